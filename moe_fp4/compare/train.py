"""One mode's training: :class:`Trainer` (forward, backward, gradient averaging over ranks, clipping,
AdamW), :func:`build` (the mode's model: moe_fp4's :class:`~moe_fp4.model.decoder.DecoderLM`, or a
Hugging Face MoE model from :func:`hf_causal_lm` for ``--hook``), the batches, :func:`activation_bytes`
(what one forward keeps for backward), :func:`profile_steps` (the all-to-all's share under the
profiler) and :func:`train_mode` (the timed run of one mode -> its result row).

Every number is reduced over ranks here (``_max_over_ranks``, ``_mean_over_ranks``): what a row
holds is the same on every rank.
"""

from __future__ import annotations

import math
import statistics
import sys
import time

import torch
import torch.distributed as dist

from moe_fp4.compare.config import HF_MODES, CompareConfig, Env
from moe_fp4.compare.data import RandomTokens, TokenBatches
from moe_fp4.compare.quiet import quiet_kineto
from moe_fp4.exchange.a2a import WIRE_BYTES
from moe_fp4.model.decoder import DecoderLM
from moe_fp4.model.moe import MoE, end_grad_wire_step
from moe_fp4.model.optim import AdamWFP8Weights
from moe_fp4.saved.accounting import saved_bytes


def _all_reduce(x: torch.Tensor, env: Env, op=None) -> torch.Tensor:
    if env.world > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x


def _max_over_ranks(v: float, env: Env) -> float:
    return _all_reduce(torch.tensor([float(v)], dtype=torch.float64, device=env.device), env, dist.ReduceOp.MAX).item()


def _mean_over_ranks(v: float, env: Env) -> float:
    return _all_reduce(torch.tensor([float(v)], dtype=torch.float64, device=env.device), env).item() / env.world


class Trainer:
    """One mode's model, optimizer and step: forward, backward, gradient averaging over the
    replicated parameters, global-norm clipping, AdamW."""

    def __init__(self, model: torch.nn.Module, loss_fn, env: Env, lr: float, steps: int, sharded=(),
                 micro_batch: int | None = None, optimizer: str = "adamw-fp8"):
        self.model, self.loss_fn, self.env = model, loss_fn, env
        self.micro_batch = micro_batch
        sharded_ids = {id(p) for p in sharded}
        params = [p for p in model.parameters() if p.requires_grad]
        self.sharded = [p for p in params if id(p) in sharded_ids]
        self.replicated = [p for p in params if id(p) not in sharded_ids]
        # AdamWFP8Weights steps the weights the FP8 GEMMs read (moe_fp4.gemm.engines.FP8_WEIGHTS) and writes their
        # FP8 copies in the same pass; every other parameter takes torch's AdamW step.
        opt_class = {"adamw-fp8": AdamWFP8Weights, "adamw": torch.optim.AdamW}[optimizer]
        self.opt = opt_class(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, fused=env.cuda or None)
        warm = max(1, min(100, steps // 10))
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / warm) * (0.55 + 0.45 * math.cos(math.pi * min(s, steps) / steps)))

    def step(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """ids, targets int64 [B, S] -> the mean loss over the B sequences (float32 scalar), after one
        optimizer step. With ``micro_batch`` the B sequences go through forward and backward in
        ceil(B / micro_batch) near-equal micro-batches, each loss weighted by its share of B, the
        gradients accumulated: the same update as one pass over B, up to rounding. The FP8 weight
        copies are made once per step (moe_fp4.gemm.engines.FP8_WEIGHTS: the weights change only at opt.step)."""
        n = ids.shape[0]
        passes = -(-n // (self.micro_batch or n))          # near-equal passes of at most micro_batch
        loss = None
        for part_ids, part_targets in zip(ids.tensor_split(passes), targets.tensor_split(passes)):
            part = self.loss_fn(self.model, part_ids, part_targets) * (part_ids.shape[0] / n)
            part.backward()
            loss = part.detach() if loss is None else loss + part.detach()
        if self.env.ep is not None:
            # Gradient wires on "auto": the sqrt(3) rule's step, on the gradients as backward left them
            # (its weight ratio reads the experts' FC2 gradient before the clip scales it).
            end_grad_wire_step(self.model)
        self._sync_and_clip()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        return loss

    def _sync_and_clip(self, max_norm: float = 1.0) -> None:
        env = self.env
        rep = [p.grad for p in self.replicated if p.grad is not None]
        shard = [p.grad for p in self.sharded if p.grad is not None]
        if env.world > 1:
            flat = torch._utils._flatten_dense_tensors(rep)
            dist.all_reduce(flat)
            flat /= env.world
            for g, s in zip(rep, torch._utils._unflatten_dense_tensors(flat, rep)):
                g.copy_(s)
            # Each rank's loss is a mean over its own tokens, so a sharded expert collects the
            # gradients of `world` such means: divide to get the gradient of their average.
            torch._foreach_div_(shard, env.world)

        def sq(gs):
            return torch.stack(torch._foreach_norm(gs)).square().sum() if gs else torch.zeros((), device=env.device)

        norm = (sq(rep) + _all_reduce(sq(shard), env)).sqrt()
        torch._foreach_mul_(rep + shard, (max_norm / (norm + 1e-6)).clamp(max=1.0))


def _lm_loss(model, ids, targets):
    return model(ids, targets)


def _hf_shifted_loss(model, ids, targets):
    logits = model(input_ids=ids).logits.float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))


