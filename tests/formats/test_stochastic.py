"""Stochastic rounding of the E2M1 codes: Triton's Philox reproduced bit for bit
in torch, the rounding rule against a brute-force reading of it, reproducibility, and unbiasedness of
MXFP4 and NVFP4 against nearest rounding's bias, and the MXFP4 kernel bit for bit against its reference
(the Philox check runs Triton's own ``tl.philox`` under the interpreter on CPU, or compiled on a GPU)."""

import numpy as np
import pytest
import torch
import triton
import triton.language as tl
from helpers import binade_blocks

import moe_fp4
import moe_fp4.formats.reference
from moe_fp4.kernels.numerics import encode_e2m1_stochastic, philox4x32, random_bits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
MAGS = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# Unbiasedness: the mean of N stochastic quantizations of a fixed tensor is within this many standard
# errors of the tensor, element by element (each rounding error is bounded by the grid spacing d times
# the scale, so its standard deviation is at most d * scale / 2). 6 sigma over 2048 elements: a false
# alarm about once in 10^6 runs.
SIGMAS = 6.0
SR_SAMPLES = 400
# The samples as SR_STEPS calls (steps 0..SR_STEPS-1) on SR_SAMPLES / SR_STEPS stacked copies of the tensor:
# Philox's counter is the element's position, so every copy of an element draws its own bits, and every
# step a new stream. Through the torch reference: the kernels equal it bit for bit (the kernel tests here
# and in test_nvfp4.py, and the API call below), and 400 interpreter calls took about 40 s per format.
SR_STEPS = 20


@triton.jit
def _philox_kernel(out_ptr, c0_ptr, c1_ptr, seed, step, rank, N: tl.constexpr):
    i = tl.arange(0, N)
    c0 = tl.load(c0_ptr + i).to(tl.uint32)
    c1 = tl.load(c1_ptr + i).to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, step + c0 * 0, rank + c0 * 0)
    tl.store(out_ptr + i * 4, r0.to(tl.int64))
    tl.store(out_ptr + i * 4 + 1, r1.to(tl.int64))
    tl.store(out_ptr + i * 4 + 2, r2.to(tl.int64))
    tl.store(out_ptr + i * 4 + 3, r3.to(tl.int64))


@pytest.mark.parametrize("seed", [0, 1, 0x1234567890ABCDEF, 2**64 - 1])
def test_philox_matches_triton_bit_for_bit(seed):
    n = 64
    g = torch.Generator().manual_seed(seed % 1000)
    c0 = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    c1 = torch.randint(0, 2**32, (n,), generator=g, dtype=torch.int64)
    out = torch.zeros(4 * n, dtype=torch.int64, device=DEVICE)
    # int32 views of the counters: the kernel reads them back as uint32 bit patterns.
    as_i32 = lambda t: (t - (t >= 2**31).long() * 2**32).to(torch.int32).to(DEVICE)  # noqa: E731
    _philox_kernel[(1,)](out, as_i32(c0), as_i32(c1), seed, 7, 3, N=n)
    ref = torch.stack(philox4x32(seed, c0, c1, 7, 3), -1).flatten()
    assert torch.equal(out.cpu() & 0xFFFFFFFF, ref)


def test_random_bits_are_reproducible_and_distinct_per_step_and_rank():
    a = random_bits(5, 0, 0, 4096)
    assert torch.equal(a, random_bits(5, 0, 0, 4096))
    for other in (random_bits(5, 1, 0, 4096), random_bits(5, 0, 1, 4096), random_bits(6, 0, 0, 4096)):
        assert (a != other).float().mean() > 0.99
    u = a.double() * 2.0 ** -16
    assert abs(u.mean().item() - 0.5) < 0.02 and (a >= 0).all() and (a < 2**16).all()


