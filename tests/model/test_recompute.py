"""Recomputation policies (issues 30, 49): none, swiglu, moe, dense, layer (moe_fp4.model.moe.Recompute).

Each policy must give the loss and every gradient of "none" bit for bit in the same precision (the
recomputation runs the same kernels on the same inputs), keep less for backward than the policy
before it, and, under expert parallelism, never repeat an exchange: the recomputed forward reuses the
count exchange, the dispatch (its received rows, MXFP4 in fp4) and the combine of the first run.
The experts keep everything through ``save_for_backward``, so a plain ``torch.utils.checkpoint``
around them drops their activations too (before, their quantized containers sat on ctx attributes,
which a checkpoint cannot drop).

The expert-parallel case (no exchange repeated, gradients bit-identical) is in test_ep.py, whose
spawned ranks must import moe_fp4 themselves (tests/distributed.py).
"""

import pytest
import torch

import moe_fp4
from moe_fp4.model.decoder import PRESETS, DecoderLM
from moe_fp4.model.experts import TOKEN_ALIGN, grouped_swiglu_experts
from moe_fp4.model.moe import MoE, MoEConfig, Recompute, checkpoint
from moe_fp4.saved.accounting import saved_bytes

POLICIES = [p.value for p in Recompute]
PRECISIONS = ["bf16", "fp8", "fp4"]
TINY = PRESETS["tiny"]


def _train_step(model, ids, targets):
    """-> (loss, {name: grad}, SavedReport of the forward)."""
    loss, report = saved_bytes(lambda: model(ids, targets))
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, report


@pytest.fixture(scope="module")
def policy_runs():
    """{precision: {policy: (loss, grads, report)}} for the tiny decoder, one batch."""
    from helpers import torch_references

    torch.manual_seed(0)
    ids = torch.randint(0, TINY.vocab, (2, TINY.seq))
    targets = torch.randint(0, TINY.vocab, (2, TINY.seq))
    out = {}
    with torch_references():
        for precision in PRECISIONS:
            out[precision] = {p: _train_step(DecoderLM(TINY, precision, recompute=p), ids, targets) for p in POLICIES}
    return out


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("policy", POLICIES[1:])
def test_policy_is_bit_identical_to_none(policy_runs, precision, policy):
    loss0, grads0, _ = policy_runs[precision]["none"]
    loss, grads, _ = policy_runs[precision][policy]
    assert torch.equal(loss, loss0)
    differ = [n for n in grads0 if not torch.equal(grads[n], grads0[n])]
    assert not differ, f"{precision} recompute={policy}: gradients differ from none: {differ}"


@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_policy_keeps_less(policy_runs, precision):
    kept = {p: policy_runs[precision][p][2].total for p in POLICIES}
    if precision == "fp4":
        # fp4 keeps its MXFP4 SwiGLU output: recomputing it from the MXFP4 SwiGLU input would change dW2.
        assert kept["swiglu"] == kept["none"]
    else:
        assert kept["swiglu"] < kept["none"]
    assert kept["moe"] < kept["swiglu"] and kept["layer"] < kept["moe"], kept
    # dense drops what moe keeps outside the MoE block; layer drops both.
    assert kept["dense"] < kept["none"] and kept["layer"] < kept["dense"], kept


def test_dense_policy_keeps_the_experts_activations(policy_runs):
    """Under recompute="dense" the MoE blocks keep exactly what they keep under "none" (their records, MXFP4 in
    fp4) while the rest is recomputed (test_each_policy_keeps_less); so fp4, whose kept MoE activations are the
    smaller, keeps less than fp8 under it."""
    for precision in PRECISIONS:
        none_moe = [(r.label, r.nbytes) for r in policy_runs[precision]["none"][2].records
                    if r.label != "autograd" and not r.parameter]
        dense_moe = [(r.label, r.nbytes) for r in policy_runs[precision]["dense"][2].records
                     if r.label != "autograd" and not r.parameter]
        assert dense_moe == none_moe and {"fc1_input", "fc2_input"} & {lab for lab, _ in dense_moe}, precision
    kept = {p: policy_runs[p]["dense"][2].total for p in PRECISIONS}
    assert kept["fp4"] < kept["fp8"] < kept["bf16"], kept


