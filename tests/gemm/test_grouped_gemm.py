"""Grouped FP8 GEMMs (kernels/grouped_gemm.py, moe_fp4.gemm.engines.grouped_fp8_mm_*) against the per-expert
references.

The kernels sum the same FP8 products in another order than the float32 references (per-128 partial
sums, scaled, then accumulated), so results agree to float32 rounding: |got - ref| is bounded by
ORDER_RTOL times sum_k |a_k b_k| (the magnitude the rounding errors scale with), elementwise. The
MXFP4-operand GEMM is compared bit for bit with "convert to FP8, then the same GEMM". On CPU the
kernels run under the Triton interpreter; the `gpu` tests compare with one cuBLAS blockwise
``scaled_mm`` per expert at MoE sizes.
"""

from __future__ import annotations

import pytest
import torch

import moe_fp4
from moe_fp4.gemm.engines import (
    GemmBackend,
    grouped_fp8_mm_nt,
    grouped_fp8_mm_wgrad,
    grouped_gemm_backend,
    quantize_fp8_weight,
    use_grouped_backend,
)
from moe_fp4.kernels import fp8 as K8
from moe_fp4.kernels import grouped_gemm as G

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Float32 reordering error relative to sum_k |a_k b_k|: measured at most 3.8e-8 on CPU (interpreter vs
# the float32 reference, K <= 384, every case below); on an H200 the kernels equalled one cuBLAS
# scaled_mm per expert bit for bit at the GPU test's shapes (K up to 7168). The bound 2^-19 = 1.9e-6 is
# chosen: 50x the CPU maximum and about 4x the random-walk estimate sqrt(K/128) * 2^-24 of the fp32
# accumulations at K = 7168 (the worst case, K * 2^-24, would be far looser than any error seen).
ORDER_RTOL = 2.0 ** -19
COUNTS = [(128, 0, 256), (384,), (0, 0, 128), (128, 128, 0, 384)]


def _weights(e, n, k, seed):
    g = torch.Generator().manual_seed(seed)
    return quantize_fp8_weight((torch.randn(e, n, k, generator=g) * k ** -0.5).to(DEVICE))


def _acts(r, k, seed, spread=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(r, k, generator=g)
    if spread:  # row and block magnitudes 2^-20 .. 2^20: MXFP4 blocks far below their tile's maximum
        x = x * torch.exp2(torch.randint(-20, 21, (r, k // 32), generator=g).float()).repeat_interleave(32, 1)
    return x.to(DEVICE)


def _close(got: torch.Tensor, ref: torch.Tensor, magnitude: torch.Tensor) -> None:
    err = (got.float() - ref.float()).abs()
    bound = ORDER_RTOL * magnitude + 1e-30
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g}"


def _abs_nt(a, b, counts):
    """sum_k |a_k b_k| per output element, in float64."""
    af = a.dequantize(torch.float32).double().abs()
    bf = b.dequantize(torch.float32).double().abs()
    out = torch.zeros(af.shape[0], bf.shape[1], dtype=torch.float64, device=af.device)
    offs = G.group_offsets(counts)
    for e in range(len(counts)):
        out[offs[e]:offs[e + 1]] = af[offs[e]:offs[e + 1]] @ bf[e].t()
    return out


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("n,k", [(128, 128), (384, 256), (256, 384)])
def test_grouped_nt_matches_reference(counts, n, k):
    r = sum(counts)
    a = moe_fp4.quantize_fp8(_acts(r, k, seed=r + n))
    b = _weights(len(counts), n, k, seed=k)
    got = G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, counts, torch.float32)
    ref = G.grouped_mm_nt_ref(a.data, a.scale, b.data, b.scale, counts, torch.float32)
    _close(got, ref, _abs_nt(a, b, counts))
    # bf16 output: the float32 accumulator rounded once (RNE).
    got16 = G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, counts, torch.bfloat16)
    assert torch.equal(got16, got.to(torch.bfloat16))


@pytest.mark.parametrize("config", [G.GemmConfig(block_m=64, block_n=256, num_warps=4, group_m=1),
                                    G.GemmConfig(block_n=64, num_stages=2),
                                    G.GemmConfig(block_m=128, block_n=128, use_tma=True)])
def test_grouped_nt_other_tile_configs(config):
    counts = (256, 0, 128)
    a = moe_fp4.quantize_fp8(_acts(384, 256, seed=1))
    b = _weights(3, 512, 256, seed=2)
    got = G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, counts, torch.float32, config=config)
    base = G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, counts, torch.float32)
    _close(got, base, _abs_nt(a, b, counts))


