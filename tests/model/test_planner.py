"""The planner (issue 30): moe_fp4.model.planner.choose over known memory and speed functions, the compare
CLI's ``--plan auto`` end to end on CPU (estimated memory), its argument checks, and moe_fp4.plan on a GPU.

The CLI runs as a subprocess (TRITON_INTERPRET=0, like test_compare.py): it trains.
"""

import json
import math

import pytest
import torch
from cli_run import assert_ok as _ok
from cli_run import run_cli as _cli

GIB = 2**30
POLICIES = ("none", "swiglu", "moe", "layer")
# A memory model per policy: fixed bytes + bytes per sequence (each policy keeps less per sequence).
FIXED = 10 * GIB
PER_SEQ = {"none": 1.0 * GIB, "swiglu": 0.9 * GIB, "moe": 0.5 * GIB, "layer": 0.2 * GIB}
# Recomputation costs: the share of a step's time each policy adds.
EXTRA = {"none": 0.0, "swiglu": 0.03, "moe": 0.25, "layer": 0.35}


# An accumulated step (two or more passes) also holds the first pass's gradients.
GRADS = 3 * GIB


def _bytes(policy, micro, passes):
    return FIXED + PER_SEQ[policy] * micro + (GRADS if passes > 1 else 0)


def _model(budget, batch, launch_s=0.02, seq_s=0.01):
    """(measure, timed, calls) for choose(): measure is the linear memory model (plus the held gradients of
    an accumulated step), timed gives tokens/s of (passes * launch + batch * seq_s) * (1 + extra)."""
    calls = {"measure": [], "timed": []}

    def measure(policy, micro, passes):
        calls["measure"].append((policy, micro, passes))
        return _bytes(policy, micro, passes)

    def timed(policy, micro, passes):
        calls["timed"].append((policy, micro, passes))
        step = (passes * launch_s + micro * passes * seq_s) * (1 + EXTRA[policy])
        return micro * passes / step, FIXED + PER_SEQ[policy] * micro

    return measure, timed, calls


def _brute_cap(policy, budget, batch):
    """The true largest micro-batch: the whole batch if one pass fits, else the largest two-pass one."""
    if _bytes(policy, batch, 1) <= budget:
        return batch
    return max([0] + [b for b in range(1, batch) if _bytes(policy, b, 2) <= budget])


@pytest.mark.parametrize("budget_gib, batch", [(80, 64), (45, 64), (30, 64), (20, 64), (200, 64), (12, 7),
                                               (72, 64), (74.5, 64), (20.5, 12)])
