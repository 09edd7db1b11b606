"""FP8 GEMM operands and fp8_mm_nt: 128x128 weight quantization against its definition, transposes,
colwise operands against the MXFP4 column kernel, and (GPU) cuBLAS blockwise against the emulation."""

import math

import pytest
import torch

import moe_fp4
from moe_fp4.formats import reference
from moe_fp4.gemm.engines import (
    FP8WeightTensor,
    GemmBackend,
    fp8_mm_nt,
    gemm_backend,
    quantize_fp8_colwise,
    quantize_fp8_weight,
)

# cuBLAS accumulates in float32 in another order and rounds the output to bf16 once: the relative
# error against the float32 emulation is about 2^-9 (measured on H200: see the GPU test's message).
SCALED_MM_VS_EMULATION_MAX_REL = 1e-2


def _weight_oracle(w: torch.Tensor):
    """Per 128x128 block, in float64: S = ceil(log2(amax / 448)) clamped, codes = RNE(w / 2^S)."""
    n, k = w.shape
    data = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(n // 128, k // 128)
    for i in range(n // 128):
        for j in range(k // 128):
            blk = w[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128].double()
            amax = blk.abs().max().item()
            s = min(max(math.ceil(math.log2(amax / 448)) if amax > 0 else -126, -126), 127)
            scale[i, j] = 2.0 ** s
            data[i * 128:(i + 1) * 128, j * 128:(j + 1) * 128] = (blk / 2.0 ** s).to(torch.float8_e4m3fn)
    return data, scale


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_weight_quantization_matches_definition(dtype):
    torch.manual_seed(0)
    w = torch.randn(256, 384, dtype=torch.float32) * torch.logspace(-3, 3, 384)
    w[:128, :128] = 0  # an all-zero block
    w[130, 200] = 448.0 * 2 ** 5  # amax exactly 448 * 2^5: S = 5, no rounding up
    w = w.to(dtype)
    q = quantize_fp8_weight(w)
    data, scale = _weight_oracle(w)
    assert torch.equal(q.data.view(torch.uint8), data.view(torch.uint8))
    assert torch.equal(q.scale, scale.float())
    assert q.scale[1, 1] == 2.0 ** 5


def test_weight_stack_and_transpose():
    torch.manual_seed(1)
    w = torch.randn(3, 256, 128, dtype=torch.bfloat16)
    q = quantize_fp8_weight(w)
    assert q.data.shape == (3, 256, 128) and q.scale.shape == (3, 2, 1)
    for e in range(3):
        single = quantize_fp8_weight(w[e])
        assert torch.equal(q[e].data.view(torch.uint8), single.data.view(torch.uint8))
        assert torch.equal(q[e].scale, single.scale)
        t = q[e].t()
        assert t.data.shape == (128, 256) and torch.equal(t.dequantize(), q[e].dequantize().t())
    assert q.nbytes == 3 * 256 * 128 + 4 * 3 * 2


def test_weight_kernel_matches_reference_with_non_finite_values():
    from moe_fp4.kernels.fp8 import quantize_fp8_weight_128x128, quantize_fp8_weight_128x128_ref

    torch.manual_seed(6)
    w = torch.randn(2, 256, 384) * torch.logspace(-30, 30, 384)
    w[0, 3, 5], w[1, 200, 300], w[1, 0, 0] = float("nan"), float("inf"), -float("inf")
    w[0, 128:, :128] = 0
    for dtype in (torch.float32, torch.bfloat16):
        got = quantize_fp8_weight_128x128(w.to(dtype), write_q=True, write_t=True)
        ref = quantize_fp8_weight_128x128_ref(w.to(dtype), write_q=True, write_t=True)
        for g, r in zip(got, ref):
            assert torch.equal(g.view(torch.uint8), r.view(torch.uint8)) if g.dtype != torch.float32 \
                else torch.equal(g, r)
        assert got[0].view(torch.uint8)[0, 3, 5] == 0x7F and got[1].view(torch.uint8)[1, 300, 200] == 0x7F


def test_weight_transposed_equals_transpose_of_weight():
    torch.manual_seed(7)
    w = torch.randn(2, 256, 384, dtype=torch.bfloat16)
    q, qt = quantize_fp8_weight(w), quantize_fp8_weight(w, transposed=True)
    assert qt.data.shape == (2, 384, 256) and qt.scale.shape == (2, 3, 2)
    ref = q.t()
    assert torch.equal(qt.data.view(torch.uint8), ref.data.view(torch.uint8)) and torch.equal(qt.scale, ref.scale)


def test_weight_transpose_kernel_is_a_byte_transpose():
    # Every byte value (NaN codes 0x7F / 0xFF included) in several 128x128 tiles, stacks of 1 and 3 and none,
    # through the Triton kernel (the interpreter on CPU) and its twin; FP8WeightTensor.t() takes it.
    from moe_fp4.kernels.fp8 import transpose_fp8_weight_128x128, transpose_fp8_weight_128x128_ref

    g = torch.Generator().manual_seed(9)
    for shape in ((1, 128, 128), (3, 256, 384), (0, 128, 256)):
        q = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
        got, ref = transpose_fp8_weight_128x128(q), transpose_fp8_weight_128x128_ref(q)
        assert got.shape == ref.shape == (shape[0], shape[2], shape[1])
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))
        assert torch.equal(ref.view(torch.uint8), q.view(torch.uint8).transpose(1, 2))
    w = torch.randn(2, 256, 384, dtype=torch.bfloat16)
    q, qt = quantize_fp8_weight_pair(w)
    t = q.t()
    assert torch.equal(t.data.view(torch.uint8), qt.data.view(torch.uint8)) and torch.equal(t.scale, qt.scale)


@pytest.mark.gpu
def test_weight_transpose_kernel_on_gpu():
    from moe_fp4.kernels.fp8 import transpose_fp8_weight_128x128, transpose_fp8_weight_128x128_ref

    q = torch.randint(0, 256, (4, 2048, 7168), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    got, ref = transpose_fp8_weight_128x128(q), transpose_fp8_weight_128x128_ref(q)
    assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_weight_validation():
    with pytest.raises(ValueError, match="multiples of 128"):
        quantize_fp8_weight(torch.randn(100, 128))
    with pytest.raises(TypeError, match="expected a bf16/fp16/fp32 tensor, got torch.float8_e4m3fn"):
        quantize_fp8_weight(torch.randn(128, 128).to(torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="scale shape"):
        FP8WeightTensor(torch.zeros(128, 256, dtype=torch.float8_e4m3fn), torch.ones(1, 1))
    with pytest.raises(TypeError, match="stack"):
        quantize_fp8_weight(torch.randn(128, 128))[0]


def test_colwise_from_high_precision_matches_mxfp4_column_kernel():
    """On MXFP4-representable values, quantizing the BF16 tensor column-wise and converting the MXFP4
    tensor column-wise are the same definition: the bits must agree."""
    torch.manual_seed(2)
    q = moe_fp4.quantize_mxfp4(torch.randn(256, 128) * torch.logspace(-2, 2, 128))
    a = quantize_fp8_colwise(q.dequantize(torch.float32))
    b = moe_fp4.mxfp4_to_fp8_colwise(q)
    assert a.data.shape == (128, 256)
    assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)) and torch.equal(a.scale, b.scale)


def test_fp8_mm_nt_emulation_and_validation():
    torch.manual_seed(3)
    a = moe_fp4.quantize_fp8(torch.randn(64, 256, dtype=torch.bfloat16))
    w = quantize_fp8_weight(torch.randn(128, 256, dtype=torch.bfloat16))
    b = moe_fp4.quantize_fp8(torch.randn(32, 256, dtype=torch.bfloat16))
    assert gemm_backend(torch.device("cpu")) is GemmBackend.EMULATED
    ref = a.dequantize(torch.float32) @ w.dequantize().t()
    assert torch.equal(fp8_mm_nt(a, w, torch.float32), ref)
    assert fp8_mm_nt(a, b).shape == (64, 32)
    assert fp8_mm_nt(a.rows(0, 0), w).shape == (0, 128)
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        fp8_mm_nt(a, quantize_fp8_weight(torch.randn(128, 128)))
    with pytest.raises(TypeError, match="expected FP8BlockTensor and FP8BlockTensor/FP8WeightTensor, got "
                                        "FP8BlockTensor and Tensor"):
        fp8_mm_nt(a, torch.zeros(4, 256))


def test_container_rows():
    torch.manual_seed(4)
    x = torch.randn(300, 256)
    f, q = moe_fp4.quantize_fp8(x), moe_fp4.quantize_mxfp4(x)
    fr, qr = f.rows(128, 256), q.rows(128, 256)
    assert torch.equal(fr.dequantize(torch.float32), f.dequantize(torch.float32)[128:256])
    assert torch.equal(qr.dequantize(torch.float32), q.dequantize(torch.float32)[128:256])
    assert fr.scale.stride() == (1, 128)


@pytest.mark.gpu
@pytest.mark.parametrize("b_kind", ["weight_128x128", "tokens_1x128"])
@pytest.mark.parametrize("m,n,k", [(256, 4096, 7168), (1024, 7168, 2048), (384, 2048, 1024)])
def test_scaled_mm_matches_emulation(b_kind, m, n, k):
    torch.manual_seed(5)
    dev = "cuda"
    assert gemm_backend(torch.device(dev)) is GemmBackend.SCALED_MM
    a = moe_fp4.quantize_fp8(torch.randn(m, k, dtype=torch.bfloat16, device=dev))
    if b_kind == "weight_128x128":
        b = quantize_fp8_weight(torch.randn(n, k, dtype=torch.bfloat16, device=dev))
        b_f32 = b.dequantize()
    else:
        b = moe_fp4.quantize_fp8(torch.randn(n, k, dtype=torch.bfloat16, device=dev))
        b_f32 = b.dequantize(torch.float32)
    got = fp8_mm_nt(a, b).float()
    ref = a.dequantize(torch.float32) @ b_f32.t()
    rel = ((got - ref).norm() / ref.norm()).item()
    assert rel < SCALED_MM_VS_EMULATION_MAX_REL, f"relative error {rel:.2e}"


@pytest.mark.gpu
def test_weight_kernel_on_gpu_matches_reference():
    from moe_fp4.kernels.fp8 import quantize_fp8_weight_128x128, quantize_fp8_weight_128x128_ref

    torch.manual_seed(8)
    w = (torch.randn(4, 512, 768) * torch.logspace(-20, 20, 768)).to(torch.bfloat16)
    w[1, 3, 5], w[2, 200, 300] = float("nan"), float("inf")
    ref = quantize_fp8_weight_128x128_ref(w, write_q=True, write_t=True)
    for asm in (None, False):   # the default (PTX rounding on sm_90+) and its pure-Triton twin
        got = quantize_fp8_weight_128x128(w.cuda(), write_q=True, write_t=True, asm=asm)
        for g, r in zip(got, ref):
            g = g.cpu()
            assert (torch.equal(g.view(torch.uint8), r.view(torch.uint8)) if g.dtype != torch.float32
                    else torch.equal(g, r))


@pytest.mark.parametrize("rows", [1, 128, 384])
def test_one_tile_scales_have_literal_m_major_strides(rows):
    """With one 1x128 tile per row, strides (1, 1) and (1, M) describe the same layout, but torch 2.11's
    scaled_mm checks (1, M) literally: every producer and rows() must give exactly that."""
    x = torch.randn(rows, 128).to(torch.bfloat16)
    for t in (moe_fp4.quantize_fp8(x), reference.quantize_fp8(x), moe_fp4.mxfp4_to_fp8(moe_fp4.quantize_mxfp4(x))):
        assert t.scale.stride() == (1, rows)
        assert t.rows(0, rows).scale.stride() == (1, rows)
    half = moe_fp4.quantize_fp8(torch.randn(2 * rows, 128).to(torch.bfloat16)).rows(rows, 2 * rows)
    assert half.scale.stride() == (1, rows)


# ---------------------------------------------------------------------------------------------
# W and W^T from one pass, once per weight version.

from moe_fp4.gemm.engines import FP8WeightCache, quantize_fp8_weight_pair  # noqa: E402


@pytest.mark.parametrize("shape", [(128, 256), (3, 256, 128), (2, 384, 384)])
def test_weight_pair_equals_the_two_separate_quantizations(shape):
    w = torch.randn(*shape) * torch.exp2(torch.randint(-8, 9, shape).float())
    w[..., 0, :7] = 0.0                                     # a partly zero block
    q, qt = quantize_fp8_weight_pair(w)
    for got, want in ((q, quantize_fp8_weight(w)), (qt, quantize_fp8_weight(w, transposed=True))):
        assert got.data.shape == want.data.shape and got.scale.shape == want.scale.shape
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)


