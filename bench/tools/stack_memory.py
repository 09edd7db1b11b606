"""Where a torchtitan experts variant's GPU memory goes: torch's allocator history over four training steps of
bench/torchtitan_experts.py's model, the live allocations at the start of step 4 and after its backward
grouped by the code that made them (moe_fp4, torchtitan, torch.optim, torch.nn frames).

    python bench/tools/stack_memory.py --variant fp8 --layers 1     # fp8 | fp4 | bf16 (torchtitan's own)

Used to find what the moe_fp4 variants held that bf16 did not (bench/RESULTS.md, "2026-11-28, torchtitan")."""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))   # bench/, also under python -P
import stack_loop  # noqa: E402
import torchtitan_experts  # noqa: E402
from torchtitan_compat import import_torchtitan  # noqa: E402

GiB = 2**30
KEEP = ("moe_fp4", "torchtitan", "torch/optim", "torch/nn", "stack_memory")


def by_site(tag: str, rows: int = 12) -> None:
    agg = collections.Counter()
    for seg in torch.cuda.memory._snapshot()["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                frames = [f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in b.get("frames", [])
                          if any(k in f["filename"] for k in KEEP)][:3]
                agg[" < ".join(frames) or "?"] += b["size"]
    print(f"--- {tag}: allocated {torch.cuda.memory_allocated() / GiB:.2f} GiB")
    for site, n in agg.most_common(rows):
        print(f"  {n / GiB:7.2f} GiB  {site}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--variant", choices=("bf16", "fp8", "fp4"), default="fp8")
    p.add_argument("--shape", choices=list(torchtitan_experts.SHAPES), default="dsv3")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    a = p.parse_args()
    print("stand-ins:", import_torchtitan("torchtitan.models.deepseek_v3", "moe_fp4.integrations.torchtitan"))
    torch.cuda.memory._record_memory_history(max_entries=200000)
    variant = {"bf16": "bf16", "fp8": "moe_fp4_fp8", "fp4": "moe_fp4"}[a.variant]
    model = torchtitan_experts.build_model(a.shape, a.layers, variant, "cuda")
    print(f"parameters {sum(p.numel() * p.element_size() for p in model.parameters()) / GiB:.2f} GiB")
    data = stack_loop.stdlib_batches(a.batch, a.seq + 1, 4, "cuda")
    positions = torch.arange(a.seq, device="cuda").repeat(a.batch, 1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = None
    for step in range(4):
        if step == 3:
            by_site("step 4 start")
            del loss   # the last step's graph: what its nodes keep outside saved tensors
            print(f"after dropping the last step's loss: {torch.cuda.memory_allocated() / GiB:.2f} GiB")
        ids = data[step]
        logits = model(ids[:, :-1], attention_masks=None, positions=positions)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())
        loss.backward()
        if step == 3:
            by_site("step 4 after backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"step {step + 1}: after the optimizer {torch.cuda.memory_allocated() / GiB:.2f} GiB, "
              f"peak {torch.cuda.max_memory_allocated() / GiB:.2f} GiB")


if __name__ == "__main__":
    main()