def test_choose_times_each_distinct_split_and_takes_the_fastest(budget_gib, batch):
    from moe_fp4.model.planner import choose, micro_batch

    budget = budget_gib * GIB
    measure, timed, calls = _model(budget, batch)
    plan = choose(POLICIES, measure, timed, batch, budget)
    seen_passes, stopped = {}, False
    for c in plan.candidates:
        if stopped:
            assert c.tokens_per_s is None and "one pass" in c.why, c
            continue
        want = _brute_cap(c.policy, budget, batch)
        assert c.largest == want, (c, want)                       # exact, never above the batch
        if not want:
            assert c.tokens_per_s is None and "not even one" in c.why, c
            continue
        assert c.micro_batch == micro_batch(batch, want) and c.passes == -(-batch // c.micro_batch)
        if c.passes in seen_passes:
            assert c.tokens_per_s is None and seen_passes[c.passes] in c.why, c
        else:
            assert c.tokens_per_s is not None, c
            seen_passes[c.passes] = c.policy
        stopped = c.passes == 1
    timed_ = [c for c in plan.candidates if c.tokens_per_s is not None]
    best = max(timed_, key=lambda c: c.tokens_per_s)
    assert (plan.policy, plan.micro_batch, plan.passes) == (best.policy, best.micro_batch, best.passes)
    assert len(calls["timed"]) == len(timed_)                   # nothing timed twice
    # every policy tried measured the whole batch in one pass first
    tried = [c.policy for c in plan.candidates if "not tried" not in c.why]
    assert [(p, m, n) for p, m, n in calls["measure"] if n == 1] == [(p, batch, 1) for p in tried]
    assert plan.policy in plan.table() and "<- chosen" in plan.table()


def test_choose_when_everything_fits_times_only_none():
    from moe_fp4.model.planner import choose

    measure, timed, calls = _model(500 * GIB, 32)
    plan = choose(POLICIES, measure, timed, 32, 500 * GIB)
    assert (plan.policy, plan.micro_batch, plan.passes) == ("none", 32, 1)
    assert calls["timed"] == [("none", 32, 1)] and calls["measure"] == [("none", 32, 1)]


def test_choose_sees_the_one_pass_step_off_the_two_pass_curve():
    """The H200 case: the whole batch fits in one pass while two passes of one sequence less do not (they
    hold the first pass's gradients). The plan must take the single pass."""
    from moe_fp4.model.planner import choose

    budget = FIXED + PER_SEQ["none"] * 16 + 0.5 * GIB      # one pass of 16 fits; two of 15 need GRADS more
    measure, timed, _ = _model(budget, 16)
    plan = choose(POLICIES, measure, timed, 16, budget)
    assert (plan.policy, plan.micro_batch, plan.passes) == ("none", 16, 1)


def test_choose_skips_a_policy_that_keeps_what_a_cheaper_one_keeps():
    """fp4's SWIGLU keeps what its NONE keeps (its SwiGLU output stays in MXFP4): the planner does not measure it."""
    from moe_fp4.model.moe import Recompute, same_policy
    from moe_fp4.model.planner import choose, kept_alike

    assert kept_alike("fp4", POLICIES) == {"swiglu": "none"} and kept_alike("fp8", POLICIES) == {}
    assert kept_alike("fp4", ("swiglu", "moe")) == {}          # none is not among them: swiglu is measured
    assert same_policy("fp4", "swiglu") is Recompute.NONE
    assert [same_policy(p, r) for p in ("bf16", "fp8") for r in POLICIES] == [None] * 8
    assert [same_policy("fp4", r) for r in ("none", "moe", "dense", "layer")] == [None] * 4
    measure, timed, calls = _model(45 * GIB, 64)
    plan = choose(POLICIES, measure, timed, 64, 45 * GIB, same={"swiglu": "none"})
    swiglu = next(c for c in plan.candidates if c.policy == "swiglu")
    assert swiglu.why == "not tried: it keeps what none keeps" and "not tried" in plan.table()
    assert all(p != "swiglu" for p, _, _ in calls["measure"] + calls["timed"])
    assert [c.policy for c in plan.candidates] == list(POLICIES)


def test_choose_nothing_fits():
    from moe_fp4.model.planner import NothingFits, choose

    measure, timed, _ = _model(5 * GIB, 8)
    with pytest.raises(NothingFits, match="not even one sequence"):
        choose(POLICIES, measure, timed, 8, 5 * GIB)
    with pytest.raises(ValueError, match="batch must be positive"):
        choose(POLICIES, measure, timed, 0, 5 * GIB)


def _drifting(measure, timed, drift_per_seq):
    """timed() of _model whose peak grows by drift_per_seq a sequence after the probes (under EP a rank's rows
    follow the routing, which drifts from balanced after the first steps)."""
    def later(policy, micro, passes):
        tps, peak = timed(policy, micro, passes)
        return tps, peak + drift_per_seq * micro
    return measure, later


def test_choose_steps_down_when_the_timed_steps_run_over_the_budget():
    """The dsv3-layers EP 2 case: the whole batch probes within the budget, its timed steps peak above it.
    That split is no plan: the next smaller one is timed, and nothing over the budget is chosen."""
    from moe_fp4.model.planner import OVER_BUDGET, choose

    budget = 27 * GIB    # none: one pass of 16 probes 26 GiB, peaks 30 timed; two passes of 8 peak 20
    measure, timed, calls = _model(budget, 16)
    measure, timed = _drifting(measure, timed, 0.25 * GIB)
    lines = []
    plan = choose(POLICIES, measure, timed, 16, budget, log=lambda m, **k: lines.append(m))
    c = {(x.policy, x.micro_batch, x.passes): x for x in plan.candidates}
    assert c[("none", 16, 1)].why == OVER_BUDGET and c[("none", 16, 1)].peak_bytes == 30 * GIB
    assert c[("none", 8, 2)].why == "" and c[("none", 8, 2)].peak_bytes == 20 * GIB
    # swiglu: one pass of 16 over too (28.4 GiB); its next size down is none's split, not timed again
    assert c[("swiglu", 16, 1)].why == OVER_BUDGET and "same passes as none" in c[("swiglu", 8, 2)].why
    assert c[("moe", 16, 1)].why == "" and c[("layer", 0, 0)].why.startswith("not tried")
    assert plan.peak_bytes <= budget and plan.table().count("<- chosen") == 1
    assert (plan.policy, plan.micro_batch, plan.passes) in {("none", 8, 2), ("moe", 16, 1)}
    assert any("over the budget in its timed steps (30.00 GiB): one micro-batch size down" in m for m in lines)
    assert calls["timed"] == [("none", 16, 1), ("none", 8, 2), ("swiglu", 16, 1), ("moe", 16, 1)]


def test_choose_steps_down_when_the_timed_steps_run_out_of_memory():
    """A split whose timed steps run out of memory (timed -> (0, inf)) counts as over the budget: one size down."""
    from moe_fp4.model.planner import OVER_BUDGET, choose

    measure, timed, calls = _model(27 * GIB, 16)

    def oom_in_one_pass(policy, micro, passes):
        return (0.0, math.inf) if passes == 1 else timed(policy, micro, passes)

    lines = []
    plan = choose(("none",), measure, oom_in_one_pass, 16, 27 * GIB, log=lambda m, **k: lines.append(m))
    assert (plan.policy, plan.micro_batch, plan.passes) == ("none", 8, 2)
    assert plan.candidates[0].why == OVER_BUDGET and plan.candidates[0].peak_bytes == math.inf
    assert any(f"{OVER_BUDGET} (out of memory): one micro-batch size down" in m for m in lines), lines
    assert not any(", 0 tokens/s" in m for m in lines), lines    # no timing line for the failed split


def test_choose_when_every_split_runs_over_says_so():
    from moe_fp4.model.planner import MAX_SIZES_DOWN, NothingFits, choose

    measure, timed, calls = _model(27 * GIB, 16)
    measure, timed = _drifting(measure, timed, 100 * GIB)
    with pytest.raises(NothingFits, match=r"fit the probes but ran over the budget in their timed steps"):
        choose(("none",), measure, timed, 16, 27 * GIB)
    assert len(calls["timed"]) == MAX_SIZES_DOWN + 1      # bounded: the first split and three sizes down


def test_search_never_probes_above_most():
    from moe_fp4.model.planner import search_largest_batch

    probed = []

    def fn(b):
        probed.append(b)
        return float(b)

    found = search_largest_batch(fn, 1e9, 4, most=10)
    assert found["batch_max"] == 10 and found["exact"] and max(probed) == 10
    found = search_largest_batch(lambda b: 100.0 * b, 650, 4, most=10)
    assert found["batch_max"] == 6 and found["exact"]


def test_plan_is_exported_and_needs_a_gpu():
    import moe_fp4
    from moe_fp4.model.planner import plan

    assert moe_fp4.plan is plan
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="needs a GPU"):
            moe_fp4.plan(torch.nn.Linear(2, 2), lambda m, p: None, budget_gib=1, batch=1)


