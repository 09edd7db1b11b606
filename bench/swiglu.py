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

Then the backward (``--warps`` picks the fused kernel's warps to time): ``swiglu_backward_quantize`` (dh's
FP8 rows and columns and dw from one pass, h in bf16 (fp8) or MXFP4 (fp4)) against the chain it replaces
in the experts' backward, timed the same way in the same process: ``swiglu_backward`` then
``quantize_fp8_rowwise_colwise`` of its dh (after ``dequantize_mxfp4`` of h for MXFP4). Each checked once
bit for bit against that chain (dw to SWIGLU_DW_RTOL: another summation order).
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from moe_fp4.kernels import swiglu as KS
from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref
from moe_fp4.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4_rowwise, quantize_mxfp4_rowwise_ref
from moe_fp4.kernels.transpose import quantize_fp8_rowwise_colwise

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
    ap.add_argument("--warps", type=int, nargs="+", default=[8], help="swiglu_backward_quantize's num_warps to time")
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
    backward(h, w, a)


def _same(got, want) -> bool:
    return all(torch.equal(g.contiguous().view(torch.uint8), r.contiguous().view(torch.uint8))
               for g, r in zip(_leaves(got), _leaves(want)))


def backward(h: torch.Tensor, w: torch.Tensor, a) -> None:
    """The fused backward against the chain it replaces, for bf16 h and MXFP4 h."""
    da = torch.randn(h.shape[0], h.shape[1] // 2, device="cuda", dtype=torch.bfloat16)
    h_mx = quantize_mxfp4_rowwise(h)
    for name, hin, hs in (("bf16 h", h, None), ("MXFP4 h", h_mx[0], h_mx[1])):
        def chain():
            hb = h if hs is None else dequantize_mxfp4(hin, hs, torch.bfloat16)
            dh, dw = KS.swiglu_backward(hb, da, w)
            return (*quantize_fp8_rowwise_colwise(dh), dw)
        want = chain()
        g, u = (h if hs is None else dequantize_mxfp4(hin, hs, torch.bfloat16)).float().chunk(2, dim=1)
        bound = KS.SWIGLU_DW_RTOL * (da.float() * g * torch.sigmoid(g) * u).abs().sum(dim=1)   # tests' rule
        del g, u
        t_chain = triton.testing.do_bench(chain, return_mode="median")
        for nw in a.warps:
            rows, cols, dw = KS.swiglu_backward_quantize(hin, da, w, hs, num_warps=nw)
            if not (_same((rows, cols), want[:2]) and bool(((dw - want[2]).abs() <= bound).all())):
                raise SystemExit(f"MISMATCH: swiglu_backward_quantize ({name}, {nw} warps) differs from the chain")
            t = triton.testing.do_bench(lambda: KS.swiglu_backward_quantize(hin, da, w, hs, num_warps=nw),
                                        return_mode="median")
            print(f"swiglu backward, {name}, {h.shape[0]}x{h.shape[1] // 2}: fused ({nw} warps) {t * 1e3:.1f} us, "
                  f"chain {t_chain * 1e3:.1f} us, fused / chain {t / t_chain:.3f}", flush=True)


if __name__ == "__main__":
    main()
