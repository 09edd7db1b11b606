"""Grouped blockwise FP8 GEMMs for Hopper in Triton's Gluon dialect: M-grouped (fprop, dgrad) and
K-grouped (the weight gradients).

``out[rows of e] = A[rows of e] @ B[e]^T`` with A float8_e4m3fn [R, K] in 1x128 tiles along K (float32
power-of-two scales, M-major as FP8BlockTensor stores them) and B float8_e4m3fn [E, N, K] in 128x128
blocks. The contract, the numerics and the validation are those of
:func:`moe_fp4.kernels.grouped_gemm.grouped_mm_nt`, its Triton twin: one wgmma chain per 128-wide K
block into a fresh float32 partial, then ``acc += partial * (s_a * s_b)`` on the CUDA cores. Gluon has
no interpreter, so the CPU suite runs the twin (and the pure-torch reference) and compiles this engine
for sm90; the GPU tests compare this engine with both.

Schedule (why each piece: docs/DESIGN.md, "The Gluon GEMM engine"):
- persistent: one program per SM walks tiles t = pid, pid + P, ... of a grouped tile list. An M tile
  is up to 256 rows of one expert (two 128-row waves; an expert's last tile may have one), so no rows
  are computed for padding and no tile straddles two experts. Tiles are ordered in groups of GROUP_M
  M tiles per N tile: consecutive programs share B[e]'s N tile while it is in L2.
- warp-specialized: a 1-warp TMA producer (40 registers) fills a NUM_STAGES-deep mbarrier ring with
  A (256 x 128) and B (BLOCK_N x 128); two consumer warpgroups, each its own partition, take one wave
  each: they issue wgmma, promote, and store their wave through shared memory with TMA while the next
  tile's loads are already in flight. The partitions share one bundle (an aggregate, as Triton's Gluon
  tutorials pass partition state): the descriptors, the ring's buffers and barriers, the staging
  buffers, the scales and the tile table.
- scales: A's come from global memory (coalesced along M) and B's is one scalar per K block, both
  loaded one K block before the wgmma they scale is waited on, so their latency hides under the MMA.
- an MXFP4 A is converted to FP8 first (mxfp4_to_fp8_rowwise), then multiplied as an FP8 A.

The weight gradients (:func:`grouped_mm_wgrad`, twin grouped_gemm.grouped_mm_wgrad): out[e] [N, K] =
A[:, tokens of e] @ B[:, tokens of e]^T, both operands in 1x128 tiles along the tokens. Same
persistent, warp-specialized pipeline over (expert, 256-row tile, 128-column tile), contracting over
the expert's tokens 128 at a time; both scales are vectors (per row and per column), so the producer
TMA-loads each token block's scale rows into the ring beside the operands and the consumers read them
from shared memory.
"""

# No ``from __future__ import annotations``: Triton 3.6's aggregates check their fields against the class
# annotations themselves, which must be types, not strings.

import functools
from dataclasses import dataclass

import torch
import triton

try:  # Gluon's Hopper API as Triton 3.6 ships it (the GPU image's Triton), and as 3.7+ renamed it
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
    from triton.language.core import _aggregate as aggregate  # the spelling of 3.6 and of its Gluon tutorials
    # TMA copies: async_copy_global_to_shared / async_copy_shared_to_global in 3.6, async_load /
    # async_store since (the old names then raise). Same arguments for what this module passes.
    _tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
    _tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global
    _ = (gluon.jit, gluon.constexpr_function, gl.warp_specialize, gl.NVMMADistributedLayout, mbarrier.MBarrierLayout,
         gl.to_tensor, tma.tensor_descriptor, gl.shared_memory_descriptor)
    AVAILABLE = True
except (ImportError, AttributeError, AssertionError):  # pragma: no cover - no usable Gluon: the Triton engine
    # AssertionError: Gluon's import asserts in a process that imported Triton under TRITON_INTERPRET=1 and then
    # turned the interpreter off (a test's spawned ranks, which import transformers before choosing the
    # references); Gluon cannot run in that process, and moe_fp4 must still import.
    AVAILABLE = False

from moe_fp4.kernels.fp8 import m_major, mxfp4_to_fp8_rowwise
from moe_fp4.kernels.grouped_gemm import (
    GROUP_ALIGN,
    _check_out_dtype,
    _nt_shapes,
    _tma_ok,
    _wgrad_shapes,
    device_ints,
    device_offsets,
    group_offsets,
)
from moe_fp4.kernels.grouped_gemm import grouped_mm_wgrad as grouped_wgrad_twin
from moe_fp4.kernels.numerics import FP8_TILE

WAVE_M = GROUP_ALIGN  # rows per wave (one consumer warpgroup's, in two m64 halves): an expert's rows are whole waves
TILE_M = 2 * WAVE_M   # rows per M tile (two waves of one expert)


def supported(device: torch.device) -> bool:
    """True when this engine can run on ``device``: Gluon imports and the GPU is a Hopper (sm90)."""
    device = torch.device(device)
    if not AVAILABLE or device.type != "cuda":
        return False
    return _hopper(device.index if device.index is not None else torch.cuda.current_device())


@functools.lru_cache(maxsize=16)
def _hopper(index: int) -> bool:
    # Cached: every launch asks, and torch.cuda.is_available() and the capability query cost host time
    # at each launch (the layer step issues its kernels from Python, and right after the routing's sync
    # the GPU waits while the host issues them).
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index) == (9, 0)


