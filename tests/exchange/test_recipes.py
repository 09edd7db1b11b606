"""Wire recipes (moe_fp4.exchange.recipes): names, validation, each precision's default, and how EPConfig
and ``--wire`` resolve a recipe with per-role overrides. What crosses the wire under each recipe, and
its bytes, is checked on gloo in test_ep.py (test_ep_recipes_send_their_formats_and_count_their_bytes)."""

import pytest

from moe_fp4.compare.cli import parse_wire
from moe_fp4.exchange.ep import AUTO, EPConfig
from moe_fp4.exchange.recipes import PRECISION_RECIPE, RECIPES, ROLES, WireRecipe, default_recipe, recipe
from moe_fp4.exchange.wire import STOCHASTIC, WireFormat, row_bytes

# The table of moe_fp4/exchange/recipes.py, spelled out: a change to a recipe must change this too.
TABLE = {
    "bf16": ("bf16", "bf16", "bf16", "bf16"),
    "fp8-dispatch": ("fp8", "bf16", "bf16", "bf16"),
    "fp8": ("fp8", "bf16", "bf16", "fp8"),
    "paper": ("mxfp4", "bf16", "bf16", "bf16"),
    "fp4": ("mxfp4", "bf16", "bf16", "mxfp4"),
    "fp4-sr": ("mxfp4", "bf16", "bf16", "mxfp4-sr"),
    "fp4-fp8sums": ("mxfp4", "fp8", "fp8", "mxfp4"),
    "fp4-sr-fp8sums": ("mxfp4", "fp8", "fp8", "mxfp4-sr"),
    "fp4-all": ("mxfp4", "mxfp4", "mxfp4-sr", "mxfp4-sr"),
}


def test_recipes_are_the_documented_table():
    assert {n: tuple(r.as_dict().values()) for n, r in RECIPES.items()} == TABLE
    assert ROLES == ("dispatch", "combine", "dispatch_grad", "combine_grad")
    for r in RECIPES.values():
        for role in ROLES:
            assert isinstance(getattr(r, role), WireFormat)
        # Values travel in nearest formats only; stochastic rounding is for gradients.
        assert r.dispatch not in STOCHASTIC and r.combine not in STOCHASTIC


def test_each_precision_has_its_recipe_and_fp8_sends_both_gemm_streams_in_fp8():
    assert set(PRECISION_RECIPE) == {"bf16", "fp8", "fp4"}
    assert default_recipe("bf16") is RECIPES["bf16"]
    # The strongest FP8 baseline: the dispatch and the combine's gradient (the two streams that feed GEMMs).
    assert default_recipe("fp8").as_dict() == {"dispatch": "fp8", "combine": "bf16", "dispatch_grad": "bf16",
                                               "combine_grad": "fp8"}
    # fp4's without a link to follow (the peer link's): both GEMM-feeding streams in MXFP4, the summed streams in
    # FP8 (the fastest within one host of the MXFP4 recipes, which train alike; per link: test_link.py).
    assert default_recipe("fp4") is RECIPES["fp4-fp8sums"]
    with pytest.raises(ValueError, match="no default wire recipe for precision 'int8'"):
        default_recipe("int8")


def test_most_compressed_recipe_sends_fewest_bytes():
    h = 7168

    def per_token(r):
        return sum(row_bytes(getattr(r, role), h) for role in ROLES)

    sizes = {n: per_token(r) for n, r in RECIPES.items()}
    assert min(sizes, key=sizes.get) == "fp4-all"
    # Per token and exchange at hidden 7168: fp8 sends 7392 + 14336 + 14336 + 7392 bytes, fp4-all 4 x 3808.
    assert sizes["fp8"] == 43456 and sizes["fp4-all"] == 4 * 3808
    assert sizes["fp8-dispatch"] > sizes["fp8"] > sizes["fp4"] > sizes["fp4-fp8sums"] > sizes["fp4-all"]


def test_recipe_validation():
    with pytest.raises(ValueError, match="unknown wire recipe 'fp2'; one of bf16, fp8-dispatch"):
        recipe("fp2")
    with pytest.raises(ValueError, match="combine=mxfp4-sr rounds stochastically"):
        WireRecipe("mxfp4", "mxfp4-sr", "bf16", "bf16")
    with pytest.raises(ValueError, match="dispatch_grad='int4' is not a wire format"):
        WireRecipe("mxfp4", "bf16", "int4", "bf16")
    assert WireRecipe("fp8", "bf16", "auto", "bf16").dispatch_grad == AUTO
    with pytest.raises(ValueError, match="dispatch='auto' is not a wire format"):
        WireRecipe("auto", "bf16", "bf16", "bf16")


