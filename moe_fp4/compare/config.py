"""What ``moe-fp4 compare`` runs and where: :class:`CompareConfig` (every check that needs no device),
:class:`Env` (device, rank, world, EP), the choices (``MODES``, ``HF_MODES``, ``DATA``, ``OPTIMIZERS``),
:class:`BatchDoesNotFit`, :func:`check_ep` and :func:`per_rank_batch`.

The messages name the command line's flags (``--steps must be positive``): they are what a user of
``moe-fp4 compare`` reads. ``FLAGS`` maps each field to its flag.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moe_fp4.exchange.ep import EPConfig
from moe_fp4.model.decoder import PRESETS, ModelConfig
from moe_fp4.model.experts import Precision
from moe_fp4.model.moe import Recompute
from moe_fp4.saved.hook import StorageFormat

GiB = 2**30
MODES = tuple(p.value for p in Precision)
HF_MODES = ("hf", "hf+hook")
DATA = ("stdlib", "random")
OPTIMIZERS = ("adamw-fp8", "adamw")
# CompareConfig's field -> the flag of `moe-fp4 compare` that sets it (eval_batches has none: Python only).
FLAGS = {"preset": "--preset", "modes": "--modes", "steps": "--steps", "warmup": "--warmup", "batch": "--batch",
         "seq": "--seq", "experts": "--experts", "layers": "--layers", "lr": "--lr", "seed": "--seed",
         "data": "--data", "eval_batches": "eval_batches", "max_batch_gib": "--max-batch",
         "budget_gib": "--budget-gib", "global_batch": "--global-batch", "recompute": "--recompute",
         "plan": "--plan auto", "profile_steps": "--profile-steps", "profile": "--profile", "hook": "--hook",
         "storage": "--storage", "optimizer": "--optimizer"}


class BatchDoesNotFit(ValueError):
    """The requested batch needs more memory than the budget."""


# Each preset's peak learning rate (AdamW; the schedule warms up over steps // 10, at most 100, then decays
# to 0.55x on a cosine): the rate it trains at without spikes at its default batch. dsv3-layers diverges within
# its first steps at 1e-3 and trains smoothly at 3e-4; tiny and small train smoothly at 1e-3.
PRESET_LR = {"tiny": 1e-3, "small": 1e-3, "dsv3-layers": 3e-4}


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
    lr: AdamW's peak learning rate (None: the preset's, PRESET_LR).
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
    lr: float | None = None
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
            raise ValueError(f"--modes: unknown mode {', '.join(map(str, bad)) if bad else '(none given)'}; "
                             f"choose from {', '.join(allowed)}")
        object.__setattr__(self, "modes", modes)
        if self.data not in DATA:
            raise ValueError(f"--data must be one of {', '.join(DATA)}, got {self.data!r}")
        if self.global_batch is not None and self.global_batch <= 0:
            raise ValueError(f"--global-batch must be positive, got {self.global_batch}")
        for name in ("steps", "batch", "eval_batches"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{FLAGS[name]} must be positive, got {getattr(self, name)}")
        for name in ("seq", "experts", "layers"):   # None: the preset's
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{FLAGS[name]} must be positive, got {v}")
        if self.lr is None:
            object.__setattr__(self, "lr", PRESET_LR[self.preset])
        if not (self.lr > 0 and math.isfinite(self.lr)):   # also NaN, which compares False
            raise ValueError(f"--lr must be positive, got {self.lr}")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"--warmup {self.warmup} must be at least 0 and less than --steps ({self.steps}): "
                             "the timed steps come after it")
        for name in ("max_batch_gib", "budget_gib"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{FLAGS[name]} must be positive, got {v}")
        if self.max_batch_gib is not None and self.budget_gib is not None:
            raise ValueError("--budget-gib checks the given --batch, --max-batch picks each mode's own: give one of "
                             "them")
        try:
            object.__setattr__(self, "recompute", Recompute(self.recompute).value)
        except ValueError:
            raise ValueError(f"--recompute must be one of {', '.join(p.value for p in Recompute)}, got "
                             f"{self.recompute!r}") from None
        try:
            object.__setattr__(self, "storage", StorageFormat(self.storage).value)
        except ValueError:
            raise ValueError(f"--storage must be one of {', '.join(f.value for f in StorageFormat)}, got "
                             f"{self.storage!r}") from None
        if self.storage != "mxfp4" and (self.hook or "fp4" not in self.modes):
            raise ValueError("--storage sets the format the fp4 mode keeps its activations in: run it with fp4 in "
                             "--modes (and without --hook)")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if self.hook and (self.recompute != "none" or self.plan):
            raise ValueError("--recompute and --plan apply to moe_fp4's decoder; --hook compares a Hugging Face model")
        if self.plan:
            if self.budget_gib is None or self.global_batch is None:
                raise ValueError("--plan auto chooses a micro-batch and recomputation per mode for a budget and a "
                                 "global batch: give --budget-gib and --global-batch")
            if self.recompute != "none":
                raise ValueError("--plan auto chooses the recomputation per mode: leave --recompute out")
        if self.profile_steps < 0:
            raise ValueError(f"--profile-steps must be 0 or more, got {self.profile_steps}")
        if self.profile and not self.profile_steps:
            raise ValueError("--profile writes the profiler's table of the profiled steps: it needs --profile-steps "
                             "> 0")
        top_k = PRESETS[self.preset].top_k
        if self.experts is not None and self.experts < top_k:
            # ModelConfig would say "top_k=2", a name no flag has.
            raise ValueError(f"--experts {self.experts}: preset {self.preset} routes each token to {top_k} experts "
                             f"(top-{top_k}), so it needs --experts {top_k} or more")
        mc = self.model  # ModelConfig validates the overrides
        if mc.moe_layers < 1:
            # The modes differ only in the MoE layers: without one they would train the same model.
            raise ValueError(f"--layers {mc.layers} leaves no MoE layer (preset {self.preset} starts with "
                             f"{mc.dense_layers} dense), so every mode would train the same model; use --layers "
                             f"{mc.dense_layers + 1} or more")

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


def per_rank_batch(global_batch: int, world: int) -> int:
    """Sequences per rank per optimizer step of a global batch over ``world`` ranks (ValueError unless
    it divides evenly)."""
    if global_batch % world:
        raise ValueError(f"--global-batch {global_batch} does not divide over {world} ranks: give a multiple of "
                         f"{world}")
    return global_batch // world


__all__ = ["BatchDoesNotFit", "CompareConfig", "DATA", "Env", "FLAGS", "HF_MODES", "MODES", "OPTIMIZERS",
           "check_ep", "per_rank_batch"]
