"""What a run needs, checked before it starts: the optional packages (:func:`require_packages`,
:func:`optional_notes`: each one imported, so that a package that is installed but broken counts as
missing and is named in one line before any work, not in a traceback after training started), and its
cost (:func:`estimate`: parameters, the memory of weights, gradients and optimizer state per device,
tokens and FLOP; :func:`cost_lines` says it, with a warning for a long CPU run; :func:`check_fits`
refuses weights and optimizer state larger than the device's memory).

The estimate is a lower bound on memory (activations come on top, and depend on the batch) and a
rough bound on time: a run that cannot fit fails in a second with one line instead of in the
allocator after minutes, and a CPU run of a large preset says it will take hours before it does.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass

import torch

from moe_fp4.compare.config import HF_MODES, CompareConfig, Env, per_rank_batch
from moe_fp4.compare.quiet import quiet_third_party
from moe_fp4.model.decoder import DecoderLM, parameter_count

# Bytes a parameter holds for the whole run: moe_fp4's decoder keeps float32 weights, gradients and both
# AdamW moments (4 x 4); the Hugging Face model of --hook is bf16 throughout (4 x 2). The FP8 modes'
# weight copies and the activations come on top.
STATE_BYTES_PER_PARAMETER = {"decoder": 16, "hf": 8}
# Training FLOP per CPU thread and second, more than any CPU run here reached: the small preset's bf16
# steps ran at 7-47 GFLOP/s on 2 cores (the emulated FP8 modes slower). A time from it is a lower bound.
CPU_FLOPS_PER_THREAD = 50e9
# A CPU run estimated to take longer than this is warned about before it starts.
CPU_WARN_SECONDS = 600


class ModelDoesNotFit(ValueError):
    """The model's weights, gradients and optimizer state alone need more memory than the device has."""


# What the --hook run imports from transformers: its configs, and the Qwen3-MoE model it builds
# (moe_fp4.compare.train.hf_causal_lm), whose import brings in the rest (torchao too, where installed).
HOOK_MODULES = ("transformers", "transformers.models.qwen3_moe.modeling_qwen3_moe")


def import_problem(*modules: str) -> str | None:
    """Import ``modules`` in order -> None, or why the first that fails cannot be imported (one line):
    "not installed" when the package is absent, else "installed but cannot be imported (Type: message)",
    whatever it raised (a package built for another torch raises ImportError or worse). The third-party
    noise of those imports is silenced as while compare runs (:func:`moe_fp4.compare.quiet.quiet_third_party`)."""
    for module in modules:
        top = module.partition(".")[0]
        if importlib.util.find_spec(top) is None:
            return "not installed"
        try:
            with quiet_third_party():
                importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - whatever a broken package raises, the run cannot use it
            text = str(e).strip().splitlines()
            where = "" if module == top else f"{module}: "
            return f"installed but cannot be imported ({where}{type(e).__name__}: {text[0] if text else ''})"
    return None


def require_packages(cfg: CompareConfig) -> None:
    """ValueError (one line, naming the pip install) when a package the run cannot do without is
    missing or cannot be imported: transformers for --hook (the hf modes)."""
    if cfg.hook or any(m in HF_MODES for m in cfg.modes):
        problem = import_problem(*HOOK_MODULES)
        if problem == "not installed":
            raise ValueError("--hook trains a Hugging Face MoE model: it needs transformers, which is not installed "
                             "(pip install transformers)")
        if problem:
            raise ValueError(f"--hook trains a Hugging Face MoE model: it needs transformers, which is {problem}; "
                             f"install a transformers that works with torch {torch.__version__} "
                             f"(pip install -U transformers)")


def optional_notes(plots: bool, progress: bool) -> list[str]:
    """One line per optional package a run would use and cannot (not installed, or installed but failing
    to import): matplotlib for the plots, tqdm for the progress bar (the run goes on without them)."""
    notes = []
    if plots:
        problem = import_problem("matplotlib", "matplotlib.pyplot")
        if problem:
            notes.append(f'matplotlib is {problem}, so no plots (pip install "moe_fp4[plot]", or pass --no-plots)')
    if progress and sys.stderr.isatty():
        problem = import_problem("tqdm", "tqdm.auto")
        if problem:
            notes.append(f"tqdm is {problem}: progress is a line per tenth of the steps instead of a bar "
                         "(pip install tqdm)")
    return notes


@dataclass(frozen=True)
class Cost:
    """What a run costs per device. parameters / active_per_token: the model's; state_bytes: its weights,
    gradients and optimizer state on one device (a lower bound of its memory); memory: the bytes the device
    has for them (free GPU memory, or this host's physical memory over its ranks; None: unknown) and
    memory_what, what that is; tokens: trained on one device over every mode; flop: their training FLOP
    (forward and backward) and the held-out evaluation's; seconds: a lower bound of the time on CPU
    (None on a GPU)."""

    parameters: int
    active_per_token: int
    state_bytes: int
    memory: int | None
    memory_what: str
    tokens: int
    flop: float
    seconds: float | None


