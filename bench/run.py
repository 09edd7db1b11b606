"""Formats and kernels at a glance (the main job is ``moe-fp4 compare``, which trains a model).

It compares the formats on one MoE-sized token batch (bytes per token on the wire and in storage,
round-trip error) for BF16, FP8 1x128 (the DeepSeek-V3 baseline) and MXFP4; on a GPU it times every
conversion kernel against a device copy of the same bytes (one shape). Then it runs the MoE layer
in bf16, fp8 (the baseline) and fp4 side by side (bench/moe_layer.py: step time, activation memory;
on a GPU the DeepSeek-V3-like config, on CPU a smoke run of the code paths). Training a whole model
in each mode, on one GPU or with expert parallelism under torchrun, is ``moe-fp4 compare``.

    python bench/run.py            # GPU if there is one, a small CPU run otherwise
    python bench/run.py --tokens 4096 --hidden 7168 --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys

import torch

import moe_fp4
from moe_fp4.formats.metrics import sqnr_db


def _run_script(path: str, args: list[str]) -> None:
    argv, sys.argv = sys.argv, [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
    except SystemExit as e:
        if e.code:
            raise
    finally:
        sys.argv = argv


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=None, help="rows (default: 8192 on GPU, 512 on CPU)")
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tokens = a.tokens or (8192 if device == "cuda" else 512)
    print(f"moe_fp4 {moe_fp4.__version__}  device={device}  batch={tokens}x{a.hidden} bf16 activations "
          f"(N(0,1) with x50 outlier channels)")

    g = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, a.hidden, generator=g)
    x[:, torch.randperm(a.hidden, generator=g)[: a.hidden // 16]] *= 50
    x = x.to(torch.bfloat16).to(device)

    fp8 = moe_fp4.quantize_fp8(x)
    mx = moe_fp4.quantize_mxfp4(x)
    mx_from_fp8 = moe_fp4.quantize_mxfp4(fp8)
    rows = [
        ("bf16", x.numel() * 2, math.inf),
        ("fp8 1x128 (baseline)", fp8.nbytes, sqnr_db(x, fp8.dequantize(torch.float32))),
        ("mxfp4 (from bf16)", mx.nbytes, sqnr_db(x, mx.dequantize(torch.float32))),
        ("mxfp4 (direct from fp8)", mx_from_fp8.nbytes, sqnr_db(x, mx_from_fp8.dequantize(torch.float32))),
    ]
    print(f"\n{'format':<26}{'bytes/token':>12}{'vs fp8':>9}{'SQNR dB':>10}")
    results = []
    for name, nbytes, snr in rows:
        per_tok = nbytes / tokens
        print(f"{name:<26}{per_tok:>12.0f}{per_tok / (fp8.nbytes / tokens):>9.3f}{snr:>10.2f}")
        results.append({"format": name, "bytes_per_token": per_tok, "sqnr_db": snr})

    col = moe_fp4.mxfp4_to_fp8_colwise(mx)
    exact = sqnr_db(mx.dequantize(torch.float32).t(), col.dequantize(torch.float32))
    print(f"\nMXFP4 rows -> FP8 columns for wgrad: SQNR vs the MXFP4 values {exact:.2f} dB (inf = exact)")

    if device == "cuda":
        print("\nkernel bandwidth vs a copy of the same bytes (one shape; all shapes: bench/conversions.py):",
              flush=True)
        conversions_py = os.path.join(os.path.dirname(os.path.abspath(__file__)), "conversions.py")
        _run_script(conversions_py, ["--tokens", str(tokens), "--hidden", str(a.hidden), "--ref", "none"])
    else:
        print("\nkernel bandwidth: needs a GPU (python bench/conversions.py)")
    here = os.path.dirname(os.path.abspath(__file__))
    layer_args = ["--config", "dsv3", "--no-budget", "--iters", "10"] if device == "cuda" else []
    print("\nMoE layer, bf16 vs fp8 (baseline) vs fp4 (bench/moe_layer.py " + " ".join(layer_args) + "):", flush=True)
    _run_script(os.path.join(here, "moe_layer.py"), layer_args)
    print("expert-parallel all-to-all and EP layer (one process per GPU): "
          "torchrun --nproc-per-node <GPUs> bench/all_to_all.py; training end to end: moe-fp4 compare")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": device, "tokens": tokens, "hidden": a.hidden, "formats": results,
                       "colwise_sqnr_db": exact}, f, indent=2, default=str)


if __name__ == "__main__":
    main()
