"""The saved-tensor hook on real Hugging Face transformers MoE models (tiny configs, random weights, no
downloads): Mixtral and Qwen3-MoE, each with the ``eager`` and ``grouped_mm`` experts implementations,
bf16. One training step with the hook against the same step without it.

The conversions run as the pure-torch references (helpers.torch_references): these tests are about the hook
on real models, and the Triton kernels under the interpreter made each one 20-50 s on the 2-core CI machine."""

from __future__ import annotations

import pytest
import torch
from optional_stacks import import_or_skip

transformers = import_or_skip("transformers")

from helpers import (  # noqa: E402  (sqnr_db fails on NaN / Inf: docs/testing.md)
    in_band,
    sqnr_db,
    torch_references,  # noqa: E402
)

from moe_fp4.saved import packing as H  # noqa: E402
from moe_fp4.saved.hook import CompressionConfig, register_activation_compression  # noqa: E402

# Measured on this configuration (torch 2.13 CPU, transformers 5.x, seed 0, the four cases): all parameter
# gradients together 32.2-36.8 dB; the worst single parameter 15.1-15.8 dB (an expert weight or the router:
# their gradients come straight from MXFP4 activations, near the round-trip SQNR of E2M1 blocks).
# Ceilings about 1 dB over the highest (remeasured 2026-11-27: 32.24-36.76 and 15.11-15.76 dB): a hook that
# kept the activations in a finer format than MXFP4 (or not at all) measures above them.
GRAD_SQNR_DB = 27.0
PARAM_GRAD_SQNR_DB = 11.0
GRAD_SQNR_CEILING_DB = 37.8
PARAM_GRAD_SQNR_CEILING_DB = 16.8
# Bytes stored for the expert modules' saved float activations over their bf16 bytes (compressed at
# 17/64 = 0.266, plus the few small tensors passed through). Measured 0.280-0.284.
STORED_RATIO_MAX = 0.30
CONFIG = CompressionConfig(min_numel=256)
LAYERS = 2


@pytest.fixture(autouse=True, scope="module")
def _references():
    with torch_references():
        yield


CASES = [(arch, impl) for arch in ("mixtral", "qwen3_moe") for impl in ("eager", "grouped_mm")]


def build(arch: str, impl: str, dtype=torch.bfloat16):
    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    if arch == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    else:
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128, head_dim=16)
    cfg = transformers.AutoConfig.for_model(arch, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=impl, dtype=dtype)
    assert model.config._experts_implementation == impl
    return model


def batch():
    return torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))


def step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def flat(grads, names):
    return torch.cat([grads[n].float().flatten() for n in names])


@pytest.mark.parametrize("arch,impl", CASES)
def test_training_step_with_hook(arch, impl, monkeypatch):
    model = build(arch, impl)
    ids = batch()
    ref_loss, ref = step(model, ids)

    packed = []
    real_quantize = H.quantize_mxfp4

    def spy(x):
        q = real_quantize(x)
        packed.append((x.numel() * x.element_size(), q.data.nbytes + q.scale.nbytes))
        return q

    monkeypatch.setattr(H, "quantize_mxfp4", spy)
    handle = register_activation_compression(model, CONFIG)
    assert handle.modules == [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]
    loss, got = step(model, ids)

    assert torch.equal(loss, ref_loss), "the forward pass must not change"
    names = sorted(ref)
    assert sorted(got) == names
    total_db = sqnr_db(flat(ref, names), flat(got, names), "all gradients")
    # helpers.sqnr_db fails on a NaN gradient, so min() sees no nan
    worst_db, worst = min((sqnr_db(ref[n].float(), got[n].float(), n), n) for n in names)
    print(f"\n{arch} {impl}: grads {total_db:.1f} dB, worst {worst_db:.1f} dB ({worst})")
    in_band(total_db, GRAD_SQNR_DB, GRAD_SQNR_CEILING_DB, "all gradients")
    in_band(worst_db, PARAM_GRAD_SQNR_DB, PARAM_GRAD_SQNR_CEILING_DB, f"worst parameter gradient ({worst})")

    st = handle.stats.total
    assert st.compressed == len(packed) > 0
    assert st.bytes_before == sum(b for b, _ in packed)
    assert st.bytes_after == sum(a for _, a in packed)
    assert st.seen == st.compressed + st.shared + sum(st.skipped.values())
    assert set(st.skipped) <= {"parameter", "non_float", "small", "no_saving"}
    ratio = (st.bytes_after + st.bytes_skipped) / (st.bytes_before + st.bytes_skipped)
    print(f"{arch} {impl}: stored {ratio:.3f}x of bf16, stats {st}")
    assert ratio <= STORED_RATIO_MAX
    assert sum(s.compressed for s in handle.stats.modules.values()) == st.compressed
    assert all(s.compressed > 0 for s in handle.stats.modules.values())

    handle.remove()
    monkeypatch.undo()
    loss2, again = step(model, ids)
    assert torch.equal(loss2, ref_loss)
    for n in names:
        assert torch.equal(again[n], ref[n]), n
    assert len(packed) == st.compressed


def test_hook_with_gradient_checkpointing():
    """HF gradient checkpointing (non-reentrant) over the decoder layers, the hook on the experts inside:
    gradients are bit-identical to the hook without checkpointing."""
    model = build("mixtral", "grouped_mm")
    ids = batch()
    with register_activation_compression(model, CONFIG) as h:
        _, plain = step(model, ids)
        plain_stats = h.stats.total
    model.train()
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()
    with register_activation_compression(model, CONFIG) as h:
        _, ckpt = step(model, ids)
        assert h.stats.total == plain_stats
    for n in plain:
        assert torch.equal(plain[n], ckpt[n]), n


def test_keep_modules_on_hf_experts():
    """keep_modules keeps the activation function's input (the gate projection) in full precision."""
    model = build("qwen3_moe", "grouped_mm")
    ids = batch()
    with register_activation_compression(model, CompressionConfig(min_numel=256, keep_modules=("*.act_fn",))) as h:
        step(model, ids)
        assert h.kept == [f"model.layers.{i}.mlp.experts.act_fn" for i in range(LAYERS)]
        assert all(s.skipped.get("kept") == 1 for s in h.stats.modules.values())
