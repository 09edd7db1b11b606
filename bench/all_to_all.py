"""Expert-parallel all-to-all, BF16 vs FP8 vs MXFP4, and the EP MoE layer step, fp4 vs fp8.

Run with one process per GPU:

    torchrun --nproc-per-node 2 bench/all_to_all.py --json a2a_nvlink.json
    NCCL_P2P_DISABLE=1 torchrun --nproc-per-node 2 bench/all_to_all.py --json a2a_shm.json   # slow link

What each row times (per rank, every rank sends N/world rows to every rank, hidden H):
- ``bf16``: ``torch.distributed.all_to_all_single`` of the bf16 [N, H] tensor itself (torch's path);
- ``fp8``: ``moe_fp4.all_to_all(x, forward="fp8", output="fp8")``: quantize bf16 -> FP8 1x128 into the
  wire rows (one pass), send, and hand back an FP8BlockTensor (the GEMM operand), the DeepSeek-V3
  baseline's dispatch;
- ``mxfp4``: ``moe_fp4.all_to_all(x, forward="mxfp4", output="fp8")``: quantize bf16 -> MXFP4 into the
  wire rows, send, convert MXFP4 -> FP8 directly on the receiver (one pass);
- ``*_wire``: the same call's uint8 all_to_all_single alone, for the split between transfer and
  conversion; ``q8`` / ``q4`` / ``4->8``: quantize_fp8, quantize_mxfp4 and mxfp4_to_fp8 alone;
  ``mx/(q8+wire)``: MXFP4 end to end against the floor of any FP8 dispatch (quantize + send, no
  receive-side work), a stricter baseline than our own FP8 path, which copies the codes out of the
  interleaved wire rows on the receiver.
The split check is off (``check=False``): a dispatcher knows its counts; its cost (one small
all-gather and a host sync) is timed on its own as ``check``. Median of --iters CUDA-event timings
after --warmup, each iteration after a barrier; a row reports the slowest rank's median.

``--layer``: the EP MoE layer (``moe_fp4.model.moe.MoE`` with ``EPConfig``), forward + backward, each rank
its own --layer-tokens tokens, bf16 / fp8 / fp4 precision on the same weights and tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
import torch.distributed as dist

import moe_fp4
from moe_fp4.exchange.a2a import exchange_rows
from moe_fp4.exchange.ep import EPConfig
from moe_fp4.exchange.wire import row_bytes
from moe_fp4.formats.metrics import sqnr_db
from moe_fp4.model.moe import MoE, MoEConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
from harness import run_record, run_times, write_json  # noqa: E402

LAYER_CONFIGS = {
    "dsv3": dict(hidden=7168, ffn=2048, num_experts=32, top_k=8),
    "small": dict(hidden=2048, ffn=1408, num_experts=64, top_k=6),
}


def log(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def time_ms(fn, warmup: int, iters: int) -> float:
    """Median ms of fn() over iters (after warmup), each iteration after the GPU's work and a barrier;
    the slowest rank's."""
    def settle():
        torch.cuda.synchronize()
        dist.barrier()

    times = run_times(fn, warmup + iters, before=settle)[warmup:]
    med = torch.tensor([statistics.median(times)], device="cuda")
    dist.all_reduce(med, op=dist.ReduceOp.MAX)
    return med.item()


