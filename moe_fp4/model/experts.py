"""Grouped SwiGLU expert MLPs with FP8 GEMMs and MXFP4 activation storage (one autograd Function).

Rows arrive permuted by expert and padded so that every expert's group is a multiple of
``TOKEN_ALIGN`` = 128 rows: the weight-gradient GEMMs contract over tokens in 1x128 tiles, and a
tile must not straddle two experts. Expert e owns rows ``offsets[e] : offsets[e] + counts[e]``.

Every step runs once for all experts: the grouped GEMMs of :mod:`moe_fp4.gemm.engines` (one Triton launch
each on Hopper), the conversions over the whole [R, *] tensors (a 128-aligned group never shares a
1x128 token tile with another expert, so the column-wise operands of all experts come from one
launch), and SwiGLU fused with the quantization of its output.

Router weights are applied inside the experts (a weighted SwiGLU, as Megatron-LM does):
``a = w_row * silu(gate) * up``, so the caller's combine is an unweighted sum that keeps nothing for
backward, and the router-weight gradient ``sum_f da * silu(gate) * up`` comes from the SwiGLU input
that backward has anyway.

What each precision keeps for backward (DESIGN.md, "Where MXFP4 is used"):

| tensor          | bf16 | fp8 (DeepSeek-V3 baseline)      | fp4                                   |
| --------------- | ---- | ------------------------------- | ------------------------------------- |
| FC1 input x     | bf16 | FP8 1x128 (the fprop operand)   | MXFP4 (fused with the FP8 cast, or as received) (*) |
| SwiGLU input h  | bf16 | bf16                            | MXFP4 (fused with SwiGLU)             |
| FC2 input a     | bf16 | FP8 1x128 (the fprop operand)   | MXFP4 (fused with SwiGLU and the FP8 cast) |

(*) From the layer: one row per token + x_saved_rows.

fp4 with ``storage="nvfp4"`` keeps the same three tensors in NVFP4 (x and h from bf16, a from its FP8
codes); inside a compression scope with ``storage=nvfp4`` the fp8 precision's FP8 activations become
NVFP4 straight from their codes.

Backward builds the weight-gradient operands from what was kept: ``fp8_to_fp8_colwise`` (fp8) or
``mxfp4_to_fp8_colwise`` (fp4), and one cast-transpose for the output gradient (its row-wise FP8
for dgrad and its column-wise FP8 for wgrad from one read). The SwiGLU backward reads fp4's MXFP4
SwiGLU input as kept, decoding it in registers (no bf16 copy of it). The FP8 weights W (128x128 blocks) come
from :data:`moe_fp4.gemm.engines.FP8_WEIGHTS`, made once per weight version and shared by forward, backward and
every micro-batch of an optimizer step; the dgrad operands W^T are W's codes and block scales transposed in
backward, one layer's at a time, freed after their GEMMs (1 byte of resident FP8 state per expert parameter).

Inside :func:`moe_fp4.compress_saved_activations` with ``compress_fp8=True``, the fp8 precision
stores its FP8 activations as MXFP4 converted directly from the FP8 codes (no BF16 round trip); its
bf16 SwiGLU input goes through ``save_for_backward``, where that hook compresses it. Nothing is
compressed twice: the quantized containers are tagged (:func:`moe_fp4.saved.accounting.keep`) and the hook passes
them through.

Everything kept goes through ``ctx.save_for_backward`` (containers as their tensors), none of it on
ctx attributes, so activation checkpointing (``torch.utils.checkpoint``, :func:`moe_fp4.model.moe.checkpoint`)
around the experts drops it in forward and recomputes it in backward; ``recompute_swiglu`` drops the
SwiGLU output alone (bf16, fp8).

Under torch.compile the same Function's bodies run inside the op pair of :mod:`moe_fp4.model.experts_op`.
One idea at over 500 lines, kept whole: the experts' autograd Function, its helpers and its public entry
points, which the eager path and the compiled op pair share.
"""

from __future__ import annotations

import torch

from moe_fp4.formats import _ops
from moe_fp4.formats.choices import Choice
from moe_fp4.formats.containers import FP8BlockTensor, MXFP4Tensor, NVFP4Tensor
from moe_fp4.formats.conversions import (
    _use_triton,
    dequantize_nvfp4,
    fp8_to_fp8_colwise,
    mxfp4_to_fp8,
    mxfp4_to_fp8_colwise,
    nvfp4_to_fp8_colwise,
    quantize_fp8,
    quantize_fp8_and_mxfp4,
    quantize_mxfp4,
    quantize_nvfp4,
)
from moe_fp4.gemm.engines import (
    FP8_WEIGHTS,
    FP8WeightTensor,
    grouped_fp8_mm_nt,
    grouped_fp8_mm_wgrad,
    in_graph_region,
)
from moe_fp4.kernels import swiglu as _swiglu
from moe_fp4.kernels import transpose as _transpose
from moe_fp4.kernels.grouped_gemm import GROUP_ALIGN, device_offsets, group_offsets, host_counts, rows_aligned
from moe_fp4.model import experts_op
from moe_fp4.saved.accounting import keep, label_saved, rebuild, report_saved
from moe_fp4.saved.hook import StorageFormat, current_compression

