"""Grouped SwiGLU expert MLPs with FP8 GEMMs and MXFP4 activation storage (one autograd Function).

Rows arrive permuted by expert and padded so that every expert's group is a multiple of
``TOKEN_ALIGN`` = 128 rows: the weight-gradient GEMMs contract over tokens in 1x128 tiles, and a
tile must not straddle two experts. Expert e owns rows ``offsets[e] : offsets[e] + counts[e]``.

What each precision keeps for backward (DESIGN.md, "Where MXFP4 is used"):

| tensor          | bf16 | fp8 (DeepSeek-V3 baseline)      | fp4                                   |
| --------------- | ---- | ------------------------------- | ------------------------------------- |
| FC1 input x     | bf16 | FP8 1x128 (the fprop operand)   | MXFP4 (fused with the FP8 cast, or as received) |
| SwiGLU input h  | bf16 | bf16                            | MXFP4                                 |
| FC2 input a     | bf16 | FP8 1x128 (the fprop operand)   | MXFP4 (fused with the FP8 cast)       |

Backward builds the weight-gradient operands from what was kept: ``fp8_to_fp8_colwise`` (fp8) or
``mxfp4_to_fp8_colwise`` (fp4) per expert, and ``quantize_fp8_colwise`` for the output gradient.
The FP8 weights (128x128 blocks) are not kept: backward quantizes W^T for dgrad again from the
master weights (one pass writing the transposed codes; bit-identical to transposing the forward's).

Inside :func:`moe_fp4.compress_saved_activations` with ``compress_fp8=True``, the fp8 precision
stores its FP8 activations as MXFP4 converted directly from the FP8 codes (no BF16 round trip); its
bf16 SwiGLU input goes through ``save_for_backward``, where that hook compresses it. Nothing is
compressed twice: the quantized containers live on ``ctx`` where the hook never sees them.
"""

from __future__ import annotations

import enum

import torch

from moe_fp4.api import (
    dequantize_mxfp4,
    fp8_to_fp8_colwise,
    mxfp4_to_fp8,
    mxfp4_to_fp8_colwise,
    quantize_fp8,
    quantize_fp8_and_mxfp4,
    quantize_mxfp4,
)
from moe_fp4.formats import FP8BlockTensor, MXFP4Tensor
from moe_fp4.gemm import fp8_mm_nt, quantize_fp8_colwise, quantize_fp8_weight
from moe_fp4.hook import current_compression
from moe_fp4.saved import label_saved, report_saved

TOKEN_ALIGN = 128


class Precision(str, enum.Enum):
    BF16 = "bf16"  # every GEMM in bf16, every saved activation in bf16
    FP8 = "fp8"    # FP8 GEMMs, DeepSeek-V3 storage (the baseline)
    FP4 = "fp4"    # FP8 GEMMs, activations saved in MXFP4


def swiglu(h: torch.Tensor) -> torch.Tensor:
    """h: bf16 [M, 2F] = [gate | up] -> bf16 [M, F] = silu(gate) * up, computed in float32."""
    gate, up = h.float().chunk(2, dim=-1)
    return (torch.nn.functional.silu(gate) * up).to(h.dtype)


def swiglu_backward(h: torch.Tensor, da: torch.Tensor) -> torch.Tensor:
    """h: [M, 2F], da: [M, F] (gradient of swiglu(h)) -> [M, 2F] gradient of h, in h's dtype."""
    gate, up = h.float().chunk(2, dim=-1)
    da = da.float()
    sig = torch.sigmoid(gate)
    silu = gate * sig
    d_gate = da * up * sig * (1 + gate * (1 - sig))
    return torch.cat([d_gate, da * silu], dim=-1).to(h.dtype)


def padded_offsets(counts) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def _keep_fp8(label: str, t: FP8BlockTensor):
    """The fp8 precision's saved FP8 activation: as is, or MXFP4 straight from its codes when the
    compression hook asks for it."""
    scope = current_compression()
    if scope is not None and scope.config.compress_fp8:
        q = quantize_mxfp4(t)
        scope.record_internal(t.nbytes, q.nbytes)
        t = q
    report_saved(label, t)
    return t


def _colwise(kept, start: int, stop: int) -> FP8BlockTensor:
    """Rows start..stop-1 of a kept activation -> FP8BlockTensor [K, stop-start] in 1x128 tiles along tokens."""
    if isinstance(kept, MXFP4Tensor):
        return mxfp4_to_fp8_colwise(kept.rows(start, stop))
    return fp8_to_fp8_colwise(kept.rows(start, stop))