@pytest.mark.gpu
def test_plan_on_a_gpu_model():
    """moe_fp4.plan on the small decoder: the chosen policy is applied, its split fits the budget as
    measured, and each timed candidate's measured peak is within the budget."""
    import moe_fp4
    from moe_fp4.model.decoder import PRESETS, DecoderLM

    cfg = PRESETS["tiny"].with_(seq=256)
    model = DecoderLM(cfg, "fp4", device="cuda")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    batch = 32

    def step(micro, passes):
        for _ in range(passes):
            ids = torch.randint(0, cfg.vocab, (micro, cfg.seq), device="cuda")
            model(ids, ids).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(1, 1)
    fixed = torch.cuda.memory_allocated()
    budget = (fixed + 40 * 2**20) / GIB
    p = moe_fp4.plan(model, step, budget_gib=budget, batch=batch, seq=cfg.seq)
    assert model.recompute.value == p.policy
    for c in p.candidates:
        if c.tokens_per_s is not None:
            assert c.peak_bytes <= budget * GIB * 1.0 + 1, c
    assert p.micro_batch * p.passes >= batch


# ---------------------------------------------------------------------------------------------------
# The CLI: --plan auto on CPU (memory estimated), and its argument checks.

def test_cli_plan_auto(tmp_path):
    from moe_fp4.model.moe import Recompute

    # tiny preset on CPU: ~11.5 MB fixed; a global batch of 8 fits in one pass only under dense (15.06 MiB in fp8,
    # 14.02 in fp4), so layer is not tried
    gib = 0.01475
    run = _cli(["compare", "--preset", "tiny", "--steps", 2, "--warmup", 1, "--modes", "fp8", "fp4",
                "--budget-gib", gib, "--global-batch", 8, "--plan", "auto", "--allow-cpu-budget", "--data", "random",
                "--out", tmp_path, "--no-progress", "--no-plots"])
    _ok(run)
    report = json.loads((tmp_path / "compare.json").read_text())
    assert set(report["plans"]) == {"fp8", "fp4"}
    for mode, p in report["plans"].items():
        row = report["modes"][mode]
        assert (row["recompute"], row["micro_batch"], row["batch"]) == (p["policy"], p["micro_batch"], 8), (row, p)
        chosen = next(c for c in p["candidates"] if c["policy"] == p["policy"])
        assert chosen["tokens_per_s"] == max(c["tokens_per_s"] for c in p["candidates"] if c["tokens_per_s"])
        for c in p["candidates"]:
            if c["largest"] == 8:   # the whole batch in one pass, measured to fit
                assert c["probes"]["8 in one pass"] <= gib * GIB, c
            elif c["largest"]:      # two passes of the cap fit, of one more do not (or that is the batch)
                assert c["probes"]["8 in one pass"] > gib * GIB, c
                assert c["probes"][str(c["largest"])] <= gib * GIB, c
                assert c["largest"] == 7 or c["probes"][str(c["largest"] + 1)] > gib * GIB, c
        assert [c["policy"] for c in p["candidates"]] == [r.value for r in Recompute]
        # which fitting split is chosen follows CPU timings: only what the memory estimates decide is asserted
        assert p["candidates"][-1]["why"] == "not tried: dense already takes the batch in one pass", p
    # fp4's swiglu keeps what its none keeps: not measured; fp8's is (its none does not take the batch in one pass)
    assert report["plans"]["fp4"]["candidates"][1]["why"] == "not tried: it keeps what none keeps"
    assert report["plans"]["fp8"]["candidates"][1]["probes"], report["plans"]["fp8"]
    assert f"plan per mode in {gib:g} GiB per device at global batch 8" in run.stdout


