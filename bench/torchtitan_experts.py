"""torchtitan's own DeepSeek-V3 model trained with each experts implementation (issue 48): tokens/s, peak and
activation memory and the loss curve, one GPU, the same model, weights and batches for every variant.

Variants (``--variants``): ``bf16`` (torchtitan's GroupedExperts: torch's bf16 ``_grouped_mm``), ``torchao``
(torchtitan's own ``Float8GroupedExpertsConverter``: torchao's FP8 row-wise grouped GEMMs, groups padded to 16;
torchtitan recommends compiling it), ``moe_fp4_fp8`` and ``moe_fp4`` (:class:`moe_fp4.integrations.torchtitan.
GroupedExpertsConverter` with precision fp8 / fp4). ``--compile`` compiles each layer of every variant as
torchtitan's trainer does (per block; moe_fp4's blocks with ``fullgraph=True``, as its converter allows without
EP). Each model
is built from torchtitan's DeepSeek-V3 layer builder with its converter applied to the model config as
``model_registry(..., converters=[...])`` does; attention is torch's SDPA (causal) in every variant, so only the
experts differ; byte tokens from Python's standard library (vocab 256); weights in bf16; torch's AdamW (fused on
CUDA, ``--adamw``); a plain loop (forward, cross entropy, backward, step). ``--shape dsv3``: DeepSeek-V3's layer
(hidden 7168, MLA with 128 heads, q LoRA 1536, kv LoRA 512) with 32 experts of ffn 2048, top-8, a shared expert,
``--layers`` MoE layers; ``--shape small``: hidden 1024, 16 heads, 16 experts of 512, top-4, 6 layers; ``--shape
tiny``: a CPU smoke run.

Per variant as bench/hf_experts.py (bench/stack_loop.py): warmup, timed steps, the forward + backward peak,
saved activations, FP8 weight copies (moe_fp4: ``FP8_PAIRS.nbytes``), peak with AdamW, the loss curve.

    python bench/torchtitan_experts.py --shape dsv3 --json tt_dsv3.json
    python bench/torchtitan_experts.py --shape dsv3 --compile --variants bf16 torchao --json tt_dsv3_compiled.json
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
from stack_loop import add_common_args, bench_main, guarded, profile_table, train_variant  # noqa: E402
from torchtitan_compat import import_torchtitan  # noqa: E402

SHAPES = {
    "dsv3": dict(dim=7168, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, moe_hidden_dim=2048, num_experts=32,
                 top_k=8, score="sigmoid", route_scale=2.5),
    "small": dict(dim=1024, n_heads=16, q_lora_rank=0, kv_lora_rank=512, moe_hidden_dim=512, num_experts=16, top_k=4,
                  score="softmax", route_scale=1.0),
    "tiny": dict(dim=256, n_heads=4, q_lora_rank=0, kv_lora_rank=128, moe_hidden_dim=256, num_experts=8, top_k=2,
                 score="softmax", route_scale=1.0),
}
DEFAULT_LAYERS = {"dsv3": 3, "small": 6, "tiny": 2}
VOCAB = 256


def model_config(shape: str, layers: int, converters):
    """torchtitan's DeepSeek-V3 model config at ``shape`` (its own layer builder and inits: the private helpers
    of torchtitan.models.deepseek_v3 0.3.0), every layer a MoE layer, the converters applied to the config."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import (
        _EMBEDDING_INIT,
        _NORM_INIT,
        DeepSeekV3Model,
        _build_dsv3_layers,
        _output_linear_init,
    )

    s = SHAPES[shape]
    rope = ComplexRoPE.Config(dim=64, max_seq_len=16384, theta=10000.0, scaling="yarn", rope_factor=40.0,
                              beta_fast=32.0, beta_slow=1.0, original_seq_len=4096)
    blocks = _build_dsv3_layers(n_layers=layers, n_dense_layers=0, dim=s["dim"], n_heads=s["n_heads"],
                                q_lora_rank=s["q_lora_rank"], kv_lora_rank=s["kv_lora_rank"], qk_nope_head_dim=128,
                                qk_rope_head_dim=64, v_head_dim=128, mscale=1.0, dense_hidden_dim=4 * s["dim"],
                                moe_hidden_dim=s["moe_hidden_dim"], num_experts=s["num_experts"], num_shared_experts=1,
                                router_top_k=s["top_k"], router_score_func=s["score"],
                                router_route_scale=s["route_scale"], router_route_norm=True, attn_backend="flex",
                                moe_comm_backend="standard", non_blocking_capacity_factor=None, rope=rope)
    config = DeepSeekV3Model.Config(
        vocab_size=VOCAB, dim=s["dim"],
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=s["dim"], param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=s["dim"], param_init=_NORM_INIT),
        lm_head=Linear.Config(in_features=s["dim"], out_features=VOCAB, param_init=_output_linear_init(s["dim"])),
        layers=blocks)
    # SDPA (causal) in every variant: the same attention whatever the experts, no flex-attention compile.
    for _, _, parent, attr in list(config.traverse(FlexAttention.Config)):
        setattr(parent, attr, ScaledDotProductAttention.Config())
    for c in converters:
        config = c.build().convert(config)
    return config