# Rows per expert group: the grouped GEMMs' alignment (one FP8 1x128 tile along tokens), the name this API exports.
TOKEN_ALIGN = GROUP_ALIGN


class Precision(Choice):
    __parameter__ = "precision"

    BF16 = "bf16"  # every GEMM in bf16, every saved activation in bf16
    FP8 = "fp8"    # FP8 GEMMs, DeepSeek-V3 storage (the baseline)
    FP4 = "fp4"    # FP8 GEMMs, activations saved in MXFP4


def _keep_fp8(t: FP8BlockTensor):
    """The fp8 precision's saved FP8 activation -> (what is kept, the bytes it replaced or None): as is,
    or MXFP4 / NVFP4 (the scope's ``storage``) straight from its codes when the compression hook asks for
    it (counted by the hook when it packs the result)."""
    scope = current_compression()
    if scope is not None and scope.config.compress_fp8:
        nv = scope.config.storage is StorageFormat.NVFP4
        return (quantize_nvfp4(t) if nv else quantize_mxfp4(t)), t.nbytes
    return t, None


class _Kept:
    """What the experts' Function keeps for backward, all of it through ``ctx.save_for_backward`` (so
    that ``torch.utils.checkpoint`` can drop it and recompute it: a ctx attribute would be held by the
    graph whatever the checkpoint does). Quantized containers and the router weights are tagged by
    :func:`moe_fp4.saved.accounting.keep` (reported by label and format, passed through the compression hook);
    bf16 tensors go through as they are (labelled for ``saved_bytes``; the hook may compress them)."""

    def __init__(self):
        self.tensors: list[torch.Tensor] = []
        self.specs: list[tuple[str, object]] = []

    def add(self, name: str, obj, label: str | None = None, converted_from: int | None = None, exact=True):
        if obj is None:
            self.specs.append((name, None))
            return
        if exact:
            tensors, spec = keep(label or name, obj, converted_from)
        else:
            label_saved(obj, label or name)
            tensors, spec = (obj,), (None, 1)   # rebuild() gives the tensor back
        self.tensors += tensors
        self.specs.append((name, spec))

    def save(self, ctx, *head: torch.Tensor) -> None:
        ctx.kept_specs, ctx.kept_head = self.specs, len(head)
        ctx.save_for_backward(*head, *self.tensors)

    @staticmethod
    def load(ctx) -> tuple[tuple, dict]:
        saved = ctx.saved_tensors
        head, rest, out = saved[:ctx.kept_head], saved[ctx.kept_head:], {}
        i = 0
        for name, spec in ctx.kept_specs:
            if spec is None:
                out[name] = None
                continue
            n = spec[1]
            out[name] = rebuild(spec, rest[i:i + n])
            i += n
        return head, out


def _colwise(kept, rows: torch.Tensor | None = None) -> FP8BlockTensor:
    """A kept activation [R, K] -> FP8BlockTensor [K, R] in 1x128 tiles along tokens (all experts in
    one launch: 128-aligned groups never share a tile). rows (int64 [R], MXFP4 only): kept holds token
    rows and expert row r is kept's row rows[r] (read in place by the kernel; the routing's own rows,
    so the public API's range check, a host sync, is skipped)."""
    if rows is not None:
        return _ops.mxfp4_to_fp8_colwise(kept, _use_triton(kept.data), rows=rows)
    if isinstance(kept, MXFP4Tensor):
        return mxfp4_to_fp8_colwise(kept)
    if isinstance(kept, NVFP4Tensor):
        return nvfp4_to_fp8_colwise(kept)
    return fp8_to_fp8_colwise(kept)


def _swiglu_quantize(h: torch.Tensor, w, fp4: bool):
    """h: bf16 [R, 2F] -> (FP8BlockTensor [R, F] of swiglu(h, w), MXFP4Tensor of it or None,
    MXFP4Tensor of h or None): one read of h (fp4 writes all three)."""
    fn = _ops._pick(_swiglu, "swiglu_quantize", _use_triton(h))
    (fd, fs), a_mx, h_mx, _ = fn(h, w, write_h_mxfp4=fp4, write_a_mxfp4=fp4)
    r, f = fd.shape
    aq = FP8BlockTensor(fd, fs, (r, f), h.dtype)
    if not fp4:
        return aq, None, None
    return aq, MXFP4Tensor(*a_mx, (r, f), h.dtype), MXFP4Tensor(*h_mx, tuple(h.shape), h.dtype)


