"""``moe-fp4`` (also ``python -m moe_fp4``): the command line. ``moe-fp4 compare --help`` shows what
``compare`` does (COMPARE_DESCRIPTION), its options and examples (COMPARE_EXAMPLES).

``compare`` checks every argument and the output directory before it builds a model (one line and
exit code 2 per problem), prints the table before it writes any file, and under torchrun prints from
rank 0 only. The parser needs no torch (its choices are spelled here, checked against the model's by
tests/compare/test_first_run.py), so ``--help`` and argparse's errors answer at once; torch and the model
load inside :func:`main`, where Ctrl-C is one line and exit code 130 like Ctrl-C at any other point before
training (during training the run stops and reports the modes it finished).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

# Sequences per rank. small: 64 x 1024 tokens keep an H200 busy; at 16 the step is bound by the host
# (kernel launches), which hides what the modes change.
PRESET_BATCH = {"tiny": 4, "small": 64, "dsv3-layers": 2}
# The parser's choices: moe_fp4.model.decoder.PRESETS' names, moe_fp4.model.moe.Recompute's values and
# moe_fp4.compare.config.PRESET_LR, spelled out so that building the parser imports no torch.
PRESET_NAMES = ("tiny", "small", "dsv3-layers")
RECOMPUTE_CHOICES = ("none", "swiglu", "moe", "dense", "layer")
PRESET_LR_HELP = {"tiny": 1e-3, "small": 1e-3, "dsv3-layers": 3e-4}
DEFAULT_OUT = "moe_fp4_compare"

COMPARE_DESCRIPTION = """\
Train a small DeepSeek-V3-style MoE model in bf16, fp8 and fp4 (same weights,
same batches) and compare them. Prints a table (tokens/s per GPU, step time,
peak and activation memory, all-to-all share, loss, ratios against fp8), then
writes DIR/compare.json and, with matplotlib (pip install "moe_fp4[plot]"),
throughput.png, memory.png and loss.png."""

COMPARE_EXAMPLES = """\
examples:
  moe-fp4 compare                     bf16 vs fp8 vs fp4 on a GPU (tiny on CPU)
  moe-fp4 compare --max-batch 60      each mode at its largest batch in 60 GiB
  moe-fp4 compare --steps 1000        convergence on the stdlib's source text
  moe-fp4 compare --budget-gib 40 --global-batch 128 --plan auto
                                      each mode with its fastest recomputation
                                      and micro-batch that fit 40 GiB
  moe-fp4 compare --hook              a Hugging Face MoE model with and
                                      without the compression hook (needs
                                      transformers: pip install transformers)
  torchrun --nproc-per-node 2 -m moe_fp4 compare
                                      expert parallelism over 2 GPUs"""


class _HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Keeps the description's and examples' line breaks and appends "(default: X)" to an option's help
    when it has a default worth showing (not None, False or "") and the help does not state one itself
    ("default" in any case)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if (action.option_strings and action.default is not None and action.default is not False
                and action.default != "" and action.default != argparse.SUPPRESS and "default" not in text.lower()):
            text += " (default: %(default)s)"
        return text


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-fp4", description="MXFP4 storage and transport for FP8 MoE training")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("compare", help="train a small DeepSeek-V3-style model in bf16, fp8 and fp4 and compare",
                       description=COMPARE_DESCRIPTION, epilog=COMPARE_EXAMPLES, formatter_class=_HelpFormatter)
    c.add_argument("--preset", choices=list(PRESET_NAMES), default=None,
                   help="model size (default: small on a GPU, tiny on CPU)")
    c.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                   help="bf16, fp8, fp4 (default: all three; with --hook: hf hf+hook)")
    c.add_argument("--steps", type=int, default=None, help="steps per mode (default: 200 on GPU, 8 on CPU)")
    c.add_argument("--warmup", type=int, default=None,
                   help="untimed first steps (default: steps // 5, at most 20)")
    batches = ", ".join(f"{k} {v}" for k, v in PRESET_BATCH.items())
    c.add_argument("--batch", type=int, default=None, help=f"sequences per rank (default: {batches})")
    c.add_argument("--seq", type=int, default=None, help="sequence length in tokens (default: the preset's)")
    c.add_argument("--experts", type=int, default=None, help="routed experts per MoE layer (default: the preset's)")
    c.add_argument("--layers", type=int, default=None,
                   help="decoder layers, >= 2: the first is dense (default: the preset's)")
    rates = ", ".join(f"{k} {v:g}" for k, v in PRESET_LR_HELP.items())
    c.add_argument("--lr", type=float, default=None,
                   help=f"AdamW's peak learning rate, warmed up over steps // 10 (at most 100) (default: {rates})")
    c.add_argument("--seed", type=int, default=0, help="seed of the weights and the batches")
    c.add_argument("--data", choices=["stdlib", "random"], default="stdlib",
                   help="tokens: the stdlib's Python source as bytes, or random")
    c.add_argument("--global-batch", type=int, default=None, metavar="N",
                   help="sequences per optimizer step over all ranks: each mode takes N / ranks per rank in the "
                        "fewest near-equal micro-batches of at most --batch (with --max-batch: its largest that "
                        "fits an accumulated step), gradients accumulated, so the modes train on the same batches")
    c.add_argument("--max-batch", type=float, default=None, metavar="GIB",
                   help="train each mode at its largest batch in GIB GiB per GPU")
    c.add_argument("--budget-gib", type=float, default=None, metavar="GIB",
                   help="fail early if --batch needs more than GIB GiB per device; with --plan auto, the budget "
                        "to plan for")
    c.add_argument("--recompute", choices=list(RECOMPUTE_CHOICES), default="none",
                   help="what backward recomputes instead of keeping: the experts' SwiGLU output, the MoE block, "
                        "everything but the MoE blocks (dense: attention and dense MLPs), or the whole decoder "
                        "layer (gradients identical to none)")
    c.add_argument("--plan", choices=["auto"], default=None,
                   help="auto: per mode, the recomputation and micro-batch with the highest measured tokens/s "
                        "that fit --budget-gib at --global-batch (each candidate measured), then train with it")
    c.add_argument("--allow-cpu-budget", action="store_true",
                   help="allow --max-batch and --plan on CPU (memory estimated; for tests)")
    c.add_argument("--slow-link", action="store_true",
                   help="NCCL_P2P_DISABLE=1: NCCL via host memory, like a network (fp4's default wire recipe "
                        "follows: fp4-all)")
    c.add_argument("--wire", default="", metavar="[RECIPE|MODE:RECIPE,...][ROLE=FMT,...]",
                   help="with torchrun (expert parallelism) or --simulate-wire: the wire format of each exchange. "
                        "RECIPE: a named set of the four (bf16, fp8-dispatch, fp8, paper, fp4, fp4-sr, fp4-fp8sums, "
                        "fp4-sr-fp8sums, fp4-all; docs/expert-parallel.md) for every mode, MODE:RECIPE for one "
                        "mode (fp4:fp4-all); ROLE=FMT then overrides one exchange, ROLE "
                        "one of dispatch, combine, dispatch_grad, combine_grad, FMT one of bf16, fp8, mxfp4, nvfp4, "
                        "native, and for the gradients also mxfp4-sr, nvfp4-sr (stochastic rounding) and auto (the "
                        "sqrt(3) rule: nvfp4-sr while the gradient's norm is at least sqrt(3) times its "
                        "quantization noise (the combine gradient's: the experts' FC2 weight gradient against the "
                        "noise the payload puts into it), fp8 after 10 steps below; the ratios are reported per "
                        "layer). Default: "
                        "each mode's own recipe (bf16: bf16, fp8: fp8, fp4: fp4-fp8sums on one host with NCCL's "
                        "peer-to-peer path on, fp4-all across hosts or with --slow-link; --simulate-wire: "
                        "fp4-fp8sums)")
    c.add_argument("--simulate-wire", action="store_true",
                   help="on one process: apply the round trip of each exchange's wire format (--wire's, by default "
                        "each mode's own recipe) where expert parallelism would send it, to study the wire's numerics "
                        "without a second GPU; in training only (the held-out loss is computed without any wire)")
    c.add_argument("--storage", choices=["mxfp4", "nvfp4"], default="mxfp4",
                   help="the format the fp4 mode keeps its activations in (nvfp4: E4M3 scales per 16 and a float32 "
                        "scale per tensor, 4.5 bits an element)")
    c.add_argument("--optimizer", choices=["adamw-fp8", "adamw"], default="adamw-fp8",
                   help="adamw-fp8 (default): moe_fp4.model.optim.AdamWFP8Weights, whose step also writes the FP8 "
                        "copies of the expert weights the FP8 GEMMs read (every other parameter, and every parameter "
                        "of the bf16 and hf modes, takes torch's AdamW step); adamw: torch.optim.AdamW for all, the "
                        "FP8 copies made in the next forward")
    c.add_argument("--hook", action="store_true",
                   help="a Hugging Face MoE model with and without activation compression (needs transformers: "
                        "pip install transformers)")
    c.add_argument("--out", default=DEFAULT_OUT, metavar="DIR", help="where compare.json and the plots go")
    c.add_argument("--no-plots", action="store_true", help="write no PNG plots")
    c.add_argument("--no-progress", action="store_true",
                   help="print no progress during training (default: a bar with tqdm, else a line per tenth of "
                        "the steps)")
    c.add_argument("--profile-steps", type=int, default=3, metavar="N",
                   help="steps profiled per mode for the all-to-all share (EP)")
    c.add_argument("--profile", action="store_true",
                   help="write rank 0's profile of those steps to DIR/profile_MODE.txt")
    return p


def check_out_dir(path: str) -> str | None:
    """Create ``path`` if missing and write and remove a probe file in it -> None if that worked, else why
    not (one line). Done before training: a directory that cannot be written must not cost a run."""
    try:
        os.makedirs(path, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".moe_fp4_probe_", dir=path)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        return f"--out {path}: cannot write there ({e.strerror or e})"
    return None


def _write_text(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def _warn(msg: str) -> None:
    print(f"moe-fp4 compare: {msg}", file=sys.stderr, flush=True)


def write_results(report: dict, out: str, plots: bool = True) -> tuple[list[str], bool]:
    """Write ``<out>/compare.json``, the profiler tables (rows' "profile_table") and the plots -> (paths
    written, whether everything went to ``out``). Called after the table is printed: if ``out`` cannot
    be written, the report (profile tables kept inside it) goes to a new temporary file instead and one
    line on stderr says where; a failing plot loses nothing and is one line too."""
    tables = {m: row.pop("profile_table") for m, row in report["modes"].items() if "profile_table" in row}
    try:
        written = [_write_text(os.path.join(out, "compare.json"), json.dumps(report, indent=1, default=str))]
        for mode, text in tables.items():
            written.append(_write_text(os.path.join(out, f"profile_{mode.replace('+', '_')}.txt"), text))
    except OSError as e:
        for mode, text in tables.items():
            report["modes"][mode]["profile_table"] = text
        try:
            fd, path = tempfile.mkstemp(prefix="moe_fp4_compare_", suffix=".json")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(report, f, indent=1, default=str)
        except OSError as e2:
            _warn(f"could not write to {out} ({e.strerror or e}) nor to a temporary file ({e2.strerror or e2}); "
                 "the table above is all that is left")
            return [], False
        _warn(f"could not write to {out} ({e.strerror or e}); wrote the report to {path} instead")
        return [path], False
    ok = True
    if plots and report["modes"]:          # (an interrupted run may have no mode to plot)
        try:
            from moe_fp4.compare.plots import write_plots

            written += write_plots(report, out)
        except ImportError as e:
            print(f'plots: matplotlib cannot be imported ({type(e).__name__}: {e}; pip install "moe_fp4[plot]")',
                  flush=True)
        except Exception as e:  # noqa: BLE001 - a plot is an extra: any failure loses nothing else
            _warn(f"plots: failed ({type(e).__name__}: {e}); compare.json has every number")
            ok = False
    return written, ok


def _distributed(slow_link: bool):
    """-> (device, rank, world) after init_process_group when launched by torchrun with > 1 process."""
    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = torch.cuda.is_available()
    if cuda:
        if local >= torch.cuda.device_count():
            raise ValueError(f"LOCAL_RANK {local} but only {torch.cuda.device_count()} GPUs are visible")
        torch.cuda.set_device(local)
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if world == 1:
        return device, 0, 1
    if slow_link:
        os.environ["NCCL_P2P_DISABLE"] = "1"
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(minutes=10),
                            device_id=device if cuda else None)
    return device, dist.get_rank(), dist.get_world_size()


def launch_env(wire: str = "", slow_link: bool = False, simulate_wire: bool = False):
    """The :class:`moe_fp4.compare.config.Env` of this process: one device, or under torchrun its rank in a new
    process group (NCCL on GPUs, gloo on CPU) with expert parallelism over every rank, its exchanges set by
    ``wire`` (``--wire``'s text: each mode's own recipe where empty). ``simulate_wire``: one process applies
    the exchanges' round trips where EP would send them. Call ``torch.distributed.destroy_process_group()``
    when done where the world is more than one."""
    from moe_fp4.compare.config import Env
    from moe_fp4.exchange.ep import EPConfig

    device, rank, world = _distributed(slow_link)
    ep = EPConfig(**parse_wire(wire), simulate=world == 1) if world > 1 or simulate_wire else None
    return Env(device, rank, world, ep)


def _rank_from_env() -> int:
    """This process's rank under torchrun (RANK), 0 otherwise; known before any process group exists."""
    return int(os.environ.get("RANK", "0"))


