"""The saved-tensor hook (moe_fp4.saved.hook) on small plain-torch functions and modules: one test per
documented rule. Compressed tensors must come back as exactly dequantize(quantize(x)); passed-through
tensors bit-exact; stats counted exactly."""

from __future__ import annotations

import dataclasses
import threading
import warnings

import pytest
import torch
from helpers import in_band, lowest, same_bits, sqnr_db
from optional_stacks import import_or_skip
from torch import nn

import moe_fp4
from moe_fp4.saved import hook as H
from moe_fp4.saved import packing as P
from moe_fp4.saved import policy as Pol
from moe_fp4.saved.hook import (
    CompressionConfig,
    SkipReason,
    compress_saved_activations,
    register_activation_compression,
)


def mx_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """dequantize(quantize(x)) in x's dtype and shape, padding the last dim to 32 like the hook."""
    k = x.shape[-1]
    rows = x.detach().reshape(-1, k)
    pad = -k % 32
    rows = torch.nn.functional.pad(rows, (0, pad)) if pad else rows.contiguous()
    y = moe_fp4.dequantize_mxfp4(moe_fp4.quantize_mxfp4(rows), x.dtype)
    return y[:, :k].reshape(x.shape)


class Probe(torch.autograd.Function):
    """y = x * 1 that saves (x, *extra) and records what backward unpacks; grad_x = grad * saved x."""

    seen: list = []

    @staticmethod
    def forward(ctx, x, *extra):
        ctx.save_for_backward(x, *extra)
        return x * 1

    @staticmethod
    def backward(ctx, g):
        saved = ctx.saved_tensors
        Probe.seen.append(saved)
        return (g * saved[0],) + (None,) * (len(saved) - 1)


@pytest.fixture(autouse=True)
def _clear_probe():
    Probe.seen = []
    yield
    Probe.seen = []
    assert H.current_compression() is None
    assert P._stack() == []


def act(shape, dtype=torch.float32, seed=0):
    """A non-leaf activation (requires grad through a leaf), the kind the hook compresses."""
    g = torch.Generator().manual_seed(seed)
    leaf = torch.randn(shape, generator=g).to(dtype).requires_grad_()
    return leaf, leaf * 1


# ---------------------------------------------------------------- config


def test_config_validation():
    c = CompressionConfig()
    assert c.modules is None and c.min_numel == 4096 and c.compress_fp8 and not c.check_finite
    with pytest.raises(dataclasses.FrozenInstanceError, match="cannot assign to field 'min_numel'"):
        c.min_numel = 1
    assert CompressionConfig(modules=["*.experts"]).modules == ("*.experts",)
    with pytest.raises(TypeError, match="tuple of fnmatch patterns"):
        CompressionConfig(modules="*.experts")
    with pytest.raises(ValueError, match="non-empty tuple"):
        CompressionConfig(modules=())
    with pytest.raises(TypeError, match="callable"):
        CompressionConfig(modules=3)
    with pytest.raises(TypeError, match="keep_modules"):
        CompressionConfig(keep_modules="*.act_fn")
    with pytest.raises(ValueError, match="min_numel: must be >= 1"):
        CompressionConfig(min_numel=0)
    with pytest.raises(TypeError, match="min_numel: expected an int"):
        CompressionConfig(min_numel=4.0)
    with pytest.raises(TypeError, match="compress_fp8: expected a bool"):
        CompressionConfig(compress_fp8=1)
    with pytest.raises(TypeError, match="check_finite: expected a bool"):
        CompressionConfig(check_finite=None)
    with pytest.raises(TypeError, match="expected a CompressionConfig"):
        compress_saved_activations({"min_numel": 4})
    with pytest.raises(ValueError, match="keep_modules needs module names"):
        compress_saved_activations(CompressionConfig(keep_modules=("a",)))


# ---------------------------------------------------------------- what is compressed, exactly


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_compressed_values_are_exact_roundtrip(dtype):
    leaf, x = act((64, 128), dtype)
    cm = compress_saved_activations()
    with cm:
        y = Probe.apply(x)
    y.backward(torch.ones_like(y))
    (saved,) = Probe.seen[0]
    ref = mx_roundtrip(x)
    assert saved.dtype == dtype and saved.shape == x.shape and saved.device == x.device
    assert same_bits(saved, ref)
    assert same_bits(leaf.grad, ref)
    assert not same_bits(saved, x.detach())
    q = moe_fp4.quantize_mxfp4(x.detach())
    s = cm.stats
    assert (s.seen, s.compressed, s.shared, s.skipped) == (1, 1, 0, {})
    assert s.bytes_before == x.numel() * x.element_size() and s.bytes_after == q.nbytes
    assert s.ratio == q.nbytes / (x.numel() * x.element_size())