def _swiglu_backward(h, da: torch.Tensor, w):
    """h: bf16 [R, 2F], or fp4's MXFP4Tensor [R, 2F] (decoded in the kernel's registers: no bf16 copy of
    it), da: bf16 [R, F] -> (dh bf16 [R, 2F], dw float32 [R] or None): one fused pass."""
    if isinstance(h, MXFP4Tensor):
        fn = _ops._pick(_swiglu, "swiglu_backward", _use_triton(h.data))
        return fn(h.data.contiguous(), da, w, h_scale=h.scale.contiguous())
    return _ops._pick(_swiglu, "swiglu_backward", _use_triton(h))(h, da, w)


def _rows_and_cols(g: torch.Tensor, rows: bool):
    """g: bf16 [R, N] -> (FP8BlockTensor [R, N] or None, FP8BlockTensor [N, R] in 1x128 tiles along R):
    the dgrad and wgrad operands of a gradient from one read."""
    fn = _ops._pick(_transpose, "quantize_fp8_rowwise_colwise", _use_triton(g))
    r_pair, c_pair = fn(g, rowwise=rows, colwise=True)
    m, n = g.shape
    rq = FP8BlockTensor(*r_pair, (m, n), g.dtype) if rows else None
    return rq, FP8BlockTensor(*c_pair, (n, m), g.dtype)


# ---------------------------------------------------------------------------------------------
# bf16: torch's grouped GEMM (CUTLASS on sm90) where there is one.

def _bf16_offsets(counts, device) -> torch.Tensor:
    """int32 [E] end offsets of the groups, on ``device`` (torch._grouped_mm's ``offs``; no host sync)."""
    return device_offsets(counts, torch.int32, device)[1:]


def _has_grouped_mm(device: torch.device) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    return device.type == "cpu" or (device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0))


def _bf16_mm(a: torch.Tensor, b: torch.Tensor, counts, offs) -> torch.Tensor:
    """a [R, K] rows grouped by expert, b [E, K, N] -> [R, N] (expert e's rows times b[e])."""
    if offs is not None:
        return torch._grouped_mm(a, b, offs=offs)
    counts = host_counts(counts)
    out = a.new_zeros(a.shape[0], b.shape[-1])
    for e, (s, c) in enumerate(zip(group_offsets(counts), counts)):
        torch.mm(a[s:s + c], b[e], out=out[s:s + c])
    return out


def _bf16_wgrad(g: torch.Tensor, x: torch.Tensor, counts, offs) -> torch.Tensor:
    """g [R, N], x [R, K] -> [E, N, K]: g_e^T x_e per expert (contraction over its rows)."""
    if offs is not None:
        return torch._grouped_mm(g.t(), x, offs=offs)
    counts = host_counts(counts)
    out = g.new_zeros(len(counts), g.shape[1], x.shape[1])
    for e, (s, c) in enumerate(zip(group_offsets(counts), counts)):
        if c:
            torch.mm(g[s:s + c].t(), x[s:s + c], out=out[e])
    return out


