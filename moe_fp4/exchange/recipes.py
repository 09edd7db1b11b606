"""Wire recipes: the format of each of the four expert-parallel exchanges, by name.

| recipe           | dispatch | combine | dispatch_grad | combine_grad | who sends this                                |
| ---------------- | -------- | ------- | ------------- | ------------ | --------------------------------------------- |
| `bf16`           | bf16     | bf16    | bf16          | bf16         | the bf16 mode                                 |
| `fp8-dispatch`   | fp8      | bf16    | bf16          | bf16         | the fp8 mode until 2026-11-28                 |
| `fp8`            | fp8      | bf16    | bf16          | fp8          | DeepEP-class systems; the fp8 mode's default  |
| `paper`          | mxfp4    | bf16    | bf16          | bf16         | arXiv 2603.02731; fp4's until 2026-11-28      |
| `fp4`            | mxfp4    | bf16    | bf16          | mxfp4        | both GEMM-feeding streams in 4 bits           |
| `fp4-sr`         | mxfp4    | bf16    | bf16          | mxfp4-sr     | the same, stochastic rounding; fp4's default  |
| `fp4-fp8sums`    | mxfp4    | fp8     | fp8           | mxfp4        | the summed streams in FP8 1x128               |
| `fp4-sr-fp8sums` | mxfp4    | fp8     | fp8           | mxfp4-sr     | the same, stochastic rounding                 |
| `fp4-all`        | mxfp4    | mxfp4   | mxfp4-sr      | mxfp4-sr     | every exchange in 4 bits: the most compressed |

The two streams that feed a GEMM (the dispatch: the experts' input; the combine's gradient: their dY) are
quantized to FP8 for that GEMM on arrival anyway, so sending them quantized costs little accuracy. The
two summed streams (the combine: a sum over a token's experts; the dispatch's gradient: a sum over its
experts' dX) feed no GEMM on arrival; no shipped system sends them below 16 bits in training
(``shared/lowprec-ep-survey.md``), and bench/RESULTS.md holds our convergence runs of each recipe.

A precision's default recipe is :data:`PRECISION_RECIPE`; :class:`moe_fp4.exchange.ep.EPConfig` takes a
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

# Each layer precision's default recipe (keys are moe_fp4.model.experts.Precision values).
# fp4's: the convergence matrices of 2026-11-28 (bench/RESULTS.md). Over nine seeds of the small preset fp4-sr is
# within issue 47's 0.5% of fp8 on the held-out and the training loss (+0.46%, +0.48%, paired by seed); the more
# compressed recipes (fp4-fp8sums, fp4-all) have three seeds, which read as fp4-sr's own first three did. At
# dsv3-layers (1 seed each) a nearest-rounded combine gradient (fp4, fp4-fp8sums) read +1.1% where fp4-sr read
# -0.1%, and fp4-sr-fp8sums +0.45% (training +1.45%). fp4-fp8sums is faster on both links (EP 2).
PRECISION_RECIPE = {"bf16": "bf16", "fp8": "fp8", "fp4": "fp4-sr"}


def recipe(name: str) -> WireRecipe:
    """A recipe by name -> WireRecipe; ValueError naming the known ones."""
    if name not in RECIPES:
        raise ValueError(f"unknown wire recipe {name!r}; one of {', '.join(RECIPES)}")
    return RECIPES[name]


def default_recipe(precision) -> WireRecipe:
    """The recipe a layer of ``precision`` ("bf16" | "fp8" | "fp4") sends when nothing is set."""
    key = getattr(precision, "value", precision)
    if key not in PRECISION_RECIPE:
        raise ValueError(f"no default wire recipe for precision {precision!r}; one of {', '.join(PRECISION_RECIPE)}")
    return RECIPES[PRECISION_RECIPE[key]]


__all__ = ["PRECISION_RECIPE", "RECIPES", "ROLES", "WireRecipe", "default_recipe", "recipe"]
