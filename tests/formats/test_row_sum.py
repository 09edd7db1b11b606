"""gather_sum (moe_fp4.kernels.row_sum): the Triton kernel against its pure-torch twin, raw bits equal; the twin
against the float32 index_add_ it replaces in the EP layer and the routing; the rounding at ties; bad input.

On CPU the kernel runs under the Triton interpreter (conftest); the `gpu` test repeats it at MoE sizes."""

from __future__ import annotations

import pytest
import torch
from helpers import same_bits

from moe_fp4.kernels.row_sum import gather_sum, gather_sum_ref

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _rows(n: int, h: int, dtype, seed: int, special: bool = True, device="cpu") -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * torch.exp2(torch.randint(-12, 12, (n, 1), generator=g).float())
    if special and n * h >= 8:
        flat = x.view(-1)
        flat[1], flat[5], flat[7] = float("nan"), float("inf"), float("-inf")
        flat[2] = -0.0
        # subnormal in bf16 and float32 (they share the exponent range): the GPU must not flush them
        flat[3] = 2.0 ** -130 if dtype != torch.float16 else 2.0 ** -20
    return x.to(dtype).to(device)


def _slots(m: int, s: int, n: int, seed: int, dtype=torch.int64, device="cpu") -> torch.Tensor:
    """[M, S] with valid rows, the empty markers the layers use (N, and out-of-range on both sides)."""
    g = torch.Generator().manual_seed(seed + 1)
    sl = torch.randint(-2, n + 3, (m, s), generator=g)
    return sl.to(dtype).to(device)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1, 1, 1), (37, 300, 23, 5), (64, 128, 70, 2), (9, 1024, 17, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_kernel_matches_reference(dtype, shape):
    n, h, m, s = shape
    x = _rows(n, h, dtype, seed=n + h)
    for slot_dtype in (torch.int64, torch.int32):
        sl = _slots(m, s, n, seed=m, dtype=slot_dtype)
        got, want = gather_sum(x, sl), gather_sum_ref(x, sl)
        assert got.shape == (m, h) and got.dtype == dtype
        assert same_bits(got, want)
    if n * h >= 8 and (sl == 1 // h).any():   # the planted NaN reaches the outputs that read its row
        assert torch.isnan(want).any()


def test_strided_rows_and_slots():
    """Rows with a row stride above H (a column slice of a wider buffer, as the EP layer's router-weight
    columns of its wire rows) and slots as a transposed view (the plan's [T, world] per-token rows)."""
    wide = _rows(40, 96, torch.float32, seed=3)
    x = wide[:, 16:80]
    assert x.stride() == (96, 1)
    sl_t = _slots(4, 29, 40, seed=5)       # [world, T] -> a [T, world] view
    sl = sl_t.t()
    assert not sl.is_contiguous()
    assert same_bits(gather_sum(x, sl), gather_sum_ref(x, sl))
    assert same_bits(gather_sum_ref(x, sl), gather_sum_ref(x.contiguous(), sl.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_is_index_add_in_ascending_order(dtype):
    """Each output's slots in ascending row order: the sum is index_add_'s into float32 zeros (sequential
    on CPU) rounded once, bit for bit; an empty slot adds nothing."""
    n, h, m = 200, 64, 50
    x = _rows(n, h, dtype, seed=7, special=False)
    g = torch.Generator().manual_seed(8)
    dst = torch.randint(0, m + 1, (n,), generator=g)   # m: a sink row, as the padding rows' index
    want = torch.zeros(m + 1, h).index_add_(0, dst, x.float())[:m].to(dtype)
    order = torch.argsort(dst, stable=True)
    counts = torch.bincount(dst, minlength=m + 1)
    s = int(counts[:m].max())
    slots = torch.full((m, s), n, dtype=torch.int64)
    start = torch.cumsum(counts, 0) - counts
    for r in range(m):
        rows_r = order[start[r]:start[r] + counts[r]]
        slots[r, :rows_r.numel()] = rows_r
    assert same_bits(gather_sum_ref(x, slots), want)
    assert same_bits(gather_sum(x, slots), want)


def test_rounds_once_to_nearest_even():
    """1 + 2^-8 and (1 + 2^-7) + 2^-8 lie halfway between bf16 neighbours: RNE gives 1 and 1 + 2^-6; a
    sum rounded per addition, or truncated (the interpreter's own float32 -> bf16 cast), would not."""
    x = torch.tensor([[1.0], [2.0 ** -8], [1.0 + 2.0 ** -7], [2.0 ** -9], [2.0 ** -9]], dtype=torch.float32)
    x = x.to(torch.bfloat16)
    sl = torch.tensor([[0, 1], [2, 1], [0, 3], [0, 5]])
    want = torch.tensor([1.0, 1.0 + 2.0 ** -6, 1.0, 1.0], dtype=torch.bfloat16)
    assert same_bits(gather_sum_ref(x, sl)[:, 0], want)
    assert same_bits(gather_sum(x, sl)[:, 0], want)
    # float32 accumulation: 2^-9 + 1 + 2^-9 + 2^-9 = 1 + 1.5 * 2^-8, above the tie: 1 + 2^-7; rounding to
    # bf16 after each addition would give 1
    sl3 = torch.tensor([[3, 0, 4, 4]])
    for fn in (gather_sum, gather_sum_ref):
        assert fn(x, sl3)[0, 0].item() == 1.0 + 2.0 ** -7


@pytest.mark.parametrize("shape", [(0, 8, 3, 2), (5, 8, 0, 2), (5, 0, 3, 2), (5, 8, 3, 0)],
                         ids=["no_rows", "no_outputs", "no_columns", "no_slots"])
def test_empty(shape):
    n, h, m, s = shape
    x = torch.randn(n, h).to(torch.bfloat16)
    sl = torch.zeros(m, s, dtype=torch.int64)
    got, want = gather_sum(x, sl), gather_sum_ref(x, sl)
    assert got.shape == want.shape == (m, h)
    assert same_bits(got, want) and not got.any()


@pytest.mark.parametrize("fn", [gather_sum, gather_sum_ref])
def test_bad_input(fn):
    x = torch.randn(4, 8).to(torch.bfloat16)
    sl = torch.zeros(3, 2, dtype=torch.int64)
    with pytest.raises(TypeError, match="rows must be one of bfloat16"):
        fn(x.to(torch.int32), sl)
    with pytest.raises(ValueError, match="2-D"):
        fn(x[0], sl)
    with pytest.raises(TypeError, match="int32 or int64"):
        fn(x, sl.float())
    with pytest.raises(ValueError, match="2-D"):
        fn(x, sl[0])
    with pytest.raises(ValueError, match="columns must be contiguous"):
        fn(x.t(), sl)
    with pytest.raises(ValueError, match="meta"):
        fn(x, sl.to("meta"))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_moe_sizes(dtype):
    """The EP layer's shapes (small preset and DeepSeek-V3's hidden): bit-identical to the twin on the GPU,
    and, with at most two slots per output (any order sums alike), to the float32 index_add_ it replaces."""
    for n, h, m, s in [(98304, 1024, 49152, 4), (16384, 7168, 4096, 8), (8192, 7168, 8192, 2)]:
        x = _rows(n, h, dtype, seed=1, device="cuda")
        sl = _slots(m, s, n, seed=2, device="cuda")
        assert same_bits(gather_sum(x, sl), gather_sum_ref(x, sl))
    n, h, m = 8192, 2048, 4096
    x = _rows(n, h, dtype, seed=3, special=False, device="cuda")
    dst = torch.randperm(n, device="cuda") // 2           # two rows per output
    want = torch.zeros(m, h, device="cuda").index_add_(0, dst, x.float()).to(dtype)
    slots = torch.argsort(dst, stable=True).view(m, 2)
    assert same_bits(gather_sum(x, slots), want)


# ---- the rows as an FP8 wire carries them: decoded inside the sum --------------------------------------------

def _wire_rows(n: int, h: int, seed: int):
    """FP8 rows as strided views of a wider byte buffer (the wire's layout: codes, then scales, then other
    columns), and as the quantizer returns them (M-major scales), with a NaN code and a zero row planted."""
    from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * torch.exp2(torch.randint(-40, 40, (n, 1), generator=g).float())
    x[0] = 0.0
    x = x.to(torch.bfloat16)
    if n > 2:
        x[2, 40] = float("nan")
    fd, fs = quantize_fp8_rowwise_ref(x)
    fw = torch.zeros(n, h + 4 * (h // 128) + 8, dtype=torch.uint8)
    fw[:, :h] = fd.view(torch.uint8)
    fw[:, h:h + 4 * (h // 128)] = fs.contiguous().view(torch.uint8)
    return (fw[:, :h].view(torch.float8_e4m3fn), fw[:, h:h + 4 * (h // 128)].view(torch.float32)), (fd, fs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 128, 1, 1), (37, 384, 23, 5), (9, 1024, 17, 8)],
                         ids=lambda s: "x".join(map(str, s)))
def test_fp8_rows_kernel_matches_reference(dtype, shape):
    from moe_fp4.kernels.row_sum import gather_sum_fp8, gather_sum_fp8_ref

    n, h, m, s = shape
    (fd, fs), (fd_own, fs_mmajor) = _wire_rows(n, h, seed=n + h)
    assert fd.stride(0) > fd.shape[1] and fs.stride(0) * 4 > fd.shape[1]   # strided wire views
    sl = _slots(m, s, n, seed=m)
    want = gather_sum_fp8_ref(fd, fs, sl, dtype)
    assert same_bits(gather_sum_fp8(fd, fs, sl, dtype), want)
    # the quantizer's own M-major scales: the same sums
    assert same_bits(gather_sum_fp8(fd_own, fs_mmajor, sl, dtype), want)
    if n > 2 and (sl == 2).any():     # the planted NaN code reaches the sums that read its row
        assert torch.isnan(want[(sl == 2).any(1)]).any()


@pytest.mark.parametrize("fmt", ["bf16", "native", "fp8", "mxfp4", "mxfp4-sr", "nvfp4", "nvfp4-sr"])
def test_unpack_sum_is_unpack_then_sum(fmt):
    """exchange.wire.unpack_sum: every wire format, rows with routing columns after the payload (the dispatch
    gradient's wire), bit for bit the decoded rows summed."""
    from moe_fp4.exchange.wire import pack, row_bytes, unpack, unpack_sum
    from moe_fp4.formats.conversions import gather_sum as api_gather_sum

    n, h, m = 30, 256, 12
    for dtype in (torch.bfloat16, torch.float32):
        x = _rows(n, h, torch.float32, seed=4, special=False).to(dtype)
        b = row_bytes(fmt, h, dtype)
        wire = torch.zeros(n, b + 16, dtype=torch.uint8)
        pack(x, fmt, out=wire)
        sl = _slots(m, 3, n, seed=6)
        want = api_gather_sum(unpack(wire, fmt, h, dtype=dtype), sl)
        got = unpack_sum(wire, fmt, h, sl, dtype)
        assert got.dtype == dtype and same_bits(got, want), (fmt, dtype)


def test_fp8_rows_narrow_column_blocks():
    """block_h 64 and 32: several programs read one row's 1x128 scale tile; the same bits."""
    from moe_fp4.kernels.row_sum import gather_sum_fp8, gather_sum_fp8_ref

    (fd, fs), _ = _wire_rows(9, 384, seed=3)
    sl = _slots(11, 3, 9, seed=4)
    want = gather_sum_fp8_ref(fd, fs, sl)
    for block_h in (64, 32):
        assert same_bits(gather_sum_fp8(fd, fs, sl, block_h=block_h, block_m=8), want), block_h


def test_fp8_rows_bad_input():
    from moe_fp4.kernels.row_sum import gather_sum_fp8

    sl = torch.zeros(3, 2, dtype=torch.int64)
    d, s = torch.zeros(4, 256, dtype=torch.uint8), torch.zeros(4, 2)
    with pytest.raises(ValueError, match="scale must be torch.float32 \\[4, 2\\]"):
        gather_sum_fp8(d, s[:, :1], sl)
    with pytest.raises(ValueError, match="bytes"):
        gather_sum_fp8(d.float(), s, sl)
    with pytest.raises(TypeError, match="dtype must be"):
        gather_sum_fp8(d, s, sl, torch.int32)
    with pytest.raises(ValueError, match="scale must be torch.float32"):
        gather_sum_fp8(d, s.double(), sl)
    with pytest.raises(ValueError, match="multiple of 128"):
        gather_sum_fp8(torch.zeros(4, 96, dtype=torch.uint8), torch.zeros(4, 0), sl)
    with pytest.raises(ValueError, match="slots must be"):
        gather_sum_fp8(d, s, sl.float())
    for block_h in (256, 96):   # a program's columns must lie in one 1x128 scale tile
        with pytest.raises(ValueError, match="block_h must divide 128"):
            gather_sum_fp8(d, s, sl, block_h=block_h)


@pytest.mark.gpu
def test_gpu_quantized_rows_and_unpack_sum():
    """The FP8 decoding sum on the GPU at the small preset's EP shapes: bit-identical to its twin, and
    unpack_sum to decoding on the GPU and then summing, for the summed streams' formats."""
    from moe_fp4.exchange.wire import pack, row_bytes, unpack, unpack_sum
    from moe_fp4.kernels.row_sum import gather_sum_fp8, gather_sum_fp8_ref

    n, h, m, s = 8192, 1024, 4096, 4
    (fd, fs), _ = _wire_rows(n, h, seed=9)
    fd, fs = fd.cuda(), fs.cuda()
    sl = _slots(m, s, n, seed=10, device="cuda")
    for dtype in DTYPES:
        assert same_bits(gather_sum_fp8(fd, fs, sl, dtype), gather_sum_fp8_ref(fd, fs, sl, dtype))
    x = _rows(n, h, torch.bfloat16, seed=11, special=False, device="cuda")
    for fmt in ("bf16", "fp8", "mxfp4", "mxfp4-sr"):
        wire = torch.zeros(n, row_bytes(fmt, h) + 32, dtype=torch.uint8, device="cuda")
        pack(x, fmt, out=wire)
        assert same_bits(unpack_sum(wire, fmt, h, sl), gather_sum(unpack(wire, fmt, h), sl)), fmt


def test_public_gather_sum_takes_strided_columns():
    """moe_fp4.formats.conversions.gather_sum (what the layers call) makes strided columns contiguous itself (the
    kernel and its twin refuse them): a gradient autograd hands over as a transposed view sums alike."""
    from moe_fp4.formats.conversions import gather_sum as api_gather_sum

    x = _rows(64, 40, torch.bfloat16, seed=12, special=False)
    xt = x.t().contiguous().t()
    assert xt.stride(1) != 1
    sl = _slots(20, 3, 64, seed=13)
    assert same_bits(api_gather_sum(xt, sl), gather_sum_ref(x, sl))
