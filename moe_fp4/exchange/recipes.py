"""Wire recipes: the format of each of the four expert-parallel exchanges, by name.

| recipe           | dispatch | combine | dispatch_grad | combine_grad | who sends this                               |
| ---------------- | -------- | ------- | ------------- | ------------ | -------------------------------------------- |
| `bf16`           | bf16     | bf16    | bf16          | bf16         | the bf16 mode                                |
| `fp8-dispatch`   | fp8      | bf16    | bf16          | bf16         | the dispatch alone in FP8                    |
| `fp8`            | fp8      | bf16    | bf16          | fp8          | DeepEP-class systems; the fp8 mode's default |
| `paper`          | mxfp4    | bf16    | bf16          | bf16         | arXiv 2603.02731's recipe                    |
| `fp4`            | mxfp4    | bf16    | bf16          | mxfp4        | both GEMM-feeding streams in 4 bits          |
| `fp4-sr`         | mxfp4    | bf16    | bf16          | mxfp4-sr     | the same, stochastic rounding                |
| `fp4-fp8sums`    | mxfp4    | fp8     | fp8           | mxfp4        | summed streams in FP8; fp4's on one host     |
| `fp4-sr-fp8sums` | mxfp4    | fp8     | fp8           | mxfp4-sr     | the same, stochastic rounding                |
| `fp4-all`        | mxfp4    | mxfp4   | mxfp4-sr      | mxfp4-sr     | every exchange in 4 bits; fp4's across hosts |

The two streams that feed a GEMM (the dispatch: the experts' input; the combine's gradient: their dY) are
quantized to FP8 for that GEMM on arrival anyway, so sending them quantized costs little accuracy. The
two summed streams (the combine: a sum over a token's experts; the dispatch's gradient: a sum over its
experts' dX) feed no GEMM on arrival, and no shipped system sends them below 16 bits in training; what each
recipe costs in accuracy is in docs/DESIGN.md, section 4, "Which exchange costs accuracy".

A precision's default recipe follows the link its exchanges cross (:data:`LINK_RECIPE`, per
:class:`moe_fp4.exchange.link.Link`: fp4 sends fp4-fp8sums within one host whose GPUs reach each other
directly, fp4-all across hosts or with NCCL's peer-to-peer path off); :class:`moe_fp4.exchange.ep.EPConfig` takes a
``recipe`` name and per-role overrides, and ``moe-fp4 compare --wire`` the same (``--wire fp4-all`` or
``--wire fp4,combine=fp8``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from moe_fp4.exchange.wire import STOCHASTIC, WireFormat

ROLES = ("dispatch", "combine", "dispatch_grad", "combine_grad")
# A gradient wire chosen by the sqrt(3) rule (EPConfig.dispatch_grad / combine_grad = "auto").
AUTO = "auto"


@dataclass(frozen=True)
class WireRecipe:
    """The wire format of each exchange: dispatch and combine (values: nearest formats only),
    dispatch_grad and combine_grad (gradients: any format, the -sr ones, or "auto")."""

    dispatch: WireFormat
    combine: WireFormat
    dispatch_grad: WireFormat | str
    combine_grad: WireFormat | str

    def __post_init__(self):
        for role in ROLES:
            v = getattr(self, role)
            grad = role.endswith("_grad")
            v = AUTO if grad and v == AUTO else _format(role, v)
            if not grad and v in STOCHASTIC:
                raise ValueError(f"WireRecipe: {role}={v.value} rounds stochastically, which is for gradients "
                                 f"only; use it for {role}_grad, and {STOCHASTIC[v].value} for {role}")
            object.__setattr__(self, role, v)

    def as_dict(self) -> dict[str, str]:
        """-> {role: format name}, in the order of ROLES."""
        return {f.name: getattr(getattr(self, f.name), "value", getattr(self, f.name)) for f in fields(self)}

    def with_(self, **roles) -> "WireRecipe":
        """This recipe with the given roles replaced (None: kept)."""
        return WireRecipe(**{r: roles[r] if roles.get(r) is not None else getattr(self, r) for r in ROLES})


def _format(role: str, v) -> WireFormat:
    try:
        return WireFormat(v)
    except ValueError:
        raise ValueError(f"WireRecipe: {role}={v!r} is not a wire format; one of "
                         f"{', '.join(f.value for f in WireFormat)}") from None


def _r(d, c, dg, cg) -> WireRecipe:
    return WireRecipe(d, c, dg, cg)


RECIPES: dict[str, WireRecipe] = {
    "bf16": _r("bf16", "bf16", "bf16", "bf16"),
    "fp8-dispatch": _r("fp8", "bf16", "bf16", "bf16"),
    "fp8": _r("fp8", "bf16", "bf16", "fp8"),
    "paper": _r("mxfp4", "bf16", "bf16", "bf16"),
    "fp4": _r("mxfp4", "bf16", "bf16", "mxfp4"),
    "fp4-sr": _r("mxfp4", "bf16", "bf16", "mxfp4-sr"),
    "fp4-fp8sums": _r("mxfp4", "fp8", "fp8", "mxfp4"),
    "fp4-sr-fp8sums": _r("mxfp4", "fp8", "fp8", "mxfp4-sr"),
    "fp4-all": _r("mxfp4", "mxfp4", "mxfp4-sr", "mxfp4-sr"),
}

# Each layer precision's default recipe on each kind of link (keys: moe_fp4.exchange.link.Link values, then
# moe_fp4.model.experts.Precision values). fp4's is the fastest recipe on each link among the MXFP4 recipes, which
# train alike: where bytes pay (a network, or NCCL through host memory) the most compressed, fp4-all; within a
# peer-to-peer host, where the conversions cost about what the bytes save, fp4-fp8sums: it sends fewer bytes than
# fp4-sr, and its nearest-rounded combine gradient costs less to make than fp4-sr's stochastic one (docs/DESIGN.md,
# section 4, "fp4's default follows the link").
LINK_RECIPE = {
    "peer": {"bf16": "bf16", "fp8": "fp8", "fp4": "fp4-fp8sums"},
    "network": {"bf16": "bf16", "fp8": "fp8", "fp4": "fp4-all"},
}
# Without a link to follow (no expert parallelism, a simulated wire without EPConfig.link): the peer defaults.
PRECISION_RECIPE = LINK_RECIPE["peer"]


def recipe(name: str) -> WireRecipe:
    """A recipe by name -> WireRecipe; ValueError naming the known ones."""
    if name not in RECIPES:
        raise ValueError(f"unknown wire recipe {name!r}; one of {', '.join(RECIPES)}")
    return RECIPES[name]


def default_recipe_name(precision, link=None) -> str:
    """The name of the recipe a layer of ``precision`` ("bf16" | "fp8" | "fp4") sends when nothing is set, on
    ``link`` (a :class:`moe_fp4.exchange.link.Link` or its value; None: the peer defaults)."""
    key = getattr(precision, "value", precision)
    lk = "peer" if link is None else getattr(link, "value", link)
    if lk not in LINK_RECIPE:
        raise ValueError(f"no default wire recipes for link {link!r}; one of {', '.join(LINK_RECIPE)}")
    if key not in LINK_RECIPE[lk]:
        raise ValueError(f"no default wire recipe for precision {precision!r}; one of {', '.join(PRECISION_RECIPE)}")
    return LINK_RECIPE[lk][key]


def default_recipe(precision, link=None) -> WireRecipe:
    """The recipe a layer of ``precision`` ("bf16" | "fp8" | "fp4") sends when nothing is set, on ``link``
    (None: the peer defaults)."""
    return RECIPES[default_recipe_name(precision, link)]


def follows_link(precision) -> bool:
    """Whether ``precision``'s default recipe differs between links (fp4's does)."""
    key = getattr(precision, "value", precision)
    return len({defaults.get(key) for defaults in LINK_RECIPE.values()}) > 1


__all__ = ["LINK_RECIPE", "PRECISION_RECIPE", "RECIPES", "ROLES", "WireRecipe", "default_recipe", "default_recipe_name",
           "follows_link", "recipe"]