def test_epconfig_resolves_the_recipe_then_its_overrides():
    # Nothing set: each precision's own recipe.
    ep = EPConfig(simulate=True)
    for precision in ("bf16", "fp8", "fp4"):
        assert ep.wire(precision) == default_recipe(precision)
    # A recipe applies to every precision; a role set beside it overrides that role only.
    ep = EPConfig(simulate=True, recipe="fp4-all", combine="bf16")
    for precision in ("bf16", "fp8", "fp4"):
        assert ep.wire(precision).as_dict() == {"dispatch": "mxfp4", "combine": "bf16", "dispatch_grad": "mxfp4-sr",
                                                "combine_grad": "mxfp4-sr"}
    # A role alone overrides each precision's own recipe.
    ep = EPConfig(simulate=True, combine_grad="nvfp4-sr")
    assert ep.wire("fp8").dispatch is WireFormat.FP8 and ep.wire("fp4").dispatch is WireFormat.MXFP4
    assert {ep.wire(p).combine_grad for p in ("bf16", "fp8", "fp4")} == {WireFormat.NVFP4_SR}
    with pytest.raises(ValueError, match="unknown wire recipe 'fp4-al'"):
        EPConfig(recipe="fp4-al")
    with pytest.raises(ValueError, match="dispatch=mxfp4-sr rounds stochastically"):
        EPConfig(recipe="fp8", dispatch="mxfp4-sr")


def test_recipe_per_precision():
    ep = EPConfig(simulate=True, recipe={"fp4": "fp4-all", "fp8": "fp8-dispatch"}, combine_grad="fp8")
    assert ep.recipe == (("fp4", "fp4-all"), ("fp8", "fp8-dispatch")) and ep in {ep}   # hashable: a frozen config
    assert ep.wire("fp4").as_dict() == {"dispatch": "mxfp4", "combine": "mxfp4", "dispatch_grad": "mxfp4-sr",
                                        "combine_grad": "fp8"}
    assert ep.wire("fp8").as_dict() == {"dispatch": "fp8", "combine": "bf16", "dispatch_grad": "bf16",
                                        "combine_grad": "fp8"}
    assert ep.wire("bf16").as_dict() == {"dispatch": "bf16", "combine": "bf16", "dispatch_grad": "bf16",
                                         "combine_grad": "fp8"}
    with pytest.raises(ValueError, match="EPConfig.recipe: 'fp16' is not a precision"):
        EPConfig(recipe={"fp16": "fp8"})
    with pytest.raises(ValueError, match="unknown wire recipe 'fp9'"):
        EPConfig(recipe={"fp8": "fp9"})
    assert parse_wire("fp8:fp8-dispatch,fp4:fp4-all") == {"recipe": {"fp8": "fp8-dispatch", "fp4": "fp4-all"}}
    assert parse_wire("paper,fp4:fp4-all,combine=fp8") == {
        "recipe": {"bf16": "paper", "fp8": "paper", "fp4": "fp4-all"}, "combine": "fp8"}
    with pytest.raises(ValueError, match="'fp16:fp8' is not MODE:RECIPE"):
        parse_wire("fp16:fp8")
    with pytest.raises(ValueError, match="two recipes for fp4"):
        parse_wire("fp4:fp4,fp4:paper")


def test_parse_wire_takes_one_recipe_then_overrides():
    assert parse_wire("") == {}
    assert parse_wire("fp4-all") == {"recipe": "fp4-all"}
    assert parse_wire("fp8, combine=fp8 ,combine_grad=auto") == {"recipe": "fp8", "combine": "fp8",
                                                                 "combine_grad": "auto"}
    assert EPConfig(**parse_wire("fp4,combine=fp8"), simulate=True).wire("fp8").as_dict() == \
        {"dispatch": "mxfp4", "combine": "fp8", "dispatch_grad": "bf16", "combine_grad": "mxfp4"}
    with pytest.raises(ValueError, match="'fp5' is neither a recipe"):
        parse_wire("fp5")
    with pytest.raises(ValueError, match=r"two recipes \(fp8, fp4\)"):
        parse_wire("fp8,fp4")
    with pytest.raises(ValueError, match="combine=mxfp4-sr rounds stochastically"):
        parse_wire("fp4,combine=mxfp4-sr")
