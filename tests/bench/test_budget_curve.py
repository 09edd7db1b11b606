"""bench/budget_curve.py (issue 49, item 4): the budget curve under torchrun (expert parallelism over 2 gloo ranks,
the global batch split over them) and on one process, on CPU with estimated memory (``--allow-cpu-budget``), and
its refusals. Subprocesses with TRITON_INTERPRET=0 (the pure-torch references): the probes train."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cli_run import cli_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "bench" / "budget_curve.py")
GIB = 2**30


def _curve(args, nproc=1, timeout=240):
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1 else \
        [sys.executable]
    return subprocess.run(launch + [SCRIPT, *map(str, args)], env=cli_env(), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, check=False)


def test_curve_under_expert_parallelism(tmp_path):
    """Two ranks, a global batch of 8 (4 a rank): at 0.0122 GiB fp8 must recompute or split its 4 sequences and
    fp4 need not (the CPU estimates of tests/model/test_planner.py's EP test: fp8 13.40 MB in one pass, fp4 12.88
    MB, budget 13.10 MB); at 0.05 GiB both take them in one pass. Rank 0 alone prints and writes."""
    out = tmp_path / "curve.json"
    run = _curve(["--preset", "tiny", "--global-batch", 8, "--budgets", 0.0122, 0.05, "--modes", "fp8", "fp4",
                  "--steps", 1, "--warmup", 0, "--allow-cpu-budget", "--json", out], nproc=2)
    assert run.returncode == 0 and "Traceback" not in run.stderr, f"{run.stdout}\n{run.stderr}"
    r = json.loads(out.read_text())
    assert r["meta"]["world"] == 2
    rows = {(x["budget_gib"], x["mode"]): x for x in r["rows"]}
    assert set(rows) == {(b, m) for b in (0.0122, 0.05) for m in ("fp8", "fp4")}
    split = {k: (x["policy"], x["micro_batch"], x["passes"], x["batch"]) for k, x in rows.items()}
    assert split[(0.0122, "fp4")] == ("none", 4, 1, 4), split
    assert split[(0.0122, "fp8")][:3] != ("none", 4, 1) and split[(0.0122, "fp8")][3] == 4, split
    assert split[(0.05, "fp8")] == split[(0.05, "fp4")] == ("none", 4, 1, 4), split
    for x in rows.values():
        none = x["candidates"][0]
        assert none["policy"] == "none" and none["probes"]["4 in one pass"] > 0, x
    assert rows[(0.0122, "fp8")]["candidates"][0]["probes"]["4 in one pass"] > 0.0122 * GIB >= \
        rows[(0.0122, "fp4")]["candidates"][0]["probes"]["4 in one pass"]
    assert run.stdout.count("global batch 8 x seq 64 (4 per rank)") == 1, run.stdout   # rank 0 only
    assert run.stdout.count("0.0122 GiB fp4: recompute none, micro-batch 4 x 1") == 1, run.stdout


def test_curve_refusals(tmp_path):
    # a global batch the ranks cannot share evenly, said once (rank 0), before any probe; torchrun then reports
    # the ranks' exit status 2 (its own traceback), the script raises nothing
    run = _curve(["--preset", "tiny", "--global-batch", 7, "--budgets", 1, "--modes", "fp8", "--allow-cpu-budget"],
                 nproc=2)
    assert run.returncode != 0 and "exitcode  : 2" in run.stderr, run.stderr
    assert 'budget_curve.py", line' not in run.stderr, run.stderr
    assert run.stderr.count("budget_curve.py: ") == 1 and "7" in run.stderr, run.stderr
    assert "planning" not in run.stdout and "does not fit" not in run.stdout


@pytest.mark.parametrize("args, message", [
    ([], "it needs a GPU"),                                          # no --allow-cpu-budget on a CPU
    (["--allow-cpu-budget", "--lr", "-1"], "--lr must be positive"),
])
def test_curve_refusals_on_one_process(args, message, capsys, monkeypatch):
    # In this process (both refusals come before any process group or model): the script's main.
    import importlib.util

    import torch

    if not args and torch.cuda.is_available():
        pytest.skip("a GPU is there: nothing to refuse")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    # the script sets the allocator's variable unless it is set: set here, so the test leaves it as it was
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    spec = importlib.util.spec_from_file_location("budget_curve", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--preset", "tiny", "--global-batch", "4", "--budgets", "1", "--modes", "fp8", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
