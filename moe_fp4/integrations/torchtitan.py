"""torchtitan (0.3) model converter: its MoE experts run on moe_fp4's grouped FP8 engine.

torchtitan 0.3's converters transform the model *config* before the model is built
(``ModelConfigConverter.convert(model_config) -> model_config``; there is no ``convert(model)`` or
``post_optimizer_hook`` any more). A training config names them by their ``Config`` in the
``converters`` list of a model registry, as torchtitan's own ``deepseek_v3_debugmodel_mxfp8`` does::

    model_spec = model_registry("debugmodel", converters=[GroupedExpertsConverter.Config(precision="fp4")])

(there is no registry of converter names to add to). :func:`deepseek_v3_debugmodel_fp8_experts` and
:func:`deepseek_v3_debugmodel_fp4_experts` are such training configs, so torchtitan's trainer takes
``--module moe_fp4.integrations.torchtitan --config deepseek_v3_debugmodel_fp4_experts``.

:class:`GroupedExpertsConverter` swaps every ``torchtitan.models.common.moe.GroupedExperts.Config`` for
:class:`MoEFP4GroupedExperts.Config` (a subclass: the same fields, sharding and init plans) and sets the
token-group alignment of its token dispatcher to 128 rows (``TOKEN_ALIGN``) with torchtitan's own setter,
``swap_token_dispatcher`` (what its float8 / mxfp8 grouped converters use). That setter picks torchao's
padding dispatcher, whose permute is a Triton kernel (no CPU); it is replaced by
:class:`PaddedTokenDispatcher`, the same dispatcher with a plain-torch padded permute (empty experts
get no padding rows and nothing trails the last group). Everything the engine cannot run is refused in
``convert``, before any config is changed: a GroupedExperts subclass (gpt-oss's biases and clamped
SwiGLU, torchtitan's fused-w13 override, another converter's experts), dims that are not multiples of
128, a dispatcher that cannot pad. Weights that are not bfloat16 / float32 are refused at build and at
each forward before any work.

:class:`MoEFP4GroupedExperts` keeps torchtitan's parameters as they are: ``w1_EFD`` (gate) and
``w3_EFD`` (up) [E, F, D], ``w2_EDF`` [E, D, F], so state dicts, checkpoints, the FSDP / EP / TP plans
and ``param_init`` (which name them) work unchanged. Its forward gets torchtitan's rows, already
grouped by expert and padded, and the per-expert counts (a host sync: the engine takes python ints),
and computes ``moe_fp4.model.experts.grouped_swiglu_experts`` with w13 = [w1; w3] along F. Router
scores stay torchtitan's: its dispatchers apply them in ``combine``.

Without expert parallelism the converter also makes each RoutedExperts a :class:`MoEFP4RoutedExperts`
(``route_tokens=True``, the default): the tokens then bypass torchtitan's dispatcher and padded permute and
take moe_fp4's own routing (``moe_fp4.model.routing.routed_swiglu_experts``, the path of moe_fp4's MoE layer
and of the Hugging Face experts): each token quantized once and its FP8 (fp4: and MXFP4) row gathered to its
k expert rows, the router scores applied inside the SwiGLU, the k outputs summed in float32 once. torchtitan's
path gathers and pads k bf16 copies of every token, which the experts then quantize row by row, and scales
and scatter-adds the outputs in bf16. Under EP (the dispatcher has an EP mesh) or with ``route_tokens=False``
torchtitan's own forward runs, as described above.

The FP8 weights. The engine takes each weight's FP8 copy (W in 128x128 blocks; its backward transposes the
codes for W^T) as its ``fp8_weights``, and a ``torch.cat([w1, w3])`` is a new tensor every forward. So this
module makes the copies itself, once per weight version (``FP8_PAIRS``; under torch.compile in the graph, every
forward): w13's by quantizing w1 and w3 separately and concatenating codes and scales along N (exact: with
F % 128 == 0 no 128x128 block straddles the two), w2's as is. It hands the engine the copies and, for the weights,
stand-ins: zero-stride tensors of the weights' shape and dtype (``_StandIn``). The FP8 path reads
nothing of its weights but their shape and dtype, and autograd routes the weight gradients back onto w1,
w3 and w2. A real ``torch.cat`` would also be
kept by the engine for backward: a bf16/fp32 copy of [w1; w3] per layer, held from forward to
backward. (w13 is not kept as storage with w1 / w3 as views of it: FSDP and EP re-create
parameters as DTensors of their own, which would break the aliasing.) The bf16 precision, and
``FP8_WEIGHTS.enabled = False``, get the real weights (a concatenation) instead.

A copy is rebuilt when its weight's ``_version`` or storage changes, and after *every* torch.optim
step, whichever parameters it stepped: FSDP2 all-gathers into the unsharded parameters with their
version counter preserved, and DTensor parameters bump their own version, not their local tensor's,
so neither the version nor the stepped parameter's identity tells a forward that the weights moved.
Between forward and backward (the engine keeps the copy it used) and across the micro-batches of one
step, nothing is rebuilt. Code that writes expert weights outside an optimizer without bumping their
version (through ``.data``; under FSDP2, a checkpoint load between steps) calls ``FP8_PAIRS.clear()``.
``AdamWFP8Weights`` brings nothing here: these parameters are never in ``FP8_WEIGHTS``, so they take
its plain AdamW step.

torch.compile: without EP the converted blocks compile as torchtitan compiles them (per block,
``fullgraph=True``): moe_fp4's routing keeps its counts on the device, the experts run as their op pair and
the FP8 copies are made in the graph (tests/integrations/test_torchtitan_experts.py). Under EP too, with
torchtitan's own exchange: :class:`PaddedTokenDispatcher` keeps the padded counts on the device over a bound of
rows and the experts take device counts (tests/integrations/test_torchtitan.py). Not supported yet: the
all-to-all swap under compile (it refuses), torchtitan's graph_trainer.

Tested on CPU (the engine's emulated FP8 GEMMs): DTensor weights on one gloo rank; and torchtitan's expert
parallelism over 2 gloo ranks (``parallelize_qwen3``, EP = 2, no FSDP) for each SPMD backend (``spmd_types``,
``partial_dtensor``, ``full_dtensor``), fp8 and fp4, under ``moe_fp4.swap_all_to_all`` with native wires and
with the MXFP4 dispatch (examples/torchtitan_ep_mxfp4.py ``--experts fp8 | fp4``,
tests/integrations/test_torchtitan.py). There :class:`PaddedTokenDispatcher`, an ``AllToAllTokenDispatcher``,
keeps torchtitan's exchanges, which the swap takes; the wire carries unpadded rows (the padded permute runs
after the all-to-all) and each local expert gets a multiple of 128 rows. FSDP, EP over more than 2 ranks and
HybridEP are untested.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, fields
from typing import Literal

import torch
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_post_hook
from torch.utils.weak import WeakIdKeyDictionary
from torchtitan.components.quantization import QuantizationConverter
from torchtitan.components.quantization.utils import swap_token_dispatcher
from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
from torchtitan.models.common.token_dispatcher import (
    AllToAllTokenDispatcher,
    HybridEPTokenDispatcher,
    TorchAOTokenDispatcher,
)

from moe_fp4.gemm.engines import FP8_WEIGHTS, FP8WeightTensor, gathered_fp8, in_graph_region, quantize_fp8_weight
from moe_fp4.gemm.fsdp import gather_in_fp8
from moe_fp4.model.experts import TOKEN_ALIGN, Precision, grouped_swiglu_experts
from moe_fp4.model.routing import routed_swiglu_experts
from moe_fp4.saved.hook import StorageFormat

logger = logging.getLogger(__name__)

PRECISIONS = tuple(p.value for p in Precision)
STORAGES = tuple(s.value for s in StorageFormat)
WEIGHT_DTYPES = (torch.bfloat16, torch.float32)


def _check_choices(what: str, precision, storage) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"{what}: precision must be one of {PRECISIONS}, got {precision!r}")
    if storage not in STORAGES:
        raise ValueError(f"{what}: storage must be one of {STORAGES}, got {storage!r}")


class _FP8Pairs:
    """The FP8 copies W of the converted experts' weights, per module and weight ("w13", "w2"), each kept with
    the key of the weight version it was made from; every torch.optim step drops all. Handed to the engine as
    pairs (W, None): its backward makes W^T from W's codes (1 byte of resident FP8 state a parameter)."""

    def __init__(self):
        self._entries = WeakIdKeyDictionary()   # module -> {name: (key, pair)}; dies with the module
        self.builds = 0
        self.hits = 0
        # A module-level hook on a module-level object: nothing to keep alive or release.
        self._hook = register_optimizer_step_post_hook(lambda _opt, _args, _kwargs: self.clear())

    def get(self, module: torch.nn.Module, name: str, params, weights) -> tuple[FP8WeightTensor, None]:
        """params: the module's parameters (their ``_version`` is the one in-place writes bump, DTensors
        included); weights: their local [E, N_i, K] tensors -> (W of cat(weights, dim=1), None)."""
        if any(gathered_fp8(w) is not None for w in weights):
            return concatenated_weight(weights), None   # FSDP2 gathered their FP8 codes: nothing to make or keep
        key = (tuple(p._version for p in params), tuple(w.data_ptr() for w in weights),
               tuple(tuple(w.shape) for w in weights), weights[0].dtype)
        slots = self._entries.setdefault(module, {})
        entry = slots.get(name)
        if entry is not None and entry[0] == key:
            self.hits += 1
            return entry[1], None
        slots.pop(name, None)   # the stale copy goes before the new one is made
        with torch.no_grad():
            q = concatenated_weight(weights)
        slots[name] = (key, q)
        self.builds += 1
        return q, None

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached FP8 copies now."""
        return sum(q.nbytes for slots in self._entries.values() for _, q in slots.values())

    def clear(self) -> None:
        self._entries.clear()


def concatenated_weight(weights) -> FP8WeightTensor:
    """weights: [E, N_i, K] tensors (N_i multiples of 128) -> W of cat(weights, dim=1), each weight quantized
    apart and the codes and block scales concatenated along N (no 128x128 block straddles two weights); a weight
    FSDP2 gathered in FP8 (moe_fp4.gemm.fsdp.GatheredFP8Weight) gives its own codes."""
    qs = [gathered_fp8(w) or quantize_fp8_weight(w) for w in weights]
    if len(qs) == 1:
        return qs[0]
    return FP8WeightTensor(torch.cat([q.data for q in qs], 1), torch.cat([q.scale for q in qs], 1))


# The process's FP8 copies for every converted experts module.
FP8_PAIRS = _FP8Pairs()


class _StandIn(torch.autograd.Function):
    """weights [E, N_i, K] -> a zero-stride [E, sum N_i, K] tensor of their dtype (no memory), whose
    gradient is split back onto the weights along dim 1. What the engine's FP8 path reads of a weight
    is its shape and its dtype (its FP8 copy comes as the engine's fp8_weights)."""

    @staticmethod
    def forward(ctx, *weights):
        ctx.sizes = [w.shape[1] for w in weights]
        e, _, k = weights[0].shape
        return torch.zeros((), dtype=weights[0].dtype, device=weights[0].device).expand(e, sum(ctx.sizes), k)

    @staticmethod
    def backward(ctx, grad):
        return tuple(grad.split(ctx.sizes, dim=1))


def _local(p: torch.Tensor) -> torch.Tensor:
    # As torchtitan's own forward: expert weights are local tensors inside the experts (EP's dynamic shapes).
    return p.to_local() if isinstance(p, DTensor) else p


def _check_weight_dtypes(what: str, params: dict) -> None:
    dtypes = {name: p.dtype for name, p in params.items()}
    if any(d not in WEIGHT_DTYPES for d in dtypes.values()) or len(set(dtypes.values())) != 1:
        raise ValueError(f"{what}: the expert weights must all be bfloat16 or all float32, got {dtypes}")


class MoEFP4GroupedExperts(GroupedExperts):
    """torchtitan's GroupedExperts (the same parameters, names and init) computed by moe_fp4's grouped
    SwiGLU engine in ``precision`` ("bf16" | "fp8" | "fp4"; fp4 keeps its activations in ``storage``,
    "mxfp4" | "nvfp4"). Built from the Config :class:`GroupedExpertsConverter` puts in the model config."""

    @dataclass(kw_only=True, slots=True)
    class Config(GroupedExperts.Config):
        precision: Literal["bf16", "fp8", "fp4"] = "fp8"
        storage: Literal["mxfp4", "nvfp4"] = "mxfp4"

        def __post_init__(self):
            _check_choices("MoEFP4GroupedExperts.Config", self.precision, self.storage)

    def __init__(self, config: Config):
        super().__init__(config)
        self.precision = Precision(config.precision)
        self.storage = StorageFormat(config.storage)
        # Parameters take torch's default dtype here; refuse one the engine cannot run before any work.
        _check_weight_dtypes(type(self).__name__, dict(self.named_parameters()))

    def extra_repr(self) -> str:
        return f"precision={self.precision.value}, storage={self.storage.value}"

    def engine_weights(self):
        """-> (w13 [E, 2F, D], w2 [E, D, F], fp8_weights) as the engine takes them: in fp8 and fp4 zero-stride
        stand-ins, their gradients routed back onto w1, w3 and w2, and their FP8 copies ((W13, None), (W2,
        None): W^T made in backward), once per weight version (``FP8_PAIRS``) or, under torch.compile, in the
        graph; in bf16 (or
        with ``FP8_WEIGHTS.enabled`` off) the weights themselves, w13 a concatenation, and None."""
        params = {"w1_EFD": self.w1_EFD, "w2_EDF": self.w2_EDF, "w3_EFD": self.w3_EFD}
        _check_weight_dtypes(type(self).__name__, params)
        w1, w2, w3 = (_local(p) for p in params.values())
        if self.precision is Precision.BF16 or not FP8_WEIGHTS.enabled:
            return torch.cat([w1, w3], dim=1), w2, None   # the engine reads these weights' values
        if in_graph_region(w1):   # the cache keys on storage addresses: no lookup in a graph
            pairs = (concatenated_weight((w1, w3)), None), (concatenated_weight((w2,)), None)
        else:
            pairs = (FP8_PAIRS.get(self, "w13", (self.w1_EFD, self.w3_EFD), (w1, w3)),
                     FP8_PAIRS.get(self, "w2", (self.w2_EDF,), (w2,)))
        return _StandIn.apply(w1, w3), _StandIn.apply(w2), pairs

    def forward(self, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """x_RD: [R, D] rows grouped by expert (any float dtype; computed in bf16, as torchtitan does),
        each expert's group a multiple of 128 rows, padding rows zero; R may run past the last group
        (torchao's padding dispatcher pads to a fixed length: those rows come back zero).
        num_tokens_per_expert_E: int [E_local], the groups' sizes (padding included) -> [R, D] of x_RD's dtype.
        Under torch.compile and CUDA-graph capture the counts stay on the device (nothing reads them on the host)
        and R is a bound, a multiple of 128 (:class:`PaddedTokenDispatcher` pads to one): the rows past the groups
        come back zero."""
        if in_graph_region(x_RD):
            return self._forward_device_counts(x_RD, num_tokens_per_expert_E)
        counts = [int(c) for c in num_tokens_per_expert_E.tolist()]
        rows = sum(counts)
        e_local = _local(self.w1_EFD).shape[0]
        if len(counts) != e_local or any(c % TOKEN_ALIGN for c in counts):
            raise ValueError(f"{type(self).__name__}: each of the {e_local} local experts needs a group of "
                             f"a multiple of {TOKEN_ALIGN} rows, got {counts} (convert the model config with "
                             f"GroupedExpertsConverter, which sets the token dispatcher's pad_multiple)")
        if x_RD.dim() != 2 or rows > x_RD.shape[0]:
            raise ValueError(f"{type(self).__name__}: x must be [R >= {rows}, D], got {tuple(x_RD.shape)}")
        w13, w2, pairs = self.engine_weights()
        y = grouped_swiglu_experts(x_RD[:rows].to(torch.bfloat16), w13, w2, counts, self.precision,
                                   storage=self.storage, fp8_weights=pairs)
        if rows < x_RD.shape[0]:
            y = torch.cat([y, y.new_zeros(x_RD.shape[0] - rows, y.shape[1])])
        return y.type_as(x_RD)

    def _forward_device_counts(self, x_RD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
        e_local = _local(self.w1_EFD).shape[0]
        if tuple(counts_E.shape) != (e_local,) or x_RD.dim() != 2:
            raise ValueError(f"{type(self).__name__}: x must be [R, D] and the counts [{e_local}], got "
                             f"{tuple(x_RD.shape)} and {tuple(counts_E.shape)}")
        w13, w2, pairs = self.engine_weights()
        y = grouped_swiglu_experts(x_RD.to(torch.bfloat16), w13, w2, counts_E.to(x_RD.device), self.precision,
                                   storage=self.storage, fp8_weights=pairs)
        return y.type_as(x_RD)


def fp8_all_gather(model: torch.nn.Module) -> list[str]:
    """model: a torchtitan model converted by :class:`GroupedExpertsConverter`, not yet sharded -> the names of the
    expert weights (w1, w2, w3 of every fp8 / fp4 :class:`MoEFP4GroupedExperts`) made
    :class:`moe_fp4.gemm.fsdp.FP8GatherWeight`: under FSDP2's ``fully_shard`` their all-gathers send W's FP8 codes
    and block scales, which the experts read directly, with ``Shard(0)`` over whole experts; other placements
    (torchtitan's ``Shard(1)``, used when its efsdp mesh outnumbers the experts: untested) gather in the weights'
    dtype with a warning. Call it before ``fully_shard``."""
    done = []
    for prefix, m in model.named_modules():
        if isinstance(m, MoEFP4GroupedExperts) and m.precision is not Precision.BF16:
            done += gather_in_fp8(m, ("w1_EFD", "w2_EDF", "w3_EFD"), f"{prefix}.")
    return done


class MoEFP4RoutedExperts(RoutedExperts):
    """torchtitan's RoutedExperts (dispatch, experts, combine) around :class:`MoEFP4GroupedExperts`. Without
    expert parallelism (its dispatcher has no EP mesh) and with ``route_tokens`` the tokens take moe_fp4's own
    routing, ``moe_fp4.model.routing.routed_swiglu_experts``: one FP8 (and, in fp4, MXFP4) quantization per
    token gathered to its k expert rows, where torchtitan's dispatcher gathers and pads k bf16 copies of each
    token for the experts to quantize; the router scores applied inside the experts' SwiGLU, where torchtitan
    scales the experts' outputs in combine (the same sum, as SwiGLU's output enters w2 linearly); the k
    outputs summed in float32 once (``gather_sum``), where torchtitan scatter-adds in bf16. With EP (or
    ``route_tokens=False``) torchtitan's own forward runs: its dispatcher's exchanges and padded permute."""

    @dataclass(kw_only=True, slots=True)
    class Config(RoutedExperts.Config):
        route_tokens: bool = True

    def __init__(self, config: Config):
        super().__init__(config)
        self.route_tokens = config.route_tokens

    def extra_repr(self) -> str:
        return f"route_tokens={self.route_tokens}"

    def routes_tokens(self, *tensors) -> bool:
        """Whether a forward on ``tensors`` takes moe_fp4's routing (no EP mesh, local tensors, our experts)."""
        return (self.route_tokens and isinstance(self.inner_experts, MoEFP4GroupedExperts)
                and getattr(self.token_dispatcher, "ep_mesh", None) is None
                and not any(isinstance(t, DTensor) for t in tensors))

    def forward(self, x_BLD: torch.Tensor, topk_scores_BLK: torch.Tensor, topk_expert_ids_BLK: torch.Tensor,
                num_local_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        """x_BLD: [B, L, D]; topk_scores_BLK: float [B, L, K]; topk_expert_ids_BLK: int [B, L, K];
        num_local_tokens_per_expert_E: [E] (torchtitan's path only) -> [B, L, D] of x's dtype."""
        if not self.routes_tokens(x_BLD, topk_scores_BLK, topk_expert_ids_BLK):
            return super().forward(x_BLD, topk_scores_BLK, topk_expert_ids_BLK, num_local_tokens_per_expert_E)
        b, seq_len, d = x_BLD.shape
        k = topk_scores_BLK.shape[-1]
        experts = self.inner_experts
        w13, w2, pairs = experts.engine_weights()
        out = routed_swiglu_experts(x_BLD.reshape(b * seq_len, d).to(torch.bfloat16),
                                    topk_expert_ids_BLK.reshape(-1, k),
                                    topk_scores_BLK.reshape(-1, k), w13, w2, experts.precision,
                                    storage=experts.storage, fp8_weights=pairs)
        return out.to(x_BLD.dtype).view(b, seq_len, d)


class PaddedTokenDispatcher(TorchAOTokenDispatcher):
    """torchtitan's TorchAOTokenDispatcher (EP all-to-all or local reorder, then a padded permute to
    expert-major groups of ``pad_multiple`` rows; combine strips the padding) with the permute in plain
    torch instead of torchao's Triton kernel. Groups are padded up to the multiple only: an empty expert
    gets no rows, and the output ends with the last group."""

    @dataclass(kw_only=True, slots=True)
    class Config(TorchAOTokenDispatcher.Config):
        pass

    def _permute(self, routed_input_RD: torch.Tensor, num_global_tokens_per_local_expert_E: torch.Tensor):
        """routed_input_RD: [N, D] in (rank, local expert) segments, rank-major (one rank without EP);
        num_global_tokens_per_local_expert_E: int [EP * e], the segments' sizes -> (the input's shape [N, D],
        [R, D] expert-major padded rows (padding rows zero), int64 [N] the padded row each input row went to
        (what :meth:`_unpermute` reads back), int64 [e] padded group sizes, on the CPU): the places of
        TorchAOTokenDispatcher._permute's results, whose third is only ever handed back to ``_unpermute``."""
        x = routed_input_RD
        n, dev = x.shape[0], x.device
        ep = self.ep_mesh.size() if self.ep_mesh is not None else 1
        with torch.no_grad():
            sizes = num_global_tokens_per_local_expert_E.to(torch.int64).view(ep, -1)   # [EP, e]
            padded = (sizes.sum(0) + self.pad_multiple - 1) // self.pad_multiple * self.pad_multiple
            flat = sizes.reshape(-1)
            src_start = flat.cumsum(0) - flat
            # where rank r's rows of expert j go: expert j's padded group start + the rows of ranks < r
            dst_start = ((padded.cumsum(0) - padded)[None, :] + (sizes.cumsum(0) - sizes)).reshape(-1)
            seg = torch.repeat_interleave(torch.arange(flat.numel(), device=dev), flat, output_size=n)
            dst = dst_start[seg] + torch.arange(n, device=dev) - src_start[seg]
            if in_graph_region(x):
                # Nothing read on the host: the groups fit in a bound of n rows and e paddings, rounded up to
                # 128 rows, and the counts stay on the device (the experts take device counts).
                total = (n + padded.numel() * (self.pad_multiple - 1) + TOKEN_ALIGN - 1) // TOKEN_ALIGN * TOKEN_ALIGN
                return (n, x.shape[1]), _ScatterRows.apply(x, dst, total), dst, padded
            # The layer's one host sync: the experts take these counts as python ints, so they get them on
            # the host (a CPU tensor) and read them there without a second sync.
            padded = padded.cpu()
        return (n, x.shape[1]), _ScatterRows.apply(x, dst, int(padded.sum())), dst, padded

    def _unpermute(self, routed_output_RD: torch.Tensor, input_shape, dst: torch.Tensor) -> torch.Tensor:
        """routed_output_RD: [R, D] expert-major padded rows; dst: int64 [N] from :meth:`_permute` -> [N, D]
        in the order the permute received them (padding rows dropped). A gather, where torchtitan's
        unpermute writes every padded row into a buffer with a sentinel row (an index_put of R rows)."""
        return routed_output_RD.index_select(0, dst)


class _ScatterRows(torch.autograd.Function):
    """x [N, D], dst int64 [N] (distinct rows of [0, total)) -> [total, D], row dst[i] = x[i], the rest zero.
    One scatter forward and a gather (``index_select``) backward, where indexing a copy of x with a
    sentinel row would copy x twice forward and scatter-add (a sort and atomics) backward."""

    @staticmethod
    def forward(ctx, x, dst, total):
        ctx.save_for_backward(dst)
        return x.new_zeros(total, x.shape[1]).index_copy_(0, dst, x)

    @staticmethod
    def backward(ctx, grad):
        (dst,) = ctx.saved_tensors
        return grad.index_select(0, dst), None, None


class GroupedExpertsConverter(QuantizationConverter):
    """Model-config converter: every torchtitan GroupedExperts becomes :class:`MoEFP4GroupedExperts` in
    ``precision`` ("fp8": DeepSeek-V3's FP8 recipe; "fp4": the same GEMMs with activations saved in
    ``storage``, MXFP4 or NVFP4; "bf16": the engine's bf16 path, for checks), and its token dispatcher
    pads each expert's group to 128 rows. Name it in a training config's ``converters`` list (module
    docstring). Refuses, naming the reason, what the engine cannot run (ValueError, before any change)."""

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        # torchtitan's Configurable requires a mutable slots dataclass (a frozen one cannot inherit from
        # it), so the fields are checked here and again when the converter is built.
        precision: Literal["bf16", "fp8", "fp4"] = "fp8"
        """moe_fp4 precision of the expert GEMMs and saved activations."""
        storage: Literal["mxfp4", "nvfp4"] = "mxfp4"
        """fp4's saved-activation format (ignored by bf16 and fp8)."""
        route_tokens: bool = True
        """Without expert parallelism, route the tokens with moe_fp4 (quantized once per token; see
        MoEFP4RoutedExperts) instead of torchtitan's dispatcher and padded permute."""

        def __post_init__(self):
            _check_choices("GroupedExpertsConverter.Config", self.precision, self.storage)

    def __init__(self, config: Config):
        _check_choices("GroupedExpertsConverter", config.precision, config.storage)
        self.config = config
        if config.model_compile_enabled:
            logger.warning("GroupedExpertsConverter: the converted experts read their group sizes on the host "
                           "and keep their FP8 weights in a python-side cache: torch.compile breaks its graph "
                           "around them")

    def convert(self, model_config):
        found = list(model_config.traverse(GroupedExperts.Config))
        for fqn, cfg, parent, _ in found:   # every refusal before any change
            _check_experts(fqn or "<root>", cfg, parent)
        if not found:
            logger.warning("GroupedExpertsConverter: the model config has no GroupedExperts; nothing converted")
        for _, cfg, parent, attr in found:
            _align_dispatcher(parent)
            new = MoEFP4GroupedExperts.Config(**{f.name: getattr(cfg, f.name) for f in fields(cfg)},
                                              precision=self.config.precision, storage=self.config.storage)
            setattr(parent, attr, new)
        for _, cfg, parent, attr in list(model_config.traverse(RoutedExperts.Config)):
            if type(cfg) is RoutedExperts.Config and isinstance(cfg.inner_experts, MoEFP4GroupedExperts.Config):
                setattr(parent, attr, MoEFP4RoutedExperts.Config(**{f.name: getattr(cfg, f.name) for f in fields(cfg)},
                                                                 route_tokens=self.config.route_tokens))
        logger.info(f"GroupedExpertsConverter: {len(found)} GroupedExperts now run moe_fp4 "
                    f"{self.config.precision}, token groups aligned to {TOKEN_ALIGN}")
        return model_config


def _check_experts(fqn: str, cfg, parent) -> None:
    """ValueError naming what the engine cannot run in this GroupedExperts config, else nothing."""
    if type(cfg) is not GroupedExperts.Config:
        owner = getattr(type(cfg), "_owner", None)
        name = getattr(owner, "__name__", type(cfg).__qualname__)
        if isinstance(cfg, MoEFP4GroupedExperts.Config):
            raise ValueError(f"GroupedExpertsConverter: {fqn} is converted already ({name})")
        raise ValueError(f"GroupedExpertsConverter: {fqn} is {name}, a GroupedExperts subclass with its own "
                         f"forward or parameters (gpt-oss: biases and a clamped SwiGLU; another converter's "
                         f"quantized experts; fused w13): moe_fp4 runs torchtitan's own GroupedExperts, "
                         f"SwiGLU (silu(x w1^T) * x w3^T) w2^T without biases, only")
    for what, n in (("model (hidden) dim", cfg.dim), ("expert ffn (hidden_dim)", cfg.hidden_dim)):
        if n % TOKEN_ALIGN:
            raise ValueError(f"GroupedExpertsConverter: {fqn}: {what} = {n} is not a multiple of "
                             f"{TOKEN_ALIGN} (the FP8 weights are quantized in 128x128 blocks)")
    if not isinstance(parent, RoutedExperts.Config):
        raise ValueError(f"GroupedExpertsConverter: {fqn} is not the inner_experts of a RoutedExperts config, "
                         f"so its token dispatcher cannot be aligned to {TOKEN_ALIGN} rows")
    dispatcher = parent.token_dispatcher
    if not isinstance(dispatcher, (AllToAllTokenDispatcher.Config, HybridEPTokenDispatcher.Config)):
        raise ValueError(f"GroupedExpertsConverter: {fqn}: the token dispatcher {type(dispatcher).__qualname__} "
                         f"cannot pad expert groups (torchtitan pads with the standard all-to-all or HybridEP)")


def _align_dispatcher(routed) -> None:
    """Align routed.token_dispatcher's groups to TOKEN_ALIGN rows, with torchtitan's setter; its torchao
    dispatcher becomes PaddedTokenDispatcher (the same, with a plain-torch padded permute)."""
    d = routed.token_dispatcher
    if isinstance(d, TorchAOTokenDispatcher.Config):   # padded already (another alignment): keep both
        pad = math.lcm(d.pad_multiple, TOKEN_ALIGN)
    else:
        swap_token_dispatcher(routed, TOKEN_ALIGN)
        d, pad = routed.token_dispatcher, TOKEN_ALIGN
    if isinstance(d, TorchAOTokenDispatcher.Config):
        routed.token_dispatcher = PaddedTokenDispatcher.Config(num_experts=d.num_experts, top_k=d.top_k,
                                                               pad_multiple=pad)


def _debugmodel_with_experts(precision: str):
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = deepseek_v3_debugmodel()
    config.model_spec = model_registry("debugmodel", converters=[GroupedExpertsConverter.Config(precision=precision)])
    return config


def deepseek_v3_debugmodel_fp8_experts():
    """torchtitan's ``deepseek_v3_debugmodel`` training config with its experts in moe_fp4's fp8 precision."""
    return _debugmodel_with_experts("fp8")


def deepseek_v3_debugmodel_fp4_experts():
    """torchtitan's ``deepseek_v3_debugmodel`` training config with its experts in moe_fp4's fp4 precision."""
    return _debugmodel_with_experts("fp4")


__all__ = ["FP8_PAIRS", "GroupedExpertsConverter", "fp8_all_gather", "MoEFP4GroupedExperts", "MoEFP4RoutedExperts",
           "PaddedTokenDispatcher", "deepseek_v3_debugmodel_fp4_experts", "deepseek_v3_debugmodel_fp8_experts"]