class _GroupedSwiGLU(torch.autograd.Function):
    precision_of = staticmethod(lambda value: Precision(value))
    bf16_offsets = staticmethod(lambda counts, device: _bf16_offsets(counts, device))

    @staticmethod
    def forward(ctx, x, w13, w2, row_w, counts, precision, x_q, recompute_swiglu, storage, x_saved, x_saved_rows,
                grad_slot, fp8_pairs=None):
        rows, hidden = (x_q.m, x_q.k) if x_q is not None else x.shape
        dev = x.device if x_q is None else x_q.device
        ctx.precision, ctx.counts, ctx.grad_slot = precision, counts, grad_slot
        kept = _Kept()
        kept.add("row_w", None if row_w is None else row_w.detach(), "row_weights")

        if precision is Precision.BF16:
            xin = x if x_q is None else x_q.dequantize(torch.bfloat16)
            offs = _bf16_offsets(counts, dev) if _has_grouped_mm(dev) else None
            w13c, w2c = w13.to(xin.dtype), w2.to(xin.dtype)
            h = _bf16_mm(xin, w13c.transpose(1, 2), counts, offs)
            a = _swiglu.swiglu_ref(h, row_w)
            y = _bf16_mm(a, w2c.transpose(1, 2), counts, offs)
            kept.add("x", xin, "fc1_input", exact=False)
            kept.add("h", h, "swiglu_input", exact=False)
            # recompute_swiglu: backward recomputes the SwiGLU output from h (same function, same bits).
            kept.add("a", None if recompute_swiglu else a, "fc2_input", exact=False)
            ctx.offs = offs
            kept.save(ctx, w13, w2)
            return y

        fp4 = precision is Precision.FP4
        # fp4 in NVFP4 (storage): the same tensors kept, each quantized with NVFP4's rules instead
        # (x and h from bf16, a from its FP8 codes), and MXFP4 rows received from the dispatch as they came.
        nv = fp4 and storage is StorageFormat.NVFP4
        # W once per weight version (moe_fp4.gemm.engines.FP8_WEIGHTS; micro-batches between two optimizer steps
        # share it). The dgrad operand W^T is made in backward from W's codes and freed after its GEMM
        # (_dgrad_weight), unless the caller's fp8_pairs hold it (the op pair under torch.compile, integrations).
        (w13q, w13t), (w2q, w2t) = fp8_pairs or ((FP8_WEIGHTS.weight(w13), None), (FP8_WEIGHTS.weight(w2), None))
        ctx.w13t, ctx.w2t = w13t, w2t
        ctx.w13q, ctx.w2q = (w13q if w13t is None else None), (w2q if w2t is None else None)
        report_saved("fp8_weights", w13q, parameter=True)   # weight copies (the cache holds them between
        report_saved("fp8_weights", w2q, parameter=True)    # steps): not activations
        if isinstance(x_q, MXFP4Tensor):
            # A received MXFP4 FC1 input: converted to FP8 for the grouped GEMM.
            xq = mxfp4_to_fp8(x_q)
            kept.add("x", x_q, "fc1_input")
        elif isinstance(x_q, FP8BlockTensor) and x_saved is not None:
            # fp4 (MXFP4 storage): the layer's per-token FP8 (rows gathered) + MXFP4, kept once per token
            # with the rows' token indices when x_saved_rows is given (backward reads the rows in place)
            xq = x_q
            kept.add("x", x_saved, "fc1_input")
            kept.add("x_rows", None if x_saved_rows is None else x_saved_rows.detach(), "fc1_input_rows")
        elif isinstance(x_q, FP8BlockTensor):
            xq = x_q
            x_kept, before = ((quantize_nvfp4(x_q) if nv else quantize_mxfp4(x_q)), None) if fp4 else _keep_fp8(x_q)
            kept.add("x", x_kept, "fc1_input", converted_from=before)
        elif nv:
            xq = quantize_fp8(x)
            kept.add("x", quantize_nvfp4(x), "fc1_input")
        elif fp4:
            xq, x_mx = quantize_fp8_and_mxfp4(x)
            kept.add("x", x_mx, "fc1_input")
        else:
            xq = quantize_fp8(x)
            x_kept, before = _keep_fp8(xq)
            kept.add("x", x_kept, "fc1_input", converted_from=before)
        h = grouped_fp8_mm_nt(xq, w13q, counts, torch.bfloat16)
        del xq, w13q
        aq, a_mx, h_mx = _swiglu_quantize(h, row_w, fp4 and not nv)
        if nv:
            kept.add("a", quantize_nvfp4(aq), "fc2_input")
            kept.add("h", quantize_nvfp4(h), "swiglu_input")
        elif fp4:
            # fp4 keeps the SwiGLU output in MXFP4 even with recompute_swiglu: recomputing it from the
            # MXFP4 SwiGLU input would change the FC2 weight gradient (it is made from the exact h).
            kept.add("a", a_mx, "fc2_input")
            kept.add("h", h_mx, "swiglu_input")
        else:
            if recompute_swiglu:
                kept.add("a", None)
            else:
                a_kept, before = _keep_fp8(aq)
                kept.add("a", a_kept, "fc2_input", converted_from=before)
            kept.add("h", h, "swiglu_input", exact=False)
        kept.save(ctx, w13, w2)
        return grouped_fp8_mm_nt(aq, w2q, counts, torch.bfloat16)

    @staticmethod
    def backward(ctx, dy):
        precision, counts = ctx.precision, ctx.counts
        need_dx, need_dw13, need_dw2 = ctx.needs_input_grad[:3]
        (w13, w2), kept = _Kept.load(ctx)
        row_w = kept["row_w"]
        # The combine's gradient as it arrived (moe_fp4.exchange.ep.GradSlot): MXFP4 or FP8 rows in expert order.
        dy_q = None if ctx.grad_slot is None else ctx.grad_slot.take()
        # With it, for the sqrt(3) rule: each row's rounding error and the rule to tell the FC2 weight
        # gradient's noise, sum_r ||a_r||^2 ||e_r||^2 (a_r: the FC2 input row the weight gradient reads).
        noise = None if ctx.grad_slot is None or not need_dw2 else ctx.grad_slot.take_noise()
        if dy_q is not None and precision is Precision.BF16:
            dy = dy_q.dequantize(torch.bfloat16)
        elif dy_q is None:
            dy = dy.contiguous()   # (with dy_q, dy is the combine's zero-stride stand-in: never read)
        if precision is Precision.BF16:
            xin, h, a = kept["x"], kept["h"], kept["a"]
            if a is None:
                a = _swiglu.swiglu_ref(h, row_w)
            offs = ctx.offs
            w13c, w2c = w13.to(dy.dtype), w2.to(dy.dtype)
            da = _bf16_mm(dy, w2c, counts, offs)
            dw2 = _bf16_wgrad(dy, a, counts, offs).to(w2.dtype) if need_dw2 else None
            if noise is not None:
                _tell_weight_noise(noise, a)
            del a
            dh, d_row = _swiglu_backward(h, da, row_w)
            dx = _bf16_mm(dh, w13c, counts, offs) if need_dx else None
            dw13 = _bf16_wgrad(dh, xin, counts, offs).to(w13.dtype) if need_dw13 else None
            return dx, dw13, dw2, d_row, None, None, None, None, None, None, None, None, None

        h = kept["h"]   # bf16, or MXFP4 read as kept by the SwiGLU backward
        if isinstance(h, NVFP4Tensor):
            h = dequantize_nvfp4(h, dy.dtype)
        a_kept = kept["a"]
        if a_kept is None:   # recompute_swiglu (fp8): the same kernel on the same h gives the forward's bytes
            a_kept = _swiglu_quantize(h, row_w, False)[0]
        if dy_q is None:
            dyq, dyt = _rows_and_cols(dy, rows=True)
        else:   # converted directly: bit for bit the operands _rows_and_cols makes of the decoded rows
            dyq, dyt = (mxfp4_to_fp8(dy_q) if isinstance(dy_q, MXFP4Tensor) else dy_q), _colwise(dy_q)
        da = grouped_fp8_mm_nt(dyq, _dgrad_weight(ctx.w2q, ctx.w2t), counts, torch.bfloat16)
        del dyq
        dw2 = grouped_fp8_mm_wgrad(dyt, _colwise(a_kept), counts, w2.dtype) if need_dw2 else None
        if noise is not None:
            _tell_weight_noise(noise, a_kept)
        del dyt, a_kept
        dh, d_row = _swiglu_backward(h, da, row_w)
        del h, da
        dhq, dht = _rows_and_cols(dh, rows=need_dx)
        del dh
        dx = grouped_fp8_mm_nt(dhq, _dgrad_weight(ctx.w13q, ctx.w13t), counts, torch.bfloat16) if need_dx else None
        dw13 = grouped_fp8_mm_wgrad(dht, _colwise(kept["x"], kept.get("x_rows")), counts, w13.dtype) \
            if need_dw13 else None
        return dx, dw13, dw2, d_row, None, None, None, None, None, None, None, None, None


