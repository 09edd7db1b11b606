"""The sqrt(3) rule measured where it means something: on the FC2 weight gradient of each expert, against the noise
the 4-bit combine-gradient payload puts into it, as tokens per expert grow (issue 47, item 6).

"FP4 All the Way" (Chmiel et al., 2025): 4-bit gradients stop helping once the gradient's norm falls below sqrt(3)
times the quantization noise in it. Per payload that ratio is the format's SQNR and never moves (MXFP4-SR: about
7.3 whatever the step, exchange.grad_rule's measurement); on the weight gradient dW2_e = dY_e^T A_e the signal adds
over the expert's tokens where they agree and the stochastic-rounding noise, unbiased and independent per element,
adds only in variance, so the ratio ||dW2_e|| / ||noise in dW2_e|| grows with the tokens per expert.

Model: one MoE layer in float32 (router softmax, top-k, SwiGLU experts, the combine weighted by the router) trained
against a fixed random linear teacher (MSE): dY_e, the gradient at expert e's output rows, is what the combine's
gradient exchange carries to the experts. Noise estimate, the issue's "occasional second quantization": dY_e
quantized to MXFP4 with stochastic rounding under two seeds; E||dW(q1) - dW(q2)||^2 = 2 E||noise||^2. Beside it
the estimate a training step could make without a second rounding or GEMM: stochastic rounding's errors are
independent and zero-mean, so E||E^T A||^2 = sum_t E||e_t||^2 ||a_t||^2, from each row's rounding error (known to
the sender) and each FC2 input row's norm (known to the expert); the column "cheap / two roundings" is its
ratio to the two-rounding estimate.

    python3 bench/tools/sqrt3_dw.py [--tokens 256 1024 4096 16384] [--hidden 256] [--ffn 256] [--experts 8]
                                    [--top-k 2] [--pairs 4] [--json PATH]

Runs on CPU (the pure-torch MXFP4 reference; a numerics measurement, not a timing).
"""

from __future__ import annotations

import argparse
import json
import math

import torch


def expert_grads(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, seed: int = 0):
    """-> list over experts of (dY_e float32 [n_e, H], A_e float32 [n_e, F]): the gradient at each expert's output
    rows and its FC2 input, for one MSE step of the layer against its teacher."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    teacher = torch.randn(hidden, hidden, generator=g) / math.sqrt(hidden)
    router = torch.randn(hidden, experts, generator=g) / math.sqrt(hidden)
    w1 = torch.randn(experts, ffn, hidden, generator=g) / math.sqrt(hidden)
    w3 = torch.randn(experts, ffn, hidden, generator=g) / math.sqrt(hidden)
    w2 = torch.randn(experts, hidden, ffn, generator=g) / math.sqrt(ffn)
    weights, ids = torch.softmax(x @ router, dim=-1).topk(top_k, dim=-1)
    out = torch.zeros(tokens, hidden)
    kept = []
    for e in range(experts):
        t, j = (ids == e).nonzero(as_tuple=True)
        a = torch.nn.functional.silu(x[t] @ w1[e].t()) * (x[t] @ w3[e].t())
        out.index_add_(0, t, weights[t, j, None] * (a @ w2[e].t()))
        kept.append((t, j, a))
    d_out = 2.0 * (out - x @ teacher) / tokens                     # d(mean squared error) / d out
    return [(weights[t, j, None] * d_out[t], a) for t, j, a in kept]


def _sr_mxfp4(dy: torch.Tensor, seed: int) -> torch.Tensor:
    from moe_fp4.formats.conversions import dequantize_mxfp4, quantize_mxfp4
    from moe_fp4.kernels.numerics import Rounding

    return dequantize_mxfp4(quantize_mxfp4(dy, Rounding.STOCHASTIC, seed=seed), torch.float32)


def ratios(tokens: int, hidden: int, ffn: int, experts: int, top_k: int, pairs: int = 4, seed: int = 0) -> dict:
    """-> per expert with rows: tokens per expert, ||dW2_e|| / ||noise in dW2_e|| (noise from ``pairs`` pairs of
    stochastic roundings), and the per-payload ratio ||dY_e|| / ||dY_q - dY_e|| (the format's, for contrast)."""
    rows = []
    for e, (dy, a) in enumerate(expert_grads(tokens, hidden, ffn, experts, top_k, seed)):
        if dy.shape[0] == 0:
            continue
        dw = dy.t() @ a
        diff2, err2, cheap2 = 0.0, 0.0, 0.0
        a2 = a.square().sum(1)                                          # ||a_t||^2 per row
        for p in range(pairs):
            q1, q2 = _sr_mxfp4(dy, 2 * p + 1 + 1000 * e), _sr_mxfp4(dy, 2 * p + 2 + 1000 * e)
            diff2 += ((q1 - q2).t() @ a).square().sum().item() / 2
            err = (q1 - dy).square().sum(1)                             # ||e_t||^2 per row
            err2 += err.sum().item()
            cheap2 += (err * a2).sum().item()
        noise = math.sqrt(diff2 / pairs)
        rows.append({"expert": e, "tokens": dy.shape[0], "dw_ratio": dw.norm().item() / noise,
                     "payload_ratio": dy.norm().item() / math.sqrt(err2 / pairs),
                     "cheap_over_two_roundings": math.sqrt(cheap2 / pairs) / noise})
    return {"tokens": tokens, "experts": rows,
            "median_tokens_per_expert": sorted(r["tokens"] for r in rows)[len(rows) // 2],
            "median_dw_ratio": sorted(r["dw_ratio"] for r in rows)[len(rows) // 2],
            "median_payload_ratio": sorted(r["payload_ratio"] for r in rows)[len(rows) // 2],
            "median_cheap_over_two_roundings": sorted(r["cheap_over_two_roundings"] for r in rows)[len(rows) // 2]}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 16384])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--pairs", type=int, default=4, help="pairs of stochastic roundings per estimate")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    sqrt3 = math.sqrt(3.0)
    out = []
    print(f"MoE layer H {a.hidden}, F {a.ffn}, {a.experts} experts, top-{a.top_k}; combine gradient in MXFP4 "
          f"(stochastic rounding); sqrt(3) = {sqrt3:.3f}")
    print(f"{'tokens':>7} {'tok/expert':>10} {'dW2 ratio':>10} {'payload ratio':>14} {'cheap / two roundings':>22}"
          f"  (medians over experts)")
    for t in a.tokens:
        r = ratios(t, a.hidden, a.ffn, a.experts, a.top_k, a.pairs)
        out.append(r)
        print(f"{t:>7} {r['median_tokens_per_expert']:>10} {r['median_dw_ratio']:>10.2f} "
              f"{r['median_payload_ratio']:>14.2f} {r['median_cheap_over_two_roundings']:>22.3f}", flush=True)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "rows": out}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