def _pass(t):
    """Run Probe saving t next to a grad-requiring leaf (passed through); return (unpacked t, stats)."""
    x = torch.randn(4, 4, requires_grad=True)
    cm = compress_saved_activations()
    with cm:
        y = Probe.apply(x, t)
    y.sum().backward()
    return Probe.seen[-1][1], cm.stats


class MyTensor(torch.Tensor):
    pass


def test_skip_reasons_pass_through_untouched():
    big = torch.randn(64, 128)
    w = nn.Parameter(torch.randn(64, 128))
    cases = [
        (w, SkipReason.PARAMETER),
        (w[1:], SkipReason.PARAMETER),
        (torch.randn(64, 128, requires_grad=True), SkipReason.LEAF),
        (big.as_subclass(MyTensor), SkipReason.SUBCLASS),
        (torch.randint(0, 9, (64, 128)), SkipReason.NON_FLOAT),
        (torch.ones(64, 128, dtype=torch.bool), SkipReason.NON_FLOAT),
        (big.to(torch.float8_e4m3fn), SkipReason.FLOAT8),
        (big.double(), SkipReason.DTYPE),
        (torch.zeros(0, 128), SkipReason.EMPTY),
        (torch.tensor(3.0), SkipReason.SCALAR),
        (torch.randn(64, 63), SkipReason.SMALL),
        (torch.randn(8192, 1), SkipReason.NO_SAVING),
        (torch.randn(1024, 8, dtype=torch.bfloat16), SkipReason.NO_SAVING),
    ]
    for t, reason in cases:
        out, s = _pass(t)
        want = {"leaf": 2} if reason is SkipReason.LEAF else {"leaf": 1, reason.value: 1}
        assert (s.seen, s.compressed, s.skipped) == (2, 0, want), reason
        assert type(out) is type(t) or isinstance(t, nn.Parameter), reason
        assert out.dtype == t.dtype and out.shape == t.shape, reason
        assert out.untyped_storage().data_ptr() == t.untyped_storage().data_ptr(), reason
        params = reason in (SkipReason.PARAMETER, SkipReason.LEAF)
        assert s.bytes_skipped == (0 if params else t.numel() * t.element_size()), reason
    k16 = torch.randn(256, 16, dtype=torch.bfloat16)   # 4096 elements, the default min_numel: compressed
    out, s = _pass(k16)
    assert s.compressed == 1 and same_bits(out, mx_roundtrip(k16))


def test_skip_layout_and_device_at_pack_time():
    cm = compress_saved_activations()
    _, x = act((64, 128))
    with cm:
        Probe.apply(x, torch.randn(64, 128).to_sparse(), torch.empty(64, 128, device="meta"))
    assert cm.stats.skipped == {"layout": 1, "device": 1} and cm.stats.compressed == 1


def test_min_numel_boundary():
    for n, compressed in ((4095, False), (4096, True)):
        _, x = act((n,))
        cm = compress_saved_activations()
        with cm:
            Probe.apply(x)
        assert cm.stats.compressed == int(compressed), n
    _, x = act((4, 32))
    cm = compress_saved_activations(CompressionConfig(min_numel=128))
    with cm:
        Probe.apply(x)
    assert cm.stats.compressed == 1


# ---------------------------------------------------------------- shapes


@pytest.mark.parametrize("shape,transpose", [((40, 96), True), ((5000,), False), ((3, 7, 96), False),
                                             ((8, 4, 160), True), ((2, 4096), False), ((33, 33), False)])