def bench_a2a(hidden: int, rows: int, warmup: int, iters: int) -> dict:
    world = dist.get_world_size()
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(x)
    splits = [rows // world] * world
    res = {"hidden": hidden, "rows": rows}
    res["bf16_ms"] = time_ms(lambda: dist.all_to_all_single(out, x), warmup, iters)
    for fmt in ("fp8", "mxfp4"):
        res[f"{fmt}_ms"] = time_ms(lambda: moe_fp4.all_to_all(x, splits, splits, forward=fmt, output="fp8",
                                                              check=False), warmup, iters)
        wire = torch.empty(rows, row_bytes(fmt, hidden), dtype=torch.uint8, device="cuda")
        res[f"{fmt}_wire_ms"] = time_ms(lambda: exchange_rows(wire, splits, splits, None), warmup, iters)
        res[f"{fmt}_bytes_per_row"] = row_bytes(fmt, hidden)
    # Conversion costs alone: what a fused FP8 baseline (quantize, send, no receive-side copy) pays
    # at least is fp8_quant_ms + fp8_wire_ms.
    qx = moe_fp4.quantize_mxfp4(x)
    res["fp8_quant_ms"] = time_ms(lambda: moe_fp4.quantize_fp8(x), warmup, iters)
    res["mxfp4_quant_ms"] = time_ms(lambda: moe_fp4.quantize_mxfp4(x), warmup, iters)
    res["mxfp4_to_fp8_ms"] = time_ms(lambda: moe_fp4.mxfp4_to_fp8(qx), warmup, iters)
    res["mxfp4_vs_fp8_floor"] = res["mxfp4_ms"] / (res["fp8_quant_ms"] + res["fp8_wire_ms"])
    qx = None   # frees it (rebound, not del: the lambda above reads it, and pyflakes calls a del'd name undefined)
    res["check_ms"] = time_ms(lambda: moe_fp4.all_to_all(x[:world], forward="bf16"), warmup, iters) - time_ms(
        lambda: moe_fp4.all_to_all(x[:world], forward="bf16", check=False), warmup, iters)
    # Bytes each rank sends to the others (its own share stays local) per second of the call.
    off_rank = rows * (world - 1) / world
    for fmt, per_row in (("bf16", 2 * hidden), ("fp8", res["fp8_bytes_per_row"]),
                         ("mxfp4", res["mxfp4_bytes_per_row"])):
        res[f"{fmt}_GBps"] = off_rank * per_row / (res[f"{fmt}_ms"] * 1e6)
    res["mxfp4_vs_fp8"] = res["mxfp4_ms"] / res["fp8_ms"]
    res["fp8_vs_bf16"] = res["fp8_ms"] / res["bf16_ms"]
    x = out = None   # frees the buffers before empty_cache (rebound, not del: the lambdas above read them)
    torch.cuda.empty_cache()
    return res


def bench_layer(config: str, tokens: int, warmup: int, iters: int) -> dict:
    cfg = MoEConfig(**LAYER_CONFIGS[config])
    torch.manual_seed(0)
    m = MoE(cfg, "fp8", device="cuda", ep=EPConfig())
    gen = torch.Generator(device="cuda").manual_seed(1 + dist.get_rank())
    x = torch.randn(tokens, cfg.hidden, dtype=torch.bfloat16, device="cuda", generator=gen).requires_grad_()
    g = torch.randn(tokens, cfg.hidden, dtype=torch.bfloat16, device="cuda", generator=gen)
    res = {"config": config, "tokens_per_rank": tokens}
    outs = {}

    def step():
        m.zero_grad(set_to_none=True)
        x.grad = None
        y = m(x)
        y.backward(g)
        return y

    for p in ("bf16", "fp8", "fp4"):
        m.precision = p
        outs[p] = step().detach()
        res[f"{p}_ms"] = time_ms(step, warmup, iters)
        res[f"{p}_tok_per_s"] = tokens / (res[f"{p}_ms"] / 1e3)
    for p in ("fp8", "fp4"):
        res[f"{p}_out_sqnr_db_vs_bf16"] = sqnr_db(outs["bf16"].float(), outs[p].float())
    res["fp4_vs_fp8"] = res["fp4_ms"] / res["fp8_ms"]
    m = x = g = None   # frees the layer and tensors before empty_cache (rebound, not del: step() reads them)
    torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[2048, 7168])
    ap.add_argument("--rows", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536],
                    help="rows per rank")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--layer", nargs="*", default=["dsv3"], choices=sorted(LAYER_CONFIGS),
                    help="EP MoE layer configs to time (none: skip)")
    ap.add_argument("--layer-tokens", type=int, default=4096)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/all_to_all.py needs CUDA GPUs (one process per GPU under torchrun)")
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    link = "shared memory (NCCL_P2P_DISABLE=1)" if os.environ.get("NCCL_P2P_DISABLE") == "1" else "default (NVLink)"
    head = {**run_record(), "world": dist.get_world_size(), "link": link,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())), "command": " ".join(sys.argv)}
    log(json.dumps(head))
    rows_out = []
    log(f"{'H':>5} {'rows':>6} {'bf16 ms':>8} {'fp8 ms':>8} {'mxfp4 ms':>9} {'fp8 wire':>9} {'mx wire':>8} "
        f"{'mx/fp8':>7} {'fp8/bf16':>8} {'bf16 GB/s':>9} {'fp8 GB/s':>8} {'mx GB/s':>8} {'check ms':>8} "
        f"{'q8 ms':>6} {'q4 ms':>6} {'4->8 ms':>7} {'mx/(q8+wire)':>12}")
    for h in a.hidden:
        for n in a.rows:
            r = bench_a2a(h, n, a.warmup, a.iters)
            rows_out.append(r)
            log(f"{h:>5} {n:>6} {r['bf16_ms']:>8.3f} {r['fp8_ms']:>8.3f} {r['mxfp4_ms']:>9.3f} "
                f"{r['fp8_wire_ms']:>9.3f} {r['mxfp4_wire_ms']:>8.3f} {r['mxfp4_vs_fp8']:>7.3f} "
                f"{r['fp8_vs_bf16']:>8.3f} {r['bf16_GBps']:>9.1f} {r['fp8_GBps']:>8.1f} {r['mxfp4_GBps']:>8.1f} "
                f"{r['check_ms']:>8.3f} {r['fp8_quant_ms']:>6.3f} {r['mxfp4_quant_ms']:>6.3f} "
                f"{r['mxfp4_to_fp8_ms']:>7.3f} {r['mxfp4_vs_fp8_floor']:>12.3f}")
    layers = []
    for c in a.layer:
        r = bench_layer(c, a.layer_tokens, a.warmup, a.iters)
        layers.append(r)
        log(f"EP layer {c}, {r['tokens_per_rank']} tokens/rank: bf16 {r['bf16_ms']:.2f} ms, fp8 {r['fp8_ms']:.2f} ms, "
            f"fp4 {r['fp4_ms']:.2f} ms; fp4/fp8 {r['fp4_vs_fp8']:.3f}; out SQNR vs bf16: fp8 "
            f"{r['fp8_out_sqnr_db_vs_bf16']:.1f} dB, fp4 {r['fp4_out_sqnr_db_vs_bf16']:.1f} dB")
    if dist.get_rank() == 0:
        write_json(a.json, {"header": head, "all_to_all": rows_out, "layer": layers})
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
