"""Grouped blockwise FP8 GEMMs for Hopper in Triton's Gluon dialect: M-grouped (fprop, dgrad) and
K-grouped (the weight gradients).

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
- an MXFP4 A: converted to FP8 first by default; with GluonConfig(decode_mxfp4=True) a fourth
  partition (two decoder warps) turns each stage's TMA-loaded packed codes into FP8 codes and row
  scales in shared memory, bit-identical but about a quarter as fast (bench/RESULTS.md, issue 29).

The weight gradients (:func:`grouped_mm_wgrad`, twin grouped_gemm.grouped_mm_wgrad): out[e] [N, K] =
A[:, tokens of e] @ B[:, tokens of e]^T, both operands in 1x128 tiles along the tokens. Same
persistent, warp-specialized pipeline over (expert, 256-row tile, 128-column tile), contracting over
the expert's tokens 128 at a time; both scales are vectors (per row and per column), so the producer
TMA-loads each token block's scale rows into the ring beside the operands and the consumers read them
from shared memory.
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
except (ImportError, AttributeError, AssertionError):  # pragma: no cover - no usable Gluon: the Triton engine
    # AssertionError: Gluon's import asserts in a process that imported Triton under TRITON_INTERPRET=1 and then
    # turned the interpreter off (a test's spawned ranks, which import transformers before choosing the
    # references); Gluon cannot run in that process, and moe_fp4 must still import.
    AVAILABLE = False

from moe_fp4.kernels.fp8 import m_major, mxfp4_to_fp8_rowwise
from moe_fp4.kernels.grouped_gemm import GROUP_ALIGN, _check_out_dtype, _nt_shapes, _tma_ok, _wgrad_shapes, \
    device_ints, group_offsets
from moe_fp4.kernels.grouped_gemm import grouped_mm_wgrad as grouped_wgrad_twin
from moe_fp4.kernels.numerics import FP8_TILE
from moe_fp4.kernels.triton_numerics import e2m1_words_to_e4m3, mxfp4_tile_exponents, pow2_f32

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
    # Cached: every launch asks, and torch.cuda.is_available() and the capability query cost ~10 us of
    # host time per launch (the layer step issues its kernels from Python, and right after the
    # routing's sync the GPU waits while the host issues them).
    return torch.cuda.is_available() and torch.cuda.get_device_capability(index) == (9, 0)


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
        # K block into it (an MXFP4 A: its packed codes, for the decoder). The stage counter runs on
        # across tiles, like the consumer's.
        nbytes: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
        A_COLS: gl.constexpr = a_desc.block_type.shape[1]   # A's columns per K block: 128 FP8, 32 MXFP4 words
        it = 0
        for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            mt, nt = _tile(t, tiles_m, tiles_n, GROUP_M)
            row0 = gl.load(tile_row_ptr + mt)
            brow = gl.load(tile_expert_ptr + mt) * N + nt * BLOCK_N
            for kb in range(KB):
                s = it % NUM_STAGES
                mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [row0, kb * A_COLS], ready.index(s), a_smem.index(s))
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
    def _zero_quarters(SUB: gl.constexpr, HALF: gl.constexpr, layout: gl.constexpr):
        """-> six float32 [SUB, HALF] zeros: a wave's four quarter accumulators and the two raw ones."""
        z = gl.zeros((SUB, HALF), gl.float32, layout)
        return z, z, z, z, z, z

    @gluon.jit
    def _stage_operands(a_smem, b_smem, s, BASE: gl.constexpr, SUB: gl.constexpr, HALF: gl.constexpr):
        """Stage s of the ring -> (a0, a1, b0, b1): a consumer's two 64-row halves of A (rows BASE ...)
        and B's two column halves, transposed for wgmma."""
        a0 = a_smem.index(s).slice(BASE, SUB, dim=0)
        a1 = a_smem.index(s).slice(BASE + SUB, SUB, dim=0)
        b0 = b_smem.index(s).slice(0, HALF, dim=0).permute((1, 0))
        b1 = b_smem.index(s).slice(HALF, HALF, dim=0).permute((1, 0))
        return a0, a1, b0, b1

    @gluon.jit
    def _stage_wait(ready, decoded, s, it, NUM_STAGES: gl.constexpr, A_MXFP4: gl.constexpr):
        """Wait until fill ``it`` of stage s is usable: loaded (FP8 A), or decoded (MXFP4 A)."""
        if A_MXFP4:
            mbarrier.wait(decoded.index(s), (it // NUM_STAGES) & 1)
        else:
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)

    @gluon.jit
    def _fp8_block_scales(nk, sa0, sa1, sb, as_ptrs, bs_ptr, stride_as_k, SUB: gl.constexpr):
        """An FP8 A's K block -> (s0, s1): s_a * s_b of the wave's two 64-row halves, from the scales
        prefetched one block ahead (sa0, sa1, sb), and block nk's, loaded now: (sa0, sa1, sb) out."""
        s0 = sa0 * sb
        s1 = sa1 * sb
        sa0 = gl.load(as_ptrs + nk * stride_as_k)
        sa1 = gl.load(as_ptrs + (nk * stride_as_k + SUB))
        sb = gl.load(bs_ptr + nk)
        return s0, s1, sa0, sa1, sb

    @gluon.jit
    def _mxfp4_block_scales(s, nk, sb, bs_ptr, as_smem, BASE: gl.constexpr, SUB: gl.constexpr,
                            layout: gl.constexpr):
        """An MXFP4 A's K block in stage s (decoded) -> (s0, s1) as _fp8_block_scales, A's row scales 2^S
        read from the stage, B's prefetched (sb); block nk's B scale out."""
        sa = _as_vector(as_smem.index(s), as_smem.type.shape[2], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        s0 = sa.slice(BASE, SUB).load(gl.SliceLayout(1, layout)) * sb
        s1 = sa.slice(BASE + SUB, SUB).load(gl.SliceLayout(1, layout)) * sb
        return s0, s1, gl.load(bs_ptr + nk)

    @gluon.jit
    def _block_head(acc00, acc01, acc10, ra, rb, a1, b0, b1, s0, s1):
        """A K block whose first two quarter products (ra = A0 B0, rb = A0 B1) are in flight -> the
        first three quarters promoted, A1 B1 in flight in rb (ra free): each promotion runs while
        the next quarter's wgmma does."""
        ra = warpgroup_mma_wait(num_outstanding=1, deps=(ra,))
        acc00 += ra * s0[:, None]
        ra = warpgroup_mma(a1, b0, ra, use_acc=False, is_async=True)
        rb = warpgroup_mma_wait(num_outstanding=1, deps=(rb,))
        acc01 += rb * s0[:, None]
        rb = warpgroup_mma(a1, b1, rb, use_acc=False, is_async=True)
        ra = warpgroup_mma_wait(num_outstanding=1, deps=(ra,))
        acc10 += ra * s1[:, None]
        return acc00, acc01, acc10, ra, rb

    @gluon.jit
    def _fma_rows(acc, raw, s_row):
        """acc + raw * s_row[:, None] as one fma.rn per element, in place: written as tensor arithmetic
        the products of a whole half could be formed before the adds while the raw accumulator stays
        live as the next wgmma's operand (64 more registers than the wide wave has)."""
        return gl.inline_asm_elementwise("fma.rn.f32 $0, $1, $2, $3;", "=f,f,f,f", [raw, s_row[:, None], acc],
                                         dtype=gl.float32, is_pure=True, pack=1)

    @gluon.jit
    def _wide_wave(a_smem, b_smem, ready, empty, decoded, as_smem, as_ptrs, stride_as_k, bs_ptr, it,
                   KB: gl.constexpr, NUM_STAGES: gl.constexpr, BASE: gl.constexpr, SUB: gl.constexpr,
                   WIDE_N: gl.constexpr, A_MXFP4: gl.constexpr, layout: gl.constexpr):
        """One wave of a tile (rows BASE .. BASE + 2 SUB - 1 of each stage) over the KB K blocks ->
        (acc0, acc1, it): its two [SUB, WIDE_N] float32 halves and the ring counter after them.

        Per K block: one m64nWIDE_N wgmma chain per 64-row half into one raw accumulator, waited, then
        promoted (acc += raw * s_a * s_b, the twin's fma) while the other warpgroup's chain runs on the
        tensor cores. Why not four [64, 64] quarters through two raw accumulators (_quarter_wave),
        which also overlaps a promotion with the same warpgroup's next quarter: a wgmma reads both
        operands from shared memory, and four m64n64 chains read A twice and B twice per wave and
        K block (64 KiB); with the ring's TMA writes (48 KiB per 256-row stage) that is 176 KiB per
        1024 tensor-core cycles, where shared memory moves 128 bytes a cycle: at most 74% tensor-pipe
        activity, about what Nsight Compute measured. Two m64n128 chains read A once and B twice
        (48 KiB): 144 KiB, at most 91%. Measured: 1-4% faster, the tensor pipe 70-75% busy, so that
        bound was not the binding one (bench/RESULTS.md, issue 29, 2026-11-26, d171d4a).
        Registers: two halves and one raw, 3 x 64."""
        acc0 = gl.zeros((SUB, WIDE_N), gl.float32, layout)
        acc1 = gl.zeros((SUB, WIDE_N), gl.float32, layout)
        raw = gl.zeros((SUB, WIDE_N), gl.float32, layout)
        if not A_MXFP4:   # the scales one K block ahead, as _quarter_wave
            sa0 = gl.load(as_ptrs)
            sa1 = gl.load(as_ptrs + SUB)
        sb = gl.load(bs_ptr)
        for kb in range(KB):
            s = it % NUM_STAGES
            nk = gl.minimum(kb + 1, KB - 1)
            if not A_MXFP4:
                s0, s1, sa0, sa1, sb = _fp8_block_scales(nk, sa0, sa1, sb, as_ptrs, bs_ptr, stride_as_k, SUB)
            _stage_wait(ready, decoded, s, it, NUM_STAGES, A_MXFP4)
            b = b_smem.index(s).permute((1, 0))
            raw = warpgroup_mma(a_smem.index(s).slice(BASE, SUB, dim=0), b, raw, use_acc=False, is_async=True)
            if A_MXFP4:
                s0, s1, sb = _mxfp4_block_scales(s, nk, sb, bs_ptr, as_smem, BASE, SUB, layout)
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            acc0 = _fma_rows(acc0, raw, s0)
            raw = warpgroup_mma(a_smem.index(s).slice(BASE + SUB, SUB, dim=0), b, raw, use_acc=False, is_async=True)
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            mbarrier.arrive(empty.index(s), count=1)   # one of the stage's two releases
            acc1 = _fma_rows(acc1, raw, s1)
            it += 1
        return acc0, acc1, it

    @gluon.jit
    def _quarter_wave(a_smem, b_smem, ready, empty, decoded, as_smem, as_ptrs, stride_as_k, bs_ptr, it,
                      KB: gl.constexpr, NUM_STAGES: gl.constexpr, BASE: gl.constexpr, SUB: gl.constexpr,
                      HALF: gl.constexpr, A_MXFP4: gl.constexpr, layout: gl.constexpr):
        """GluonConfig(wide=False): one wave over the KB K blocks as _wide_wave, but as four [SUB, HALF]
        float32 quarters (two 64-row halves x two column halves, 32 registers each) -> (acc00, acc01,
        acc10, acc11, it), acc<row half><column half>.

        Per K block the four quarter products run through two raw accumulators in turn: while one
        quarter is promoted (acc += raw * s_a * s_b on the CUDA cores) the next one's wgmma runs, so
        only the last promotion of a block leaves the tensor cores idle; 4 x 32 + 2 x 32 registers fit
        without spills. (Issuing the next block's first wgmma before that promotion keeps a wgmma in
        flight across the loop's back edge; ptxas then serializes every wgmma, C7514 "non wgmma
        instructions reading accumulator registers", for any such schedule tried.)"""
        acc00, acc01, acc10, acc11, ra, rb = _zero_quarters(SUB, HALF, layout)
        # Scales one K block ahead: a load issued now is consumed a whole block (4 wgmmas) later, so its
        # latency never stalls a promotion (loaded just in time, it stalled a third of the consumers'
        # cycles: bench/tools/gemm_limiters.py). The last block reloads itself.
        if not A_MXFP4:   # (an MXFP4 A's row scales come with each stage: no registers carried)
            sa0 = gl.load(as_ptrs)
            sa1 = gl.load(as_ptrs + SUB)
        sb = gl.load(bs_ptr)
        for kb in range(KB):
            s = it % NUM_STAGES
            nk = gl.minimum(kb + 1, KB - 1)
            if not A_MXFP4:
                # The next block's scale loads go out before the stage wait, in flight while it waits.
                s0, s1, sa0, sa1, sb = _fp8_block_scales(nk, sa0, sa1, sb, as_ptrs, bs_ptr, stride_as_k, SUB)
            _stage_wait(ready, decoded, s, it, NUM_STAGES, A_MXFP4)
            a0, a1, b0, b1 = _stage_operands(a_smem, b_smem, s, BASE, SUB, HALF)
            ra = warpgroup_mma(a0, b0, ra, use_acc=False, is_async=True)
            rb = warpgroup_mma(a0, b1, rb, use_acc=False, is_async=True)
            if A_MXFP4:   # read from the stage while its first wgmmas run
                s0, s1, sb = _mxfp4_block_scales(s, nk, sb, bs_ptr, as_smem, BASE, SUB, layout)
            acc00, acc01, acc10, ra, rb = _block_head(acc00, acc01, acc10, ra, rb, a1, b0, b1, s0, s1)
            rb = warpgroup_mma_wait(num_outstanding=0, deps=(rb,))
            mbarrier.arrive(empty.index(s), count=1)   # one of the stage's two releases
            acc11 += rb * s1[:, None]
            it += 1
        return acc00, acc01, acc10, acc11, it

    @gluon.jit
    def _wg_consumer(d_desc, a_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                     b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr, tile_waves_ptr,
                     tiles_m, tiles_n, as_smem, decoded,
                     KB: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                     D_BUFS: gl.constexpr, WG: gl.constexpr, A_MXFP4: gl.constexpr, WIDE: gl.constexpr):
        # One warpgroup, its own partition: wave WG (rows 128 WG .. 128 WG + 127) of every tile, as two
        # [64, BLOCK_N] halves (WIDE, GluonConfig.wide: _wide_wave) or four [64, BLOCK_N/2] quarters
        # (_quarter_wave), each stored through its staging buffers (the d_desc box) and TMA.
        # Its own partition, because Triton puts a partition-wide bar.sync before every mbarrier wait
        # and arrive: one 8-warp consumer for both waves (9a5e346 and before) was held in step by that
        # barrier, so neither warpgroup's promotion overlapped the other's wgmma (4.6 of 11.2 cycles
        # between issues, Nsight Compute); two partitions drift apart and take turns on the tensor cores.
        # A one-wave tile (an expert's last 128 rows): warpgroup 1 computes nothing, it only releases
        # the tile's stages, and warpgroup 0 has the tensor cores to itself.
        # A_MXFP4: A's FP8 codes and their scales 2^S come from the decoder (_mxfp4_decoder) through
        # shared memory: the consumer waits on the stage's `decoded` barrier instead of `ready` and
        # reads the 128 row scales of its wave there.
        SUB: gl.constexpr = d_desc.block_type.shape[0]     # 64 rows: one m64 wgmma
        BOX_N: gl.constexpr = d_desc.block_type.shape[1]   # BLOCK_N (WIDE), else BLOCK_N / 2 columns
        BASE: gl.constexpr = WG * 2 * SUB                  # this warpgroup's first row in the tile
        layout: gl.constexpr = _acc_layout(BOX_N, 4)
        rows = gl.arange(0, SUB, layout=gl.SliceLayout(1, layout))
        it = 0
        n_store = 0
        for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            mt, nt = _tile(t, tiles_m, tiles_n, GROUP_M)
            valid = (WG == 0) | (gl.load(tile_waves_ptr + mt) == 2)
            run = valid
            if A_MXFP4:
                # With the decoder's registers taken the branch below spills inside the K loop (Triton
                # 3.9): an MXFP4 A's second wave runs in a one-wave tile and is not stored, as before.
                run = True
            if run:
                row0 = gl.load(tile_row_ptr + mt) + BASE
                bs_ptr = (b_scale_ptr + gl.load(tile_expert_ptr + mt).to(gl.int64) * stride_bs_e
                          + (nt * BLOCK_N // 128) * stride_bs_n)
                col = nt * BLOCK_N
                # This warpgroup's staging buffers: WG * D_BUFS ... of the 2 x D_BUFS.
                if WIDE:
                    acc0, acc1, it = _wide_wave(a_smem, b_smem, ready, empty, decoded, as_smem,
                                                a_scale_ptr + row0 + rows, stride_as_k, bs_ptr, it, KB, NUM_STAGES,
                                                BASE, SUB, BOX_N, A_MXFP4, layout)
                    if valid:
                        n_store = _store_quarter(acc0, d_desc, d_smem, n_store, row0, col, D_BUFS, WG * D_BUFS)
                        n_store = _store_quarter(acc1, d_desc, d_smem, n_store, row0 + SUB, col, D_BUFS, WG * D_BUFS)
                else:
                    acc00, acc01, acc10, acc11, it = _quarter_wave(a_smem, b_smem, ready, empty, decoded, as_smem,
                                                                   a_scale_ptr + row0 + rows, stride_as_k, bs_ptr,
                                                                   it, KB, NUM_STAGES, BASE, SUB, BOX_N, A_MXFP4,
                                                                   layout)
                    if valid:
                        n_store = _store_quarter(acc00, d_desc, d_smem, n_store, row0, col, D_BUFS, WG * D_BUFS)
                        n_store = _store_quarter(acc01, d_desc, d_smem, n_store, row0, col + BOX_N, D_BUFS,
                                                 WG * D_BUFS)
                        n_store = _store_quarter(acc10, d_desc, d_smem, n_store, row0 + SUB, col, D_BUFS,
                                                 WG * D_BUFS)
                        n_store = _store_quarter(acc11, d_desc, d_smem, n_store, row0 + SUB, col + BOX_N, D_BUFS,
                                                 WG * D_BUFS)
            else:
                # Warpgroup 1 in a one-wave tile: no rows of its own. It still releases every stage,
                # each after it was filled (the empty barrier counts two arrivals per fill).
                for kb in range(KB):
                    s = it % NUM_STAGES
                    _stage_wait(ready, decoded, s, it, NUM_STAGES, A_MXFP4)
                    mbarrier.arrive(empty.index(s), count=1)
                    it += 1
        tma.store_wait(pendings=0)

    @gluon.jit
    def _mxfp4_decoder(pk_smem, a_smem, as_smem, sc_smem, ready, decoded, e8w_ptr, stride_e8w, R, tile_row_ptr,
                       tiles_m, tiles_n, KB: gl.constexpr, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr,
                       WORDS_LAYOUT: gl.constexpr):
        # MXFP4 A (warps of its own): per stage, the 256 rows' packed codes (int16 words of 4 codes,
        # TMA-loaded by the producer) -> FP8 codes in the stage's A buffer, which the consumers' wgmmas
        # read, and each row's FP8 scale 2^S in the stage's scale buffer; then `decoded`. The rule is
        # the row-wise converter's (mxfp4_tile_exponents + e2m1_words_to_e4m3, the same device
        # functions), so the GEMM equals "convert to FP8, then the FP8-A kernel" bit for bit, while A's
        # bytes are read once at half size and no FP8 copy is written to global memory.
        # The E8M0 bytes of a row's K block are one int32 word (e8w: [R, K/128]); the stage's 256 words
        # are loaded one K block ahead, decide once per stage whether every block converts exactly
        # (the fast path), and go through sc_smem to the passes. Rows go CH per pass, 8 x 4 threads
        # per warp over 8 rows x 4 blocks (one block's 8 words per thread, so a thread needs one byte).
        DW: gl.constexpr = gl.num_warps()
        CH: gl.constexpr = 8 * DW                              # rows per pass
        ROWS: gl.constexpr = a_smem.type.shape[1]              # 256
        NPASS: gl.constexpr = ROWS // CH
        words2: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [DW, 1], [1, 0])
        words5: gl.constexpr = gl.BlockedLayout([1, 1, 1, 2, 4], [8, 1, 4, 1, 1], [DW, 1, 1, 1, 1], [4, 3, 2, 1, 0])
        blocks3: gl.constexpr = gl.SliceLayout(3, gl.SliceLayout(4, words5))
        stage3: gl.constexpr = gl.BlockedLayout([1, 1, 4], [32, 1, 1], [DW, 1, 1], [2, 1, 0])
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        PACKED: gl.constexpr = pk_smem.type.layout
        r = gl.arange(0, CH, layout=gl.SliceLayout(1, gl.SliceLayout(2, blocks3)))
        blk = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, blocks3)))
        r3 = r[:, None, None] + blk[None, None, :] * 0
        rs = gl.arange(0, ROWS, layout=gl.SliceLayout(1, gl.SliceLayout(2, stage3)))
        bs = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, stage3)))
        sc = _view2(sc_smem, gl.int32, NPASS, CH, flat)
        it = 0
        for t in range(gl.program_id(0), tiles_m * tiles_n, gl.num_programs(0)):
            mt, nt = _tile(t, tiles_m, tiles_n, GROUP_M)
            row0 = gl.load(tile_row_ptr + mt)
            live = rs < R - row0        # rows past R: TMA zero-filled codes, scale byte 0, never stored
            w_base = e8w_ptr + row0.to(gl.int64) * stride_e8w
            w_offs = rs * stride_e8w
            w_next = gl.load(w_base + w_offs, mask=live, other=0)
            for kb in range(KB):
                s = it % NUM_STAGES
                w = w_next
                w_next = gl.load((w_base + gl.minimum(kb + 1, KB - 1)) + w_offs, mask=live, other=0)
                _n, _s, _e, normal = mxfp4_tile_exponents((w[:, None, None] >> (bs * 8)[None, None, :]) & 0xFF,
                                                          live[:, None, None] & (bs < 4)[None, None, :])
                sc_smem.store(w)   # the passes read it back in their own layout
                mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
                packed = _view3(pk_smem.index(s), gl.int16, NPASS, CH, PACKED)
                words = _view3(a_smem.index(s), gl.int32, NPASS, CH, WORDS_LAYOUT)
                scales = _view2(as_smem.index(s), gl.float32, NPASS, CH, flat)
                for c in range(NPASS):
                    valid = r3 < R - (row0 + c * CH)
                    wc = sc.index(c).load(gl.SliceLayout(1, gl.SliceLayout(2, blocks3)))
                    sb = (wc[:, None, None] >> (blk * 8)[None, None, :]) & 0xFF
                    nan, S, e_rel, _ = mxfp4_tile_exponents(sb, valid)
                    x = packed.index(c).load(words2).to(gl.int32)
                    x = gl.convert_layout(gl.reshape(x, [CH, 1, 4, 2, 4]), words5)
                    q = e2m1_words_to_e4m3(x, nan, e_rel, normal, True)
                    words.index(c).store(gl.convert_layout(gl.reshape(q, [CH, 32]), words2))
                    scales.index(c).store(pow2_f32(gl.reshape(S, [CH])))
                fence_async_shared()   # the generic-proxy stores, before the consumers' wgmmas read them
                mbarrier.arrive(decoded.index(s), count=1)
                it += 1

    @gluon.jit
    def _grouped_mm_nt_kernel(a_desc, b_desc, d_desc, a_scale_ptr, stride_as_k,
                              b_scale_ptr, stride_bs_e, stride_bs_n,
                              tile_row_ptr, tile_expert_ptr, tile_waves_ptr, tiles_m, N, R,
                              K: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
                              GROUP_M: gl.constexpr, D_BUFS: gl.constexpr, A_MXFP4: gl.constexpr,
                              A_LAYOUT: gl.constexpr, WORDS_LAYOUT: gl.constexpr, WIDE: gl.constexpr,
                              num_warps: gl.constexpr):
        # A_MXFP4: a_desc is the packed codes as int16 words [R, K/4] and a_scale_ptr their E8M0 bytes
        # as int32 words [R, K/128] (4 blocks each; row stride stride_as_k); a fourth partition decodes
        # them into FP8 stages (A_LAYOUT: the FP8 tile's wgmma layout, WORDS_LAYOUT: the same bytes as
        # int32 words).
        KB: gl.constexpr = K // 128
        TM: gl.constexpr = a_desc.block_type.shape[0]
        tiles_n = N // BLOCK_N   # N is a multiple of 128 = BLOCK_N (grouped_gemm._nt_shapes checks it)
        ld_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        d_smem = gl.allocate_shared_memory(d_desc.dtype, [2 * D_BUFS] + d_desc.block_type.shape, d_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)   # both consumer warpgroups release a stage
        if A_MXFP4:
            a_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_STAGES, TM, 128], A_LAYOUT)
            sc_smem = gl.allocate_shared_memory(gl.int32, [TM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
            as_smem = gl.allocate_shared_memory(gl.float32, [NUM_STAGES, 1, TM], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
            decoded = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
            for s in gl.static_range(NUM_STAGES):
                mbarrier.init(decoded.index(s), count=1)
            # The default partition (num_warps = 4) is warpgroup 0; warpgroup 1, the producer warp and
            # two decoder warps are workers: 216 registers for warpgroup 1 (the consumers compile
            # without spills there), 24 for the producer, 72 for the decoder; with the launch's 11
            # warps Triton leaves the default partition 216 as well. (The same consumer list as the
            # FP8-A call below: Gluon 3.6 cannot build the partition list in a variable.)
            gl.warp_specialize(
                [(_wg_consumer, (d_desc, a_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                                 b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr,
                                 tile_waves_ptr, tiles_m, tiles_n, as_smem, decoded, KB, BLOCK_N, NUM_STAGES,
                                 GROUP_M, D_BUFS, 0, True, WIDE)),
                 (_wg_consumer, (d_desc, a_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                                 b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr,
                                 tile_waves_ptr, tiles_m, tiles_n, as_smem, decoded, KB, BLOCK_N, NUM_STAGES,
                                 GROUP_M, D_BUFS, 1, True, WIDE)),
                 (_producer, (a_desc, b_desc, ld_smem, b_smem, ready, empty, tile_row_ptr, tile_expert_ptr,
                              tiles_m, tiles_n, N, KB, BLOCK_N, NUM_STAGES, GROUP_M)),
                 (_mxfp4_decoder, (ld_smem, a_smem, as_smem, sc_smem, ready, decoded, a_scale_ptr, stride_as_k, R,
                                   tile_row_ptr, tiles_m, tiles_n, KB, NUM_STAGES, GROUP_M, WORDS_LAYOUT))],
                worker_num_warps=[4, 1, 2], worker_num_regs=[216, 24, 72])
            for s in gl.static_range(NUM_STAGES):
                mbarrier.invalidate(decoded.index(s))
        else:
            # The default partition (num_warps = 4) is warpgroup 0; warpgroup 1 and the producer are
            # workers: 232 registers for warpgroup 1, 40 for the producer.
            gl.warp_specialize(
                [(_wg_consumer, (d_desc, ld_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                                 b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr,
                                 tile_waves_ptr, tiles_m, tiles_n, ld_smem, ready, KB, BLOCK_N, NUM_STAGES,
                                 GROUP_M, D_BUFS, 0, False, WIDE)),
                 (_wg_consumer, (d_desc, ld_smem, b_smem, d_smem, ready, empty, a_scale_ptr, stride_as_k,
                                 b_scale_ptr, stride_bs_e, stride_bs_n, tile_row_ptr, tile_expert_ptr,
                                 tile_waves_ptr, tiles_m, tiles_n, ld_smem, ready, KB, BLOCK_N, NUM_STAGES,
                                 GROUP_M, D_BUFS, 1, False, WIDE)),
                 (_producer, (a_desc, b_desc, ld_smem, b_smem, ready, empty, tile_row_ptr, tile_expert_ptr,
                              tiles_m, tiles_n, N, KB, BLOCK_N, NUM_STAGES, GROUP_M))],
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

    if hasattr(gl.shared_memory_descriptor, "reinterpret"):   # Triton 3.7+
        @gluon.jit
        def _as_vector(smem, n: gl.constexpr, layout: gl.constexpr):
            """A [1, n] float32 shared buffer viewed as [n]."""
            return smem.reinterpret(gl.float32, [n], layout)

        @gluon.jit
        def _view3(smem, dtype: gl.constexpr, n: gl.constexpr, rows: gl.constexpr, layout: gl.constexpr):
            """A [n * rows, 32] shared buffer of words viewed as dtype [n, rows, 32] (n passes)."""
            return smem.reinterpret(dtype, [n, rows, 32], layout)

        @gluon.jit
        def _view2(smem, dtype: gl.constexpr, n: gl.constexpr, rows: gl.constexpr, layout: gl.constexpr):
            """A shared buffer of n * rows 32-bit values viewed as dtype [n, rows]."""
            return smem.reinterpret(dtype, [n, rows], layout)
    else:                                                     # Triton 3.6
        @gluon.jit
        def _as_vector(smem, n: gl.constexpr, layout: gl.constexpr):
            """A [1, n] float32 shared buffer viewed as [n]."""
            return smem._reinterpret(gl.float32, [n], layout)

        @gluon.jit
        def _view3(smem, dtype: gl.constexpr, n: gl.constexpr, rows: gl.constexpr, layout: gl.constexpr):
            """A [n * rows, 32] shared buffer of words viewed as dtype [n, rows, 32] (n passes)."""
            return smem._reinterpret(dtype, [n, rows, 32], layout)

        @gluon.jit
        def _view2(smem, dtype: gl.constexpr, n: gl.constexpr, rows: gl.constexpr, layout: gl.constexpr):
            """A shared buffer of n * rows 32-bit values viewed as dtype [n, rows]."""
            return smem._reinterpret(dtype, [n, rows], layout)

    @gluon.jit
    def _promote_rc(acc, raw, s_row, s_col):
        """acc + raw * s_row * s_col per element: t = raw * s_row (exact: a power-of-two scale), then one
        fma, which is what the Triton twin computes (fma(dot, s_a * s_b, acc)). Inline PTX because
        written as tensor arithmetic the compiler forms all 32 products of a quarter before adding
        them, while the raw accumulator stays live as the next wgmma's operand: 32 more registers,
        which made the consumers spill and serialize their wgmmas (Triton 3.6 and 3.9); one
        mul + fma per element needs one temporary."""
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
    def _wgrad_producer(a_desc, b_desc, as_desc, bs_desc, a_smem, b_smem, as_smem, bs_smem, ready, empty,
                        offsets_ptr, num_experts, N, K, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr):
        # One warp, as _producer: one stage per 128 tokens of the tile's expert, holding A [TILE_N, 128],
        # B [128, 128] and their scales for that token block: A's TILE_N row scales and B's 128 column
        # scales (rows of the M-major scale tensors, TMA-loaded like the operands; rows past N are
        # zero-filled like A's).
        TILE_N: gl.constexpr = a_desc.block_type.shape[0]
        BLOCK_K: gl.constexpr = b_desc.block_type.shape[0]
        nbytes: gl.constexpr = (a_desc.block_type.nbytes + b_desc.block_type.nbytes + as_desc.block_type.nbytes
                                + bs_desc.block_type.nbytes)
        tiles_n = (N + TILE_N - 1) // TILE_N   # (not gl.cdiv: see _grouped_mm_nt_kernel)
        tiles_k = K // BLOCK_K
        it = 0
        for t in range(gl.program_id(0), num_experts * tiles_n * tiles_k, gl.num_programs(0)):
            e, nt, kt = _wgrad_tile(t, tiles_n, tiles_k, GROUP_M)
            start = gl.load(offsets_ptr + e)
            stop = gl.load(offsets_ptr + e + 1)
            for tok in range(start, stop, 128):
                s = it % NUM_STAGES
                mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                _tma_load(a_desc, [nt * TILE_N, tok], ready.index(s), a_smem.index(s))
                _tma_load(b_desc, [kt * BLOCK_K, tok], ready.index(s), b_smem.index(s))
                _tma_load(as_desc, [tok // 128, nt * TILE_N], ready.index(s), as_smem.index(s))
                _tma_load(bs_desc, [tok // 128, kt * BLOCK_K], ready.index(s), bs_smem.index(s))
                it += 1

    @gluon.jit
    def _wgrad_wide_wave(a_smem, b_smem, as_smem, bs_smem, ready, empty, it, blocks, NUM_STAGES: gl.constexpr,
                         BASE: gl.constexpr, SUB: gl.constexpr, layout: gl.constexpr):
        """One wave of a weight-gradient tile (rows BASE .. BASE + 2 SUB - 1 of each stage) over its expert's
        token blocks -> (acc0, acc1, it): two [SUB, 128] float32 halves, as _wide_wave does for fprop.
        Per token block: one m64n128 wgmma chain per 64-row half into one raw accumulator, waited, then
        promoted with the row and column scales (_promote_rc); B's 128 column scales are read from the
        stage once per block (32 registers a thread in this layout). Registers: two halves, one raw and
        the column scales, 3 x 64 + 32."""
        TILE_N: gl.constexpr = a_smem.type.shape[1]
        BLOCK_K: gl.constexpr = b_smem.type.shape[1]
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        acc0 = gl.zeros((SUB, BLOCK_K), gl.float32, layout)
        acc1 = gl.zeros((SUB, BLOCK_K), gl.float32, layout)
        raw = gl.zeros((SUB, BLOCK_K), gl.float32, layout)
        for kb in range(blocks):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            b = b_smem.index(s).permute((1, 0))
            raw = warpgroup_mma(a_smem.index(s).slice(BASE, SUB, dim=0), b, raw, use_acc=False, is_async=True)
            sa = _as_vector(as_smem.index(s), TILE_N, flat)
            s0 = sa.slice(BASE, SUB).load(gl.SliceLayout(1, layout))[:, None]
            s1 = sa.slice(BASE + SUB, SUB).load(gl.SliceLayout(1, layout))[:, None]
            col = _as_vector(bs_smem.index(s), BLOCK_K, flat).load(gl.SliceLayout(0, layout))[None, :]
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            acc0 = _promote_rc(acc0, raw, s0, col)
            raw = warpgroup_mma(a_smem.index(s).slice(BASE + SUB, SUB, dim=0), b, raw, use_acc=False, is_async=True)
            raw = warpgroup_mma_wait(num_outstanding=0, deps=(raw,))
            mbarrier.arrive(empty.index(s), count=1)   # one of the stage's two releases (SPLIT: its one)
            acc1 = _promote_rc(acc1, raw, s1, col)
            it += 1
        return acc0, acc1, it

    @gluon.jit
    def _wgrad_quarter_wave(a_smem, b_smem, as_smem, bs_smem, ready, empty, it, blocks, NUM_STAGES: gl.constexpr,
                            BASE: gl.constexpr, SUB: gl.constexpr, layout: gl.constexpr):
        """GluonConfig(wide=False): one wave of a weight-gradient tile as _wgrad_wide_wave, but as four
        [SUB, 64] quarters through two raw accumulators -> (acc00, acc01, acc10, acc11, it). The quarters
        go column half by column half (00, 10, 01, 11), so one half's 16 column scales are live at a time."""
        TILE_N: gl.constexpr = a_smem.type.shape[1]
        BLOCK_K: gl.constexpr = b_smem.type.shape[1]
        HALF: gl.constexpr = BLOCK_K // 2
        row_scale: gl.constexpr = gl.SliceLayout(1, layout)
        col_scale: gl.constexpr = gl.SliceLayout(0, layout)
        flat: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
        acc00, acc01, acc10, acc11, ra, rb = _zero_quarters(SUB, HALF, layout)
        for kb in range(blocks):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            a0, a1, b0, b1 = _stage_operands(a_smem, b_smem, s, BASE, SUB, HALF)
            ra = warpgroup_mma(a0, b0, ra, use_acc=False, is_async=True)
            rb = warpgroup_mma(a1, b0, rb, use_acc=False, is_async=True)
            sa = _as_vector(as_smem.index(s), TILE_N, flat)
            sb = _as_vector(bs_smem.index(s), BLOCK_K, flat)
            s0 = sa.slice(BASE, SUB).load(row_scale)[:, None]
            s1 = sa.slice(BASE + SUB, SUB).load(row_scale)[:, None]
            col = sb.slice(0, HALF).load(col_scale)[None, :]
            ra = warpgroup_mma_wait(num_outstanding=1, deps=(ra,))
            acc00 = _promote_rc(acc00, ra, s0, col)
            ra = warpgroup_mma(a0, b1, ra, use_acc=False, is_async=True)
            rb = warpgroup_mma_wait(num_outstanding=1, deps=(rb,))
            acc10 = _promote_rc(acc10, rb, s1, col)
            rb = warpgroup_mma(a1, b1, rb, use_acc=False, is_async=True)
            col = sb.slice(HALF, HALF).load(col_scale)[None, :]
            ra = warpgroup_mma_wait(num_outstanding=1, deps=(ra,))
            acc01 = _promote_rc(acc01, ra, s0, col)
            rb = warpgroup_mma_wait(num_outstanding=0, deps=(rb,))
            mbarrier.arrive(empty.index(s), count=1)   # one of the stage's two releases (SPLIT: its one)
            acc11 = _promote_rc(acc11, rb, s1, col)
            it += 1
        return acc00, acc01, acc10, acc11, it

    @gluon.jit
    def _wgrad_consumer(d_desc, a_smem, b_smem, as_smem, bs_smem, d_smem, ready, empty, turn, offsets_ptr,
                        num_experts, N, K, NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, D_BUFS: gl.constexpr,
                        WG: gl.constexpr, SPLIT: gl.constexpr, WIDE: gl.constexpr):
        # One warpgroup, its own partition: wave WG of every tile as two [64, 128] float32 halves (WIDE:
        # _wgrad_wide_wave) or four [64, 64] quarters through two raw accumulators, as _wg_consumer. What
        # differs is the column scale: B's scale varies along the output's columns (one per column and
        # token block), so the promotion is acc += raw * s_a[row] * s_b[col] (_promote_rc, why: there),
        # and in the wgmma layout a thread holds 32 columns of a half (16 of a quarter). The scales come
        # with the operands through the ring (TMA), so a consumer reads them from shared memory right
        # after issuing the wgmma they scale: no prefetch registers, no global-load latency.
        SUB: gl.constexpr = d_desc.block_type.shape[0]     # 64 rows: one m64 wgmma
        TILE_N: gl.constexpr = a_smem.type.shape[1]        # rows per tile: 256 (2 waves), or 128 with SPLIT
        BLOCK_K: gl.constexpr = b_smem.type.shape[1]       # 128 columns per tile
        HALF: gl.constexpr = BLOCK_K // 2                  # a quarter's 64 columns (not WIDE)
        BASE: gl.constexpr = 0 if SPLIT else WG * 2 * SUB
        layout: gl.constexpr = _acc_layout(HALF, 4)        # a [64, 64] quarter
        wide: gl.constexpr = _acc_layout(BLOCK_K, 4)       # a [64, 128] half (WIDE)
        tiles_n = (N + TILE_N - 1) // TILE_N
        tiles_k = K // BLOCK_K
        it = 0
        n_store = 0
        # SPLIT: this warpgroup takes every second of the program's tiles, the first at WG, and the two
        # take turns: one enters its tile's K loop only when the other has finished its own (turn[WG],
        # arrived by the other). That orders their waits on the shared ring: a consumer that waited on a
        # stage's barrier two phases ahead of it would take the older phase for its own (a parity wait
        # cannot tell them apart). It is the ping-pong schedule: one's epilogue beside the other's wgmmas.
        mine = WG
        own = 0
        for t in range(gl.program_id(0), num_experts * tiles_n * tiles_k, gl.num_programs(0)):
            e, nt, kt = _wgrad_tile(t, tiles_n, tiles_k, GROUP_M)
            start = gl.load(offsets_ptr + e)
            blocks = (gl.load(offsets_ptr + e + 1) - start) // 128
            row0 = nt * TILE_N + BASE
            if SPLIT:
                take = mine % 2 == 0
            else:
                take = mine >= 0
            mine += 1
            if take:
                if SPLIT:
                    if (WG == 1) or (own > 0):
                        mbarrier.wait(turn.index(WG), (own - 1 + WG) & 1)
                if WIDE:
                    acc0, acc1, it = _wgrad_wide_wave(a_smem, b_smem, as_smem, bs_smem, ready, empty, it, blocks,
                                                      NUM_STAGES, BASE, SUB, wide)
                else:
                    acc00, acc01, acc10, acc11, it = _wgrad_quarter_wave(a_smem, b_smem, as_smem, bs_smem, ready, empty,
                                                                         it, blocks, NUM_STAGES, BASE, SUB, layout)
                if SPLIT:
                    mbarrier.arrive(turn.index(1 - WG), count=1)   # the other warpgroup's turn
                    own += 1
                # The second wave of a tile past N (N an odd multiple of 128) ran on TMA's zero fill; it
                # is not stored.
                if row0 < N:
                    row = e * N + row0    # the output viewed as [E N, K]
                    c = kt * BLOCK_K
                    if WIDE:
                        n_store = _store_quarter(acc0, d_desc, d_smem, n_store, row, c, D_BUFS, WG * D_BUFS)
                        n_store = _store_quarter(acc1, d_desc, d_smem, n_store, row + SUB, c, D_BUFS, WG * D_BUFS)
                    else:
                        n_store = _store_quarter(acc00, d_desc, d_smem, n_store, row, c, D_BUFS, WG * D_BUFS)
                        n_store = _store_quarter(acc01, d_desc, d_smem, n_store, row, c + HALF, D_BUFS, WG * D_BUFS)
                        n_store = _store_quarter(acc10, d_desc, d_smem, n_store, row + SUB, c, D_BUFS, WG * D_BUFS)
                        n_store = _store_quarter(acc11, d_desc, d_smem, n_store, row + SUB, c + HALF, D_BUFS,
                                                 WG * D_BUFS)
            else:
                it += blocks   # the other warpgroup's tile (SPLIT): its stages pass by
        tma.store_wait(pendings=0)

    @gluon.jit
    def _grouped_mm_wgrad_kernel(a_desc, b_desc, as_desc, bs_desc, d_desc, offsets_ptr, num_experts, N, K,
                                 NUM_STAGES: gl.constexpr, GROUP_M: gl.constexpr, D_BUFS: gl.constexpr,
                                 SPLIT: gl.constexpr, WIDE: gl.constexpr, num_warps: gl.constexpr):
        # offsets_ptr: the E + 1 group offsets (int32) of the tokens; N, K multiples of 128.
        a_smem = gl.allocate_shared_memory(a_desc.dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
        b_smem = gl.allocate_shared_memory(b_desc.dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
        as_smem = gl.allocate_shared_memory(as_desc.dtype, [NUM_STAGES] + as_desc.block_type.shape, as_desc.layout)
        bs_smem = gl.allocate_shared_memory(bs_desc.dtype, [NUM_STAGES] + bs_desc.block_type.shape, bs_desc.layout)
        d_smem = gl.allocate_shared_memory(d_desc.dtype, [2 * D_BUFS] + d_desc.block_type.shape, d_desc.layout)
        ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())   # SPLIT's turns
        for s in gl.static_range(NUM_STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1 if SPLIT else 2)   # SPLIT: one consumer per stage
        for w in gl.static_range(2):
            mbarrier.init(turn.index(w), count=1)
        gl.warp_specialize(
            [(_wgrad_consumer, (d_desc, a_smem, b_smem, as_smem, bs_smem, d_smem, ready, empty, turn, offsets_ptr,
                                num_experts, N, K, NUM_STAGES, GROUP_M, D_BUFS, 0, SPLIT, WIDE)),
             (_wgrad_consumer, (d_desc, a_smem, b_smem, as_smem, bs_smem, d_smem, ready, empty, turn, offsets_ptr,
                                num_experts, N, K, NUM_STAGES, GROUP_M, D_BUFS, 1, SPLIT, WIDE)),
             (_wgrad_producer, (a_desc, b_desc, as_desc, bs_desc, a_smem, b_smem, as_smem, bs_smem, ready, empty,
                                offsets_ptr, num_experts, N, K, NUM_STAGES, GROUP_M))],
            worker_num_warps=[4, 1], worker_num_regs=[240, 24])
        for s in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(ready.index(s))
            mbarrier.invalidate(empty.index(s))
        for w in gl.static_range(2):
            mbarrier.invalidate(turn.index(w))


_GL_DTYPES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float8_e4m3fn: "float8e4nv",
              torch.int16: "int16"}


def _desc(t: torch.Tensor, block: list[int], layout=None):
    if layout is None:
        layout = _default_layout(tuple(block), t.dtype)
    return GluonTensorDescriptor.from_tensor(t, block, layout)


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


if AVAILABLE:
    # An FP8 A stage [256, 128] as wgmma reads it (128-byte rows, 128-byte swizzle), and the same bytes
    # as int32 words [256, 32], the decoder's view: the swizzle permutes 16-byte chunks within a row by
    # the row's index, whatever the element width, so both layouts place every byte alike.
    _A_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=8, rank=2)
    _WORDS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    # The packed MXFP4 codes of a stage, int16 words [256, 32]: not swizzled. The decoder reads a row's
    # 64 bytes in 16-byte pieces, a warp 8 consecutive rows: 512 contiguous bytes, no bank conflict.
    _PACKED_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)

BLOCK_N = 128     # output columns per tile: one 128-wide weight scale block, two 64-column quarters
NUM_WARPS = 4     # the default partition: consumer warpgroup 0 (warpgroup 1 and the producer are workers)
QUARTER = [WAVE_M // 2, BLOCK_N // 2]   # [rows, columns] of one output quarter: a staging buffer, a TMA store box
WIDE_BOX = [WAVE_M // 2, BLOCK_N]       # one output half of a wave (GluonConfig.wide)


@dataclass(frozen=True)
class GluonConfig:
    """Pipeline depth, output staging and tile order of one launch.

    num_stages: A + B stages in the mbarrier ring (48 KiB each);
    d_bufs:     output staging buffers per consumer warpgroup, each one store box: [64, 128] with
                ``wide`` (fprop/dgrad), else a [64, 64] quarter; None = 64 KiB in all (wide: 2 for bf16,
                1 for float32; quarters: 4 and 2);
    group_m:    M tiles that share each N tile in the tile order (L2 reuse of B[e]);
    split:      wgrad only: each consumer warpgroup takes whole 128-row tiles of its own (every second
                tile of the program), so one's epilogue runs beside the other's wgmmas; False: both take
                one 128-row wave of a 256-row tile.
    wide:       each consumer warpgroup computes its 128-row wave as two [64, 128] halves, one m64n128
                wgmma per half and K block (the default; the weight gradients too since d3bff7c
                (2026-11-26), 1.08-1.12x their quarters on an H100); False: as four [64, 64] quarters
                through two raw accumulators (the engine before), which read A and B from shared
                memory more often (why: _wide_wave).
    decode_mxfp4: fprop/dgrad with an MXFP4 A: decode it inside the kernel (a decoder partition
                writes each stage's FP8 codes to shared memory; NT_MXFP4_CONFIGS); False (the
                default): convert it with mxfp4_to_fp8_rowwise first, then the FP8-A kernel, which
                measured 4x faster (bench/RESULTS.md, issue 29). Same bits either way.
    Shared memory (227 KiB per CTA on Hopper) must hold num_stages x 48 KiB (wgrad: + 1.5 KiB of scales;
    split: 33 KiB; an MXFP4 A decoded in the kernel: 65 KiB, its packed codes, FP8 codes and scales
    beside B) + the staging buffers."""

    num_stages: int = 3
    d_bufs: int | None = None
    group_m: int = 8
    split: bool = False
    decode_mxfp4: bool = False
    wide: bool = True

    def __post_init__(self):
        if self.num_stages < 2 or self.group_m < 1 or (self.d_bufs is not None and self.d_bufs < 1):
            raise ValueError(f"GluonConfig: need num_stages >= 2, group_m >= 1, d_bufs >= 1, got {self}")

    def store_box(self, wgrad: bool = False) -> list[int]:
        """[rows, columns] of one staging buffer and TMA store box."""
        return WIDE_BOX if self.wide else QUARTER

    def staging(self, out_dtype: torch.dtype, wgrad: bool = False) -> int:
        if self.d_bufs is not None:
            return self.d_bufs
        box = self.store_box(wgrad)
        return 64 * 1024 // (2 * box[0] * box[1] * out_dtype.itemsize)

    def smem_bytes(self, out_dtype: torch.dtype, wgrad: bool = False, mxfp4: bool = False) -> int:
        box = self.store_box(wgrad)
        staged = 2 * self.staging(out_dtype, wgrad) * box[0] * box[1] * out_dtype.itemsize
        if mxfp4:   # per stage: packed codes (K/2 bytes per row), FP8 codes, a float32 scale per row, B
            return self.num_stages * (TILE_M * (FP8_TILE // 2 + FP8_TILE + 4) + BLOCK_N * FP8_TILE) + staged
        if not wgrad:
            return self.num_stages * (TILE_M + BLOCK_N) * FP8_TILE + staged
        rows = self.wgrad_rows()   # A rows and B rows of a stage, FP8, and a float32 scale for each
        return self.num_stages * (rows + BLOCK_N) * (FP8_TILE + 4) + staged

    def wgrad_rows(self) -> int:
        """Rows of the weight gradient per tile: two waves, or one with ``split``."""
        return WAVE_M if self.split else TILE_M


# 3 stages and 64 KiB of staging: 3 x 48 + 64 = 208 KiB (H100 sweep: bench/RESULTS.md, "Gluon engine").
NT_CONFIG = GluonConfig()
# An MXFP4 A decoded in the kernel: 3 stages of 65 KiB and one staging buffer per consumer (bf16: 16 KiB
# in all); float32 output (32 KiB of staging) leaves room for 2 stages. Not the default: on the H200
# (bench/gemm.py, dsv3 and small FC1) the two decoder warps held the kernel to 269-270 TFLOP/s, where
# converting first and the FP8-A kernel ran at 897-1141.
# Quarters (wide=False): a wide staging box would not fit beside 3 stages of 65 KiB.
NT_MXFP4_CONFIGS = {torch.bfloat16: GluonConfig(num_stages=3, d_bufs=1, decode_mxfp4=True, wide=False),
                    torch.float32: GluonConfig(num_stages=2, d_bufs=1, decode_mxfp4=True, wide=False)}
SMEM_LIMIT = 232448   # bytes of shared memory one CTA may use on sm90
MBARRIER_BYTES = 1024  # room kept for the ring's barriers beside the buffers


def grouped_mm_nt(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor, counts,
                  out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | None = None) -> torch.Tensor:
    """A: float8_e4m3fn [R, K] with a_scale float32 [R, K/128] (any strides), or MXFP4 uint8 [R, K/2]
    with a_scale uint8 [R, K/32]; B: float8_e4m3fn [E, N, K] with b_scale float32 [E, N/128, K/128];
    counts: E ints, multiples of 128, summing to R -> out_dtype (bfloat16 or float32) [R, N]: rows of
    expert e times B[e]^T. The signature and result of grouped_gemm.grouped_mm_nt (``config``: a
    :class:`GluonConfig`; None or another engine's config = NT_CONFIG). An MXFP4 A is converted to
    FP8 first (mxfp4_to_fp8_rowwise), or with ``config.decode_mxfp4`` (NT_MXFP4_CONFIGS) decoded
    inside the kernel; both bit-identical to the Triton kernel's in-register decode. CUDA tensors
    on a Hopper GPU (:func:`supported`)."""
    mxfp4, r, n, k, counts = _nt_shapes(a, a_scale, b, b_scale, counts, "grouped_mm_nt")
    _check_out_dtype(out_dtype, "grouped_mm_nt")
    if not supported(a.device):
        raise RuntimeError(f"gluon grouped_mm_nt: needs Gluon and a Hopper (sm90) GPU, got {a.device}")
    cfg = config if isinstance(config, GluonConfig) else NT_CONFIG
    decode = mxfp4 and cfg.decode_mxfp4
    if cfg.split:
        raise ValueError("gluon grouped_mm_nt: GluonConfig.split is a weight-gradient layout (grouped_mm_wgrad)")
    smem = cfg.smem_bytes(out_dtype, mxfp4=decode)
    if smem + MBARRIER_BYTES > SMEM_LIMIT:
        raise ValueError(f"gluon grouped_mm_nt: {cfg} needs {smem} bytes of shared memory and its barriers, "
                         f"more than the {SMEM_LIMIT} a CTA has")
    out = torch.empty(r, n, dtype=out_dtype, device=a.device)
    if r == 0 or n == 0:
        return out
    if mxfp4 and not decode:
        a, a_scale = mxfp4_to_fp8_rowwise(a, a_scale)
    tables = _tile_tables(tuple(counts), a.device)
    tiles_m = tables.shape[1]
    if decode:
        # The packed codes as int16 words (4 codes each; TMA needs 16-byte aligned rows: K/2 bytes, a
        # multiple of 64) and the E8M0 bytes with unit column stride (the decoder reads 4 per K block).
        a = a if a.stride(1) == 1 and _tma_ok(a) else a.contiguous()
        a_desc = _desc(a.view(torch.int16), [TILE_M, FP8_TILE // 4], _PACKED_LAYOUT)
        # The E8M0 bytes as one int32 word per row and K block (the decoder loads a stage's 256 at once).
        if a_scale.stride(1) != 1 or a_scale.stride(0) % 4 or a_scale.data_ptr() % 4:
            a_scale = a_scale.contiguous()
        a_scale = a_scale.view(torch.int32)
        stride_as = a_scale.stride(0)
    else:
        a_desc = _desc(a, [TILE_M, FP8_TILE])
        a_scale = m_major(a_scale)      # the consumer reads 128 rows' scales of one K block at once
        stride_as = a_scale.stride(1)
    b_scale = b_scale.contiguous()      # one scale per K block at consecutive addresses
    tiles = tiles_m * triton.cdiv(n, BLOCK_N)
    grid = (min(tiles, _num_sms(a.device.index or 0)),)
    _grouped_mm_nt_kernel[grid](
        a_desc, _desc(b.view(-1, k), [BLOCK_N, FP8_TILE]),
        _desc(out, cfg.store_box()), a_scale, stride_as,
        b_scale, b_scale.stride(0), b_scale.stride(1),
        tables[0], tables[1], tables[2], tiles_m, n, r,
        K=k, BLOCK_N=BLOCK_N, NUM_STAGES=cfg.num_stages, GROUP_M=cfg.group_m, D_BUFS=cfg.staging(out_dtype),
        A_MXFP4=decode, A_LAYOUT=_A_LAYOUT, WORDS_LAYOUT=_WORDS_LAYOUT, WIDE=cfg.wide, num_warps=NUM_WARPS)
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
    of 128, summing to R -> out_dtype (bfloat16 or float32) [E, N, K]: out[e] = A[:, tokens of e] @
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
        _desc(b_scale_t, [1, FP8_TILE]), _desc(out.view(-1, k), cfg.store_box(wgrad=True)), _offsets(counts, a.device),
        n_exp, n, k, NUM_STAGES=cfg.num_stages, GROUP_M=cfg.group_m, D_BUFS=cfg.staging(out_dtype, wgrad=True),
        SPLIT=cfg.split, WIDE=cfg.wide, num_warps=NUM_WARPS)
    return out


def compile_sm90(k: int = 1024, out_dtype: torch.dtype = torch.bfloat16, config: GluonConfig | None = None,
                 kind: str = "nt"):
    """-> one of the engine's kernels compiled for sm90 (a triton CompiledKernel: .asm["ptx"], ["cubin"]),
    without a GPU: ``kind`` "nt" (fprop/dgrad at contraction K = k), "nt_mxfp4" (the same with an MXFP4
    A decoded in the kernel; ``config`` None = NT_MXFP4_CONFIGS[out_dtype]) or "wgrad". Triton compiles for
    GPUTarget("cuda", 90, 32) from small host tensors standing in for the operands (only dtypes, strides
    and alignment reach the compiler). The CPU tests check with it that each kernel still compiles on
    the installed Triton, uses wgmma and does not spill."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    e, n, r = 2, 2 * BLOCK_N, 2 * TILE_M
    a = torch.empty(r, k, dtype=torch.float8_e4m3fn)
    b = torch.empty(e * n, k, dtype=torch.float8_e4m3fn)
    out = torch.empty(r, n, dtype=out_dtype)
    scale = torch.empty(k // FP8_TILE, r).t()
    tables = torch.empty(3, 2, dtype=torch.int32)
    if config is None:
        config = NT_MXFP4_CONFIGS[out_dtype] if kind == "nt_mxfp4" else NT_CONFIG
    wgrad = kind == "wgrad"
    common = {"NUM_STAGES": config.num_stages, "GROUP_M": config.group_m,
              "D_BUFS": config.staging(out_dtype, wgrad), "num_warps": NUM_WARPS}
    if kind in ("nt", "nt_mxfp4"):
        kernel = _grouped_mm_nt_kernel
        mx = kind == "nt_mxfp4"
        packed = torch.empty(r, k // 4, dtype=torch.int16)
        args = {"a_desc": _desc(packed, [TILE_M, FP8_TILE // 4], _PACKED_LAYOUT) if mx else _desc(a, [TILE_M, FP8_TILE]),
                "b_desc": _desc(b, [BLOCK_N, FP8_TILE]),
                "d_desc": _desc(out, config.store_box()), "a_scale_ptr": torch.empty(r, k // FP8_TILE, dtype=torch.int32)
                if mx else scale, "stride_as_k": k // FP8_TILE if mx else r,
                "b_scale_ptr": scale, "stride_bs_e": 16, "stride_bs_n": 16, "tile_row_ptr": tables,
                "tile_expert_ptr": tables, "tile_waves_ptr": tables, "tiles_m": 2, "N": n, "R": r}
        constexprs = {"K": k, "BLOCK_N": BLOCK_N, "A_MXFP4": mx, "A_LAYOUT": _A_LAYOUT,
                      "WORDS_LAYOUT": _WORDS_LAYOUT, "WIDE": config.wide, **common}
    elif kind == "wgrad":
        kernel = _grouped_mm_wgrad_kernel
        scale_rows = torch.empty(k // FP8_TILE, r)
        rows = config.wgrad_rows()
        args = {"a_desc": _desc(a, [rows, FP8_TILE]), "b_desc": _desc(a, [FP8_TILE, FP8_TILE]),
                "as_desc": _desc(scale_rows, [1, rows]), "bs_desc": _desc(scale_rows, [1, FP8_TILE]),
                "d_desc": _desc(out, config.store_box(wgrad=True)), "offsets_ptr": tables, "num_experts": e, "N": n,
                "K": n}
        constexprs = {"SPLIT": config.split, "WIDE": config.wide, **common}
    else:
        raise ValueError(f"compile_sm90: kind must be 'nt', 'nt_mxfp4' or 'wgrad', got {kind!r}")
    names = [p.name for p in kernel.params]
    signature = {name: "constexpr" if name in constexprs else mangle_type(args[name]) for name in names}
    src = GluonASTSource(kernel, signature, {(names.index(c),): v for c, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