def test_shapes_views_padding_and_1d(shape, transpose):
    leaf, x = act(shape, torch.bfloat16)
    if transpose:
        x = x.transpose(0, 1)
        assert not x.is_contiguous()
    cm = compress_saved_activations(CompressionConfig(min_numel=1))
    with cm:
        y = Probe.apply(x)
    y.backward(torch.ones_like(y))
    (saved,) = Probe.seen[0]
    assert saved.shape == x.shape and saved.dtype == x.dtype and saved.is_contiguous()
    assert same_bits(saved, mx_roundtrip(x.contiguous()))
    kp = -(-x.shape[-1] // 32) * 32
    assert cm.stats.bytes_after == (x.numel() // x.shape[-1]) * kp * 17 // 32


# ---------------------------------------------------------------- dedupe and sharing


def test_same_storage_compressed_once_and_unpacked_shared():
    _, x = act((64, 128))
    cm = compress_saved_activations()
    with cm:
        y = x * x
    s = cm.stats
    assert (s.seen, s.compressed, s.shared) == (2, 1, 1)
    assert s.bytes_after == moe_fp4.quantize_mxfp4(x.detach()).nbytes
    a = y.grad_fn._saved_self
    b = y.grad_fn._saved_other
    assert a.data_ptr() == b.data_ptr() and same_bits(a, mx_roundtrip(x))
    del a, b
    c = y.grad_fn._saved_self
    assert same_bits(c, mx_roundtrip(x))


def test_dedupe_respects_version_view_and_entry():
    _, x = act((64, 128))
    cm = compress_saved_activations()
    with cm:
        keep = [Probe.apply(x, x), Probe.apply(x, x[:32])]
        with torch.no_grad():
            x.mul_(2)
        keep.append(Probe.apply(x))
    assert (cm.stats.compressed, cm.stats.shared) == (3, 2)
    with cm:
        keep.append(Probe.apply(x))
    assert (cm.stats.compressed, cm.stats.shared) == (4, 2)
    with cm:
        Probe.apply(x)
        Probe.apply(x)
    assert (cm.stats.compressed, cm.stats.shared) == (6, 2), "a copy whose graph is gone is not reused"


def test_dedupe_never_confuses_reused_addresses():
    _, x = act((64, 128))
    cm = compress_saved_activations()
    outs = []
    with cm:
        for i in range(6):
            h = x + i
            outs.append((Probe.apply(h), mx_roundtrip(h)))
            del h
    assert cm.stats.compressed == 6
    for y, ref in outs:
        y.sum().backward(retain_graph=True)
        assert same_bits(Probe.seen[-1][0], ref)


# ---------------------------------------------------------------- aliasing and in-place changes


def test_inplace_after_save_uses_pack_time_values():
    leaf, x = act((64, 128))
    ref = mx_roundtrip(x)
    with compress_saved_activations():
        y = Probe.apply(x)
    with torch.no_grad():
        x.add_(100.0)
    y.backward(torch.ones_like(y))
    assert same_bits(leaf.grad, ref)


def test_inplace_after_save_of_passthrough_raises_like_torch():
    def run(use_hook):
        _, x = act((8, 8))
        ctx = compress_saved_activations() if use_hook else torch.autograd.graph.saved_tensors_hooks(
            lambda t: t, lambda t: t)
        with ctx if use_hook else torch.enable_grad():
            y = (x * x).sum()
        with torch.no_grad():
            x.add_(1.0)
        y.backward()

    for use_hook in (False, True):
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            run(use_hook)


def test_unpack_is_pure_and_repeatable():
    lin = nn.Linear(128, 128)
    _, x = act((64, 128))
    with compress_saved_activations():
        y = torch.nn.functional.gelu(lin(x)).pow(2).sum()
    g1 = torch.autograd.grad(y, (x, lin.weight), retain_graph=True)
    g2 = torch.autograd.grad(y, (x, lin.weight), retain_graph=True)
    g3 = torch.autograd.grad(y, (x, lin.weight))
    for a, b, c in zip(g1, g2, g3):
        assert same_bits(a, b) and same_bits(a, c)


# ---------------------------------------------------------------- NaN / Inf


def test_nonfinite_poisons_its_block_by_default():
    _, x = act((64, 128))
    with torch.no_grad():
        x[3, 40] = float("inf")
    with compress_saved_activations():
        y = Probe.apply(x)
    y.sum().backward()
    (saved,) = Probe.seen[0]
    nan = torch.isnan(saved)
    assert nan[3, 32:64].all() and nan.sum() == 32
    finite = ~nan
    assert same_bits(saved[finite], mx_roundtrip(x)[finite])


def test_check_finite_stores_nonfinite_tensors_exactly():
    _, x = act((64, 128))
    with torch.no_grad():
        x[3, 40] = float("nan")
    cm = compress_saved_activations(CompressionConfig(check_finite=True))
    _, ok = act((64, 128), seed=1)
    with cm:
        y = Probe.apply(x) + Probe.apply(ok)
    y.sum().backward()
    assert cm.stats.skipped == {"non_finite": 1} and cm.stats.compressed == 1
    saved = [s[0] for s in Probe.seen]
    assert any(same_bits(s, x.detach()) for s in saved)


# ---------------------------------------------------------------- double backward


def test_create_graph_double_backward_uses_dequantized_values():
    leaf_a, a = act((64, 128), seed=0)
    leaf_b, b = act((64, 128), seed=1)
    with compress_saved_activations():
        y = (a * b).sum()
    (ga,) = torch.autograd.grad(y, leaf_a, create_graph=True)
    assert ga.requires_grad and same_bits(ga, mx_roundtrip(b))
    (gb,) = torch.autograd.grad(ga.pow(2).sum(), leaf_b)
    assert same_bits(gb, 2 * mx_roundtrip(b))


# ---------------------------------------------------------------- activation checkpointing


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.SiLU(), nn.Linear(256, 128))


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_around_compresses_only_the_inputs(reentrant):
    """Context around checkpoint(): only the checkpoint's own saved inputs are seen (both variants save
    them); backward recomputes the function from their dequantized values."""
    f = _mlp()
    leaf, h = act((64, 128))
    gy = torch.randn(64, 128, generator=torch.Generator().manual_seed(7))
    cm = compress_saved_activations()
    with cm:
        y = torch.utils.checkpoint.checkpoint(f, h, use_reentrant=reentrant)
    assert (cm.stats.seen, cm.stats.compressed) == (1, 1)
    y.backward(gy)
    got = [leaf.grad] + [p.grad for p in f.parameters()]

    f2 = _mlp()
    hq = mx_roundtrip(h).requires_grad_()
    f2(hq).backward(gy)
    for a, b in zip(got, [hq.grad] + [p.grad for p in f2.parameters()]):
        assert same_bits(a, b)


@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpoint_with_scope_inside(reentrant):
    """Scope entered inside the checkpointed function: it is innermost, so the function's saves are
    compressed. Non-reentrant: in forward, and nothing is recomputed; reentrant: the forward runs without
    grad and the saves are compressed during the recomputation, where the function's input is a detached
    leaf (passed through). Gradients equal the hook without checkpointing, bit for bit."""
    gy = torch.randn(64, 128, generator=torch.Generator().manual_seed(7))

    def run(ckpt):
        f = _mlp()
        leaf, h = act((64, 128))
        cm = compress_saved_activations()

        def g(inp):
            with cm:
                return f(inp)

        if ckpt:
            y = torch.utils.checkpoint.checkpoint(g, h, use_reentrant=reentrant)
            fwd = cm.stats.compressed
            y.backward(gy)
            return [leaf.grad] + [p.grad for p in f.parameters()], fwd, cm.stats
        hd = h.detach().requires_grad_() if reentrant else h
        g(hd).backward(gy)
        return [hd.grad if reentrant else leaf.grad] + [p.grad for p in f.parameters()], None, cm.stats

    ref, _, ref_stats = run(False)
    got, fwd, stats = run(True)
    assert fwd == (0 if reentrant else 3)
    assert stats == ref_stats
    want = (2, {"parameter": 2, "leaf": 1}) if reentrant else (3, {"parameter": 2})
    assert (stats.compressed, stats.skipped) == want
    for a, b in zip(got, ref):
        assert same_bits(a, b)


@pytest.mark.parametrize("early_stop", [True, False])
def test_checkpoint_recomputation_of_a_scoped_part(early_stop):
    """Non-reentrant checkpoint over [a part saved by the checkpoint, then a scope]: the scope's saves are
    compressed in forward. If the recomputation reaches the scope again (early stop off), it compresses and
    counts them again; gradients are identical either way."""
    torch.manual_seed(0)
    lin0, f = nn.Linear(128, 128), _mlp()
    params = list(lin0.parameters()) + list(f.parameters())
    x = torch.randn(64, 128, requires_grad=True)
    gy = torch.randn(64, 128)

    def run(ckpt):
        cm = compress_saved_activations()

        def g(h):
            a = torch.tanh(lin0(h))
            with cm:
                return f(a) * a

        for p in params + [x]:
            p.grad = None
        with torch.utils.checkpoint.set_checkpoint_early_stop(early_stop):
            y = torch.utils.checkpoint.checkpoint(g, x, use_reentrant=False) if ckpt else g(x)
            seen_fwd = cm.stats.seen
            y.backward(gy)
        return [x.grad.clone()] + [p.grad.clone() for p in params], seen_fwd, cm.stats

    ref, _, ref_stats = run(False)
    got, seen_fwd, stats = run(True)
    assert seen_fwd == ref_stats.seen == 7
    assert stats.seen == (7 if early_stop else 14) and stats.compressed == (4 if early_stop else 8)
    for a, b in zip(got, ref):
        assert same_bits(a, b)


# ---------------------------------------------------------------- dtype / device


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_module_grads_with_hook_close_and_dtype_kept(dtype):
    torch.manual_seed(0)
    lin = nn.Linear(128, 128).to(dtype)
    _, x = act((64, 128), dtype)
    with compress_saved_activations():
        out = torch.nn.functional.silu(lin(x))
    (gw,) = torch.autograd.grad(out.float().pow(2).sum(), lin.weight)
    ref = torch.autograd.grad(torch.nn.functional.silu(lin(x)).float().pow(2).sum(), lin.weight)[0]
    assert gw.dtype == dtype
    # measured 19.18-19.21 dB over the three dtypes (CPU); ceiling 1.1 dB over: a finer format than MXFP4
    # (or none) measures above it
    in_band(sqnr_db(ref.float(), gw.float(), "weight gradient"), 12, 20.3, str(dtype))


# ---------------------------------------------------------------- module selection


class Experts3D(nn.Module):
    def __init__(self, e=4, h=64, f=128):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(e, 2 * f, h) * 0.05)
        self.down_proj = nn.Parameter(torch.randn(e, h, f) * 0.05)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        out = 0
        for e in range(self.gate_up_proj.shape[0]):
            g, u = torch.nn.functional.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
            out = out + torch.nn.functional.linear(self.act_fn(g) * u, self.down_proj[e])
        return out


