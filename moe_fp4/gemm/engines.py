"""FP8 blockwise GEMMs for the expert MLPs (DeepSeek-V3 recipe: E4M3, power-of-two scales).

Operands:
- activations: :class:`~moe_fp4.formats.containers.FP8BlockTensor` [M, K], 1x128 tiles along K (the contraction);
- weights: :class:`FP8WeightTensor` [N, K] in 128x128 blocks. A 128x128 block grid is the same for W
  and W^T, so one quantization serves fprop (x W^T) and dgrad (dy W) (``.t()`` transposes the codes);
- weight gradients contract over tokens: both operands are FP8BlockTensors quantized in 1x128 tiles
  *along tokens* (``quantize_fp8_colwise``, ``fp8_to_fp8_colwise``, ``mxfp4_to_fp8_colwise``).

:func:`fp8_mm_nt` computes ``a @ b^T`` with ``torch.nn.functional.scaled_mm`` on sm90+ GPUs. Elsewhere
(CPU, older GPUs) it emulates the FP8 GEMM: both operands are dequantized exactly to float32 and
multiplied in float32, so every code path runs in CI with the same quantized values.

The expert layer uses the grouped forms, all experts in one call: :func:`grouped_fp8_mm_nt` (fprop,
dgrad) and :func:`grouped_fp8_mm_wgrad` (weight gradients), on the Gluon engine of
``kernels/gluon_grouped_gemm.py`` (Hopper), the Triton kernels of ``kernels/grouped_gemm.py`` (sm90+),
one cuBLAS ``scaled_mm`` per expert, or the float32 emulation (:func:`grouped_gemm_backend` chooses). With
device counts the grouped GEMMs go through the ops ``moe_fp4::grouped_mm_nt`` / ``grouped_mm_wgrad`` (one node
each for torch.compile, the engine chosen when they run).

One idea at over 500 lines, kept whole: the FP8 GEMMs' entry points with their engine choice, their ops and the
FP8 weight copies they read, which share one weight format and one set of checks.
"""

from __future__ import annotations

import contextlib
import enum
import os
import weakref
from dataclasses import dataclass

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

from moe_fp4.formats import kernel_ops
from moe_fp4.formats.containers import HIGH_PRECISION_DTYPES, FP8BlockTensor, MXFP4Tensor, _fail
from moe_fp4.formats.conversions import _check_out_dtype
from moe_fp4.kernels import adamw as adamw_kernels
from moe_fp4.kernels import fp8 as fp8_kernels
from moe_fp4.kernels import gluon_grouped_gemm as gluon_kernels
from moe_fp4.kernels import grouped_gemm as grouped_kernels
from moe_fp4.kernels.fp8 import WEIGHT_BLOCK
from moe_fp4.kernels.numerics import FP8_TILE


class GemmBackend(enum.Enum):
    GLUON = "gluon"          # grouped only: the persistent warp-specialized Gluon engine (sm90; fprop, dgrad
                             # and the weight gradients)
    TRITON = "triton"        # grouped only: moe_fp4's Triton kernels, one launch for all experts (sm90+)
    SCALED_MM = "scaled_mm"  # cuBLAS blockwise FP8 through torch.nn.functional.scaled_mm (sm90+), per expert
    EMULATED = "emulated"    # exact dequantization to float32, float32 matmul


def gemm_backend(device: torch.device) -> GemmBackend:
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return GemmBackend.SCALED_MM
    return GemmBackend.EMULATED