class _GroupedSwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w13, w2, counts, precision, x_q):
        offsets = padded_offsets(counts)
        rows, hidden = (x_q.m, x_q.k) if x_q is not None else x.shape
        ffn = w2.shape[-1]
        ctx.precision = precision
        groups = [(e, o, o + c) for e, (o, c) in enumerate(zip(offsets, counts)) if c > 0]
        ctx.groups = groups
        h = x.new_empty(rows, 2 * ffn) if x_q is None else torch.empty(rows, 2 * ffn, dtype=torch.bfloat16,
                                                                         device=x_q.device)
        y = torch.empty(rows, hidden, dtype=h.dtype, device=h.device)

        if precision is Precision.BF16:
            w13c, w2c = w13.to(h.dtype), w2.to(h.dtype)
            xin = x if x_q is None else x_q.dequantize(h.dtype)
            for e, s, t in groups:
                torch.mm(xin[s:t], w13c[e].t(), out=h[s:t])
            a = swiglu(h)
            for e, s, t in groups:
                torch.mm(a[s:t], w2c[e].t(), out=y[s:t])
            for tensor, label in ((xin, "fc1_input"), (h, "swiglu_input"), (a, "fc2_input")):
                label_saved(tensor, label)
            ctx.save_for_backward(w13, w2, xin, h, a)
            return y

        w13q, w2q = quantize_fp8_weight(w13), quantize_fp8_weight(w2)
        if isinstance(x_q, MXFP4Tensor):
            xq = mxfp4_to_fp8(x_q)
            ctx.x_kept = x_q
            report_saved("fc1_input", x_q)
        elif isinstance(x_q, FP8BlockTensor):
            xq = x_q
            if precision is Precision.FP4:
                ctx.x_kept = quantize_mxfp4(x_q)
                report_saved("fc1_input", ctx.x_kept)
            else:
                ctx.x_kept = _keep_fp8("fc1_input", x_q)
        elif precision is Precision.FP4:
            xq, x_mx_new = quantize_fp8_and_mxfp4(x)
            ctx.x_kept = x_mx_new
            report_saved("fc1_input", x_mx_new)
        else:
            xq = quantize_fp8(x)
            ctx.x_kept = _keep_fp8("fc1_input", xq)
        for e, s, t in groups:
            h[s:t] = fp8_mm_nt(xq.rows(s, t), w13q[e], h.dtype)
        del xq
        a = swiglu(h)
        if precision is Precision.FP4:
            aq, ctx.a_kept = quantize_fp8_and_mxfp4(a)
            ctx.h_kept = quantize_mxfp4(h)
            report_saved("fc2_input", ctx.a_kept)
            report_saved("swiglu_input", ctx.h_kept)
            ctx.save_for_backward(w13, w2)
        else:
            aq = quantize_fp8(a)
            ctx.a_kept = _keep_fp8("fc2_input", aq)
            label_saved(h, "swiglu_input")
            ctx.save_for_backward(w13, w2, h)
        del w13q
        for e, s, t in groups:
            y[s:t] = fp8_mm_nt(aq.rows(s, t), w2q[e], y.dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        precision, groups = ctx.precision, ctx.groups
        need_dx = ctx.needs_input_grad[0]
        dy = dy.contiguous()
        if precision is Precision.BF16:
            w13, w2, xin, h, a = ctx.saved_tensors
        elif precision is Precision.FP4:
            w13, w2 = ctx.saved_tensors
            h = dequantize_mxfp4(ctx.h_kept, dy.dtype)
        else:
            w13, w2, h = ctx.saved_tensors
        dw13 = torch.zeros_like(w13) if ctx.needs_input_grad[1] else None
        dw2 = torch.zeros_like(w2) if ctx.needs_input_grad[2] else None
        da = torch.empty(dy.shape[0], w2.shape[-1], dtype=dy.dtype, device=dy.device)

        if precision is Precision.BF16:
            w13c, w2c = w13.to(dy.dtype), w2.to(dy.dtype)
            for e, s, t in groups:
                torch.mm(dy[s:t], w2c[e], out=da[s:t])
                if dw2 is not None:
                    dw2[e] = (dy[s:t].t() @ a[s:t]).to(dw2.dtype)
            dh = swiglu_backward(h, da)
            dx = torch.empty(dy.shape[0], w13.shape[-1], dtype=dy.dtype, device=dy.device) if need_dx else None
            for e, s, t in groups:
                if dx is not None:
                    torch.mm(dh[s:t], w13c[e], out=dx[s:t])
                if dw13 is not None:
                    dw13[e] = (dh[s:t].t() @ xin[s:t]).to(dw13.dtype)
            return dx, dw13, dw2, None, None, None

        dyq = quantize_fp8(dy)
        w2qt = quantize_fp8_weight(w2, transposed=True)
        for e, s, t in groups:
            da[s:t] = fp8_mm_nt(dyq.rows(s, t), w2qt[e], da.dtype)
            if dw2 is not None:
                dw2[e] = fp8_mm_nt(quantize_fp8_colwise(dy[s:t]), _colwise(ctx.a_kept, s, t), dw2.dtype)
        del dyq, w2qt
        dh = swiglu_backward(h, da)
        del h, da
        dx = torch.empty(dy.shape[0], w13.shape[-1], dtype=dy.dtype, device=dy.device) if need_dx else None
        dhq = quantize_fp8(dh) if need_dx else None
        w13qt = quantize_fp8_weight(w13, transposed=True) if need_dx else None
        for e, s, t in groups:
            if dx is not None:
                dx[s:t] = fp8_mm_nt(dhq.rows(s, t), w13qt[e], dx.dtype)
            if dw13 is not None:
                dw13[e] = fp8_mm_nt(quantize_fp8_colwise(dh[s:t]), _colwise(ctx.x_kept, s, t), dw13.dtype)
        return dx, dw13, dw2, None, None, None


def grouped_swiglu_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, counts, precision="fp8",
                           x_q: MXFP4Tensor | FP8BlockTensor | None = None) -> torch.Tensor:
    """SwiGLU expert MLPs over rows grouped by expert.

    x:      bf16 [R, H], rows grouped by expert (expert e owns ``counts[e]`` consecutive rows, each
            count a multiple of 128; padding rows are zero), R = sum(counts). With ``x_q`` given,
            x only carries the gradient: any bf16 tensor of shape [R, H] (e.g. a zero-stride
            ``expand`` of a 0-d tensor) whose ``.grad`` hook receives d(loss)/d(input).
    w13:    bf16/fp32 [E, 2F, H]: gate rows 0..F-1, up rows F..2F-1.
    w2:     bf16/fp32 [E, H, F].
    counts: E ints, multiples of 128.
    precision: "bf16" | "fp8" | "fp4" (or :class:`Precision`).
    x_q:    optional MXFP4Tensor or FP8BlockTensor [R, H], the input as received from the all-to-all.
            MXFP4 is converted to FP8 directly for the GEMM and kept as is for backward; FP8 is the
            GEMM operand itself, kept as is (fp8) or converted FP8 -> MXFP4 directly (fp4). bf16
            precision dequantizes it.
    -> bf16 [R, H]: for each expert, swiglu(x W13^T) W2^T.
    """
    precision = Precision(precision)
    if w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"grouped_swiglu_experts: w13 [E, 2F, H] and w2 [E, H, F], got {tuple(w13.shape)}, "
                         f"{tuple(w2.shape)}")
    n_exp, two_f, hidden = w13.shape
    if tuple(w2.shape) != (n_exp, hidden, two_f // 2) or two_f % 2:
        raise ValueError(f"grouped_swiglu_experts: w2 must be [E, H, F] = {(n_exp, hidden, two_f // 2)}, "
                         f"got {tuple(w2.shape)}")
    counts = tuple(int(c) for c in counts)
    if len(counts) != n_exp or any(c < 0 or c % TOKEN_ALIGN for c in counts):
        raise ValueError(f"grouped_swiglu_experts: counts must be {n_exp} non-negative multiples of "
                         f"{TOKEN_ALIGN}, got {counts}")
    if tuple(x.shape) != (sum(counts), hidden):
        raise ValueError(f"grouped_swiglu_experts: x must be [sum(counts), H] = {(sum(counts), hidden)}, "
                         f"got {tuple(x.shape)}")
    if x.dtype != torch.bfloat16:
        raise TypeError(f"grouped_swiglu_experts: x must be bfloat16, got {x.dtype}")
    if x_q is not None:
        if not isinstance(x_q, (MXFP4Tensor, FP8BlockTensor)):
            raise TypeError(f"grouped_swiglu_experts: x_q must be an MXFP4Tensor or FP8BlockTensor, "
                            f"got {type(x_q).__name__}")
        if (x_q.m, x_q.k) != tuple(x.shape):
            raise ValueError(f"grouped_swiglu_experts: x_q is [{x_q.m}, {x_q.k}], expected {tuple(x.shape)}")
    elif not x.is_contiguous():
        x = x.contiguous()
    return _GroupedSwiGLU.apply(x, w13, w2, counts, precision, x_q)