def converters_of(variant: str):
    if variant == "bf16":
        return []
    if variant == "torchao":
        from torchtitan.components.quantization.float8 import Float8GroupedExpertsConverter

        return [Float8GroupedExpertsConverter.Config()]
    from moe_fp4.integrations.torchtitan import GroupedExpertsConverter

    return [GroupedExpertsConverter.Config(precision={"moe_fp4_fp8": "fp8", "moe_fp4": "fp4"}[variant])]


def build_model(shape: str, layers: int, variant: str, device) -> torch.nn.Module:
    """The variant's model on ``device``, seeded, torchtitan's inits, bf16 weights (and real buffers); the RoPE
    cache stays complex (a .to(bfloat16) would drop its imaginary part), as under torchtitan's FSDP mixed
    precision, which casts parameters only."""
    config = model_config(shape, layers, converters_of(variant))
    torch.manual_seed(0)
    with torch.device(device):
        model = config.build()
        model.init_weights()
    return model._apply(lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t)


def run(variant: str, a, data, device) -> dict:
    from moe_fp4.integrations.torchtitan import FP8_PAIRS

    def measured():
        model = build_model(a.shape, a.layers, variant, device).train()
        if a.compile:
            for block in model.layers.values() if hasattr(model.layers, "values") else model.layers:
                block.compile(fullgraph=variant.startswith("moe_fp4"))
        seq = data.shape[2] - 1
        positions = torch.arange(seq, device=device).repeat(data.shape[1], 1)

        def loss_of(ids):
            logits = model(ids[:, :-1], attention_masks=None, positions=positions)
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())

        row = train_variant(variant, model, loss_of, data, a.warmup, a.steps, a.lr,
                            fp8_copies=lambda: FP8_PAIRS.nbytes, progress=a.progress,
                            tokens_per_step=data.shape[1] * seq, adamw=a.adamw)
        row["compiled"] = bool(a.compile)
        if a.profile:
            row["profile"] = profile_table(model, loss_of, data, a.lr, a.profile, a.adamw)
        return row

    row = guarded(variant, measured, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, SHAPES)
    # torchao last: a variant that fails cannot leave anything behind for the others (left_by_earlier_gib)
    p.add_argument("--variants", nargs="+", default=["bf16", "moe_fp4_fp8", "moe_fp4", "torchao"])
    p.add_argument("--compile", action="store_true", help="compile each layer of every variant")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N training steps per variant (the table goes to --json)")
    a = p.parse_args(argv)
    a.layers = a.layers or DEFAULT_LAYERS[a.shape]
    # torchtitan 0.3.0 imports names an older torch lacks (FSDP's, unused on one GPU): stand-ins that raise if used
    stood_in = import_torchtitan("torchtitan.models.deepseek_v3", "torchtitan.components.quantization.float8",
                                 "moe_fp4.integrations.torchtitan")
    title = (f"torchtitan DeepSeek-V3 {a.shape} x {a.layers} MoE layers"
             + (", every layer compiled" if a.compile else ""))
    if stood_in:
        title += f" (this torch lacks {', '.join(stood_in)}: stand-ins from bench/torchtitan_compat.py)"
    # one token more a row: the inputs are its first seq tokens, the targets its last seq
    return bench_main("torchtitan_experts.py", a, title, a.variants, run, bf16="bf16", seq_extra=1)


if __name__ == "__main__":
    raise SystemExit(main())