class MLP(nn.Module):
    def __init__(self, h=64, f=128):
        super().__init__()
        self.up = nn.Linear(h, f)
        self.down = nn.Linear(f, h)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Block(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.attn = nn.Linear(64, 64)
        self.conv = nn.Conv1d(64, 64, 3, padding=1)
        self.experts = Experts3D() if kind == "3d" else nn.ModuleList([MLP() for _ in range(2)])

    def forward(self, x):
        x = self.attn(x) + self.conv(x.t().unsqueeze(0))[0].t()
        if isinstance(self.experts, nn.ModuleList):
            return x + sum(e(x) for e in self.experts)
        return x + self.experts(x)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Block("3d"), Block("list")])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def toy_step(model, x, config=None, register=False):
    h = register_activation_compression(model, config) if register else None
    model.zero_grad(set_to_none=True)
    model(x).pow(2).mean().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return grads, h


def toy_input():
    return torch.randn(64, 64, generator=torch.Generator().manual_seed(3))


def test_default_selection_finds_experts_not_convs_nor_nested():
    torch.manual_seed(0)
    m = Toy()
    names = [n for n, _ in H.select_modules(m, CompressionConfig())]
    assert names == ["layers.0.experts", "layers.1.experts.0", "layers.1.experts.1"]
    assert not H.is_expert_module("conv", m.layers[0].conv)
    assert H.is_expert_module("x.experts", m.layers[0].experts)
    assert [n for n, _ in H.select_modules(m, CompressionConfig(modules=("layers.*",)))] == ["layers.0", "layers.1"]
    assert [n for n, _ in H.select_modules(m, CompressionConfig(modules=lambda n, mod: isinstance(mod, MLP)))] == [
        "layers.1.experts.0", "layers.1.experts.1"]
    with pytest.raises(ValueError, match="no module of Toy matched"):
        register_activation_compression(m, CompressionConfig(modules=("nope",)))
    with pytest.raises(ValueError, match="no module of Linear matched"):
        register_activation_compression(nn.Linear(4, 4))
    with pytest.raises(TypeError, match="expected an nn.Module"):
        register_activation_compression(lambda x: x)