WIRE_ROLES = ("dispatch", "combine", "dispatch_grad", "combine_grad")


def parse_wire(text: str) -> dict:
    """``--wire fp4,combine=mxfp4,dispatch_grad=fp8`` -> {"recipe": "fp4", "combine": "mxfp4", "dispatch_grad":
    "fp8"}: at most one recipe name (:data:`moe_fp4.exchange.recipes.RECIPES`) for every mode, MODE:RECIPE
    items for one mode each (``fp8:fp8-dispatch,fp4:fp4-all`` -> {"recipe": {"fp8": "fp8-dispatch", "fp4":
    "fp4-all"}}), then ROLE=FMT items that override a role for every mode; ValueError (one line) for an
    unknown mode, recipe, role or format, a stochastic format for values, or a repeated role or recipe."""
    from moe_fp4.exchange.recipes import RECIPES
    from moe_fp4.exchange.wire import WireFormat

    formats = [f.value for f in WireFormat]
    out: dict = {}
    per_mode: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        role, eq, fmt = item.partition("=")
        role, fmt = role.strip(), fmt.strip()
        mode, colon, name = item.partition(":")
        if colon and not eq:
            if mode not in ("bf16", "fp8", "fp4") or name not in RECIPES:
                raise ValueError(f"--wire: {item!r} is not MODE:RECIPE with MODE one of bf16, fp8, fp4 and RECIPE one "
                                 f"of {', '.join(RECIPES)}")
            if mode in per_mode:
                raise ValueError(f"--wire: two recipes for {mode}")
            per_mode[mode] = name
            continue
        if not eq:
            if item not in RECIPES:
                raise ValueError(f"--wire: {item!r} is neither a recipe ({', '.join(RECIPES)}) nor ROLE=FMT with "
                                 f"ROLE one of {', '.join(WIRE_ROLES)}")
            if "recipe" in out:
                raise ValueError(f"--wire: two recipes ({out['recipe']}, {item}); give one, then ROLE=FMT overrides")
            out["recipe"] = item
            continue
        if role not in WIRE_ROLES:
            raise ValueError(f"--wire: {item!r} is not ROLE=FMT with ROLE one of {', '.join(WIRE_ROLES)}")
        if fmt == "auto" and role.endswith("_grad"):
            pass   # the sqrt(3) rule (EPConfig "auto")
        elif fmt not in formats:
            raise ValueError(f"--wire: {role}={fmt!r}: the format must be one of {', '.join(formats)}"
                             + (", or auto" if role.endswith("_grad") else ""))
        if role in ("dispatch", "combine") and fmt.endswith("-sr"):
            raise ValueError(f"--wire: {role}={fmt} rounds stochastically, which is for gradients only; "
                             f"use it for dispatch_grad or combine_grad")
        if role in out:
            raise ValueError(f"--wire: {role} is given twice")
        out[role] = fmt
    if per_mode:   # MODE:RECIPE over the recipe for every mode
        every = out.get("recipe")
        out["recipe"] = {**({m: every for m in ("bf16", "fp8", "fp4")} if every else {}), **per_mode}
    return out