def _dgrad_weight(w: FP8WeightTensor | None, wt: FP8WeightTensor | None) -> FP8WeightTensor:
    """The dgrad operand W^T [E, K, N]: ``wt`` when the caller gave it, else W's codes and block scales transposed
    (bit for bit what quantizing W^T gives: a 128x128 block's scale is the same either way), made now and freed
    with the GEMM that reads it."""
    return wt if wt is not None else w.t()


def quantize_expert_tokens(x: torch.Tensor, precision, storage: str | StorageFormat = "mxfp4"):
    """x: bf16 [T, H] tokens -> (FP8BlockTensor [T+1, H], MXFP4Tensor [T+1, H] (fp4) or None): the experts'
    FC1 operand (and fp4's kept copy, from the same read) quantized per token, before the tokens are
    copied to their k expert rows; the last row is a zero token, the source of the padding rows. None
    where the experts quantize their own rows: bf16, and fp4 with NVFP4 storage (its per-tensor scale).

    Both formats are row-wise (FP8 1x128 tiles and MXFP4 1x32 blocks along H), so the gathered rows
    (:func:`gather_expert_tokens`) are bit for bit what the experts make of gathered bf16 rows, while
    the quantizer reads T rows instead of T*k and the gather moves 1 (+0.53) bytes an element, not 2."""
    precision, storage = Precision(precision), StorageFormat(storage)
    if precision is Precision.BF16 or (precision is Precision.FP4 and storage is StorageFormat.NVFP4):
        return None
    with torch.no_grad():
        xz = torch.cat([x, x.new_zeros(1, x.shape[1])])
        if precision is Precision.FP4:
            return quantize_fp8_and_mxfp4(xz)
        return quantize_fp8(xz), None


def gather_expert_tokens(tokens, src_row: torch.Tensor):
    """tokens: :func:`quantize_expert_tokens` of T tokens; src_row: int64 [R], the token of each expert row
    (T for a padding row) -> (x_q FP8BlockTensor [R, H], x_saved MXFP4Tensor [T+1, H] or None,
    x_saved_rows int64 [R] or None), the ``x_q``, ``x_saved`` and ``x_saved_rows`` of
    :func:`grouped_swiglu_experts`. Only the GEMM operand is gathered: fp4's kept MXFP4 copy stays one
    row per token (k times less memory than one per expert row, and no gather pass), and backward reads
    each expert row's token in place."""
    fp8, mx = tokens
    shape = (src_row.shape[0], fp8.k)
    # The scales are M-major: gathering columns of scale^T keeps that layout without a copy.
    x_q = FP8BlockTensor(fp8.data.index_select(0, src_row), fp8.scale.t().index_select(1, src_row).t(),
                         shape, fp8.dtype)
    if mx is None:
        return x_q, None, None
    return x_q, mx, src_row


