"""Grouped blockwise FP8 GEMM for Hopper in Triton's Gluon dialect: the M-grouped engine (fprop, dgrad).

``out[rows of e] = A[rows of e] @ B[e]^T`` with A float8_e4m3fn [R, K] in 1x128 tiles along K (float32
power-of-two scales, M-major as FP8BlockTensor stores them) and B float8_e4m3fn [E, N, K] in 128x128
blocks. The contract, the numerics and the validation are those of
:func:`moe_fp4.kernels.grouped_gemm.grouped_mm_nt`, its Triton twin: one wgmma chain per 128-wide K
block into a fresh float32 partial, then ``acc += partial * (s_a * s_b)`` on the CUDA cores. Gluon has
no interpreter, so the CPU suite runs the twin (and the pure-torch reference); the GPU tests compare
this engine with both.

Schedule (why each piece: docs/DESIGN.md, "The Gluon GEMM engine"):
- persistent: one program per SM walks tiles t = pid, pid + P, ... of a grouped tile list. An M tile
  is up to 256 rows of one expert (two 128-row waves; an expert's last tile may have one), so no rows
  are computed for padding and no tile straddles two experts. Tiles are ordered in groups of GROUP_M
  M tiles per N tile: consecutive programs share B[e]'s N tile while it is in L2.
- warp-specialized: a 1-warp TMA producer (40 registers) fills a NUM_STAGES-deep mbarrier ring with
  A (256 x 128) and B (BLOCK_N x 128); two consumer warpgroups, each its own partition, take one wave
  each: they issue wgmma, promote, and store their wave through shared memory with TMA while the next
  tile's loads are already in flight.
- scales: A's come from global memory (coalesced along M) and B's is one scalar per K block, both
  loaded one K block before the wgmma they scale is waited on, so their latency hides under the MMA.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

try:  # Gluon's Hopper API as Triton 3.6 ships it (the GPU image's Triton), and as 3.7+ renamed it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    # TMA copies: async_copy_global_to_shared / async_copy_shared_to_global in 3.6, async_load /
    # async_store since (the old names then raise). Same arguments for what this module passes.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _ = (gluon.jit, gluon.constexpr_function, gl.warp_specialize, gl.NVMMADistributedLayout, mbarrier.MBarrierLayout)
    AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - a Triton without (this) Gluon: the Triton engine
    AVAILABLE = False

from moe_fp4.kernels.fp8 import m_major, mxfp4_to_fp8_rowwise
from moe_fp4.kernels.grouped_gemm import GROUP_ALIGN, _check_out_dtype, _nt_shapes, device_ints
from moe_fp4.kernels.numerics import FP8_TILE

WAVE_M = GROUP_ALIGN  # rows per wave (one consumer warpgroup's, in two m64 halves): an expert's rows are whole waves
TILE_M = 2 * WAVE_M   # rows per M tile (two waves of one expert)


def supported(device: torch.device) -> bool:
    """True when this engine can run on ``device``: Gluon imports and the GPU is a Hopper (sm90)."""
    device = torch.device(device)
    return (AVAILABLE and device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) == (9, 0))


def m_tiles(counts) -> tuple[list[int], list[int], list[int]]:
    """counts: E ints (multiples of 128) -> (first row, expert, waves) per M tile: each expert's rows in
    tiles of 256 (2 waves), its last tile 128 rows (1 wave) when its count is an odd multiple of 128;
    experts without rows have no tile."""
    rows, experts, waves = [], [], []
    start = 0
    for e, c in enumerate(counts):
        for r in range(0, c, TILE_M):
            rows.append(start + r)
            experts.append(e)
            waves.append(min(2, (c - r) // WAVE_M))
        start += c
    return rows, experts, waves


if AVAILABLE:

    @gluon.constexpr_function
    def _acc_layout(block_n, num_warps):
        # A [64, block_n] quarter over one consumer warpgroup's 4 warps: 16 rows each, one m64 wgmma.
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, block_n, 32])

    @gluon.jit
    def _tile(t, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """Tile index t -> (M tile, N tile): GROUP_M M tiles per N tile, M fastest within a group."""
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        size_m = gl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (t % per_group) % size_m, (t % per_group) // size_m

    @gluon.jit
    def _producer(a_desc, b_desc, a_smem, b_smem, ready, empty, tile_row_ptr, tile_expert_ptr,
                  tiles_m, tiles_n, N,
                  KB: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
        # One warp: waits for a free stage, then TMA-loads A's 256 rows and B[e]'s BLOCK_N rows of one
        # K block into it. The stage counter runs on across tiles, like the consumer's.
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        it = 0
        for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            mt, nt = _tile(t, tiles_m, tiles_n, GROUP_M)
            row0 = gl.load(tile_row_ptr + mt)
            brow = gl.load(tile_expert_ptr + mt) * N + nt * BLOCK_N
            for kb in range(KB):
                s = it % NUM_STAGES
                mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [row0, kb * 128], ready.index(s), a_smem.index(s))
                _tma_load(b_desc, [brow, kb * 128], ready.index(s), b_smem.index(s))
                it += 1

    @gluon.jit
    def _store_quarter(acc, d_desc, d_smem, n_store, row, col, D_BUFS: gl.constexpr, BUF0: gl.constexpr = 0):
        """One quarter of a tile through shared memory (buffers BUF0 .. BUF0 + D_BUFS - 1 in turn) and TMA;
        -> stores issued."""
        # Buffer n_store % D_BUFS was last read by the store D_BUFS stores ago: wait for that one only
        # (store_wait counts this thread's own bulk stores, so each consumer partition waits for its own).
        tma.store_wait(pendings=D_BUFS - 1)
        buf = d_smem.index(BUF0 + n_store % D_BUFS)
        buf.store(acc.to(d_desc.dtype))
        fence_async_shared()
        _tma_store(d_desc, [row, col], buf)
        return n_store + 1

    @gluon.jit
    def _wg_consumer(d_desc, a_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                     b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr, tile_waves_ptr,
                     tiles_m, tiles_n,
                     KB: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                     D_BUFS: gl.constexpr, WG: gl.constexpr):
        # One warpgroup, its own partition: wave WG (rows 128 WG .. 128 WG + 127) of every tile, as four
        # [64, BLOCK_N/2] float32 quarters (two 64-row halves x two column halves, 32 registers each).
        # Per K block the four quarter products run through two raw accumulators in turn: while one
        # quarter is promoted (acc += raw * s_a * s_b on the CUDA cores) the next one's wgmma runs, so
        # only the last promotion of a block leaves the tensor cores idle; 4 x 32 + 2 x 32 registers
        # fit without spills. Its own partition, because Triton puts a partition-wide bar.sync before
        # every mbarrier wait and arrive: one 8-warp consumer for both waves (9a5e346 and before) was
        # held in step by that barrier, so neither warpgroup's promotion overlapped the other's wgmma
        # (4.6 of 11.2 cycles between issues, Nsight Compute); two partitions drift apart and take
        # turns on the tensor cores.
        SUB: gl.constexpr = d_desc.block_type.shape[0]     # 64 rows: one m64 wgmma
        HALF: gl.constexpr = d_desc.block_type.shape[1]    # BLOCK_N / 2 columns
        BASE: gl.constexpr = WG * 2 * SUB                  # this warpgroup's first row in the tile
        layout: gl.constexpr = _acc_layout(HALF, 4)
        rows = gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
        it = 0
        n_store = 0
        for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            mt, nt = _tile(t, tiles_m, tiles_n, GROUP_M)
            row0 = gl.load(tile_row_ptr + mt) + BASE
            # Wave 1 of a one-wave tile runs too (rows of the next expert, or past R: not stored),
            # so both partitions release every stage; its scale loads are masked.
            valid = (gl.load(tile_waves_ptr + mt) == 2) | (WG == 0)
            live = rows < gl.where(valid, SUB, 0)
            bs_ptr = (b_scale_ptr + gl.load(tile_expert_ptr + mt).to(gl.int64) * stride_bs_e
                      + (nt * BLOCK_N // 128) * stride_bs_n)
            as_ptrs = a_scale_ptr + row0 + rows
            acc00 = gl.zeros((SUB, HALF), gl.float32, layout)   # acc<64-row half><column half>
            acc01 = gl.zeros((SUB, HALF), gl.float32, layout)
            acc10 = gl.zeros((SUB, HALF), gl.float32, layout)
            acc11 = gl.zeros((SUB, HALF), gl.float32, layout)
            ra = gl.zeros((SUB, HALF), gl.float32, layout)
            rb = gl.zeros((SUB, HALF), gl.float32, layout)
            # Scales one K block ahead: a load issued now is consumed a whole block (4 wgmmas) later,
            # so its latency never stalls a promotion (loaded just in time, it stalled a third of the
            # consumers' cycles: bench/tools/gemm_limiters.py). The last block reloads itself.
            sa0 = gl.load(as_ptrs, mask=live, other=0.0)
            sa1 = gl.load(as_ptrs + SUB, mask=live, other=0.0)
            sb = gl.load(bs_ptr)
            for kb in range(KB):
                s = it % NUM_STAGES
                s0 = sa0 * sb
                s1 = sa1 * sb
                nk = gl.minimum(kb + 1, KB - 1)
                sa0 = gl.load(as_ptrs + nk * stride_as_k, mask=live, other=0.0)
                sa1 = gl.load(as_ptrs + (nk * stride_as_k + SUB), mask=live, other=0.0)
                sb = gl.load(bs_ptr + nk)
                mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
                a0 = a_smem.index(s).slice(BASE, SUB, dim=0)
                a1 = a_smem.index(s).slice(BASE + SUB, SUB, dim=0)
                b0 = b_smem.index(s).slice(0, HALF, dim=0).permute((1, 0))
                b1 = b_smem.index(s).slice(HALF, HALF, dim=0).permute((1, 0))
                ra = warpgroup_mma(a0, b0, ra, use_acc=False, is_async=True)
                rb = warpgroup_mma(a0, b1, rb, use_acc=False, is_async=True)
                ra = warpgroup_mma_wait(num_outstanding=1, deps=(ra,))
                acc00 += ra * s0[:, None]
                ra = warpgroup_mma(a1, b0, ra, use_acc=False, is_async=True)
                rb = warpgroup_mma_wait(num_outstanding=1, deps=(rb,))
                acc01 += rb * s0[:, None]
                rb = warpgroup_mma(a1, b1, rb, use_acc=False, is_async=True)
                ra = warpgroup_mma_wait(num_outstanding=1, deps=(ra,))
                acc10 += ra * s1[:, None]
                rb = warpgroup_mma_wait(num_outstanding=0, deps=(rb,))
                mbarrier.arrive(empty.index(s), count=1)   # one of the stage's two releases
                acc11 += rb * s1[:, None]
                it += 1
            if valid:
                # This warpgroup's staging buffers: WG * D_BUFS ... of the 2 x D_BUFS.
                col = nt * BLOCK_N
                n_store = _store_quarter(acc00, d_desc, d_smem, n_store, row0, col, D_BUFS, WG * D_BUFS)
                n_store = _store_quarter(acc01, d_desc, d_smem, n_store, row0, col + HALF, D_BUFS, WG * D_BUFS)
                n_store = _store_quarter(acc10, d_desc, d_smem, n_store, row0 + SUB, col, D_BUFS, WG * D_BUFS)
                n_store = _store_quarter(acc11, d_desc, d_smem, n_store, row0 + SUB, col + HALF, D_BUFS, WG * D_BUFS)
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_mm_nt_kernel(a_desc, b_desc, d_desc, a_scale_ptr, stride_as_k,
                              b_scale_ptr, stride_bs_e, stride_bs_n,
                              tile_row_ptr, tile_expert_ptr, tile_waves_ptr, tiles_m, N,
                              K: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                              GROUP_M: gl.constexpr, D_BUFS: gl.constexpr, num_warps: gl.constexpr):
        KB: gl.constexpr = K // 128
        tiles_n = N // BLOCK_N   # N is a multiple of 128 = BLOCK_N (grouped_gemm._nt_shapes checks it)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        d_smem = gl.allocate_shared_memory(d_desc.dtype, [2 * D_BUFS] + d_desc.block_type.shape, d_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)   # both consumer warpgroups release a stage
        # The default partition (num_warps = 4) is warpgroup 0; warpgroup 1 and the producer are
        # workers: 232 registers for warpgroup 1, 40 for the producer.
        gl.warp_specialize(
            [(_wg_consumer, (d_desc, a_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                             b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr,
                             tile_waves_ptr, tiles_m, tiles_n, KB, BLOCK_N, NUM_STAGES, GROUP_M, D_BUFS, 0)),
             (_wg_consumer, (d_desc, a_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                             b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr,
                             tile_waves_ptr, tiles_m, tiles_n, KB, BLOCK_N, NUM_STAGES, GROUP_M, D_BUFS, 1)),
             (_producer, (a_desc, b_desc, a_smem, b_smem, ready, empty, tile_row_ptr, tile_expert_ptr,
                          tiles_m, tiles_n, N, KB, BLOCK_N, NUM_STAGES, GROUP_M))],
            worker_num_warps=[4, 1], worker_num_regs=[232, 40])
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8e4nv"}


def _desc(t: torch.Tensor, block: list[int]):
    layout = gl.NVMMASharedLayout.get_default_for(block, getattr(gl, _GL_DTYPES[t.dtype]))
    return GluonTensorDescriptor.from_tensor(t, block, layout)


@functools.lru_cache(maxsize=256)
def _tile_tables(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [3, M tiles] on ``device``: first row, expert, waves of each M tile (:func:`m_tiles`). Cached
    per routing: a training step meets the same counts in fprop, dgrad and every layer's backward,
    and building the table (a pinned host copy) costs more host time than the launch."""
    rows, experts, waves = m_tiles(counts)
    return device_ints(rows + experts + waves, torch.int32, device).view(3, len(rows))