def test_cli_plan_auto_under_expert_parallelism(tmp_path):
    """--plan auto under torchrun (EP on 2 gloo ranks, the global batch split over the ranks): every rank
    plans the same (the probes are maxima over the ranks), and where fp8 must recompute or split to fit its
    4 sequences a rank, fp4 need do neither (CPU estimates, 2026-11-28: fp8 13.40 MB in one pass, fp4
    12.88 MB, budget 0.0122 GiB = 13.10 MB)."""
    gib = 0.0122
    run = _cli(["compare", "--preset", "tiny", "--steps", 2, "--warmup", 1, "--modes", "fp8", "fp4",
                "--budget-gib", gib, "--global-batch", 8, "--plan", "auto", "--allow-cpu-budget", "--data", "random",
                "--out", tmp_path, "--no-progress", "--no-plots"], nproc=2)
    _ok(run)
    report = json.loads((tmp_path / "compare.json").read_text())
    assert report["meta"]["world"] == 2
    plans = report["plans"]
    for mode, p in plans.items():
        row = report["modes"][mode]
        assert (row["recompute"], row["micro_batch"], row["batch"]) == (p["policy"], p["micro_batch"], 4), (row, p)
        none = p["candidates"][0]
        assert none["policy"] == "none" and none["probes"]["4 in one pass"] > 0, p
    assert plans["fp8"]["candidates"][0]["probes"]["4 in one pass"] > gib * GIB >= \
        plans["fp4"]["candidates"][0]["probes"]["4 in one pass"], plans
    # fp8 recomputes or splits (which of the two is faster is timed, on CPU either); fp4 does neither.
    assert (plans["fp8"]["policy"], plans["fp8"]["micro_batch"]) != ("none", 4), plans["fp8"]
    assert plans["fp4"]["policy"] == "none" and plans["fp4"]["micro_batch"] == 4, plans["fp4"]