# The Toy model's tests of registration and bookkeeping run the pure-torch reference conversions (the
# `references` fixture, conftest.py): the kernels through the hook are checked by the tests above.

def test_register_stats_remove_and_restore(references):
    torch.manual_seed(0)
    m = Toy()
    x = toy_input()
    ref, _ = toy_step(m, x)
    cfg = CompressionConfig(min_numel=1024)
    got, h = toy_step(m, x, cfg, register=True)
    st = h.stats
    assert h.modules == ["layers.0.experts", "layers.1.experts.0", "layers.1.experts.1"]
    e3d, e0, e1 = (st.modules[n] for n in h.modules)
    # Experts3D, per expert: linear saves x (shared after the first expert) and a view of gate_up_proj
    # (parameter); silu saves g; mul saves silu(g) and u; linear saves its input and a view of down_proj
    assert (e3d.seen, e3d.compressed, e3d.shared, e3d.skipped) == (28, 17, 3, {"parameter": 8})
    for s in (e0, e1):
        assert (s.seen, s.compressed, s.shared, s.skipped) == (5, 2, 1, {"parameter": 2})
    tot = st.total
    assert tot.seen == sum(s.seen for s in st.modules.values())
    assert tot.bytes_after == sum(s.bytes_after for s in st.modules.values())
    assert tot.bytes_after / tot.bytes_before == pytest.approx(17 / 128)
    measured = {n: sqnr_db(ref[n], got[n], n) for n in ref}        # fails on NaN / Inf
    for n, v in measured.items():
        in_band(v, 10, what=n)                   # parameters the compressed activations do not reach: inf
    assert any(not torch.equal(ref[n], got[n]) for n in ref)
    # The most affected gradient carries MXFP4's error: measured 12.04 dB (CPU, seed 0; the others 15.2 to
    # inf); a hook that stored a finer format would lift it far over the ceiling.
    in_band(lowest(measured.values(), "parameter gradients"), 10, 13.1, "most affected parameter gradient")
    h.remove()
    h.remove()
    again, _ = toy_step(m, x)
    for n in ref:
        assert same_bits(ref[n], again[n]), n
    with register_activation_compression(m, cfg) as h2:
        toy_step(m, x)
        assert h2.stats.total.compressed == tot.compressed
    again, _ = toy_step(m, x)
    assert all(same_bits(ref[n], again[n]) for n in ref)
    assert h2.stats.total.compressed == tot.compressed
    h2.stats.reset()
    assert h2.stats.total.seen == 0