@functools.lru_cache(maxsize=8)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


BLOCK_N = 128     # output columns per tile: one 128-wide weight scale block, two 64-column quarters
NUM_WARPS = 4     # the default partition: consumer warpgroup 0 (warpgroup 1 and the producer are workers)
QUARTER = [WAVE_M // 2, BLOCK_N // 2]   # [rows, columns] of one output quarter: a staging buffer, a TMA store box


@dataclass(frozen=True)
class GluonConfig:
    """Pipeline depth, output staging and tile order of one launch.

    num_stages: A + B stages in the mbarrier ring (48 KiB each);
    d_bufs:     output staging buffers per consumer warpgroup, one [64, 64] quarter each; None = 4 for
                bf16, 2 for float32 (64 KiB in all);
    group_m:    M tiles that share each N tile in the tile order (L2 reuse of B[e]).
    Shared memory (227 KiB per CTA on Hopper) must hold num_stages x 48 KiB + the staging buffers."""

    num_stages: int = 3
    d_bufs: int | None = None
    group_m: int = 8

    def __post_init__(self):
        if self.num_stages < 2 or self.group_m < 1 or (self.d_bufs is not None and self.d_bufs < 1):
            raise ValueError(f"GluonConfig: need num_stages >= 2, group_m >= 1, d_bufs >= 1, got {self}")

    def staging(self, out_dtype: torch.dtype) -> int:
        if self.d_bufs is not None:
            return self.d_bufs
        return 4 if out_dtype == torch.bfloat16 else 2

    def smem_bytes(self, out_dtype: torch.dtype) -> int:
        staged = 2 * self.staging(out_dtype) * QUARTER[0] * QUARTER[1] * out_dtype.itemsize
        return self.num_stages * (TILE_M + BLOCK_N) * FP8_TILE + staged


# 3 stages and four bf16 quarters: 3 x 48 + 64 = 208 KiB (H100 sweep: bench/RESULTS.md, "Gluon engine").
NT_CONFIG = GluonConfig()
SMEM_LIMIT = 232448   # bytes of shared memory one CTA may use on sm90


def grouped_mm_nt(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts,
                  out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | None = None) -> torch.Tensor:
    """A: float8_e4m3fn [R, K] with a_scale float32 [R, K/128] (any strides), or MXFP4 uint8 [R, K/2]
    with a_scale uint8 [R, K/32]; B: float8_e4m3fn [E, N, K] with b_scale float32 [E, N/128, K/128];
    counts: E ints, multiples of 128, summing to R -> out_dtype (bfloat16 or float32) [R, N]: rows of
    expert e times B[e]^T. The signature and result of grouped_gemm.grouped_mm_nt (``config``: a
    :class:`GluonConfig`; None or another engine's config = NT_CONFIG); an MXFP4 A is converted to
    FP8 first (mxfp4_to_fp8_rowwise, bit-identical to the decode inside the Triton kernel). CUDA
    tensors on a Hopper GPU (:func:`supported`)."""
    mxfp4, r, n, k, counts = _nt_shapes(a, a_scale, b, b_scale, counts, "grouped_mm_nt")
    _check_out_dtype(out_dtype, "grouped_mm_nt")
    if not supported(a.device):
        raise RuntimeError(f"gluon grouped_mm_nt: needs Gluon and a Hopper (sm90) GPU, got {a.device}")
    cfg = config if isinstance(config, GluonConfig) else NT_CONFIG
    if cfg.smem_bytes(out_dtype) > SMEM_LIMIT:
        raise ValueError(f"gluon grouped_mm_nt: {cfg} needs {cfg.smem_bytes(out_dtype)} bytes of shared memory, "
                         f"more than the {SMEM_LIMIT} a CTA has")
    out = torch.empty(r, n, dtype=out_dtype, device=a.device)
    if r == 0 or n == 0:
        return out
    if mxfp4:
        a, a_scale = mxfp4_to_fp8_rowwise(a, a_scale)
    tables = _tile_tables(tuple(counts), a.device)
    tiles_m = tables.shape[1]
    a_scale = m_major(a_scale)          # the consumer reads 128 rows' scales of one K block at once
    b_scale = b_scale.contiguous()      # one scale per K block at consecutive addresses
    tiles = tiles_m * triton.cdiv(n, BLOCK_N)
    grid = (min(tiles, _num_sms(a.device.index or 0)),)
    _grouped_mm_nt_kernel[grid](
        _desc(a, [TILE_M, FP8_TILE]), _desc(b.view(-1, k), [BLOCK_N, FP8_TILE]),
        _desc(out, QUARTER), a_scale, a_scale.stride(1),
        b_scale, b_scale.stride(0), b_scale.stride(1),
        tables[0], tables[1], tables[2], tiles_m, n,
        K=k, BLOCK_N=BLOCK_N, NUM_STAGES=cfg.num_stages, GROUP_M=cfg.group_m, D_BUFS=cfg.staging(out_dtype),
        num_warps=NUM_WARPS)
    return out


def compile_sm90(k: int = 1024, out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig = NT_CONFIG):
    """-> the engine's kernel compiled for sm90 (a triton CompiledKernel: .asm["ptx"], ["cubin"]) at
    contraction K = k, without a GPU: Triton compiles for GPUTarget("cuda", 90, 32) from small host
    tensors standing in for the operands (only dtypes, strides and alignment reach the compiler). The
    CPU tests check with it that the kernel still compiles on the installed Triton, uses wgmma and does
    not spill."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    e, n, r = 2, 2 * BLOCK_N, 2 * TILE_M
    a = torch.empty(r, k, dtype=torch.float8_e4m3fn)
    b = torch.empty(e * n, k, dtype=torch.float8_e4m3fn)
    out = torch.empty(r, n, dtype=out_dtype)
    scale = torch.empty(k // FP8_TILE, r).t()
    tables = torch.empty(3, 2, dtype=torch.int32)
    args = {"a_desc": _desc(a, [TILE_M, FP8_TILE]), "b_desc": _desc(b, [BLOCK_N, FP8_TILE]),
            "d_desc": _desc(out, QUARTER), "a_scale_ptr": scale, "stride_as_k": r,
            "b_scale_ptr": scale, "stride_bs_e": 16, "stride_bs_n": 16, "tile_row_ptr": tables,
            "tile_expert_ptr": tables, "tile_waves_ptr": tables, "tiles_m": 2, "N": n}
    constexprs = {"K": k, "BLOCK_N": BLOCK_N, "NUM_STAGES": config.num_stages, "GROUP_M": config.group_m,
                  "D_BUFS": config.staging(out_dtype), "num_warps": NUM_WARPS}
    names = [p.name for p in _grouped_mm_nt_kernel.params]
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in names}
    src = GluonASTSource(_grouped_mm_nt_kernel, signature, {(names.index(c),): v for c, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