@pytest.mark.parametrize("spread", [False, True])
def test_mxfp4_operand_is_bit_identical_to_converting_first(spread):
    counts = (128, 0, 256)
    x = _acts(384, 384, seed=3, spread=spread)
    x[5, :64] = 0.0                                       # zero blocks and a zero tile
    x[6, :128] = 0.0
    q = moe_fp4.quantize_mxfp4(x.to(torch.bfloat16))
    b = _weights(3, 256, 384, seed=4)
    got = G.grouped_mm_nt(q.data, q.scale, b.data, b.scale, counts, torch.float32)
    fd, fs = K8.mxfp4_to_fp8_rowwise(q.data, q.scale)
    want = G.grouped_mm_nt(fd, fs, b.data, b.scale, counts, torch.float32)
    assert torch.equal(got, want)
    ref = G.grouped_mm_nt_ref(q.data, q.scale, b.data, b.scale, counts, torch.float32)
    assert torch.equal(G.grouped_mm_nt_ref(fd, fs, b.data, b.scale, counts, torch.float32), ref)


@pytest.mark.gpu
def test_mxfp4_operand_nan_block_poisons_its_row_only():
    # GPU only: the interpreter's float8 -> float32 conversion does not map the NaN byte 0x7F to NaN.
    counts = (128,)
    x = _acts(128, 128, seed=5).to(torch.bfloat16)
    x[3, 40] = float("nan")
    q = moe_fp4.quantize_mxfp4(x)
    b = _weights(1, 128, 128, seed=6)
    got = G.grouped_mm_nt(q.data, q.scale, b.data, b.scale, counts, torch.float32)
    assert torch.isnan(got[3]).all() and torch.isfinite(got[torch.arange(128) != 3]).all()


# The default configs use TMA; the same tiles through pointers must give the same bits.
POINTERS_OF_DEFAULT = G.GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=3, use_tma=False)


def test_grouped_tma_descriptors_load_what_the_pointers_load():
    """Same tiles through TMA descriptors (the default) and pointers: the same products in the same
    order, bit for bit."""
    counts = (256, 0, 128)
    a, b = _colwise(_acts(384, 256, seed=15)), _colwise(_acts(384, 384, seed=16))
    assert torch.equal(G.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts, config=POINTERS_OF_DEFAULT),
                       G.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts))
    x, w = moe_fp4.quantize_fp8(_acts(384, 256, seed=19)), _weights(3, 256, 256, seed=20)
    assert torch.equal(G.grouped_mm_nt(x.data, x.scale, w.data, w.scale, counts, config=POINTERS_OF_DEFAULT),
                       G.grouped_mm_nt(x.data, x.scale, w.data, w.scale, counts))


def test_grouped_wgrad_tiles_that_do_not_divide_k():
    counts = (256, 0, 128)
    a, b = _colwise(_acts(384, 256, seed=15)), _colwise(_acts(384, 384, seed=16))
    cfg = G.GemmConfig(block_n=256)                      # K = 384: masked loads
    got = G.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts, config=cfg)
    ref = G.grouped_mm_wgrad_ref(a.data, a.scale, b.data, b.scale, counts)
    af, bf = a.dequantize(torch.float32).double().abs(), b.dequantize(torch.float32).double().abs()
    offs = G.group_offsets(counts)
    mag = torch.stack([af[:, offs[e]:offs[e + 1]] @ bf[:, offs[e]:offs[e + 1]].t() for e in range(3)])
    _close(got, ref, mag)


def test_mxfp4_operand_with_pointer_config_is_bit_identical():
    counts = (128, 256)
    q = moe_fp4.quantize_mxfp4(_acts(384, 256, seed=17).to(torch.bfloat16))
    b = _weights(2, 256, 256, seed=18)
    cfg = POINTERS_OF_DEFAULT
    got = G.grouped_mm_nt(q.data, q.scale, b.data, b.scale, counts, torch.float32, config=cfg)
    fd, fs = K8.mxfp4_to_fp8_rowwise(q.data, q.scale)
    assert torch.equal(got, G.grouped_mm_nt(fd, fs, b.data, b.scale, counts, torch.float32, config=cfg))


def _colwise(x):
    return moe_fp4.quantize_fp8(x.t().contiguous())


@pytest.mark.parametrize("counts", COUNTS)
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_grouped_wgrad_matches_reference(counts, out_dtype):
    r = sum(counts)
    n, k = 256, 384
    dy, x = _acts(r, n, seed=7), _acts(r, k, seed=8)
    a, b = _colwise(dy), _colwise(x)
    got = G.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts, out_dtype)
    ref = G.grouped_mm_wgrad_ref(a.data, a.scale, b.data, b.scale, counts, torch.float32)
    assert got.shape == (len(counts), n, k) and got.dtype == out_dtype
    af, bf = a.dequantize(torch.float32).double().abs(), b.dequantize(torch.float32).double().abs()
    offs = G.group_offsets(counts)
    mag = torch.stack([af[:, offs[e]:offs[e + 1]] @ bf[:, offs[e]:offs[e + 1]].t() for e in range(len(counts))])
    if out_dtype is torch.float32:
        _close(got, ref, mag)
    else:
        assert torch.equal(got, G.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts).to(out_dtype))
    for e, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(got[e]) == 0


def test_empty_and_degenerate_shapes():
    b = _weights(2, 128, 128, seed=9)
    a = moe_fp4.quantize_fp8(torch.zeros(0, 128, device=DEVICE))
    assert G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, (0, 0)).shape == (0, 128)
    z = moe_fp4.quantize_fp8(torch.zeros(128, 0, device=DEVICE))
    out = G.grouped_mm_wgrad(z.data, z.scale, z.data, z.scale, (0, 0))
    assert out.shape == (2, 128, 128) and torch.count_nonzero(out) == 0