def prefetch_fp8_weights(*weights) -> None:
    """weights: [E, N, K] tensors (or None, skipped) -> nothing: each one's FP8 copy W made now,
    as the experts would make it (:data:`moe_fp4.gemm.engines.FP8_WEIGHTS`), so that their forward finds it
    cached. The MoE layer calls it where the GPU would otherwise wait for the host (the weights need no
    routing): the FC1 weights before the router, the FC2 weights while the host waits for the routing's
    counts. Nothing when the cache is off: the experts would quantize a second time."""
    if not FP8_WEIGHTS.enabled or any(w is not None and in_graph_region(w) for w in weights):
        return   # compiled and captured experts quantize in their graph
    with torch.no_grad():
        for w in weights:
            if w is not None:
                FP8_WEIGHTS.weight(w)


def _tell_weight_noise(noise, a) -> None:
    """noise: (row_err2 float32 [Rp], rule) from the GradSlot; a: the FC2 input [Rp, F] as the weight gradient
    reads it (bf16, FP8BlockTensor, MXFP4Tensor or NVFP4Tensor) -> the rule's weight-noise sum for this pass."""
    row_err2, rule = noise
    af = a if isinstance(a, torch.Tensor) else a.dequantize(torch.float32)
    rule.record_weight_noise((torch.linalg.vector_norm(af, dim=1, dtype=torch.float32).square() * row_err2).sum())