def test_moe_policy_keeps_no_expert_activation(policy_runs):
    """Under recompute="moe" no expert activation is held (they are recomputed); with "swiglu" the FC2
    input is gone in bf16 and fp8."""
    for precision in PRECISIONS:
        labels = {r.label for r in policy_runs[precision]["moe"][2].records}
        assert not labels & {"fc1_input", "swiglu_input", "fc2_input", "row_weights"}, (precision, labels)
    for precision in ("bf16", "fp8"):
        labels = {r.label for r in policy_runs[precision]["swiglu"][2].records}
        assert "fc2_input" not in labels and "swiglu_input" in labels, (precision, labels)


@pytest.mark.parametrize("precision", ["fp8", "fp4"])
def test_torch_checkpoint_drops_the_experts_activations(references, precision):
    """A plain torch.utils.checkpoint around the grouped experts holds only its inputs: the experts'
    MXFP4 / FP8 activations go through save_for_backward, not ctx attributes. Gradients are equal."""
    torch.manual_seed(1)
    e, f, h = 2, 128, 128
    counts = (TOKEN_ALIGN, 2 * TOKEN_ALIGN)
    x = torch.randn(sum(counts), h, dtype=torch.bfloat16, requires_grad=True)
    w13 = (torch.randn(e, 2 * f, h) * h ** -0.5).requires_grad_()
    w2 = (torch.randn(e, h, f) * f ** -0.5).requires_grad_()

    def fn(x):
        return grouped_swiglu_experts(x, w13, w2, counts, precision)

    grads = {}
    for name, run in (("plain", fn), ("checkpoint", lambda x: torch.utils.checkpoint.checkpoint(
            fn, x, use_reentrant=False))):
        y, report = saved_bytes(run, x)
        y.float().square().sum().backward()
        grads[name] = (report, x.grad.clone(), w13.grad.clone(), w2.grad.clone())
        x.grad = w13.grad = w2.grad = None
    plain, ckpt = grads["plain"][0], grads["checkpoint"][0]
    assert {"fc1_input", "swiglu_input", "fc2_input"} <= {r.label for r in plain.records}
    assert not {r.label for r in ckpt.records} & {"fc1_input", "swiglu_input", "fc2_input"}
    assert ckpt.total == x.numel() * x.element_size()   # the checkpoint's input, nothing else
    for a, b in zip(grads["plain"][1:], grads["checkpoint"][1:]):
        assert torch.equal(a, b)


def test_hook_around_a_checkpoint_compresses_its_input_only(references):
    """The compression hook entered around moe_fp4.model.moe.checkpoint sees only what the checkpoint holds
    (its input): the experts' kept tensors are the checkpoint's to drop, not the hook's to count."""
    torch.manual_seed(2)
    m = MoE(MoEConfig(hidden=128, ffn=128, num_experts=2, top_k=1), "fp8")
    x0 = torch.randn(256, 128, dtype=torch.bfloat16, requires_grad=True)
    x = x0 * 1   # not a leaf: the hook passes leaves that require grad through
    scope = moe_fp4.compress_saved_activations(moe_fp4.CompressionConfig(min_numel=1024))
    with scope:
        y = checkpoint(m, x)
    y.float().square().sum().backward()
    s = scope.stats
    assert s.compressed == 1 and s.bytes_before == x.numel() * x.element_size()
    assert s.internal == 0 and "quantized" not in s.skipped
    assert x0.grad is not None and torch.isfinite(x0.grad).all()
    # Without the checkpoint the hook sees the experts' own tensors: tagged, passed through, counted once.
    scope = moe_fp4.compress_saved_activations(moe_fp4.CompressionConfig(min_numel=1024))
    with scope:
        m(x)
    assert scope.stats.skipped["quantized"] >= 4   # FC1 and FC2 inputs (data, scale) and the router weights