@dataclass(frozen=True)
class FP8WeightTensor:
    """Weights quantized to FP8 E4M3 in 128x128 blocks with power-of-two scales.

    data:  float8_e4m3fn [N, K] or [E, N, K] (one matrix per expert), contiguous.
    scale: float32 [ceil(N/128), ceil(K/128)] or [E, ...], contiguous (row-major): 2^S per block.
           This is the layout ``scaled_mm`` takes for ``BlockWise128x128`` (passed as ``scale.t()``
           alongside ``data.t()``).
    """

    data: torch.Tensor
    scale: torch.Tensor

    def __post_init__(self):
        d, s = self.data, self.scale
        if d.dtype != torch.float8_e4m3fn or s.dtype != torch.float32:
            _fail(TypeError, f"FP8WeightTensor: need float8_e4m3fn data and float32 scale, got {d.dtype}, {s.dtype}")
        if d.dim() not in (2, 3) or s.dim() != d.dim():
            _fail(ValueError, f"FP8WeightTensor: data [N, K] or [E, N, K] with a scale of the same rank, "
                              f"got {tuple(d.shape)} and {tuple(s.shape)}")
        blocks = (*d.shape[:-2], -(-d.shape[-2] // WEIGHT_BLOCK), -(-d.shape[-1] // WEIGHT_BLOCK))
        if tuple(s.shape) != blocks:
            _fail(ValueError, f"FP8WeightTensor: scale shape {tuple(s.shape)} must be {blocks}")
        if not d.is_contiguous() or not s.is_contiguous():
            _fail(ValueError, "FP8WeightTensor: data and scale must be contiguous")
        if d.device != s.device:
            _fail(ValueError, f"FP8WeightTensor: data on {d.device} but scale on {s.device}")

    @property
    def nbytes(self) -> int:
        return self.data.numel() + 4 * self.scale.numel()

    def __getitem__(self, e: int) -> "FP8WeightTensor":
        """Expert e of an [E, N, K] stack -> FP8WeightTensor [N, K] (views)."""
        if self.data.dim() != 3:
            raise TypeError("FP8WeightTensor: only an [E, N, K] stack can be indexed by expert")
        return FP8WeightTensor(self.data[e], self.scale[e])

    def t(self) -> "FP8WeightTensor":
        """-> FP8WeightTensor [K, N] of W^T (a copy of the codes; the block scales transpose exactly): the dgrad
        operand the experts make in backward. The codes go through the 128x128 tile transpose kernel on CUDA
        (or under TRITON_INTERPRET=1), its pure-torch twin elsewhere; bit-identical."""
        from moe_fp4.formats.conversions import _use_triton

        n, k = self.data.shape[-2:]
        scale_t = self.scale.transpose(-1, -2).contiguous()
        if n % WEIGHT_BLOCK or k % WEIGHT_BLOCK or not self.data.is_contiguous():
            return FP8WeightTensor(self.data.transpose(-1, -2).contiguous(), scale_t)
        q3 = self.data.reshape(-1, n, k)
        kernel = kernel_ops.kernel(fp8_kernels, "transpose_fp8_weight_128x128", _use_triton(q3))
        return FP8WeightTensor(kernel(q3).reshape(*self.data.shape[:-2], k, n), scale_t)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """-> dtype tensor of data's shape: data * scale of its block (exact in float32)."""
        n, k = self.data.shape[-2:]
        s = self.scale.repeat_interleave(WEIGHT_BLOCK, dim=-2)[..., :n, :]
        s = s.repeat_interleave(WEIGHT_BLOCK, dim=-1)[..., :k]
        return (self.data.float() * s).to(dtype)


def _quantize_weight(w: torch.Tensor, write_q: bool, write_t: bool, fn: str):
    """-> (data, data^T, scale) of quantize_fp8_weight_128x128 for w [N, K] / [E, N, K], after the checks."""
    from moe_fp4.formats.conversions import _use_triton

    if not isinstance(w, torch.Tensor) or w.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(f"{fn}: expected a bf16/fp16/fp32 tensor, got {getattr(w, 'dtype', type(w))}")
    if w.dim() not in (2, 3):
        raise ValueError(f"{fn}: expected [N, K] or [E, N, K], got {tuple(w.shape)}")
    n, k = w.shape[-2:]
    if n % WEIGHT_BLOCK or k % WEIGHT_BLOCK:
        raise ValueError(f"{fn}: N = {n} and K = {k} must be multiples of {WEIGHT_BLOCK}")
    w3 = w.detach().reshape(-1, n, k).contiguous()
    kernel = kernel_ops.kernel(fp8_kernels, "quantize_fp8_weight_128x128", _use_triton(w3))
    return kernel(w3, write_q=write_q, write_t=write_t)


def quantize_fp8_weight(w: torch.Tensor, transposed: bool = False) -> FP8WeightTensor:
    """w: bf16/fp16/fp32 [N, K] or [E, N, K] (N, K multiples of 128) -> FP8WeightTensor in 128x128 blocks
    of W, or with ``transposed=True`` of W^T ([K, N] / [E, K, N]: the dgrad operand, the same codes
    and scales transposed, without quantizing W first).

    Per block: S = clamp(ceil(log2(amax / 448)), -126, 127) over finite values (the rule of the 1x128
    activation tiles), codes = E4M3 RNE of w / 2^S. One Triton pass on CUDA (or under
    TRITON_INTERPRET=1), the pure-torch twin elsewhere; bit-identical.
    """
    q, qt, scale = _quantize_weight(w, not transposed, transposed, "quantize_fp8_weight")
    if transposed:
        return _stacked(qt, scale.transpose(1, 2).contiguous(), w.shape[:-2])
    return _stacked(q, scale, w.shape[:-2])


def quantize_fp8_weight_pair(w: torch.Tensor) -> tuple[FP8WeightTensor, FP8WeightTensor]:
    """w: bf16/fp16/fp32 [N, K] or [E, N, K] -> (W, W^T) as FP8WeightTensors, from ONE pass over w: the
    fprop and the dgrad operand. Equal to (quantize_fp8_weight(w), quantize_fp8_weight(w, True)): a
    128x128 block's scale is the same for W and W^T, so the transposed scales are exact."""
    q, qt, scale = _quantize_weight(w, True, True, "quantize_fp8_weight_pair")
    return _pair(q, qt, scale, w.shape[:-2])


def _pair(q: torch.Tensor, qt: torch.Tensor, scale: torch.Tensor, lead) -> tuple[FP8WeightTensor, FP8WeightTensor]:
    """A weight kernel's W codes, W^T codes and block scales -> (W, W^T) as FP8WeightTensors with the
    weight's leading dimensions ``lead`` (W^T's scales are W's transposed: 128x128 blocks)."""
    return _stacked(q, scale, lead), _stacked(qt, scale.transpose(1, 2).contiguous(), lead)


def _stacked(data: torch.Tensor, scale: torch.Tensor, lead) -> FP8WeightTensor:
    """The quantizer's [E', N, K] codes and [E', N/128, K/128] scales -> FP8WeightTensor with the weight's
    own leading dimensions ``lead`` (none for a single [N, K] matrix)."""
    return FP8WeightTensor(data.reshape(*lead, *data.shape[1:]), scale.reshape(*lead, *scale.shape[1:]))


def gathered_fp8(w: torch.Tensor) -> FP8WeightTensor | None:
    """w's own W (codes and scales) when w is an expert weight FSDP2 gathered in FP8 (moe_fp4.gemm.fsdp.
    GatheredFP8Weight, which holds nothing else), else None."""
    return w.fp8_weight if hasattr(type(w), "fp8_weight") else None


def in_graph_region(t: torch.Tensor) -> bool:
    """Whether work on ``t`` is being recorded rather than run: under torch.compile or CUDA-graph capture. There
    nothing may wait for the host, and nothing may be cached across calls by storage address (a compiled graph
    and a replayed CUDA graph read their inputs as they are at run time; a tensor made during capture lives in
    the graph's memory pool)."""
    return torch.compiler.is_compiling() or (t.is_cuda and torch.cuda.is_current_stream_capturing())


class FP8WeightCache:
    """FP8 copies of weights, made once per weight version: W of :func:`quantize_fp8_weight` (128x128 blocks)
    per weight tensor, reused until the weight changes.

    A weight changes when an optimizer (or anything) writes it in place, which bumps its ``_version``,
    or when its storage moves; either makes the next :meth:`weight` quantize again and drop the old copy. So
    with gradient accumulation the weights are quantized once per optimizer step, not per micro-batch. The
    cache holds weights weakly (an entry dies with its weight) and costs, per weight, one FP8 copy and its
    scales: 1 byte a parameter (``nbytes``). The dgrad operand W^T is not kept: with 128x128 blocks its codes
    are W's transposed under the same scales (:meth:`FP8WeightTensor.t`, bit for bit what quantizing W^T
    gives), so the experts make it in backward, per layer, and free it after their GEMMs.

    In-place ops on the parameter and ``load_state_dict`` bump ``_version``; torch.optim's for-loop and
    foreach optimizers do too, but the fused ones (``AdamW(fused=True)``: ``torch._fused_adamw_``) do
    not, and neither does a write through ``w.data``. Nor is the tensor a forward reads always the one an
    optimizer steps: FSDP2 steps the sharded DTensor parameters and all-gathers them into the unsharded
    tensors the modules read with their version counters preserved. So every torch.optim step drops the
    entries of the parameters it stepped, and every entry when it steps a DTensor (a global optimizer step
    post-hook, registered with the cache): the next forward quantizes again, once per weight per step,
    whatever the optimizer and however the weights are sharded. Code that writes
    weights any other way (``w.data.copy_(...)``, its own fused kernels) must call :meth:`clear` after it,
    or set ``enabled = False``.

    A *pinned* copy (:meth:`pin`) keeps one storage for the weight's life: every refresh writes the new codes and
    scales into the same two tensors, so a compiled graph or a CUDA graph that takes them as inputs reads the
    current W without a lookup. A pinned copy is refreshed where an unpinned one would be dropped: after each
    torch.optim step that steps its weight (AdamWFP8Weights' fused step writes W into it: pinned_copy),
    and at the next :meth:`weight` or :meth:`pin` of a changed weight.
    """

    def __init__(self):
        from torch.utils.weak import WeakIdKeyDictionary

        self._entries = WeakIdKeyDictionary()
        self.enabled = True
        self.hits = 0
        self.misses = 0
        # Without this hook, AdamW(fused=True) would leave the experts with the FP8 copies of the first
        # step's weights for the whole run (fused steps leave _version alone).
        ref = weakref.ref(self)   # the global hook must not keep a cache alive

        def after_step(optimizer, _args, _kwargs):
            cache = ref()
            if cache is not None:
                cache._after_step(optimizer)

        self._hook = register_optimizer_step_post_hook(after_step)

    def _after_step(self, optimizer) -> None:
        """Drop every unpinned copy when the optimizer steps a DTensor (FSDP2, expert parallelism: the tensors
        the experts read are not the ones it steps, and their versions do not move; see the class docstring),
        else the copies of the parameters it stepped, unless it keeps this cache itself
        (``optimizer.fp8_weight_cache is self``: moe_fp4.model.optim.AdamWFP8Weights puts the copies its step
        made and drops the others). Pinned copies of stepped parameters are refreshed in place instead."""
        if not self._entries:
            return
        from torch.distributed.tensor import DTensor

        params = [p for group in optimizer.param_groups for p in group["params"]]
        owned = getattr(optimizer, "fp8_weight_cache", None) is self
        if any(isinstance(p, DTensor) for p in params):
            # also after AdamWFP8Weights: it fuses only the parameters the cache holds, never a DTensor
            for w in [w for w, entry in self._entries.items() if not entry[2]]:
                del self._entries[w]
            return
        for p in params:
            entry = self._entries.get(p)
            if entry is None:
                continue
            if entry[2]:
                # pinned: AdamWFP8Weights put its fresh W (the key matches) or took torch's step (discarded:
                # no key); any other optimizer may have changed p behind its version (fused steps)
                if entry[0] is None or not owned and p.grad is not None:
                    self._refresh(p, entry[1])
            elif not owned:
                del self._entries[p]

    @staticmethod
    def _key(w: torch.Tensor):
        return (w._version, w.data_ptr(), tuple(w.shape), w.dtype)

    def _refresh(self, w: torch.Tensor, q: FP8WeightTensor, new: FP8WeightTensor | None = None) -> None:
        """Write W of w as it is now (or ``new``, made from it) into the pinned copy q's own tensors."""
        with torch.no_grad():
            new = quantize_fp8_weight(w.detach()) if new is None else new
            q.data.copy_(new.data)
            q.scale.copy_(new.scale)
        self._entries[w] = (self._key(w), q, True)

    def pin(self, w: torch.Tensor) -> FP8WeightTensor:
        """w: a plain (not DTensor) [N, K] or [E, N, K] weight -> its pinned W: the same two tensors on every
        call for as long as w keeps its shape, dtype and device, holding W of w's current version (refreshed in
        place when w changed). Not under torch.compile: pin outside the compiled region and pass the result in.
        Pinning works whether or not ``enabled`` is set (it is the caller's explicit request)."""
        from torch.distributed.tensor import DTensor

        if isinstance(w, DTensor) or in_graph_region(w):
            raise RuntimeError("FP8WeightCache.pin: pin a plain weight outside torch.compile (the compiled region "
                               "takes the pinned tensors as inputs); a DTensor's local tensors change under FSDP2")
        entry = self._entries.get(w)
        if entry is not None and entry[2]:
            q = entry[1]
            if q.data.device == w.device and tuple(q.data.shape) == tuple(w.shape):
                if entry[0] != self._key(w):
                    self._refresh(w, q)
                return q
        with torch.no_grad():
            q = quantize_fp8_weight(w.detach())
        self._entries.pop(w, None)
        self._entries[w] = (self._key(w), q, True)
        return q

    def is_pinned(self, w: torch.Tensor) -> bool:
        entry = self._entries.get(w)
        return entry is not None and entry[2]

    def pinned_copy(self, w: torch.Tensor) -> FP8WeightTensor | None:
        """w's pinned copy (its tensors, whatever their freshness) for an optimizer to write W into before
        :meth:`put`, or None when w is not pinned or its copy no longer matches w's shape and device."""
        entry = self._entries.get(w)
        if entry is None or not entry[2]:
            return None
        q = entry[1]
        return q if q.data.device == w.device and tuple(q.data.shape) == tuple(w.shape) else None

    def weight(self, w: torch.Tensor) -> FP8WeightTensor:
        """w: [N, K] or [E, N, K] -> W in 128x128 blocks, quantized now or at the same version of w before; w's own
        FP8 codes when w is an FSDP2 parameter gathered in FP8 (moe_fp4.gemm.fsdp.GatheredFP8Weight)."""
        fp8 = gathered_fp8(w)
        if fp8 is not None:
            return fp8
        try:
            key = (w._version, w.data_ptr(), tuple(w.shape), w.dtype)
        except RuntimeError:   # a tensor subclass without a plain storage: no identity to cache on
            key = None
        if key is None or in_graph_region(w):
            return quantize_fp8_weight(w)
        entry = self._entries.get(w)
        if entry is not None and entry[2]:
            return self.pin(w)
        if not self.enabled:
            return quantize_fp8_weight(w)
        if entry is not None and entry[0] == key:
            self.hits += 1
            return entry[1]
        self._entries.pop(w, None)   # the stale copy goes before the new one is made
        q = quantize_fp8_weight(w)
        self._entries[w] = (key, q, False)
        self.misses += 1
        return q

    def get(self, w: torch.Tensor) -> tuple[FP8WeightTensor, FP8WeightTensor]:
        """w: [N, K] or [E, N, K] -> (W, W^T): :meth:`weight`, and its transpose made now (not kept)."""
        q = self.weight(w)
        return q, q.t()

    def __contains__(self, w: torch.Tensor) -> bool:
        """Whether w has a copy here (of any version): an FP8 GEMM has read it since it last changed."""
        return w in self._entries

    def put(self, w: torch.Tensor, q: FP8WeightTensor) -> None:
        """Hold ``q`` (W), made by the caller from w as it is now, for w's current version: what an optimizer
        that quantizes while it updates (adamw_step_fp8_weight_pair's W) hands over."""
        entry = self._entries.get(w)
        if entry is not None and entry[2]:
            if q.data is entry[1].data and q.scale is entry[1].scale:   # written in place (pinned_copy)
                self._entries[w] = (self._key(w), q, True)
            else:
                self._refresh(w, entry[1], q)   # the pinned tensors take the new codes
            return
        if not self.enabled:
            return
        self._entries.pop(w, None)
        self._entries[w] = (self._key(w), q, False)

    def discard(self, w: torch.Tensor) -> None:
        """Drop w's copy, if any (w is about to change); a pinned copy stays, marked stale until refreshed."""
        entry = self._entries.get(w)
        if entry is not None and entry[2]:
            self._entries[w] = (None, entry[1], True)
        else:
            self._entries.pop(w, None)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached FP8 copies now, pinned ones included."""
        return sum(q.nbytes for _, q, _ in self._entries.values())

    def clear(self) -> None:
        """Drop every unpinned copy and mark every pinned one stale (refreshed at its next use)."""
        for w, (_, q, pinned) in list(self._entries.items()):
            if pinned:
                self._entries[w] = (None, q, True)
            else:
                del self._entries[w]


def adamw_step_fp8_weight(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                          scalars, out: FP8WeightTensor | None = None) -> FP8WeightTensor:
    """:func:`adamw_step_fp8_weight_pair`'s step, making W alone (the pass writes no W^T): what the FP8 weight
    cache holds, W^T being made in backward from W's codes. ``out``: an FP8WeightTensor of p's W to write into
    and return (a pinned copy, :meth:`FP8WeightCache.pinned_copy`) instead of new tensors."""
    q = _adamw_step(p, grad, exp_avg, exp_avg_sq, scalars, False, out)[0]
    return q if out is None else out


def adamw_step_fp8_weight_pair(p: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                               exp_avg_sq: torch.Tensor, scalars) -> tuple[FP8WeightTensor, FP8WeightTensor]:
    """p: float32/bf16/fp16 [N, K] or [E, N, K] (N, K multiples of 128); grad, exp_avg, exp_avg_sq: float
    tensors of p's shape; all contiguous -> (W, W^T) as FP8WeightTensors of the updated p. One AdamW step
    with ``scalars`` (moe_fp4.kernels.adamw.AdamWScalars) updates p, exp_avg and exp_avg_sq in place, and
    the same pass quantizes the new p: equal to quantize_fp8_weight_pair(p) after the update, without
    reading p again. One Triton pass on CUDA (or under TRITON_INTERPRET=1), the pure-torch twin
    elsewhere. p's ``_version`` is bumped (the kernel writes it behind autograd's back)."""
    return _adamw_step(p, grad, exp_avg, exp_avg_sq, scalars, True)


def _adamw_step(p, grad, exp_avg, exp_avg_sq, scalars, write_t: bool, out: FP8WeightTensor | None = None):
    from moe_fp4.formats.conversions import _use_triton

    if not isinstance(p, torch.Tensor) or p.dim() not in (2, 3):
        raise ValueError(f"adamw_step_fp8_weight_pair: expected p [N, K] or [E, N, K], got {getattr(p, 'shape', p)}")
    for name, t in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not isinstance(t, torch.Tensor) or t.shape != p.shape:
            raise ValueError(f"adamw_step_fp8_weight_pair: {name} must have p's shape {tuple(p.shape)}, got "
                             f"{tuple(getattr(t, 'shape', ()))}")
    for name, t in (("p", p), ("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if not t.is_contiguous():
            raise ValueError(f"adamw_step_fp8_weight_pair: {name} must be contiguous (updated in place)")
    n, k = p.shape[-2:]
    views = [t.detach().view(-1, n, k) for t in (p, grad, exp_avg, exp_avg_sq)]
    step = adamw_kernels.adamw_fp8_weight_step if _use_triton(p) else adamw_kernels.adamw_fp8_weight_step_ref
    if out is not None:
        out = (out.data.view(-1, n, k), out.scale.view(-1, *out.scale.shape[-2:]))
    q, qt, scale = step(*views, scalars, write_t=write_t, out=out)
    torch.autograd.graph.increment_version(p)
    if not write_t:
        return _stacked(q, scale, p.shape[:-2]), None
    return _pair(q, qt, scale, p.shape[:-2])


# The process's cache, used by the expert layer (moe_fp4.model.experts). ``FP8_WEIGHTS.enabled = False``
# quantizes on every call instead (the memory of the copies then lives only from forward to backward).
FP8_WEIGHTS = FP8WeightCache()


def quantize_fp8_colwise(x: torch.Tensor) -> FP8BlockTensor:
    """x: bf16/fp16/fp32 [M, K] (M % 128 == 0) -> FP8BlockTensor [K, M] holding x^T in 1x128 tiles along M.

    The weight-gradient operand for a tensor held in high precision (the output gradient dY):
    a transpose copy, then the row-wise quantizer. Same definition as ``fp8_to_fp8_colwise`` and
    ``mxfp4_to_fp8_colwise`` applied to exact inputs.
    """
    from moe_fp4.formats.conversions import quantize_fp8

    if x.dim() != 2:
        raise ValueError(f"quantize_fp8_colwise: expected [M, K], got {tuple(x.shape)}")
    return quantize_fp8(x.t().contiguous())


def _padded_block_scale(scale: torch.Tensor) -> torch.Tensor:
    """scale: float32 [N/128, K/128] -> the same values as [round_up(K/128, 4), N/128] with strides
    (1, round_up(K/128, 4)): cuBLAS wants 16-byte-aligned strides for 128x128 block scales."""
    nb, kb = scale.shape
    kb4 = -(-kb // 4) * 4
    if kb4 == kb:
        return scale.t()
    buf = torch.ones(nb, kb4, dtype=scale.dtype, device=scale.device)
    buf[:, :kb] = scale
    return buf.t()


# torch releases disagree on how a 1x128 scale for mat_b is passed: torch 2.11's _scaled_mm_v2 takes
# b.scale itself ([N, K/128], strides (1, N)); others check its transpose. The first call tries both
# and remembers the one torch accepts (the GPU tests compare every layout with the emulation).
_B_1X128_LAYOUTS = (lambda s: s, lambda s: s.t())
_b_1x128_layout: list[int] = []


def _scaled_mm(a: FP8BlockTensor, b, out_dtype: torch.dtype) -> torch.Tensor:
    F = torch.nn.functional
    # scaled_mm wants mat_b column-major [K, N]: b.data.t() is exactly that.
    call = lambda scale_b, recipe_b: F.scaled_mm(  # noqa: E731
        a.data, b.data.t(), a.scale, F.ScalingType.BlockWise1x128, scale_b, recipe_b, output_dtype=out_dtype)
    if isinstance(b, FP8WeightTensor):
        return call(_padded_block_scale(b.scale), F.ScalingType.BlockWise128x128)
    if _b_1x128_layout:
        return call(_B_1X128_LAYOUTS[_b_1x128_layout[0]](b.scale), F.ScalingType.BlockWise1x128)
    errors = []
    for i, layout in enumerate(_B_1X128_LAYOUTS):
        try:
            out = call(layout(b.scale), F.ScalingType.BlockWise1x128)
        except (ValueError, RuntimeError) as e:
            errors.append(str(e).splitlines()[0])
            continue
        _b_1x128_layout.append(i)
        return out
    raise RuntimeError(f"fp8_mm_nt: torch.nn.functional.scaled_mm rejected both 1x128 scale layouts for mat_b: "
                       f"{errors}")


def fp8_mm_nt(a: FP8BlockTensor, b: FP8BlockTensor | FP8WeightTensor,
              out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a: FP8BlockTensor [M, K] (1x128 tiles along K), b: FP8BlockTensor [N, K] (1x128 along K) or
    FP8WeightTensor [N, K] (128x128 blocks) -> out_dtype [M, N] = a @ b^T, accumulated in float32.

    K must be a multiple of 128 (whole tiles on both sides). On sm90+ this is one cuBLAS blockwise
    FP8 GEMM; elsewhere an exact-dequantize float32 emulation (see the module docstring).
    """
    if not isinstance(a, FP8BlockTensor) or not isinstance(b, (FP8BlockTensor, FP8WeightTensor)):
        raise TypeError(f"fp8_mm_nt: expected FP8BlockTensor and FP8BlockTensor/FP8WeightTensor, "
                        f"got {type(a).__name__} and {type(b).__name__}")
    k = a.data.shape[1]
    if b.data.dim() != 2 or b.data.shape[1] != k:
        raise ValueError(f"fp8_mm_nt: a is [M, K] = {tuple(a.data.shape)}, b must be [N, K], got {tuple(b.data.shape)}")
    if k % FP8_TILE != 0:
        raise ValueError(f"fp8_mm_nt: K = {k} must be a multiple of {FP8_TILE}")
    m, n = a.data.shape[0], b.data.shape[0]
    if m == 0 or n == 0 or k == 0:
        return torch.zeros(m, n, dtype=out_dtype, device=a.device)
    if gemm_backend(a.device) is GemmBackend.SCALED_MM:
        return _scaled_mm(a, b, out_dtype)
    return (a.dequantize(torch.float32) @ b.dequantize(torch.float32).t()).to(out_dtype)


# ---------------------------------------------------------------------------------------------
# Grouped GEMMs: all experts in one call.

GROUPED_BACKEND_ENV = "MOE_FP4_GROUPED_GEMM"
_forced_grouped: list[GemmBackend] = []


def grouped_gemm_backend(device: torch.device) -> GemmBackend:
    """The implementation of the grouped GEMMs for tensors on ``device``.

    Default: the Gluon engine on Hopper (sm90) where this Triton has Gluon, the Triton kernels on
    other sm90+ GPUs, the float32 emulation elsewhere. Overridden by :func:`use_grouped_backend`
    (innermost wins), else by ``MOE_FP4_GROUPED_GEMM`` = ``gluon`` | ``triton`` | ``scaled_mm`` |
    ``emulated`` (``scaled_mm`` = one cuBLAS blockwise GEMM per expert, the reference path; ``triton``
    on a CPU tensor needs ``TRITON_INTERPRET=1``; ``gluon`` needs a Hopper GPU).
    """
    if _forced_grouped:
        return _forced_grouped[-1]
    env = os.environ.get(GROUPED_BACKEND_ENV, "").strip().lower()
    if env:
        try:
            return GemmBackend(env)
        except ValueError:
            raise ValueError(f"{GROUPED_BACKEND_ENV}={env!r}: expected one of "
                             f"{[b.value for b in GemmBackend]}") from None
    device = torch.device(device)
    if gluon_kernels.supported(device):
        return GemmBackend.GLUON
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0):
        return GemmBackend.TRITON
    return GemmBackend.EMULATED


