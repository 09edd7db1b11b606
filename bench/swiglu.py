"""The fused SwiGLU + quantize kernel's time against a device copy of the bytes it moves, per output set.

    python bench/swiglu.py                          # 32768 tokens x F = 2048 (h is [32768, 4096] bf16)
    python bench/swiglu.py --tokens 4096 --ffn 7168

``swiglu_quantize(h, w, write_h_mxfp4, write_a_mxfp4)`` with router weights w, for the output sets the
layer uses: FP8 a + MXFP4 a + MXFP4 h (the fp4 layer), FP8 a + MXFP4 a, FP8 a alone (the fp8 layer).
Bytes moved = h and w read + every output written (data and scales, from the tensors' sizes); the
copy baseline is ``dst.copy_(src)`` on uint8 buffers of half that each, timed in the same process.
Medians of ``triton.testing.do_bench``. Each output set is checked once, bit for bit, the way the
tests define it: the FP8 and MXFP4 forms of a against the references applied to the kernel's own a
(which may differ from ``swiglu_ref``'s by one bf16 ulp, ``SWIGLU_MAX_ULP``), MXFP4 h against
``quantize_mxfp4_rowwise_ref(h)``. GPU only.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from moe_fp4.kernels import swiglu as KS
from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref
from moe_fp4.kernels.mxfp4 import quantize_mxfp4_rowwise_ref

OUTPUT_SETS = ((True, True), (False, True), (False, False))   # (write_h_mxfp4, write_a_mxfp4)


def _leaves(obj):
    if obj is None:
        return []
    if isinstance(obj, torch.Tensor):
        return [obj]
    return [t for o in obj for t in _leaves(o)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--ffn", type=int, default=2048, help="F: h is [tokens, 2F] (F % 128 == 0)")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench/swiglu.py needs a CUDA GPU")
    torch.manual_seed(0)
    h = torch.randn(a.tokens, 2 * a.ffn, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(a.tokens, device="cuda", dtype=torch.float32)
    for hm, am in OUTPUT_SETS:
        fp8, a_mx, h_mx, act = KS.swiglu_quantize(h, w, hm, am, write_a=True)
        pairs = [(fp8, quantize_fp8_rowwise_ref(act))]
        pairs += [(a_mx, quantize_mxfp4_rowwise_ref(act))] if am else []
        pairs += [(h_mx, quantize_mxfp4_rowwise_ref(h))] if hm else []
        for got, want in pairs:
            if not all(torch.equal(g.contiguous().view(torch.uint8), r.contiguous().view(torch.uint8))
                       for g, r in zip(got, want)):
                raise SystemExit(f"MISMATCH: swiglu_quantize h_mx={hm} a_mx={am} differs from its definition")
        out = KS.swiglu_quantize(h, w, hm, am)
        moved = h.numel() * 2 + w.numel() * 4 + sum(t.numel() * t.element_size() for t in _leaves(out))
        src = torch.empty(moved // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        t_copy = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
        t = triton.testing.do_bench(lambda: KS.swiglu_quantize(h, w, hm, am), return_mode="median")
        print(f"swiglu_quantize h_mx={hm} a_mx={am} {a.tokens}x{a.ffn}: {t * 1e3:.1f} us, {moved / 1e6:.0f} MB, "
              f"{100 * t_copy / t:.1f}% copy", flush=True)


if __name__ == "__main__":
    main()