def test_weight_cache_quantizes_once_per_version_and_again_after_a_change():
    # The cache holds W alone (1 byte a parameter and its block scales); get() adds W^T, W's codes and scales
    # transposed: bit for bit quantize_fp8_weight_pair's W^T, which quantizes W^T itself.
    cache = FP8WeightCache()
    w = torch.nn.Parameter(torch.randn(2, 128, 256))
    first = cache.weight(w)
    assert cache.weight(w) is first and (cache.hits, cache.misses) == (1, 1)   # micro-batches share it
    assert cache.nbytes == first.nbytes == 2 * 128 * 256 + 4 * 2 * 1 * 2
    with torch.no_grad():
        w.mul_(2.0)                                         # an optimizer step: in place, _version bumps
    second = cache.weight(w)
    assert second is not first and cache.misses == 2
    assert torch.equal(second.scale, first.scale * 2)        # powers of two: codes equal, scales doubled
    fresh = quantize_fp8_weight_pair(w)
    for got, want in zip(cache.get(w), fresh):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
    assert cache.get(w)[0] is second and cache.nbytes == second.nbytes   # W^T is made, not kept
    cache.enabled = False
    assert cache.weight(w) is not cache.weight(w)            # disabled: a new copy on every call
    del w, first, second, fresh
    import gc
    gc.collect()
    assert cache.nbytes == 0                                 # an entry dies with its weight


