"""The MoE layer under torch.compile(fullgraph=True) and with device counts: no graph break (fullgraph makes one
an error), no host read of the counts, and the eager bits in forward and backward for every precision.

CPU: backend "aot_eager" (Dynamo and AOTAutograd, the ops as they run eagerly; Inductor's C++ build would add
minutes and nothing the ops' graph does not show), and the pure-torch twins inside the ops (``references``): the
Triton kernels through their ops under compile are tests/formats/test_kernel_ops.py's, and the twins are the
kernels' bits. The GPU run of the same step: bench/moe_compile.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from moe_fp4.formats import conversions
from moe_fp4.kernels import grouped_gemm
from moe_fp4.model import routing as routing_module
from moe_fp4.model.moe import MoE, MoEConfig
from moe_fp4.model.routing import make_routing, routed_swiglu_experts, rows_bound

CONFIG = MoEConfig(hidden=128, ffn=128, num_experts=3, top_k=2, shared_ffn=128)


def _step(fn, layer, x, dy):
    layer.zero_grad(set_to_none=True)
    xi = x.clone().requires_grad_()
    y = fn(xi)
    y.backward(dy)
    return [y, xi.grad, layer.w13.grad, layer.w2.grad, layer.router.weight.grad, layer.shared_w13.grad]


@pytest.mark.parametrize("precision,recompute", [("bf16", "none"), ("fp8", "none"), ("fp4", "none"),
                                                  ("fp8", "swiglu"), ("fp8", "moe"), ("fp4", "moe")])
def test_layer_compiles_fullgraph_with_the_eager_bits(precision, recompute, references):
    # recompute="moe" under compile is torch's own checkpoint (nothing to replay without EP: no host sync).
    torch.manual_seed(1)
    layer = MoE(CONFIG, precision, recompute=recompute)
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    dy = torch.randn(40, 128, dtype=torch.bfloat16)
    eager_host = _step(layer, layer, x, dy)
    layer.host_counts = False
    eager_device = _step(layer, layer, x, dy)
    layer.host_counts = None   # on the device under compile
    torch._dynamo.reset()
    compiled = _step(torch.compile(layer, fullgraph=True, backend="aot_eager"), layer, x, dy)
    for name, a, b, c in zip(("y", "dx", "dw13", "dw2", "drouter", "dshared"), eager_host, eager_device, compiled):
        assert not a.isnan().any(), name
        assert torch.equal(a, b), f"{name}: device counts differ from host counts"
        assert torch.equal(a, c), f"{name}: compiled differs from eager"


class _HostReads(TorchDispatchMode):
    """Records the aten ops that copy a value to the host (on CUDA a device-to-host copy and a sync): a
    scalar read, and the ops whose output size depends on the values."""

    SYNCING = ("aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select",
               "aten::unique_dim", "aten::_unique2", "aten::unique_consecutive")

    def __init__(self):
        super().__init__()
        self.seen = []
        self.exempt = 0   # inside the pure-torch GEMM twins, which read device counts on the host by design

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.name()
        if self.exempt:
            return func(*args, **kwargs)
        if name in self.SYNCING or (name.startswith("aten::repeat_interleave") and kwargs.get("output_size") is None
                                    and len(args) < 3):
            self.seen.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp4"])
def test_device_counts_read_nothing_on_the_host(monkeypatch, precision, references):
    # The eager step with device counts, forward and backward: no counts_to_host, no tolist / item, and no aten
    # op that reads a value on the host (what a one-GPU step would copy device-to-host and wait for), outside
    # the grouped GEMMs' pure-torch twins: they read the counts on the host by design (the references; on a
    # GPU the Triton and Gluon kernels take device counts, tests/gemm's GPU tests). The conversions' input value
    # checks are off, as on a GPU unless MOE_FP4_CHECK_VALUES=1 (on CPU they always run).
    reads = _HostReads()
    tolist, item, ref_counts = torch.Tensor.tolist, torch.Tensor.item, grouped_gemm._ref_counts

    def refuse(what, real=None):
        def fail(*a, **k):
            if reads.exempt and real is not None:
                return real(*a, **k)
            raise AssertionError(f"the step read a value on the host: {what}")
        return fail

    def exempt(*a, **k):
        reads.exempt += 1
        try:
            return ref_counts(*a, **k)
        finally:
            reads.exempt -= 1

    monkeypatch.setattr(routing_module, "counts_to_host", refuse("counts_to_host"))
    torch.manual_seed(2)
    layer = MoE(CONFIG, precision)
    layer.host_counts = False
    x = torch.randn(24, 128, dtype=torch.bfloat16, requires_grad=True)
    with monkeypatch.context() as m, reads:
        m.setattr(conversions, "check_values_enabled", lambda _t: False)
        m.setattr(grouped_gemm, "_ref_counts", exempt)
        m.setattr(torch.Tensor, "tolist", refuse("tolist", tolist))
        m.setattr(torch.Tensor, "item", refuse("item", item))
        layer(x).float().square().sum().backward()
    assert reads.seen == [], reads.seen
    assert x.grad is not None and not x.grad.isnan().any()


def test_device_routing_matches_host_routing_on_the_groups():
    # The same rows for every pair; the device buffer is the static bound long, its tail padding rows.
    g = torch.Generator().manual_seed(3)
    t, k, e = 50, 3, 5
    experts = torch.randint(0, e + 1, (t, k), generator=g)     # id e: dropped
    weights = torch.rand(t, k, generator=g)
    host = make_routing(weights, experts, e)
    dev = make_routing(weights, experts, e, host_counts=False)
    assert dev.on_device and not host.on_device and dev.dropped is None
    assert dev.rows == rows_bound(t * k, e) >= host.rows
    assert dev.padded_counts.tolist() == list(host.padded_counts) and dev.counts.tolist() == list(host.counts)
    kept = experts.flatten() < e
    assert torch.equal(dev.dest[kept], host.dest[kept]) and (dev.dest[~kept] == dev.rows).all()
    assert torch.equal(dev.src_row[:host.rows], host.src_row) and (dev.src_row[host.rows:] == t).all()


def test_routed_experts_compile_fullgraph(references):
    # The entry point of the transformers experts implementations, compiled as a grouped_mm model compiles.
    torch.manual_seed(4)
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    idx = torch.randint(0, 3, (32, 2))
    w = torch.rand(32, 2)
    w13 = torch.randn(3, 256, 128, dtype=torch.bfloat16) * 0.1
    w2 = torch.randn(3, 128, 128, dtype=torch.bfloat16) * 0.1
    fn = lambda x: routed_swiglu_experts(x, idx, w, w13, w2, "fp8")  # noqa: E731
    torch._dynamo.reset()
    assert torch.equal(torch.compile(fn, fullgraph=True, backend="aot_eager")(x), fn(x))


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp4"])
def test_experts_op_pair_opcheck(precision, references):
    # The fake against the real op and the autograd registration. opcheck's schema and dynamic-shape tests are
    # left out: the first does arithmetic on the float8 weight codes (which float8 lacks), and the op pair is
    # traced with static shapes (its kept specs are looked up by shape).
    from torch.library import opcheck

    from moe_fp4.gemm.engines import quantize_fp8_weight_pair
    from moe_fp4.model import experts_op

    torch.manual_seed(5)
    e, h, f, rows = 2, 128, 128, 384
    x = torch.randn(rows, h, dtype=torch.bfloat16)
    x[256:] = 0   # the static bound's tail: padding rows
    w13 = (torch.randn(e, 2 * f, h) * 0.1).bfloat16().requires_grad_()
    w2 = (torch.randn(e, h, f) * 0.1).bfloat16().requires_grad_()
    (a, at), (b, bt) = quantize_fp8_weight_pair(w13), quantize_fp8_weight_pair(w2)
    recipe = experts_op.Recipe(precision, "mxfp4", False).encode()
    args = (x.requires_grad_(), w13, w2, a.data, a.scale, at.data, at.scale, b.data, b.scale, bt.data, bt.scale,
            torch.rand(rows).requires_grad_(), torch.tensor([128, 128]), None, None, None, None, None, recipe)
    opcheck(torch.ops.moe_fp4.experts_forward.default, args,
            test_utils=("test_faketensor", "test_autograd_registration"))


def test_explicit_fp8_weights_give_the_cached_pairs_bits(references):
    # fp8_weights: the pairs the GEMMs read, passed in (what the compiled graph and the torchtitan converter do);
    # the same bits as the process cache's pairs, eager and compiled; a wrong structure or shape is refused.
    from moe_fp4.gemm.engines import quantize_fp8_weight_pair
    from moe_fp4.model.experts import grouped_swiglu_experts

    torch.manual_seed(6)
    w13 = (torch.randn(2, 256, 128) * 0.1).bfloat16().requires_grad_()
    w2 = (torch.randn(2, 128, 128) * 0.1).bfloat16().requires_grad_()
    x = torch.randn(256, 128, dtype=torch.bfloat16)
    pairs = (quantize_fp8_weight_pair(w13), quantize_fp8_weight_pair(w2))

    def run(fn, **kw):
        w13.grad = w2.grad = None
        y = fn(x, w13, w2, (128, 128), "fp4", **kw)
        y.float().square().sum().backward()
        return y, w13.grad, w2.grad

    cached, given = run(grouped_swiglu_experts), run(grouped_swiglu_experts, fp8_weights=pairs)
    torch._dynamo.reset()
    compiled = run(torch.compile(grouped_swiglu_experts, fullgraph=True, backend="aot_eager"), fp8_weights=pairs)
    for a, b, c in zip(cached, given, compiled):
        assert torch.equal(a, b) and torch.equal(a, c)
    with pytest.raises(TypeError, match=r"\(\(W13, W13\^T\), \(W2, W2\^T\)\)"):
        grouped_swiglu_experts(x, w13, w2, (128, 128), "fp8", fp8_weights=pairs[0])
    with pytest.raises(ValueError, match=r"W2\^T must be an FP8WeightTensor \(2, 128, 128\)"):
        grouped_swiglu_experts(x, w13, w2, (128, 128), "fp8", fp8_weights=(pairs[0], (pairs[1][0], pairs[0][1])))


@pytest.mark.parametrize("precision", ["fp8", "fp4"])
def test_layer_compiles_with_dynamic_rows(precision, references):
    # dynamic=True: the token count (and the routing's row bound) is symbolic, so the experts' op pair runs on
    # symbolic shapes (what the rows of an expert-parallel exchange are); one graph serves both sizes.
    from torch._dynamo.utils import counters

    torch.manual_seed(4)
    layer = MoE(CONFIG, precision)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(layer, fullgraph=True, dynamic=True, backend="aot_eager")
    for tokens in (40, 56):
        x = torch.randn(tokens, 128, dtype=torch.bfloat16)
        dy = torch.randn(tokens, 128, dtype=torch.bfloat16)
        eager = _step(layer, layer, x, dy)
        got = _step(compiled, layer, x, dy)
        for name, a, b in zip(("y", "dx", "dw13", "dw2", "drouter", "dshared"), eager, got):
            assert not a.isnan().any() and torch.equal(a, b), (tokens, name)
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _quantize_counter(monkeypatch):
    """Counts the weight quantizations the experts' op path makes (at trace time under compile: each one is a
    quantization inside the graph, run every step)."""
    from moe_fp4.model import experts_op

    calls = []
    real = experts_op.quantize_fp8_weight

    def counted(w, *args, **kwargs):
        calls.append(tuple(w.shape))
        return real(w, *args, **kwargs)

    monkeypatch.setattr(experts_op, "quantize_fp8_weight", counted)
    return calls


@pytest.mark.parametrize("precision", ["fp8", "fp4"])
def test_pinned_fp8_weights_enter_the_graph_as_inputs_and_follow_the_optimizer(monkeypatch, precision, references):
    # pin_fp8_weights: the compiled step takes the pinned W as inputs (no quantization traced into the graph) and
    # gives the eager bits; after optimizer steps (torch's AdamW, fused or not, and AdamWFP8Weights) and a
    # load_state_dict, the compiled step reads the new weights' W, as a fresh unpinned eager layer does.
    from moe_fp4.gemm.engines import FP8_WEIGHTS
    from moe_fp4.model.optim import AdamWFP8Weights

    torch.manual_seed(2)
    layer = MoE(CONFIG, precision)
    x = torch.randn(40, 128, dtype=torch.bfloat16)
    dy = torch.randn(40, 128, dtype=torch.bfloat16)
    plain = MoE(CONFIG, precision)

    def eager_reference():
        plain.load_state_dict(layer.state_dict())
        return _step(plain, plain, x, dy)

    calls = _quantize_counter(monkeypatch)
    assert layer.pin_fp8_weights() is layer
    assert "fp8_w13" not in layer.state_dict()                        # checkpoints never hold FP8
    pinned = layer.fp8_w13
    assert pinned.dtype == torch.float8_e4m3fn and FP8_WEIGHTS.is_pinned(layer.w13)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="aot_eager")
    got, want = _step(compiled, layer, x, dy), eager_reference()
    assert calls == [], f"the compiled step quantized weights in its graph: {calls}"
    for name, a, b in zip(("y", "dx", "dw13", "dw2", "drouter", "dshared"), got, want):
        assert not a.isnan().any() and torch.equal(a, b), name
    for opt in (torch.optim.AdamW(layer.parameters(), lr=1e-2, foreach=True),
                torch.optim.AdamW(layer.parameters(), lr=1e-2, fused=True),
                AdamWFP8Weights(layer.parameters(), lr=1e-2)):
        _step(compiled, layer, x, dy)
        before = layer.fp8_w13.clone()
        with monkeypatch.context() as m:
            if isinstance(opt, AdamWFP8Weights):   # its fused step writes the pinned tensors in place: no copy
                m.setattr(FP8_WEIGHTS, "_refresh", lambda *a: pytest.fail("copied into the pinned W"))
            opt.step()
        assert layer.fp8_w13 is pinned                                 # refreshed in place: the graph's input
        assert not torch.equal(before.view(torch.uint8), pinned.view(torch.uint8)), type(opt).__name__
        got, want = _step(compiled, layer, x, dy), eager_reference()
        for name, a, b in zip(("y", "dx", "dw13", "dw2"), got, want):
            assert torch.equal(a, b), (type(opt).__name__, name)
    other = MoE(CONFIG, precision)
    layer.load_state_dict(other.state_dict())
    got, want = _step(compiled, layer, x, dy), eager_reference()
    assert torch.equal(got[0], want[0]) and torch.equal(got[2], want[2]), "load_state_dict"
    assert calls == []


def test_pinned_fp8_weights_refuse_under_compile_and_follow_in_place_writes_in_eager():
    from moe_fp4.gemm.engines import FP8_WEIGHTS, quantize_fp8_weight

    torch.manual_seed(3)
    layer = MoE(CONFIG, "fp8").pin_fp8_weights()
    pinned = layer.fp8_w2
    with torch.no_grad():
        layer.w2.mul_(2)                                               # bumps _version: eager sees it
    x = torch.randn(8, 128, dtype=torch.bfloat16)
    layer(x)
    assert layer.fp8_w2 is pinned
    assert torch.equal(pinned.view(torch.uint8), quantize_fp8_weight(layer.w2.detach()).data.view(torch.uint8))
    assert MoE(CONFIG, "bf16").pin_fp8_weights()._pinned is False      # nothing to pin in bf16
    with pytest.raises(RuntimeError, match="outside torch.compile"):
        torch.compile(lambda w: FP8_WEIGHTS.pin(w), fullgraph=True, backend="aot_eager")(layer.w13)
