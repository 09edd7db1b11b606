"""The end-to-end comparison behind ``moe-fp4 compare``: train one model in bf16, fp8 and fp4.

Each mode builds the same :class:`~moe_fp4.model.decoder.DecoderLM` (same seed: same initial weights,
same batches) and trains it for ``steps`` steps with AdamW (float32 master weights, bf16 compute,
global-norm clipping at 1, linear warmup then cosine decay). Measured per mode:

- step time: CUDA events around every step after ``warmup``, median (wall clock on CPU); tokens/s
  per GPU = batch * seq / step time, the slowest rank's under EP;
- peak memory: ``torch.cuda.max_memory_allocated`` over the whole run (largest rank);
- activation memory: what one forward keeps alive for backward. On CUDA the allocator's growth
  over the forward (logits and loss included); on CPU the bytes saved for backward
  (:func:`moe_fp4.saved.accounting.saved_bytes`, plus what the compression hook stored in the ``--hook`` run);
- all-to-all share: the NCCL send/recv kernels' time in a few profiled steps over the step time
  (EP only);
- loss: every step's training loss (averaged over ranks), and a held-out loss at the end.

Expert parallelism: under ``torchrun`` with more than one process every MoE layer is split over all
ranks (:class:`moe_fp4.exchange.ep.EPConfig`); the other parameters are replicated and their gradients
averaged (data parallel over the same ranks), each rank draws its own batches.

``max_batch_gib``: for each mode, the exact largest batch (sequences per rank) whose step peaks
within that budget (per device): :func:`search_largest_batch`, every candidate measured by one probe
step from a freshly built model (two probes give an affine prediction, then bracket and bisect); the
timed run then uses each mode's own largest batch. On CPU the memory of
a step is estimated (parameters, gradients, optimizer state and saved activations; there is no
allocator to ask), so CPU budgets are for tests, not measurements.

``recompute``: every mode's recomputation policy (:class:`moe_fp4.model.moe.Recompute`). ``plan`` (with
``budget_gib`` and ``global_batch``): per mode, :func:`plan_mode` measures each policy's largest
micro-batch in the budget and the tokens/s of each distinct split (:mod:`moe_fp4.model.planner`), and the mode
trains with the fastest; the report keeps every candidate under "plans".
"""

from __future__ import annotations

import contextlib
import datetime
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace

import torch
import torch.distributed as dist

from moe_fp4.formats.conversions import conversion_path
from moe_fp4.compare.data import RandomTokens, TokenBatches, stdlib_corpus
from moe_fp4.exchange.ep import EPConfig
from moe_fp4.model.experts import Precision
from moe_fp4.gemm.engines import grouped_gemm_backend
from moe_fp4.saved.hook import StorageFormat
from moe_fp4.model.decoder import PRESETS, DecoderLM, ModelConfig, parameter_count
from moe_fp4.model.moe import DISPATCH_FORMAT, MoE, Recompute, end_grad_wire_step
from moe_fp4.model.optim import AdamWFP8Weights
from moe_fp4.model.planner import (  # noqa: F401 (re-exported)
    MAX_SEARCH_PROBES,
    PLAN_TIMED_STEPS,
    PLAN_WARMUP_STEPS,
    largest_micro_batch,
    micro_batch,
    search_largest_batch,
)
from moe_fp4.saved.accounting import saved_bytes

GiB = 2**30
MODES = tuple(p.value for p in Precision)
HF_MODES = ("hf", "hf+hook")
DATA = ("stdlib", "random")
OPTIMIZERS = ("adamw-fp8", "adamw")
CPU_NOTE = ("CPU run: conversions by {path}, FP8 GEMMs emulated in float32; CPU timings mean nothing, they "
            "only show that every path runs. Measure on a GPU.")


class BatchDoesNotFit(ValueError):
    """The requested batch needs more memory than the budget."""