def test_scope_exits_when_forward_raises():
    class Boom(Experts3D):
        def forward(self, x):
            _ = x * 2
            assert H.current_compression() is not None
            raise RuntimeError("boom")

    m = nn.Sequential(nn.Linear(64, 64), Boom())
    h = register_activation_compression(m)
    with pytest.raises(RuntimeError, match="boom"):
        m(torch.randn(64, 64))
    assert H.current_compression() is None and P._stack() == []
    _, x = act((64, 128))
    before = h.stats.total.seen
    y = x * x
    assert h.stats.total.seen == before
    assert same_bits(y.grad_fn._saved_self, x.detach())
    h.remove()


def test_keep_modules_pause_compression(references):
    torch.manual_seed(0)
    m = Toy()
    x = toy_input()
    inside = []
    m.layers[0].experts.act_fn.register_forward_hook(lambda *a: inside.append(H.current_compression()))
    cfg = CompressionConfig(min_numel=1024, keep_modules=("*.experts.act_fn",))
    _, h = toy_step(m, x, cfg, register=True)
    assert h.kept == ["layers.0.experts.act_fn"]
    s = h.stats.modules["layers.0.experts"]
    assert s.skipped == {"parameter": 8, "kept": 4}
    assert inside == [None] * 4
    h.remove()
    with pytest.raises(ValueError, match="matches no submodule"):
        register_activation_compression(m, CompressionConfig(keep_modules=("*.nothing",)))
    with pytest.raises(ValueError, match="matches no submodule"):
        register_activation_compression(m, CompressionConfig(keep_modules=("layers.0.attn",)))


def test_pause_compression_context():
    _, x = act((64, 128))
    cm = compress_saved_activations()
    with cm:
        with H.pause_compression():
            assert H.current_compression() is None
            y = Probe.apply(x)
        assert H.current_compression() is not None
    y.sum().backward()
    assert cm.stats.skipped == {"kept": 1} and same_bits(Probe.seen[0][0], x.detach())


# ---------------------------------------------------------------- FP8 handshake


class FakeFP8Linear(torch.autograd.Function):
    """Follows the handshake of moe_fp4's own FP8 Functions: keeps its saved input as a ctx attribute, in
    MXFP4 (direct FP8 -> MXFP4) when a scope asks for it, else in FP8."""

    stored: list = []

    @staticmethod
    def forward(ctx, x, w):
        fp8 = moe_fp4.quantize_fp8(x.detach())
        scope = H.current_compression()
        if scope is not None and scope.config.compress_fp8:
            ctx.x = moe_fp4.quantize_mxfp4(fp8)
            scope.record_internal(fp8.nbytes, ctx.x.nbytes)
        else:
            ctx.x = fp8
        FakeFP8Linear.stored.append(ctx.x)
        ctx.save_for_backward(w)
        return x @ w.t()

    @staticmethod
    def backward(ctx, g):
        (w,) = ctx.saved_tensors
        x = ctx.x.dequantize(torch.float32)
        return g @ w, g.t() @ x


