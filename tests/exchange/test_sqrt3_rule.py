"""The sqrt(3) rule for gradient wires (issue 27): EPConfig(dispatch_grad="auto" / combine_grad="auto").

The rule's arithmetic on synthetic rows (the ratio sqrt(sum x^2 / sum noise^2), the patience, the switch
to bf16 and that nothing is measured after it), its configuration checks, and the MoE layer with the
simulated wire: the ratio it measures is the round trip's, and after the switch the gradients are those of
a bf16 gradient wire bit for bit. The EP group's shared decision is tested in test_ep.py (2, 4, 8 ranks).
"""

import math

import pytest
import torch

from moe_fp4.exchange import wire as W
from moe_fp4.exchange.ep import AUTO, SQRT3, EPConfig, GradWireRule, grad_format
from moe_fp4.model.moe import MoE, MoEConfig, end_grad_wire_step
from moe_fp4.exchange.wire import WireFormat


def test_rule_ratio_patience_and_fallback():
    rule = GradWireRule(WireFormat.NVFP4_SR, patience=2)
    x = torch.ones(4, 16)
    assert rule.format is WireFormat.NVFP4_SR and rule.end_step() is None      # nothing sent: no step measured
    rule.record(x, x + 0.25)                      # signal 64, noise 4 -> ratio 4
    rule.record(x, x)                             # a second exchange in the same step adds to its sums
    assert rule.end_step() == pytest.approx(math.sqrt(128 / 4))
    for step in range(2):                         # ratio 1 < sqrt(3), twice: the patience runs out
        rule.record(x, x + 1.0)
        assert rule.end_step() == pytest.approx(1.0)
        assert (rule.format is WireFormat.BF16) == (step == 1)
    assert rule.fell_back_at == 3
    rule.record(x, x + 5.0)                       # after the switch nothing is measured
    assert rule.end_step() is None and len(rule.ratios) == 3
    s = rule.summary()
    assert s["fell_back_at"] == 3 and s["ratio_min"] == pytest.approx(1.0) and s["steps"] == 3


def test_one_step_above_resets_the_count():
    rule = GradWireRule(WireFormat.MXFP4_SR, patience=2)
    x = torch.ones(2, 32)
    for noise in (1.0, 0.1, 1.0):                 # below, above, below: never two in a row
        rule.record(x, x + noise)
        rule.end_step()
    assert rule.fell_back_at is None and rule.below == 1
    assert SQRT3 == pytest.approx(3 ** 0.5)


def test_auto_configuration_is_checked():
    ep = EPConfig(simulate=True, dispatch_grad="auto", auto_format="mxfp4-sr", auto_patience=3)
    # An unset role follows the precision's recipe; a set one overrides it for every precision.
    assert ep.dispatch_grad == AUTO and ep.combine_grad is None
    assert ep.wire("fp8").dispatch_grad == AUTO and ep.wire("fp8").combine_grad is WireFormat.FP8
    assert ep.wire("bf16").dispatch_grad == AUTO and ep.wire("bf16").combine_grad is WireFormat.BF16
    rules = ep.grad_rules()
    assert set(rules) == {"dispatch_grad"} and rules["dispatch_grad"].fmt is WireFormat.MXFP4_SR
    assert rules["dispatch_grad"].patience == 3 and ep.grad_rules()["dispatch_grad"] is not rules["dispatch_grad"]
    with pytest.raises(ValueError, match="between a quantized format and bf16"):
        EPConfig(dispatch_grad="auto", auto_format="bf16")
    with pytest.raises(ValueError, match="auto_patience"):
        EPConfig(dispatch_grad="auto", auto_patience=0)
    with pytest.raises(ValueError, match="'auto' is not a valid WireFormat"):
        EPConfig(combine="auto")                  # values have no rule
    with pytest.raises(ValueError, match="needs its GradWireRule"):
        grad_format(AUTO, None)


def _layers(**formats):
    cfg = MoEConfig(hidden=128, ffn=128, num_experts=4, top_k=2, shared_ffn=0)
    torch.manual_seed(0)
    ref = MoE(cfg, precision="fp8", ep=EPConfig(simulate=True, combine="bf16"))
    m = MoE(cfg, precision="fp8", ep=EPConfig(simulate=True, **formats))
    m.load_state_dict(ref.state_dict())
    return ref, m


def _grad(m, x, g):
    x = x.clone().requires_grad_()
    m(x).backward(g)
    return x.grad


def test_moe_layer_measures_the_round_trip_and_switches_to_bf16(references):
    ref, m = _layers(dispatch_grad="auto", combine_grad="auto")
    x = torch.randn(24, 128, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    g = torch.randn(24, 128, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    W.seed_stochastic_rounding(3)
    _grad(m, x, g)
    # The combine gradient the rule measured is g itself (the layer's output gradient): its ratio is the
    # nvfp4-sr round trip's, drawn with the same seed and step.
    W.seed_stochastic_rounding(3)
    rt = W.unpack(W.pack(g, "nvfp4-sr"), "nvfp4-sr", 128, "bf16", torch.bfloat16).float()
    want = math.sqrt(float(g.float().square().sum()) / float((rt - g.float()).square().sum()))
    ratios = end_grad_wire_step(m)[""]
    assert set(ratios) == {"dispatch_grad", "combine_grad"}
    assert ratios["combine_grad"] == pytest.approx(want, rel=1e-6)
    assert ratios["dispatch_grad"] > SQRT3
    # After a switch the layer's gradients are those of bf16 gradient wires, bit for bit.
    for rule in m.grad_rules.values():
        rule.fell_back_at = 1
    W.seed_stochastic_rounding(0)
    got, want = _grad(m, x, g), _grad(ref, x, g)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    assert end_grad_wire_step(m) == {}
