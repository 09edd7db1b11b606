"""The memory ceiling of the column kernels' access pattern: how fast can a byte transpose with the
same tiles go, with no arithmetic at all?

``fp8_to_fp8_colwise`` reads FP8 rows [M, K] and writes FP8 columns [K, M]: one program (one warp)
loads 128 tokens x 16 G columns as 32-bit words, transposes each quad of four tokens' words in
registers (``_quad_bytes_transpose``, four tokens per output word) and stores 16 G rows of 128
bytes. ``_transpose_kernel`` below is that program with the conversion taken out (no scales, no
column maximum, no re-encode): the output is the input transposed, bit for bit. Timed in one run,
each against a device copy of the same bytes (``bench/conversions.py``'s ``measure``: CUDA events,
median, buffers rotating over >= 4x L2):

- the library's ``fp8_to_fp8_colwise`` at its defaults;
- ``_transpose_kernel`` at G = 1, 2, 4, 8 columns groups of 16 and 1, 2, 4 warps;
- ``torch``: ``x.t().contiguous()`` on uint8, torch's own transpose kernel.

If the library kernel is close to the transpose at its own G and warps, the access pattern (16 G
bytes per token row per program, 128-byte output rows) is its limit, not its arithmetic.

    python bench/tools/transpose_ceiling.py                          # 65536 x 7168 and 32768 x 4096
    python bench/tools/transpose_ceiling.py --tokens 32768 --hidden 7168 --json ceiling.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# bench/, for bench/conversions.py; this directory is sys.path[0] when run as a script
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import conversions as KB  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import moe_fp4  # noqa: E402
from moe_fp4.kernels.transpose import _quad_bytes_transpose, _quad_tokens  # noqa: E402
from moe_fp4.kernels.triton_numerics import use_asm  # noqa: E402

GROUPS = [1, 2, 4, 8]
WARPS = [1, 2, 4]


@triton.jit
def _transpose_kernel(q_ptr, o_ptr, M, M4, K4, G: tl.constexpr, ASM: tl.constexpr):
    # q: uint8 [M, K] as int32 words [M, K4]; o: uint8 [K, M] as int32 words [K, M4]. The program
    # geometry and the grid order (column groups fastest) are _fp8_to_fp8_colwise_kernel's.
    n_k = K4 // (4 * G)
    pid_k = tl.program_id(0) % n_k
    pid_t = tl.program_id(0) // n_k
    col0 = pid_k * (16 * G)
    gw = tl.arange(0, G)[:, None] * 4 + tl.arange(0, 4)[None, :]
    quad, tok = _quad_tokens(pid_t)
    x = tl.load(q_ptr.to(tl.pointer_type(tl.int32)) + tok[:, None, None, :, :] * K4
                + (col0 // 4 + gw)[None, :, :, None, None], mask=(tok < M)[:, None, None, :, :], other=0)
    b0, b1, b2, b3 = _quad_bytes_transpose(x, G, ASM)
    qg = pid_t * 32 + quad
    obase = o_ptr.to(tl.pointer_type(tl.int32)) + (col0 + gw * 4)[None, :, :, None].to(tl.int64) * M4 \
        + qg[:, None, None, :]
    omask = (qg < M4)[:, None, None, :]
    tl.store(obase, b0, mask=omask)
    tl.store(obase + M4, b1, mask=omask)
    tl.store(obase + 2 * M4, b2, mask=omask)
    tl.store(obase + 3 * M4, b3, mask=omask)


def transpose(x: torch.Tensor, g: int = 2, num_warps: int = 1, asm: bool | None = None) -> torch.Tensor:
    """x: uint8 [M, K], M % 4 == 0, K % (16 g) == 0, contiguous -> uint8 [K, M] = x.t(), through
    _transpose_kernel (the column kernels' tiles without their arithmetic)."""
    m, k = x.shape
    if m % 4 or k % (16 * g) or not x.is_contiguous():
        raise ValueError(f"transpose: needs M % 4 == 0, K % {16 * g} == 0 and a contiguous x, got {tuple(x.shape)}")
    out = torch.empty(k, m, dtype=torch.uint8, device=x.device)
    if m and k:
        _transpose_kernel[(triton.cdiv(m, 128) * (k // (16 * g)),)](
            x, out, m, m // 4, k // 4, G=g, ASM=use_asm(x) if asm is None else asm, num_warps=num_warps)
    return out


def bench_shape(tokens: int, hidden: int, cfg: KB.TimingConfig) -> dict:
    dev = cfg.device
    x = KB.make_input(tokens, hidden, dev)
    fp8 = moe_fp4.quantize_fp8(x)
    del x
    op = moe_fp4.fp8_to_fp8_colwise
    out = op(fp8)
    read, written = KB.nbytes(fp8), KB.nbytes(out)
    del out
    row: dict = {"tokens": tokens, "hidden": hidden, "op_bytes": read + written}
    ring = [(fp8,)] + [(KB.clone(fp8),) for _ in range(KB.ring_size(read, cfg) - 1)]
    row["op_gbps"] = (read + written) / KB.measure(op, ring, cfg)[0] / 1e9
    del ring, fp8
    KB.free_memory(dev)

    n = tokens * hidden
    copies = [(torch.empty(n, dtype=torch.uint8, device=dev), torch.empty(n, dtype=torch.uint8, device=dev))
              for _ in range(KB.ring_size(n, cfg))]
    row["copy_gbps"] = 2 * n / KB.measure(lambda s, d: d.copy_(s), copies, cfg)[0] / 1e9
    del copies
    KB.free_memory(dev)

    ring = [(torch.randint(0, 256, (tokens, hidden), dtype=torch.uint8, device=dev),)
            for _ in range(KB.ring_size(n, cfg))]
    want = ring[0][0].t().contiguous()
    row["torch_gbps"] = 2 * n / KB.measure(lambda s: s.t().contiguous(), ring, cfg)[0] / 1e9
    row["transpose"] = []
    for g in GROUPS:
        for w in WARPS:
            if not torch.equal(transpose(ring[0][0], g, w), want):
                raise RuntimeError(f"_transpose_kernel G={g} warps={w}: output is not x.t()")
            t = KB.measure(lambda s, g=g, w=w: transpose(s, g, w), ring, cfg)[0]
            row["transpose"].append({"g": g, "num_warps": w, "gbps": 2 * n / t / 1e9})
    del ring, want
    KB.free_memory(dev)
    return row


def summary(row: dict) -> str:
    c = row["copy_gbps"]
    best = max(row["transpose"], key=lambda t: t["gbps"])
    at_default = next(t for t in row["transpose"] if (t["g"], t["num_warps"]) == (2, 1))
    grid = ", ".join(f"G{t['g']}/{t['num_warps']}w {100 * t['gbps'] / c:.1f}" for t in row["transpose"])
    return (f"{row['tokens']}x{row['hidden']}: fp8_to_fp8_colwise {100 * row['op_gbps'] / c:.1f}% of copy | "
            f"transpose at its tiles (G2, 1 warp) {100 * at_default['gbps'] / c:.1f}% | best transpose "
            f"{100 * best['gbps'] / c:.1f}% (G{best['g']}, {best['num_warps']} warps) | torch x.t().contiguous() "
            f"{100 * row['torch_gbps'] / c:.1f}% | copy {c:.0f} GB/s\n    all: {grid}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 32768])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    cfg, record = KB.cuda_run("bench/tools/transpose_ceiling.py", a.iters)
    rows = []
    for tokens, hidden in zip(a.tokens, a.hidden):
        rows.append(bench_shape(tokens, hidden, cfg))
        print(summary(rows[-1]), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({**record, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
