"""Saved-tensor hook on a Hugging Face MoE model: peak memory and step time with and without it.

Builds a transformers MoE model from a config (random weights, bf16, small vocabulary, no download),
then measures one training step (forward + backward) in three modes, in one run:
  baseline   the model as it is
  hook       moe_fp4.register_activation_compression(model) (expert activations stored in MXFP4)
  removed    after handle.remove() (must match the baseline: loss and gradients bit-identical)

Per mode: step time (CUDA events, warmup, median of --iters), peak memory over the step
(max_memory_allocated after reset_peak_memory_stats, minus the memory held before the step: weights,
gradient buffers, optimizer-free), the memory held after the forward (the activations saved for backward),
and, from handle.stats, the expert modules' saved activations before/after compression.

    python bench/hook.py                                  # GPU: Qwen3-MoE, hidden 2048, 8 experts, 4 layers
    python bench/hook.py --arch mixtral --impl eager --json hook.json
    python bench/hook.py                                  # no GPU: a tiny CPU smoke run of the same code

No timed assertions; the script fails only if the removed hook does not restore the baseline exactly.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys

import torch

import moe_fp4
from moe_fp4.formats.metrics import sqnr_db

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # bench/, also under python -P
from harness import device_name, run_record, run_times, write_json  # noqa: E402

MiB = 2**20
REDUCTION_ORDER_FLOOR_DB = 80.0


def build(a, device):
    import transformers

    kw = dict(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
              num_key_value_heads=max(1, a.heads // 4), vocab_size=a.vocab, max_position_embeddings=a.seq,
              head_dim=a.hidden // a.heads)
    if a.arch == "mixtral":
        kw.update(num_local_experts=a.experts, num_experts_per_tok=a.topk, intermediate_size=a.intermediate)
    else:
        kw.update(num_experts=a.experts, num_experts_per_tok=a.topk, moe_intermediate_size=a.intermediate,
                  intermediate_size=a.intermediate, norm_topk_prob=True)
    cfg = transformers.AutoConfig.for_model(a.arch, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation=a.impl, dtype=torch.bfloat16)
    return model.to(device).train()


def one_step(model, ids, device):
    """-> (loss, ms, held_before, after_forward, peak) with memory in bytes relative to held_before; the
    step timed with CUDA events (wall clock on CPU)."""
    cuda = device == "cuda"
    model.zero_grad(set_to_none=False)
    held = 0
    if cuda:
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    got = {}

    def fwd_bwd():
        got["loss"] = model(input_ids=ids, labels=ids).loss
        got["after_fwd"] = torch.cuda.memory_allocated() - held if cuda else float("nan")
        got["loss"].backward()

    (ms,) = run_times(fwd_bwd, 1, device=device)
    peak = torch.cuda.max_memory_allocated() - held if cuda else float("nan")
    return got["loss"].detach(), ms, held if cuda else float("nan"), got["after_fwd"], peak


def measure(name, model, ids, device, iters, warmup):
    print(f"[{name}] warmup {warmup}, then {iters} timed steps", flush=True)
    for _ in range(warmup):
        one_step(model, ids, device)
    runs = [one_step(model, ids, device) for _ in range(iters)]
    loss = runs[-1][0]
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    res = {
        "step_ms_median": statistics.median(r[1] for r in runs),
        "step_ms_all": [r[1] for r in runs],
        "held_before_mib": runs[-1][2] / MiB,
        "after_forward_mib": runs[-1][3] / MiB,
        "peak_step_mib": runs[-1][4] / MiB,
        "loss": loss.item(),
    }
    print(f"[{name}] step {res['step_ms_median']:.2f} ms, after forward {res['after_forward_mib']:.1f} MiB, "
          f"peak over step {res['peak_step_mib']:.1f} MiB", flush=True)
    return res, loss, grads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", choices=["qwen3_moe", "mixtral"], default="qwen3_moe")
    p.add_argument("--impl", choices=["eager", "grouped_mm"], default="grouped_mm")
    p.add_argument("--hidden", type=int, default=None, help="default 2048 on GPU, 64 on CPU")
    p.add_argument("--intermediate", type=int, default=None, help="expert FFN width (default hidden/2)")
    p.add_argument("--experts", type=int, default=None, help="default 8 on GPU, 4 on CPU")
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="default 4 on GPU, 2 on CPU")
    p.add_argument("--heads", type=int, default=None, help="attention heads (default hidden/128, at least 4)")
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--seq", type=int, default=None, help="default 2048 on GPU, 32 on CPU")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--iters", type=int, default=None, help="timed steps per mode (default 10 on GPU, 2 on CPU)")
    p.add_argument("--warmup", type=int, default=None, help="default 3 on GPU, 1 on CPU")
    p.add_argument("--min-numel", type=int, default=4096, help="CompressionConfig.min_numel")
    p.add_argument("--json", default=None, help="also write the results here")
    a = p.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    gpu = device == "cuda"
    a.hidden = a.hidden or (2048 if gpu else 64)
    a.intermediate = a.intermediate or a.hidden // 2
    a.experts = a.experts or (8 if gpu else 4)
    a.layers = a.layers or (4 if gpu else 2)
    a.heads = a.heads or max(4, a.hidden // 128)
    a.seq = a.seq or (2048 if gpu else 32)
    a.iters = a.iters or (10 if gpu else 2)
    a.warmup = a.warmup if a.warmup is not None else (3 if gpu else 1)
    dev_name = device_name(device)
    print(f"moe_fp4 {moe_fp4.__version__} saved-tensor hook bench on {device} ({dev_name}), torch {torch.__version__}")
    if not gpu:
        print("CPU smoke run: a tiny model, the same code path; times and memory here mean nothing "
              "(memory is measured on CUDA only)")
    print(f"model: {a.arch} ({a.impl} experts), hidden {a.hidden}, expert FFN {a.intermediate}, {a.experts} experts "
          f"top-{a.topk}, {a.layers} layers, {a.heads} heads, vocab {a.vocab}, bf16; batch {a.batch} x seq {a.seq}",
          flush=True)

    model = build(a, device)
    ids = torch.randint(0, a.vocab, (a.batch, a.seq), generator=torch.Generator().manual_seed(1)).to(device)
    print(f"parameters: {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M", flush=True)

    base, base_loss, base_grads = measure("baseline", model, ids, device, a.iters, a.warmup)
    # One more baseline step: GPU kernels with atomics (scatter-add in routing) make gradients differ run to
    # run, and then "bit-identical after remove()" cannot be asked of the hook either.
    one_step(model, ids, device)
    base_again = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    deterministic = all(torch.equal(base_again[n], base_grads[n]) for n in base_grads)
    handle = moe_fp4.register_activation_compression(model, moe_fp4.CompressionConfig(min_numel=a.min_numel))
    print(f"hook on {len(handle.modules)} modules: {handle.modules[0]} ...", flush=True)
    hooked, hook_loss, hook_grads = measure("hook", model, ids, device, a.iters, a.warmup)
    steps = a.warmup + a.iters
    st = handle.stats.total
    handle.remove()
    removed, rm_loss, rm_grads = measure("removed", model, ids, device, a.iters, a.warmup)

    names = sorted(base_grads)
    flat = lambda g: torch.cat([g[n].float().flatten() for n in names])  # noqa: E731
    grad_db = sqnr_db(flat(base_grads), flat(hook_grads))
    worst_db, worst = min((sqnr_db(base_grads[n].float(), hook_grads[n].float()), n) for n in names)
    restored = torch.equal(rm_loss, base_loss) and all(torch.equal(rm_grads[n], base_grads[n]) for n in names)
    noise_db = math.inf if deterministic else sqnr_db(flat(base_grads), flat(base_again))
    removed_db = sqnr_db(flat(base_grads), flat(rm_grads))

    per_step = lambda v: v / steps / MiB  # noqa: E731
    expert = {
        "compressed_tensors_per_step": st.compressed / steps,
        "bf16_mib_per_step": per_step(st.bytes_before),
        "mxfp4_mib_per_step": per_step(st.bytes_after),
        "passed_through_mib_per_step": per_step(st.bytes_skipped),
        "skipped_per_step": {k: v / steps for k, v in st.skipped.items()},
        "ratio": st.ratio,
    }
    print(f"\nexpert modules' saved activations per step (handle.stats): {expert['bf16_mib_per_step']:.1f} MiB "
          f"-> {expert['mxfp4_mib_per_step']:.1f} MiB MXFP4 ({st.ratio:.3f}x), "
          f"{expert['passed_through_mib_per_step']:.2f} MiB passed through, skipped {expert['skipped_per_step']}")
    print(f"\n{'mode':<10}{'step ms':>10}{'after fwd MiB':>15}{'peak step MiB':>15}{'loss':>12}")
    for name, r in (("baseline", base), ("hook", hooked), ("removed", removed)):
        print(f"{name:<10}{r['step_ms_median']:>10.2f}{r['after_forward_mib']:>15.1f}{r['peak_step_mib']:>15.1f}"
              f"{r['loss']:>12.5f}")
    ratios = {
        "step_time": hooked["step_ms_median"] / base["step_ms_median"],
        "after_forward": hooked["after_forward_mib"] / base["after_forward_mib"] if gpu else float("nan"),
        "peak_step": hooked["peak_step_mib"] / base["peak_step_mib"] if gpu else float("nan"),
        "saved_mib": (base["after_forward_mib"] - hooked["after_forward_mib"]) if gpu else float("nan"),
    }
    print(f"{'hook/base':<10}{ratios['step_time']:>10.3f}{ratios['after_forward']:>15.3f}{ratios['peak_step']:>15.3f}")
    print(f"\nactivation memory saved after forward: {ratios['saved_mib']:.1f} MiB "
          f"(stats predict {expert['bf16_mib_per_step'] - expert['mxfp4_mib_per_step']:.1f} MiB)")
    print(f"gradients with hook vs baseline: {grad_db:.1f} dB all, worst {worst_db:.1f} dB ({worst}); "
          f"loss {'identical' if torch.equal(hook_loss, base_loss) else 'differs'}")
    # A bit-level difference far above the hook's own effect (MXFP4: ~20-40 dB) is cuBLAS/atomics picking another
    # reduction order for a changed memory layout, not the hook.
    same_up_to_order = restored or (torch.equal(rm_loss, base_loss) and removed_db >= REDUCTION_ORDER_FLOOR_DB)
    if restored:
        print("after handle.remove(): bit-identical to baseline")
    elif deterministic:
        print(f"after handle.remove(): not bit-identical: gradients {removed_db:.1f} dB vs baseline "
              f"({'reduction-order noise, far above the hook' if same_up_to_order else 'DIFFERS'}); loss "
              f"{'identical' if torch.equal(rm_loss, base_loss) else 'differs'}")
    else:
        print(f"after handle.remove(): gradients {removed_db:.1f} dB vs baseline; the baseline itself differs run to "
              f"run ({noise_db:.1f} dB, nondeterministic GPU kernels), so bit-identity is not checkable here; "
              f"loss {'identical' if torch.equal(rm_loss, base_loss) else 'differs'}")

    if a.json:
        # "device" stays the device type here, its name is "device_name"
        out = {**run_record(device), "device": device, "device_name": dev_name,
               "transformers": __import__("transformers").__version__, "cpu_smoke_run": not gpu,
               "args": vars(a), "baseline": base, "hook": hooked, "removed": removed, "ratios": ratios,
               "expert_activations": expert, "grad_sqnr_db": grad_db, "worst_param_grad_sqnr_db": worst_db,
               "worst_param": worst, "restored_exactly": restored,
               "baseline_deterministic": deterministic, "baseline_rerun_grad_sqnr_db": noise_db,
               "removed_grad_sqnr_db": removed_db}
        write_json(a.json, out, indent=2, default=str)
        print(f"wrote {a.json}")
    if not same_up_to_order:
        raise SystemExit("handle.remove() did not restore the baseline exactly")


if __name__ == "__main__":
    main()
