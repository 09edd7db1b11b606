"""The training loop and measurements that bench/hf_experts.py and bench/torchtitan_experts.py share: each variant
of one model trained on the same stdlib byte batches with torch's AdamW, timed per step, its memory split into
the forward + backward peak, the saved activations and the FP8 weight copies, and its loss curve.

The AdamW is torch's fused one on CUDA (``--adamw fused``, the default), as both stacks' own loops default to
(torchtitan 0.3's optimizer ``implementation="fused"``; transformers' ``optim="adamw_torch_fused"`` from torch
2.8); ``--adamw foreach`` is torch's own default, which the results of 2026-11-28 up to 5689502 used. Every
variant of a run steps with the same one."""

from __future__ import annotations

import gc
import json
import sys
import time
import traceback

import torch

GiB = 2**30


def stdlib_batches(batch: int, seq: int, count: int, device) -> torch.Tensor:
    """-> int64 [count, batch, seq] windows of Python's standard library source as byte tokens (vocab 256)."""
    from moe_fp4.compare.data import stdlib_corpus

    text = stdlib_corpus().train
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, text.numel() - seq, (count, batch), generator=g)
    return text[starts[..., None] + torch.arange(seq)].long().to(device)


def saved_bytes(model, loss_of) -> int:
    """Bytes of the distinct storages autograd keeps from one forward (``loss_of()``) for backward: the
    activations, counted once per storage by a saved-tensor hook that returns each tensor unchanged, the
    parameters excluded. Runs forward and backward; the caller drops the gradients."""
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_of()
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    loss.backward()
    return sum(n for ptr, n in seen.items() if ptr not in params)


ADAMW = ("fused", "foreach")


def make_adamw(params, lr: float, impl: str = "fused", **kw) -> torch.optim.AdamW:
    """torch's AdamW, ``impl`` "fused" (CUDA parameters; foreach elsewhere) or "foreach"."""
    if impl not in ADAMW:
        raise ValueError(f"make_adamw: impl must be one of {ADAMW}, got {impl!r}")
    params = list(params)
    fused = impl == "fused" and all(p.is_cuda for p in params)
    return torch.optim.AdamW(params, lr=lr, fused=fused, foreach=not fused, **kw)


def train_variant(name: str, model, loss_of, data: torch.Tensor, warmup: int, steps: int, lr: float,
                  fp8_copies=lambda: 0, progress: bool = True, tokens_per_step: int | None = None,
                  adamw: str = "fused") -> dict:
    """Train ``model`` for ``warmup`` + ``steps`` steps on ``data`` [count, batch, seq] (``loss_of(ids)`` -> the
    step's loss) with torch's AdamW -> the row: tokens/s over the timed steps, peak memory (AdamW's temporaries
    included), fwd_bwd (the peak of forward and backward less what was allocated before the forward), saved
    activations (:func:`saved_bytes`, one extra forward + backward at the end), ``fp8_copies()`` bytes after
    backward, the loss curve. One ``loss.item()`` per step in every variant."""
    opt = make_adamw(model.parameters(), lr, adamw, betas=(0.9, 0.95), weight_decay=0.1)
    cuda = data.device.type == "cuda"
    losses, times, act, peak, copies, before = [], [], 0, 0, 0, 0
    for step in range(warmup + steps):
        ids = data[step % data.shape[0]]
        if cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        loss = loss_of(ids)
        loss.backward()
        if step >= warmup and cuda:
            # forward + backward only: AdamW's temporaries come after, the same in every variant
            act = max(act, torch.cuda.max_memory_allocated() - before)
            copies = max(copies, fp8_copies())
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step >= warmup:
            times.append(time.perf_counter() - t0)
            if cuda:
                peak = max(peak, torch.cuda.max_memory_allocated())
        if progress and (step + 1) % 50 == 0:
            print(f"  {name}: step {step + 1}, loss {losses[-1]:.4f}", flush=True)
    step_s = sum(times) / len(times)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    opt_state = sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                    if isinstance(t, torch.Tensor))
    saved = saved_bytes(model, lambda: loss_of(data[0]))
    opt.zero_grad(set_to_none=True)
    tokens = tokens_per_step or data.shape[1] * data.shape[2]
    return {"impl": name, "tokens_per_s": tokens / step_s, "step_ms": 1e3 * step_s, "peak_gib": peak / GiB,
            "static_gib": before / GiB, "fwd_bwd_gib": act / GiB, "saved_gib": saved / GiB,
            "fp8_weight_copies_gib": copies / GiB,
            # the peak split: weights, AdamW's state, FP8 weight copies, saved activations, and the rest
            # (gradients, temporaries, workspaces): what each GiB of the peak is
            "weights_gib": weights / GiB, "optimizer_state_gib": opt_state / GiB,
            "rest_gib": (peak - weights - opt_state - copies - saved) / GiB if cuda else None,
            "loss_first": losses[0], "loss_last": losses[-1],
            "loss_last10": sum(losses[-10:]) / len(losses[-10:]), "loss_curve": losses}


