"""Grouped blockwise FP8 GEMMs for the expert MLPs: Triton kernels, launchers, pure-torch references.

DeepSeek-V3 scaling: E4M3 operands with float32 power-of-two scales, float32 accumulation, the
scales applied per 128-wide step of the contraction (one ``tl.dot`` per step, then
``acc += dot * scale_a * scale_b``). One launch covers every expert; rows are grouped by expert in
128-aligned groups (``counts``: E multiples of 128), so no 128-row tile straddles two experts and a
tile finds its expert in a small table instead of a host loop. ``counts`` are host ints or an int
tensor on the device; with a tensor nothing reads them on the host (no sync, CUDA-graph safe): R is then
a static bound, and the rows past the groups are a tail the GEMMs leave out.

- :func:`grouped_mm_nt` (fprop and dgrad, "M-grouped"): ``out[rows of e] = A[rows of e] @ B[e]^T``.
  A: FP8 [R, K] in 1x128 tiles along K, or MXFP4 [R, K] (converted to FP8 first by the row-wise
  MXFP4 -> FP8 converter). B: FP8 [E, N, K] in 128x128 blocks.
- :func:`grouped_mm_wgrad` (weight gradients, "K-grouped"): ``out[e] = A[:, cols of e] @ B[:, cols of e]^T``
  with A [N, R] and B [K, R], both FP8 in 1x128 tiles along R (the tokens): dW = dY^T X per expert.

Each launcher ``name`` has a twin ``name_ref`` with the same signature: dequantize exactly to
float32 and multiply per expert in float32. The kernels sum the same products in another order, so
they agree with the twins to float32 rounding (tests/gemm/test_grouped_gemm.py bounds it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from moe_fp4.kernels.fp8 import WEIGHT_BLOCK, mxfp4_to_fp8_rowwise, mxfp4_to_fp8_rowwise_ref
from moe_fp4.kernels.numerics import FP8_TILE, MXFP4_BLOCK
from moe_fp4.kernels.triton_numerics import f32_to_bf16_rne

try:  # Triton >= 3.4 (host-side TMA descriptors; the interpreter emulates them)
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer path only
    TensorDescriptor = None

GROUP_ALIGN = 128   # rows per expert are a multiple of this (one FP8 1x128 tile along tokens)


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipeline depth of one grouped GEMM launch."""

    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 4
    group_m: int = 8      # M tiles per L2 swizzle group (M-grouped kernel)
    use_tma: bool = False  # FP8 operands through TMA tensor descriptors (needs even tiles)

    def __post_init__(self):
        if self.block_m not in (64, 128):
            raise ValueError(f"GemmConfig: block_m must be 64 or 128, got {self.block_m}")
        if self.block_n not in (64, 128, 256):
            raise ValueError(f"GemmConfig: block_n must be 64, 128 or 256, got {self.block_n}")
        if self.num_warps not in (4, 8) or self.num_stages < 1 or self.group_m < 1:
            raise ValueError(f"GemmConfig: bad num_warps / num_stages / group_m in {self}")


# TMA descriptor loads, 64x128 tiles, 4 warps, 3 stages: the fastest config, or close to it, for every GEMM
# of the H200 sweep (bench/gemm.py --sweep, dsv3 shapes; bench/RESULTS.md). 128x128 with 8 warps is slower:
# the per-step scaled accumulation keeps two fp32 tiles live, and the wgrad kernel spills at that size.
NT_CONFIG = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True)
WGRAD_CONFIG = GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=True)


# --------------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------------

@triton.jit
def _epilogue(acc, OUT_DTYPE: tl.constexpr):
    """float32 accumulator -> OUT_DTYPE (bfloat16 or float32), rounded to nearest even."""
    if OUT_DTYPE == tl.bfloat16:
        return f32_to_bf16_rne(acc)
    else:
        return acc