def _check(a: argparse.Namespace, cuda: bool):
    """Every argument and environment check, before any model is built or process group started ->
    the CompareConfig. Raises ValueError with one line for the first problem."""
    from moe_fp4.compare.config import CompareConfig, check_ep, per_rank_batch
    from moe_fp4.compare.preflight import require_packages

    preset = a.preset or ("small" if cuda else "tiny")
    steps = a.steps if a.steps is not None else (200 if cuda else 8)
    modes = tuple(a.modes) if a.modes else (("hf", "hf+hook") if a.hook else ("bf16", "fp8", "fp4"))
    cfg = CompareConfig(preset=preset, modes=modes, steps=steps,
                        warmup=a.warmup if a.warmup is not None else min(20, steps // 5),
                        batch=a.batch if a.batch is not None else PRESET_BATCH[preset],
                        seq=a.seq, experts=a.experts, layers=a.layers,
                        lr=a.lr, seed=a.seed, data=a.data, max_batch_gib=a.max_batch, budget_gib=a.budget_gib,
                        global_batch=a.global_batch, recompute=a.recompute, plan=a.plan == "auto",
                        profile_steps=a.profile_steps, profile=a.profile, hook=a.hook, progress=not a.no_progress,
                        storage=a.storage, optimizer=a.optimizer)
    require_packages(cfg)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.global_batch is not None:
        per_rank_batch(cfg.global_batch, world)
    wire = parse_wire(a.wire)
    if a.simulate_wire and world > 1:
        raise ValueError("--simulate-wire applies the wire formats on one process; under torchrun the exchanges "
                         "are real: drop --simulate-wire")
    if a.simulate_wire and a.hook:
        raise ValueError("--simulate-wire applies to moe_fp4's model, not to --hook's Hugging Face model")
    if wire and world == 1 and not a.simulate_wire:
        raise ValueError("--wire sets the expert-parallel exchanges: run it under torchrun with 2 or more ranks, "
                         "or add --simulate-wire to apply its formats' round trips on one process")
    if world > 1:
        if a.hook:
            raise ValueError("--hook compares a Hugging Face model on one device; run it without torchrun")
        check_ep(cfg.model, world)
    if a.plan and not cuda and not a.allow_cpu_budget:
        raise ValueError("--plan auto needs a GPU: on CPU the memory is only estimated and every candidate trains a "
                         "model (--allow-cpu-budget runs it anyway, for tests)")
    if a.max_batch is not None and not cuda and not a.allow_cpu_budget:
        # On CPU every probe trains a model and the memory is an estimate: minutes for a number that
        # says nothing about a GPU.
        raise ValueError("--max-batch needs a GPU: on CPU there is no allocator to measure, the memory is only "
                         "estimated and each probe trains a model (--allow-cpu-budget runs it anyway, for tests)")
    if _rank_from_env() == 0:   # rank 0 alone writes
        problem = check_out_dir(a.out)
        if problem:
            raise ValueError(problem)
    return cfg


def compare(a: argparse.Namespace, err) -> int:
    import torch

    from moe_fp4.compare.memory import prefer_expandable_segments
    from moe_fp4.compare.preflight import optional_notes

    prefer_expandable_segments()   # before anything allocates on the GPU: budgets measure what the card holds
    try:
        cfg = _check(a, torch.cuda.is_available())
    except ValueError as e:
        err(str(e))
        return 2
    from moe_fp4.compare.runner import run  # after the checks, which need less; looked up here: tests replace it

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.slow_link and world == 1:
        print("note: --slow-link changes only NCCL between processes; it has no effect on one process", flush=True)
    notes = optional_notes(plots=not a.no_plots, progress=not a.no_progress) if _rank_from_env() == 0 else []
    for note in notes:
        print("note: " + note, flush=True)
    plots = not a.no_plots and not any(n.startswith("matplotlib ") for n in notes)   # the note said: no plots
    env = launch_env(a.wire, a.slow_link, a.simulate_wire)
    rank, world = env.rank, env.world
    try:
        report = run(cfg, env)
    except ValueError as e:
        err(str(e))
        return 2
    finally:
        if world > 1:
            import torch.distributed as dist

            dist.destroy_process_group()
    report["meta"]["slow_link"] = bool(a.slow_link and world > 1)
    rc = finish(report, a.out, plots=plots) if rank == 0 else 0
    # A run that lost a mode, or was interrupted, wrote what it had and says so in its exit status.
    if report.get("interrupted"):
        return 130
    return max(rc, 1) if report.get("failed") else rc


def finish(report: dict, out: str, plots: bool = True) -> int:
    """Print the table, then write the files -> the exit code: 0, or 1 when something could not go to
    ``out`` (the report then went to a temporary file, see :func:`write_results`)."""
    from moe_fp4.compare.report import table

    # The table first: whatever happens to the files, the run's numbers are on the screen.
    print(table(report), flush=True)
    written, ok = write_results(report, out, plots=plots)
    if written:
        print("wrote " + ", ".join(written), flush=True)
    return 0 if ok else 1


INTERRUPTED = "moe-fp4: interrupted (Ctrl-C)"


def main(argv=None) -> int:
    from moe_fp4.compare import interrupts

    previous = interrupts.install()
    try:
        p = _parser()
        a = p.parse_args(argv)
        sub = p._subparsers._group_actions[0].choices[a.command]

        def err(msg: str) -> None:
            # A problem found after a Ctrl-C whose KeyboardInterrupt a library swallowed (transformers' lazy
            # imports report it as a failed import) is the interrupt, not the problem.
            interrupts.raise_if_pending()
            # Under torchrun every rank finds the same problem: one line, from rank 0.
            if _rank_from_env() == 0:
                print(f"{sub.prog}: error: {msg}", file=sys.stderr, flush=True)

        try:
            rc = compare(a, err)
        except Exception:
            # An import interrupted by Ctrl-C can fail with another error than KeyboardInterrupt: the interrupt.
            interrupts.raise_if_pending()
            raise
        interrupts.raise_if_pending()   # a swallowed Ctrl-C that nothing checked after it
        return rc
    except KeyboardInterrupt:
        # Before training (imports, checks, model building): one line, no traceback. During training the
        # runner turns SIGINT into its own Interrupted and reports the modes it finished (exit code 130 too).
        if _rank_from_env() == 0:
            print(INTERRUPTED, file=sys.stderr, flush=True)
        return 130
    finally:
        interrupts.restore(previous)


def run() -> None:
    """The console script: :func:`main`, then the process exits with its code. After a Ctrl-C (130) it exits at
    once: a KeyboardInterrupt that passed through an import's own evaluation can leave CPython marked to end
    the process by SIGINT at shutdown (exit -2), whatever the code; nothing is written yet to flush."""
    rc = main()
    if rc == 130:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130)
    raise SystemExit(rc)


if __name__ == "__main__":
    run()