def test_fp8_handshake_counts_internal_and_follows_config():
    x = torch.randn(64, 128)
    w = nn.Parameter(torch.randn(32, 128))
    fp8 = moe_fp4.quantize_fp8(x)
    assert H.current_compression() is None
    FakeFP8Linear.stored = []
    FakeFP8Linear.apply(x, w)
    assert isinstance(FakeFP8Linear.stored[-1], moe_fp4.FP8BlockTensor)

    cm = compress_saved_activations()
    with cm:
        scope = H.current_compression()
        assert isinstance(scope, H.ActiveCompression) and scope.config is cm.config
        y = FakeFP8Linear.apply(x, w)
    q = FakeFP8Linear.stored[-1]
    assert isinstance(q, moe_fp4.MXFP4Tensor)
    assert same_bits(q.data, moe_fp4.quantize_mxfp4(fp8).data)
    s = cm.stats
    assert (s.internal, s.compressed, s.seen, s.skipped) == (1, 0, 1, {"parameter": 1})
    assert (s.bytes_before, s.bytes_after) == (fp8.nbytes, q.nbytes)
    y.sum().backward()
    assert same_bits(w.grad, torch.ones(64, 32).t() @ q.dequantize(torch.float32))

    with compress_saved_activations(CompressionConfig(compress_fp8=False)) as cm2:
        FakeFP8Linear.apply(x, w)
    assert isinstance(FakeFP8Linear.stored[-1], moe_fp4.FP8BlockTensor) and cm2.stats.internal == 0
    with pytest.raises(ValueError, match="non-negative int"):
        H.ActiveCompression(CompressionConfig(), H.CompressionStats()).record_internal(-1, 0)


def test_current_compression_is_thread_local_and_innermost():
    other = []
    a = compress_saved_activations(name="a")
    b = compress_saved_activations(name="b")
    with a:
        assert H.current_compression().name == "a"
        with b:
            assert H.current_compression().name == "b"
            t = threading.Thread(target=lambda: other.append(H.current_compression()))
            t.start()
            t.join()
        assert H.current_compression().name == "a"
    assert other == [None] and H.current_compression() is None


# ---------------------------------------------------------------- torch.compile


# torch.compile's first use imports torch internals that still call torch.jit.script_method, which
# torch 2.13 deprecates (14 warnings in the suite's summary): torch's own, from this test's use of
# torch.compile, so they are ignored here and nowhere else.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
def test_compiled_model_warns_once_and_stays_uncompressed_and_a_compiled_one_is_refused(monkeypatch):
    try:
        torch.compile(lambda t: t + 1)(torch.zeros(2))
    except Exception as e:  # pragma: no cover - depends on the machine's C++ toolchain
        pytest.skip(f"torch.compile is not usable here: {type(e).__name__}: {e}")
    monkeypatch.setattr(P, "_warned", set())
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 64), Experts3D())
    h = register_activation_compression(m, CompressionConfig(min_numel=1024))
    mc = torch.compile(m)
    x = toy_input()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        mc(x).sum().backward()
        mc(x).sum().backward()
    msgs = [str(i.message) for i in w if "eager-only" in str(i.message)]
    assert len(msgs) == 1
    assert h.stats.total.seen == 0
    h.remove()
    # Registered on a compiled model: refused, naming the experts' own storage.
    with pytest.raises(RuntimeError, match=r"eager-only.*experts' own storage"):
        register_activation_compression(mc, CompressionConfig(min_numel=1024))


# ---------------------------------------------------------------- tensor-subclass parameters