def profile_table(model, loss_of, data: torch.Tensor, lr: float, steps: int, adamw: str = "fused") -> str:
    """torch.profiler over ``steps`` training steps (``loss_of(ids)`` -> the loss) -> its table of the 30
    kernels and ops with the most GPU time."""
    from torch.profiler import ProfilerActivity, profile

    opt = make_adamw(model.parameters(), lr, adamw)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for step in range(steps):
            loss_of(data[step % data.shape[0]]).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)


def guarded(name: str, fn, device) -> dict:
    """fn() -> its row, or a row saying why the variant could not run (an optional baseline that does not
    apply is a line in the table, not the end of the run)."""
    # what earlier variants left allocated (0 when each went with its frame): reported with the row
    left = torch.cuda.memory_allocated() / GiB if device.type == "cuda" else 0.0
    try:
        return {**fn(), "left_by_earlier_gib": left}
    except Exception as e:  # noqa: BLE001
        why = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        # The traceback's frames hold the failed variant's model, gradients and optimizer state: without
        # clearing them the next variants would run with that memory still allocated.
        traceback.clear_frames(e.__traceback__)
        del e
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"impl": name, "skipped": why, "left_by_earlier_gib": left}


def print_table(rows: list[dict], bf16: str, fp8: str = "moe_fp4_fp8") -> None:
    """The rows as a table; ratios against the ``bf16`` variant and against ``fp8``."""
    base = {r["impl"]: r for r in rows if "skipped" not in r}
    g, f = base.get(bf16), base.get(fp8)

    def ratio(r, b, key):
        return r[key] / b[key] if b and b[key] else float("nan")

    print(f"{'variant':<14} {'tokens/s':>10} {'vs bf16':>8} {'vs fp8':>7} {'peak GiB':>9} {'fwd+bwd':>8} {'saved':>7} "
          f"{'saved/fp8':>9} {'fp8 W':>6} {'loss 1st':>8} {'last10':>8}")
    for r in rows:
        if "skipped" in r:
            print(f"{r['impl']:<14} skipped: {r['skipped']}")
            continue
        print(f"{r['impl']:<14} {r['tokens_per_s']:>10,.0f} {ratio(r, g, 'tokens_per_s'):>7.3f}x "
              f"{ratio(r, f, 'tokens_per_s'):>6.3f}x {r['peak_gib']:>9.2f} {r['fwd_bwd_gib']:>8.2f} "
              f"{r['saved_gib']:>7.2f} {ratio(r, f, 'saved_gib'):>8.3f}x {r['fp8_weight_copies_gib']:>6.2f} "
              f"{r['loss_first']:>8.4f} {r['loss_last10']:>8.4f}")
    print("peak split, GiB: weights + AdamW state + FP8 weight copies + saved activations + the rest (gradients, "
          "temporaries)")
    for r in rows:
        if "skipped" not in r and r.get("rest_gib") is not None:
            print(f"{r['impl']:<14} {r['peak_gib']:>7.2f} = {r['weights_gib']:.2f} + {r['optimizer_state_gib']:.2f} + "
                  f"{r['fp8_weight_copies_gib']:.2f} + {r['saved_gib']:.2f} + {r['rest_gib']:.2f}")


def add_common_args(p, shapes) -> None:
    """The arguments both benchmarks take: shape, layers, batch, seq, steps, warmup, lr, adamw, json, progress."""
    p.add_argument("--shape", choices=list(shapes), default="dsv3")
    p.add_argument("--layers", type=int, default=None, help="default: the shape's")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=200, help="timed steps per variant")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--adamw", choices=ADAMW, default="fused",
                   help="torch's AdamW, every variant alike (default fused: both stacks' own default)")
    p.add_argument("--json", default=None)
    p.add_argument("--no-progress", dest="progress", action="store_false")


def bench_main(script: str, a, title: str, variants: list[str], run, bf16: str, seq_extra: int = 0) -> int:
    """The shared main of the two benchmarks: check for a GPU (``--shape tiny`` runs on CPU), set the allocator as
    ``moe-fp4 compare`` does, make the batches (``a.seq + seq_extra`` tokens a row), print the header, run each
    variant (``run(variant, a, data, device)`` -> its row), print the table, write ``a.json`` -> exit code."""
    if not torch.cuda.is_available() and a.shape != "tiny":
        print(f"{script} times a GPU: it needs one (on CPU: --shape tiny, a smoke run)", file=sys.stderr)
        return 2
    from moe_fp4.compare.memory import prefer_expandable_segments
    from moe_fp4.compare.origin import commit

    prefer_expandable_segments()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = stdlib_batches(a.batch, a.seq + seq_extra, a.warmup + a.steps, device)
    dev = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"{dev} | torch {torch.__version__} | commit {commit()} | {title}, batch {a.batch} x seq {a.seq}, "
          f"{a.warmup} + {a.steps} steps, AdamW {a.adamw}", flush=True)
    rows = [run(v, a, data, device) for v in variants]
    print_table(rows, bf16=bf16)
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"device": dev, "torch": torch.__version__, "commit": commit(), "args": vars(a), "rows": rows},
                      fh, indent=1)
    return 0