@pytest.mark.parametrize("kw", [dict(fused=True), dict(foreach=True), dict(foreach=False)], ids=str)
def test_weight_cache_drops_a_pair_after_any_optimizer_step(kw):
    """A fused AdamW step writes the weights without bumping _version (found on an H100: the experts then
    kept the first step's FP8 copies for the whole run); every torch.optim step drops the pairs of the
    parameters it stepped, so the next get() quantizes the new weights (DTensor parameters: next test)."""
    cache = FP8WeightCache()
    w = torch.nn.Parameter(torch.randn(2, 128, 256))
    other = torch.nn.Parameter(torch.randn(128, 128))       # cached, but not in this optimizer
    opt = torch.optim.AdamW([w], lr=0.1, **kw)
    first, kept = cache.weight(w), cache.weight(other)
    w.grad = torch.randn_like(w)
    version = w._version
    opt.step()
    if kw.get("fused"):
        assert w._version == version                        # why the version alone cannot be trusted
    second = cache.weight(w)
    assert second is not first and cache.misses == 3
    fresh = quantize_fp8_weight_pair(w)
    for got, want in zip(cache.get(w), fresh):
        assert torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8))
        assert torch.equal(got.scale, want.scale)
    assert cache.weight(other) is kept                       # a parameter the optimizer did not step


