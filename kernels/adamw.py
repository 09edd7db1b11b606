"""AdamW step fused with the FP8 weight quantization: Triton kernel, launcher and pure-torch reference.

The grouped FP8 GEMMs read each expert weight W [E, N, K] as 128x128-block FP8 codes, and dgrad reads
W^T. Made apart from the optimizer, that pair costs a pass over the weights every optimizer step
(read W, write two FP8 copies). The optimizer's update reads and writes W anyway, so here one program
per 128x128 block updates W, exp_avg and exp_avg_sq, then reads the new block back (just written by
the same program: from L2) and quantizes it, so the pair costs its own writes and no second read of W
from memory: faster than torch's fused AdamW followed by the pair (bench/tools/adamw_fp8.py,
bench/RESULTS.md).

Update, in float32 with the constants rounded to float32 once on the host (``AdamWScalars``):

    p = p * decay                                   decay = 1 - lr * weight_decay (decoupled)
    m = m * beta1 + g * (1 - beta1)
    v = v * beta2 + (g * g) * (1 - beta2)
    p = p - step_size * m / (sqrt(v) / bc2_sqrt + eps)
        step_size = lr / (1 - beta1^t), bc2_sqrt = sqrt(1 - beta2^t)

which is torch.optim.AdamW's update (same order as its single-tensor path; torch's fused kernel
computes some products in double). The FP8 pair is quantize_fp8_weight_pair of the stored new W
(in W's dtype), bit for bit. Division and square root are the correctly rounded ones, so under the
interpreter the kernel equals the reference bit for bit; on a GPU the compiler may contract a
multiply-add into an FMA, which moves m and v by an ulp or two of the terms that formed them, and W by
as much as that moves the update (tests/model/test_optim.py bounds both on a GPU).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_fp4.kernels.fp8 import WEIGHT_BLOCK, quantize_fp8_weight_128x128_ref, weight_block
from moe_fp4.kernels.triton_numerics import f32_to_bf16_rne, fp8_weight_block, pow2_f32, use_asm


@dataclass(frozen=True)
class AdamWScalars:
    """One AdamW step's float32 constants for a parameter at step t (t >= 1), each rounded to float32
    once from the double it is computed in (the kernel receives float32 arguments)."""

    decay: float
    beta1: float
    one_minus_beta1: float
    beta2: float
    one_minus_beta2: float
    step_size: float
    bc2_sqrt: float
    eps: float
    maximize: bool = False

    @staticmethod
    def at(step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
           maximize: bool = False) -> "AdamWScalars":
        if step < 1:
            raise ValueError(f"AdamWScalars.at: step counts from 1, got {step}")
        for name, val in (("lr", lr), ("eps", eps), ("weight_decay", weight_decay)):
            if not math.isfinite(val) or val < 0:
                raise ValueError(f"AdamWScalars.at: {name} must be finite and >= 0, got {val}")
        for name, val in (("beta1", beta1), ("beta2", beta2)):
            if not 0.0 <= val < 1.0:
                raise ValueError(f"AdamWScalars.at: {name} must be in [0, 1), got {val}")
        f32 = _f32
        return AdamWScalars(
            decay=f32(1.0 - lr * weight_decay), beta1=f32(beta1), one_minus_beta1=f32(1.0 - beta1),
            beta2=f32(beta2), one_minus_beta2=f32(1.0 - beta2), step_size=f32(lr / (1.0 - beta1 ** step)),
            bc2_sqrt=f32(math.sqrt(1.0 - beta2 ** step)), eps=f32(eps), maximize=maximize)


def _f32(x: float) -> float:
    """x rounded to the nearest float32 (as a Python float; struct, not a tensor: this runs per parameter
    per step on the host)."""
    return struct.unpack("f", struct.pack("f", x))[0]


@triton.jit
def _store_rne(ptr, offs, x):
    """Store float32 x at ptr + offs in ptr's element type, rounded to nearest even. bf16 through
    f32_to_bf16_rne: the interpreter's float32 -> bf16 cast truncates."""
    if ptr.dtype.element_ty == tl.bfloat16:
        y = f32_to_bf16_rne(x)
    else:
        y = x.to(ptr.dtype.element_ty)
    tl.store(ptr + offs, y)