def test_random_bits_are_halves_of_philox_words_eight_elements_a_call():
    # Element o: half o % 2 (low first) of word (o % 8) // 2 at the counter (o // 8, 0, step, rank).
    n = 8 * 40 + 3
    bits = random_bits(2**40 + 9, 6, 2**32 - 1, n)
    g = torch.arange(n) // 8
    words = torch.stack(philox4x32(2**40 + 9, g, g * 0, 6, 2**32 - 1), -1)
    o = torch.arange(n)
    want = (words[o, (o % 8) // 2] >> (16 * (o % 2))) & 0xFFFF
    assert torch.equal(bits, want)
    assert random_bits(1, 0, 0, 0).numel() == 0


def test_the_rounding_rule_by_brute_force():
    """Every element: the lower grid neighbour, or the upper one when u < (a - lo) / (hi - lo)."""
    g = torch.Generator().manual_seed(3)
    v = torch.cat([torch.randn(3000, generator=g) * 3, torch.tensor([0.0, -0.0, 6.0, -7.5, 0.25, 5.0, 1e-30])])
    bits = torch.randint(0, 2**16, v.shape, generator=g, dtype=torch.int64)
    bits[:8] = torch.tensor([0, 2**16 - 1, 2**15, 255, 256, 1, 12345, 2**16 - 256])
    got = encode_e2m1_stochastic(v, bits)
    for x, b, c in zip(v.tolist(), bits.tolist(), got.tolist()):
        a = min(abs(x), 6.0)
        lo = max(i for i, m in enumerate(MAGS) if m <= a)
        up = lo < 7 and np.float32(b * 2.0 ** -16) < np.float32((a - MAGS[lo]) / (MAGS[lo + 1] - MAGS[lo]))
        want = (lo + int(up)) | (8 if np.signbit(x) else 0)
        assert c == want, (x, b, c, want)


def _element_scale(q) -> torch.Tensor:
    """The scale each element's code multiplies: 2^(byte - 127) (MXFP4) or fl(e4m3 * s_t) (NVFP4)."""
    if isinstance(q, moe_fp4.MXFP4Tensor):
        return torch.exp2(q.scale.float() - 127).repeat_interleave(32, dim=1)
    return (q.scale.float() * q.tensor_scale).repeat_interleave(16, dim=1)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4"])
def test_stochastic_rounding_is_unbiased_where_nearest_is_not(fmt):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(16, 128, generator=g)
    # Rows whose every other element repeats one off-grid value: nearest rounding's error on those does not
    # average out (the others, 1.0, set each block's scale).
    odd = torch.arange(128) % 2 == 1
    x[0] = torch.where(odd, 0.3, 1.0) * torch.sign(x[0])
    x[1] = torch.where(odd, 0.7, 1.0) * torch.sign(x[1])
    quant = moe_fp4.quantize_mxfp4 if fmt == "mxfp4" else moe_fp4.quantize_nvfp4
    ref = moe_fp4.formats.reference.quantize_mxfp4 if fmt == "mxfp4" else moe_fp4.formats.reference.quantize_nvfp4
    deq = moe_fp4.formats.reference.dequantize_mxfp4 if fmt == "mxfp4" else moe_fp4.formats.reference.dequantize_nvfp4
    near_q = quant(x)
    # What the statistics below hold for is what the API returns: one call, bit for bit.
    api, want = quant(x, rounding="stochastic", seed=7, step=3), ref(x, rounding="stochastic", seed=7, step=3)
    assert torch.equal(api.data, want.data) and torch.equal(api.scale.view(torch.uint8), want.scale.view(torch.uint8))
    copies = SR_SAMPLES // SR_STEPS
    stacked = x.repeat(copies, 1)
    acc = torch.zeros_like(x)
    for step in range(SR_STEPS):
        acc += deq(ref(stacked, rounding="stochastic", seed=7, step=step), torch.float32).view(copies, *x.shape).sum(0)
    mean = acc / SR_SAMPLES
    scale = _element_scale(near_q)               # the same scales in both roundings
    # An element's two neighbours are at most 2 * scale apart: its rounding error has a standard deviation
    # of at most scale. Elements above 6 * scale saturate (NVFP4's rounded E4M3 block scale can put a
    # block's largest element there): no rounding can be unbiased for them.
    inside = x.abs() <= 6 * scale
    bound = SIGMAS * scale / SR_SAMPLES ** 0.5
    assert ((mean - x).abs() <= bound)[inside].all(), ((mean - x).abs() / bound)[inside].max()
    near = near_q.dequantize(torch.float32)
    near_err, sr_err = (near - x)[:2, odd].abs().mean(), (mean - x)[:2, odd].abs().mean()
    assert near_err > 10 * sr_err, (near_err, sr_err)                      # nearest's bias, for contrast
    if fmt == "mxfp4":
        assert inside.all()                      # RCEIL scales never clip


def test_stochastic_api_reproducible_and_validated():
    x = torch.randn(8, 64)
    a = moe_fp4.quantize_mxfp4(x, rounding="stochastic", seed=1, step=2, rank=3)
    b = moe_fp4.quantize_mxfp4(x, rounding="stochastic", seed=1, step=2, rank=3)
    c = moe_fp4.quantize_mxfp4(x, rounding="stochastic", seed=1, step=2, rank=4)
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
    assert torch.equal(a.scale, moe_fp4.quantize_mxfp4(x).scale)        # the scales are nearest's
    with pytest.raises(ValueError, match="rounding must be one of"):
        moe_fp4.quantize_mxfp4(x, rounding="up")
    with pytest.raises(TypeError, match="seed must be an int"):
        moe_fp4.quantize_nvfp4(x, rounding="stochastic", seed=-1)
    with pytest.raises(ValueError, match="stochastic rounding takes"):
        moe_fp4.quantize_mxfp4(moe_fp4.quantize_fp8(torch.randn(8, 128)), rounding="stochastic")


def _hard_rows(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    """[m, k] values over many binades, with a NaN block, an Inf block, a zero block, a block at float32's
    smallest scales and one at its largest (rows permitting)."""
    g = torch.Generator().manual_seed(seed)
    x = binade_blocks(m, k, 32, 30, g)
    if m >= 2 and k >= 96:
        x[0, 5] = float("nan")
        x[0, 40] = float("-inf")
        x[0, 64:96] = 0.0
        x[1, :32] = torch.randn(32, generator=g) * 2.0 ** -130    # subnormal: the -127 exponent floor
        x[1, 32:64] = torch.randn(32, generator=g) * 2.0 ** 120
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(2, 96), (5, 1024), (1, 32), (3, 2080)])
def test_mxfp4_stochastic_kernel_equals_its_reference_bit_for_bit(dtype, shape):
    from moe_fp4.kernels.mxfp4 import quantize_mxfp4_stochastic, quantize_mxfp4_stochastic_ref

    x = _hard_rows(*shape, dtype, seed=shape[1]).to(DEVICE)
    if dtype == torch.float16:
        x = torch.nan_to_num(x.float(), posinf=float("inf"), neginf=float("-inf")).clamp(-6e4, 6e4).to(dtype)
        x[0, 5] = float("nan")
    for seed, step, rank in [(0, 0, 0), (2**64 - 1, 2**32 - 1, 2**31 + 5), (12345, 7, 1)]:
        got = quantize_mxfp4_stochastic(x, seed, step, rank)
        want = quantize_mxfp4_stochastic_ref(x, seed, step, rank)
        assert torch.equal(got[1], want[1]), "scales"
        assert torch.equal(got[0], want[0]), (got[0] != want[0]).sum()


def test_mxfp4_stochastic_kernel_empty_and_through_the_api():
    from moe_fp4.kernels.mxfp4 import quantize_mxfp4_stochastic

    d, s = quantize_mxfp4_stochastic(torch.zeros(0, 64, device=DEVICE), 1, 2, 3)
    assert d.shape == (0, 32) and s.shape == (0, 2)
    x = torch.randn(4, 3, 64, device=DEVICE, dtype=torch.bfloat16)
    q = moe_fp4.quantize_mxfp4(x, rounding="stochastic", seed=3, step=1, rank=2)
    r = moe_fp4.formats.reference.quantize_mxfp4(x, rounding="stochastic", seed=3, step=1, rank=2)
    assert q.shape == x.shape and torch.equal(q.data, r.data) and torch.equal(q.scale, r.scale)