def test_policy_names_and_misuse():
    assert Recompute("moe") is Recompute.MOE
    with pytest.raises(ValueError,
                       match="recompute='everything' is not one of 'none', 'swiglu', 'moe', 'dense', 'layer'"):
        Recompute("everything")
    with pytest.raises(ValueError, match="layer"):
        MoE(MoEConfig(hidden=128, ffn=128, num_experts=2, top_k=1), "fp8", recompute="layer")
    model = DecoderLM(TINY, "fp8", device="meta", recompute="layer")
    assert all(b.recompute is Recompute.LAYER for b in model.blocks)
    assert all(m.recompute is Recompute.NONE for m in model.moe_layers())
    with pytest.raises(ValueError, match="dense"):
        MoE(MoEConfig(hidden=128, ffn=128, num_experts=2, top_k=1), "fp8", recompute="dense")
    model.recompute = "dense"
    assert all(b.recompute is Recompute.DENSE for b in model.blocks)
    assert all(m.recompute is Recompute.NONE for m in model.moe_layers())
    model.recompute = "swiglu"
    assert all(b.recompute is Recompute.SWIGLU for b in model.blocks)
    assert all(m.recompute is Recompute.SWIGLU for m in model.moe_layers())


def test_replay_refuses_a_recomputation_that_runs_more_exchanges():
    from moe_fp4.model.moe import _Replay

    rep = _Replay()
    assert rep.once(lambda: 1) == 1
    rep.recorded, rep.pos = True, 0
    assert rep.once(lambda: 2) == 1   # replayed, not recomputed
    with pytest.raises(RuntimeError, match="more MoE exchanges"):
        rep.once(lambda: 3)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_policies_bit_identical_on_gpu(precision):
    """The GPU kernels (Gluon / Triton GEMMs, conversions, SwiGLU) recompute the same bytes: the MoE
    layer's input and parameter gradients under every policy equal those without recomputation."""
    torch.manual_seed(3)
    cfg = MoEConfig(hidden=512, ffn=256, num_experts=8, top_k=2, shared_ffn=256)
    m = MoE(cfg, precision, dtype=torch.float32, device="cuda")
    x0 = torch.randn(1000, cfg.hidden, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(1000, cfg.hidden, device="cuda", dtype=torch.bfloat16)
    out = {}
    for policy in ("none", "swiglu", "moe", "layer"):
        m.recompute = "none" if policy == "layer" else policy
        x = x0 * 1
        y = checkpoint(m, x) if policy == "layer" else m(x)
        y.backward(g)
        out[policy] = [x0.grad.clone()] + [p.grad.clone() for p in m.parameters()]
        x0.grad = None
        m.zero_grad(set_to_none=True)
    for policy in ("swiglu", "moe", "layer"):
        assert all(torch.equal(a, b) for a, b in zip(out[policy], out["none"])), (precision, policy)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", PRECISIONS)
def test_decoder_policies_bit_identical_on_gpu(precision):
    """The decoder-level policies (dense, layer: checkpoints around attention, the dense MLP and whole blocks)
    on the GPU kernels: the loss and every gradient equal those without recomputation."""
    torch.manual_seed(4)
    cfg = PRESETS["tiny"]
    ids = torch.randint(0, cfg.vocab, (4, cfg.seq), device="cuda")
    targets = torch.randint(0, cfg.vocab, (4, cfg.seq), device="cuda")
    out = {}
    for policy in POLICIES:
        model = DecoderLM(cfg, precision, device="cuda", recompute=policy)
        loss = model(ids, targets)
        loss.backward()
        out[policy] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    loss0, grads0 = out["none"]
    for policy in POLICIES[1:]:
        loss, grads = out[policy]
        assert torch.equal(loss, loss0), (precision, policy)
        differ = [n for n in grads0 if not torch.equal(grads[n], grads0[n])]
        assert not differ, (precision, policy, differ)