@triton.jit
def _grouped_mm_nt_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, tile_expert_ptr,
                          M, N, K, E,
                          stride_am, stride_asm, stride_ask,
                          stride_be, stride_bn, stride_bse, stride_bsn,
                          stride_cm,
                          OUT_DTYPE: tl.constexpr, MASK_N: tl.constexpr, USE_TMA: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                          GROUP_M: tl.constexpr):
    # USE_TMA: a_ptr / b_ptr are tensor descriptors of A [R, K] and B viewed as [E * N, K] (N a multiple of
    # BLOCK_N); else pointers, masked past column N when MASK_N.
    # Swizzled tile order: GROUP_M consecutive M tiles share each N tile while it is in L2.
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    size_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % size_m
    pid_n = (pid % per_group) // size_m

    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    # A 128-row tile past the last expert's rows (device counts: R is a static bound) has expert id E: it
    # contracts nothing and stores zeros, so those rows hold zeros as a padding row's output does.
    e = tl.load(tile_expert_ptr + (pid_m * BLOCK_M) // 128).to(tl.int64)
    k_steps = tl.where(e < E, tl.cdiv(K, BLOCK_K), 0)
    e = tl.minimum(e, E - 1)
    cols_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = cols_n < N
    as_ptrs = as_ptr + rows * stride_asm
    if USE_TMA:
        a_ptrs = a_ptr   # unused: the descriptors address A and B
        b_ptrs = b_ptr
    else:
        a_ptrs = a_ptr + rows[:, None] * stride_am + tl.arange(0, BLOCK_K)[None, :]
        b_ptrs = b_ptr + e * stride_be + cols_n[:, None].to(tl.int64) * stride_bn + tl.arange(0, BLOCK_K)[None, :]
    bs_ptrs = bs_ptr + e * stride_bse + (cols_n // 128) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kt in range(0, k_steps):
        if USE_TMA:
            a = a_ptr.load([pid_m * BLOCK_M, kt * BLOCK_K])
            sa = tl.load(as_ptrs)
            b = b_ptr.load([(e * N + pid_n * BLOCK_N).to(tl.int32), kt * BLOCK_K])
            sb = tl.load(bs_ptrs)
        elif MASK_N:
            a = tl.load(a_ptrs)
            sa = tl.load(as_ptrs)
            b = tl.load(b_ptrs, mask=mask_n[:, None], other=0.0)
            sb = tl.load(bs_ptrs, mask=mask_n, other=0.0)
        else:
            a = tl.load(a_ptrs)
            sa = tl.load(as_ptrs)
            b = tl.load(b_ptrs)
            sb = tl.load(bs_ptrs)
        acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        if not USE_TMA:
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        as_ptrs += stride_ask
        bs_ptrs += 1
    c = c_ptr + rows[:, None] * stride_cm + cols_n[None, :]
    tl.store(c, _epilogue(acc, OUT_DTYPE), mask=mask_n[None, :])


@triton.jit
def _grouped_mm_wgrad_kernel(a_ptr, as_ptr, b_ptr, bs_ptr, c_ptr, offsets_ptr,
                             N, K,
                             stride_am, stride_asn, stride_ast,
                             stride_bk, stride_bsk, stride_bst,
                             stride_ce, stride_cn,
                             OUT_DTYPE: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # Program (tile of dW[e], expert e): contract over expert e's tokens in steps of one 1x128 tile.
    # USE_TMA: a_ptr / b_ptr are tensor descriptors of A [N, R] and B [K, R] (N and K multiples of the
    # tile); else pointers, masked past row N and column K when MASKED.
    pid = tl.program_id(0)
    e = tl.program_id(1)
    tiles_k = tl.cdiv(K, BLOCK_N)
    pid_m = pid // tiles_k
    pid_n = pid % tiles_k
    # Group offsets are multiples of 128: saying so lets the loads below be 16-byte vectors (Triton
    # cannot prove the alignment of a value loaded at run time and would load byte by byte).
    start = tl.multiple_of(tl.load(offsets_ptr + e), 128)
    stop = tl.multiple_of(tl.load(offsets_ptr + e + 1), 128)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rows < N
    mask_n = cols < K
    rr = tl.arange(0, BLOCK_R)
    t0 = start // BLOCK_R
    if USE_TMA:
        a_ptrs = a_ptr
        b_ptrs = b_ptr
    else:
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * stride_am + start + rr[None, :]
        b_ptrs = b_ptr + cols[:, None].to(tl.int64) * stride_bk + start + rr[None, :]
    as_ptrs = as_ptr + rows * stride_asn + t0 * stride_ast
    bs_ptrs = bs_ptr + cols * stride_bsk + t0 * stride_bst
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for it in range(0, (stop - start) // BLOCK_R):
        if USE_TMA:
            r0 = (start + it * BLOCK_R).to(tl.int32)
            a = a_ptr.load([pid_m * BLOCK_M, r0])
            b = b_ptr.load([pid_n * BLOCK_N, r0])
            sa = tl.load(as_ptrs)
            sb = tl.load(bs_ptrs)
        elif MASKED:
            a = tl.load(a_ptrs, mask=mask_m[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=mask_n[:, None], other=0.0)
            sa = tl.load(as_ptrs, mask=mask_m, other=0.0)
            sb = tl.load(bs_ptrs, mask=mask_n, other=0.0)
        else:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
            sa = tl.load(as_ptrs)
            sb = tl.load(bs_ptrs)
        acc += tl.dot(a, tl.trans(b)) * (sa[:, None] * sb[None, :])
        if not USE_TMA:
            a_ptrs += BLOCK_R
            b_ptrs += BLOCK_R
        as_ptrs += stride_ast
        bs_ptrs += stride_bst
    c = c_ptr + e.to(tl.int64) * stride_ce + rows[:, None].to(tl.int64) * stride_cn + cols[None, :]
    tl.store(c, _epilogue(acc, OUT_DTYPE), mask=mask_m[:, None] & mask_n[None, :])


# --------------------------------------------------------------------------------------------
# Launchers and references
# --------------------------------------------------------------------------------------------

def device_ints(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A short host list -> a tensor on ``device`` without a host sync (pinned staging for CUDA: a
    pageable host-to-device copy would wait for the stream)."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    return host.to(device, non_blocking=True)


def group_offsets(counts) -> list[int]:
    """counts: E ints -> E + 1 offsets (0, c0, c0 + c1, ..., sum)."""
    out = [0]
    for c in counts:
        out.append(out[-1] + int(c))
    return out


OUT_DTYPES = (torch.bfloat16, torch.float32)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}   # the kernels' OUT_DTYPE


def _check_out_dtype(dtype, fn: str) -> None:
    if dtype not in OUT_DTYPES:
        raise TypeError(f"{fn}: out_dtype must be bfloat16 or float32, got {dtype}")


def _tma_ok(t: torch.Tensor) -> bool:
    """TMA descriptors need a contiguous last dimension and 16-byte aligned base and row stride."""
    return (TensorDescriptor is not None and t.stride(-1) == 1 and t.data_ptr() % 16 == 0
            and all(st % 16 == 0 for st in t.stride()[:-1]))


def rows_aligned(rows) -> bool:
    """Whether ``rows`` is a multiple of GROUP_ALIGN. A symbolic ``rows`` (torch.compile's dynamic shapes, the
    rows an expert-parallel exchange received) cannot be branched on: it is asserted at run time instead
    (``torch._check``), which also lets the compiler reason with it."""
    if isinstance(rows, torch.SymInt):
        torch._check(rows % GROUP_ALIGN == 0, lambda: f"the rows R = {rows} must be a multiple of {GROUP_ALIGN}")
        return True
    return rows % GROUP_ALIGN == 0


def _check_device_counts(counts: torch.Tensor, rows: int, n_exp: int, device, fn: str) -> torch.Tensor:
    """Device counts: int32/int64 [E] on the operands' device, R a multiple of 128. Their values are not
    read (that is a host sync): each must be a non-negative multiple of 128 and they may sum to at most R;
    the rows past their sum are a static bound's tail, which the GEMMs leave out (fprop and dgrad write
    zeros there)."""
    if counts.dtype not in (torch.int32, torch.int64) or tuple(counts.shape) != (n_exp,):
        raise ValueError(f"{fn}: device counts must be int32/int64 [{n_exp}], got {counts.dtype} "
                         f"{tuple(counts.shape)}")
    if counts.device != torch.device(device):
        raise ValueError(f"{fn}: counts on {counts.device}, operands on {device}")
    if not rows_aligned(rows):
        raise ValueError(f"{fn}: with device counts the rows R = {rows} must be a multiple of {GROUP_ALIGN}")
    return counts


def host_counts(counts) -> tuple[int, ...]:
    """counts: E ints or an int tensor [E] -> E ints (a tensor's values are copied to the host: a sync)."""
    return tuple(int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts))


def device_offsets(counts, dtype: torch.dtype, device) -> torch.Tensor:
    """counts: E ints or an int tensor [E] on ``device`` -> dtype [E + 1] group offsets on ``device``, without
    a host sync (a tensor's cumulative sum on the device, a host list through pinned staging)."""
    if not isinstance(counts, torch.Tensor):
        return device_ints(group_offsets(counts), dtype, device)
    out = torch.zeros(counts.shape[0] + 1, dtype=dtype, device=counts.device)
    torch.cumsum(counts, 0, dtype=dtype, out=out[1:])
    return out


def tile_experts(counts, rows: int, device) -> torch.Tensor:
    """counts: E ints or an int tensor [E] (multiples of 128) -> int32 [rows / 128]: the expert of each
    128-row tile, E for a tile past the last group (a static bound's tail). Device counts: a search on
    the device, no host sync."""
    if not isinstance(counts, torch.Tensor):
        return device_ints([e for e, c in enumerate(counts) for _ in range(c // GROUP_ALIGN)]
                           + [len(counts)] * ((rows - sum(counts)) // GROUP_ALIGN), torch.int32, device)
    ends = torch.cumsum(counts, 0)
    starts = torch.arange(0, rows, GROUP_ALIGN, device=counts.device, dtype=ends.dtype)
    return torch.searchsorted(ends, starts, right=True).to(torch.int32)


def _check_counts(counts, rows: int, n_exp: int, fn: str, device=None):
    if isinstance(counts, torch.Tensor):
        return _check_device_counts(counts, rows, n_exp, device, fn)
    key = counts if isinstance(counts, tuple) else tuple(counts)
    try:
        return _checked_counts(key, rows, n_exp, fn)
    except TypeError:   # unhashable entries: checked uncached
        return _checked_counts.__wrapped__(key, rows, n_exp, fn)


@functools.lru_cache(maxsize=256)
def _checked_counts(counts: tuple, rows: int, n_exp: int, fn: str) -> tuple[int, ...]:
    """counts as ints, or ValueError. Cached per routing (a failure is not cached): every grouped GEMM
    of a step meets the same counts, and the checks cost host time at each launch."""
    counts = tuple(int(c) for c in counts)
    if len(counts) != n_exp:
        raise ValueError(f"{fn}: expected {n_exp} counts (one per expert), got {len(counts)}")
    if any(c < 0 or c % GROUP_ALIGN for c in counts):
        raise ValueError(f"{fn}: counts must be non-negative multiples of {GROUP_ALIGN}, got {counts}")
    if sum(counts) != rows:
        raise ValueError(f"{fn}: counts sum to {sum(counts)}, but the operand has {rows} rows")
    return counts


def _nt_shapes(a, a_scale, b, b_scale, counts, fn: str):
    """-> (mxfp4, R, N, K, counts) after checking the operands of grouped_mm_nt."""
    mxfp4 = a.dtype == torch.uint8
    if a.dim() != 2 or (not mxfp4 and a.dtype != torch.float8_e4m3fn):
        raise TypeError(f"{fn}: A must be float8_e4m3fn [R, K] or MXFP4 uint8 [R, K/2], got {a.dtype} "
                        f"{tuple(a.shape)}")
    r = a.shape[0]
    k = a.shape[1] * (2 if mxfp4 else 1)
    want_scale = (torch.uint8, (r, k // MXFP4_BLOCK)) if mxfp4 else (torch.float32, (r, k // FP8_TILE))
    if a_scale.dtype != want_scale[0] or tuple(a_scale.shape) != want_scale[1]:
        raise ValueError(f"{fn}: A's scale must be {want_scale[0]} {want_scale[1]}, got {a_scale.dtype} "
                         f"{tuple(a_scale.shape)}")
    if b.dtype != torch.float8_e4m3fn or b.dim() != 3 or b.shape[2] != k:
        raise ValueError(f"{fn}: B must be float8_e4m3fn [E, N, K = {k}], got {b.dtype} {tuple(b.shape)}")
    n_exp, n = b.shape[:2]
    if k % FP8_TILE or n % WEIGHT_BLOCK:
        raise ValueError(f"{fn}: N = {n} and K = {k} must be multiples of {FP8_TILE}")
    if b_scale.dtype != torch.float32 or tuple(b_scale.shape) != (n_exp, n // WEIGHT_BLOCK, k // WEIGHT_BLOCK):
        raise ValueError(f"{fn}: B's scale must be float32 {(n_exp, n // WEIGHT_BLOCK, k // WEIGHT_BLOCK)}, "
                         f"got {b_scale.dtype} {tuple(b_scale.shape)}")
    if a.stride(1) != 1 or b.stride(2) != 1 or b.stride(1) != k:
        raise ValueError(f"{fn}: A's rows and B's [N, K] matrices must be contiguous")
    if len({a.device, a_scale.device, b.device, b_scale.device}) != 1:
        raise ValueError(f"{fn}: operands on different devices")
    return mxfp4, r, n, k, _check_counts(counts, r, n_exp, fn, a.device)


def grouped_mm_nt(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts,
                  out_dtype: torch.dtype = torch.bfloat16, config: GemmConfig = NT_CONFIG) -> torch.Tensor:
    """A: float8_e4m3fn [R, K] with a_scale float32 [R, K/128] (any strides), or MXFP4 uint8 [R, K/2]
    with a_scale uint8 [R, K/32] (row-major; converted to FP8 first by mxfp4_to_fp8_rowwise); B:
    float8_e4m3fn [E, N, K] with b_scale float32 [E, N/128, K/128] (128x128 blocks); counts: E ints,
    multiples of 128, summing to R, or an int tensor [E] on A's device (values unread: multiples of 128
    summing to at most R; the rows past their sum come out zero) -> out_dtype [R, N]: rows of expert e
    times B[e]^T, one launch. Device counts cost no host sync."""
    mxfp4, r, n, k, counts = _nt_shapes(a, a_scale, b, b_scale, counts, "grouped_mm_nt")
    _check_out_dtype(out_dtype, "grouped_mm_nt")
    out = torch.empty(r, n, dtype=out_dtype, device=a.device)
    if r == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if mxfp4:
        a, a_scale = mxfp4_to_fp8_rowwise(a, a_scale)
    tile_expert = tile_experts(counts, r, a.device)
    bs = b_scale.contiguous()
    cfg = config
    even_n = n % cfg.block_n == 0
    tma = cfg.use_tma and even_n and _tma_ok(a)
    a_arg, b_arg = a, b
    if tma:
        a_arg = TensorDescriptor.from_tensor(a, [cfg.block_m, FP8_TILE])
        b_arg = TensorDescriptor.from_tensor(b.view(-1, k), [cfg.block_n, FP8_TILE])
    grid = (triton.cdiv(r, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _grouped_mm_nt_kernel[grid](
        a_arg, a_scale, b_arg, bs, out, tile_expert, r, n, k, b.shape[0],
        a.stride(0), a_scale.stride(0), a_scale.stride(1),
        b.stride(0), b.stride(1), bs.stride(0), bs.stride(1), out.stride(0),
        OUT_DTYPE=_TL_DTYPES[out_dtype], MASK_N=not even_n, USE_TMA=tma, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=FP8_TILE, GROUP_M=cfg.group_m, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def _ref_counts(counts, rows: int, fn: str) -> tuple[int, ...]:
    """The twins read device counts on the host (a sync: they are the references) and check their values."""
    if not isinstance(counts, torch.Tensor):
        return counts
    counts = host_counts(counts)
    if any(c < 0 or c % GROUP_ALIGN for c in counts) or sum(counts) > rows:
        raise ValueError(f"{fn}: counts must be non-negative multiples of {GROUP_ALIGN} summing to at most "
                         f"{rows}, got {counts}")
    return counts


def _dequant_rows(data: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 [M, K] codes and float32 [M, K/128] scales -> exact float32 values."""
    return data.float() * scale.repeat_interleave(FP8_TILE, dim=1)


def grouped_mm_nt_ref(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts,
                      out_dtype: torch.dtype = torch.bfloat16, config: GemmConfig = NT_CONFIG) -> torch.Tensor:
    """Pure-torch twin of grouped_mm_nt: per expert, float32 matmul of the exactly dequantized operands
    (an MXFP4 A is converted to FP8 by mxfp4_to_fp8_rowwise_ref first). ``config`` is ignored."""
    mxfp4, r, n, k, counts = _nt_shapes(a, a_scale, b, b_scale, counts, "grouped_mm_nt")
    counts = _ref_counts(counts, r, "grouped_mm_nt")
    if mxfp4:
        a, a_scale = mxfp4_to_fp8_rowwise_ref(a, a_scale)
    out = torch.zeros(r, n, dtype=out_dtype, device=a.device)
    bf = b.float() * b_scale.repeat_interleave(WEIGHT_BLOCK, 1).repeat_interleave(WEIGHT_BLOCK, 2)
    offs = group_offsets(counts)
    for e in range(len(counts)):
        s, t = offs[e], offs[e + 1]
        if t > s:
            out[s:t] = (_dequant_rows(a[s:t], a_scale[s:t]) @ bf[e].t()).to(out_dtype)
    return out


def _wgrad_shapes(a, a_scale, b, b_scale, counts, fn: str):
    for name, t, s in (("A", a, a_scale), ("B", b, b_scale)):
        if t.dtype != torch.float8_e4m3fn or t.dim() != 2:
            raise TypeError(f"{fn}: {name} must be float8_e4m3fn [*, R], got {t.dtype} {tuple(t.shape)}")
        if t.stride(1) != 1:
            raise ValueError(f"{fn}: {name}'s rows must be contiguous")
        if s.dtype != torch.float32 or tuple(s.shape) != (t.shape[0], t.shape[1] // FP8_TILE):
            raise ValueError(f"{fn}: {name}'s scale must be float32 {(t.shape[0], t.shape[1] // FP8_TILE)}, "
                             f"got {s.dtype} {tuple(s.shape)}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"{fn}: A is [N, R] = {tuple(a.shape)}, B must be [K, R], got {tuple(b.shape)}")
    if len({a.device, a_scale.device, b.device, b_scale.device}) != 1:
        raise ValueError(f"{fn}: operands on different devices")
    n_exp = counts.shape[0] if isinstance(counts, torch.Tensor) and counts.dim() == 1 else len(tuple(counts))
    return a.shape[0], b.shape[0], _check_counts(counts, a.shape[1], n_exp, fn, a.device)


def grouped_mm_wgrad(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts,
                     out_dtype: torch.dtype = torch.float32, config: GemmConfig = WGRAD_CONFIG) -> torch.Tensor:
    """A: float8_e4m3fn [N, R] with a_scale float32 [N, R/128], B: float8_e4m3fn [K, R] with b_scale
    float32 [K, R/128] (both in 1x128 tiles along R, the tokens; scales any strides); counts: E ints,
    multiples of 128, summing to R, or an int tensor [E] on A's device (values unread, summing to at most
    R: the columns past their sum are left out) -> out_dtype [E, N, K]: out[e] = A[:, cols of e] @
    B[:, cols of e]^T (zeros for an expert without rows), one launch."""
    n, k, counts = _wgrad_shapes(a, a_scale, b, b_scale, counts, "grouped_mm_wgrad")
    _check_out_dtype(out_dtype, "grouped_mm_wgrad")
    n_exp = len(counts)
    out = torch.empty(n_exp, n, k, dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:   # no tokens: every expert's gradient is zero
        return out.zero_()
    offsets = device_offsets(counts, torch.int64, a.device)
    cfg = config
    even = n % cfg.block_m == 0 and k % cfg.block_n == 0
    tma = cfg.use_tma and even and _tma_ok(a) and _tma_ok(b)
    a_arg, b_arg = a, b
    if tma:
        a_arg = TensorDescriptor.from_tensor(a, [cfg.block_m, FP8_TILE])
        b_arg = TensorDescriptor.from_tensor(b, [cfg.block_n, FP8_TILE])
    grid = (triton.cdiv(n, cfg.block_m) * triton.cdiv(k, cfg.block_n), n_exp)
    _grouped_mm_wgrad_kernel[grid](
        a_arg, a_scale, b_arg, b_scale, out, offsets, n, k,
        a.stride(0), a_scale.stride(0), a_scale.stride(1),
        b.stride(0), b_scale.stride(0), b_scale.stride(1),
        out.stride(0), out.stride(1),
        OUT_DTYPE=_TL_DTYPES[out_dtype], MASKED=not even, USE_TMA=tma,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_R=FP8_TILE,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_mm_wgrad_ref(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts,
                         out_dtype: torch.dtype = torch.float32, config: GemmConfig = WGRAD_CONFIG) -> torch.Tensor:
    """Pure-torch twin of grouped_mm_wgrad (float32 matmul of the exactly dequantized operands per
    expert). ``config`` is ignored."""
    n, k, counts = _wgrad_shapes(a, a_scale, b, b_scale, counts, "grouped_mm_wgrad")
    counts = _ref_counts(counts, a.shape[1], "grouped_mm_wgrad")
    out = torch.zeros(len(counts), n, k, dtype=out_dtype, device=a.device)
    af, bf = _dequant_rows(a, a_scale), _dequant_rows(b, b_scale)
    offs = group_offsets(counts)
    for e in range(len(counts)):
        s, t = offs[e], offs[e + 1]
        if t > s:
            out[e] = (af[:, s:t] @ bf[:, s:t].t()).to(out_dtype)
    return out