class WrappedWeight(torch.Tensor):
    """A wrapper tensor subclass with no storage of its own, as torchao's FP8 training weights
    (Float8TrainingWeightWrapperTensor), DTensor and FSDP2's sharded parameters are: its data lives in
    an inner tensor that ``__tensor_flatten__`` names, and every op runs on that."""

    @staticmethod
    def __new__(cls, inner):
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype, device=inner.device,
                                                   requires_grad=inner.requires_grad)

    def __init__(self, inner):
        self._inner = inner

    def __tensor_flatten__(self):
        return ["_inner"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return WrappedWeight(inner_tensors["_inner"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        from torch.utils._pytree import tree_map
        unwrap = lambda t: t._inner if isinstance(t, WrappedWeight) else t  # noqa: E731
        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))
        # Views of the weight (the per-expert slices) stay wrapped, as torchao keeps its wrapper.
        keep = func in (torch.ops.aten.select.int, torch.ops.aten.t.default, torch.ops.aten.detach.default,
                        torch.ops.aten.alias.default, torch.ops.aten.transpose.int)
        return WrappedWeight(out) if keep and isinstance(out, torch.Tensor) else out


# Gradient SQNR floor of the Experts3D model with compressed activations against the same model without
# the hook: measured 15.9 dB (gate_up_proj) and 17.2 dB (down_proj), CPU, seed 0; the floor is about 4 dB under,
# the ceiling about 1 dB over the higher (activations left uncompressed would measure inf).
WRAPPED_GRAD_SQNR_FLOOR_DB = 12.0
WRAPPED_GRAD_SQNR_CEILING_DB = 18.3


def test_wrapper_subclass_parameters_are_recognised_and_activations_compressed(references):
    # torchao 0.18's FP8 MoE training wraps expert weights in a storage-less tensor subclass; the hook
    # asked each parameter for its storage pointer and crashed in the first forward ("Attempted to access
    # the data pointer on an invalid python storage"). The parameters' storages are now those of the
    # tensors they flatten to: the weights pass through as parameters, the activations are compressed.
    torch.manual_seed(0)
    plain = Experts3D()
    wrapped = Experts3D()
    for name in ("gate_up_proj", "down_proj"):
        setattr(wrapped, name, nn.Parameter(WrappedWeight(getattr(plain, name).detach().clone())))
    x = toy_input()
    ref = torch.autograd.grad(plain(x).pow(2).mean(), list(plain.parameters()))
    h = register_activation_compression(wrapped)
    try:
        got = torch.autograd.grad(wrapped(x).pow(2).mean(), list(wrapped.parameters()))
        stats = h.stats.total
    finally:
        h.remove()
    assert stats.compressed > 0, stats
    assert stats.skipped.get(SkipReason.SUBCLASS.value, 0) + stats.skipped.get(SkipReason.PARAMETER.value, 0) > 0
    for r, g in zip(ref, got):
        g = g._inner if isinstance(g, WrappedWeight) else g
        in_band(sqnr_db(r.float(), g.float(), "wrapped weight gradient"), WRAPPED_GRAD_SQNR_FLOOR_DB,
                WRAPPED_GRAD_SQNR_CEILING_DB)
    # A parameter's storages are those of what it wraps; a plain parameter's, its own.
    assert Pol._storage_ptrs(wrapped.down_proj) == {wrapped.down_proj._inner.untyped_storage().data_ptr()}
    assert Pol._storage_ptrs(plain.down_proj) == {plain.down_proj.untyped_storage().data_ptr()}


def test_torchao_fp8_training_weights_have_their_inner_storage():
    # The same with torchao's own wrapper where torchao imports (not in CI's extras; its FP8 grouped GEMM
    # needs a GPU, so only the hook's side is checked here: bench/experts.py runs torchao + hook on a GPU).
    import_or_skip("torchao.prototype.moe_training.config", "torchao.quantization")
    from torchao.prototype.moe_training.config import Float8TrainingOpConfig
    from torchao.quantization import quantize_

    m = Experts3D()
    quantize_(m, Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: isinstance(mod, Experts3D))
    w = m.down_proj
    assert type(w) is not torch.Tensor and isinstance(w, nn.Parameter)
    names, _ = w.__tensor_flatten__()
    inner = {getattr(w, n).untyped_storage().data_ptr() for n in names}
    assert Pol._storage_ptrs(w) == inner
    assert Pol._skip_reason(w, CompressionConfig()) is SkipReason.PARAMETER


# ---------------------------------------------------------------- NVFP4 storage (issue 27)

@pytest.mark.parametrize("shape", [(64, 128), (3, 40), (7, 16)])
def test_nvfp4_storage_round_trip_and_bytes(shape):
    leaf, x = act(shape, torch.bfloat16)
    cm = compress_saved_activations(CompressionConfig(min_numel=1, storage="nvfp4"))
    with cm:
        y = Probe.apply(x)
    y.backward(torch.ones_like(y))
    (saved,) = Probe.seen[0]
    k = x.shape[-1]
    kp = -(-k // 16) * 16
    padded = torch.nn.functional.pad(x.detach().reshape(-1, k), (0, kp - k))
    ref = moe_fp4.quantize_nvfp4(padded).dequantize(x.dtype)[:, :k].reshape(x.shape)
    assert saved.shape == x.shape and saved.dtype == x.dtype
    assert same_bits(saved, ref) and same_bits(leaf.grad, ref)
    assert cm.stats.compressed == 1 and cm.stats.bytes_after == (x.numel() // k) * kp * 9 // 16 + 4
    # More accurate than the default MXFP4 storage on the same values.
    err = lambda r: (r.float() - x.detach().float()).norm()  # noqa: E731
    if k % 32 == 0:
        assert err(saved) < err(mx_roundtrip(x))


def test_storage_format_validated():
    assert CompressionConfig(storage="nvfp4").storage is H.StorageFormat.NVFP4
    assert CompressionConfig().storage is moe_fp4.StorageFormat.MXFP4
    with pytest.raises(ValueError, match="CompressionConfig.storage: expected one of mxfp4, nvfp4"):
        CompressionConfig(storage="fp4")