def hf_causal_lm(config, device=None, arch: str = "qwen3_moe", experts_implementation: str | None = None):
    """A Hugging Face MoE causal LM of the shape of a :class:`moe_fp4.model.decoder.ModelConfig` (random bf16
    weights from the current torch seed, built from a config: no download). Qwen3-MoE has no shared
    expert, so ``shared_ffn`` is ignored; the first ``dense_layers`` layers are dense MLPs of
    ``dense_ffn``. ``experts_implementation``: transformers' expert kernel ("grouped_mm" by default on
    CUDA, "eager" elsewhere)."""
    import transformers

    c = config
    impl = experts_implementation or ("grouped_mm" if torch.device(device or "cpu").type == "cuda" else "eager")
    hf = transformers.AutoConfig.for_model(
        arch, hidden_size=c.hidden, num_hidden_layers=c.layers, num_attention_heads=c.heads,
        num_key_value_heads=c.heads, head_dim=c.hidden // c.heads, vocab_size=c.vocab, max_position_embeddings=c.seq,
        num_experts=c.num_experts, num_experts_per_tok=c.top_k, moe_intermediate_size=c.ffn,
        intermediate_size=c.dense_ffn, norm_topk_prob=True, mlp_only_layers=list(range(c.dense_layers)))
    model = transformers.AutoModelForCausalLM.from_config(hf, experts_implementation=impl, dtype=torch.bfloat16)
    return model.to(device).train()


def build(cfg: CompareConfig, mode: str, env: Env):
    """-> (model, loss_fn, sharded parameters, compression handle or None) for one mode, initialized
    from cfg.seed."""
    mc = cfg.model
    if mode in HF_MODES:
        torch.manual_seed(cfg.seed)
        model = hf_causal_lm(mc, env.device)
        handle = None
        if mode == "hf+hook":
            import moe_fp4

            handle = moe_fp4.register_activation_compression(model)
        return model, _hf_shifted_loss, (), handle
    model = DecoderLM(mc, precision=mode, device=env.device, ep=env.ep, seed=cfg.seed, recompute=cfg.recompute,
                      storage=cfg.storage)
    return model, _lm_loss, model.expert_parameters() if env.ep is not None and not env.ep.simulate else (), None


def _batches(cfg: CompareConfig, env: Env, corpus, held_out: bool = False):
    seq = cfg.model.seq
    # The held-out batches of the stdlib text are the same for every --seed: a seed changes the weights and
    # the training batches, not the set the runs are judged on (runs of several seeds are compared). Random
    # tokens take seed + 1, so that no training batch repeats them.
    seed = (1 if cfg.data == "stdlib" else cfg.seed + 1) if held_out else cfg.seed
    if cfg.data == "random":
        return RandomTokens(cfg.model.vocab, seq, seed, env.rank, env.device)
    return TokenBatches(corpus.held_out if held_out else corpus.train, seq, seed, env.rank, env.device)


def _sync(env: Env) -> None:
    if env.cuda:
        torch.cuda.synchronize(env.device)


def activation_bytes(trainer: Trainer, ids, targets, handle=None) -> dict:
    """One forward + backward; -> {"activation_bytes": what the forward kept alive for backward (on CUDA
    the allocator's growth over the forward; on CPU the bytes saved for backward), "saved_bytes": the
    bytes saved for backward by count (every device)}."""
    env = trainer.env
    _sync(env)
    before = torch.cuda.memory_allocated(env.device) if env.cuda else 0
    if handle is not None:
        handle.stats.reset()
    loss, report = saved_bytes(trainer.loss_fn, trainer.model, ids, targets)
    saved = report.total
    if handle is not None:
        t = handle.stats.total
        saved += t.bytes_after + t.bytes_skipped
    _sync(env)
    grown = torch.cuda.memory_allocated(env.device) - before if env.cuda else saved
    loss.backward()
    trainer.opt.zero_grad(set_to_none=True)
    return {"activation_bytes": int(_max_over_ranks(grown, env)), "saved_bytes": int(_max_over_ranks(saved, env))}



