"""The expert-parallel MoE layer's configuration: :class:`EPConfig`, the group and the format of each exchange
(a named recipe, per-role overrides, fp4's default following the link, the sqrt(3) rule's settings), resolved
once per precision. The exchanges themselves are in :mod:`moe_fp4.exchange.ep`, which re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from moe_fp4.exchange.a2a import check_value_formats, resolve_group
from moe_fp4.exchange.grad_rule import GradWireRule
from moe_fp4.exchange.link import Link, detect_link
from moe_fp4.exchange.recipes import AUTO, PRECISION_RECIPE, ROLES, WireRecipe, default_recipe, recipe
from moe_fp4.exchange.wire import DISPATCH_FORMATS, UNQUANTIZED, WireFormat
from moe_fp4.formats.choices import not_one_of


@dataclass(frozen=True)
class EPConfig:
    """Expert parallelism for the MoE layer.

    group: the EP process group (None: the default group); its size must divide the expert count.
    recipe: a named wire recipe (:data:`moe_fp4.exchange.recipes.RECIPES`: "fp8", "fp4", "fp4-all", ...)
    for every layer precision, or a dict {precision: name} for some ({"fp4": "fp4-all"}); a precision
    without one takes its default on the group's link (:data:`moe_fp4.exchange.recipes.LINK_RECIPE`: bf16 ->
    "bf16", fp8 -> "fp8", fp4 -> "fp4-fp8sums" within one peer-to-peer host, "fp4-all" across hosts or with
    NCCL's peer-to-peer path off). The four role fields below, when set, override the recipe's for every precision.
    link: the :class:`~moe_fp4.exchange.link.Link` the default recipes follow ("peer" | "network"); None
    (default): detected over the group when a layer first needs it (:meth:`wire_link`), or "peer" with
    ``simulate``.
    combine: wire format of the combine (expert outputs back to their tokens): bf16, fp8, mxfp4, nvfp4
    or native.
    dispatch_grad: wire format of the dispatch's gradient (backward, to the tokens' ranks); those of
    combine, or mxfp4-sr / nvfp4-sr (stochastic rounding, unbiased: for gradients only).
    combine_grad: wire format of the combine's gradient (backward, to the experts' ranks); as
    dispatch_grad. Either gradient may be ``"auto"``: the sqrt(3) rule (:class:`GradWireRule`) sends it
    in ``auto_format`` while its norm stays at least sqrt(3) times its quantization noise's (for the
    combine's gradient of the MoE layer: the norm of the experts' FC2 weight gradient against the noise
    the payload puts into it; otherwise the payload's own), and in ``auto_fallback``
    (default the next format up: a 4-bit format -> fp8 -> bf16) from the optimizer step after
    ``auto_patience`` consecutive steps below; each MoE layer keeps its own rule per gradient, and
    :func:`moe_fp4.model.moe.end_grad_wire_step` (once per optimizer step, after the backward passes and
    before the gradients are clipped or zeroed) closes the step's measurement.
    simulate: no exchange: with one process (no group needed), the MoE layer keeps every expert and
    applies each exchange's round trip where EP would send it (the dispatch on the expert input, its
    experts taking the received rows as EP's receiver does, :func:`simulate_dispatch_rows`; its
    gradient in dispatch_grad; the combine on the layer's routed output, its gradient in combine_grad):
    the wire's numerics on one GPU or on CPU. The dispatch rows and the combine gradient are
    those EP sends; the combine and dispatch-gradient rows are sums over all of a token's experts, where
    EP sends one partial sum per rank. Under ``torch.no_grad()`` (evaluation) no round trip is applied:
    a held-out loss is the model's own, the same for every recipe.
    dispatch: wire format of the dispatch (the expert input): mxfp4, fp8, nvfp4, bf16 or native (nvfp4
    rows become FP8 1x128 on arrival, each with its sender's tensor scale).
    """

    group: object = None
    combine: WireFormat | None = None
    dispatch_grad: WireFormat | str | None = None
    combine_grad: WireFormat | str | None = None
    simulate: bool = False
    # New fields go last: a positional EPConfig(...) of an earlier release keeps its meaning.
    dispatch: WireFormat | None = None
    auto_format: WireFormat = WireFormat.NVFP4_SR
    auto_patience: int = 10
    recipe: str | dict | None = None
    auto_fallback: WireFormat | None = None
    link: Link | str | None = None

    def __post_init__(self):
        if self.link is not None:
            try:
                object.__setattr__(self, "link", Link(self.link))
            except ValueError:
                raise ValueError(f"EPConfig.link: one of {', '.join(k.value for k in Link)} (or None: detected), "
                                 f"got {self.link!r}") from None
        if isinstance(self.recipe, dict):
            # Kept as sorted (precision, name) pairs: the config stays hashable.
            bad = [p for p in self.recipe if p not in PRECISION_RECIPE]
            if bad:
                raise ValueError(f"EPConfig.recipe: {bad[0]!r} is not a precision; one of "
                                 f"{', '.join(PRECISION_RECIPE)}")
            object.__setattr__(self, "recipe", tuple(sorted((str(p), n) for p, n in self.recipe.items())))
        for name in ([self.recipe] if isinstance(self.recipe, str) else [n for _, n in self.recipe or ()]):
            recipe(name)                              # an unknown name fails here, naming the known ones
        if self.combine is not None:
            object.__setattr__(self, "combine", WireFormat.of(self.combine, "EPConfig.combine"))
            check_value_formats("EPConfig", combine=self.combine)
        if self.dispatch is not None:
            object.__setattr__(self, "dispatch", WireFormat.of(self.dispatch, "EPConfig.dispatch"))
            check_value_formats("EPConfig", dispatch=self.dispatch)
        for name in ("dispatch_grad", "combine_grad"):
            v = getattr(self, name)
            if v is not None:
                try:
                    fmt = AUTO if v == AUTO else WireFormat(v)
                except ValueError:   # a gradient may also follow the rule
                    choices = [*(f.value for f in WireFormat), AUTO]
                    raise ValueError(not_one_of(f"EPConfig.{name}", v, choices)) from None
                object.__setattr__(self, name, fmt)
        object.__setattr__(self, "auto_format", WireFormat.of(self.auto_format, "EPConfig.auto_format"))
        if self.auto_format in UNQUANTIZED:
            raise ValueError(f"EPConfig.auto_format: the sqrt(3) rule starts from a quantized format, "
                             f"got {self.auto_format.value}")
        if self.auto_fallback is not None:
            object.__setattr__(self, "auto_fallback", WireFormat.of(self.auto_fallback, "EPConfig.auto_fallback"))
        if isinstance(self.auto_patience, bool) or not isinstance(self.auto_patience, int) or self.auto_patience < 1:
            raise ValueError(f"EPConfig.auto_patience: expected an int >= 1, got {self.auto_patience!r}")
        # Each precision's formats on each link, resolved once: the layer reads them every forward.
        given = {} if isinstance(self.recipe, str) else dict(self.recipe or ())
        wires = {}
        for link in Link:
            for precision in PRECISION_RECIPE:
                name = self.recipe if isinstance(self.recipe, str) else given.get(precision)
                base = recipe(name) if name is not None else default_recipe(precision, link)
                wires[link, precision] = w = base.with_(**{r: getattr(self, r) for r in ROLES})
                if w.dispatch not in DISPATCH_FORMATS:
                    raise ValueError(f"EPConfig.dispatch: one of {', '.join(f.value for f in DISPATCH_FORMATS)}, "
                                     f"got {w.dispatch.value}")
        object.__setattr__(self, "_wires", wires)
        # The precisions whose formats differ between links: only these need the link (a collective to detect).
        object.__setattr__(self, "_follows", {p: wires[Link.PEER, p] != wires[Link.NETWORK, p]
                                              for p in PRECISION_RECIPE})

    def wire(self, precision) -> WireRecipe:
        """The formats a layer of ``precision`` ("bf16" | "fp8" | "fp4") sends: the recipe (or the
        precision's default recipe on :meth:`wire_link`), with the roles set here in its place. Where the
        precision's formats differ between links and ``link`` is None, the first call detects the link (a
        collective over the group; see :meth:`wire_link`)."""
        key = getattr(precision, "value", precision)
        if key not in PRECISION_RECIPE:
            raise ValueError(f"EPConfig.wire: no precision {precision!r}; one of {', '.join(PRECISION_RECIPE)}")
        if self._follows[key]:
            return self._wires[self.wire_link(), key]
        return self._wires[Link.PEER, key]

    def follows_link(self, precision) -> bool:
        """Whether the formats of ``precision`` depend on the link (its default recipe does, and no recipe or
        role set here pins them)."""
        key = getattr(precision, "value", precision)
        if key not in PRECISION_RECIPE:
            raise ValueError(f"EPConfig.follows_link: no precision {precision!r}; one of {', '.join(PRECISION_RECIPE)}")
        return self._follows[key]

    def wire_link(self) -> Link:
        """The link the default recipes follow: ``link`` when set; Link.PEER with ``simulate`` (nothing
        crosses a link; give ``link="network"`` to simulate the network's defaults); otherwise
        :func:`~moe_fp4.exchange.link.detect_link` over the group, once. That is a collective: every rank of
        the group must reach its first call together (the MoE layer's first forward does)."""
        if self.link is not None:
            return self.link
        if self.simulate:
            return Link.PEER
        detected = self.__dict__.get("_detected_link")
        if detected is None:
            detected = detect_link(self.group)
            object.__setattr__(self, "_detected_link", detected)
        return detected

    def grad_rules(self) -> dict[str, "GradWireRule"]:
        """A fresh :class:`GradWireRule` for each gradient set to "auto" (one set per MoE layer)."""
        return {n: GradWireRule(self.auto_format, self.auto_patience, self.auto_fallback)
                for n in ("dispatch_grad", "combine_grad") if getattr(self, n) == AUTO}

    @property
    def process_group(self):
        return resolve_group(self.group)


__all__ = ["EPConfig"]
