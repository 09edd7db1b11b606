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

Then the backward, ``swiglu_backward(h, da, w)``: with bf16 h (fp8's), and with fp4's MXFP4 h both ways,
``dequantize_mxfp4`` then the bf16 kernel (the path before 5e20141, 2026-11-26) against the
kernel decoding h in registers (``h_scale=``), each checked bit for bit (dh) against the first. ``--fwd
BM,TILES,WARPS ...`` and ``--bwd BM,BW,WARPS ...`` time the forward (each output set, checked against the
defaults' bytes) and the MXFP4 backward at other configurations too.
"""

from __future__ import annotations

import argparse

import torch
import triton.testing

from moe_fp4.kernels import swiglu as KS
from moe_fp4.kernels.fp8 import quantize_fp8_rowwise_ref
from moe_fp4.kernels.mxfp4 import dequantize_mxfp4, quantize_mxfp4_rowwise, quantize_mxfp4_rowwise_ref

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
    ap.add_argument("--fwd", nargs="*", default=[], metavar="BM,TILES,WARPS",
                    help="more block_m,tiles,num_warps configurations of swiglu_quantize to time (every output set)")
    ap.add_argument("--bwd", nargs="*", default=[], metavar="BM,BW,WARPS",
                    help="more block_m,block_w,num_warps configurations of the MXFP4 backward to time")
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
        for cfg in [None] + [tuple(int(v) for v in c.split(",")) for c in a.fwd]:
            kw = {} if cfg is None else dict(block_m=cfg[0], tiles=cfg[1], num_warps=cfg[2])
            if cfg is not None and not all(
                    torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
                    for x, y in zip(_leaves(KS.swiglu_quantize(h, w, hm, am, **kw)), _leaves(out))):
                raise SystemExit(f"MISMATCH: swiglu_quantize {kw} differs from its defaults' output")
            t = triton.testing.do_bench(lambda: KS.swiglu_quantize(h, w, hm, am, **kw), return_mode="median")
            print(f"swiglu_quantize h_mx={hm} a_mx={am} {a.tokens}x{a.ffn} ({kw or 'defaults'}): {t * 1e3:.1f} us, "
                  f"{moved / 1e6:.0f} MB, {100 * t_copy / t:.1f}% copy", flush=True)
    backward(h, w, a)


def backward(h: torch.Tensor, w: torch.Tensor, a) -> None:
    da = torch.randn(h.shape[0], h.shape[1] // 2, device="cuda", dtype=torch.bfloat16)
    hd, hs = quantize_mxfp4_rowwise(h)
    shape = f"{h.shape[0]}x{h.shape[1] // 2}"
    t_bf16 = triton.testing.do_bench(lambda: KS.swiglu_backward(h, da, w), return_mode="median")
    print(f"swiglu_backward, bf16 h, {shape}: {t_bf16 * 1e3:.1f} us", flush=True)
    want = KS.swiglu_backward(dequantize_mxfp4(hd, hs, torch.bfloat16), da, w)[0]
    t_deq = triton.testing.do_bench(lambda: KS.swiglu_backward(dequantize_mxfp4(hd, hs, torch.bfloat16), da, w),
                                    return_mode="median")
    print(f"swiglu_backward, MXFP4 h, dequantize_mxfp4 + bf16 kernel, {shape}: {t_deq * 1e3:.1f} us", flush=True)
    configs = [None] + [tuple(int(v) for v in c.split(",")) for c in a.bwd]
    for cfg in configs:
        kw = {} if cfg is None else dict(block_m=cfg[0], block_w=cfg[1], num_warps=cfg[2])
        if not torch.equal(KS.swiglu_backward(hd, da, w, h_scale=hs, **kw)[0].view(torch.int16),
                           want.view(torch.int16)):
            raise SystemExit(f"MISMATCH: swiglu_backward with MXFP4 h ({kw or 'defaults'}) differs from "
                             "dequantize + bf16")
        t = triton.testing.do_bench(lambda: KS.swiglu_backward(hd, da, w, h_scale=hs, **kw), return_mode="median")
        print(f"swiglu_backward, MXFP4 h decoded in the kernel ({kw or 'defaults'}), {shape}: {t * 1e3:.1f} us, "
              f"/ dequantize + bf16 kernel {t / t_deq:.3f}", flush=True)


if __name__ == "__main__":
    main()
