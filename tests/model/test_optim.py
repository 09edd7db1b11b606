"""AdamW fused with the FP8 weight quantization (kernels/adamw.py, moe_fp4.model.optim): the kernel equals its
pure-torch twin bit for bit under the interpreter, its FP8 pair equals quantize_fp8_weight_pair of the
updated weight, and the optimizer follows torch's AdamW (to float32 rounding) while keeping the cache."""

import math

import pytest
import torch

from moe_fp4.gemm.engines import FP8WeightCache, adamw_step_fp8_weight_pair, quantize_fp8_weight_pair
from moe_fp4.kernels.adamw import AdamWScalars, _div_rn, _sqrt_rn, adamw_fp8_weight_step, adamw_fp8_weight_step_ref
from moe_fp4.model.optim import AdamWFP8Weights

# The fused update and torch's AdamW round the same float32 formula differently in a few places (torch's
# single-tensor path lerps the first moment; its fused kernel multiplies in double): after a few steps
# they may differ by a few float32 ulps of the weight, never more than this relative to the weight's size.
ADAMW_REL_TOL = 2.0 ** -20


def _u8(t):
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _state(shape, dtype, state_dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = (torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 7, shape, generator=g).float())).to(dtype)
    grad = torch.randn(shape, generator=g).to(dtype)
    m = (torch.randn(shape, generator=g) * 0.1).to(state_dtype)
    v = (torch.rand(shape, generator=g) * 0.01).to(state_dtype)
    return p, grad, m, v


@pytest.mark.parametrize("dtype,state_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                               (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16)],
                         ids=str)
def test_kernel_equals_reference_bit_for_bit(dtype, state_dtype):
    p, g, m, v = _state((2, 128, 256), dtype, state_dtype)
    g[0, 5, :9] = float("nan")              # a NaN gradient: NaN weight, the block's codes 0x7F, finite amax
    g[1, 130 - 128, 3] = float("inf")
    p[1, 0, 128:] = 0.0
    c = AdamWScalars.at(7, 3e-3, 0.9, 0.95, 1e-8, 0.1)
    got_t, want_t = [t.clone() for t in (p, g, m, v)], [t.clone() for t in (p, g, m, v)]
    got = adamw_fp8_weight_step(*got_t, c)
    want = adamw_fp8_weight_step_ref(*want_t, c)
    for a, b in zip(got_t + list(got), want_t + list(want)):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(_u8(a), _u8(b)) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                               and torch.equal(a.nan_to_num(), b.nan_to_num()))
    assert not torch.equal(got_t[0], p)                                  # the weight moved


def test_kernel_maximize_empty_and_the_pair_of_the_new_weight():
    p, g, m, v = _state((1, 256, 128), torch.float32, torch.float32, seed=1)
    m.zero_()
    v.zero_()
    c = AdamWScalars.at(1, 1e-2, 0.9, 0.999, 1e-8, 0.0, maximize=True)
    a, b = [t.clone() for t in (p, g, m, v)], [t.clone() for t in (p, g, m, v)]
    q, qt, s = adamw_fp8_weight_step(*a, c)
    adamw_fp8_weight_step_ref(*b, c)
    assert torch.equal(a[0], b[0])
    # Step 1 from zero moments, no decay: Adam's first step is lr * g / (|g| + eps), here up the gradient
    # (atol: the float32 rounding of p, |p| < 2^9)
    torch.testing.assert_close(a[0] - p, 1e-2 * g / (g.abs() + 1e-8), rtol=0, atol=1e-4)
    pair = quantize_fp8_weight_pair(a[0][0])
    assert torch.equal(_u8(q[0]), _u8(pair[0].data)) and torch.equal(_u8(qt[0]), _u8(pair[1].data))
    assert torch.equal(s[0], pair[0].scale)
    empty = [torch.empty(0, 128, 128) for _ in range(4)]
    q, qt, s = adamw_fp8_weight_step(*empty, c)
    assert q.shape == (0, 128, 128) and qt.shape == (0, 128, 128) and s.shape == (0, 1, 1)