def test_validation_messages():
    a = moe_fp4.quantize_fp8(_acts(256, 128, seed=10))
    b = _weights(2, 128, 128, seed=11)
    with pytest.raises(ValueError, match="multiples of 128"):
        G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, (200, 56))
    with pytest.raises(ValueError, match="sum to 128"):
        G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, (128, 0))
    with pytest.raises(ValueError, match="2 counts"):
        G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, (256,))
    with pytest.raises(ValueError, match=r"K = 128"):
        G.grouped_mm_nt(a.data, a.scale, _weights(2, 128, 256, 1).data, b.scale, (128, 128))
    with pytest.raises(TypeError, match="float8_e4m3fn"):
        G.grouped_mm_nt(a.data.float(), a.scale, b.data, b.scale, (128, 128))
    with pytest.raises(ValueError, match="scale"):
        G.grouped_mm_nt(a.data, a.scale[:, :0], b.data, b.scale, (128, 128))
    with pytest.raises(ValueError, match="block_m"):
        G.GemmConfig(block_m=32)
    with pytest.raises(ValueError, match=r"\[K, R\]"):
        c = moe_fp4.quantize_fp8(_acts(128, 256, seed=12))
        G.grouped_mm_wgrad(a.data, a.scale, c.data, c.scale, (128, 0))


def test_container_api_and_backends(monkeypatch):
    counts = (128, 256)
    x = _acts(384, 256, seed=12).to(torch.bfloat16)
    b = _weights(2, 128, 256, seed=13)
    q = moe_fp4.quantize_mxfp4(x)
    with use_grouped_backend("triton"):
        assert grouped_gemm_backend(torch.device("cpu")) is GemmBackend.TRITON
        tri = grouped_fp8_mm_nt(q, b, counts, torch.float32)
        tri_w = grouped_fp8_mm_wgrad(_colwise(x.float()), _colwise(x.float()), counts)
    with use_grouped_backend(GemmBackend.EMULATED):
        emu = grouped_fp8_mm_nt(q, b, counts, torch.float32)
        emu_w = grouped_fp8_mm_wgrad(_colwise(x.float()), _colwise(x.float()), counts)
    assert torch.allclose(tri, emu, rtol=1e-5, atol=1e-5) and torch.allclose(tri_w, emu_w, rtol=1e-5, atol=1e-4)
    monkeypatch.setenv("MOE_FP4_GROUPED_GEMM", "cutlass")
    with pytest.raises(ValueError, match="MOE_FP4_GROUPED_GEMM"):
        grouped_gemm_backend(torch.device("cpu"))
    monkeypatch.setenv("MOE_FP4_GROUPED_GEMM", "emulated")
    assert grouped_gemm_backend(torch.device(DEVICE)) is GemmBackend.EMULATED
    with pytest.raises(TypeError, match="FP8WeightTensor"):
        grouped_fp8_mm_nt(q, b.data, counts)
    with pytest.raises(TypeError, match="output dtype"):
        grouped_fp8_mm_nt(q, b, counts, torch.int32)


# ---------------------------------------------------------------------------------------------
# GPU: the Triton kernels against one cuBLAS blockwise scaled_mm per expert at MoE sizes.

def _sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)


def _gpu_operands(counts, h, f):
    """The layer's GEMM operands for these counts on the GPU -> (x, dy bf16 [R, H], W13 FP8 [E, 2F, H],
    W2^T FP8 [E, F, H], x as FP8 and as MXFP4)."""
    r, e = sum(counts), len(counts)
    x = torch.randn(r, h, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(r, h, device="cuda", dtype=torch.bfloat16)
    w13 = quantize_fp8_weight(torch.randn(e, 2 * f, h, device="cuda") * h ** -0.5)
    w2t = quantize_fp8_weight(torch.randn(e, h, f, device="cuda") * f ** -0.5, transposed=True)
    return (x, dy, w13, w2t, *moe_fp4.quantize_fp8_and_mxfp4(x))


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="FP8 tensor cores need sm90")
@pytest.mark.parametrize("h,f,e", [(7168, 2048, 8), (2048, 1408, 16)])
def test_gpu_grouped_gemms_match_scaled_mm_per_expert(h, f, e):
    torch.manual_seed(14)
    counts = tuple(128 * int(c) for c in torch.randint(0, 9, (e,)))
    counts = (0,) + counts[1:]
    x, dy, w13, w2t, xq, xmx = _gpu_operands(counts, h, f)
    for a, b in ((xq, w13), (moe_fp4.quantize_fp8(dy), w2t)):
        with use_grouped_backend("triton"):
            got = grouped_fp8_mm_nt(a, b, counts, torch.float32)
        with use_grouped_backend("scaled_mm"):
            ref = grouped_fp8_mm_nt(a, b, counts, torch.float32)
        _close(got, ref, _abs_nt(a, b, counts))
    assert torch.equal(G.grouped_mm_nt(xq.data, xq.scale, w13.data, w13.scale, counts, config=POINTERS_OF_DEFAULT),
                       G.grouped_mm_nt(xq.data, xq.scale, w13.data, w13.scale, counts))
    with use_grouped_backend("triton"):
        assert torch.equal(grouped_fp8_mm_nt(xmx, w13, counts),
                           grouped_fp8_mm_nt(moe_fp4.mxfp4_to_fp8(xmx), w13, counts))
        got = grouped_fp8_mm_wgrad(_colwise(dy), _colwise(x), counts)
    with use_grouped_backend("scaled_mm"):
        ref = grouped_fp8_mm_wgrad(_colwise(dy), _colwise(x), counts)
    a, b = _colwise(dy), _colwise(x)
    af, bf = a.dequantize(torch.float32).double().abs(), b.dequantize(torch.float32).double().abs()
    offs = G.group_offsets(counts)
    mag = torch.stack([af[:, offs[i]:offs[i + 1]] @ bf[:, offs[i]:offs[i + 1]].t() for i in range(e)])
    _close(got, ref, mag)


