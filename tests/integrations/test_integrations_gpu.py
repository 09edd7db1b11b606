"""The Hugging Face experts implementations and the torchtitan converter on a GPU (the Gluon / Triton grouped FP8
GEMMs instead of the CPU emulation): the same inputs, references and floor-ceiling bands as their CPU tests
(tests/integrations/test_hf_experts.py, test_torchtitan_experts.py), so a kernel that computed other numerics
than the emulation's would leave the band. Marked gpu; skipped without CUDA."""

import os
import sys

import pytest
import torch
from helpers import sqnr_db  # fails on NaN / Inf

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench")

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_hf_experts_on_gpu(family):
    th = pytest.importorskip("test_hf_experts")
    experts = th._experts(th._model(family, "eager", dtype=torch.float32))
    x0, idx, w0 = th._module_inputs(experts.gate_up_proj.shape[-1])
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    x, w = x0.double().requires_grad_(), w0.double().requires_grad_()
    rw13, rw2 = w13.double().requires_grad_(), w2.double().requires_grad_()
    ref = th._reference(x, idx, w, rw13, rw2)
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    ref.backward(gy)
    want = dict(out=ref.detach(), dx=x.grad, dweights=w.grad, dw13=rw13.grad, dw2=rw2.grad)
    for impl in ("moe_fp4_fp8", "moe_fp4"):
        mod = th._experts(th._model(family, impl)).cuda()
        with torch.no_grad():
            mod.gate_up_proj.copy_(w13)
            mod.down_proj.copy_(w2)
        xb, wb = x0.clone().cuda().requires_grad_(), w0.clone().cuda().requires_grad_()
        out = mod(xb, idx.cuda(), wb)
        out.backward(gy.bfloat16().cuda())
        got = dict(out=out.detach(), dx=xb.grad, dweights=wb.grad, dw13=mod.gate_up_proj.grad, dw2=mod.down_proj.grad)
        db = {k: round(sqnr_db(want[k].float(), got[k].float().cpu(), f"{impl} {k}"), 2) for k in want}
        print(family, impl, db)
        outside = {k: (v, th.MODULE_FLOOR_DB[impl][k], th.MODULE_CEILING_DB[impl][k]) for k, v in db.items()
                   if not th.MODULE_FLOOR_DB[impl][k] <= v <= th.MODULE_CEILING_DB[impl][k]}
        assert not outside, (family, impl, outside)


@pytest.mark.parametrize("mode", ["fp8", "fp4"])
def test_torchtitan_experts_on_gpu(mode):
    sys.path.insert(0, BENCH)
    from torchtitan_compat import import_torchtitan

    # torchtitan 0.3.0 on an older torch (the names it lacks are FSDP's: stand-ins that raise if used); the
    # torchtitan modules test_torchtitan_experts skips without come first, so that it finds them imported.
    try:
        stood_in = import_torchtitan("torchtitan.models.qwen3", "torchtitan.models.common.moe",
                                     "torchtitan.models.common.token_dispatcher", "test_torchtitan_experts")
    except ImportError as e:   # not installed, or broken beyond the stand-ins
        pytest.skip(f"torchtitan cannot be imported ({type(e).__name__}: {e})")
    print("stand-ins:", stood_in)
    tt = sys.modules["test_torchtitan_experts"]
    x, counts, dy = tt._rows()
    want = tt._step(tt._experts(), x, counts, dy)
    got = tt._step(tt._experts(mode).cuda(), x.cuda(), counts.cuda(), dy.cuda())
    db = {k: round(sqnr_db(want[k].float(), got[k].float().cpu(), f"{mode} {k}"), 2) for k in tt.KEYS}
    print(mode, db)
    outside = {k: (v, tt.SQNR_FLOOR_DB[mode][k], tt.SQNR_CEILING_DB[mode][k]) for k, v in db.items()
               if not tt.SQNR_FLOOR_DB[mode][k] <= v <= tt.SQNR_CEILING_DB[mode][k]}
    assert not outside, (mode, outside)