@pytest.mark.parametrize("args, message", [
    (["--plan", "auto", "--global-batch", "8"], "give --budget-gib and --global-batch"),
    (["--plan", "auto", "--budget-gib", "1"], "give --budget-gib and --global-batch"),
    (["--plan", "auto", "--budget-gib", "1", "--global-batch", "8", "--recompute", "moe"], "leave --recompute out"),
    (["--hook", "--recompute", "moe"], "--hook compares a Hugging Face model"),
    (["--plan", "auto", "--budget-gib", "1", "--global-batch", "8"], "--plan auto needs a GPU"),
])
def test_cli_plan_arguments(tmp_path, capsys, monkeypatch, args, message):
    import moe_fp4.compare.cli
    import moe_fp4.compare.runner

    def refuse(*_a, **_k):
        raise AssertionError("argument validation let the run start")

    monkeypatch.setattr(moe_fp4.compare.runner, "run", refuse)
    monkeypatch.setattr(moe_fp4.compare.cli, "_distributed", refuse)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert moe_fp4.compare.cli.main(["compare", "--preset", "tiny", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moe-fp4 compare: error: ") and message in err, err


def test_cli_recompute_trains_identically(tmp_path):
    """--recompute layer trains to the same losses as none (same precision, same batches)."""
    losses = {}
    for policy in ("none", "layer"):
        out = tmp_path / policy
        run = _cli(["compare", "--preset", "tiny", "--steps", 3, "--warmup", 1, "--modes", "fp4", "--recompute",
                    policy, "--data", "random", "--out", out, "--no-progress", "--no-plots"])
        _ok(run)
        row = json.loads((out / "compare.json").read_text())["modes"]["fp4"]
        assert row["recompute"] == policy
        losses[policy] = row["loss_curve"]
    assert losses["none"] == losses["layer"] and all(math.isfinite(v) for v in losses["none"])


def test_cli_max_batch_takes_the_whole_rank_batch_in_one_pass(tmp_path):
    """--max-batch with --global-batch: when the rank's whole batch fits in one pass it is taken as is
    (the two-pass search below it would not see it)."""
    run = _cli(["compare", "--preset", "tiny", "--steps", 2, "--warmup", 1, "--modes", "fp4", "--max-batch", 0.02,
                "--global-batch", 4, "--allow-cpu-budget", "--data", "random", "--out", tmp_path, "--no-progress",
                "--no-plots"])
    _ok(run)
    report = json.loads((tmp_path / "compare.json").read_text())
    found, row = report["max_batch"]["fp4"], report["modes"]["fp4"]
    assert found["one_pass"] and found["batch_max"] == 4 and found["probe"]["4 in one pass"] <= 0.02 * GIB, found
    assert (row["batch"], row["micro_batch"], row["accumulate"]) == (4, 4, 1), row


def test_table_shows_no_ratios_without_the_baseline():
    """A run of one mode (here fp4 alone, as when modes are planned in separate calls) prints its row and
    plan, and no "ratios vs fp8" line of NaNs."""
    from moe_fp4.compare.report import ratios, table

    row = {"mode": "fp4", "tokens_per_s_per_gpu": 1000.0, "step_ms": 10.0, "peak_bytes": 2 * GIB,
           "activation_bytes": GIB, "a2a_share": None, "loss_final": 1.0, "loss_eval": 1.1}
    report = {"meta": {"device": "GPU", "world": 1, "torch": "t", "triton": "t", "version": "0", "date": "d"},
              "config": {"hook": False, "budget_gib": 9, "global_batch": 64}, "modes": {"fp4": row},
              "max_batch": {}, "notes": [],
              "plans": {"fp4": {"policy": "none", "micro_batch": 22, "passes": 3,
                                "candidates": [{"policy": "none", "tokens_per_s": 1000.0}]}}}
    report["ratios"] = ratios(report["modes"])
    text = table(report)
    assert "ratios vs" not in text and "nan" not in text
    assert "fp4      recompute none, micro-batch 22 x 3 passes" in text


# ---------------------------------------------------------------------------------------------------
# A search that cannot run away (issue 49): flat first probes, a floor per sequence, probes that fail.

GB = 2**30


def _flat_then_rising(calls, fixed=66 * GB, per=GB, flat=2, tiny=1000, oom_from=None):
    """Memory of a step whose first batches barely differ (weights and optimizer state dominate: dsv3-layers
    measured 66.66 GiB at batch 1 and 2) and then rise by ``per`` a sequence; out of memory from
    ``oom_from``. Records every batch asked for in ``calls``."""
    def measure(b):
        calls.append(b)
        assert b < 10_000, f"asked for batch {b}: memory proportional to an absurd batch"
        if oom_from is not None and b >= oom_from:
            return math.inf
        return fixed + tiny * b + max(0, b - flat) * per
    return measure


def _brute_largest(measure, budget, top=10_000):
    b = 0
    while b + 1 < top and measure(b + 1) <= budget:
        b += 1
    return b


@pytest.mark.parametrize("budget_gib", [70, 80, 100, 139])
def test_search_with_flat_first_probes_steps_up_and_ends_exact(budget_gib):
    from moe_fp4.model.planner import search_largest_batch

    budget = budget_gib * GB
    calls, lines = [], []
    found = search_largest_batch(_flat_then_rising(calls), budget, 1, min_step=0.5 * GB,
                                 log=lambda m, **k: lines.append(m))
    want = _brute_largest(_flat_then_rising([]), budget)
    assert found["batch_max"] == want and found["exact"], (found, want)
    assert len(calls) <= 16 and max(calls) <= 4 * want + 4, calls          # issue 49: at most 16 probes
    assert want + 1 in calls                                               # batch_max + 1 measured
    assert any("stepping up from batch 2 instead of predicting" in m for m in lines), lines


def test_search_without_a_floor_caps_the_prediction():
    # The same flat probes without min_step: the line through them predicts about 34 million sequences; the
    # search measures at most PREDICTION_CAP times the largest fit, then brackets and bisects.
    from moe_fp4.model.planner import PREDICTION_CAP, search_largest_batch

    calls = []
    found = search_largest_batch(_flat_then_rising(calls), 100 * GB, 1)
    assert found["batch_max"] == _brute_largest(_flat_then_rising([]), 100 * GB) and found["exact"]
    assert calls[:3] == [1, 2, 2 * PREDICTION_CAP], calls


def test_search_floor_rules_out_batches_without_measuring_them():
    # Doubling from the flat probes overshoots (64 at a 100 GiB budget, where 35 is the answer): the floor
    # from the largest measured fit puts such batches above the budget, and they are not measured.
    from moe_fp4.model.planner import search_largest_batch

    calls, lines = [], []
    found = search_largest_batch(_flat_then_rising(calls), 100 * GB, 1, min_step=0.5 * GB,
                                 log=lambda m, **k: lines.append(m))
    assert found["batch_max"] == _brute_largest(_flat_then_rising([]), 100 * GB) and found["exact"]
    skipped = set(map(int, found["skipped"]))
    assert skipped and skipped.isdisjoint(calls), (skipped, calls)
    measure = _flat_then_rising([])
    for b, floor in found["skipped"].items():
        assert 100 * GB < floor <= measure(int(b)), (b, floor)      # over the budget, and a true lower bound
    assert sum("does not fit, not measured: at least" in m for m in lines) == len(skipped), lines


@pytest.mark.parametrize("oom_from", [1, 2, 3, 17, 40])
def test_search_with_probes_that_fail(oom_from):
    # Out of memory (inf) from some batch on, below the budget's answer or above it.
    from moe_fp4.model.planner import search_largest_batch

    calls = []
    found = search_largest_batch(_flat_then_rising(calls, oom_from=oom_from), 100 * GB, 1, min_step=0.5 * GB)
    want = _brute_largest(_flat_then_rising([], oom_from=oom_from), 100 * GB)
    assert found["batch_max"] == want and found["exact"], (oom_from, found)
    assert len(calls) <= 16, calls


def test_search_that_runs_out_of_probes_says_so():
    from moe_fp4.model.planner import search_largest_batch

    calls, lines = [], []
    found = search_largest_batch(_flat_then_rising(calls), 100 * GB, 1, min_step=0.5 * GB, max_probes=4,
                                 log=lambda m, **k: lines.append(m))
    assert len(calls) == 4 and not found["exact"]
    assert found["batch_max"] == max(b for b in calls if b <= 34)           # the largest batch measured to fit
    assert any(m.startswith("  the search stopped at its bound of 4 probes") for m in lines), lines


def test_search_refuses_a_floor_that_is_not_one():
    # min_step above what a sequence really adds: the batch it ruled out is measured at the end and fits.
    from moe_fp4.model.planner import search_largest_batch

    with pytest.raises(ValueError, match="min_step is not a floor"):
        search_largest_batch(lambda b: b * 1.0, 10.0, 1, min_step=100.0)
