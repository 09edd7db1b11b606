"""``moe_fp4.model.moe.MoE``: a DeepSeek-V3-style routed MoE block with bf16 / fp8 / fp4 precision modes.

Router (top-k over softmax or sigmoid scores, in float32) -> dropless permutation of the (token,
expert) pairs by expert, each expert's group padded to 128 rows -> grouped SwiGLU experts
(:mod:`moe_fp4.model.experts`: FP8 GEMMs in fp8/fp4, MXFP4 saved activations in fp4, the router weights
applied to the SwiGLU output) -> unweighted combine (nothing saved for backward) -> plus an optional shared
expert (the same grouped MLP with one expert over all tokens). The router, the permutation and the combine
are identical in every precision.

Recomputation (:class:`Recompute`, ``MoE(recompute=...)``, :func:`checkpoint` for any region that holds
MoE layers): what a forward keeps for backward can be traded for compute, from the SwiGLU output alone
to the whole block or decoder layer. A recomputed forward never repeats what cannot or should not run
twice: the routing's host sync and, under expert parallelism, the count exchange, the dispatch and the
combine; their results are recorded in the first run and returned in the recomputation, so the received
rows stay in their wire format (MXFP4 in fp4) and backward sends nothing a second time.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
from torch import nn

from moe_fp4.exchange.ep import EPConfig, GradSlot, GradWireRule, combine, dispatch, plan_dispatch
from moe_fp4.exchange.recipes import WireRecipe, default_recipe
from moe_fp4.exchange.simulate import simulate_dispatch_rows, simulate_exchange
from moe_fp4.exchange.wire import WireFormat
from moe_fp4.formats.choices import Choice
from moe_fp4.gemm.engines import FP8_WEIGHTS, WEIGHT_BLOCK, FP8WeightTensor, gathered_fp8, in_graph_region
from moe_fp4.model.experts import (
    TOKEN_ALIGN,
    Precision,
    gather_expert_tokens,
    grouped_swiglu_experts,
    prefetch_fp8_weights,
    quantize_expert_tokens,
)
from moe_fp4.model.replay import _Replay, checkpoint, once  # noqa: F401 - _Replay: moved, importable here
from moe_fp4.model.routing import Routing, host_counts_here, make_routing, permute, row_weights, unpermute
from moe_fp4.saved.hook import StorageFormat

# The dispatch's wire format in each precision: its default recipe's (moe_fp4.exchange.recipes).
DISPATCH_FORMAT = {p: default_recipe(p).dispatch for p in Precision}
# EP: a quantized combine gradient reaches the experts as it arrived (GradSlot); False: decoded to bf16 first.
FUSE_COMBINE_GRAD = True


class ScoreFunction(str, enum.Enum):
    SOFTMAX = "softmax"  # Mixtral / DeepSeek-V2
    SIGMOID = "sigmoid"  # DeepSeek-V3


class Recompute(Choice):
    """What a forward keeps for backward, and what backward recomputes instead (each numerically
    identical to NONE in the same precision: the recomputation runs the same kernels on the same
    inputs).

    NONE: keep everything. SWIGLU: the experts keep the SwiGLU input, not its output (bf16, fp8; fp4
    keeps its MXFP4 output, see ``grouped_swiglu_experts``). MOE: the MoE block keeps its input (and,
    under expert parallelism, the received rows and the combined output) and recomputes router, experts
    and shared expert. DENSE: everything but the MoE blocks is recomputed: each decoder layer's attention
    sub-block and the dense layers' MLP keep their inputs only, while the MoE blocks keep what NONE keeps
    (in fp4 that is MXFP4, so fp4 recomputes only what it cannot compress; the bf16 attention and dense MLP
    hold most of a layer's activations at DeepSeek-V3 shapes under expert parallelism). LAYER: the decoder
    layer (attention + MoE) keeps its input only. DENSE and LAYER are a decoder's to apply
    (:class:`moe_fp4.model.decoder.DecoderLM`), or wrap your own sub-blocks in :func:`checkpoint`.

    In order of recomputation cost, which the planner relies on: MOE recomputes the experts' FP8 GEMMs,
    DENSE the bf16 attention and dense MLP (at DeepSeek-V3 shapes more FLOPs, at half FP8's rate), LAYER both."""

    __parameter__ = "recompute"

    NONE = "none"
    SWIGLU = "swiglu"
    MOE = "moe"
    DENSE = "dense"
    LAYER = "layer"


def _host_counts(choice: bool | None, x: torch.Tensor) -> bool:
    """MoE.host_counts -> whether the routing reads its counts on the host: None does so in eager mode only
    (torch.compile and CUDA-graph capture cannot wait for the host)."""
    return bool(choice) if choice is not None else host_counts_here(x)


def same_policy(precision, policy) -> Recompute | None:
    """The cheaper policy that keeps exactly what ``policy`` keeps in ``precision`` ("bf16" | "fp8" | "fp4"),
    or None where none does: fp4 keeps its SwiGLU output in MXFP4 whatever the policy (recomputing it from the
    MXFP4 SwiGLU input would change the FC2 weight gradient, experts.py), so its SWIGLU is its NONE. A planner
    need not measure such a policy (each probe builds and steps a fresh model)."""
    if Precision(precision) is Precision.FP4 and Recompute(policy) is Recompute.SWIGLU:
        return Recompute.NONE
    return None


@dataclass(frozen=True)
class MoEConfig:
    """hidden H, ffn F (per expert), num_experts E, top_k; H and F multiples of 128 (FP8 tiles and
    128x128 weight blocks). shared_ffn > 0 adds a shared expert of that width."""

    hidden: int
    ffn: int
    num_experts: int
    top_k: int
    shared_ffn: int = 0
    score: ScoreFunction = ScoreFunction.SOFTMAX
    norm_topk_prob: bool = True

    def __post_init__(self):
        object.__setattr__(self, "score", ScoreFunction(self.score))
        for name in ("hidden", "ffn"):
            v = getattr(self, name)
            if v <= 0 or v % WEIGHT_BLOCK:
                raise ValueError(f"MoEConfig: {name} = {v} must be a positive multiple of {WEIGHT_BLOCK}")
        if self.shared_ffn < 0 or self.shared_ffn % WEIGHT_BLOCK:
            raise ValueError(f"MoEConfig: shared_ffn = {self.shared_ffn} must be 0 or a multiple of {WEIGHT_BLOCK}")
        if self.num_experts <= 0 or not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"MoEConfig: need 0 < top_k <= num_experts, got top_k={self.top_k}, "
                             f"num_experts={self.num_experts}")


class _Recorded:
    """The combine's output in a checkpointed region: the first run returns the tensor itself (on the
    graph), a recomputation a detached alias of it (the same values; nothing downstream trains through it)."""

    def __init__(self, y: torch.Tensor):
        self.y, self.first = y, True

    def take(self) -> torch.Tensor:
        if self.first:
            self.first = False
            y, self.y = self.y, self.y.detach()   # drop the stash's reference to the graph
            return y
        return self.y


class MoE(nn.Module):
    """Routed MoE block. forward: x bf16 [..., H] -> bf16 [..., H].

    Parameters (dtype ``dtype``, the master copies; the FP8 paths quantize them on each forward):
    router.weight [E, H], w13 [E_local, 2F, H] (gate | up), w2 [E_local, H, F], and with a shared
    expert shared_w13 [1, 2Fs, H], shared_w2 [1, H, Fs]. ``precision`` ("bf16" | "fp8" | "fp4") may
    be changed on a built module, as may ``storage`` ("mxfp4" | "nvfp4"), the format fp4 keeps its
    activations in.

    ``ep``: an :class:`~moe_fp4.exchange.ep.EPConfig` for expert parallelism. The group's ranks hold
    E_local = E / world experts each (rank r: experts r*E_local ... (r+1)*E_local - 1); tokens go
    to their experts' ranks and back through :mod:`moe_fp4.exchange.ep` (MXFP4 dispatch in fp4, FP8 in fp8,
    bf16 in bf16). The router and the shared expert are replicated and run on local tokens; reduce
    their gradients over the data-parallel replicas as usual. Without ``ep``, E_local = E; with
    ``EPConfig(simulate=True)`` too, and each exchange's wire round trip is applied where EP would send
    it (no process group).

    :meth:`pin_fp8_weights` holds the expert weights' FP8 copies as buffers of the layer, which a compiled or
    CUDA-graph-captured forward reads instead of quantizing the weights in its graph every step.
    """

    _PINNED = ("w13", "w2", "shared_w13", "shared_w2")

    def __init__(self, config: MoEConfig, precision: str | Precision = "fp8", dtype=torch.bfloat16,
                 device=None, ep: EPConfig | None = None, recompute: str | Recompute = "none",
                 storage: str | StorageFormat = "mxfp4"):
        super().__init__()
        self.config = config
        self.precision = precision
        self.recompute = recompute
        self.storage = storage
        self.ep = ep
        self._while_routing = None   # forward's GPU work queued during the routing's sync (route())
        # The single-rank routing's counts: None reads them on the host (one sync a layer, buffers sized
        # exactly) in eager mode and keeps them on the device under torch.compile and CUDA-graph capture (no
        # sync; the experts' buffers take the static bound of rows, routing.rows_bound); True / False always.
        self.host_counts: bool | None = None
        # The sqrt(3) rule of each gradient exchange set to "auto" (EPConfig.grad_rules): this layer's own.
        self.grad_rules: dict[str, GradWireRule] = {} if ep is None else ep.grad_rules()
        c, kw = config, {"dtype": dtype, "device": device}
        world = 1
        if ep is not None and not ep.simulate:
            world = torch.distributed.get_world_size(ep.process_group)
            if c.num_experts % world:
                raise ValueError(f"MoE: {c.num_experts} experts do not divide over an EP group of {world} ranks")
        self.num_local_experts = c.num_experts // world
        self.router = nn.Linear(c.hidden, c.num_experts, bias=False, **kw)
        self.w13 = nn.Parameter(torch.empty(self.num_local_experts, 2 * c.ffn, c.hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(self.num_local_experts, c.hidden, c.ffn, **kw))
        if c.shared_ffn:
            self.shared_w13 = nn.Parameter(torch.empty(1, 2 * c.shared_ffn, c.hidden, **kw))
            self.shared_w2 = nn.Parameter(torch.empty(1, c.hidden, c.shared_ffn, **kw))
        else:
            self.shared_w13 = self.shared_w2 = None
        self.reset_parameters()
        self._pinned = False
        self.register_load_state_dict_post_hook(MoE._repin_after_load)

    def pin_fp8_weights(self) -> "MoE":
        """fp8 / fp4: hold W, the FP8 copy (128x128 blocks, 1 byte a parameter) of each expert weight (routed
        and shared), pinned (:meth:`moe_fp4.gemm.engines.FP8WeightCache.pin`: one storage each for the weight's
        life, refreshed in place) and registered as non-persistent buffers ``fp8_<name>`` / ``fp8_<name>_scale``,
        which forward passes to the experts. Under torch.compile the graph takes them as inputs (static ones
        for CUDA graphs) instead of quantizing W every step. -> self.

        Call it outside the compiled region, once the layer is on its device and in its dtype (again after a
        ``.to()``). The copies follow the weights after every torch.optim step (AdamWFP8Weights' fused step
        writes them in place), after ``load_state_dict``, and at every forward outside torch.compile that finds a
        weight changed.
        A compiled forward cannot check: a weight written any other way (``w.data.copy_``, a custom update) must
        be followed by ``pin_fp8_weights()`` before the next compiled forward, or that forward reads the old W.
        Not under FSDP2, whose DTensor parameters change their local tensors under the module: there
        :func:`moe_fp4.model.fsdp.fp8_all_gather` gathers the FP8 codes instead. A copy of the layer (``deepcopy``)
        is pinned again by its first forward outside torch.compile, or by calling this."""
        self._pinned = self.precision is not Precision.BF16
        if self._pinned:
            self._sync_pinned()
        return self

    def _sync_pinned(self, names=_PINNED) -> None:
        """The pinned copies of ``names`` refreshed where a weight changed, and (re)registered where the buffers
        are not the cache's tensors (the first pin, or a weight moved or cast)."""
        for name in names:
            w = getattr(self, name)
            if w is None:
                continue
            q = FP8_WEIGHTS.pin(w)
            if getattr(self, f"fp8_{name}", None) is not q.data:
                self.register_buffer(f"fp8_{name}", q.data, persistent=False)
                self.register_buffer(f"fp8_{name}_scale", q.scale, persistent=False)

    @staticmethod
    def _repin_after_load(module: "MoE", _incompatible) -> None:
        if getattr(module, "_pinned", False):
            module._sync_pinned()

    def _fp8_weights(self, w13: str, w2: str):
        """-> ((W13, None), (W2, None)) from the pinned buffers, for grouped_swiglu_experts' fp8_weights (its
        backward transposes W), or None when not pinned (the experts then use the process's cache, or under
        torch.compile or CUDA-graph capture quantize in the graph)."""
        if not getattr(self, "_pinned", False) or self.precision is Precision.BF16 \
                or gathered_fp8(self.w13) is not None:
            return None   # not pinned, or FSDP2 gathered the weights in FP8 (the experts read those codes)
        if not in_graph_region(self.w13):   # a compiled or captured graph reads the buffers as they are
            self._sync_pinned((w13, w2))
        return tuple((FP8WeightTensor(getattr(self, f"fp8_{n}"), getattr(self, f"fp8_{n}_scale")), None)
                     for n in (w13, w2))

    @property
    def precision(self) -> Precision:
        return self._precision

    @precision.setter
    def precision(self, value) -> None:
        self._precision = Precision(value)

    @property
    def wire(self) -> WireRecipe:
        """The format of each exchange: EPConfig.wire(precision), or the precision's default recipe."""
        return default_recipe(self.precision) if self.ep is None else self.ep.wire(self.precision)

    @property
    def dispatch_format(self) -> WireFormat:
        """The dispatch's wire format (``wire.dispatch``)."""
        return self.wire.dispatch

    @property
    def storage(self) -> StorageFormat:
        """fp4's activation storage, "mxfp4" or "nvfp4" (``grouped_swiglu_experts``' storage); may be changed."""
        return self._storage

    @storage.setter
    def storage(self, value) -> None:
        self._storage = StorageFormat(value)

    @property
    def recompute(self) -> Recompute:
        return self._recompute

    @recompute.setter
    def recompute(self, value) -> None:
        value = Recompute(value)
        if value in (Recompute.DENSE, Recompute.LAYER):
            raise ValueError(f"MoE: recompute='{value.value}' recomputes parts of the decoder layer outside the MoE "
                             f"block, which the layer must do: use moe_fp4.model.decoder.DecoderLM(recompute="
                             f"'{value.value}') or wrap those parts in moe_fp4.model.moe.checkpoint")
        self._recompute = value

    def reset_parameters(self) -> None:
        h = self.config.hidden
        nn.init.normal_(self.router.weight, std=h ** -0.5)
        for w13, w2 in ((self.w13, self.w2), (self.shared_w13, self.shared_w2)):
            if w13 is not None:
                nn.init.normal_(w13, std=h ** -0.5)
                nn.init.normal_(w2, std=w2.shape[-1] ** -0.5)

    def gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [T, H] -> (weights float32 [T, k], experts int64 [T, k]): top-k of the scores; with
        norm_topk_prob the k weights sum to 1."""
        c = self.config
        scores = torch.nn.functional.linear(x, self.router.weight.to(x.dtype)).float()
        scores = scores.softmax(-1) if c.score is ScoreFunction.SOFTMAX else scores.sigmoid()
        weights, experts = scores.topk(c.top_k, dim=-1)
        if c.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, experts

    def route(self, x: torch.Tensor) -> Routing:
        """x: [T, H] -> Routing of the (token, expert) pairs: one host sync for the counts where ``host_counts``
        asks for it (eager mode by default), device counts otherwise. Inside forward, the GPU work that needs no
        routing is queued during that sync (``make_routing``'s ``while_waiting``); a subclass may override this
        method with the same signature."""
        return make_routing(*self.gate(x), self.config.num_experts,
                            while_waiting=getattr(self, "_while_routing", None),
                            host_counts=_host_counts(getattr(self, "host_counts", None), x))

    def _prefetch_fp8_weights(self, fc1: bool = True, fc2: bool = True) -> None:
        """fp8 / fp4: the FP8 pairs of the FC1 (w13) and / or FC2 (w2) weights, routed and shared, made now
        (:func:`moe_fp4.model.experts.prefetch_fp8_weights`), where the GPU would otherwise wait for the host."""
        if self.precision is not Precision.BF16 and not getattr(self, "_pinned", False):
            prefetch_fp8_weights(*((self.w13, self.shared_w13) if fc1 else ()),
                                 *((self.w2, self.shared_w2) if fc2 else ()))

    def _routed_ep(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            raise RuntimeError(
                "MoE: the expert-parallel exchange (EPConfig without simulate) runs eagerly only: its dispatch "
                "plan reads the counts on the host and its exchanges call c10d's collective. Keep the layer out "
                "of the compiled region (torch.compiler.disable on it, compiling the rest without fullgraph), "
                "compile it with EPConfig(simulate=True) or without EP, or use torchtitan's converter "
                "(moe_fp4.integrations.torchtitan), whose blocks compile under expert parallelism")
        weights, experts = self.gate(x)
        ep = self.ep
        # once(): inside a checkpoint the recomputation reuses these (no second exchange; the received
        # rows stay as they arrived, MXFP4 in fp4). The combine's output is kept detached: downstream
        # ops of a recomputation may read it, its gradient flows through the first run's graph.
        plan = once(lambda: plan_dispatch(experts, self.config.num_experts, ep.process_group,
                                          while_waiting=self._prefetch_fp8_weights))
        rules, wire = self.grad_rules, self.wire
        sent = once(lambda: dispatch(x, weights, experts, plan, wire.dispatch, wire.dispatch_grad,
                                     rule=rules.get("dispatch_grad")))
        slot = GradSlot() if FUSE_COMBINE_GRAD else None    # y goes to the combine alone
        y = grouped_swiglu_experts(sent.x, self.w13, self.w2, plan.padded_counts, self.precision, x_q=sent.x_q,
                                   row_weights=sent.row_weights(), recompute_swiglu=self._swiglu_recompute,
                                   storage=self.storage, grad_slot=slot, fp8_weights=self._fp8_weights("w13", "w2"))
        out = once(lambda: _Recorded(combine(y, sent, plan, wire.combine, wire.combine_grad,
                                             rule=rules.get("combine_grad"), slot=slot)))
        return out.take()

    @property
    def _swiglu_recompute(self) -> bool:
        return self.recompute is Recompute.SWIGLU

    def _shared(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        rows = -(-t // TOKEN_ALIGN) * TOKEN_ALIGN
        xp = torch.nn.functional.pad(x, (0, 0, 0, rows - t))
        return grouped_swiglu_experts(xp, self.shared_w13, self.shared_w2, (rows,), self.precision,
                                      recompute_swiglu=self._swiglu_recompute, storage=self.storage,
                                      fp8_weights=self._fp8_weights("shared_w13", "shared_w2"))[:t]

    def _route_prefetching(self, x2: torch.Tensor, while_waiting=None) -> Routing:
        """x2: [T, H] -> :meth:`route`'s Routing, with the GPU work that needs no routing queued where the
        GPU would wait for the host: the FC1 weights before the router (the host then issues the router's
        small kernels while the GPU quantizes), the FC2 weights and ``while_waiting()`` (when given) during
        the routing's count read (the host then takes the counts and builds the row maps while the GPU
        quantizes)."""
        if torch.compiler.is_compiling():
            # Compiled: the counts stay on the device (no wait to fill), the weights are quantized in the graph,
            # and no attribute of the module is set (a side effect a compiled checkpoint refuses).
            routing = self.route(x2)
            if while_waiting is not None:
                while_waiting()
            return routing
        self._prefetch_fp8_weights(fc2=False)

        def during_count_read():
            self._prefetch_fp8_weights(fc1=False)
            if while_waiting is not None:
                while_waiting()

        self._while_routing = during_count_read
        try:
            return self.route(x2)
        finally:
            self._while_routing = None

    def _routed_local(self, x2: torch.Tensor) -> torch.Tensor:
        """x2: bf16 [T, H] -> bf16 [T, H], the routed experts' output with every expert on this rank."""
        staged = {}
        routing = self._route_prefetching(
            x2, lambda: staged.update(tokens=quantize_expert_tokens(x2, self.precision, self.storage)))
        # The experts' quantized input made per token and gathered to their rows (bit for bit what they
        # would make of the gathered bf16 rows); fp4's MXFP4 copy stays per token, with the rows' token
        # indices. A checkpoint's recomputation, which replays the routing without waiting, quantizes here.
        tokens = staged["tokens"] if "tokens" in staged else quantize_expert_tokens(x2, self.precision, self.storage)
        x_q, x_saved, x_saved_rows = (None, None, None) if tokens is None else gather_expert_tokens(
            tokens, routing.src_row)
        y_perm = grouped_swiglu_experts(permute(x2, routing, values=x_q is None), self.w13, self.w2,
                                        routing.padded_counts, self.precision, x_q=x_q,
                                        row_weights=row_weights(routing), recompute_swiglu=self._swiglu_recompute,
                                        storage=self.storage, x_saved=x_saved, x_saved_rows=x_saved_rows,
                                        fp8_weights=self._fp8_weights("w13", "w2"))
        return unpermute(y_perm, routing)

    def _routed_simulated(self, x2: torch.Tensor, sim: WireRecipe) -> torch.Tensor:
        """x2: bf16 [T, H] -> bf16 [T, H], the routed experts' output with every expert on this rank and each
        exchange's round trip in ``sim``'s formats applied where EP would send it (``EPConfig.simulate``)."""
        routing = self._route_prefetching(x2)
        # The router reads the local rows; the experts, the dispatched ones. A quantized dispatch reaches
        # the experts as EP's receiver builds it (x_q); xd then only carries the gradient, whose round trip
        # simulate_exchange applies (its forward then sends native rows, a view: the values would not be read).
        x_q = simulate_dispatch_rows(x2, self.dispatch_format, routing.src_row)
        fmt = self.dispatch_format if x_q is None else WireFormat.NATIVE
        xd = simulate_exchange(x2, fmt, sim.dispatch_grad, self.grad_rules.get("dispatch_grad"))
        # The combine gradient's sqrt(3) rule tells the experts its rows' rounding errors (EP's GradSlot).
        c_rule = self.grad_rules.get("combine_grad")
        slot = GradSlot() if c_rule is not None else None
        y_perm = grouped_swiglu_experts(permute(xd, routing, values=x_q is None), self.w13, self.w2,
                                        routing.padded_counts, self.precision, x_q=x_q,
                                        row_weights=row_weights(routing), recompute_swiglu=self._swiglu_recompute,
                                        storage=self.storage, grad_slot=slot,
                                        fp8_weights=self._fp8_weights("w13", "w2"))
        y = unpermute(y_perm, routing)
        return simulate_exchange(y, sim.combine, sim.combine_grad, c_rule, slot,
                                 None if slot is None else routing.src_row)

    def _forward_rows(self, x2: torch.Tensor) -> torch.Tensor:
        if self.ep is not None and not self.ep.simulate:
            y = self._routed_ep(x2)
        elif self.ep is not None and torch.is_grad_enabled():
            # EPConfig.simulate applies the wire's round trips in training only (under no_grad, e.g. an
            # eval, none: a held-out loss is the model's own).
            y = self._routed_simulated(x2, self.wire)
        else:
            y = self._routed_local(x2)
        if self.shared_w13 is not None:
            y = y + self._shared(x2)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        if x.shape[-1] != c.hidden:
            raise ValueError(f"MoE: expected [..., {c.hidden}], got {tuple(x.shape)}")
        if x.dtype != torch.bfloat16:
            raise TypeError(f"MoE: expected a bfloat16 input, got {x.dtype}")
        x2 = x.reshape(-1, c.hidden)
        if self.recompute is Recompute.MOE and torch.is_grad_enabled() and torch.compiler.is_compiling() and \
                (self.ep is None or self.ep.simulate):
            # Compiled without EP nothing must not run twice (no host sync, no exchange): torch's own
            # checkpoint, which the compiler traces, recomputes the same ops.
            y = torch.utils.checkpoint.checkpoint(self._forward_rows, x2, use_reentrant=False)
        elif self.recompute is Recompute.MOE and torch.is_grad_enabled():
            y = checkpoint(self._forward_rows, x2)
        else:
            y = self._forward_rows(x2)
        return y.view(x.shape)

    def extra_repr(self) -> str:
        c = self.config
        ep = "" if self.ep is None else f", ep_local_experts={self.num_local_experts}"
        return (f"hidden={c.hidden}, ffn={c.ffn}, experts={c.num_experts}, top_k={c.top_k}, "
                f"shared_ffn={c.shared_ffn}, score={c.score.value}, precision={self.precision.value}{ep}"
                + ("" if self.recompute is Recompute.NONE else f", recompute={self.recompute.value}")
                + ("" if self.storage is StorageFormat.MXFP4 else f", storage={self.storage.value}"))


def end_grad_wire_step(model: nn.Module) -> dict[str, dict[str, float]]:
    """Close one optimizer step of every sqrt(3) rule in ``model``'s MoE layers (gradient wires set to
    "auto", :class:`moe_fp4.exchange.ep.GradWireRule`): call it once per optimizer step, after the step's
    backward passes and before the gradients are clipped, scaled or zeroed, on every rank of the EP group
    (it sums each rule's measurement over the group). The combine gradient's rule reads the layer's FC2
    weight gradient (``w2.grad``) for its weight ratio; where that is None (called after zero_grad) the
    step decides on the payload's ratio alone.
    -> {layer name: {gradient: this step's payload norm / noise ratio}} for the rules that measured one."""
    out: dict[str, dict[str, float]] = {}
    for name, m in model.named_modules():
        if isinstance(m, MoE) and m.grad_rules:
            group = None if m.ep.simulate else m.ep.process_group
            c_rule, g2 = m.grad_rules.get("combine_grad"), m.w2.grad
            w_sq = None
            if c_rule is not None and c_rule.weight_noise is not None and g2 is not None:
                # ||dW2||^2 accumulated in float32 by the reduction: no float32 copy of the gradient
                w_sq = torch.linalg.vector_norm(g2.detach(), dtype=torch.float32).square()
            got = {g: rule.end_step(group, w_sq if g == "combine_grad" else None)
                   for g, rule in m.grad_rules.items()}
            got = {g: r for g, r in got.items() if r is not None}
            if got:
                out[name] = got
    return out


__all__ = ["DISPATCH_FORMAT", "MoE", "MoEConfig", "Recompute", "Routing", "ScoreFunction", "checkpoint",
           "end_grad_wire_step", "make_routing", "once", "permute", "row_weights", "same_policy", "unpermute"]