def m_tiles_on_device(counts: torch.Tensor, rows: int) -> torch.Tensor:
    """counts: int tensor [E] (multiples of 128, summing to at most ``rows``, a multiple of 128) -> int32
    [3, (rows / 128 + E + 1) // 2] on counts' device, built there (no host sync): first row, expert and
    waves of each M tile, the tiles of :func:`m_tiles` first, then tiles of expert E (stored as zeros)
    over the rows past the groups, then entries with no waves (nothing). The length is a static bound:
    expert e has ceil(c_e / 256) tiles and the tail ceil(tail / 256), at most rows / 256 + (E + 1) / 2."""
    n_exp = counts.shape[0]
    c = counts.to(torch.int64)
    per = (c + TILE_M - 1) // TILE_M
    tile_end = torch.cumsum(per, 0)
    row_end = torch.cumsum(c, 0)
    j = torch.arange((rows // WAVE_M + n_exp + 1) // 2, device=c.device)
    e = torch.searchsorted(tile_end, j, right=True)
    ec = e.clamp(max=n_exp - 1)
    local = j - (tile_end - per)[ec]
    row = (row_end - c)[ec] + local * TILE_M
    waves = ((c[ec] - local * TILE_M) // WAVE_M).clamp(max=2)
    tail = e >= n_exp
    tail_row = row_end[-1] + (j - tile_end[-1]) * TILE_M
    row = torch.where(tail, tail_row, row)
    waves = torch.where(tail, ((rows - tail_row) // WAVE_M).clamp(0, 2), waves)
    return torch.stack([row, e, waves]).to(torch.int32)


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
        # A [64, block_n] half over one consumer warpgroup's 4 warps: 16 rows each, one m64 wgmma.
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                         instr_shape=[16, block_n, 32])

    @aggregate
    class _NtPartitions:
        """What the M-grouped kernel's partitions share: the TMA descriptors of A, B and the output, the
        ring (A and B stages, its ``ready`` and ``empty`` barriers), the output staging buffers, A's and
        B's scales and the tile table (first row, expert and waves of each M tile; expert E marks a tile of
        zeros past the groups, see :func:`m_tiles_on_device`)."""

        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        d_desc: tma.tensor_descriptor
        a_smem: gl.shared_memory_descriptor
        b_smem: gl.shared_memory_descriptor
        d_smem: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        a_scale_ptr: gl.tensor
        stride_as_k: gl.tensor
        b_scale_ptr: gl.tensor
        stride_bs_e: gl.tensor
        stride_bs_n: gl.tensor
        tile_row_ptr: gl.tensor
        tile_expert_ptr: gl.tensor
        tile_waves_ptr: gl.tensor
        tiles_m: gl.tensor
        tiles_n: gl.tensor
        N: gl.tensor
        num_experts: gl.tensor
        KB: gl.constexpr
        NUM_STAGES: gl.constexpr
        GROUP_M: gl.constexpr
        D_BUFS: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, a_desc, b_desc, d_desc, a_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                     b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr, tile_waves_ptr, tiles_m,
                     tiles_n, N, num_experts, KB, NUM_STAGES, GROUP_M, D_BUFS):
            self.a_desc = a_desc
            self.b_desc = b_desc
            self.d_desc = d_desc
            self.a_smem = a_smem
            self.b_smem = b_smem
            self.d_smem = d_smem
            self.ready = ready
            self.empty = empty
            self.a_scale_ptr = a_scale_ptr
            self.stride_as_k = stride_as_k
            self.b_scale_ptr = b_scale_ptr
            self.stride_bs_e = stride_bs_e
            self.stride_bs_n = stride_bs_n
            self.tile_row_ptr = tile_row_ptr
            self.tile_expert_ptr = tile_expert_ptr
            self.tile_waves_ptr = tile_waves_ptr
            self.tiles_m = tiles_m
            self.tiles_n = tiles_n
            self.N = N
            self.num_experts = num_experts
            self.KB = gl.constexpr(KB)
            self.NUM_STAGES = gl.constexpr(NUM_STAGES)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.D_BUFS = gl.constexpr(D_BUFS)

    @gluon.jit
    def _slot(it, NUM_STAGES: gl.constexpr):
        """Fill ``it`` of the ring (fills are counted on across tiles) -> (its stage, its phase): the
        stage's barriers complete one phase per fill, so a wait for fill ``it`` names parity
        (it // NUM_STAGES) & 1 (a producer waiting for the fill before it to be released: the other one)."""
        return it % NUM_STAGES, (it // NUM_STAGES) & 1

    @gluon.jit
    def _tile(t, tiles_m, tiles_n, GROUP_M: gl.constexpr):
        """Tile index t -> (M tile, N tile): GROUP_M M tiles per N tile, M fastest within a group."""
        per_group = GROUP_M * tiles_n
        first_m = (t // per_group) * GROUP_M
        size_m = gl.minimum(tiles_m - first_m, GROUP_M)
        return first_m + (t % per_group) % size_m, (t % per_group) // size_m

    @gluon.jit
    def _producer(p):
        # One warp: waits for a free stage, then TMA-loads A's 256 rows and B[e]'s BLOCK_N rows of one
        # K block into it. The fill counter runs on across tiles, like the consumers'.
        nbytes: gl.constexpr = p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
        BLOCK_N: gl.constexpr = p.b_desc.block_type.shape[0]
        it = 0
        for t in range(gl.program_id(0), p.tiles_m * p.tiles_n, gl.num_programs(0)):
            mt, nt = _tile(t, p.tiles_m, p.tiles_n, p.GROUP_M)
            row0 = gl.load(p.tile_row_ptr + mt)
            expert = gl.load(p.tile_expert_ptr + mt)
            brow = expert * p.N + nt * BLOCK_N
            if expert < p.num_experts:   # a tile of zeros past the groups loads nothing
                for kb in range(p.KB):
                    s, phase = _slot(it, p.NUM_STAGES)
                    mbarrier.wait(p.empty.index(s), phase ^ 1)
                    mbarrier.expect(p.ready.index(s), nbytes)
                    _tma_load(p.a_desc, [row0, kb * 128], p.ready.index(s), p.a_smem.index(s))
                    _tma_load(p.b_desc, [brow, kb * 128], p.ready.index(s), p.b_smem.index(s))
                    it += 1

    @gluon.jit
    def _store_half(acc, p, n_store, row, col, WG: gl.constexpr):
        """One [64, 128] half of warpgroup WG's wave through its staging buffers (WG * D_BUFS ... of the
        2 x D_BUFS, in turn) and TMA -> stores issued."""
        # Buffer n_store % D_BUFS was last read by the store D_BUFS stores ago: wait for that one only
        # (store_wait counts this thread's own bulk stores, so each consumer partition waits for its own).
        tma.store_wait(pendings=p.D_BUFS - 1)
        buf = p.d_smem.index(WG * p.D_BUFS + n_store % p.D_BUFS)
        buf.store(acc.to(p.d_desc.dtype))
        fence_async_shared()
        _tma_store(p.d_desc, [row, col], buf)
        return n_store + 1

    @gluon.jit
    def _fp8_block_scales(nk, sa0, sa1, sb, as_ptrs, bs_ptr, stride_as_k, SUB: gl.constexpr):
        """A K block -> (s0, s1): s_a * s_b of the wave's two 64-row halves, from the scales prefetched
        one block ahead (sa0, sa1, sb), and block nk's, loaded now: (sa0, sa1, sb) out."""
        s0 = sa0 * sb
        s1 = sa1 * sb
        sa0 = gl.load(as_ptrs + nk * stride_as_k)
        sa1 = gl.load(as_ptrs + (nk * stride_as_k + SUB))
        sb = gl.load(bs_ptr + nk)
        return s0, s1, sa0, sa1, sb

    @gluon.jit
    def _fma_rows(acc, raw, s_row):
        """acc + raw * s_row[:, None] as one fma.rn per element, in place: written as tensor arithmetic
        the products of a whole half could be formed before the adds while the raw accumulator stays
        live as the next wgmma's operand (64 more registers than the wave has)."""
        return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [raw, s_row[:, None], acc],
                                         dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _wave(p, as_ptrs, bs_ptr, it, BASE: gl.constexpr, SUB: gl.constexpr, layout: gl.constexpr):
        """One wave of a tile (rows BASE .. BASE + 2 SUB - 1 of each stage) over the KB K blocks ->
        (acc0, acc1, it): its two [SUB, BLOCK_N] float32 halves and the fill counter after them.

        Per K block: one m64nBLOCK_N wgmma chain per 64-row half into one raw accumulator, waited, then
        promoted (acc += raw * s_a * s_b, the twin's fma) while the other warpgroup's chain runs on the
        tensor cores. A wgmma reads both operands from shared memory: two m64n128 chains read A once
        and B twice per wave and K block (48 KiB), where four m64n64 quarters would read each twice
        (64 KiB) beside the ring's TMA writes, against shared memory's 128 bytes a cycle.
        Registers: two halves and one raw, 3 x 64.
        The scales are loaded one K block ahead: a load issued now is consumed a whole block later, so
        its latency never stalls a promotion; the last block reloads itself."""
        BLOCK_N: gl.constexpr = p.d_desc.block_type.shape[1]
        acc0 = gl.zeros((SUB, BLOCK_N), gl.float32, layout)
        acc1 = gl.zeros((SUB, BLOCK_N), gl.float32, layout)
        raw = gl.zeros((SUB, BLOCK_N), gl.float32, layout)
        sa0 = gl.load(as_ptrs)
        sa1 = gl.load(as_ptrs + SUB)
        sb = gl.load(bs_ptr)
        for kb in range(p.KB):
            nk = gl.minimum(kb + 1, p.KB - 1)
            # The next block's scale loads go out before the stage wait, in flight while it waits.
            s0, s1, sa0, sa1, sb = _fp8_block_scales(nk, sa0, sa1, sb, as_ptrs, bs_ptr, p.stride_as_k, SUB)
            s, phase = _slot(it, p.NUM_STAGES)
            mbarrier.wait(p.ready.index(s), phase)
            b = p.b_smem.index(s).permute((1, 0))
            raw = warpgroup_mma(p.a_smem.index(s).slice(BASE, SUB, dim=0), b, raw, use_acc=False, is_async=True)
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            acc0 = _fma_rows(acc0, raw, s0)
            raw = warpgroup_mma(p.a_smem.index(s).slice(BASE + SUB, SUB, dim=0), b, raw, use_acc=False,
                                is_async=True)
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            mbarrier.arrive(p.empty.index(s), count=1)   # one of the stage's two releases
            acc1 = _fma_rows(acc1, raw, s1)
            it += 1
        return acc0, acc1, it

    @gluon.jit
    def _wg_consumer(p, WG: gl.constexpr):
        # One warpgroup, its own partition: wave WG (rows 128 WG .. 128 WG + 127) of every tile, as two
        # [64, BLOCK_N] halves (_wave), each stored through its staging buffers (the d_desc box) and TMA.
        # Its own partition, because Triton puts a partition-wide bar.sync before every mbarrier wait
        # and arrive: one partition for both waves would be held in step by that barrier, so neither
        # warpgroup's promotion would overlap the other's wgmma; two partitions drift apart and take
        # turns on the tensor cores.
        # A one-wave tile (an expert's last 128 rows): warpgroup 1 computes nothing, it only releases
        # the tile's stages, and warpgroup 0 has the tensor cores to itself.
        SUB: gl.constexpr = p.d_desc.block_type.shape[0]       # 64 rows: one m64 wgmma
        BLOCK_N: gl.constexpr = p.d_desc.block_type.shape[1]
        BASE: gl.constexpr = WG * 2 * SUB                      # this warpgroup's first row in the tile
        layout: gl.constexpr = _acc_layout(BLOCK_N, 4)
        rows = gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
        it = 0
        n_store = 0
        for t in range(gl.program_id(0), p.tiles_m * p.tiles_n, gl.num_programs(0)):
            mt, nt = _tile(t, p.tiles_m, p.tiles_n, p.GROUP_M)
            expert = gl.load(p.tile_expert_ptr + mt)
            waves = gl.load(p.tile_waves_ptr + mt)
            if expert >= p.num_experts:
                # Past the groups (a static bound's tail): this warpgroup's wave, if the tile has it, is
                # stored as zeros; nothing was loaded, so no stage is waited on or released.
                if waves > WG:
                    row0 = gl.load(p.tile_row_ptr + mt) + BASE
                    zero = gl.zeros((SUB, BLOCK_N), gl.float32, layout)
                    n_store = _store_half(zero, p, n_store, row0, nt * BLOCK_N, WG)
                    n_store = _store_half(zero, p, n_store, row0 + SUB, nt * BLOCK_N, WG)
            elif (WG == 0) | (waves == 2):
                row0 = gl.load(p.tile_row_ptr + mt) + BASE
                bs_ptr = (p.b_scale_ptr + expert.to(gl.int64) * p.stride_bs_e
                          + (nt * BLOCK_N // 128) * p.stride_bs_n)
                col = nt * BLOCK_N
                acc0, acc1, it = _wave(p, p.a_scale_ptr + row0 + rows, bs_ptr, it, BASE, SUB, layout)
                n_store = _store_half(acc0, p, n_store, row0, col, WG)
                n_store = _store_half(acc1, p, n_store, row0 + SUB, col, WG)
            else:
                # Warpgroup 1 in a one-wave tile: no rows of its own. It still releases every stage,
                # each after it was filled (the empty barrier counts two arrivals per fill).
                for kb in range(p.KB):
                    s, phase = _slot(it, p.NUM_STAGES)
                    mbarrier.wait(p.ready.index(s), phase)
                    mbarrier.arrive(p.empty.index(s), count=1)
                    it += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_mm_nt_kernel(a_desc, b_desc, d_desc, a_scale_ptr, stride_as_k,
                              b_scale_ptr, stride_bs_e, stride_bs_n,
                              tile_row_ptr, tile_expert_ptr, tile_waves_ptr, tiles_m, N, num_experts,
                              K: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                              D_BUFS: gl.constexpr, num_warps: gl.constexpr):
        # a_desc: A [R, K] in [256, 128] boxes, b_desc: B viewed as [E N, K] in [BLOCK_N, 128] boxes,
        # d_desc: the output [R, N] in [64, BLOCK_N] boxes; a_scale_ptr: A's scales M-major (K block kb
        # of row r at r + kb stride_as_k); b_scale_ptr: B's [E, N/128, K/128]; the tile table: _tile_tables.
        BLOCK_N: gl.constexpr = b_desc.block_type.shape[0]
        tiles_n = N // BLOCK_N   # N is a multiple of 128 = BLOCK_N (grouped_gemm._nt_shapes checks it)
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        d_smem = gl.allocate_shared_memory(d_desc.dtype, [2 * D_BUFS] + d_desc.block_type.shape, d_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)   # both consumer warpgroups release a stage
        # gl.to_tensor: Triton passes an integer argument equal to 1 as a constexpr, the bundle holds tensors.
        p = _NtPartitions(a_desc, b_desc, d_desc, a_smem, b_smem, d_smem, ready, empty,
                          a_scale_ptr, gl.to_tensor(stride_as_k), b_scale_ptr, gl.to_tensor(stride_bs_e),
                          gl.to_tensor(stride_bs_n), tile_row_ptr, tile_expert_ptr, tile_waves_ptr,
                          gl.to_tensor(tiles_m), gl.to_tensor(tiles_n), gl.to_tensor(N), gl.to_tensor(num_experts),
                          K // 128, NUM_STAGES, GROUP_M, D_BUFS)
        # The default partition (num_warps = 4) is warpgroup 0; warpgroup 1 and the producer are
        # workers: 232 registers for warpgroup 1, 40 for the producer.
        gl.warp_specialize([(_wg_consumer, (p, 0)), (_wg_consumer, (p, 1)), (_producer, (p,))],
                           worker_num_warps=[4, 1], worker_num_regs=[232, 40])
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))

    # ----------------------------------------------------------------------------------------
    # K-grouped: the weight gradients. out[e] = A[:, tokens of e] @ B[:, tokens of e]^T with A [N, R]
    # and B [K, R], both FP8 in 1x128 tiles along R (the tokens), scales M-major [N, R/128] / [K, R/128].
    # A tile is 256 rows of out[e] (two 128-row waves, one per consumer warpgroup; with
    # GluonConfig.split 128 rows, one warpgroup's) x 128 columns; its contraction runs over expert e's
    # tokens, 128 at a time. The pipeline is the M-grouped one's: the producer streams A [rows, 128],
    # B [128, 128] and their scales per token block into the same kind of ring.

    @aggregate
    class _WgradPartitions:
        """What the weight-gradient kernel's partitions share: the TMA descriptors of A, B, their scale
        rows and the output, the ring (A, B and scale stages, ``ready`` and ``empty``), the staging
        buffers, the two warpgroups' ``turn`` barriers (PING_PONG), the experts' token offsets and the
        sizes. PING_PONG (GluonConfig.split): each consumer warpgroup takes whole 128-row tiles of its
        own, in turns; otherwise both take one 128-row wave of each 256-row tile."""

        a_desc: tma.tensor_descriptor
        b_desc: tma.tensor_descriptor
        as_desc: tma.tensor_descriptor
        bs_desc: tma.tensor_descriptor
        d_desc: tma.tensor_descriptor
        a_smem: gl.shared_memory_descriptor
        b_smem: gl.shared_memory_descriptor
        as_smem: gl.shared_memory_descriptor
        bs_smem: gl.shared_memory_descriptor
        d_smem: gl.shared_memory_descriptor
        ready: gl.shared_memory_descriptor
        empty: gl.shared_memory_descriptor
        turn: gl.shared_memory_descriptor
        offsets_ptr: gl.tensor
        num_experts: gl.tensor
        N: gl.tensor
        K: gl.tensor
        NUM_STAGES: gl.constexpr
        GROUP_M: gl.constexpr
        D_BUFS: gl.constexpr
        PING_PONG: gl.constexpr

        @gluon.constexpr_function
        def __init__(self, a_desc, b_desc, as_desc, bs_desc, d_desc, a_smem, b_smem, as_smem, bs_smem, d_smem, ready,
                     empty, turn, offsets_ptr, num_experts, N, K, NUM_STAGES, GROUP_M, D_BUFS, PING_PONG):
            self.a_desc = a_desc
            self.b_desc = b_desc
            self.as_desc = as_desc
            self.bs_desc = bs_desc
            self.d_desc = d_desc
            self.a_smem = a_smem
            self.b_smem = b_smem
            self.as_smem = as_smem
            self.bs_smem = bs_smem
            self.d_smem = d_smem
            self.ready = ready
            self.empty = empty
            self.turn = turn
            self.offsets_ptr = offsets_ptr
            self.num_experts = num_experts
            self.N = N
            self.K = K
            self.NUM_STAGES = gl.constexpr(NUM_STAGES)
            self.GROUP_M = gl.constexpr(GROUP_M)
            self.D_BUFS = gl.constexpr(D_BUFS)
            self.PING_PONG = gl.constexpr(PING_PONG)

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):   # Triton 3.7+
        @gluon.jit
        def _as_vector(smem, n: gl.constexpr, layout: gl.constexpr):
            """A [1, n] float32 shared buffer viewed as [n]."""
            return smem.reinterpret(gl.float32, [n], layout)
    else:                                                     # Triton 3.6
        @gluon.jit
        def _as_vector(smem, n: gl.constexpr, layout: gl.constexpr):
            """A [1, n] float32 shared buffer viewed as [n]."""
            return smem._reinterpret(gl.float32, [n], layout)

    @gluon.jit
    def _promote_rc(acc, raw, s_row, s_col):
        """acc + raw * s_row * s_col per element: t = raw * s_row (exact: a power-of-two scale), then one
        fma, which is what the Triton twin computes (fma(dot, s_a * s_b, acc)). Inline PTX because
        written as tensor arithmetic the compiler forms all the products of a half before adding them,
        while the raw accumulator stays live as the next wgmma's operand: more registers than the
        consumers have, so they would spill and ptxas would serialize their wgmmas; one mul + fma per
        element needs one temporary."""
        return gl.inline_asm_elementwise(
            "{ .reg .f32 t; mul.rn.f32 t, $1, $2; fma.rn.f32 $0, t, $3, $4; }", "=f,f,f,f,f",
            [raw, s_row, s_col, acc], dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _wgrad_tile(t, tiles_n, tiles_k, GROUP_M: gl.constexpr):
        """Tile index t -> (expert, row tile, column tile): experts in order (one expert's A and B
        columns stay in L2 while its tiles run), GROUP_M row tiles per column tile within an expert."""
        per_expert = tiles_n * tiles_k
        nt, kt = _tile(t % per_expert, tiles_n, tiles_k, GROUP_M)
        return t // per_expert, nt, kt

    @gluon.jit
    def _wgrad_producer(p):
        # One warp, as _producer: one stage per 128 tokens of the tile's expert, holding A [TILE_N, 128],
        # B [128, 128] and their scales for that token block: A's TILE_N row scales and B's 128 column
        # scales (rows of the M-major scale tensors, TMA-loaded like the operands; rows past N are
        # zero-filled like A's).
        TILE_N: gl.constexpr = p.a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = p.b_desc.block_type.shape[0]
        nbytes: gl.constexpr = (p.a_desc.block_type.nbytes + p.b_desc.block_type.nbytes
                                + p.as_desc.block_type.nbytes + p.bs_desc.block_type.nbytes)
        tiles_n = (p.N + TILE_N - 1) // TILE_N
        tiles_k = p.K // BLOCK_K
        it = 0
        for t in range(gl.program_id(0), p.num_experts * tiles_n * tiles_k, gl.num_programs(0)):
            e, nt, kt = _wgrad_tile(t, tiles_n, tiles_k, p.GROUP_M)
            start = gl.load(p.offsets_ptr + e)
            stop = gl.load(p.offsets_ptr + e + 1)
            for tok in range(start, stop, 128):
                s, phase = _slot(it, p.NUM_STAGES)
                mbarrier.wait(p.empty.index(s), phase ^ 1)
                mbarrier.expect(p.ready.index(s), nbytes)
                _tma_load(p.a_desc, [nt * TILE_N, tok], p.ready.index(s), p.a_smem.index(s))
                _tma_load(p.b_desc, [kt * BLOCK_K, tok], p.ready.index(s), p.b_smem.index(s))
                _tma_load(p.as_desc, [tok // 128, nt * TILE_N], p.ready.index(s), p.as_smem.index(s))
                _tma_load(p.bs_desc, [tok // 128, kt * BLOCK_K], p.ready.index(s), p.bs_smem.index(s))
                it += 1

    @gluon.jit
    def _wgrad_wave(p, it, blocks, BASE: gl.constexpr, SUB: gl.constexpr, layout: gl.constexpr):
        """One wave of a weight-gradient tile (rows BASE .. BASE + 2 SUB - 1 of each stage) over its expert's
        token blocks -> (acc0, acc1, it): two [SUB, 128] float32 halves, as _wave does for fprop.
        Per token block: one m64n128 wgmma chain per 64-row half into one raw accumulator, waited, then
        promoted with the row and column scales (_promote_rc); B's 128 column scales are read from the
        stage once per block (32 registers a thread in this layout). Registers: two halves, one raw and
        the column scales, 3 x 64 + 32."""
        TILE_N: gl.constexpr = p.a_smem.type.shape[1]
        BLOCK_K: gl.constexpr = p.b_smem.type.shape[1]
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        acc0 = gl.zeros((SUB, BLOCK_K), gl.float32, layout)
        acc1 = gl.zeros((SUB, BLOCK_K), gl.float32, layout)
        raw = gl.zeros((SUB, BLOCK_K), gl.float32, layout)
        for kb in range(blocks):
            s, phase = _slot(it, p.NUM_STAGES)
            mbarrier.wait(p.ready.index(s), phase)
            b = p.b_smem.index(s).permute((1, 0))
            raw = warpgroup_mma(p.a_smem.index(s).slice(BASE, SUB, dim=0), b, raw, use_acc=False, is_async=True)
            sa = _as_vector(p.as_smem.index(s), TILE_N, flat)
            s0 = sa.slice(BASE, SUB).load(gl.SliceLayout(1, layout))[:, None]
            s1 = sa.slice(BASE + SUB, SUB).load(gl.SliceLayout(1, layout))[:, None]
            col = _as_vector(p.bs_smem.index(s), BLOCK_K, flat).load(gl.SliceLayout(0, layout))[None, :]
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            acc0 = _promote_rc(acc0, raw, s0, col)
            raw = warpgroup_mma(p.a_smem.index(s).slice(BASE + SUB, SUB, dim=0), b, raw, use_acc=False,
                                is_async=True)
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            mbarrier.arrive(p.empty.index(s), count=1)   # one of the stage's two releases (PING_PONG: its one)
            acc1 = _promote_rc(acc1, raw, s1, col)
            it += 1
        return acc0, acc1, it

    @gluon.jit
    def _wgrad_consumer(p, WG: gl.constexpr):
        # One warpgroup, its own partition: wave WG of every tile as two [64, 128] float32 halves
        # (_wgrad_wave), as _wg_consumer. What differs is the column scale: B's scale varies along the
        # output's columns (one per column and token block), so the promotion is acc += raw * s_a[row] *
        # s_b[col] (_promote_rc, why: there), and in the wgmma layout a thread holds 32 columns of a half.
        # The scales come with the operands through the ring (TMA), so a consumer reads them from shared
        # memory right after issuing the wgmma they scale: no prefetch registers, no global-load latency.
        SUB: gl.constexpr = p.d_desc.block_type.shape[0]     # 64 rows: one m64 wgmma
        TILE_N: gl.constexpr = p.a_smem.type.shape[1]        # rows per tile: 256 (2 waves), or 128 with PING_PONG
        BLOCK_K: gl.constexpr = p.b_smem.type.shape[1]       # 128 columns per tile
        BASE: gl.constexpr = 0 if p.PING_PONG else WG * 2 * SUB
        layout: gl.constexpr = _acc_layout(BLOCK_K, 4)       # a [64, 128] half
        tiles_n = (p.N + TILE_N - 1) // TILE_N
        tiles_k = p.K // BLOCK_K
        it = 0
        n_store = 0
        # PING_PONG: this warpgroup takes every second of the program's tiles, the first at WG, and the
        # two take turns: one enters its tile's K loop only when the other has finished its own (turn[WG],
        # arrived by the other). That orders their waits on the shared ring: a consumer that waited on a
        # stage's barrier two phases ahead of it would take the older phase for its own (a parity wait
        # cannot tell them apart). It is the ping-pong schedule: one's epilogue beside the other's wgmmas.
        mine = WG
        own = 0
        for t in range(gl.program_id(0), p.num_experts * tiles_n * tiles_k, gl.num_programs(0)):
            e, nt, kt = _wgrad_tile(t, tiles_n, tiles_k, p.GROUP_M)
            start = gl.load(p.offsets_ptr + e)
            blocks = (gl.load(p.offsets_ptr + e + 1) - start) // 128
            row0 = nt * TILE_N + BASE
            if p.PING_PONG:
                take = mine % 2 == 0
            else:
                take = mine >= 0
            mine += 1
            if take:
                if p.PING_PONG:
                    if (WG == 1) or (own > 0):
                        mbarrier.wait(p.turn.index(WG), (own - 1 + WG) & 1)
                acc0, acc1, it = _wgrad_wave(p, it, blocks, BASE, SUB, layout)
                if p.PING_PONG:
                    mbarrier.arrive(p.turn.index(1 - WG), count=1)   # the other warpgroup's turn
                    own += 1
                # The second wave of a tile past N (N an odd multiple of 128) ran on TMA's zero fill; it
                # is not stored.
                if row0 < p.N:
                    row = e * p.N + row0    # the output viewed as [E N, K]
                    c = kt * BLOCK_K
                    n_store = _store_half(acc0, p, n_store, row, c, WG)
                    n_store = _store_half(acc1, p, n_store, row + SUB, c, WG)
            else:
                it += blocks   # the other warpgroup's tile (PING_PONG): its stages pass by
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_mm_wgrad_kernel(a_desc, b_desc, as_desc, bs_desc, d_desc, offsets_ptr, num_experts, N, K,
                                 NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, D_BUFS: gl.constexpr,
                                 PING_PONG: gl.constexpr, num_warps: gl.constexpr):
        # offsets_ptr: the E + 1 group offsets (int32) of the tokens; N, K multiples of 128.
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        as_smem = gl.allocate_shared_memory(as_desc.dtype, [NUM_STAGES] + as_desc.block_type.shape, as_desc.layout)
        bs_smem = gl.allocate_shared_memory(bs_desc.dtype, [NUM_STAGES] + bs_desc.block_type.shape, bs_desc.layout)
        d_smem = gl.allocate_shared_memory(d_desc.dtype, [2 * D_BUFS] + d_desc.block_type.shape, d_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # PING_PONG's turns
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1 if PING_PONG else 2)   # PING_PONG: one consumer per stage
        for w in gl.static_range(2):
            mbarrier.init(turn.index(w), count=1)
        # gl.to_tensor: Triton passes an integer argument equal to 1 as a constexpr, the bundle holds tensors.
        p = _WgradPartitions(a_desc, b_desc, as_desc, bs_desc, d_desc, a_smem, b_smem, as_smem, bs_smem, d_smem,
                             ready, empty, turn, offsets_ptr, gl.to_tensor(num_experts), gl.to_tensor(N),
                             gl.to_tensor(K), NUM_STAGES, GROUP_M, D_BUFS, PING_PONG)
        gl.warp_specialize([(_wgrad_consumer, (p, 0)), (_wgrad_consumer, (p, 1)), (_wgrad_producer, (p,))],
                           worker_num_warps=[4, 1], worker_num_regs=[240, 24])
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        for w in gl.static_range(2):
            mbarrier.invalidate(turn.index(w))


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8e4nv"}


def _desc(t: torch.Tensor, block: list[int]):
    return GluonTensorDescriptor.from_tensor(t, block, _default_layout(tuple(block), t.dtype))


@functools.lru_cache(maxsize=64)
def _default_layout(block: tuple[int, ...], dtype: torch.dtype):
    # Cached: building the layout cost about as much host time as the rest of the descriptor.
    return gl.NVMMASharedLayout.get_default_for(list(block), getattr(gl, _GL_DTYPES[dtype]))


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


BLOCK_N = 128     # output columns per tile: one 128-wide weight scale block
NUM_WARPS = 4     # the default partition: consumer warpgroup 0 (warpgroup 1 and the producer are workers)
STORE_BOX = [WAVE_M // 2, BLOCK_N]   # [rows, columns] of one output half of a wave: a staging buffer, a TMA store box


@dataclass(frozen=True)
class GluonConfig:
    """Pipeline depth, output staging and tile order of one launch.

    num_stages: A + B stages in the mbarrier ring (48 KiB each);
    d_bufs:     output staging buffers per consumer warpgroup, each one [64, 128] store box (STORE_BOX);
                None = 64 KiB in all (2 for bf16, 1 for float32);
    group_m:    M tiles that share each N tile in the tile order (L2 reuse of B[e]);
    split:      wgrad only: each consumer warpgroup takes whole 128-row tiles of its own (every second
                tile of the program), so one's epilogue runs beside the other's wgmmas (the ping-pong
                schedule); False: both take one 128-row wave of a 256-row tile.
    Shared memory (227 KiB per CTA on Hopper) must hold num_stages x 48 KiB (wgrad: + 1.5 KiB of scales;
    split: 33 KiB) + the staging buffers."""

    num_stages: int = 3
    d_bufs: int | None = None
    group_m: int = 8
    split: bool = False

    def __post_init__(self):
        if self.num_stages < 2 or self.group_m < 1 or (self.d_bufs is not None and self.d_bufs < 1):
            raise ValueError(f"GluonConfig: need num_stages >= 2, group_m >= 1, d_bufs >= 1, got {self}")

    def staging(self, out_dtype: torch.dtype) -> int:
        """Staging buffers per consumer warpgroup for ``out_dtype``."""
        if self.d_bufs is not None:
            return self.d_bufs
        return 64 * 1024 // (2 * STORE_BOX[0] * STORE_BOX[1] * out_dtype.itemsize)

    def smem_bytes(self, out_dtype: torch.dtype, wgrad: bool = False) -> int:
        """Bytes of shared memory of the ring and the staging buffers (fprop/dgrad, or ``wgrad``)."""
        staged = 2 * self.staging(out_dtype) * STORE_BOX[0] * STORE_BOX[1] * out_dtype.itemsize
        if not wgrad:
            return self.num_stages * (TILE_M + BLOCK_N) * FP8_TILE + staged
        rows = self.wgrad_rows()   # A rows and B rows of a stage, FP8, and a float32 scale for each
        return self.num_stages * (rows + BLOCK_N) * (FP8_TILE + 4) + staged

    def wgrad_rows(self) -> int:
        """Rows of the weight gradient per tile: two waves, or one with ``split``."""
        return WAVE_M if self.split else TILE_M


# 3 stages and 64 KiB of staging: 3 x 48 + 64 = 208 KiB (H100 sweep: bench/RESULTS.md, "Gluon engine").
NT_CONFIG = GluonConfig()
SMEM_LIMIT = 232448   # bytes of shared memory one CTA may use on sm90
MBARRIER_BYTES = 1024  # room kept for the ring's barriers beside the buffers


def grouped_mm_nt(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts,
                  out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | None = None) -> torch.Tensor:
    """A: float8_e4m3fn [R, K] with a_scale float32 [R, K/128] (any strides), or MXFP4 uint8 [R, K/2]
    with a_scale uint8 [R, K/32]; B: float8_e4m3fn [E, N, K] with b_scale float32 [E, N/128, K/128];
    counts: E ints, multiples of 128, summing to R, or an int tensor [E] on A's device (no host sync: the
    tile table is built there, :func:`m_tiles_on_device`; the rows past the groups come out zero) -> out_dtype
    (bfloat16 or float32) [R, N]: rows of expert e times B[e]^T. The signature and result of
    grouped_gemm.grouped_mm_nt (``config``: a
    :class:`GluonConfig`; None or another engine's config = NT_CONFIG). An MXFP4 A is converted to
    FP8 first (mxfp4_to_fp8_rowwise), as the twin does. CUDA tensors on a Hopper GPU (:func:`supported`)."""
    mxfp4, r, n, k, counts = _nt_shapes(a, a_scale, b, b_scale, counts, "grouped_mm_nt")
    _check_out_dtype(out_dtype, "grouped_mm_nt")
    if not supported(a.device):
        raise RuntimeError(f"gluon grouped_mm_nt: needs Gluon and a Hopper (sm90) GPU, got {a.device}")
    cfg = config if isinstance(config, GluonConfig) else NT_CONFIG
    if cfg.split:
        raise ValueError("gluon grouped_mm_nt: GluonConfig.split is a weight-gradient layout (grouped_mm_wgrad)")
    smem = cfg.smem_bytes(out_dtype)
    if smem + MBARRIER_BYTES > SMEM_LIMIT:
        raise ValueError(f"gluon grouped_mm_nt: {cfg} needs {smem} bytes of shared memory and its barriers, "
                         f"more than the {SMEM_LIMIT} a CTA has")
    out = torch.empty(r, n, dtype=out_dtype, device=a.device)
    if r == 0 or n == 0:
        return out
    if mxfp4:
        a, a_scale = mxfp4_to_fp8_rowwise(a, a_scale)
    if isinstance(counts, torch.Tensor):
        tables = m_tiles_on_device(counts, r)
    else:
        tables = _tile_tables(tuple(counts), a.device)
    tiles_m = tables.shape[1]
    a_scale = m_major(a_scale)          # the consumer reads 128 rows' scales of one K block at once
    b_scale = b_scale.contiguous()      # one scale per K block at consecutive addresses
    tiles = tiles_m * triton.cdiv(n, BLOCK_N)
    grid = (min(tiles, _num_sms(a.device.index or 0)),)
    _grouped_mm_nt_kernel[grid](
        _desc(a, [TILE_M, FP8_TILE]), _desc(b.view(-1, k), [BLOCK_N, FP8_TILE]), _desc(out, STORE_BOX),
        a_scale, a_scale.stride(1), b_scale, b_scale.stride(0), b_scale.stride(1),
        tables[0], tables[1], tables[2], tiles_m, n, b.shape[0],
        K=k, NUM_STAGES=cfg.num_stages, GROUP_M=cfg.group_m, D_BUFS=cfg.staging(out_dtype), num_warps=NUM_WARPS)
    return out


@functools.lru_cache(maxsize=256)
def _offsets(counts: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """int32 [E + 1] group offsets on ``device``, cached per routing (the layer's two wgrads share one)."""
    return device_ints(group_offsets(counts), torch.int32, device)


def _scale_rows(scale: torch.Tensor) -> torch.Tensor:
    """float32 [M, T] scales (any strides) -> [T, M] row-major with 16-byte aligned rows (a TMA source)."""
    rows = m_major(scale).t()
    return rows if _tma_ok(rows) else rows.contiguous()


WGRAD_CONFIG = GluonConfig()   # the same ring and staging as fprop: 3 x 48 KiB + 64 KiB


def grouped_mm_wgrad(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts,
                     out_dtype: torch.dtype = torch.float32, config: GluonConfig | None = None) -> torch.Tensor:
    """A: float8_e4m3fn [N, R] with a_scale float32 [N, R/128], B: float8_e4m3fn [K, R] with b_scale
    float32 [K, R/128] (1x128 tiles along R, the tokens; scales any strides); counts: E ints, multiples
    of 128, summing to R, or an int tensor [E] on A's device (device offsets, no host sync; the tokens past
    the groups are left out) -> out_dtype (bfloat16 or float32) [E, N, K]: out[e] = A[:, tokens of e] @
    B[:, tokens of e]^T, zeros for an expert without tokens. The signature and result of
    grouped_gemm.grouped_mm_wgrad, its Triton twin (``config``: a :class:`GluonConfig`; None or another
    engine's config = WGRAD_CONFIG). N and K that are not multiples of 128 (never in the expert layer,
    whose dims are FP8 tiles) go to the twin: TMA boxes and the tile table assume whole 128-wide tiles.
    CUDA tensors on a Hopper GPU (:func:`supported`)."""
    n, k, counts = _wgrad_shapes(a, a_scale, b, b_scale, counts, "grouped_mm_wgrad")
    _check_out_dtype(out_dtype, "grouped_mm_wgrad")
    if not supported(a.device):
        raise RuntimeError(f"gluon grouped_mm_wgrad: needs Gluon and a Hopper (sm90) GPU, got {a.device}")
    cfg = config if isinstance(config, GluonConfig) else WGRAD_CONFIG
    smem = cfg.smem_bytes(out_dtype, wgrad=True)
    if smem > SMEM_LIMIT:
        raise ValueError(f"gluon grouped_mm_wgrad: {cfg} needs {smem} bytes of shared memory, "
                         f"more than the {SMEM_LIMIT} a CTA has")
    if n % FP8_TILE or k % FP8_TILE:
        return grouped_wgrad_twin(a, a_scale, b, b_scale, counts, out_dtype)
    n_exp = len(counts)
    out = torch.empty(n_exp, n, k, dtype=out_dtype, device=a.device)
    if out.numel() == 0:
        return out
    if a.shape[1] == 0:
        return out.zero_()
    # TMA needs 16-byte aligned rows; R is a multiple of 128, so a copy makes any layout aligned.
    a = a if _tma_ok(a) else a.contiguous()
    b = b if _tma_ok(b) else b.contiguous()
    # The scales as [R/128, N] and [R/128, K] row-major (M-major [N, R/128] transposed): one token
    # block's scales of a tile are one TMA box.
    a_scale_t, b_scale_t = _scale_rows(a_scale), _scale_rows(b_scale)
    rows = cfg.wgrad_rows()
    tiles = n_exp * triton.cdiv(n, rows) * (k // FP8_TILE)
    grid = (min(tiles, _num_sms(a.device.index or 0)),)
    _grouped_mm_wgrad_kernel[grid](
        _desc(a, [rows, FP8_TILE]), _desc(b, [FP8_TILE, FP8_TILE]), _desc(a_scale_t, [1, rows]),
        _desc(b_scale_t, [1, FP8_TILE]), _desc(out.view(-1, k), STORE_BOX),
        device_offsets(counts, torch.int32, a.device) if isinstance(counts, torch.Tensor)
        else _offsets(counts, a.device),
        n_exp, n, k, NUM_STAGES=cfg.num_stages, GROUP_M=cfg.group_m, D_BUFS=cfg.staging(out_dtype),
        PING_PONG=cfg.split, num_warps=NUM_WARPS)
    return out


def compile_sm90(k: int = 1024, out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | None = None,
                 kind: str = "nt", ones: bool = False):
    """-> one of the engine's kernels compiled for sm90 (a triton CompiledKernel: .asm["ptx"], ["cubin"]),
    without a GPU: ``kind`` "nt" (fprop/dgrad at contraction K = k) or "wgrad"; ``config`` None = the
    launcher's (NT_CONFIG, WGRAD_CONFIG). Triton compiles for GPUTarget("cuda", 90, 32) from small host
    tensors standing in for the operands (only dtypes, strides and alignment reach the compiler).
    ``ones``: the integer arguments that a launch may pass as 1 (tile count, scale strides, experts)
    equal to 1, which Triton specializes into constexprs. The CPU tests check with it that each kernel
    still compiles on the installed Triton, uses wgmma and does not spill."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    e, n, r = 2, 2 * BLOCK_N, 2 * TILE_M
    a = torch.empty(r, k, dtype=torch.float8_e4m3fn)
    b = torch.empty(e * n, k, dtype=torch.float8_e4m3fn)
    out = torch.empty(r, n, dtype=out_dtype)
    scale = torch.empty(k // FP8_TILE, r).t()
    tables = torch.empty(3, 2, dtype=torch.int32)
    if kind == "nt":
        config = config or NT_CONFIG
        kernel = _grouped_mm_nt_kernel
        args = {"a_desc": _desc(a, [TILE_M, FP8_TILE]), "b_desc": _desc(b, [BLOCK_N, FP8_TILE]),
                "d_desc": _desc(out, STORE_BOX), "a_scale_ptr": scale, "stride_as_k": r, "b_scale_ptr": scale,
                "stride_bs_e": 16, "stride_bs_n": 16, "tile_row_ptr": tables, "tile_expert_ptr": tables,
                "tile_waves_ptr": tables, "tiles_m": 2, "N": n, "num_experts": e}
        constexprs = {"K": k}
    elif kind == "wgrad":
        config = config or WGRAD_CONFIG
        kernel = _grouped_mm_wgrad_kernel
        scale_rows = torch.empty(k // FP8_TILE, r)
        rows = config.wgrad_rows()
        args = {"a_desc": _desc(a, [rows, FP8_TILE]), "b_desc": _desc(a, [FP8_TILE, FP8_TILE]),
                "as_desc": _desc(scale_rows, [1, rows]), "bs_desc": _desc(scale_rows, [1, FP8_TILE]),
                "d_desc": _desc(out, STORE_BOX), "offsets_ptr": tables, "num_experts": e, "N": n,
                "K": n}
        constexprs = {"PING_PONG": config.split}
    else:
        raise ValueError(f"compile_sm90: kind must be 'nt' or 'wgrad', got {kind!r}")
    constexprs.update({"NUM_STAGES": config.num_stages, "GROUP_M": config.group_m,
                       "D_BUFS": config.staging(out_dtype), "num_warps": NUM_WARPS})
    if ones:
        args.update({name: 1 for name in ("stride_as_k", "stride_bs_e", "stride_bs_n", "tiles_m", "num_experts")
                     if name in args})
    constexprs.update({name: 1 for name, value in args.items() if isinstance(value, int) and value == 1})
    names = [p.name for p in kernel.params]
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in names}
    src = GluonASTSource(kernel, signature, {(names.index(c),): v for c, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
