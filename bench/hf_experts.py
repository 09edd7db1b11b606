"""Hugging Face transformers' own MoE model trained with each experts implementation (issue 48): tokens/s, peak
and activation memory and the loss curve, one GPU, the same model, weights and batches for every variant.

Variants (``--impls``): ``grouped_mm`` (transformers' default BF16 experts: ``torch._grouped_mm``), ``moe_fp4_fp8``
and ``moe_fp4`` (moe_fp4's experts implementations: FP8 GEMMs with FP8 / MXFP4 activations kept), and on request
``torchao`` (transformers' grouped_mm with torchao's FP8 grouped GEMMs: ``quantize_(Float8TrainingOpConfig())``
on the experts modules). torchao does not apply here: its FP8 grouped GEMM needs every expert's token count a
multiple of 16, which torchtitan's permutation pads to and transformers' does not; on an H200 (torch 2.11,
torchao 0.18) its first backward ends in a device-side assert (`_scaled_grouped_mm`: "expected input tensor
dynamic dimension byte size to be non-negative multiple of 16"), which leaves the process's CUDA context
unusable, so it is not in the default list. torchao's FP8 experts are measured against moe_fp4's in
bench/experts.py (the experts alone) and bench/torchao_ep.py (torchtitan's EP block). The model is transformers'
Qwen3-MoE built from a config (no download) with byte tokens from Python's standard library
(:func:`moe_fp4.compare.data.stdlib_corpus`); weights in bf16, torch's AdamW (fused on CUDA, ``--adamw``), a plain
training loop (forward with labels, backward, step). ``--shape dsv3``: DeepSeek-V3's expert shapes (hidden 7168,
expert ffn 2048, 32 experts, top-8, 56 heads of 128) in ``--layers`` layers; ``--shape small``: hidden 1024, expert
ffn 512, 16 experts, top-4, 6 layers.

Per variant: ``--warmup`` untimed steps, then ``--steps`` timed (each step's loss read: one sync per step in
every variant). Memory: the peak over the timed steps (AdamW's temporaries included); fwd+bwd, the peak
of forward and backward less what was allocated before the forward (weights, optimizer state), which holds
the saved activations, the gradients and, in moe_fp4's variants, the FP8 copies of the expert weights
(``fp8 W``, made in the first forward after each optimizer step); saved, the bytes autograd keeps from one
forward (activations, counted once per storage by a saved-tensor hook, weights excluded): what MXFP4 storage
shrinks. On CPU ``--shape tiny`` is a smoke run (no memory numbers). Printed: a table with tokens/s,
ratios against grouped_mm and moe_fp4_fp8, memory, the first and last losses; ``--json``: everything,
with each variant's loss curve.

    python bench/hf_experts.py --shape dsv3 --json hf_dsv3.json
    python bench/hf_experts.py --shape small --batch 16 --json hf_small.json
    python bench/hf_experts.py --shape small --batch 16 --compile --json hf_small_compiled.json
    python bench/hf_experts.py --shape small --batch 16 --compile-mode reduce-overhead   # CUDA graphs
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
from stack_loop import add_common_args, bench_main, guarded, profile_table, train_variant  # noqa: E402

SHAPES = {
    "dsv3": dict(hidden_size=7168, moe_intermediate_size=2048, intermediate_size=18432, num_experts=32,
                 num_experts_per_tok=8, num_attention_heads=56, num_key_value_heads=8, head_dim=128),
    "small": dict(hidden_size=1024, moe_intermediate_size=512, intermediate_size=2816, num_experts=16,
                  num_experts_per_tok=4, num_attention_heads=8, num_key_value_heads=8, head_dim=128),
    "tiny": dict(hidden_size=128, moe_intermediate_size=128, intermediate_size=256, num_experts=4,
                 num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}
DEFAULT_LAYERS = {"dsv3": 3, "small": 6, "tiny": 2}


def build(shape: str, layers: int, seq: int, impl: str, device):
    import transformers

    import moe_fp4  # noqa: F401 - registers moe_fp4's experts implementations

    cfg = transformers.Qwen3MoeConfig(vocab_size=256, num_hidden_layers=layers, max_position_embeddings=seq,
                                      decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
                                      **SHAPES[shape])
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(
            cfg, dtype=torch.bfloat16, experts_implementation="grouped_mm" if impl == "torchao" else impl)
    if impl == "torchao":
        from torchao.prototype.moe_training.config import Float8TrainingOpConfig
        from torchao.quantization import quantize_

        quantize_(model, Float8TrainingOpConfig(), filter_fn=lambda mod, fqn: fqn.endswith("mlp.experts"))
    return model.train()


def run(impl: str, a, data, device) -> dict:
    from moe_fp4.gemm.engines import FP8_WEIGHTS

    def measured():
        model = build(a.shape, a.layers, a.seq, impl, device)
        # --compile: the whole model with fullgraph=True, which every variant here compiles under
        forward = torch.compile(model, fullgraph=True, mode=a.compile_mode) if a.compile else model

        def loss_of(ids):
            if a.compile_mode == "reduce-overhead":
                torch.compiler.cudagraph_mark_step_begin()   # the last step's graph outputs are dead by now
            return forward(ids, labels=ids).loss

        out = train_variant(impl, model, loss_of, data, a.warmup, a.steps, a.lr,
                            fp8_copies=lambda: FP8_WEIGHTS.nbytes, progress=a.progress, adamw=a.adamw)
        if a.profile:
            out["profile"] = profile_table(model, lambda ids: model(ids, labels=ids).loss, data, a.lr, a.profile,
                                           a.adamw)
        out["compiled"] = (a.compile_mode or "default") if a.compile else False
        return out

    row = guarded(impl, measured, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()   # the variant's model went with measured()'s frame
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(p, SHAPES)
    p.add_argument("--impls", nargs="+", default=["grouped_mm", "moe_fp4_fp8", "moe_fp4"])
    p.add_argument("--compile", action="store_true",
                   help="torch.compile(fullgraph=True) the model in every variant (the baseline compiled too)")
    p.add_argument("--compile-mode", default=None, choices=["reduce-overhead", "max-autotune-no-cudagraphs"],
                   help="torch.compile's mode (implies --compile); reduce-overhead replays each step as CUDA graphs")
    p.add_argument("--profile", type=int, default=0, metavar="N",
                   help="also profile N training steps per variant (the table goes to --json)")
    a = p.parse_args(argv)
    a.layers = a.layers or DEFAULT_LAYERS[a.shape]
    a.compile = a.compile or a.compile_mode is not None
    return bench_main("hf_experts.py", a, f"Qwen3-MoE {a.shape} x {a.layers} layers", a.impls, run, bf16="grouped_mm")


if __name__ == "__main__":
    raise SystemExit(main())