def grouped_swiglu_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts, precision="fp8",
                           x_q: MXFP4Tensor | FP8BlockTensor | None = None,
                           row_weights: torch.Tensor | None = None, recompute_swiglu: bool = False,
                           storage: str | StorageFormat = "mxfp4", x_saved: MXFP4Tensor | None = None,
                           x_saved_rows: torch.Tensor | None = None, grad_slot=None,
                           fp8_weights=None) -> torch.Tensor:
    """SwiGLU expert MLPs over rows grouped by expert.

    x:      bf16 [R, H], rows grouped by expert (expert e owns ``counts[e]`` consecutive rows, each
            count a multiple of 128; padding rows are zero), R = sum(counts). With ``x_q`` given,
            x only carries the gradient: any bf16 tensor of shape [R, H] (e.g. a zero-stride
            ``expand`` of a 0-d tensor) whose ``.grad`` hook receives d(loss)/d(input).
    w13:    bf16/fp32 [E, 2F, H]: gate rows 0..F-1, up rows F..2F-1.
    w2:     bf16/fp32 [E, H, F].
    counts: E ints, multiples of 128 summing to R; or an int tensor [E] on the device (device counts: no
            host sync; multiples of 128 summing to at most R, values unread; the rows past the groups are
            padding rows, zero in x, and come out zero).
    precision: "bf16" | "fp8" | "fp4" (or :class:`Precision`).
    x_q:    optional MXFP4Tensor or FP8BlockTensor [R, H], the input as received from the all-to-all.
            MXFP4 is converted to FP8 directly for the GEMM and kept as
            is for backward; FP8 is the GEMM operand, kept
            as is (fp8) or converted FP8 -> MXFP4 directly (fp4). bf16 precision dequantizes it.
    row_weights: optional float32 [R], the router weight of each row (0 for padding rows),
            differentiable: the output is then ``row_weights[:, None] * expert(x)`` with the weight
            applied to the SwiGLU output.
    recompute_swiglu: keep the SwiGLU input only and recompute its output (the FC2 input) in backward,
            bit for bit what the forward used (bf16: 2F bytes a row less; fp8: F + F/128*4). fp4 keeps
            its MXFP4 FC2 input anyway (0.53 bytes an element): recomputing it from the MXFP4 SwiGLU
            input would change the FC2 weight gradient.
    storage: fp4's activation format, "mxfp4" (default) or "nvfp4" (:class:`moe_fp4.StorageFormat`: E4M3
            scales per 16 and a float32 scale per tensor, 4.5 bits an element): x and the SwiGLU
            input h quantized from bf16, the FC2 input from its FP8 codes (FP8 -> NVFP4), an FP8 x_q
            likewise; an MXFP4 x_q is kept as received. Backward converts NVFP4 -> FP8 along tokens for
            the weight gradients (``nvfp4_to_fp8_colwise``). Other precisions ignore it (the fp8
            precision's storage inside a compression scope is the scope's ``CompressionConfig.storage``).
    x_saved: optional MXFP4Tensor [R, H], with an FP8 x_q in fp4 with MXFP4 storage only: the MXFP4 copy
            of the same rows that fp4 keeps for backward, instead of converting x_q's FP8 codes.
            :func:`gather_expert_tokens` makes the pair from bf16 tokens (the same bits as
            ``quantize_fp8_and_mxfp4`` of the gathered rows, which the experts run without x_q).
    x_saved_rows: optional int64 [R], with x_saved only: x_saved then holds token rows [T', H] and row r
            of x is x_saved's row x_saved_rows[r] (each in [0, T'); not checked: a host sync). Each token
            is kept once rather than once per expert row; backward converts the rows in place.
    grad_slot: optional :class:`moe_fp4.exchange.ep.GradSlot`, given to the EP combine that alone reads the
            output: the output's gradient then arrives there as MXFP4 or FP8 rows, which backward converts
            to its two FP8 operands directly (the gradient passed through autograd is a stand-in).
    fp8_weights: optional ((W13, W13^T), (W2, W2^T)), FP8WeightTensors of w13 and w2 as
            :func:`moe_fp4.gemm.engines.quantize_fp8_weight_pair` makes them: the FP8 weights the GEMMs read,
            instead of the process's cache (FP8_WEIGHTS) or, under torch.compile, a quantization in the graph.
            W13^T and W2^T may be None: backward then transposes W's codes (what it does without fp8_weights).
            w13 and w2 then give only their shape and dtype and take the gradients (a stand-in of their shape
            will do). bf16 ignores it.
    Everything kept goes through ``ctx.save_for_backward``, so ``torch.utils.checkpoint`` (and
    :func:`moe_fp4.model.moe.checkpoint`) around this call drops it and recomputes it.
    -> bf16 [R, H]: for each expert, (w * swiglu(x W13^T)) W2^T.
    """
    precision = Precision(precision)
    try:
        storage = StorageFormat(storage)
    except ValueError:
        raise ValueError(f"grouped_swiglu_experts: storage must be one of "
                         f"{', '.join(f.value for f in StorageFormat)}, got {storage!r}") from None
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"grouped_swiglu_experts: w13 [E, 2F, H] and w2 [E, H, F], got {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    n_exp, two_f, hidden = w13.shape
    if tuple(w2.shape) != (n_exp, hidden, two_f // 2) or two_f % 2:
        raise ValueError(f"grouped_swiglu_experts: w2 must be [E, H, F] = {(n_exp, hidden, two_f // 2)}, "
                         f"got {tuple(w2.shape)}")
    if isinstance(counts, torch.Tensor):
        # Device counts: checked by shape only (their values would be a host sync); x's rows are a static
        # bound, a multiple of 128, and the rows past the groups are padding.
        if counts.dtype not in (torch.int32, torch.int64) or tuple(counts.shape) != (n_exp,):
            raise ValueError(f"grouped_swiglu_experts: device counts must be int32/int64 [{n_exp}], got "
                             f"{counts.dtype} {tuple(counts.shape)}")
        if x.dim() != 2 or x.shape[1] != hidden or not rows_aligned(x.shape[0]):
            raise ValueError(f"grouped_swiglu_experts: with device counts x must be [R, {hidden}] with R a "
                             f"multiple of {TOKEN_ALIGN}, got {tuple(x.shape)}")
    else:
        counts = tuple(int(c) for c in counts)
        if len(counts) != n_exp or any(c < 0 or c % TOKEN_ALIGN for c in counts):
            raise ValueError(f"grouped_swiglu_experts: counts must be {n_exp} non-negative multiples of "
                             f"{TOKEN_ALIGN}, got {counts}")
        if tuple(x.shape) != (sum(counts), hidden):
            raise ValueError(f"grouped_swiglu_experts: x must be [sum(counts), H] = {(sum(counts), hidden)}, "
                             f"got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"grouped_swiglu_experts: x must be bfloat16, got {x.dtype}")
    if row_weights is not None:
        if row_weights.dtype != torch.float32 or tuple(row_weights.shape) != (x.shape[0],):
            raise ValueError(f"grouped_swiglu_experts: row_weights must be float32 [{x.shape[0]}], got "
                             f"{row_weights.dtype} {tuple(row_weights.shape)}")
        row_weights = row_weights.contiguous()
    if x_q is not None:
        if not isinstance(x_q, (MXFP4Tensor, FP8BlockTensor)):
            raise TypeError(f"grouped_swiglu_experts: x_q must be an MXFP4Tensor or FP8BlockTensor, "
                            f"got {type(x_q).__name__}")
        if (x_q.m, x_q.k) != tuple(x.shape):
            raise ValueError(f"grouped_swiglu_experts: x_q is [{x_q.m}, {x_q.k}], expected {tuple(x.shape)}")
    elif not x.is_contiguous():
        x = x.contiguous()
    if x_saved is not None:
        if not (precision is Precision.FP4 and storage is StorageFormat.MXFP4 and isinstance(x_q, FP8BlockTensor)):
            raise ValueError("grouped_swiglu_experts: x_saved goes with an FP8BlockTensor x_q in fp4 with MXFP4 "
                             f"storage, got precision {precision.value}, storage {storage.value}, x_q "
                             f"{type(x_q).__name__}")
        rows_want = x.shape[0] if x_saved_rows is None else None
        if not isinstance(x_saved, MXFP4Tensor) or x_saved.k != hidden or rows_want not in (None, x_saved.m):
            raise ValueError(f"grouped_swiglu_experts: x_saved must be an MXFP4Tensor "
                             f"{tuple(x.shape) if rows_want else '[T, ' + str(hidden) + ']'}, got "
                             f"{type(x_saved).__name__} {getattr(x_saved, 'shape', '')}")
    if x_saved_rows is not None:
        if x_saved is None:
            raise ValueError("grouped_swiglu_experts: x_saved_rows goes with x_saved")
        if not isinstance(x_saved_rows, torch.Tensor) or x_saved_rows.dtype != torch.int64 or \
                tuple(x_saved_rows.shape) != (x.shape[0],) or x_saved_rows.device != x_saved.data.device:
            raise ValueError(f"grouped_swiglu_experts: x_saved_rows must be int64 [{x.shape[0]}] on "
                             f"{x_saved.data.device}, got {getattr(x_saved_rows, 'dtype', type(x_saved_rows))} "
                             f"{tuple(getattr(x_saved_rows, 'shape', ()))}")
    pairs = None if precision is Precision.BF16 else _check_fp8_weights(fp8_weights, w13, w2)
    if torch.compiler.is_compiling() and grad_slot is None:
        return _compiled(x, w13, w2, row_weights, counts, precision, x_q, recompute_swiglu, storage, x_saved,
                         x_saved_rows, pairs)
    return _GroupedSwiGLU.apply(x, w13, w2, row_weights, counts, precision, x_q, bool(recompute_swiglu), storage,
                                x_saved, x_saved_rows, grad_slot, pairs)


def _check_fp8_weights(fp8_weights, w13: torch.Tensor, w2: torch.Tensor):
    """fp8_weights of grouped_swiglu_experts -> it, after checking its structure and shapes against w13 and w2."""
    if fp8_weights is None:
        return None
    # Checked as sequences: an FP8WeightTensor indexes by expert, so unpacking one would not fail.
    if not (isinstance(fp8_weights, (tuple, list)) and len(fp8_weights) == 2
            and all(isinstance(p, (tuple, list)) and len(p) == 2 for p in fp8_weights)):
        raise TypeError("grouped_swiglu_experts: fp8_weights must be ((W13, W13^T), (W2, W2^T))")
    (a, at), (b, bt) = fp8_weights
    for name, t, want in (("W13", a, w13.shape), ("W13^T", at, (*w13.shape[:1], w13.shape[2], w13.shape[1])),
                          ("W2", b, w2.shape), ("W2^T", bt, (*w2.shape[:1], w2.shape[2], w2.shape[1]))):
        if t is None and name.endswith("^T"):   # made in backward from W
            continue
        if not isinstance(t, FP8WeightTensor) or tuple(t.data.shape) != tuple(want):
            got = tuple(t.data.shape) if isinstance(t, FP8WeightTensor) else ()
            raise ValueError(f"grouped_swiglu_experts: fp8_weights' {name} must be an FP8WeightTensor "
                             f"{tuple(want)}, got {type(t).__name__} {got}")
    return (a, at), (b, bt)


def _compiled(x, w13, w2, row_weights, counts, precision, x_q, recompute_swiglu, storage, x_saved, x_saved_rows,
              pairs):
    """grouped_swiglu_experts under torch.compile: the op pair of :mod:`moe_fp4.model.experts_op` (the Function's
    bodies as two opaque nodes). Needs device counts and no compression scope (the saved-tensor hook does not
    run under compile)."""
    if not isinstance(counts, torch.Tensor):
        counts = torch.tensor(counts, dtype=torch.int64, device=x.device)
    if current_compression() is not None:
        raise RuntimeError("grouped_swiglu_experts: moe_fp4.compress_saved_activations does not run under "
                           "torch.compile; fp4 precision keeps its activations in MXFP4 itself")
    kind = "" if x_q is None else ("mxfp4" if isinstance(x_q, MXFP4Tensor) else "fp8")
    recipe = experts_op.Recipe(precision.value, storage.value, bool(recompute_swiglu), kind, x_saved is not None,
                               x_saved_rows is not None)
    return experts_op.experts(x, w13, w2, row_weights, counts, recipe, x_q, x_saved, x_saved_rows, pairs)


experts_op._FUNCTION.append(_GroupedSwiGLU)


__all__ = ["TOKEN_ALIGN", "Precision", "gather_expert_tokens", "grouped_swiglu_experts", "prefetch_fp8_weights",
           "quantize_expert_tokens"]