def test_scalars_and_inputs_are_checked_before_any_work():
    with pytest.raises(ValueError, match="step counts from 1"):
        AdamWScalars.at(0, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    with pytest.raises(ValueError, match="beta2"):
        AdamWScalars.at(1, 1e-3, 0.9, 1.0, 1e-8, 0.1)
    with pytest.raises(ValueError, match="lr"):
        AdamWScalars.at(1, float("nan"), 0.9, 0.95, 1e-8, 0.1)
    c = AdamWScalars.at(2, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    p, g, m, v = _state((1, 128, 128), torch.float32, torch.float32)
    with pytest.raises(ValueError, match="multiples of 128"):
        adamw_fp8_weight_step(*[t[:, :100].contiguous() for t in (p, g, m, v)], c)
    with pytest.raises(ValueError, match="exp_avg is"):
        adamw_fp8_weight_step(p, g, m[:, :, :64].contiguous(), v, c)
    with pytest.raises(ValueError, match="chunk"):
        adamw_fp8_weight_step(p, g, m, v, c, chunk=48)
    with pytest.raises(TypeError, match="p must be"):
        adamw_fp8_weight_step(p.double(), g, m, v, c)
    with pytest.raises(ValueError, match="contiguous"):
        adamw_step_fp8_weight_pair(p[0].t(), g[0].t(), m[0].t(), v[0].t(), c)
    with pytest.raises(ValueError, match="grad must have"):
        adamw_step_fp8_weight_pair(p[0], g[0, :, :64], m[0], v[0], c)
    before = p.clone()
    with pytest.raises(ValueError, match=r"exp_avg_sq must have p's shape \(1, 128, 128\), got \(1, 64, 128\)"):
        adamw_step_fp8_weight_pair(p, g, m, v[:, :64], c)
    assert torch.equal(p, before)                                          # nothing written


def test_gemm_pair_bumps_the_version_and_keeps_2d_shapes():
    p, g, m, v = _state((128, 256), torch.bfloat16, torch.float32, seed=2)
    version = p._version
    w, wt = adamw_step_fp8_weight_pair(p, g, m, v, AdamWScalars.at(3, 1e-3, 0.9, 0.95, 1e-8, 0.1))
    assert p._version > version                     # a cache keyed on _version sees the change
    want, want_t = quantize_fp8_weight_pair(p)
    assert w.data.shape == (128, 256) and wt.data.shape == (256, 128)
    assert torch.equal(_u8(w.data), _u8(want.data)) and torch.equal(_u8(wt.data), _u8(want_t.data))
    assert torch.equal(w.scale, want.scale) and torch.equal(wt.scale, want_t.scale)


def _close(a, b):
    scale = a.abs().amax().clamp_min(1e-30)
    return ((a - b).abs().amax() / scale).item() <= ADAMW_REL_TOL


@pytest.mark.parametrize("kw", [dict(), dict(foreach=True), dict(fused=True), dict(weight_decay=0.0, maximize=True)],
                         ids=str)
def test_optimizer_follows_torch_adamw_and_keeps_the_cache(kw):
    cache = FP8WeightCache()
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.randn(2, 128, 256))          # read by the "FP8 GEMMs": cached
    b = torch.nn.Parameter(torch.randn(384))                   # a bias: torch's step
    w_ref, b_ref = (torch.nn.Parameter(t.detach().clone()) for t in (w, b))
    hp = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    hp.update(kw)
    opt = AdamWFP8Weights([w, b], cache=cache, **hp)
    ref = torch.optim.AdamW([w_ref, b_ref], **hp)
    calls = []
    opt.register_step_post_hook(lambda *a: calls.append(1))
    for step in range(3):
        first = cache.weight(w)
        assert cache.misses == 1 and cache.hits == 2 * step    # quantized once, in the first forward
        for p_, q_ in ((w, w_ref), (b, b_ref)):
            p_.grad = q_.grad = torch.randn_like(p_) * (step + 1)
        opt.step()
        ref.step()
        assert opt.last_step_fp8_params == 1 and len(calls) == step + 1
        assert _close(w.detach(), w_ref.detach()) and torch.equal(b, b_ref)
        for key in ("exp_avg", "exp_avg_sq"):
            assert _close(opt.state[w][key], ref.state[w_ref][key])
        assert opt.state[w]["step"].item() == step + 1
        pair = cache.get(w)                                    # the optimizer's W, no new quantization
        assert pair[0] is not first and cache.misses == 1
        fresh = quantize_fp8_weight_pair(w)
        for got, want in zip(pair, fresh):
            assert torch.equal(_u8(got.data), _u8(want.data)) and torch.equal(got.scale, want.scale)
    # torch's AdamW takes the state over (same keys)
    back = torch.optim.AdamW([w_ref, b_ref], **hp)
    back.load_state_dict(opt.state_dict())
    assert back.state_dict()["state"][0]["step"].item() == 3


def test_optimizer_without_a_cached_pair_is_torch_adamw_and_drops_stale_pairs():
    cache = FP8WeightCache()
    w = torch.nn.Parameter(torch.randn(128, 128))
    w_ref = torch.nn.Parameter(w.detach().clone())
    opt = AdamWFP8Weights([w], lr=1e-2, cache=cache)
    ref = torch.optim.AdamW([w_ref], lr=1e-2)
    for p_ in (w, w_ref):
        p_.grad = torch.ones_like(p_)
    opt.step()                                                 # not read by an FP8 GEMM yet: torch's step
    ref.step()
    assert opt.last_step_fp8_params == 0 and torch.equal(w, w_ref)
    cache.get(w)
    w.grad = torch.ones_like(w).t().contiguous().t()           # a non-contiguous gradient: torch's step
    opt.step()
    assert opt.last_step_fp8_params == 0 and w not in cache    # the stale pair is gone
    cache.get(w)
    cache.enabled = False
    w.grad = torch.ones_like(w)
    opt.step()                                                 # still cached from before, fused
    assert opt.last_step_fp8_params == 1 and w not in cache    # a disabled cache keeps no new pair
    w.grad = None
    cache.enabled = True
    q = cache.weight(w)
    opt.step()                                                 # no gradient: w and its copy stay as they are
    assert opt.last_step_fp8_params == 0 and cache.weight(w) is q


def test_optimizer_rejects_what_it_does_not_fuse():
    # Python's own message (no amsgrad parameter): the optimizer takes AdamW's fused arguments only
    with pytest.raises(TypeError, match="unexpected keyword argument 'amsgrad'"):
        AdamWFP8Weights([torch.nn.Parameter(torch.randn(128, 128))], amsgrad=True)
    with pytest.raises(TypeError, match="FP8WeightCache"):
        AdamWFP8Weights([torch.nn.Parameter(torch.randn(128, 128))], cache={})
    opt = AdamWFP8Weights([torch.nn.Parameter(torch.randn(128, 128))], fused=None)
    assert opt._step_supports_amp_scaling is False
    assert math.isclose(opt.param_groups[0]["lr"], 1e-3)


# On a GPU the compiler may contract a multiply-add of the update into one FMA (one rounding instead of
# two), so the moments and the weight may differ from the reference by an ulp or two of the terms that
# formed them: |got - want| <= ADAMW_GPU_ULPS * eps32 * (sum of the terms' magnitudes), plus one ulp of
# the stored dtype where that rounding flips (bf16 weights).
ADAMW_GPU_ULPS = 2


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gpu_kernel_matches_the_reference_and_quantizes_its_own_weight(dtype):
    p, g, m, v = (t.cuda() for t in _state((4, 512, 1024), dtype, torch.float32, seed=5))
    c = AdamWScalars.at(10, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    got = [t.clone() for t in (p, g, m, v)]
    twin = [t.clone() for t in (p, g, m, v)]
    want = [t.clone() for t in (p, g, m, v)]
    pair = adamw_fp8_weight_step(*got, c)
    pair_twin = adamw_fp8_weight_step(*twin, c, asm=False, num_warps=8, chunk=16)
    adamw_fp8_weight_step_ref(*want, c)
    for a, b in zip(got + list(pair), twin + list(pair_twin)):     # PTX rounding == its twin, any tiling
        assert torch.equal(_u8(a), _u8(b))
    eps = torch.finfo(torch.float32).eps
    gf, m0, v0, p0 = g.float(), m.float(), v.float(), p.float()
    m_bound = ADAMW_GPU_ULPS * eps * (m0.abs() * c.beta1 + gf.abs() * c.one_minus_beta1)
    v_bound = ADAMW_GPU_ULPS * eps * (v0 * c.beta2 + gf * gf * c.one_minus_beta2)
    assert ((got[2] - want[2]).abs() <= m_bound).all()
    assert ((got[3] - want[3]).abs() <= v_bound).all()
    # The weight from the kernel's own moments (the update divides by sqrt(v): an ulp of v where the
    # moments are tiny moves it by far more than an ulp, and that is the moments' error, bounded above)
    f = lambda x: torch.tensor(x, dtype=torch.float32, device=p.device)   # noqa: E731
    decayed = p0 * f(c.decay)
    update = _div_rn(f(c.step_size) * got[2], _div_rn(_sqrt_rn(got[3]), f(c.bc2_sqrt)) + f(c.eps))
    p_want = decayed - update
    p_bound = ADAMW_GPU_ULPS * eps * (decayed.abs() + update.abs())
    if dtype != torch.float32:
        p_bound = p_bound + torch.finfo(dtype).eps * p_want.abs()
    assert ((got[0].float() - p_want).abs() <= p_bound).all()
    w, wt = quantize_fp8_weight_pair(got[0])                           # the pair is of the stored new weight
    assert torch.equal(_u8(pair[0]), _u8(w.data)) and torch.equal(_u8(pair[1]), _u8(wt.data))
    assert torch.equal(pair[2], w.scale)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp8", "fp4"])
def test_gpu_experts_train_on_the_optimizer_pairs(monkeypatch, precision):
    """The experts' forward and backward find the pairs the optimizer wrote (no quantization after the
    first forward), and each equals quantize_fp8_weight_pair of the weight as it now is."""
    from moe_fp4.model import experts

    cache = FP8WeightCache()
    monkeypatch.setattr(experts, "FP8_WEIGHTS", cache)
    torch.manual_seed(0)
    w13 = torch.nn.Parameter(torch.randn(4, 512, 256, device="cuda") * 256 ** -0.5)
    w2 = torch.nn.Parameter(torch.randn(4, 256, 256, device="cuda") * 256 ** -0.5)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    opt = AdamWFP8Weights([w13, w2], lr=1e-3, fused=True, cache=cache)
    for step in range(3):
        y = experts.grouped_swiglu_experts(x, w13, w2, [128] * 4, precision)
        y.float().pow(2).mean().backward()
        assert cache.misses == 2                               # the first forward's two quantizations only
        opt.step()
        opt.zero_grad()
        assert opt.last_step_fp8_params == 2
        for w in (w13, w2):
            got, want = cache.get(w), quantize_fp8_weight_pair(w)
            for a, b in zip(got, want):
                assert torch.equal(_u8(a.data), _u8(b.data)) and torch.equal(a.scale, b.scale)
    assert cache.misses == 2


def test_kernel_without_the_transpose_writes_the_same_weight_codes():
    # write_t=False (what AdamWFP8Weights runs: the cache holds W alone): the same update, codes and scales as the
    # pair step, no W^T; kernel and twin alike.
    p, g, m, v = _state((2, 128, 256), torch.bfloat16, torch.float32, seed=3)
    c = AdamWScalars.at(3, 1e-3, 0.9, 0.95, 1e-8, 0.1)
    for step in (adamw_fp8_weight_step, adamw_fp8_weight_step_ref):
        pair_state, w_state = [t.clone() for t in (p, g, m, v)], [t.clone() for t in (p, g, m, v)]
        q, qt, s = step(*pair_state, c)
        q1, qt1, s1 = step(*w_state, c, write_t=False)
        assert qt is not None and qt1 is None
        assert torch.equal(_u8(q), _u8(q1)) and torch.equal(s, s1)
        for a, b in zip(pair_state, w_state):
            assert torch.equal(_u8(a), _u8(b))
        # out=: W written into the caller's tensors (a pinned copy), returned as they are
        out_state = [t.clone() for t in (p, g, m, v)]
        out = (torch.full_like(q, float("nan")), torch.zeros_like(s))
        q2, _, s2 = step(*out_state, c, write_t=False, out=out)
        assert q2 is out[0] and s2 is out[1] and torch.equal(_u8(q2), _u8(q)) and torch.equal(s2, s)
        with pytest.raises(ValueError, match="out must be"):
            step(*[t.clone() for t in (p, g, m, v)], c, write_t=False, out=(out[0][:1], out[1]))
