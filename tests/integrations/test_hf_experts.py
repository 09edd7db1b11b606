"""moe_fp4's experts inside Hugging Face transformers: ``experts_implementation="moe_fp4"`` (FP8 GEMMs, MXFP4
kept for backward) and ``"moe_fp4_fp8"`` (FP8 GEMMs, FP8 kept), registered by ``import moe_fp4``
(:mod:`moe_fp4.integrations.hf_experts`).

- Registration: the two names are in transformers' registry whichever of moe_fp4 and transformers a
  script imports first, and ``import moe_fp4`` alone does not import transformers.
- The experts module of every family tested (Qwen3-MoE, Mixtral, DeepSeek-V3, Qwen2-MoE, OLMoE: tiny
  configs, hidden 128, expert ffn 128, 4 experts, top-2, random weights, no downloads), called as
  transformers calls it, against a float64 reference computed here (each token's top-k experts' SwiGLU
  outputs weighted and summed, slots with an id >= E adding nothing): the output and the gradients of the
  tokens, the router weights and both expert weights. A control registered with the bf16 precision runs
  the same routing, permutation and combine with bf16 GEMMs: it must sit at bf16's rounding, which pins the
  plumbing; the FP8 paths by SQNR floors and ceilings (a path that ran in bf16 would exceed the ceiling).
- The whole model of each family: loss and logits against the float32 eager model, fp4's forward
  bit-identical to fp8's (they differ only in what is kept), every experts module checked.
- Refusals, before any work: expert ffn not a multiple of 128, another gate (GPT-OSS: biases, transposed
  and interleaved weights), another activation, float32 activations.
- The FP8 copies of the expert weights are made once per optimizer step with torch's AdamW.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from optional_stacks import import_or_skip

transformers = import_or_skip("transformers")
import_or_skip("transformers.integrations.moe")

from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS  # noqa: E402

import moe_fp4  # noqa: E402,F401 - registers the implementations
from moe_fp4.formats.metrics import sqnr_db  # noqa: E402
from moe_fp4.integrations import hf_experts  # noqa: E402
from moe_fp4.model.experts import Precision  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
E, K, VOCAB = 4, 2, 128
_COMMON = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=K,
               max_position_embeddings=64, tie_word_embeddings=False)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", dict(_COMMON, intermediate_size=128, moe_intermediate_size=128, num_experts=E,
                                         num_key_value_heads=2, head_dim=32)),
    "mixtral": ("MixtralConfig", dict(_COMMON, intermediate_size=128, num_local_experts=E, num_key_value_heads=2,
                                      head_dim=32)),
    "deepseek_v3": ("DeepseekV3Config", dict(
        _COMMON, intermediate_size=128, moe_intermediate_size=128, n_routed_experts=E, n_shared_experts=1,
        first_k_dense_replace=0, n_group=1, topk_group=1, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(_COMMON, intermediate_size=128, moe_intermediate_size=128,
                                         shared_expert_intermediate_size=128, num_experts=E, num_key_value_heads=2)),
    "olmoe": ("OlmoeConfig", dict(_COMMON, intermediate_size=128, num_experts=E, num_key_value_heads=2,
                                  eos_token_id=None, pad_token_id=None, bos_token_id=None)),
}
BF16_CONTROL = "moe_fp4_test_bf16"   # the same routing and combine, bf16 GEMMs
ALL_EXPERTS_FUNCTIONS.register(BF16_CONTROL, hf_experts._forward(BF16_CONTROL, Precision.BF16))
IMPLS = (BF16_CONTROL, "moe_fp4_fp8", "moe_fp4")

# Experts module against the float64 reference (SQNR, dB; T = 96 tokens, 1 slot in 8 sent to no expert here).
# Measured on CPU (2026-11-28), lowest / highest over the five families:
#   bf16 control: out 46.4, dx 46.0, dweights 46.7, dW13 46.9, dW2 46.9 (lowest; transformers' bf16 grouped_mm
#                 on the same inputs: 45.9, 45.1, 45.9, 45.9, 45.9: bf16 rounding of inputs and outputs);
#   moe_fp4_fp8:  out 23.4 / 23.8, dx 23.6 / 23.8, dweights 23.6 / 24.5, dW13 23.6 / 23.7, dW2 23.5 / 23.7;
#   moe_fp4:      out 23.4 / 23.8, dx 17.3 / 17.6, dweights 14.6 / 16.3, dW13 15.1 / 15.2, dW2 16.4 / 16.5
#                 (MXFP4 kept: the SwiGLU backward and the weight gradients read the kept activations).
# Floors 1 dB under the lowest; ceilings 1 dB over the highest for the FP8 paths (bf16 GEMMs sit at ~46 dB).
MODULE_FLOOR_DB = {
    BF16_CONTROL: dict(out=45.4, dx=45.0, dweights=45.7, dw13=45.9, dw2=45.9),
    "moe_fp4_fp8": dict(out=22.4, dx=22.6, dweights=22.6, dw13=22.6, dw2=22.5),
    "moe_fp4": dict(out=22.4, dx=16.3, dweights=13.6, dw13=14.1, dw2=15.4),
}
MODULE_CEILING_DB = {
    "moe_fp4_fp8": dict(out=24.8, dx=24.8, dweights=25.5, dw13=24.7, dw2=24.7),
    "moe_fp4": dict(out=24.8, dx=18.6, dweights=17.3, dw13=16.2, dw2=17.5),
}


def _config(family: str, **change):
    cls, fields = FAMILIES[family]
    return getattr(transformers, cls)(**{**fields, **change})


def _model(family: str, impl: str, dtype=torch.bfloat16, **change):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(_config(family, **change), dtype=torch.float32,
                                                          experts_implementation=impl)
    return model.to(dtype)


def _experts(model):
    return model.model.layers[0].mlp.experts


def _reference(x, idx, w, w13, w2):
    """float64: sum over slots of w * down(silu(gate x) * up x), slots with idx >= E adding nothing."""
    x, w, w13, w2 = (t.double() for t in (x, w, w13, w2))
    f = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for e in range(w13.shape[0]):
        tok, slot = torch.where(idx == e)
        h = x[tok] @ w13[e].t()
        a = torch.nn.functional.silu(h[:, :f]) * h[:, f:]
        out = out.index_add(0, tok, w[tok, slot, None] * (a @ w2[e].t()))
    return out


def _module_inputs(hidden: int, tokens: int = 96):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(tokens, hidden, generator=g).bfloat16()
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    idx[torch.rand(tokens, K, generator=g) < 0.125] = E          # transformers' EP sentinel: no expert here
    w = torch.rand(tokens, K, generator=g).softmax(-1)
    return x, idx, w


@pytest.mark.parametrize("family", list(FAMILIES))
def test_experts_module_against_float64(family, references):
    experts = _experts(_model(family, "eager", dtype=torch.float32))
    x0, idx, w0 = _module_inputs(experts.gate_up_proj.shape[-1])
    w13, w2 = experts.gate_up_proj.detach(), experts.down_proj.detach()
    x, w = x0.double().requires_grad_(), w0.double().requires_grad_()
    rw13, rw2 = w13.double().requires_grad_(), w2.double().requires_grad_()
    ref = _reference(x, idx, w, rw13, rw2)
    gy = torch.randn(ref.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    ref.backward(gy)
    want = dict(out=ref.detach(), dx=x.grad, dweights=w.grad, dw13=rw13.grad, dw2=rw2.grad)
    for impl in IMPLS:
        mod = _experts(_model(family, impl))
        mod.gate_up_proj.data.copy_(w13)
        mod.down_proj.data.copy_(w2)
        xb, wb = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        out = mod(xb, idx, wb)
        assert out.dtype == torch.bfloat16 and out.shape == x0.shape
        out.backward(gy.bfloat16())
        got = dict(out=out.detach(), dx=xb.grad, dweights=wb.grad, dw13=mod.gate_up_proj.grad, dw2=mod.down_proj.grad)
        db = {k: sqnr_db(want[k].float(), got[k].float()) for k in want}
        print(family, impl, {k: round(v, 1) for k, v in db.items()})
        # the router weights of the dropped slots get no gradient
        assert torch.all(wb.grad[idx >= E] == 0), (family, impl)
        for k, v in db.items():
            assert v >= MODULE_FLOOR_DB[impl][k], (family, impl, k, db)
            if impl in MODULE_CEILING_DB:
                assert v <= MODULE_CEILING_DB[impl][k], (family, impl, k, db)


# The whole model (bf16 weights, batch 2 x 32) against the float32 eager model: the loss's relative error.
# Measured (CPU, 2026-11-28): 3.1e-5 (qwen3_moe), 2.9e-5 (mixtral), 7.4e-4 (deepseek_v3: its routed output
# scaled by 2.5), 3.5e-5 (qwen2_moe), 1.6e-4 (olmoe); bf16 grouped_mm: 9e-6 to 8.4e-5. Logits SQNR measured
# 21.4 (deepseek_v3) to 40.3 dB; floors 1 dB under each.
MODEL_LOSS_RTOL = 2e-3
MODEL_LOGITS_FLOOR_DB = {"qwen3_moe": 38.8, "mixtral": 36.3, "deepseek_v3": 20.4, "qwen2_moe": 39.3, "olmoe": 35.9}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_whole_model(family, references):
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(1))
    ref = _model(family, "eager", dtype=torch.float32)(ids, labels=ids)
    logits = {}
    for impl in ("moe_fp4_fp8", "moe_fp4"):
        model = _model(family, impl)
        assert model.config._experts_implementation == impl
        assert hf_experts.check_experts(model, impl) == 2          # both layers' experts
        out = model(ids, labels=ids)
        out.loss.backward()
        logits[impl] = out.logits.detach()
        db = sqnr_db(ref.logits.detach().float(), logits[impl].float())
        print(family, impl, f"loss {out.loss.item():.6f} vs {ref.loss.item():.6f}, logits {db:.1f} dB")
        assert abs(out.loss.item() - ref.loss.item()) <= MODEL_LOSS_RTOL * ref.loss.item(), (family, impl)
        assert db >= MODEL_LOGITS_FLOOR_DB[family], (family, impl, db)
        grads = [p.grad for n, p in model.named_parameters() if ".experts." in n]
        assert len(grads) == 4 and all(g is not None and torch.isfinite(g).all() for g in grads), (family, impl)
    # fp4 and fp8 run the same forward: they differ only in what backward reads
    assert torch.equal(logits["moe_fp4"], logits["moe_fp4_fp8"]), family


@pytest.mark.parametrize("family, change, why", [
    ("qwen3_moe", dict(moe_intermediate_size=96), "multiples of 128"),
    ("qwen3_moe", dict(hidden_act="gelu"), "not SiLU"),
    ("mixtral", dict(hidden_act="relu"), "not SiLU"),
])
def test_unfit_experts_refused_before_any_work(family, change, why):
    model = _model(family, "moe_fp4", **change)
    with pytest.raises(ValueError, match=why):
        hf_experts.check_experts(model)
    experts = _experts(model)
    h = experts.gate_up_proj.shape[-1]
    x, idx, w = _module_inputs(h, 8)
    with pytest.raises(ValueError, match=why):
        experts(x, idx, w)


def test_gpt_oss_refused():
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=E,
                                    num_experts_per_tok=K, layer_types=["full_attention"])
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, experts_implementation="moe_fp4")
    with pytest.raises(ValueError, match="GptOssExperts.*biases"):
        hf_experts.check_experts(model)


def test_float32_activations_refused():
    experts = _experts(_model("qwen3_moe", "moe_fp4", dtype=torch.float32))
    x, idx, w = _module_inputs(128, 8)
    with pytest.raises(ValueError, match="bfloat16 activations"):
        experts(x.float(), idx, w)


def test_fp8_weights_once_per_optimizer_step(monkeypatch, references):
    """Two AdamW steps of two micro-batches each: each expert weight quantized once per step (forward,
    backward and the second micro-batch reuse it), again after each step."""
    from moe_fp4.gemm.engines import FP8WeightCache
    from moe_fp4.model import experts as experts_mod

    cache = FP8WeightCache()
    monkeypatch.setattr(experts_mod, "FP8_WEIGHTS", cache)
    model = _model("qwen3_moe", "moe_fp4", dtype=torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(2))
    weights = 2 * 2   # two layers, gate_up_proj and down_proj each
    for step in range(2):
        for micro in range(2):
            model(ids[micro:micro + 1], labels=ids[micro:micro + 1]).loss.backward()
        assert cache.misses == weights * (step + 1), (step, cache.misses, cache.hits)
        opt.step()
        opt.zero_grad()


_PROBE = ("import os, sys; {before}import {first}; imported = 'transformers' in sys.modules; import {second}; "
          "from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS as F; "
          "from moe_fp4.kernels import gluon_grouped_gemm as g; "
          "print(imported, 'moe_fp4' in F, 'moe_fp4_fp8' in F, g.AVAILABLE)")
# The second order also runs as tests/distributed.py's ranks do: Triton imported under TRITON_INTERPRET=1, then
# the interpreter turned off, where Gluon's import asserts: moe_fp4 must still import and register (on the
# Triton engine).
_INTERPRETER_OFF = "import triton; os.environ['TRITON_INTERPRET'] = '0'; "


@pytest.mark.parametrize("first, second, before", [("moe_fp4", "transformers.integrations.moe", ""),
                                                   ("transformers.integrations.moe", "moe_fp4", _INTERPRETER_OFF)],
                         ids=["moe_fp4-first", "transformers-first-interpreter-off"])
def test_registered_whichever_is_imported_first(first, second, before):
    """Both names registered in either order; ``import moe_fp4`` alone does not import transformers."""
    env = dict(os.environ, TRITON_INTERPRET="1" if before else "0")
    run = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c",
                          _PROBE.format(first=first, second=second, before=before)],
                         capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
    assert run.returncode == 0, run.stderr
    got = run.stdout.split()
    assert got[:3] == [str(first != "moe_fp4"), "True", "True"], run.stdout + run.stderr
    if before:
        assert got[3] == "False", run.stdout   # Gluon unusable in that process: the Triton engine


def test_model_compiles_fullgraph_with_the_eager_bits(references):
    # A transformers model on moe_fp4's experts compiles as one on "grouped_mm" does: fullgraph=True (a graph
    # break is an error), the loss and the expert weights' gradients those of the eager model, bit for bit.
    # "moe_fp4_fp8" runs the same op pair in another precision (tests/model/test_compile.py covers all three).
    model = _model("qwen3_moe", "moe_fp4")
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))

    def step(fn):
        model.zero_grad(set_to_none=True)
        out = fn(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), _experts(model).gate_up_proj.grad, _experts(model).down_proj.grad

    eager = step(model)
    torch._dynamo.reset()
    compiled = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    for a, b in zip(eager, compiled):
        assert not a.isnan().any() and torch.equal(a, b)