@contextlib.contextmanager
def use_grouped_backend(backend: GemmBackend | str):
    """Run the grouped GEMMs inside the ``with`` block on ``backend`` (tests, benchmarks)."""
    _forced_grouped.append(GemmBackend(backend))
    try:
        yield
    finally:
        _forced_grouped.pop()


def _grouped_impl(name: str, device: torch.device):
    """-> (backend, the function with grouped_gemm.<name>'s signature that runs it): the one place where
    an engine is chosen. The Gluon engine has both (grouped_mm_nt: fprop and dgrad; grouped_mm_wgrad:
    the weight gradients)."""
    backend = grouped_gemm_backend(device)
    if backend is GemmBackend.GLUON and hasattr(gluon_kernels, name):
        return backend, getattr(gluon_kernels, name)
    if backend in (GemmBackend.GLUON, GemmBackend.TRITON):
        return backend, getattr(grouped_kernels, name)
    return backend, getattr(grouped_kernels, name + "_ref")


def grouped_fp8_mm_nt(a: FP8BlockTensor | MXFP4Tensor, b: FP8WeightTensor, counts,
                      out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """a: FP8BlockTensor [R, K] (1x128 tiles along K) or MXFP4Tensor [R, K] (converted to FP8 first, as
    ``mxfp4_to_fp8`` converts it), rows grouped by expert; b: FP8WeightTensor
    [E, N, K]; counts: E ints, multiples of 128, summing to R, or an int tensor [E] on a's device (no
    host sync; values unread, summing to at most R, the rows past them come out zero) -> out_dtype [R, N]:
    expert e's rows times b[e]^T. Fprop (x W^T) and dgrad (dy W, with ``b`` = the transposed weights).
    The scaled_mm backend reads device counts on the host (one GEMM per expert)."""
    if not isinstance(a, (FP8BlockTensor, MXFP4Tensor)) or not isinstance(b, FP8WeightTensor):
        raise TypeError(f"grouped_fp8_mm_nt: expected FP8BlockTensor/MXFP4Tensor and FP8WeightTensor, "
                        f"got {type(a).__name__} and {type(b).__name__}")
    if b.data.dim() != 3:
        raise ValueError(f"grouped_fp8_mm_nt: b must be an [E, N, K] stack, got {tuple(b.data.shape)}")
    _check_out_dtype(out_dtype, "grouped_fp8_mm_nt")
    if isinstance(counts, torch.Tensor):   # the op: one node for torch.compile, nothing read on the host
        return torch.ops.moe_fp4.grouped_mm_nt(a.data, a.scale, b.data, b.scale, counts, out_dtype)
    return _grouped_nt(a, b, counts, out_dtype)


def _grouped_nt(a, b: FP8WeightTensor, counts, out_dtype) -> torch.Tensor:
    backend, fn = _grouped_impl("grouped_mm_nt", a.device)
    if backend is GemmBackend.SCALED_MM:
        return _grouped_nt_scaled_mm(a, b, counts, out_dtype)
    kernel_dtype = out_dtype if out_dtype in grouped_kernels.OUT_DTYPES else torch.float32
    return fn(a.data, a.scale, b.data, b.scale, counts, kernel_dtype).to(out_dtype)


@torch.library.custom_op("moe_fp4::grouped_mm_nt", mutates_args=())
def _grouped_nt_op(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                   counts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """grouped_fp8_mm_nt with device counts on plain tensors (A FP8 or MXFP4 codes): the engine is chosen when
    the op runs (grouped_gemm_backend)."""
    shape = (a.shape[0], a.shape[1] * (2 if a.dtype == torch.uint8 else 1))
    cls = MXFP4Tensor if a.dtype == torch.uint8 else FP8BlockTensor
    return _grouped_nt(cls(a, a_scale, shape, torch.bfloat16), FP8WeightTensor(b, b_scale), counts, out_dtype)


@_grouped_nt_op.register_fake
def _(a, a_scale, b, b_scale, counts, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


def _grouped_nt_scaled_mm(a, b: FP8WeightTensor, counts, out_dtype) -> torch.Tensor:
    from moe_fp4.formats.conversions import mxfp4_to_fp8

    # Same validation as the kernels (shapes, counts), then one cuBLAS GEMM per expert.
    grouped_kernels._nt_shapes(a.data, a.scale, b.data, b.scale, counts, "grouped_fp8_mm_nt")
    counts = grouped_kernels._ref_counts(counts, a.m, "grouped_fp8_mm_nt")   # per expert: read on the host
    if isinstance(a, MXFP4Tensor):
        a = mxfp4_to_fp8(a)
    alloc = torch.zeros if sum(counts) < a.m else torch.empty   # the rows past the groups are zeros
    out = alloc(a.m, b.data.shape[1], dtype=out_dtype, device=a.device)
    offs = grouped_kernels.group_offsets(counts)
    for e in range(len(offs) - 1):
        if offs[e + 1] > offs[e]:
            out[offs[e]:offs[e + 1]] = fp8_mm_nt(a.rows(offs[e], offs[e + 1]), b[e], out_dtype)
    return out


def grouped_fp8_mm_wgrad(a: FP8BlockTensor, b: FP8BlockTensor, counts,
                         out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """a: FP8BlockTensor [N, R], b: FP8BlockTensor [K, R], both in 1x128 tiles along R (the tokens,
    grouped by expert: ``*_colwise`` of the row-wise activations); counts: E ints, multiples of 128,
    summing to R, or an int tensor [E] on a's device (no host sync; the columns past their sum are left
    out) -> out_dtype [E, N, K]: out[e] = a[:, tokens of e] @ b[:, tokens of e]^T, the
    weight gradient dY_e^T X_e (zeros for an expert without tokens)."""
    if not isinstance(a, FP8BlockTensor) or not isinstance(b, FP8BlockTensor):
        raise TypeError(f"grouped_fp8_mm_wgrad: expected two FP8BlockTensors, got {type(a).__name__} and "
                        f"{type(b).__name__}")
    _check_out_dtype(out_dtype, "grouped_fp8_mm_wgrad")
    if isinstance(counts, torch.Tensor):
        return torch.ops.moe_fp4.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts, out_dtype)
    return _grouped_wgrad(a, b, counts, out_dtype)


@torch.library.custom_op("moe_fp4::grouped_mm_wgrad", mutates_args=())
def _grouped_wgrad_op(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                      counts: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """grouped_fp8_mm_wgrad with device counts on plain tensors."""
    wrap = lambda d, sc: FP8BlockTensor(d, sc, d.shape, torch.bfloat16)  # noqa: E731
    return _grouped_wgrad(wrap(a, a_scale), wrap(b, b_scale), counts, out_dtype)


@_grouped_wgrad_op.register_fake
def _(a, a_scale, b, b_scale, counts, out_dtype):
    return a.new_empty(counts.shape[0], a.shape[0], b.shape[0], dtype=out_dtype)


def _grouped_wgrad(a: FP8BlockTensor, b: FP8BlockTensor, counts, out_dtype) -> torch.Tensor:
    backend, fn = _grouped_impl("grouped_mm_wgrad", a.device)
    if backend is not GemmBackend.SCALED_MM:
        kernel_dtype = out_dtype if out_dtype in grouped_kernels.OUT_DTYPES else torch.float32
        return fn(a.data, a.scale, b.data, b.scale, counts, kernel_dtype).to(out_dtype)
    n, k, counts = grouped_kernels._wgrad_shapes(a.data, a.scale, b.data, b.scale, counts, "grouped_fp8_mm_wgrad")
    counts = grouped_kernels._ref_counts(counts, a.data.shape[1], "grouped_fp8_mm_wgrad")
    out = torch.zeros(len(counts), n, k, dtype=out_dtype, device=a.device)
    offs = grouped_kernels.group_offsets(counts)
    for e in range(len(counts)):
        s, t = offs[e], offs[e + 1]
        if t > s:
            out[e] = fp8_mm_nt(_column_slice(a, s, t), _column_slice(b, s, t), out_dtype)
    return out


def _column_slice(t: FP8BlockTensor, start: int, stop: int) -> FP8BlockTensor:
    """Columns start..stop-1 (tile-aligned) of an FP8BlockTensor [N, R] in 1x128 tiles along R."""
    data = t.data[:, start:stop].contiguous()
    scale = fp8_kernels.m_major(t.scale[:, start // FP8_TILE: stop // FP8_TILE])
    return FP8BlockTensor(data, scale, data.shape, t.dtype)


__all__ = [
    "FP8_WEIGHTS",
    "gathered_fp8",
    "in_graph_region",
    "FP8WeightCache",
    "FP8WeightTensor",
    "GemmBackend",
    "adamw_step_fp8_weight",
    "adamw_step_fp8_weight_pair",
    "fp8_mm_nt",
    "gemm_backend",
    "grouped_fp8_mm_nt",
    "grouped_fp8_mm_wgrad",
    "grouped_gemm_backend",
    "use_grouped_backend",
    "quantize_fp8_colwise",
    "quantize_fp8_weight",
    "quantize_fp8_weight_pair",
]
