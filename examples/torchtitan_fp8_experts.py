"""torchtitan's DeepSeek-V3 debug model with its MoE experts on moe_fp4's FP8 engine, a few training steps.

    python examples/torchtitan_fp8_experts.py                     # fp8 (DeepSeek-V3's FP8 recipe)
    python examples/torchtitan_fp8_experts.py --precision fp4     # the same GEMMs, activations kept in MXFP4

In a torchtitan training config the converter is one entry of the model registry's ``converters`` list,
as torchtitan's own ``deepseek_v3_debugmodel_mxfp8`` names its MXFP8 converter::

    config.model_spec = model_registry("debugmodel", converters=[GroupedExpertsConverter.Config(precision="fp8")])

(``--module moe_fp4.integrations.torchtitan --config deepseek_v3_debugmodel_fp8_experts`` is that config.)
This example builds its model the same way: torchtitan's ``model_registry("debugmodel", converters=[...])``
(6 layers, dim 256, 8 experts of ffn 256, top-3, 2 shared experts), the converter applied by torchtitan.
It then trains the converted and the unconverted model from the same initial weights on the same
batch (a learnable pattern: each token is the previous one + 1) with torch's AdamW, and prints both
losses per step, and how many FP8 weight pairs the converted experts built (2 per MoE layer per step:
[w1; w3] and w2, none again in backward).

torchtitan's own Trainer is not run: on a machine without an accelerator it picks "cuda" for its device,
and its debug configs read a tokenizer and the c4_test data set from torchtitan's repository, which its
wheel does not ship. On CPU, torch's SDPA replaces flex attention (which has no CPU backward); nothing
else changes. On CPU the FP8 GEMMs are emulated (exact dequantization, float32 matmuls); on a Hopper GPU
the same code runs moe_fp4's grouped FP8 kernels (``--device cuda``; not run by CI).
"""

from __future__ import annotations

import argparse
import time

import torch

from moe_fp4.compare.quiet import quiet_third_party

# torchtitan imports torchao, which reports the prebuilt extensions it cannot load here and its enums'
# pytree registration: known-harmless lines, dropped while the example runs (nothing else is).
with quiet_third_party():
    from moe_fp4.integrations.torchtitan import FP8_PAIRS, GroupedExpertsConverter


def build(converters, device: str):
    """torchtitan's deepseek_v3 debug model, built from its own registry with ``converters``."""
    from torchtitan.models.deepseek_v3 import model_registry

    spec = model_registry("debugmodel", converters=converters)
    if device == "cpu":   # flex attention has no CPU backward: torch's SDPA (causal, no masks) instead
        from torchtitan.models.common.attention import FlexAttention, ScaledDotProductAttention

        for _, _, parent, attr in list(spec.model.traverse(FlexAttention.Config)):
            setattr(parent, attr, ScaledDotProductAttention.Config())
    torch.manual_seed(0)
    with torch.device(device):
        model = spec.model.build()
        model.init_weights()
    return spec, model


def batch(args, vocab: int, device: str) -> torch.Tensor:
    """[batch, seq + 1] token ids: random starts, then each token the previous one + 1 (mod vocab)."""
    g = torch.Generator().manual_seed(1000)
    start = torch.randint(0, vocab, (args.batch, 1), generator=g)
    return ((start + torch.arange(args.seq + 1)) % vocab).to(device)


def train(model, args, vocab: int, device: str) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    positions = torch.arange(args.seq, device=device).repeat(args.batch, 1)
    # what torchtitan's trainer passes flex attention (SDPA, on CPU, takes none)
    masks = None if device == "cpu" else model.get_attention_masks(positions=positions)
    tokens = batch(args, vocab, device)   # one batch, every step: the loss falls within a few steps
    losses = []
    for _ in range(args.steps):
        logits = model(tokens[:, :-1], attention_masks=masks, positions=positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--precision", choices=("fp8", "fp4", "bf16"), default="fp8")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--device", default="cpu")
    args = p.parse_args()

    ref_spec, ref = build(None, args.device)
    spec, model = build([GroupedExpertsConverter.Config(precision=args.precision)], args.device)
    model.load_state_dict(ref.state_dict())   # the same parameters and keys: one checkpoint serves both
    experts = sorted({type(m).__name__ for n, m in model.named_modules() if n.endswith("inner_experts")})
    vocab = ref_spec.model.vocab_size
    print(f"torchtitan {spec.name} {spec.flavor}: experts {experts}, precision {args.precision}")

    t = time.perf_counter()
    ref_losses = train(ref, args, vocab, args.device)
    t_ref = time.perf_counter() - t
    builds = FP8_PAIRS.builds
    t = time.perf_counter()
    losses = train(model, args, vocab, args.device)
    t_conv = time.perf_counter() - t
    for step, (a, b) in enumerate(zip(ref_losses, losses)):
        print(f"step {step}: loss unconverted {a:.4f}, converted ({args.precision}) {b:.4f}, "
              f"relative difference {abs(b - a) / a:.1e}")
    print(f"FP8 weight copies built: {FP8_PAIRS.builds - builds} over {args.steps} steps; "
          f"time {t_ref:.1f} s unconverted, {t_conv:.1f} s converted")


if __name__ == "__main__":
    with quiet_third_party():   # and torchtitan's router on CPU, where autocast declines float32
        main()