# --------------------------------------------------------------------------------------------
# The Gluon engine (kernels/gluon_grouped_gemm.py): its tile list on the CPU, the kernel on Hopper
# against its Triton twin and the per-expert float32 reference.

from moe_fp4.kernels import gluon_grouped_gemm as GL  # noqa: E402


@pytest.mark.parametrize("counts", [(), (0,), (128,), (256,), (384, 0, 128), (0, 640, 0), (1024,) * 3])
def test_gluon_tile_list_covers_each_expert_once(counts):
    rows, experts, waves = GL.m_tiles(counts)
    covered = []
    for r0, e, w in zip(rows, experts, waves):
        assert w in (1, 2) and counts[e] > 0
        covered += [(r, e) for r in range(r0, r0 + w * GL.WAVE_M)]
    offs = G.group_offsets(counts)
    assert covered == [(r, e) for e in range(len(counts)) for r in range(offs[e], offs[e + 1])]
    # Two-wave tiles wherever an expert has 256 rows left: one-wave tiles only at an expert's end.
    assert sum(w == 1 for w in waves) == sum((c // 128) % 2 for c in counts)


def test_gluon_config_shared_memory_per_layout():
    # The launchers refuse a config whose ring and staging do not fit a CTA's shared memory; the
    # weight-gradient stages also carry each token block's float32 row and column scales.
    c = GL.GluonConfig()
    assert c.smem_bytes(torch.bfloat16) == 3 * (256 + 128) * 128 + 64 * 1024
    assert c.smem_bytes(torch.bfloat16, wgrad=True) == 3 * (256 + 128) * (128 + 4) + 64 * 1024 <= GL.SMEM_LIMIT
    split = GL.GluonConfig(num_stages=4, split=True)
    assert split.wgrad_rows() == 128 and c.wgrad_rows() == 256
    assert split.smem_bytes(torch.float32, wgrad=True) == 4 * (128 + 128) * 132 + 64 * 1024 <= GL.SMEM_LIMIT
    assert GL.GluonConfig(num_stages=4).smem_bytes(torch.bfloat16, wgrad=True) > GL.SMEM_LIMIT
    with pytest.raises(ValueError, match="num_stages"):
        GL.GluonConfig(num_stages=1)
    # Staging in [64, 128] boxes (one half of a wave), 64 KiB by default, fprop/dgrad and weight
    # gradients alike.
    assert GL.STORE_BOX == [64, 128]
    assert c.staging(torch.bfloat16) == 2 and c.staging(torch.float32) == 1
    assert GL.GluonConfig(d_bufs=1).smem_bytes(torch.bfloat16) == 3 * (256 + 128) * 128 + 32 * 1024
    assert c.smem_bytes(torch.bfloat16) + GL.MBARRIER_BYTES <= GL.SMEM_LIMIT


def test_gluon_engine_is_chosen_only_where_it_runs(monkeypatch):
    monkeypatch.delenv("MOE_FP4_GROUPED_GEMM", raising=False)
    assert not GL.supported(torch.device("cpu"))
    assert grouped_gemm_backend(torch.device("cpu")) is GemmBackend.EMULATED
    if GL.supported(torch.device(DEVICE)):
        assert grouped_gemm_backend(torch.device(DEVICE)) is GemmBackend.GLUON
    with use_grouped_backend("gluon"):
        with pytest.raises(RuntimeError, match="Hopper"):
            grouped_fp8_mm_nt(moe_fp4.quantize_fp8(torch.randn(128, 128)),
                              quantize_fp8_weight(torch.randn(1, 128, 128)), [128])


def _cuobjdump(cubin: bytes, flag: str, tmp_path) -> str:
    import os
    import subprocess

    import triton
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    path = tmp_path / "kernel.cubin"
    path.write_bytes(cubin)
    return subprocess.run([tool, flag, str(path)], capture_output=True, text=True, check=True, timeout=120).stdout


def _sass_lines(sass: str) -> list[tuple[int, str]]:
    """cuobjdump -sass text -> [(address, instruction)]."""
    import re
    return [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]


def _inner_loops_of(lines, opcode: str) -> list[tuple[int, int]]:
    """-> the innermost loop (start, end address: a backward branch and its target) around each
    instruction whose opcode starts with ``opcode``."""
    import re
    loops = []
    for addr, ins in lines:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    found = set()
    for addr, ins in lines:
        if ins.split(" ")[-1].startswith(opcode) or re.match(r"(@!?U?P\w+ )?" + re.escape(opcode), ins):
            around = [lp for lp in loops if lp[0] <= addr <= lp[1]]
            if around:
                found.add(min(around, key=lambda lp: lp[1] - lp[0]))
    return sorted(found)


@pytest.mark.skipif(not GL.AVAILABLE, reason="this Triton has no (compatible) Gluon")
@pytest.mark.parametrize("kind,out_dtype,split,ones", [
    ("nt", "bfloat16", False, False), ("nt", "float32", False, False), ("nt", "bfloat16", False, True),
    ("wgrad", "bfloat16", False, False), ("wgrad", "float32", False, False), ("wgrad", "bfloat16", True, False),
    ("wgrad", "bfloat16", True, True)])
def test_gluon_engine_compiles_for_sm90_with_wgmma_and_without_spills(tmp_path, kind, out_dtype, split, ones):
    # No GPU needed: the installed Triton compiles the engine for Hopper (its wheel ships ptxas). This is
    # what catches Gluon API drift between Triton releases on the CPU machine (the GPU image's 3.6 and
    # later ones), and a change that makes the consumers spill (a branch around the second wave does).
    # ``ones``: the integer arguments a launch may pass as 1 (one M tile, a scale stride at K = 128, one
    # expert) equal to 1, which Triton specializes into constexprs. In a process of its own without
    # TRITON_INTERPRET: the interpreter, once it has run a kernel in this process, leaves Triton's shared
    # jit functions (cdiv) in a state the Gluon frontend rejects.
    import os
    import re
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import sys, torch; from moe_fp4.kernels import gluon_grouped_gemm as GL; "
            "cfg = GL.GluonConfig(num_stages=4, split=True) if sys.argv[5] == 'True' else None; "
            "k = GL.compile_sm90(k=1024, kind=sys.argv[3], "
            "out_dtype=getattr(torch, sys.argv[4]), config=cfg, ones=sys.argv[6] == 'True'); "
            "open(sys.argv[1], 'wb').write(k.asm['cubin']); open(sys.argv[2], 'w').write(k.asm['ptx'])")
    cubin, ptx_path = tmp_path / "kernel.cubin", tmp_path / "kernel.ptx"
    argv = [str(cubin), str(ptx_path), kind, out_dtype, str(split), str(ones)]
    # -P as this process has it: a run from the checkout with an installed package keeps the source tree's
    # moe_fp4/ (which lacks kernels/, shipped as moe_fp4.kernels) off sys.path.
    safe = ["-P"] if sys.flags.safe_path else []
    run = subprocess.run([sys.executable, *safe, "-c", code, *argv], env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    ptx = ptx_path.read_text()
    # Per K (token) block and consumer warpgroup: 2 halves x 4 k32 steps, m64n128k32 E4M3 -> F32.
    wgmmas = len(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n128k32\.f32\.e4m3\.e4m3", ptx))
    assert wgmmas == 2 * 8
    assert "setmaxnreg" in ptx   # the producer gives its registers to the consumers
    sass = _cuobjdump(cubin.read_bytes(), "-sass", tmp_path)
    # One raw accumulator per consumer: each of the two halves' chains waited for (2 per consumer), never
    # each k32 step (ptxas serializes every wgmma, a wait to zero after each, when it runs out of registers).
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 4
    lines = _sass_lines(sass)
    loops = _inner_loops_of(lines, "QGMMA")
    assert len(loops) == 2, loops   # each consumer's K loop
    in_loops = [ins for addr, ins in lines if any(a <= addr <= b for a, b in loops)]
    assert not [ins for ins in in_loops if re.search(r"\b(LDL|STL)\b", ins)], "spills inside a K loop"
    if kind == "nt":
        usage = _cuobjdump(cubin.read_bytes(), "-res-usage", tmp_path)
        assert re.search(r"STACK:0\b", usage), usage
        assert "LDL" not in sass


def _hopper():
    return GL.supported(torch.device("cuda")) if torch.cuda.is_available() else False


# Hopper's FP8 wgmma adds its products in an accumulator that keeps about 14 bits (DeepSeek-V3 report,
# 3.3.2: the reason the recipe promotes every 128 columns of K). A 128-wide block is 4 chained k32
# instructions, each adding an error of up to 2^-13 of the block's running |sum| (at least 13 bits),
# so against the float64 product of the exact operands the bound is 4 x 2^-13 = 2^-11 times
# sum_k |a_k b_k|. The Triton twin runs the same instructions, so against it the engine only
# reorders float32 additions (ORDER_RTOL).
HOPPER_FP8_ACC_RTOL = 2.0 ** -11


def _ref64_nt(a, b, counts):
    """The exact product per expert in float64 (operands dequantized exactly)."""
    af, bf = a.dequantize(torch.float32).double(), b.dequantize(torch.float32).double()
    out = torch.zeros(af.shape[0], bf.shape[1], dtype=torch.float64, device=af.device)
    offs = G.group_offsets(counts)
    for e in range(len(counts)):
        out[offs[e]:offs[e + 1]] = af[offs[e]:offs[e + 1]] @ bf[e].t()
    return out


def _close_to(got, ref, magnitude, rtol):
    err = (got.double() - ref.double()).abs()
    bound = rtol * magnitude + 1e-30
    assert bool((err <= bound).all()), f"max err/bound {(err / bound).max().item():.3g} (rtol {rtol:.3g})"


def _check_engine(got, twin, ref64, mag):
    """The Gluon engine's float32 result: within float32 reordering of its Triton twin (ORDER_RTOL) and
    within Hopper's FP8 accumulator bound of the float64 product; both errors printed."""
    rel = lambda t: ((t.double() - ref64).abs() / (mag + 1e-300)).max().item()  # noqa: E731
    print(f"max |err| / sum|ab| vs float64: gluon {rel(got):.3g}, triton twin {rel(twin):.3g}")
    _close(got, twin, mag)
    _close_to(got, ref64, mag, HOPPER_FP8_ACC_RTOL)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon engine needs Hopper (sm90)")
@pytest.mark.parametrize("h,f,e", [(7168, 2048, 8), (2048, 1408, 16), (512, 384, 5)])
def test_gpu_gluon_grouped_nt_matches_triton_and_reference(h, f, e):
    # Ragged reality: experts with 0 rows, one 128-row wave, odd multiples of 128 (a one-wave last
    # tile whose second wave reads the next expert's rows and must not store them), and the last
    # tile running past R.
    torch.manual_seed(29 + e)
    counts = [128 * int(c) for c in torch.randint(0, 9, (e,))]
    counts[0], counts[1] = 0, 128
    counts[-1] = 384
    x, dy, w13, w2t, xq, xmx = _gpu_operands(counts, h, f)
    for a, b in ((xq, w13), (moe_fp4.quantize_fp8(dy), w2t)):
        got = GL.grouped_mm_nt(a.data, a.scale, b.data, b.scale, counts, torch.float32)
        twin = G.grouped_mm_nt(a.data, a.scale, b.data, b.scale, counts, torch.float32)
        ref64, mag = _ref64_nt(a, b, counts), _abs_nt(a, b, counts)
        _check_engine(got, twin, ref64, mag)
        # bf16 output: the same float32 accumulator rounded once.
        assert torch.equal(GL.grouped_mm_nt(a.data, a.scale, b.data, b.scale, counts), got.to(torch.bfloat16))
    with use_grouped_backend("gluon"):
        assert torch.equal(grouped_fp8_mm_nt(xmx, w13, counts),
                           grouped_fp8_mm_nt(moe_fp4.mxfp4_to_fp8(xmx), w13, counts))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon engine needs Hopper (sm90)")
@pytest.mark.parametrize("spread", [False, True])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_gpu_gluon_mxfp4_operand_equals_converting_first(spread, out_dtype):
    # An MXFP4 A against mxfp4_to_fp8_rowwise + the FP8-A kernel, bit for bit: ragged experts (0 rows,
    # one wave, odd multiples of 128, the last tile past R), blocks far below their tile's maximum
    # (spread: the converter's general path), a NaN block (its row's outputs NaN, nothing else).
    torch.manual_seed(31)
    counts = [0, 128, 384, 640, 0, 256, 128]
    r, h, n = sum(counts), 1024, 384
    x = _acts(r, h, seed=41, spread=spread).to(torch.bfloat16)
    x[300, 64:96] = float("nan")
    q = moe_fp4.quantize_mxfp4(x)
    w = _weights(len(counts), n, h, seed=43)
    got = GL.grouped_mm_nt(q.data, q.scale, w.data, w.scale, counts, out_dtype)
    fd, fs = K8.mxfp4_to_fp8_rowwise(q.data, q.scale)
    first = GL.grouped_mm_nt(fd, fs, w.data, w.scale, counts, out_dtype)
    assert torch.equal(got.isnan(), first.isnan())
    assert got.isnan().any(dim=1).nonzero().flatten().tolist() == [300] and bool(got[300].isnan().all())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(first))
    # A strided view of the codes (a column slice of a wider buffer) gives the same bits.
    wide = torch.zeros(r, q.data.shape[1] + 64, dtype=torch.uint8, device="cuda")
    wide[:, 32:32 + q.data.shape[1]] = q.data
    strided = GL.grouped_mm_nt(wide[:, 32:32 + q.data.shape[1]], q.scale, w.data, w.scale, counts, out_dtype)
    assert torch.equal(torch.nan_to_num(strided), torch.nan_to_num(got))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon engine needs Hopper (sm90)")
def test_gpu_gluon_rows_of_empty_and_absent_experts():
    # Only experts with rows are written; a NaN in one expert's rows stays in those rows.
    counts = [0, 256, 0, 128]
    a = moe_fp4.quantize_fp8(torch.randn(384, 256, device="cuda"))
    b = quantize_fp8_weight(torch.randn(4, 256, 256, device="cuda") * 256 ** -0.5)
    data = a.data.clone()
    data[3, 7] = float("nan")
    got = GL.grouped_mm_nt(data, a.scale, b.data, b.scale, counts, torch.float32)
    assert got[3].isnan().all() and not got[torch.arange(384, device="cuda") != 3].isnan().any()
    twin = G.grouped_mm_nt(data, a.scale, b.data, b.scale, counts, torch.float32)
    rest = torch.arange(384, device="cuda") != 3
    _close(got[rest], twin[rest], _abs_nt(a, b, counts)[rest])


def _wgrad_magnitude(a, b, counts):
    """sum over each expert's tokens of |a_nt b_kt|, float64 [E, N, K]."""
    af, bf = a.dequantize(torch.float32).double().abs(), b.dequantize(torch.float32).double().abs()
    offs = G.group_offsets(counts)
    return torch.stack([af[:, offs[i]:offs[i + 1]] @ bf[:, offs[i]:offs[i + 1]].t() for i in range(len(counts))])


def _wgrad_ref64(a, b, counts):
    af, bf = a.dequantize(torch.float32).double(), b.dequantize(torch.float32).double()
    offs = G.group_offsets(counts)
    return torch.stack([af[:, offs[i]:offs[i + 1]] @ bf[:, offs[i]:offs[i + 1]].t() for i in range(len(counts))])


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon engine needs Hopper (sm90)")
@pytest.mark.parametrize("config", [GL.GluonConfig(), GL.GluonConfig(num_stages=4, split=True)],
                         ids=["waves", "split"])
@pytest.mark.parametrize("n,k,e", [(7168, 2048, 6), (1408, 2048, 9), (384, 640, 5)])
def test_gpu_gluon_wgrad_matches_triton_and_reference(n, k, e, config):
    # Ragged reality for the K-grouped GEMM: experts without tokens (their dW is zeros, written), one
    # token block, the last expert empty (its offset is R), and N an odd multiple of 128 (a last row
    # tile with one wave: the second runs on TMA's zero fill and must not be stored).
    torch.manual_seed(31 + e)
    counts = [128 * int(c) for c in torch.randint(0, 9, (e,))]
    counts[0], counts[1], counts[-1] = 0, 128, 0
    r = sum(counts)
    dy = torch.randn(r, n, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(r, k, device="cuda", dtype=torch.bfloat16)
    a, b = _colwise(dy), _colwise(x)
    got = GL.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts, torch.float32, config=config)
    twin = G.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts, torch.float32)
    _check_engine(got, twin, _wgrad_ref64(a, b, counts), _wgrad_magnitude(a, b, counts))
    for i, c in enumerate(counts):
        if c == 0:
            assert torch.count_nonzero(got[i]) == 0
    # bf16 output: the same float32 accumulator rounded once.
    assert torch.equal(GL.grouped_mm_wgrad(a.data, a.scale, b.data, b.scale, counts, torch.bfloat16, config=config),
                       got.to(torch.bfloat16))
    if config == GL.WGRAD_CONFIG:   # the layer's path: moe_fp4.gemm.engines picks the engine and its config
        with use_grouped_backend("gluon"):
            assert torch.equal(grouped_fp8_mm_wgrad(a, b, counts), got)


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon engine needs Hopper (sm90)")
def test_gpu_gluon_wgrad_nan_stays_in_its_expert_and_row():
    # A NaN in dY^T at (row 5, a token of expert 1) poisons dW[1][5, :] and nothing else; an N that is
    # not a multiple of 128 goes to the Triton twin, which gives the same values.
    counts = [256, 128, 0, 384]
    a = _colwise(torch.randn(768, 384, device="cuda"))
    b = _colwise(torch.randn(768, 256, device="cuda"))
    data = a.data.clone()
    data[5, 300] = float("nan")
    got = GL.grouped_mm_wgrad(data, a.scale, b.data, b.scale, counts, torch.float32)
    poisoned = torch.zeros_like(got, dtype=torch.bool)
    poisoned[1, 5] = True
    assert got[poisoned].isnan().all() and not got[~poisoned].isnan().any()
    odd = _colwise(torch.randn(768, 200, device="cuda"))
    assert torch.equal(GL.grouped_mm_wgrad(odd.data, odd.scale, b.data, b.scale, counts),
                       G.grouped_mm_wgrad(odd.data, odd.scale, b.data, b.scale, counts))


# ---------------------------------------------------------------------------------------------
# Device counts: an int tensor [E] whose values no launcher reads on the host, over a static bound of rows.

@pytest.mark.parametrize("counts,tail", [((128, 0, 256), 256), ((384,), 0), ((0, 0, 128), 128), ((0, 0), 384)])
def test_device_counts_equal_host_counts_and_zero_the_tail(counts, tail):
    # The rows past the groups (a static bound's tail) hold garbage inputs here: fprop and dgrad store zeros
    # there, the weight gradient leaves those tokens out; every other bit equals the host-count GEMM's.
    n, k = 256, 384
    r = sum(counts)
    a = moe_fp4.quantize_fp8(_acts(r + tail, k, seed=3) * 7)
    w = _weights(len(counts), n, k, seed=5)
    dev = torch.tensor(counts, device=DEVICE)
    for fn in (G.grouped_mm_nt, G.grouped_mm_nt_ref):
        host = fn(a.data[:r], a.scale[:r], w.data, w.scale, counts, torch.float32)
        got = fn(a.data, a.scale, w.data, w.scale, dev, torch.float32)
        assert torch.equal(got[:r], host) and not got[r:].any(), fn.__name__
    ga, gb = moe_fp4.quantize_fp8(_acts(n, r + tail, seed=7)), moe_fp4.quantize_fp8(_acts(k, r + tail, seed=9))
    for fn in (G.grouped_mm_wgrad, G.grouped_mm_wgrad_ref):
        host = fn(ga.data[:, :r].contiguous(), ga.scale[:, :r // 128].contiguous(), gb.data[:, :r].contiguous(),
                  gb.scale[:, :r // 128].contiguous(), counts)
        assert torch.equal(fn(ga.data, ga.scale, gb.data, gb.scale, dev), host), fn.__name__
    with use_grouped_backend("emulated"):
        assert torch.equal(grouped_fp8_mm_nt(a, w, dev, torch.float32)[:r],
                           grouped_fp8_mm_nt(a.rows(0, r), w, counts, torch.float32))


def test_device_counts_are_validated_by_shape_not_by_value():
    a = moe_fp4.quantize_fp8(_acts(256, 256, seed=1))
    w = _weights(2, 128, 256, seed=2)
    for bad, match in ((torch.tensor([128]), r"int32/int64 \[2\]"), (torch.tensor([128.0, 0.0]), "int32/int64"),
                       (torch.tensor([[128, 0]]), r"\[2\]")):
        with pytest.raises(ValueError, match=match):
            G.grouped_mm_nt(a.data, a.scale, w.data, w.scale, bad.to(DEVICE))
    # The twins read the values (they are the references) and refuse a sum past R.
    with pytest.raises(ValueError, match="at most 256"):
        G.grouped_mm_nt_ref(a.data, a.scale, w.data, w.scale, torch.tensor([256, 128], device=DEVICE))


@pytest.mark.parametrize("seed", range(6))
def test_gluon_device_tile_table_equals_the_host_one_then_covers_the_tail(seed):
    # m_tiles_on_device: the host table's tiles first, then zero tiles over exactly the tail's rows, then
    # entries with no waves; its length is the static bound however the rows fall.
    g = torch.Generator().manual_seed(seed)
    e = int(torch.randint(1, 9, (), generator=g))
    counts = [128 * int(c) for c in torch.randint(0, 6, (e,), generator=g)]
    rows = sum(counts) + 128 * int(torch.randint(0, 5, (), generator=g))
    table = GL.m_tiles_on_device(torch.tensor(counts), rows)
    assert table.dtype == torch.int32 and table.shape == (3, (rows // 128 + e + 1) // 2)
    host = GL.m_tiles(counts)
    n = len(host[0])
    assert [table[i, :n].tolist() for i in range(3)] == [list(h) for h in host]
    tail = table[:, n:]
    zero = tail[:, tail[2] > 0]
    assert (zero[1] == e).all()
    covered = sorted(r for row, waves in zip(zero[0].tolist(), zero[2].tolist()) for r in range(row, row + 128 * waves))
    assert covered == list(range(sum(counts), rows))


@pytest.mark.gpu
@pytest.mark.skipif(not _hopper(), reason="the Gluon engine needs Hopper (sm90)")
def test_gpu_gluon_device_counts_equal_host_counts_and_zero_the_tail():
    counts = [0, 128, 384, 640, 0, 256, 128]
    r, tail, h, n = sum(counts), 640, 1024, 384
    a = moe_fp4.quantize_fp8(_acts(r + tail, h, seed=11).to(torch.bfloat16) * 3)
    w = _weights(len(counts), n, h, seed=13)
    dev = torch.tensor(counts, device="cuda")
    for out_dtype in (torch.bfloat16, torch.float32):
        host = GL.grouped_mm_nt(a.data[:r], a.scale[:r], w.data, w.scale, counts, out_dtype)
        got = GL.grouped_mm_nt(a.data, a.scale, w.data, w.scale, dev, out_dtype)
        assert torch.equal(got[:r], host) and not got[r:].any()
    ga, gb = moe_fp4.quantize_fp8(_acts(n, r + tail, seed=7)), moe_fp4.quantize_fp8(_acts(h, r + tail, seed=9))
    host = GL.grouped_mm_wgrad(ga.data[:, :r].contiguous(), ga.scale[:, :r // 128].contiguous(),
                               gb.data[:, :r].contiguous(), gb.scale[:, :r // 128].contiguous(), counts)
    assert torch.equal(GL.grouped_mm_wgrad(ga.data, ga.scale, gb.data, gb.scale, dev), host)
