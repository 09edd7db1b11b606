"""MXFP4 -> FP8 column conversion (``mxfp4_to_fp8_colwise``) on inputs that steer its tiles between the
word (SWAR) path and the general path, next to the FP8 -> FP8 column conversion. GPU only.

    python bench/tools/colwise_zero_blocks.py

32768 x 7168 (dsv3's FC1 input rows): random rows; the last 64 of every 1024 rows zero (the padding
rows of 32 experts: all-zero blocks, scale byte 0); every 97th row scaled by 1e-5 (17 binades under
its tile: the general path); and ``rows=`` reading 4096 tokens plus a zero token for the padding rows
(what the layer's fp4 backward converts). Medians of ``triton.testing.do_bench``.
"""

from __future__ import annotations

import torch
import triton.testing

from moe_fp4.kernels import fp8 as K8
from moe_fp4.kernels import mxfp4 as KMX
from moe_fp4.kernels import transpose as KT

M, K = 32768, 7168


def _us(fn) -> float:
    return triton.testing.do_bench(fn, return_mode="median") * 1e3


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("bench/tools/colwise_zero_blocks.py needs a CUDA GPU")
    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    padded = x.clone().view(32, 1024, K)
    padded[:, -64:] = 0
    padded = padded.view(M, K)
    spread = x.clone()
    spread[::97] *= 1e-5
    for name, t in (("random rows", x), ("64 zero rows per 1024 (padding)", padded),
                    ("every 97th row x1e-5 (17 binades)", spread)):
        d, s = KMX.quantize_mxfp4_rowwise(t)
        print(f"mxfp4 colwise, {name}: {_us(lambda: KT.mxfp4_to_fp8_colwise(d, s)):.1f} us", flush=True)
    tokens = torch.randn(4097, K, device="cuda", dtype=torch.bfloat16)
    tokens[4096] = 0
    d, s = KMX.quantize_mxfp4_rowwise(tokens)
    rows = torch.randint(0, 4096, (M,), device="cuda")
    rows.view(32, 1024)[:, -64:] = 4096
    print(f"mxfp4 colwise, rows= with padding rows from the zero token: "
          f"{_us(lambda: KT.mxfp4_to_fp8_colwise(d, s, rows=rows)):.1f} us", flush=True)
    for name, t in (("random rows", x), ("64 zero rows per 1024 (padding)", padded)):
        f = K8.quantize_fp8_rowwise(t)
        print(f"fp8 colwise, {name}: {_us(lambda: KT.fp8_to_fp8_colwise(*f)):.1f} us", flush=True)


if __name__ == "__main__":
    main()