def _cpu_memory(env: Env) -> tuple[int | None, str]:
    try:
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None, "unknown"
    local = int(os.environ.get("LOCAL_WORLD_SIZE", env.world))   # ranks of this host share its memory
    if local > 1:
        return total // local, f"of physical memory per rank on this host ({local} ranks)"
    return total, "of physical memory on this host"


def _gpu_memory(env: Env) -> tuple[int | None, str]:
    try:
        free, _ = torch.cuda.mem_get_info(env.device)
    except RuntimeError:
        return None, "unknown"
    return free, f"free on the {torch.cuda.get_device_name(env.device)}"


def estimate(cfg: CompareConfig, env: Env, counts: dict | None = None) -> Cost:
    """The run's :class:`Cost` on this device. counts: :func:`moe_fp4.model.decoder.parameter_count` of
    the model (built on the meta device when None; the --hook model has the same shape without the
    shared expert, so its count is an upper bound)."""
    mc = cfg.model
    counts = counts or parameter_count(DecoderLM(mc.with_(), precision="bf16", device="meta"))
    params = counts["total"]
    if env.ep is not None and not env.ep.simulate and env.world > 1:
        params = params - counts["experts"] + counts["experts"] // env.world   # the experts are sharded
    state = params * STATE_BYTES_PER_PARAMETER["hf" if cfg.hook else "decoder"]
    memory, what = _gpu_memory(env) if env.cuda else _cpu_memory(env)
    batch = per_rank_batch(cfg.global_batch, env.world) if cfg.global_batch is not None else cfg.batch
    tokens = len(cfg.modes) * cfg.steps * batch * mc.seq
    # 6 FLOP a parameter and token (forward and backward), plus causal attention's 6 * seq * hidden a layer
    per_token = 6 * counts["active_per_token"] + 6 * mc.layers * mc.seq * mc.hidden
    evaluated = len(cfg.modes) * cfg.eval_batches * min(batch, cfg.batch) * mc.seq
    flop = tokens * per_token + evaluated * per_token / 3
    seconds = None if env.cuda else flop / (CPU_FLOPS_PER_THREAD * max(1, torch.get_num_threads()))
    return Cost(counts["total"], counts["active_per_token"], state, memory, what, tokens, flop, seconds)


def _bytes(v: float) -> str:
    return f"{v / 2**30:.1f} GiB" if v >= 2**30 else f"{v / 2**20:.1f} MiB"


def _flop(v: float) -> str:
    for scale, unit in ((1e15, "PFLOP"), (1e12, "TFLOP"), (1e9, "GFLOP")):
        if v >= scale:
            return f"{v / scale:.3g} {unit}"
    return f"{v / 1e6:.3g} MFLOP"


def _duration(s: float) -> str:
    return f"{s / 3600:.1f} hours" if s >= 3600 else f"{s / 60:.0f} minutes" if s >= 60 else f"{s:.0f} s"


def cost_lines(cost: Cost, cfg: CompareConfig, env: Env) -> list[str]:
    """The banner's cost line, and on CPU a warning when the run will take longer than
    ``CPU_WARN_SECONDS`` (what to do instead included)."""
    have = "" if cost.memory is None else f" ({_bytes(cost.memory)} {cost.memory_what})"
    searches = " and the batch searches" if cfg.max_batch_gib is not None or cfg.plan else ""
    lines = [f"  cost: at least {_bytes(cost.state_bytes)} per device for weights, gradients and optimizer "
             f"state{have}; {cost.tokens:,} tokens per device over {len(cfg.modes)} modes{searches}, about "
             f"{_flop(cost.flop)}"]
    if cost.seconds is not None and cost.seconds > CPU_WARN_SECONDS:
        rate = CPU_FLOPS_PER_THREAD * max(1, torch.get_num_threads())
        lines.append(f"  warning: on CPU this takes at least {_duration(cost.seconds)} (even at {rate / 1e9:.0f} "
                     f"GFLOP/s on {torch.get_num_threads()} threads, more than measured on CPUs); stop it with Ctrl-C "
                     f"and use --preset tiny, fewer --steps or a smaller --batch, or run on a GPU")
    return lines


def check_fits(cost: Cost, cfg: CompareConfig, env: Env) -> None:
    """:class:`ModelDoesNotFit` (one line) when the weights, gradients and optimizer state alone exceed
    the memory the device has: such a run could only end in the allocator's error."""
    if cost.memory is None or cost.state_bytes <= cost.memory:
        return
    per = STATE_BYTES_PER_PARAMETER["hf" if cfg.hook else "decoder"]
    more = "" if not env.cuda or cfg.hook else ", or more GPUs under torchrun (expert parallelism shards the experts)"
    raise ModelDoesNotFit(
        f"preset {cfg.preset} does not fit: its weights, gradients and optimizer state alone need "
        f"{_bytes(cost.state_bytes)} per device ({cost.parameters / 1e6:,.0f} million parameters, {per} bytes each), "
        f"more than the {_bytes(cost.memory)} {cost.memory_what}. Use a smaller --preset, fewer --experts or "
        f"--layers{more}")


__all__ = ["HOOK_MODULES", "Cost", "ModelDoesNotFit", "check_fits", "cost_lines", "estimate", "import_problem",
           "optional_notes", "require_packages"]
