"""Issue 45: the rough edges a newcomer met in ``moe-fp4 compare``, one test (or a few) each, all in
process and none training a model: a missing optional package found before any work, the cost of a
run said up front and a model that cannot fit refused, probe lines that say whether they fit with
enough digits, the plan table's untried policies, the formats in use on the mode lines, known
third-party noise silenced narrowly, and plots whose legend covers no bar and whose title says what
was held equal.

moe_fp4 is imported inside the tests, as in test_compare.py.
"""

import importlib.util
import io
import json
import logging
import re
import sys
import warnings

import pytest
import torch
from optional_stacks import import_or_skip

GiB = 2**30


@pytest.fixture
def no_work(monkeypatch):
    """Any attempt to load the corpus, describe the device or train fails the test (one process: no
    process group starts)."""
    import moe_fp4.compare.cli
    import moe_fp4.compare.runner

    def refuse(*_a, **_k):
        raise AssertionError("the run started work before the check")

    monkeypatch.setattr(moe_fp4.compare.runner, "stdlib_corpus", refuse)
    monkeypatch.setattr(moe_fp4.compare.runner, "describe", refuse)
    monkeypatch.setattr(moe_fp4.compare.runner, "train_mode", refuse)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    return moe_fp4.compare.cli.main


def _without(monkeypatch, *names):
    """importlib.util.find_spec answers None for ``names``, as when they are not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in names else real(name, *a))


# ---------------------------------------------------------------------------------------------------
# `--hook` without transformers died with a raw ModuleNotFoundError after training had started.

def test_hook_without_transformers_refused_before_any_work(no_work, monkeypatch, capsys, tmp_path):
    _without(monkeypatch, "transformers")
    assert no_work(["compare", "--preset", "tiny", "--hook", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moe-fp4 compare: error: --hook trains a Hugging Face MoE model: it needs transformers, which is "
                   "not installed (pip install transformers)"], err
    # run() from Python checks it too, before it loads anything
    from moe_fp4.compare.config import CompareConfig, Env
    from moe_fp4.compare.runner import run

    with pytest.raises(ValueError, match=r"pip install transformers"):
        run(CompareConfig(preset="tiny", hook=True), Env(torch.device("cpu")))


def test_missing_plot_and_progress_packages_are_notes(monkeypatch):
    from moe_fp4.compare.preflight import optional_notes

    class TTY(io.StringIO):
        def isatty(self):
            return True

    _without(monkeypatch, "matplotlib", "tqdm")
    monkeypatch.setattr(sys, "stderr", TTY())
    notes = optional_notes(plots=True, progress=True)
    assert len(notes) == 2 and 'pip install "moe_fp4[plot]"' in notes[0] and "pip install tqdm" in notes[1]
    assert optional_notes(plots=False, progress=False) == []


def test_broken_plot_and_progress_packages_are_notes(monkeypatch):
    # Installed (find_spec finds them) but failing at import: the same notes, with the error.
    from moe_fp4.compare.preflight import optional_notes

    class TTY(io.StringIO):
        def isatty(self):
            return True

    real = importlib.import_module

    def broken(name, *a):
        if name.partition(".")[0] in ("matplotlib", "tqdm"):
            raise ImportError(f"cannot import name 'X' from {name!r}")
        return real(name, *a)

    monkeypatch.setattr(importlib, "import_module", broken)
    monkeypatch.setattr(sys, "stderr", TTY())
    notes = optional_notes(plots=True, progress=True)
    assert notes == ["matplotlib is installed but cannot be imported (ImportError: cannot import name 'X' from "
                     "'matplotlib'), so no plots (pip install \"moe_fp4[plot]\", or pass --no-plots)",
                     "tqdm is installed but cannot be imported (ImportError: cannot import name 'X' from 'tqdm'): "
                     "progress is a line per tenth of the steps instead of a bar (pip install tqdm)"], notes


def test_preflight_imports_quietly(monkeypatch, caplog):
    # The package check imports what --hook needs under the same filters as the run: torchao's known lines
    # (imported by transformers) are dropped there, any other line of the same logger still shows.
    from moe_fp4.compare import preflight

    real = importlib.import_module

    def noisy(name, *a):
        if name == "noisy_package":
            logging.getLogger("torchao").warning("Failed to load /x/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so")
            logging.getLogger("torchao").warning("a line of torchao's own")
            return sys
        return real(name, *a)

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(importlib, "import_module", noisy)
    with caplog.at_level(logging.WARNING):
        assert preflight.import_problem("noisy_package") is None
    assert [r.getMessage() for r in caplog.records if r.name == "torchao"] == ["a line of torchao's own"], caplog.text


# ---------------------------------------------------------------------------------------------------
# `MoE(cfg, precision="fp16")` said only "'fp16' is not a valid Precision": every enum-valued argument
# names its parameter and its choices (moe_fp4.formats.choices.Choice), before any work.

def test_enum_arguments_name_the_parameter_and_the_choices(monkeypatch):
    from moe_fp4 import exchange_role
    from moe_fp4.exchange.ep import EPConfig
    from moe_fp4.exchange.swap import swap_all_to_all
    from moe_fp4.model.decoder import PRESETS, DecoderLM
    from moe_fp4.model.moe import MoE, MoEConfig

    def refuse(*_a, **_k):
        raise AssertionError("weights were allocated before the argument was refused")

    cfg = MoEConfig(hidden=128, ffn=128, num_experts=4, top_k=2)
    cases = [
        (lambda: MoE(cfg, precision="fp16"), "precision='fp16' is not one of 'bf16', 'fp8', 'fp4'"),
        (lambda: MoE(cfg, recompute="all"), "recompute='all' is not one of 'none', 'swiglu', 'moe', 'dense', 'layer'"),
        (lambda: MoE(cfg, storage="fp4"), "storage='fp4' is not one of 'mxfp4', 'nvfp4'"),
        (lambda: DecoderLM(PRESETS["tiny"], precision="int8"), "precision='int8' is not one of 'bf16', 'fp8', 'fp4'"),
        (lambda: EPConfig(combine="fp16"),
         "EPConfig.combine='fp16' is not one of 'mxfp4', 'fp8', 'bf16', 'native', 'nvfp4', 'mxfp4-sr', 'nvfp4-sr'"),
        (lambda: EPConfig(dispatch_grad="fp4"), "EPConfig.dispatch_grad='fp4' is not one of 'mxfp4', 'fp8', 'bf16', "
                                                "'native', 'nvfp4', 'mxfp4-sr', 'nvfp4-sr', 'auto'"),
        (lambda: swap_all_to_all(dispatch="mxfp8").__enter__(), "wire format 'mxfp8' is not one of 'mxfp4', 'fp8'"),
        (lambda: exchange_role("merge").__enter__(), "role='merge' is not one of 'dispatch', 'combine'"),
    ]
    monkeypatch.setattr(torch, "empty", refuse)
    for build, message in cases:
        with pytest.raises(ValueError) as e:
            build()
        assert str(e.value).startswith(message), (message, str(e.value))


# ---------------------------------------------------------------------------------------------------
# `--preset small` on CPU ran for hours without a word; dsv3-layers ended in the allocator's error.

def _cost(preset, batch, steps=8, **env):
    from moe_fp4.compare.config import CompareConfig, Env
    from moe_fp4.compare.preflight import cost_lines, estimate

    cfg = CompareConfig(preset=preset, batch=batch, steps=steps, warmup=0)
    e = Env(torch.device("cpu"), **env)
    cost = estimate(cfg, e)
    return cfg, e, cost, cost_lines(cost, cfg, e)


def test_cost_is_said_before_the_run_and_a_long_cpu_run_warned(monkeypatch):
    from moe_fp4.model.decoder import PRESETS, DecoderLM, parameter_count

    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)     # the time estimate scales with the threads
    cfg, _, cost, lines = _cost("small", 64)
    params = parameter_count(DecoderLM(PRESETS["small"], precision="bf16", device="meta"))["total"]
    assert cost.state_bytes == 16 * params                     # fp32 weight, gradient and two AdamW moments
    assert cost.tokens == 3 * 8 * 64 * 1024
    assert lines[0].startswith("  cost: at least 2.5 GiB per device for weights, gradients and optimizer state")
    assert "1,572,864 tokens per device over 3 modes" in lines[0] and "PFLOP" in lines[0]
    assert len(lines) == 2 and lines[1].startswith("  warning: on CPU this takes at least 2.8 hours"), lines
    assert "--preset tiny" in lines[1] and "GPU" in lines[1]
    _, _, _, tiny = _cost("tiny", 4)
    assert len(tiny) == 1 and "warning" not in tiny[0]         # the CPU default: no warning


def test_expert_parallelism_shards_the_estimate():
    from moe_fp4.exchange.ep import EPConfig

    _, _, one, _ = _cost("small", 64)
    _, _, two, _ = _cost("small", 64, rank=0, world=2, ep=EPConfig())
    _, _, sim, _ = _cost("small", 64, ep=EPConfig(simulate=True))
    assert sim.state_bytes == one.state_bytes > two.state_bytes > one.state_bytes / 2


def test_a_model_that_cannot_fit_is_refused_before_any_work(no_work, monkeypatch, capsys, tmp_path):
    import moe_fp4.compare.preflight as preflight

    monkeypatch.setattr(preflight, "_cpu_memory", lambda env: (2 * GiB, "of physical memory on this host"))
    assert no_work(["compare", "--preset", "small", "--steps", "2", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("moe-fp4 compare: error: preset small does not fit: its weights, "
                                               "gradients and optimizer state alone need 2.5 GiB per device"), err
    assert "more than the 2.0 GiB of physical memory on this host. Use a smaller --preset" in err[0], err


def test_cpu_memory_is_the_hosts_over_its_ranks(monkeypatch):
    import os

    from moe_fp4.compare.config import Env
    from moe_fp4.compare.preflight import _cpu_memory

    total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert _cpu_memory(Env(torch.device("cpu"))) == (total, "of physical memory on this host")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _cpu_memory(Env(torch.device("cpu"), 0, 2))[0] == total // 2


# ---------------------------------------------------------------------------------------------------
# Probe lines: "batch 43 -> 0.05 GiB (budget 0.05)", no verdict, a 0.015 GiB budget shown as 0.01.

def test_probe_lines_say_whether_it_fits_with_enough_digits():
    from moe_fp4.compare.memory import gib_digits, probe_verdict

    assert gib_digits(0.015 * GiB) == "0.01500" and gib_digits(11.89 * GiB) == "11.89"
    assert probe_verdict(0.0149 * GiB, 0.015 * GiB) == "0.01490 GiB, fits in the 0.015 GiB budget"
    assert probe_verdict(0.0462 * GiB, 0.015 * GiB) == "0.04620 GiB, does not fit in the 0.015 GiB budget"
    assert probe_verdict(float("inf"), GiB) == "out of memory, does not fit"


def test_searches_print_one_verdict_per_probe(monkeypatch):
    import moe_fp4.compare.memory as memory
    from moe_fp4.compare.config import CompareConfig, Env

    # a step of b sequences in `passes` passes: 10 + b * passes MiB-ish, in thousandths of a GiB
    monkeypatch.setattr(memory, "step_bytes", lambda cfg, mode, env, corpus, batches, passes=1:
                        {b: (10 + b * passes) / 1000 * GiB for b in batches})
    cfg = CompareConfig(preset="tiny", modes=("fp4",), steps=2, warmup=0, batch=8, data="random")
    env = Env(torch.device("cpu"))
    lines = []
    found = memory.largest_batch(cfg, "fp4", env, None, 0.0155 * GiB, log=lambda msg, **k: lines.append(msg))
    assert found["batch_max"] == 5
    assert lines and all(line.startswith("  fp4: batch ") for line in lines), lines
    assert "  fp4: batch 5: 0.01500 GiB, fits in the 0.0155 GiB budget" in lines, lines
    assert "  fp4: batch 6: 0.01600 GiB, does not fit in the 0.0155 GiB budget" in lines, lines
    lines.clear()
    found = memory.largest_accumulated_batch(cfg, "fp4", env, None, 0.0155 * GiB, 8,
                                             log=lambda msg, **k: lines.append(msg))
    assert found["batch_max"] == 2
    assert lines[0] == "  fp4: the whole batch of 8 in one pass: 0.01800 GiB, does not fit in the 0.0155 GiB budget"
    assert all(line.startswith("  fp4: 2 passes of ") for line in lines[1:]), lines

    monkeypatch.setattr(memory, "measure_steps", lambda *a, **k: (1000.0, None))
    lines.clear()
    plan = memory.plan_mode(CompareConfig(preset="tiny", modes=("fp4",), steps=2, warmup=0, budget_gib=0.0155,
                                          global_batch=8, plan=True, data="random"),
                            "fp4", env, None, 8, log=lambda msg, **k: lines.append(msg))
    assert not any("(budget " in line for line in lines), lines          # the planner's own probe lines
    assert any(line.startswith("  fp4 none: the whole batch of 8 in one pass: ") for line in lines), lines
    assert any("tokens/s" in line for line in lines), lines               # the timed split still shows
    assert plan.policy == "none"


def test_plan_table_says_not_tried():
    from moe_fp4.compare.report import plan_table

    cand = {"micro_batch": 0, "passes": 0, "peak_bytes": None, "tokens_per_s": None, "probes": {}}
    plan = {"policy": "swiglu", "micro_batch": 8, "passes": 1, "candidates": [
        {**cand, "policy": "none", "largest": 0, "why": "not even one sequence fits"},
        {**cand, "policy": "swiglu", "largest": 16, "micro_batch": 16, "passes": 1, "peak_bytes": 5 * 2**20,
         "tokens_per_s": 1300.0, "why": "over the budget in its timed steps"},
        {**cand, "policy": "swiglu", "largest": 8, "micro_batch": 8, "passes": 1, "peak_bytes": 3 * 2**20,
         "tokens_per_s": 1234.0, "why": ""},
        {**cand, "policy": "moe", "largest": 0, "why": "not tried: swiglu already takes the batch in one pass"}]}
    rows = plan_table(plan).splitlines()
    assert rows[0].split()[:2] == ["policy", "largest"]
    assert rows[1].split()[:2] == ["none", "0"]
    # the faster split that ran over the budget is listed, not chosen
    assert rows[2].split()[:3] == ["swiglu", "16", "16"] and rows[2].endswith("over the budget in its timed steps")
    assert rows[3].split()[:3] == ["swiglu", "8", "8"] and rows[3].endswith("<- chosen")
    assert rows[4].split()[:3] == ["moe", "not", "tried"], rows[4]


# ---------------------------------------------------------------------------------------------------
# The formats in use: the wire only in compare.json, --storage only in a "done" line.

def test_mode_lines_name_the_saved_format_and_the_wire():
    from moe_fp4.compare.report import mode_line, wire_text

    assert mode_line("fp4", 4, 4, 64, None, "none", "nvfp4", None) == \
        "[fp4] training 4 steps at batch 4 x 64 per rank; activations saved in nvfp4"
    assert mode_line("fp8", 4, 6, 64, 3, "moe", "mxfp4", None) == \
        "[fp8] training 4 steps at batch 6 x 64 per rank (2 micro-batches of up to 3, gradients accumulated), " \
        "recompute moe; activations saved in fp8 (1x128 blocks)"
    assert mode_line("hf+hook", 2, 4, 64, None, "none", "mxfp4", None).endswith("activations saved in mxfp4")
    wire = {"recipe": None, "simulated": False, "auto": {"format": "nvfp4-sr", "patience": 10},
            "per_mode": {"fp8": {"dispatch": "fp8", "combine": "bf16", "dispatch_grad": "bf16", "combine_grad": "fp8"},
                         "fp4": {"dispatch": "mxfp4", "combine": "bf16", "dispatch_grad": "auto",
                                 "combine_grad": "nvfp4-sr"}}}
    assert wire_text(wire, "fp4") == "dispatch mxfp4, combine bf16, dispatch_grad auto (nvfp4-sr, bf16 after 10 " \
                                     "steps below sqrt(3)), combine_grad nvfp4-sr"   # a compare.json from before
    wire["auto"]["fallback"] = "fp8"                                                      # the fallback was named
    assert "dispatch_grad auto (nvfp4-sr, fp8 after 10 steps below sqrt(3))" in wire_text(wire, "fp4")
    # Four formats that are a named recipe's are called by its name.
    assert wire_text(wire, "fp8") == "recipe fp8: dispatch fp8, combine bf16, dispatch_grad bf16, combine_grad fp8"
    assert mode_line("fp8", 4, 4, 64, None, "none", "mxfp4", wire).endswith("; all-to-all " + wire_text(wire, "fp8"))


def test_the_sqrt3_line_names_the_weight_ratio_and_the_fallback():
    from moe_fp4.compare.report import grad_wire_line
    from moe_fp4.exchange.ep import GradWireRule

    rule = GradWireRule("mxfp4-sr", patience=1)
    x = torch.ones(2, 32)
    for noise, w_noise in ((0.1, 1.0), (1.0, 100.0)):     # step 1: payload 10, weight 3; step 2: 1 and 0.3
        rule.record(x, x + noise)
        rule.record_weight_noise(torch.tensor(w_noise))
        rule.end_step(weight_grad_sq=torch.tensor(9.0))
    line = grad_wire_line({"layers.0.moe": {"combine_grad": rule.summary()}})
    assert line == ("sqrt(3) rule: layers.0.moe combine_grad mxfp4-sr norm/noise 10.00 -> 1.00 (min 1.00), FC2 weight "
                    "gradient norm/noise 3.00 -> 0.30 (min 0.30), fp8 from step 2"), line
    empty = GradWireRule("nvfp4-sr").summary()
    assert grad_wire_line({"m": {"dispatch_grad": empty}}) == "sqrt(3) rule: m dispatch_grad: not measured"


# ---------------------------------------------------------------------------------------------------
# torchao's failed `_C_mxfp8` load and pytree's Enum notice in every --hook run.

def test_known_third_party_noise_is_silenced_narrowly():
    from moe_fp4.compare.quiet import quiet_third_party

    class Keep(logging.Handler):
        def __init__(self):
            super().__init__(logging.WARNING)
            self.records = []

        def emit(self, record):
            self.records.append(record.getMessage())

    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    before = (list(torchao.filters), list(pytree.filters))
    keep = Keep()
    torchao.addHandler(keep)
    pytree.addHandler(keep)
    failed = "Failed to load /venv/lib/python3.11/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: x"
    enum = ("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
            "opaque value type.")
    autocast = "`torch.cuda.amp.autocast(args...)` is deprecated. Please use `torch.amp.autocast('cuda', args...)`"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with quiet_third_party():
            torchao.warning(failed)
            pytree.warning(enum)
            torchao.warning("Failed to quantize the model")            # another torchao message: kept
            warnings.warn(autocast, FutureWarning)
            warnings.warn("something else", FutureWarning)
        torchao.warning(failed)                                          # after the run: as before
        warnings.warn(autocast, FutureWarning)
    torchao.removeHandler(keep)
    pytree.removeHandler(keep)
    assert keep.records == ["Failed to quantize the model", failed], keep.records
    assert [str(w.message) for w in caught] == ["something else", autocast]
    assert (torchao.filters, pytree.filters) == before                   # nothing left behind


# ---------------------------------------------------------------------------------------------------
# memory.png: the legend covered the fp4 bar; nothing said which batch each mode ran or what was equal.

def _report(batches, **config):
    rows = {m: {"mode": m, "batch": b, "micro_batch": b, "accumulate": 1, "seq": 1024,
                "tokens_per_s_per_gpu": 3e5 + 1e4 * i, "peak_bytes": (96 + i) * GiB,
                "activation_bytes": (80 + i) * GiB, "loss_curve": [6.0, 5.0, 4.0]}
            for i, (m, b) in enumerate(zip(("bf16", "fp8", "fp4"), batches))}
    return {"meta": {"device": "NVIDIA H200", "world": 1, "gpus": 1, "version": "0.1.0", "commit": "abc1234"},
            "config": {"preset": "small", "max_batch_gib": None, "plan": False, **config}, "modes": rows}


def test_plot_titles_say_what_was_held_equal():
    from moe_fp4.compare.plots import held_equal

    assert held_equal(_report([16, 16, 16])) == "same batch 16 x 1024 tokens per GPU"
    assert held_equal(_report([292, 334, 414], max_batch_gib=100.0)) == \
        "same memory budget: each mode at its largest batch in 100 GiB per GPU"
    planned = _report([64, 64, 64], plan=True, budget_gib=40.0, global_batch=64)
    assert held_equal(planned).startswith("same memory budget: 40 GiB per GPU, global batch 64")


def test_memory_plot_keeps_the_legend_off_the_bars(tmp_path, monkeypatch):
    import_or_skip("matplotlib")
    import matplotlib.pyplot as plt

    from moe_fp4.compare.plots import write_plots

    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig: figures.append(fig))   # keep them to inspect
    paths = write_plots(_report([292, 334, 414], max_batch_gib=100.0), str(tmp_path))
    assert [p.rsplit("/", 1)[1] for p in paths] == ["throughput.png", "memory.png", "loss.png"]
    fig = figures[1]
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [patch.get_window_extent(renderer) for patch in ax.patches]
    assert len(bars) == 6 and not any(legend.overlaps(b) for b in bars)
    texts = [t.get_text() for t in ax.texts]
    assert texts == ["batch 292", "batch 334", "batch 414"], texts       # the modes ran at different batches
    assert all(not t.get_window_extent(renderer).overlaps(b) for t in ax.texts for b in bars)
    assert "same memory budget" in ax.get_title()
    for f in figures:
        real_close(f)


# ---------------------------------------------------------------------------------------------------
# A mode that fails in training (out of memory, a one-line error) or a kill the process can catch loses
# nothing (issue 49): the modes done are printed and written, the failure is named, and the exit status
# says the run is partial (1; 130 when interrupted). A run where no mode finished ends in the one-line
# error and exit 2, naming the batch, the device and the mode, with no traceback.

OOM_LINE = (r"batch \d+ x 64 does not fit on .+ in mode fp8 \(out of memory\)\. "
            r"Lower --batch, or find the largest with --max-batch GIB")


def _failing_run(monkeypatch, tmp_path, modes, fail):
    """moe-fp4 compare on the tiny preset with train_mode replaced: ``fail(mode)`` raises for the modes it
    chooses, the others train for real -> (exit code, the modes trained)."""
    from helpers import torch_references

    import moe_fp4.compare.cli
    import moe_fp4.compare.runner

    trained = []

    def maybe_fails(cfg, mode, *a, **k):
        fail(mode)
        trained.append(mode)
        return real(cfg, mode, *a, **k)

    real = moe_fp4.compare.runner.train_mode
    monkeypatch.setattr(moe_fp4.compare.runner, "train_mode", maybe_fails)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with torch_references():   # the modes that train do so for real: the references, not the interpreter
        code = moe_fp4.compare.cli.main(["compare", "--preset", "tiny", "--steps", "1", "--batch", "1",
                                         "--modes", *modes, "--data", "random", "--no-progress",
                                         "--no-plots", "--out", str(tmp_path)])
    return code, trained


def _oom_in_fp8(mode):
    import torch

    if mode == "fp8":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("modes", [("bf16", "fp8"), ("fp8", "bf16")])
def test_out_of_memory_in_one_mode_keeps_the_others(monkeypatch, capsys, tmp_path, modes):
    code, trained = _failing_run(monkeypatch, tmp_path, modes, _oom_in_fp8)
    assert code == 1 and trained == ["bf16"]           # fp8 failed; bf16 trained, before or after it
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "compare.json").read_text())
    assert list(report["modes"]) == ["bf16"] and re.fullmatch(OOM_LINE, report["failed"]["fp8"])
    assert re.search(r"^fp8      failed: " + OOM_LINE + "$", out, re.M), out     # in the table too
    assert re.search(r"^bf16 +[\d,]+ ", out, re.M), out


def test_out_of_memory_in_the_only_mode_is_one_line_and_exit_2(monkeypatch, capsys, tmp_path):
    code, trained = _failing_run(monkeypatch, tmp_path, ("fp8",), _oom_in_fp8)
    assert code == 2 and trained == []
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert re.fullmatch("moe-fp4 compare: error: " + OOM_LINE, err[0]), err[0]
    assert not (tmp_path / "compare.json").exists()


def test_plan_with_nothing_that_fits_one_mode_trains_the_others(monkeypatch, capsys, tmp_path):
    """--plan auto where one mode fits no sequence under any policy (dsv3-layers, EP 2, 44 GiB: fp8 needs 44.44
    GiB for one sequence with every layer recomputed): that mode is named as failed, the others are planned
    and trained (it used to end the whole run)."""
    from helpers import torch_references

    import moe_fp4.compare.cli
    import moe_fp4.compare.runner
    from moe_fp4.model.planner import NothingFits

    planned = []

    def plan_or_not(cfg, mode, *a, **k):
        planned.append(mode)
        if mode == "fp8":
            raise NothingFits("not even one sequence fits in 0.05 GiB under any recomputation policy (none, layer)")
        return real(cfg, mode, *a, **k)

    real = moe_fp4.compare.runner.plan_mode
    monkeypatch.setattr(moe_fp4.compare.runner, "plan_mode", plan_or_not)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    with torch_references():
        code = moe_fp4.compare.cli.main(["compare", "--preset", "tiny", "--steps", "1", "--warmup", "0",
                                         "--modes", "fp8", "fp4", "--budget-gib", "0.05", "--global-batch", "2",
                                         "--plan", "auto", "--allow-cpu-budget", "--data", "random",
                                         "--no-progress", "--no-plots", "--out", str(tmp_path)])
    assert code == 1 and planned == ["fp8", "fp4"]
    report = json.loads((tmp_path / "compare.json").read_text())
    assert list(report["modes"]) == ["fp4"] and list(report["plans"]) == ["fp4"]
    assert report["failed"]["fp8"].startswith("mode fp8: not even one sequence fits in 0.05 GiB"), report["failed"]
    out = capsys.readouterr().out
    assert re.search(r"^fp8      failed: mode fp8: not even one sequence", out, re.M), out
    assert re.search(r"^fp4 +[\d,]+ ", out, re.M), out


def test_interrupted_run_writes_the_modes_done(monkeypatch, capsys, tmp_path):
    import os
    import signal

    def killed_at_fp4(mode):
        if mode == "fp4":
            os.kill(os.getpid(), signal.SIGTERM)       # what torchrun or a scheduler sends

    code, trained = _failing_run(monkeypatch, tmp_path, ("bf16", "fp4", "fp8"), killed_at_fp4)
    assert code == 130 and trained == ["bf16"]
    report = json.loads((tmp_path / "compare.json").read_text())
    assert list(report["modes"]) == ["bf16"] and report["interrupted"] == "SIGTERM"
    assert "interrupted (SIGTERM): the modes not shown did not finish" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL   # the handler is gone after the run


# ---------------------------------------------------------------------------------------------------
# Presets that train (issue 49): the learning rate comes from the preset unless --lr gives one.

@pytest.mark.parametrize("preset,lr", [("tiny", 1e-3), ("small", 1e-3), ("dsv3-layers", 3e-4)])
def test_learning_rate_defaults_come_from_the_preset(preset, lr, tmp_path):
    from moe_fp4.compare.cli import _check, _parser
    from moe_fp4.compare.config import PRESET_LR, CompareConfig

    assert PRESET_LR[preset] == lr
    assert CompareConfig(preset=preset).lr == lr
    assert CompareConfig(preset=preset, lr=5e-4).lr == 5e-4
    a = _parser().parse_args(["compare", "--preset", preset, "--out", str(tmp_path)])
    assert _check(a, cuda=False).lr == lr
    a = _parser().parse_args(["compare", "--preset", preset, "--lr", "2e-4", "--out", str(tmp_path)])
    assert _check(a, cuda=False).lr == 2e-4


def test_held_out_batches_are_the_same_for_every_seed():
    # Seeds change the weights and the training batches, not the held-out set the runs are judged on
    # (issue 47's convergence matrix compares seeds); random tokens keep their own seed + 1.
    import torch

    from moe_fp4.compare.config import CompareConfig, Env
    from moe_fp4.compare.data import stdlib_corpus
    from moe_fp4.compare.train import _batches

    env, corpus = Env(torch.device("cpu")), stdlib_corpus()
    held = [_batches(CompareConfig(preset="tiny", seed=s), env, corpus, held_out=True).next(4) for s in (0, 5)]
    train = [_batches(CompareConfig(preset="tiny", seed=s), env, corpus).next(4) for s in (0, 5)]
    assert all(torch.equal(a, b) for a, b in zip(*held))
    assert not torch.equal(train[0][0], train[1][0])
    rand = [_batches(CompareConfig(preset="tiny", seed=s, data="random"), env, None, held_out=True).next(4)
            for s in (0, 1)]
    assert not torch.equal(rand[0][0], rand[1][0])
    train1 = _batches(CompareConfig(preset="tiny", seed=1, data="random"), env, None).next(4)
    assert not torch.equal(train1[0], rand[1][0])          # seed 1's training batches are not its held-out ones