def profile_steps(trainer: Trainer, data, batch: int, steps: int, table_rows: int = 0) -> tuple[float | None, str]:
    """Run ``steps`` training steps under torch.profiler -> (milliseconds per step in the all-to-all: the
    NCCL send/recv kernels on CUDA, the collective's ops on CPU, the mean over ranks; None without EP,
    and this rank's profiler table of the ``table_rows`` most expensive ops ("" when 0))."""
    env = trainer.env
    if steps == 0 or (env.world == 1 and not table_rows):
        return None, ""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.cuda else [])
    # acc_events: one profiling cycle here, so accumulating changes nothing, but without it torch 2.11
    # on CUDA warns that "Profiler clears events at the end of each cycle" on the first profile.
    with quiet_kineto(), profile(activities=acts, acc_events=True) as prof:
        for _ in range(steps):
            trainer.step(*data.next(batch))
        _sync(env)
    total = 0.0
    events = prof.key_averages()
    for e in events:
        k = e.key.lower()
        if env.cuda and "nccl" in k and ("sendrecv" in k or "alltoall" in k):
            total += getattr(e, "device_time_total", 0.0) or getattr(e, "cuda_time_total", 0.0)
        elif not env.cuda and ("all_to_all" in k or "alltoall" in k) and "::" in k:
            total += e.cpu_time_total
    text = ""
    if table_rows:
        text = events.table(sort_by="self_cuda_time_total" if env.cuda else "self_cpu_time_total", row_limit=table_rows,
                            max_name_column_width=90)
    return (_mean_over_ranks(total / 1e3 / steps, env) if env.world > 1 else None), text


def _progress(cfg: CompareConfig, env: Env, desc: str):
    if not (cfg.progress and env.lead and sys.stderr.isatty()):
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=cfg.steps, desc=desc, unit="step", leave=False, file=sys.stderr, dynamic_ncols=True)


def _wire_bytes_per_step(steps: int, env: Env) -> dict[str, float] | None:
    """The bytes each exchange sent to other ranks during the training steps, per step and rank (the mean
    over ranks) -> {role: bytes}, None without expert parallelism. Read after the timed steps: the
    reduction is a collective."""
    if env.world == 1:
        WIRE_BYTES.take()
        return None
    sent = WIRE_BYTES.take()
    roles = ("count", "dispatch", "combine", "dispatch_grad", "combine_grad")
    v = _all_reduce(torch.tensor([float(sent.get(r, 0)) for r in roles], dtype=torch.float64, device=env.device),
                    env)
    return {r: x / env.world / steps for r, x in zip(roles, v.tolist())}


def _dispatch_rows(rows: list[int], env: Env) -> dict | None:
    """rows[s]: the most rows one dispatch delivered to this rank in step s (over layers and micro-batches)
    -> {"max_rank": [per step, the largest rank's], "mean_rank": [per step, the mean over ranks],
    "imbalance": [max / mean per step]}; None without expert parallelism. A rank's expert activations grow
    with its rows: the memory of a step follows the most loaded rank (probes of a fresh model's second step
    under-read the peak of later steps)."""
    if env.world == 1:
        return None
    v = torch.tensor(rows, dtype=torch.float64, device=env.device)
    most = _all_reduce(v.clone(), env, dist.ReduceOp.MAX)
    mean = _all_reduce(v, env) / env.world
    return {"max_rank": most.tolist(), "mean_rank": mean.tolist(),
            "imbalance": [a / b if b else 1.0 for a, b in zip(most.tolist(), mean.tolist())]}