def test_weight_cache_sees_a_step_through_another_tensor():
    """FSDP2's pattern: the optimizer steps a sharded DTensor parameter, and the module reads an unsharded
    tensor refilled from it with its version counter preserved (same storage, same _version). The pair made
    before the step must not be reused after it, with torch's AdamW and with AdamWFP8Weights (which keeps
    the cache itself but never fuses a DTensor)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cache = FP8WeightCache()
        shard = torch.nn.Parameter(distribute_tensor(torch.randn(2, 128, 256), init_device_mesh("cpu", (1,)),
                                                     [Shard(0)]))
        unsharded = torch.empty(2, 128, 256)

        def all_gather():
            with torch.autograd._unsafe_preserve_version_counter(unsharded):
                unsharded.copy_(shard.detach().full_tensor())

        from moe_fp4.model.optim import AdamWFP8Weights

        for make in (torch.optim.AdamW, lambda ps, lr: AdamWFP8Weights(ps, lr=lr, cache=cache)):
            all_gather()
            first = cache.weight(unsharded)
            opt = make([shard], lr=0.1)
            shard.grad = distribute_tensor(torch.randn(2, 128, 256), shard.device_mesh, [Shard(0)])
            version, ptr = unsharded._version, unsharded.data_ptr()
            opt.step()
            all_gather()
            assert (unsharded._version, unsharded.data_ptr()) == (version, ptr)   # nothing the key could see
            second = cache.weight(unsharded)
            assert second is not first, make
            fresh = quantize_fp8_weight_pair(unsharded)
            assert torch.equal(second.data.view(torch.uint8), fresh[0].data.view(torch.uint8))
    finally:
        dist.destroy_process_group()


def test_experts_reuse_forward_weights_in_backward_and_across_micro_batches(monkeypatch, references):
    # fp8 only: fp4 takes the same weight path (the precisions differ in the activations). The cache's
    # bookkeeping, not the kernels: the pure-torch references (conftest's `references`) spare 4 steps of
    # interpreted conversions.
    precision = "fp8"
    from moe_fp4.gemm import engines as gemm
    from moe_fp4.model import experts

    cache = FP8WeightCache()
    monkeypatch.setattr(experts, "FP8_WEIGHTS", cache)
    torch.manual_seed(3)
    w13 = torch.nn.Parameter(torch.randn(2, 256, 128) * 128 ** -0.5)
    w2 = torch.nn.Parameter(torch.randn(2, 128, 128) * 128 ** -0.5)
    x = torch.randn(256, 128, dtype=torch.bfloat16, requires_grad=True)

    def step():
        w13.grad = w2.grad = x.grad = None
        y = experts.grouped_swiglu_experts(x, w13, w2, [128, 128], precision)
        y.float().square().sum().backward()
        return y.detach(), x.grad, w13.grad, w2.grad

    first = step()
    assert (cache.hits, cache.misses) == (0, 2)              # W13 and W2: one pass each, backward reuses
    second = step()                                          # the next micro-batch: no quantization
    assert (cache.hits, cache.misses) == (2, 2)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    cache.enabled = False                                    # the same numbers without the cache
    for a, b in zip(first, step()):
        assert torch.equal(a, b)
    cache.enabled = True
    with torch.no_grad():
        w2.add_(1e-2)                                        # an optimizer step changes W2 only
    step()
    assert (cache.hits, cache.misses) == (3, 3)
    assert gemm.FP8_WEIGHTS is not cache                     # the process's cache was left alone


def test_resident_fp8_weight_state_is_one_byte_a_parameter(monkeypatch, references):
    # After a step of an fp8 MoE layer (routed and shared experts) the cache holds W alone for each expert
    # weight: its codes (1 byte a parameter) and one float32 scale per 128x128 block; backward made W^T from
    # them and kept nothing, and the step's gradients are the ones the full (W, W^T) pairs give.
    from moe_fp4.model import experts
    from moe_fp4.model.moe import MoE, MoEConfig

    cache = FP8WeightCache()
    monkeypatch.setattr(experts, "FP8_WEIGHTS", cache)
    torch.manual_seed(5)
    layer = MoE(MoEConfig(hidden=256, ffn=128, num_experts=4, top_k=2, shared_ffn=128), "fp8")
    x = torch.randn(64, 256, dtype=torch.bfloat16)

    def step(**kw):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        layer(xi).float().square().sum().backward()
        return [xi.grad, layer.w13.grad, layer.w2.grad, layer.shared_w13.grad, layer.shared_w2.grad]

    got = step()
    weights = [layer.w13, layer.w2, layer.shared_w13, layer.shared_w2]
    params = sum(w.numel() for w in weights)
    assert cache.nbytes == params + 4 * params // (128 * 128)
    for w in weights:
        assert w in cache and cache.weight(w).data.shape == w.shape
    # The same step with each W^T quantized by the weight quantizer from W's exact values, transposed: the
    # gradients do not move (a transpose of the codes is that quantization).
    monkeypatch.setattr(experts, "_dgrad_weight", lambda w, wt: wt if wt is not None else quantize_fp8_weight(
        w.dequantize(torch.float32).transpose(-1, -2).contiguous()))
    for a, b in zip(got, step()):
        assert not a.isnan().any() and torch.equal(a, b)
