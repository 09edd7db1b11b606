"""What a kernel's general path costs its fast path: each conversion kernel with a per-program fast
path, compiled as is and compiled without its general path (bench/tools/sass.py's module copy with the path
test replaced by True), timed side by side against a device copy of the same bytes, on data that
always takes the fast path (outputs checked bit for bit). The general path raises the kernel's
register count (MXFP4 -> FP8 rows: 112 registers with it, 33 without, Triton 3.6), which caps how many
programs an SM holds; this measures whether that matters.

    python bench/tools/fast_only.py            # 65536 x 7168 and 32768 x 4096, CUDA only
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import sass  # noqa: E402
import torch  # noqa: E402
import triton.testing  # noqa: E402

from moe_fp4.kernels import fp8 as K8  # noqa: E402
from moe_fp4.kernels import mxfp4 as KMX  # noqa: E402

SHAPES = [(65536, 7168), (32768, 4096)]


def _flat(out):
    return list(out) if isinstance(out, tuple) else [out]


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def main() -> int:
    if not torch.cuda.is_available():
        sys.exit("bench/tools/fast_only.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()}: % of copy, each pair timed twice, alternating", flush=True)
    for tokens, hidden in SHAPES:
        x = torch.randn(tokens, hidden, dtype=torch.bfloat16, device="cuda")
        mx = KMX.quantize_mxfp4_rowwise(x)
        f8 = K8.quantize_fp8_rowwise(x)
        cases = [("mxfp4_to_fp8", "mxfp4_to_fp8_rowwise", mx), ("fp8_to_mxfp4", "quantize_mxfp4_from_fp8", f8),
                 ("mxfp4_to_bf16", "dequantize_mxfp4", (*mx, torch.bfloat16)),
                 ("mxfp4_to_fp8_colwise", "mxfp4_to_fp8_colwise", mx), ("fp8_to_fp8_colwise", "fp8_to_fp8_colwise", f8)]
        for name, fn, args in cases:
            mod_name = sass.KERNELS[name][0]
            both = getattr(sass._module(mod_name, []), fn)
            fast = getattr(sass._module(mod_name, sass.path_branches(name, "fast")), fn)
            want = _flat(both(*args))
            same = all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
                       for a, b in zip(_flat(fast(*args)), want))
            src = torch.empty((_bytes(args) + _bytes(want)) // 2, dtype=torch.uint8, device="cuda")
            dst = torch.empty_like(src)
            t_copy = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
            runs = []
            for _ in range(2):
                for label, f in (("both paths", both), ("fast path only", fast)):
                    t = triton.testing.do_bench(lambda: f(*args), return_mode="median")
                    runs.append(f"{label} {100 * t_copy / t:.1f}%")
            print(f"{tokens} x {hidden} {name}: {', '.join(runs)}; bits equal: {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