@dataclass(frozen=True)
class CompareConfig:
    """What ``moe-fp4 compare`` runs. batch: sequences per rank; warmup: untimed first steps (they
    still train); max_batch_gib: per-device budget for the largest-batch search (None: off);
    budget_gib: per-device budget the requested batch must fit (None: no check; on CUDA an
    out-of-memory step still ends with a clear error); hook: compare a Hugging Face MoE model with
    and without :func:`moe_fp4.register_activation_compression` instead of the precision modes;
    profile: keep the profiler's table of the profiled steps in each row ("profile_table");
    global_batch: sequences per optimizer step over all ranks (None: ``batch`` per rank, one micro-batch):
    each rank takes global_batch / world of them per step in the fewest near-equal micro-batches of at
    most the mode's batch (``batch``, or with ``max_batch_gib`` its largest micro-batch whose
    accumulated step fits), the gradients accumulated, so every mode trains on the same batches;
    recompute: the recomputation policy of every mode (:class:`moe_fp4.model.moe.Recompute`: none, swiglu, moe,
    layer); plan: per mode, choose the policy and micro-batch with the highest measured tokens/s that fits
    ``budget_gib`` at ``global_batch`` (:mod:`moe_fp4.model.planner`) and train with that choice; storage: the
    format the fp4 mode keeps its activations in, "mxfp4" or "nvfp4" (:class:`moe_fp4.StorageFormat`);
    optimizer: "adamw-fp8" (:class:`moe_fp4.model.optim.AdamWFP8Weights`: the FP8 modes' expert weights take a step
    that also writes their FP8 copies, every other parameter torch's fused AdamW step; the bf16 and Hugging
    Face modes have no FP8 weights, so for them it is torch's AdamW) or "adamw" (torch.optim.AdamW for
    every mode: the FP8 copies are made in the next forward)."""

    preset: str = "small"
    modes: tuple[str, ...] = MODES
    steps: int = 200
    warmup: int = 20
    batch: int = 8
    seq: int | None = None
    experts: int | None = None
    layers: int | None = None
    lr: float = 1e-3
    seed: int = 0
    data: str = "stdlib"
    eval_batches: int = 8
    max_batch_gib: float | None = None
    budget_gib: float | None = None
    global_batch: int | None = None
    recompute: str = "none"
    plan: bool = False
    profile_steps: int = 3
    profile: bool = False
    hook: bool = False
    progress: bool = True
    storage: str = "mxfp4"
    optimizer: str = "adamw-fp8"

    def __post_init__(self):
        """Every check that needs no device: ``moe-fp4 compare`` builds this before any model, so a bad
        argument fails in a second with one line instead of after minutes of training."""
        if self.preset not in PRESETS:
            raise ValueError(f"unknown preset {self.preset!r}; choose one of {', '.join(PRESETS)}")
        allowed = HF_MODES if self.hook else MODES
        modes = tuple(HF_MODES if self.hook and self.modes == MODES else self.modes)
        bad = [m for m in modes if m not in allowed]
        if bad or not modes:
            raise ValueError(f"unknown mode(s) {bad or modes}; choose from {', '.join(allowed)}")
        object.__setattr__(self, "modes", modes)
        if self.data not in DATA:
            raise ValueError(f"unknown data {self.data!r}; choose one of {', '.join(DATA)}")
        if self.global_batch is not None and self.global_batch <= 0:
            raise ValueError(f"global_batch must be positive, got {self.global_batch}")
        for name in ("steps", "batch", "eval_batches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in ("seq", "experts", "layers"):   # None: the preset's
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if not (self.lr > 0 and math.isfinite(self.lr)):   # also NaN, which compares False
            raise ValueError(f"lr must be positive, got {self.lr}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"warmup = {self.warmup} must be in [0, steps = {self.steps}): "
                             "the timed steps come after it")
        for name in ("max_batch_gib", "budget_gib"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be positive, got {v}")
        if self.max_batch_gib is not None and self.budget_gib is not None:
            raise ValueError("budget_gib checks the given batch, max_batch_gib picks each mode's own: give one of them")
        object.__setattr__(self, "recompute", Recompute(self.recompute).value)   # ValueError names the choices
        try:
            object.__setattr__(self, "storage", StorageFormat(self.storage).value)
        except ValueError:
            raise ValueError(f"storage must be one of {', '.join(f.value for f in StorageFormat)}, got "
                             f"{self.storage!r}") from None
        if self.storage != "mxfp4" and (self.hook or "fp4" not in self.modes):
            raise ValueError("--storage sets the format the fp4 mode keeps its activations in: run it with fp4 in "
                             "--modes (and without --hook)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.hook and (self.recompute != "none" or self.plan):
            raise ValueError("--recompute and --plan apply to moe_fp4's decoder; --hook compares a Hugging Face model")
        if self.plan:
            if self.budget_gib is None or self.global_batch is None:
                raise ValueError("--plan auto chooses a micro-batch and recomputation per mode for a budget and a "
                                 "global batch: give --budget-gib and --global-batch")
            if self.recompute != "none":
                raise ValueError("--plan auto chooses the recomputation per mode: leave --recompute out")
        if self.profile_steps < 0:
            raise ValueError(f"profile_steps must be >= 0, got {self.profile_steps}")
        if self.profile and not self.profile_steps:
            raise ValueError("profile writes the profiler's table of the profiled steps: it needs profile_steps > 0")
        mc = self.model  # ModelConfig validates the overrides
        if mc.moe_layers < 1:
            # The modes differ only in the MoE layers: without one they would train the same model.
            raise ValueError(f"layers = {mc.layers} leaves no MoE layer (preset {self.preset} starts with "
                             f"{mc.dense_layers} dense), so every mode would train the same model; use layers >= "
                             f"{mc.dense_layers + 1}")

    @property
    def model(self) -> ModelConfig:
        return PRESETS[self.preset].with_(seq=self.seq, num_experts=self.experts, layers=self.layers)


@dataclass(frozen=True)
class Env:
    """Where the run happens: device, this rank, the world size and the EP config (None: one process)."""

    device: torch.device
    rank: int = 0
    world: int = 1
    ep: EPConfig | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def lead(self) -> bool:
        return self.rank == 0


def check_ep(model: ModelConfig, world: int) -> None:
    if model.num_experts % world:
        raise ValueError(f"expert parallelism over {world} ranks needs an expert count divisible by {world}; "
                         f"the model has {model.num_experts} (pass --experts)")


def version() -> str:
    """moe_fp4's version, from the code that runs (not the metadata of whatever copy pip installed)."""
    from moe_fp4 import __version__

    return __version__


def _git(args: list[str], cwd: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10,
                          check=True).stdout.strip()


def _is_moe_fp4_project(root: str) -> bool:
    """Whether ``root`` holds moe_fp4's own pyproject.toml (name = "moe_fp4")."""
    try:
        with open(os.path.join(root, "pyproject.toml"), encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return False
    return re.search(r'(?m)^\s*name\s*=\s*["\']moe[_-]fp4["\']', text) is not None


def commit() -> str | None:
    """MOE_FP4_COMMIT if set (recorded when the tree was copied or built without its git history), else
    git's short HEAD of moe_fp4's own checkout ("+dirty" with uncommitted changes to tracked files):
    the package's parent directory must be the top of a git work tree that holds moe_fp4's
    pyproject.toml (a source checkout or an editable install). None otherwise: a wheel installed into
    some other repository's virtual environment must not report that repository's commit."""
    if os.environ.get("MOE_FP4_COMMIT"):
        return os.environ["MOE_FP4_COMMIT"]
    # this file is <root>/moe_fp4/compare/runner.py
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not _is_moe_fp4_project(root):
        return None
    try:
        if not os.path.samefile(_git(["rev-parse", "--show-toplevel"], root), root):
            return None
        sha = _git(["rev-parse", "--short", "HEAD"], root)
        dirty = _git(["status", "--porcelain", "--untracked-files=no"], root)
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def provenance(meta: dict) -> str:
    """meta: describe()'s dict -> "moe_fp4 0.1.0, commit abc1234" (no commit part when there is none)."""
    return f"moe_fp4 {meta['version']}" + (f", commit {meta['commit']}" if meta.get("commit") else "")


def describe(env: Env) -> dict:
    import triton

    dev = torch.cuda.get_device_name(env.device) if env.cuda else f"CPU ({platform.processor() or platform.machine()})"
    return {"device": dev, "gpus": env.world if env.cuda else 0, "world": env.world,
            "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "version": version(), "commit": commit(), "grouped_gemm": grouped_gemm_backend(env.device).value,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "command": " ".join([_program()] + sys.argv[1:])}


def _program() -> str:
    name = os.path.basename(sys.argv[0])
    return "moe-fp4" if name in ("__main__.py", "moe-fp4") else name


def _all_reduce(x: torch.Tensor, env: Env, op=None) -> torch.Tensor:
    if env.world > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x


def _max_over_ranks(v: float, env: Env) -> float:
    return _all_reduce(torch.tensor([float(v)], dtype=torch.float64, device=env.device), env, dist.ReduceOp.MAX).item()


def _mean_over_ranks(v: float, env: Env) -> float:
    return _all_reduce(torch.tensor([float(v)], dtype=torch.float64, device=env.device), env).item() / env.world


def ranks_legend(world: int) -> str | None:
    """What each printed number is under expert parallelism (None on one process): the table's
    columns are reduced over ranks, each in its own way."""
    if world == 1:
        return None
    return (f"{world} ranks: tokens/s/GPU and step ms are the slowest rank's, peak and activation memory the "
            f"largest rank's; the all-to-all share and the losses are means over the {world} ranks (the progress "
            f"lines during training show rank 0's loss)")


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
        self._sync_and_clip()
        self.opt.step()
        self.sched.step()
        self.opt.zero_grad(set_to_none=True)
        if self.env.ep is not None:
            end_grad_wire_step(self.model)   # gradient wires on "auto": the sqrt(3) rule's step
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
    seed = cfg.seed + (1 if held_out else 0)
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


@contextlib.contextmanager
def _quiet_kineto():
    """Keep the profiler's C++ side (kineto) from writing its own log lines ("USDT: ... profiler_start" /
    "profiler_stop", once per profiled run on every rank) to stderr. Kineto reads KINETO_LOG_LEVEL once,
    when the first profile starts; 6 is above its highest severity. A level the user set is kept, and the
    variable is restored so that no child process inherits the change."""
    if "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        os.environ.pop("KINETO_LOG_LEVEL", None)


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
    with _quiet_kineto(), profile(activities=acts, acc_events=True) as prof:
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
    import gc

    gc.collect()
    if env.cuda:
        torch.cuda.empty_cache()


def step_bytes(cfg: CompareConfig, mode: str, env: Env, corpus, batches: list[int], passes: int = 1) -> dict[int, int]:
    """Memory of one training step at each batch (per device, the largest rank): CUDA's peak
    allocation, or on CPU parameters + gradients + optimizer state + saved activations. With
    ``passes`` > 1 the step takes batch * passes sequences in micro-batches of ``batch``, gradients
    accumulated (a later pass runs with the earlier passes' gradients held: more than one pass of the
    same batch). Builds its own model (the probes train it) and frees it."""
    _free(env)   # every probe starts from the same state: nothing cached from the one before
    out = {}
    model = trainer = handle = None
    try:
        model, loss_fn, sharded, handle = build(cfg, mode, env)
        trainer = Trainer(model, loss_fn, env, cfg.lr, cfg.steps, sharded, optimizer=cfg.optimizer)
        data = _batches(cfg, env, corpus)
        trainer.micro_batch = batches[0]
        trainer.step(*data.next(batches[0] * passes))        # optimizer state exists from here on
        for b in batches:
            trainer.micro_batch = b
            ids, targets = data.next(b * passes)
            if env.cuda:
                _sync(env)
                torch.cuda.reset_peak_memory_stats(env.device)
                try:
                    trainer.step(ids, targets)
                    _sync(env)
                    used = torch.cuda.max_memory_allocated(env.device)
                except torch.OutOfMemoryError:
                    trainer.opt.zero_grad(set_to_none=True)
                    used = float("inf")
            else:
                static = sum(t.numel() * t.element_size() for p in model.parameters()
                             for t in (p, *trainer.opt.state[p].values()) if isinstance(t, torch.Tensor))
                act = activation_bytes(trainer, ids[:b], targets[:b], handle)["saved_bytes"]
                used = static + sum(p.numel() * p.element_size() for p in model.parameters()) + act
            out[b] = _max_over_ranks(used, env)
    except torch.OutOfMemoryError:
        # Out of memory building the model or in its first step: none of the batches fits. (An
        # exception raised on some ranks only would leave the others in a collective; a probe's
        # memory is the same on every rank up to routing, which the search's margin does not rely on.)
        out.update({b: float("inf") for b in batches if b not in out})
    finally:
        if handle is not None:
            handle.remove()
        del model, trainer
        _free(env)
    return out


def per_rank_batch(global_batch: int, world: int) -> int:
    """Sequences per rank per optimizer step of a global batch over ``world`` ranks (ValueError unless
    it divides evenly)."""
    if global_batch % world:
        raise ValueError(f"global batch {global_batch} does not divide over {world} ranks: give a multiple of {world}")
    return global_batch // world


def _quiet(*_a, **_k) -> None:
    return None


def largest_batch(cfg: CompareConfig, mode: str, env: Env, corpus, budget: float, log=print) -> dict:
    """The exact largest batch whose training step fits ``budget`` bytes per device
    (:func:`search_largest_batch`; each candidate one probe from a freshly built model: step_bytes).
    With a global batch, :func:`moe_fp4.model.planner.largest_micro_batch` instead."""
    return search_largest_batch(lambda b: step_bytes(cfg, mode, env, corpus, [b])[b], budget,
                                max(1, cfg.batch // 2), log=lambda *a, **k: log(f"  {mode}:" + a[0][1:], **k))


def measure_steps(cfg: CompareConfig, mode: str, env: Env, corpus, batch: int, micro: int,
                  warmup: int = PLAN_WARMUP_STEPS, steps: int = PLAN_TIMED_STEPS) -> tuple[float, float | None]:
    """Time ``steps`` training steps of ``batch`` sequences per rank in micro-batches of at most ``micro``
    (after ``warmup`` untimed ones) on a freshly built model -> (tokens/s per GPU of the slowest rank,
    peak bytes of the largest rank; None on CPU). The model is freed afterwards."""
    _free(env)
    model, loss_fn, sharded, handle = build(cfg, mode, env)
    trainer = Trainer(model, loss_fn, env, cfg.lr, cfg.steps, sharded, micro_batch=micro,
                      optimizer=cfg.optimizer)
    data = _batches(cfg, env, corpus)
    try:
        for _ in range(warmup):
            trainer.step(*data.next(batch))
        _sync(env)
        if env.cuda:
            torch.cuda.reset_peak_memory_stats(env.device)
        times = []
        for _ in range(steps):
            ids, targets = data.next(batch)
            _sync(env)
            t0 = time.perf_counter()
            trainer.step(ids, targets)
            _sync(env)
            times.append(time.perf_counter() - t0)
        peak = _max_over_ranks(torch.cuda.max_memory_allocated(env.device), env) if env.cuda else None
        step_s = _max_over_ranks(statistics.median(times), env)
    finally:
        if handle is not None:
            handle.remove()
        del model, trainer
        _free(env)
    return batch * cfg.model.seq / step_s, peak


def plan_mode(cfg: CompareConfig, mode: str, env: Env, corpus, per_rank: int, log=print,
              warmup_steps: int = PLAN_WARMUP_STEPS, timed_steps: int = PLAN_TIMED_STEPS):
    """:func:`moe_fp4.model.planner.choose` for one mode: each policy's exact largest micro-batch in
    ``cfg.budget_gib`` (every probe a fresh model, :func:`step_bytes`), each distinct split timed by
    :func:`measure_steps` -> the Plan."""
    from moe_fp4.model.planner import choose

    budget = cfg.budget_gib * GiB

    def measure(policy: str, micro: int, passes: int) -> float:
        return step_bytes(replace(cfg, recompute=policy, plan=False), mode, env, corpus, [micro], passes)[micro]

    def timed(policy: str, micro: int, passes: int) -> tuple[float, float | None]:
        return measure_steps(replace(cfg, recompute=policy, plan=False), mode, env, corpus, per_rank, micro,
                             warmup_steps, timed_steps)

    return choose([p.value for p in Recompute], measure, timed, per_rank, budget,
                  lambda msg, **k: log(f"  {mode}" + msg[1:], **k))


def ratios(rows: dict[str, dict], base: str = "fp8") -> dict:
    """{mode: {key: mode's value / base's}} for throughput and memory, and loss deltas in % of bf16 and fp8."""
    out = {}
    for m, r in rows.items():
        d = {}
        b = rows.get(base)
        for key in ("tokens_per_s_per_gpu", "step_ms", "peak_bytes", "activation_bytes", "saved_bytes"):
            if b and r.get(key) and b.get(key):
                d[f"{key}_vs_{base}"] = r[key] / b[key]
        for ref in ("bf16", "fp8"):
            if ref in rows and ref != m:
                for key in ("loss_final", "loss_eval"):
                    d[f"{key}_delta_pct_vs_{ref}"] = 100.0 * (r[key] - rows[ref][key]) / rows[ref][key]
        out[m] = d
    return out


def run(cfg: CompareConfig, env: Env, log=print) -> dict:
    """Run every mode (and the largest-batch search with ``max_batch_gib``) -> the report dict that
    ``moe-fp4 compare`` prints and writes as JSON."""
    mc = cfg.model
    if env.world > 1:
        if cfg.hook:
            raise ValueError("--hook compares a Hugging Face model on one device; run it without torchrun")
        check_ep(mc, env.world)
    if cfg.global_batch is not None:
        per_rank_batch(cfg.global_batch, env.world)   # fails now, not after the searches
    t0 = time.perf_counter()
    corpus = stdlib_corpus() if cfg.data == "stdlib" else None
    meta = describe(env)
    meta["optimizer"] = cfg.optimizer
    if env.ep is not None:
        # What each exchange sends: the dispatch in the mode's format unless EPConfig sets it, the rest as
        # EPConfig says.
        meta["wire"] = {"dispatch": {m: (env.ep.dispatch or DISPATCH_FORMAT[Precision(m)]).value
                                     for m in cfg.modes if m in MODES},
                        **{k: getattr(getattr(env.ep, k), "value", getattr(env.ep, k))
                           for k in ("combine", "dispatch_grad", "combine_grad")},
                        "simulated": env.ep.simulate}
        if env.ep.grad_rules():
            meta["wire"]["auto"] = {"format": env.ep.auto_format.value, "patience": env.ep.auto_patience}
    report = {"meta": meta, "config": {**asdict(cfg), "model": asdict(mc)}, "notes": [], "modes": {},
              "max_batch": {}}
    if not env.cuda:
        report["notes"].append(CPU_NOTE.format(path=conversion_path(env.device)))
    if ranks_legend(env.world):
        report["notes"].append(ranks_legend(env.world))
    if corpus is not None:
        meta["data"] = (f"stdlib: {corpus.files} Python source files, {corpus.train.numel() / 2**20:.1f} MiB train, "
                        f"{corpus.held_out.numel() / 2**20:.1f} MiB held out, byte tokens")
    if env.lead:
        counts = parameter_count(DecoderLM(mc.with_(), precision="bf16", device="meta")) if not cfg.hook else None
        log(f"moe-fp4 compare: preset {cfg.preset} ({mc.layers} layers, hidden {mc.hidden}, {mc.num_experts} experts "
            f"top-{mc.top_k}, ffn {mc.ffn}, seq {mc.seq}), modes {', '.join(cfg.modes)}, {cfg.steps} steps "
            f"({cfg.warmup} untimed), data {cfg.data}", flush=True)
        params = (f"{counts['total'] / 1e6:.1f} million parameters ({counts['active_per_token'] / 1e6:.1f} million "
                  f"active per token); " if counts else "")
        log(f"  {params}{meta['device']} x {env.world}, torch {meta['torch']}, triton {meta['triton']}, "
            f"grouped GEMMs {meta['grouped_gemm']}, optimizer {cfg.optimizer}, {provenance(meta)}", flush=True)
        for n in report["notes"]:
            log("  note: " + n, flush=True)
    batch = {m: cfg.batch for m in cfg.modes}
    policy = {m: cfg.recompute for m in cfg.modes}
    micro = {m: None for m in cfg.modes}
    if cfg.plan:
        per_rank = per_rank_batch(cfg.global_batch, env.world)
        report["plans"] = {}
        for m in cfg.modes:
            if env.lead:
                log(f"[{m}] planning {per_rank} sequences per rank per step in {cfg.budget_gib:g} GiB per device",
                    flush=True)
            chosen = plan_mode(cfg, m, env, corpus, per_rank, log if env.lead else _quiet)
            report["plans"][m] = asdict(chosen)
            if env.lead:
                log("  " + chosen.table().replace("\n", "\n  "), flush=True)
            batch[m], micro[m], policy[m] = per_rank, chosen.micro_batch, chosen.policy
    elif cfg.budget_gib is not None and cfg.max_batch_gib is None:
        for m in cfg.modes:
            fit = step_bytes(cfg, m, env, corpus, [max(1, cfg.batch // 2), cfg.batch])[cfg.batch]
            if fit > cfg.budget_gib * GiB:
                raise BatchDoesNotFit(
                    f"batch {cfg.batch} x {mc.seq} does not fit in {cfg.budget_gib:g} GiB per device in mode {m}: "
                    f"one step needs {fit / GiB:.2f} GiB. Lower --batch, or find the largest with --max-batch "
                    f"{cfg.budget_gib:g}")
    if cfg.max_batch_gib is not None:
        for m in cfg.modes:
            if env.lead:
                log(f"[{m}] largest batch in {cfg.max_batch_gib:g} GiB per device", flush=True)
            # With a global batch the micro-batch must fit an accumulated step: a later pass holds the
            # earlier passes' gradients (measured on an H100: fp4 at batch 44 of the small preset,
            # 11.89 GiB in one pass, 13.53 GiB in the second of two), unless the rank's whole batch
            # fits in one pass (which that search, on the two-pass curve, would not see).
            if cfg.global_batch is not None:
                found = largest_micro_batch(
                    lambda b, passes: step_bytes(cfg, m, env, corpus, [b], passes)[b], cfg.max_batch_gib * GiB,
                    per_rank_batch(cfg.global_batch, env.world), max(1, cfg.batch // 2),
                    log=lambda *a, **k: (log if env.lead else _quiet)(f"  {m}:" + a[0][1:], **k))
            else:
                found = largest_batch(cfg, m, env, corpus, cfg.max_batch_gib * GiB, log if env.lead else _quiet)
            report["max_batch"][m] = found
            if found["batch_max"] == 0:
                raise BatchDoesNotFit(f"mode {m}: not even one sequence of {mc.seq} fits in {cfg.max_batch_gib:g} GiB "
                                      f"per device (probes: {found['probe']})")
            batch[m] = found["batch_max"]
    if cfg.global_batch is not None and not cfg.plan:
        per_rank = per_rank_batch(cfg.global_batch, env.world)
        for m in cfg.modes:
            micro[m] = micro_batch(per_rank, batch[m])
            batch[m] = per_rank
    for m in cfg.modes:
        if env.lead:
            split = "" if micro[m] in (None, batch[m]) else \
                f" ({-(-batch[m] // micro[m])} micro-batches of up to {micro[m]}, gradients accumulated)"
            again = "" if policy[m] == "none" else f", recompute {policy[m]}"
            log(f"[{m}] training {cfg.steps} steps at batch {batch[m]} x {mc.seq} per rank{split}{again}", flush=True)
        try:
            report["modes"][m] = train_mode(replace(cfg, recompute=policy[m], plan=False), m, env, corpus, batch[m],
                                            log if env.lead else _quiet, micro_batch=micro[m])
        except torch.OutOfMemoryError as e:
            raise BatchDoesNotFit(f"batch {batch[m]} x {mc.seq} does not fit on {meta['device']} in mode {m} "
                                  f"(out of memory). Lower --batch, or find the largest with --max-batch GIB") from e
        budget = cfg.max_batch_gib if cfg.max_batch_gib is not None else cfg.budget_gib
        report["modes"][m]["recompute"] = policy[m]
        if m == "fp4":
            report["modes"][m]["storage"] = cfg.storage
        peak = report["modes"][m]["peak_bytes"]
        if budget is not None and peak is not None and peak > budget * GiB:
            report["notes"].append(f"{m}: the training run peaked at {peak / GiB:.2f} GiB, above the {budget:g} GiB "
                                   f"budget its batch was chosen for")
        if env.lead:
            log("  " + done_line(report["modes"][m], env.world), flush=True)
    report["ratios"] = ratios(report["modes"], "hf" if cfg.hook else "fp8")
    report["wall_s"] = time.perf_counter() - t0
    return report




def _gib(v) -> str:
    return "-" if v is None else f"{v / GiB:.2f} GiB" if v >= GiB else f"{v / 2**20:.1f} MiB"


def done_line(r: dict, world: int = 1) -> str:
    """One mode's result as it finishes, every number named (the table's header comes at the end)."""
    slowest, largest, mean = ("", "", "") if world == 1 else (" (slowest rank)", " (largest rank)",
                                                              f" (means over {world} ranks)")
    parts = [f"{r['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {r['step_ms']:.1f} ms/step{slowest}"]
    if r.get("recompute", "none") != "none":
        parts.append(f"recompute {r['recompute']}")
    if r.get("storage", "mxfp4") != "mxfp4":
        parts.append(f"activations stored in {r['storage']}")
    peak = "" if r["peak_bytes"] is None else f"peak {_gib(r['peak_bytes'])}, "
    parts.append(f"memory{largest}: {peak}activation {_gib(r['activation_bytes'])}")
    if r["a2a_share"] is not None:
        parts.append(f"all-to-all {100 * r['a2a_share']:.1f}% of the step")
    if r.get("grad_wire_auto"):
        parts.append(grad_wire_line(r["grad_wire_auto"]))
    parts.append(f"loss {r['loss_final']:.4f}, eval loss {r['loss_eval']:.4f}{mean}")
    return f"{r['mode']} done: " + ", ".join(parts)


def grad_wire_line(rules: dict) -> str:
    """The sqrt(3) rule's outcome per layer and gradient, one clause each."""
    out = []
    for layer, per in rules.items():
        for g, d in per.items():
            if not d["steps"]:
                out.append(f"{layer} {g}: not measured")
                continue
            fell = "never below sqrt(3)" if d["fell_back_at"] is None else f"bf16 from step {d['fell_back_at']}"
            out.append(f"{layer} {g} {d['format']} norm/noise {d['ratio_first']:.2f} -> {d['ratio_last']:.2f} "
                       f"(min {d['ratio_min']:.2f}), {fell}")
    return "sqrt(3) rule: " + "; ".join(out)


def row_line(r: dict) -> str:
    share = "-" if r["a2a_share"] is None else f"{100 * r['a2a_share']:.1f}%"
    return (f"{r['mode']:<8} {r['tokens_per_s_per_gpu']:>12,.0f} {r['step_ms']:>9.1f} {_gib(r['peak_bytes']):>10} "
            f"{_gib(r['activation_bytes']):>10} {share:>7} {r['loss_final']:>8.4f} {r['loss_eval']:>8.4f}")


def table(report: dict) -> str:
    """The comparison as text: the header, one row per mode, then the ratios against the baseline, the
    largest batches and the notes."""
    m = report["meta"]
    base = "hf" if report["config"]["hook"] else "fp8"
    lines = [f"{m['device']} x {m['world']} | torch {m['torch']} | triton {m['triton']} | {provenance(m)} | "
             f"{m['date']}",
             f"{'mode':<8} {'tokens/s/GPU':>12} {'step ms':>9} {'peak mem':>10} {'act mem':>10} {'a2a':>7} "
             f"{'loss':>8} {'eval':>8}"]
    lines += [row_line(r) for r in report["modes"].values()]
    # Ratios only against a baseline that ran (a run of --modes fp4 alone has none to show).
    against = {mode: d for mode, d in report["ratios"].items() if mode != base and base in report["modes"]}
    if against:
        lines.append(f"ratios vs {base}:")
    for mode, d in against.items():
        parts = [f"tokens/s {d.get(f'tokens_per_s_per_gpu_vs_{base}', math.nan):.3f}x"]
        if f"peak_bytes_vs_{base}" in d:
            parts.append(f"peak memory {d[f'peak_bytes_vs_{base}']:.3f}x")
        parts.append(f"activation memory {d.get(f'activation_bytes_vs_{base}', math.nan):.3f}x")
        parts += [f"eval loss {d[k]:+.2f}% vs {k.rsplit('_', 1)[1]}" for k in d if k.startswith("loss_eval_delta")]
        lines.append(f"  {mode:<8} " + ", ".join(parts))
    if report["max_batch"]:
        mb = report["max_batch"]
        lines.append(f"largest batch per device in {report['config']['max_batch_gib']:g} GiB: "
                     + ", ".join(f"{k} {v['batch_max']}" for k, v in mb.items())
                     + ("" if base not in mb or not mb[base]["batch_max"] else
                        " (" + ", ".join(f"{k} {v['batch_max'] / mb[base]['batch_max']:.2f}x"
                                         for k, v in mb.items() if k != base) + f" of {base})"))
    if report.get("plans"):
        cfg = report["config"]
        lines.append(f"plan per mode in {cfg['budget_gib']:g} GiB per device at global batch {cfg['global_batch']} "
                     f"(the measured fastest policy and micro-batch that fit):")
        for mode, p in report["plans"].items():
            tried = ", ".join(f"{c['policy']} {c['tokens_per_s']:,.0f}" for c in p["candidates"]
                              if c["tokens_per_s"] is not None)
            lines.append(f"  {mode:<8} recompute {p['policy']}, micro-batch {p['micro_batch']} x {p['passes']} "
                         f"passes (tokens/s while planning: {tried})")
    lines += ["note: " + n for n in report["notes"]]
    return "\n".join(lines)


__all__ = ["BatchDoesNotFit", "CompareConfig", "Env", "Trainer", "check_ep", "largest_batch", "measure_steps",
           "micro_batch", "per_rank_batch", "plan_mode", "ratios", "run", "search_largest_batch", "table",
           "train_mode"]