@triton.jit
def _adamw_fp8_weight_kernel(p_ptr, g_ptr, m_ptr, v_ptr, q_ptr, qt_ptr, s_ptr, N, K, NB, KB,
                             decay, beta1, one_minus_beta1, beta2, one_minus_beta2, step_size, bc2_sqrt, eps,
                             MAXIMIZE: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                             ASM: tl.constexpr, WRITE_T: tl.constexpr):
    # One program per 128x128 block (bn, bk) of matrix e: the block's AdamW update, then its FP8
    # codes for W [N, K] (and W^T [K, N] with WRITE_T) and its scale (the math of quantize_fp8_weight_128x128).
    # The update runs over CHUNK-row slices (a loop, not unrolled): four whole float32 tiles in
    # registers spilled (sm_90a, 16 warps: 128 registers, 204 local loads and stores). The quantizer
    # then reads the new block back; this program has just written it, so that read is served by L2.
    bn = tl.program_id(0)
    bk = tl.program_id(1)
    e = tl.program_id(2)
    cols = bk * BLOCK + tl.arange(0, BLOCK)
    base = e.to(tl.int64) * N * K
    for i in range(0, BLOCK // CHUNK):
        rows = bn * BLOCK + i * CHUNK + tl.arange(0, CHUNK)
        offs = base + rows[:, None].to(tl.int64) * K + cols[None, :]
        p = tl.load(p_ptr + offs).to(tl.float32)
        g = tl.load(g_ptr + offs).to(tl.float32)
        m = tl.load(m_ptr + offs).to(tl.float32)
        v = tl.load(v_ptr + offs).to(tl.float32)
        if MAXIMIZE:
            g = -g
        p = p * decay
        m = m * beta1 + g * one_minus_beta1
        v = v * beta2 + (g * g) * one_minus_beta2
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - tl.div_rn(step_size * m, denom)
        _store_rne(p_ptr, offs, p)
        _store_rne(m_ptr, offs, m)
        _store_rne(v_ptr, offs, v)
    tl.debug_barrier()   # the block's new values, written by all of this program's threads, visible to all
    _, _, _, offs, offs_t = weight_block(N, K, BLOCK)
    q, S = fp8_weight_block(tl.load(p_ptr + offs).to(tl.float32), ASM)
    tl.store(q_ptr + offs, q)
    if WRITE_T:
        tl.store(qt_ptr + offs_t, tl.trans(q))
    tl.store(s_ptr + (e * NB + bn) * KB + bk, pow2_f32(S))


def _check(p, g, m, v, fn):
    if p.dim() != 3:
        raise ValueError(f"{fn}: expected p [E, N, K], got {tuple(p.shape)}")
    if p.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"{fn}: p must be float32/bf16/fp16, got {p.dtype}")
    n, k = p.shape[-2:]
    if n % WEIGHT_BLOCK or k % WEIGHT_BLOCK:
        raise ValueError(f"{fn}: N = {n} and K = {k} must be multiples of {WEIGHT_BLOCK}")
    for name, t in (("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if t.shape != p.shape or t.device != p.device:
            raise ValueError(f"{fn}: {name} is {tuple(t.shape)} on {t.device}, p is {tuple(p.shape)} on {p.device}")
        if not t.dtype.is_floating_point or t.dtype.itemsize < 2:
            raise TypeError(f"{fn}: {name} must be float32/bf16/fp16, got {t.dtype}")
    for name, t in (("p", p), ("grad", g), ("exp_avg", m), ("exp_avg_sq", v)):
        if not t.is_contiguous():
            raise ValueError(f"{fn}: {name} must be contiguous")


def _outputs(p, write_t: bool, out=None):
    e, n, k = p.shape
    shapes = ((e, n, k), (e, n // WEIGHT_BLOCK, k // WEIGHT_BLOCK))
    if out is not None:
        q, scale = out
        if (q.dtype, scale.dtype) != (torch.float8_e4m3fn, torch.float32) or \
                (tuple(q.shape), tuple(scale.shape)) != shapes or not (q.is_contiguous() and scale.is_contiguous()):
            raise ValueError(f"adamw_fp8_weight_step: out must be contiguous float8_e4m3fn {shapes[0]} and float32 "
                             f"{shapes[1]}, got {q.dtype} {tuple(q.shape)} and {scale.dtype} {tuple(scale.shape)}")
    else:
        q = torch.empty(shapes[0], dtype=torch.float8_e4m3fn, device=p.device)
        scale = torch.empty(shapes[1], dtype=torch.float32, device=p.device)
    qt = torch.empty(e, k, n, dtype=torch.float8_e4m3fn, device=p.device) if write_t else None
    return q, qt, scale


def adamw_fp8_weight_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                          c: AdamWScalars, num_warps: int = 16, chunk: int = 32, asm: bool | None = None,
                          write_t: bool = True, out=None):
    """p: float32/bf16/fp16 [E, N, K] (N, K multiples of 128), g / m / v: float [E, N, K], all contiguous
    -> (data float8_e4m3fn [E, N, K], data_t float8_e4m3fn [E, K, N] or None without write_t, scale float32
    [E, N/128, K/128]): p, m and v updated in place by one AdamW step with the constants c, and the FP8 pair
    of the new p (quantize_fp8_weight_128x128 with write_q and write_t). ``out``: (data, scale) tensors of
    those shapes to write W into (and return) instead of new ones. Bit-identical to adamw_fp8_weight_step_ref
    under the interpreter. asm: None = the PTX rounding on sm_90+ outside the interpreter."""
    _check(p, g, m, v, "adamw_fp8_weight_step")
    if chunk < 1 or chunk & (chunk - 1) or WEIGHT_BLOCK % chunk:
        raise ValueError(f"adamw_fp8_weight_step: chunk (rows per slice) must be a power of two dividing "
                         f"{WEIGHT_BLOCK}, got {chunk}")
    q, qt, scale = _outputs(p, write_t, out)
    e, n, k = p.shape
    if p.numel():
        q8 = q.view(torch.uint8)
        _adamw_fp8_weight_kernel[(n // WEIGHT_BLOCK, k // WEIGHT_BLOCK, e)](
            p, g, m, v, q8, q8 if qt is None else qt.view(torch.uint8), scale, n, k, n // WEIGHT_BLOCK,
            k // WEIGHT_BLOCK, c.decay, c.beta1, c.one_minus_beta1, c.beta2, c.one_minus_beta2, c.step_size,
            c.bc2_sqrt, c.eps, MAXIMIZE=c.maximize, BLOCK=WEIGHT_BLOCK, CHUNK=chunk,
            ASM=use_asm(p) if asm is None else asm, WRITE_T=qt is not None, num_warps=num_warps)
    return q, qt, scale


# Correctly rounded float32 division and square root, as the kernel's div_rn / sqrt_rn: through
# float64, which rounds once more without error (53 >= 2 * 24 + 2 bits). torch's own float32 sqrt on
# CPU is not always correctly rounded (161 of 1024 random values differed, torch 2.13).
def _div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a.double() / b.double()).float()


def _sqrt_rn(a: torch.Tensor) -> torch.Tensor:
    return a.double().sqrt().float()


def adamw_fp8_weight_step_ref(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor,
                              c: AdamWScalars, num_warps: int = 16, chunk: int = 32, asm: bool | None = None,
                              write_t: bool = True, out=None):
    """Pure-torch twin of adamw_fp8_weight_step (num_warps, chunk and asm are ignored): the same float32
    operations in the same order, then quantize_fp8_weight_128x128_ref of the stored new p."""
    _check(p, g, m, v, "adamw_fp8_weight_step_ref")
    f = lambda x: torch.tensor(x, dtype=torch.float32, device=p.device)   # noqa: E731 - float32 constants
    gf = g.float()
    if c.maximize:
        gf = -gf
    pf = p.float() * f(c.decay)
    mf = m.float() * f(c.beta1) + gf * f(c.one_minus_beta1)
    vf = v.float() * f(c.beta2) + (gf * gf) * f(c.one_minus_beta2)
    denom = _div_rn(_sqrt_rn(vf), f(c.bc2_sqrt)) + f(c.eps)
    pf = pf - _div_rn(f(c.step_size) * mf, denom)
    p.copy_(pf)
    m.copy_(mf)
    v.copy_(vf)
    q, qt, scale = quantize_fp8_weight_128x128_ref(p, write_q=True, write_t=write_t)
    if out is None:
        return q, qt, scale
    dq, ds = _outputs(p, False, out)[::2]
    dq.copy_(q)
    ds.copy_(scale)
    return dq, qt, ds
