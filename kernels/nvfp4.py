"""NVFP4 (issue 27): E2M1 values, one E4M3 scale per 16 elements, one float32 scale per tensor.

The exact pure-torch references: the definition the Triton kernels (not written yet) will be tested
against bit for bit, as for MXFP4. The rules, in float32 unless said otherwise (DESIGN.md section 3):

1. tensor scale: s_t = max(amax_t / 2688, 2^-126), one float32 division; amax_t is the largest |x| over
   the finite elements (NaN and +-Inf ignored, 0 for a tensor with none). 2688 = 448 * 6 maps amax_t onto
   the largest E4M3 scale times the largest E2M1 value. The floor keeps s_t a float32 normal, so a zero
   or tiny tensor needs no special case: its blocks round to zero scales.
2. block scale, per 16 consecutive elements of a row: r = amax_b / fl(6 * s_t) (two float32 roundings),
   stored as the E4M3 code of r rounded to nearest even, saturating at 448 (``encode_e4m3``); E4M3
   subnormals are used. A block holding NaN or +-Inf gets the E4M3 NaN byte 0x7F.
3. elements: with the block's effective scale S = fl(e4m3(code) * s_t), each value x / S (one float32
   division) is rounded to the nearest E2M1 value, ties to even, saturating at +-6 (``encode_e2m1``),
   sign kept (-0 for a small negative). A block whose scale code is 0 (r below half the smallest E4M3
   subnormal, 2^-10) has S = 0 and stores signed zeros; a NaN block stores codes 0.
4. dequantize: fl(fl(e2m1 * e4m3) * s_t) in float32 (the first product is exact), rounded once to the
   output dtype; a NaN block gives NaN (the canonical bits of ``NAN_BITS``).
"""

from __future__ import annotations

import torch

from moe_fp4.kernels.numerics import (
    E2M1_MAX,
    E4M3_MAX,
    E4M3_NAN_BYTE,
    Rounding,
    decode_e2m1,
    encode_e2m1,
    encode_e2m1_stochastic,
    encode_e4m3,
    finite_abs,
    pack_nibbles,
    random_bits,
    unpack_nibbles,
    with_canonical_nan,
)

NVFP4_BLOCK = 16
# amax_t / NVFP4_TENSOR_DIVISOR maps a tensor's largest finite magnitude onto E4M3_MAX * E2M1_MAX.
NVFP4_TENSOR_DIVISOR = E4M3_MAX * E2M1_MAX
# Floor of the tensor scale: float32's smallest normal.
NVFP4_TENSOR_SCALE_MIN = 2.0 ** -126


def nvfp4_tensor_scale_ref(x: torch.Tensor) -> torch.Tensor:
    """x: bf16/fp16/fp32 [...] -> float32 0-d: max(amax of the finite |x| / 2688, 2^-126) (rule 1)."""
    amax = finite_abs(x.float()).amax() if x.numel() else torch.zeros((), device=x.device)
    s = amax / torch.tensor(NVFP4_TENSOR_DIVISOR, dtype=torch.float32, device=x.device)
    return s.clamp(min=NVFP4_TENSOR_SCALE_MIN)


def quantize_nvfp4_ref(x: torch.Tensor, tensor_scale: torch.Tensor | None = None,
                       rounding: Rounding = Rounding.NEAREST, seed: int = 0, step: int = 0, rank: int = 0):
    """x: bf16/fp16/fp32 [M, K], K % 16 == 0; tensor_scale: float32 0-d (default: rule 1 from x)
    -> (data uint8 [M, K/2] two E2M1 codes a byte (element 2i in the low nibble), scale float8_e4m3fn
    [M, K/16], tensor_scale float32 0-d). A given tensor_scale lets a tensor be quantized in pieces
    with one scale (it must be a positive float32 normal). rounding STOCHASTIC rounds the elements with
    ``encode_e2m1_stochastic`` and the bits ``random_bits(seed, step, rank, M * K)`` (scales as for
    NEAREST; unbiased except where an element exceeds 6 S, which rule 2's saturation can cause)."""
    m, k = x.shape
    xf = x.float()
    s_t = nvfp4_tensor_scale_ref(xf) if tensor_scale is None else tensor_scale.to(torch.float32).reshape(())
    blocks = xf.view(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    nonfinite = (~torch.isfinite(blocks)).any(dim=-1)
    amax_b = finite_abs(blocks).amax(dim=-1) if k else torch.zeros(m, 0, device=x.device)
    r = amax_b / (6.0 * s_t)                                           # rule 2: fl(6 * s_t), then the division
    code = encode_e4m3(r.clamp(max=E4M3_MAX))
    nan_byte = torch.full_like(code.view(torch.uint8), E4M3_NAN_BYTE)
    code = torch.where(nonfinite, nan_byte, code.view(torch.uint8)).view(torch.float8_e4m3fn)
    eff = torch.where(nonfinite, torch.zeros_like(r), code.float() * s_t)   # rule 3: S = fl(e4m3 * s_t)
    safe = torch.where(eff > 0, eff, torch.ones_like(eff))[..., None]
    v = torch.where((eff > 0)[..., None], blocks / safe, blocks * 0.0)     # S = 0: signed zeros
    v = torch.where(nonfinite[..., None], torch.zeros_like(v), v)          # NaN block: codes 0
    v = v.view(m, k)
    if Rounding(rounding) is Rounding.STOCHASTIC:
        codes = encode_e2m1_stochastic(v, random_bits(seed, step, rank, m * k, x.device).view(m, k))
    else:
        codes = encode_e2m1(v)
    return pack_nibbles(codes), code, s_t


def dequantize_nvfp4_ref(data: torch.Tensor, scale: torch.Tensor, tensor_scale: torch.Tensor,
                         dtype: torch.dtype) -> torch.Tensor:
    """data uint8 [M, K/2], scale float8_e4m3fn [M, K/16], tensor_scale float32 0-d -> dtype [M, K]
    (rule 4)."""
    m, half_k = data.shape
    k = 2 * half_k
    vals = decode_e2m1(unpack_nibbles(data)).view(m, k // NVFP4_BLOCK, NVFP4_BLOCK)
    sv = scale.float()
    nan = torch.isnan(sv)
    out = (vals * torch.where(nan, torch.zeros_like(sv), sv)[..., None]) * tensor_scale.to(torch.float32)
    return with_canonical_nan(out.to(dtype), nan[..., None]).view(m, k)
