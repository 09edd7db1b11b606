"""MXFP4 storage of a Hugging Face MoE model's expert activations with one call, no model rewrite.

    python examples/hf_register_hooks.py                          # CPU in seconds, or CUDA if available
    python examples/hf_register_hooks.py --device cuda --hidden 1024 --layers 4 --experts 8 --seq 1024

Builds a small transformers Qwen3-MoE model from a config (random bf16 weights, no download) and runs:
  1. one training step (forward + backward) without the hook: the reference loss and gradients;
  2. the same step from the same weights under ``moe_fp4.register_activation_compression(model)``: the
     expert modules' saved activations, bf16 vs MXFP4 (from ``handle.stats``), and how close the
     gradients stay to the reference (SQNR per parameter group; the forward, hence the loss, is unchanged);
  3. a few AdamW steps with the hook on;
  4. ``handle.remove()``, the weights reset, and the step again: loss and gradients must be bit-identical
     to the reference (exit status 1 otherwise).
"""

from __future__ import annotations

import argparse
import sys

import torch

import moe_fp4
from moe_fp4.compare.quiet import quiet_third_party
from moe_fp4.formats.metrics import sqnr_db

# transformers' model code imports torchao where it is installed, which reports the prebuilt extensions it
# cannot load here and its enums' pytree registration: known-harmless lines, dropped (nothing else is).
with quiet_third_party():
    import transformers
    import transformers.modeling_utils


def build(a) -> torch.nn.Module:
    cfg = transformers.AutoConfig.for_model(
        "qwen3_moe", hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
        num_key_value_heads=max(1, a.heads // 4), head_dim=a.hidden // a.heads, vocab_size=a.vocab,
        max_position_embeddings=a.seq, num_experts=a.experts, num_experts_per_tok=a.topk,
        moe_intermediate_size=a.hidden, intermediate_size=a.hidden, norm_topk_prob=True)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="grouped_mm",
                                                          dtype=torch.bfloat16)
    return model.to(a.device).train()


def step(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward + backward from zeroed gradients -> (loss, {parameter name: gradient})."""
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][n], b[1][n]) for n in a[1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (also the expert FFN width)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=4)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--train-steps", type=int, default=3)
    a = p.parse_args()

    model = build(a)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1)).to(a.device)
    print(f"qwen3_moe on {a.device}: hidden {a.hidden}, {a.layers} layers, {a.experts} experts top-{a.topk}, "
          f"batch {a.batch} x seq {a.seq}, bf16, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M parameters")
    init = {k: v.clone() for k, v in model.state_dict().items()}

    ref = step(model, ids)
    # Kernels with atomics (e.g. on GPU) can make the reference itself differ run to run.
    reproducible = same(step(model, ids), ref)

    handle = moe_fp4.register_activation_compression(model)
    print(f"hooked {len(handle.modules)} expert modules: {', '.join(handle.modules)}")
    hooked = step(model, ids)
    st = handle.stats.total
    print(f"expert activations saved for backward: {st.bytes_before} bytes bf16 -> {st.bytes_after} bytes MXFP4 "
          f"({st.ratio:.3f}x) in {st.compressed} tensors; {st.bytes_skipped} bytes passed through uncompressed")
    saved = st.bytes_before - st.bytes_after
    print(f"memory saved: {saved} bytes ({saved / 2**20:.2f} MiB)")

    groups = {
        "expert weights": lambda n: any(n.startswith(m + ".") for m in handle.modules),
        "attention weights": lambda n: ".self_attn." in n,
        "all": lambda n: True,
    }
    for group, member in groups.items():
        names = sorted(n for n in ref[1] if member(n))
        flat = [torch.cat([g[1][n].float().flatten() for n in names]) for g in (ref, hooked)]
        print(f"gradient SQNR {group}: {sqnr_db(*flat):.1f} dB ({len(names)} tensors)")
    print(f"loss without hook {ref[0].item():.6f}, with hook {hooked[0].item():.6f}")

    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for i in range(a.train_steps):
        loss, _ = step(model, ids)
        opt.step()
        print(f"train step {i + 1} loss {loss.item():.6f}")

    handle.remove()
    with torch.no_grad():
        model.load_state_dict(init)
    identical = same(step(model, ids), ref)
    if identical:
        print("after handle.remove(): loss and gradients bit-identical to the unhooked step")
    elif not reproducible:
        print("after handle.remove(): not bit-identical, but the unhooked step is not reproducible on this device "
              "either (nondeterministic kernels), so bit-identity cannot be checked here")
    else:
        print("after handle.remove(): loss or gradients DIFFER from the unhooked step")
        sys.exit(1)


if __name__ == "__main__":
    main()
