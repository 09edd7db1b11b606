"""The memory ceiling of each conversion's traffic shape: how fast can anything read R bytes and
write W bytes, when R != W?

bench/conversions.py measures every conversion against a copy (R = W). The decoders write two to four
bytes per byte read and the encoders the reverse, and HBM need not serve those mixes at a copy's
rate. For each op and shape this script times, in one run:

- the op itself (its launcher's defaults; output not checked here, bench/conversions.py does that);
- ``copy``: ``dst.copy_(src)`` on uint8 moving the op's bytes (bench/conversions.py's baseline);
- ``stream``: a Triton kernel with no arithmetic, an elementwise cast between integer words with the
  op's read:write ratio of data bytes (MXFP4 -> FP8: int16 words of four codes to int32 words of four
  bytes; scales left out, 1-3% of the bytes), four words per thread on both sides as in the library's
  row kernels, each program one contiguous chunk; the best of a few program sizes;
- ``tile``: the same cast laid out like the row conversions, a program covering BM rows x a column
  range of the [tokens, words per row] matrix, with the row blocks fastest in the grid (as the
  library's row kernels launch) and with the column blocks fastest;
- ``torch cast``: ``dst.copy_(src)`` between the same integer words (torch's vectorized elementwise
  kernel), for the ops with one output.

Every figure is GB/s of its own bytes and % of the copy's GB/s; "op / stream" is the op's GB/s over
the stream kernel's. Timing: bench/conversions.py's ``measure`` (CUDA events, median, inputs and outputs
rotating over >= 4x L2). CUDA only.

    python bench/tools/ceiling.py                                   # 65536 x 7168 and 32768 x 4096, every row op
    python bench/tools/ceiling.py --ops mxfp4_to_fp8 --tokens 32768 --hidden 7168 --json ceiling.json
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

# Row conversions as elementwise casts between integer words of the op's data: (source words,
# output words, second output or None), one source word per output word, so the read:write ratio
# of data bytes is the op's (MXFP4 -> FP8: int16 words of 4 codes -> int32 words of 4 bytes).
WORDS = {
    "bf16_to_mxfp4": (torch.int32, torch.int8, None),
    "fp8_to_mxfp4": (torch.int32, torch.int16, None),
    "mxfp4_to_bf16": (torch.int8, torch.int32, None),
    "mxfp4_to_fp8": (torch.int16, torch.int32, None),
    "bf16_to_fp8": (torch.int32, torch.int16, None),
    "bf16_to_fp8_and_mxfp4": (torch.int32, torch.int16, torch.int8),
}
SOURCE_BYTES_PER_ELEMENT = {"bf16": 2, "fp8": 1, "mxfp4": 0.5}
STREAM_CONFIGS = [(1024, 4), (2048, 4), (4096, 4), (2048, 8), (4096, 8)]   # (source words, warps) per program
TILE_CONFIGS = [(1, 1024, 4), (1, 2048, 4), (2, 512, 4), (2, 1024, 4), (4, 256, 4), (4, 512, 1), (4, 512, 4),
                (8, 256, 4)]                                               # (rows, source words per row, warps)


@triton.jit
def _cast_tile_kernel(src_ptr, dst_ptr, dst2_ptr, n_row_blocks, n_col_blocks, row_words,
                      BM: tl.constexpr, BW: tl.constexpr, ROWS_FASTEST: tl.constexpr, TWO_OUTPUTS: tl.constexpr):
    # src / dst viewed as [rows, row_words] word matrices; a program casts BM rows x BW words. The
    # [BM, BW / 4, 4] shape gives loads and stores the same 4 words per thread (one register layout,
    # no shared memory), as the library's row kernels do. A stream is BM = 1, one row per program.
    pid = tl.program_id(0)
    if ROWS_FASTEST:
        rb = pid % n_row_blocks
        cb = pid // n_row_blocks
    else:
        rb = pid // n_col_blocks
        cb = pid % n_col_blocks
    rows = rb.to(tl.int64) * BM + tl.arange(0, BM).to(tl.int64)
    offs = (rows * row_words + cb * BW)[:, None, None] + (tl.arange(0, BW // 4) * 4)[None, :, None] \
        + tl.arange(0, 4)[None, None, :]
    x = tl.load(src_ptr + offs)
    tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty))
    if TWO_OUTPUTS:
        tl.store(dst2_ptr + offs, x.to(dst2_ptr.dtype.element_ty))


def _buffers(words: int, kinds: tuple, device) -> tuple:
    src_t, dst_t, dst2_t = kinds
    src = torch.randint(0, 255, (words * torch.empty(0, dtype=src_t).element_size(),), dtype=torch.uint8,
                        device=device).view(src_t)
    dst = torch.empty(words, dtype=dst_t, device=device)
    dst2 = torch.empty(words, dtype=dst2_t, device=device) if dst2_t is not None else dst
    return src, dst, dst2


def _mb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure_gbps(fn, ring: list[tuple], moved: int, cfg: KB.TimingConfig) -> float:
    t, _ = KB.measure(fn, ring, cfg)
    return moved / t / 1e9


def ring_of(make, input_bytes: int, cfg: KB.TimingConfig) -> list[tuple]:
    return [make() for _ in range(KB.ring_size(input_bytes, cfg))]


def bench_shape(op: KB.OpSpec, tokens: int, hidden: int, cfg: KB.TimingConfig) -> dict:
    dev = cfg.device
    x = KB.make_input(tokens, hidden, dev)
    args = op.prepare(x)
    out = op.run(*args)
    read, written = KB.nbytes(args), KB.nbytes(out)
    del out, x
    KB.free_memory(dev)
    row: dict = {"op": op.name, "tokens": tokens, "hidden": hidden, "bytes_read": read, "bytes_written": written}
    ring = [args] + [KB.clone(args) for _ in range(KB.ring_size(read, cfg) - 1)]
    row["op_gbps"] = measure_gbps(op.run, ring, read + written, cfg)
    del ring, args
    KB.free_memory(dev)

    half = (read + written) // 2
    copies = ring_of(lambda: (torch.empty(half, dtype=torch.uint8, device=dev),
                              torch.empty(half, dtype=torch.uint8, device=dev)), half, cfg)
    row["copy_gbps"] = measure_gbps(lambda s, d: d.copy_(s), copies, 2 * half, cfg)
    del copies
    KB.free_memory(dev)

    kinds = WORDS[op.name]
    src_bytes = torch.empty(0, dtype=kinds[0]).element_size()
    row_words = int(hidden * SOURCE_BYTES_PER_ELEMENT[op.name.split("_to_")[0]]) // src_bytes
    words = tokens * row_words
    bufs = ring_of(lambda: _buffers(words, kinds, dev), words * src_bytes, cfg)
    moved = sum(_mb(t) for t in bufs[0][:2]) + (_mb(bufs[0][2]) if kinds[2] is not None else 0)

    def launch(bm, bw, warps, rows_fastest, nrows, nw):
        nrb, ncb = nrows // bm, nw // bw

        def run(s, d, d2):
            _cast_tile_kernel[(nrb * ncb,)](s, d, d2, nrb, ncb, nw, BM=bm, BW=bw, ROWS_FASTEST=rows_fastest,
                                            TWO_OUTPUTS=kinds[2] is not None, num_warps=warps)
        s, d, d2 = bufs[0]
        run(s, d, d2)
        if not (torch.equal(d, s.to(d.dtype)) and torch.equal(d2, s.to(d2.dtype))):
            raise RuntimeError(f"_cast_tile_kernel BM={bm} BW={bw}: output is not the cast of the input")
        return measure_gbps(run, bufs, moved, cfg)

    row["stream"] = [{"words": bw, "num_warps": w, "gbps": launch(1, bw, w, True, words // bw, bw)}
                     for bw, w in STREAM_CONFIGS if words % bw == 0]
    row["tile"] = [{"bm": bm, "words": bw, "num_warps": w, "rows_fastest": fast,
                    "gbps": launch(bm, bw, w, fast, tokens, row_words)}
                   for bm, bw, w in TILE_CONFIGS for fast in (True, False)
                   if tokens % bm == 0 and row_words % bw == 0]
    del bufs
    KB.free_memory(dev)
    if kinds[2] is None:
        # torch's own cast of the same words (its vectorized elementwise kernel)
        bufs = ring_of(lambda: _buffers(words, kinds, dev), words * src_bytes, cfg)
        row["torch_cast"] = {"from": str(kinds[0]), "to": str(kinds[1]),
                             "gbps": measure_gbps(lambda s, d, d2: d.copy_(s), bufs, moved, cfg)}
        del bufs
        KB.free_memory(dev)
    return row


def summary(row: dict) -> str:
    c = row["copy_gbps"]
    best = max(row["stream"], key=lambda s: s["gbps"])
    cells = [f"{row['op']:<22}", f"{row['tokens']:>6}x{row['hidden']:<5}",
             f"op {row['op_gbps']:5.0f} ({100 * row['op_gbps'] / c:5.1f}%)",
             f"copy {c:5.0f}",
             f"stream {best['gbps']:5.0f} ({100 * best['gbps'] / c:5.1f}%, "
             f"{best['words']}w x {best['num_warps']} warps)"]
    for fastest in (True, False):
        tiles = [t for t in row["tile"] if t["rows_fastest"] == fastest]
        if tiles:
            b = max(tiles, key=lambda t: t["gbps"])
            cells.append(f"tile {'rows' if fastest else 'cols'}-fastest {100 * b['gbps'] / c:5.1f}% "
                         f"({b['bm']}x{b['words']}, {b['num_warps']} warps)")
    if "torch_cast" in row:
        cells.append(f"torch cast {100 * row['torch_cast']['gbps'] / c:5.1f}%")
    cells.append(f"op/stream {row['op_gbps'] / best['gbps']:.2f}")
    return " | ".join(cells)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", nargs="+", choices=list(WORDS), default=list(WORDS))
    ap.add_argument("--tokens", type=int, nargs="+", default=[65536, 32768])
    ap.add_argument("--hidden", type=int, nargs="+", default=[7168, 4096], help="paired with --tokens")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cfg, record = KB.cuda_run("bench/tools/ceiling.py", a.iters)
    result = {**record, "rows": []}
    ops = [op for op in KB.OPS if op.name in a.ops]
    for tokens, hidden in zip(a.tokens, a.hidden):
        for op in ops:
            row = bench_shape(op, tokens, hidden, cfg)
            result["rows"].append(row)
            KB.log(summary(row))
            if a.json:
                with open(a.json, "w") as f:
                    json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
