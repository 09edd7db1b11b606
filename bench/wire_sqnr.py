"""SQNR of every wire format on tensors captured from the compare model: the rows each exchange of an
expert-parallel MoE layer would send (issue 27).

    python bench/wire_sqnr.py                          # tiny preset on CPU, small on a GPU
    python bench/wire_sqnr.py --preset small --train-steps 50 --json wire_sqnr.json

The model (``moe-fp4 compare``'s, bf16 mode, the default data) trains ``--train-steps`` AdamW steps,
then one more batch runs with hooks on every MoE layer. Captured per layer, as [tokens, H] rows:
``dispatch`` the MoE input (what the dispatch sends), ``combine`` the MoE output (at EP 1 the combine
rows are each token's sum over its experts: the layer's output), ``dispatch_grad`` the gradient of
the MoE input and ``combine_grad`` that of its output (what the two backward exchanges send). Each
is packed into every wire format and unpacked (``moe_fp4.exchange.wire``: the bytes that would travel), and
the table gives the SQNR in dB of the round trip against the float32 rows, the median over layers
(min, max), and the bytes per row at the model's H. The stochastic formats draw one sample each.

A second table measures NVFP4 -> FP8 1x128 (``moe_fp4.nvfp4_to_fp8``, what an FP8 GEMM would read from
NVFP4 rows; not exact in general) on the same rows: the share of nonzero NVFP4 values that the FP8 copy
changes, the share it flushes to zero, the median and largest relative change of the changed ones,
and the SQNR against the float32 rows of NVFP4 and of FP8-from-NVFP4 (medians over layers; the
largest change is the maximum).
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

import moe_fp4
from moe_fp4.compare.data import TokenBatches, stdlib_corpus
from moe_fp4.compare.origin import commit
from moe_fp4.exchange import wire as W
from moe_fp4.formats.metrics import sqnr_db
from moe_fp4.model.decoder import PRESETS, DecoderLM

FORMATS = ["bf16", "fp8", "mxfp4", "nvfp4", "mxfp4-sr", "nvfp4-sr"]
ROLES = ["dispatch", "combine", "dispatch_grad", "combine_grad"]


def capture(model: DecoderLM, ids: torch.Tensor, targets: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """One forward and backward with hooks on every MoE layer -> per layer {role: float32 [T, H]}."""
    caught: list[dict[str, torch.Tensor]] = []
    handles = []
    for moe in model.moe_layers():
        slot: dict[str, torch.Tensor] = {}
        caught.append(slot)

        def pre(_m, args, slot=slot):
            x = args[0]
            slot["dispatch"] = x.detach().reshape(-1, x.shape[-1]).float()
            if x.requires_grad:
                x.register_hook(lambda g, slot=slot: slot.__setitem__("dispatch_grad",
                                                                      g.reshape(-1, g.shape[-1]).float()))

        def post(_m, _args, y, slot=slot):
            slot["combine"] = y.detach().reshape(-1, y.shape[-1]).float()
            if y.requires_grad:
                y.register_hook(lambda g, slot=slot: slot.__setitem__("combine_grad",
                                                                      g.reshape(-1, g.shape[-1]).float()))

        handles += [moe.register_forward_pre_hook(pre), moe.register_forward_hook(post)]
    model(ids, targets).backward()
    for h in handles:
        h.remove()
    return caught


def round_trip(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 [T, H] -> the rows as they arrive through the ``fmt`` wire (bf16 rows packed)."""
    rows = x.to(torch.bfloat16).contiguous()
    return W.unpack(W.pack(rows, fmt), fmt, x.shape[1], "bf16", torch.float32)


def nvfp4_to_fp8_change(x: torch.Tensor) -> dict[str, float]:
    """float32 [T, H] rows -> how NVFP4 -> FP8 moves their NVFP4 values (module docstring)."""
    q = moe_fp4.quantize_nvfp4(x.to(torch.bfloat16).contiguous())
    v = q.dequantize(torch.float32)
    f = moe_fp4.dequantize_fp8(moe_fp4.nvfp4_to_fp8(q), torch.float32)
    nz = v != 0
    changed = nz & (f != v)
    rel = ((f - v).abs() / v.abs())[changed]
    n = max(int(nz.sum()), 1)
    return {"changed": int(changed.sum()) / n, "flushed": int((nz & (f == 0)).sum()) / n,
            "median_rel": float(rel.median()) if rel.numel() else 0.0,
            "max_rel": float(rel.max()) if rel.numel() else 0.0,
            "sqnr_nvfp4": sqnr_db(x, v), "sqnr_fp8_from_nvfp4": sqnr_db(x, f)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", choices=list(PRESETS), default=None, help="default: small on a GPU, tiny on CPU")
    p.add_argument("--train-steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    preset = a.preset or ("small" if device == "cuda" else "tiny")
    cfg = PRESETS[preset]
    torch.manual_seed(a.seed)
    model = DecoderLM(cfg, precision="bf16", device=device, seed=a.seed)
    data = TokenBatches(stdlib_corpus().train, cfg.seq, a.seed, 0, device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(a.train_steps):
        loss = model(*data.next(a.batch))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if step % 10 == 0 or step == a.train_steps - 1:
            print(f"train step {step + 1}/{a.train_steps}: loss {loss.item():.4f}", flush=True)
    W.seed_stochastic_rounding(a.seed)
    layers = capture(model, *data.next(a.batch))
    hidden = cfg.hidden
    results = {}
    print(f"\n{preset} (H = {hidden}), {len(layers)} MoE layers, {a.train_steps} training steps, device {device}, "
          f"commit {commit()}")
    print("| rows | " + " | ".join(f"{f} ({W.row_bytes(f, hidden)} B)" for f in FORMATS) + " |")
    print("| --- |" + " ---: |" * len(FORMATS))
    for role in ROLES:
        cells = []
        for fmt in FORMATS:
            vals = [sqnr_db(layer[role], round_trip(layer[role], fmt)) for layer in layers if role in layer]
            results[f"{role}/{fmt}"] = vals
            cells.append(f"{statistics.median(vals):.2f} ({min(vals):.2f}, {max(vals):.2f})")
        print(f"| {role} | " + " | ".join(cells) + " |")
    print("\nNVFP4 -> FP8 1x128 (nvfp4_to_fp8) on the same rows, medians over layers (largest change: maximum)")
    print("| rows | values changed | flushed to 0 | median change | largest change | SQNR nvfp4 "
          "| SQNR fp8 from nvfp4 |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    to_fp8 = {}
    for role in ROLES:
        per = [nvfp4_to_fp8_change(layer[role]) for layer in layers if role in layer]
        to_fp8[role] = per
        med = {k: statistics.median(d[k] for d in per) for k in per[0]}
        print(f"| {role} | {100 * med['changed']:.2f}% | {100 * med['flushed']:.4f}% | "
              f"{100 * med['median_rel']:.2f}% | {100 * max(d['max_rel'] for d in per):.2f}% | "
              f"{med['sqnr_nvfp4']:.2f} | {med['sqnr_fp8_from_nvfp4']:.2f} |")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"preset": preset, "hidden": hidden, "train_steps": a.train_steps, "batch": a.batch,
                       "device": device, "commit": commit(), "torch": torch.__version__,
                       "row_bytes": {f: W.row_bytes(f, hidden) for f in FORMATS}, "sqnr_db": results,
                       "nvfp4_to_fp8": to_fp8}, fh, indent=1)
        print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