def train_mode(cfg: CompareConfig, mode: str, env: Env, corpus, batch: int, log=print,
               micro_batch: int | None = None) -> dict:
    """Train one mode for cfg.steps steps at ``batch`` sequences per rank per optimizer step, in
    micro-batches of ``micro_batch`` (None: one pass) -> its result row."""
    mc = cfg.model
    micro = micro_batch or batch
    model, loss_fn, sharded, handle = build(cfg, mode, env)
    trainer = Trainer(model, loss_fn, env, cfg.lr, cfg.steps, sharded, micro_batch=micro,
                      optimizer=cfg.optimizer)
    data, held = _batches(cfg, env, corpus), _batches(cfg, env, corpus, held_out=True)
    if env.cuda:
        torch.cuda.reset_peak_memory_stats(env.device)
    bar = _progress(cfg, env, f"{mode:>8}")
    every = max(1, cfg.steps // 10)
    # This rank's loss: averaging it over ranks here would add a collective inside the timed steps.
    loss_label = "loss" if env.world == 1 else "rank 0 loss"
    losses, events, t_cpu = [], [], []
    WIRE_BYTES.take()                         # the counts of what ran before this mode are not its own
    WIRE_BYTES.take_rows_max()
    rows = []                                 # per step: the most rows one dispatch delivered (host ints)
    t0 = time.perf_counter()
    for s in range(cfg.steps):
        ids, targets = data.next(batch)
        if s >= cfg.warmup:
            if env.cuda:
                events.append(torch.cuda.Event(enable_timing=True))
                events[-1].record()
            else:
                t_cpu.append(time.perf_counter())
        losses.append(trainer.step(ids, targets))
        rows.append(WIRE_BYTES.take_rows_max().get("dispatch", 0))
        if bar is not None:
            bar.update(1)
            if s % every == 0 or s == cfg.steps - 1:
                bar.set_postfix_str(f"{loss_label} {losses[-1].item():.3f}")
        elif env.lead and cfg.progress and (s % every == 0 or s == cfg.steps - 1):
            log(f"  {mode} step {s + 1}/{cfg.steps} {loss_label} {losses[-1].item():.4f}", flush=True)
    if env.cuda:
        events.append(torch.cuda.Event(enable_timing=True))
        events[-1].record()
        _sync(env)
        times = [a.elapsed_time(b) for a, b in zip(events, events[1:])]
    else:
        t_cpu.append(time.perf_counter())
        times = [(b - a) * 1e3 for a, b in zip(t_cpu, t_cpu[1:])]
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t0
    step_ms = _max_over_ranks(statistics.median(times), env)
    peak = _max_over_ranks(torch.cuda.max_memory_allocated(env.device), env) if env.cuda else None
    wire_bytes = _wire_bytes_per_step(cfg.steps, env)
    dispatch_rows = _dispatch_rows(rows, env)
    curve = _all_reduce(torch.stack(losses).float(), env) / env.world
    with torch.no_grad():
        ev = torch.stack([loss_fn(model, *held.next(micro)).float() for _ in range(cfg.eval_batches)]).mean()
    ev = (_all_reduce(ev, env) / env.world).item()
    act = activation_bytes(trainer, *data.next(micro), handle)   # one micro-batch's: what a pass holds
    # After the eval: the profiled steps train the model further.
    a2a, prof = profile_steps(trainer, data, batch, cfg.profile_steps, 60 if cfg.profile else 0)
    curve = curve.tolist()
    tail = curve[-max(1, min(50, cfg.steps // 10)):]
    row = {"mode": mode, "batch": batch, "micro_batch": micro, "accumulate": -(-batch // micro), "seq": mc.seq,
           "tokens_per_step_per_rank": batch * mc.seq,
           "step_ms": step_ms, "step_ms_all": times, "tokens_per_s_per_gpu": batch * mc.seq / step_ms * 1e3,
           "peak_bytes": peak, **act, "a2a_ms": a2a,
           "a2a_share": None if a2a is None else a2a / step_ms,
           "loss_final": statistics.fmean(tail), "loss_eval": ev, "loss_curve": curve, "wall_s": wall}
    if wire_bytes is not None:
        row["wire_bytes_per_step"] = wire_bytes
    if dispatch_rows is not None:
        row["dispatch_rows"] = dispatch_rows
    if prof:
        row["profile_table"] = prof
    rules = {name: {g: r.summary() for g, r in m.grad_rules.items()} for name, m in model.named_modules()
             if isinstance(m, MoE) and m.grad_rules}
    if rules:
        row["grad_wire_auto"] = rules   # the sqrt(3) rule per MoE layer and gradient (EPConfig "auto")
    if handle is not None:
        handle.remove()
    del model, trainer
    _free(env)
    return row


def _free(env: Env) -> None:
    """Return a finished model's memory before the next one is built: on a GPU its cyclic garbage collected and
    the allocator's cache emptied, so the next probe or run starts from the same state. On CPU nothing is
    measured from an allocator (the probes count bytes), and a full collection with torch and Triton imported
    is slow enough to add seconds to a plan: left to Python's own collector there."""
    if env.cuda:
        import gc

        gc.collect()
        torch.cuda.empty_cache()



def _quiet(*_a, **_k) -> None:
    return None


__all__ = ["Trainer", "activation_bytes", "build", "hf_causal_lm", "profile_steps", "train_mode"]
