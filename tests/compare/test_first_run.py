"""Issue 26 part A: a first ``moe-fp4 compare`` never wastes the user's time. One test (or a few) per
problem a new user hit: errors found before training (one line, exit code 2, no traceback), results
kept when the files cannot be written, torchrun output labelled and printed once, help text for a
terminal, the table in order with unambiguous units and no warnings, the banner's provenance, and the
default output directory ignored by git.

As in test_compare.py, anything that trains runs as a subprocess with TRITON_INTERPRET=0 and
OMP_NUM_THREADS=1 (the pure-torch reference conversions), and moe_fp4 is imported inside the tests.
"""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI_TIMEOUT_S = 240
MODES = ("bf16", "fp8", "fp4")
ERROR = "moe-fp4 compare: error: "
# A table row: the mode, then tokens/s/GPU (digits with thousands commas).
ROW = re.compile(r"^(bf16|fp8|fp4|hf|hf\+hook)\s+[\d,]+\s")


def _env(**extra) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "MOE_FP4_COMMIT", "KINETO_LOG_LEVEL"):
        env.pop(k, None)
    env.update(extra)
    return env


def _compare(args, nproc: int = 1, cwd: str = ROOT, **env) -> subprocess.CompletedProcess:
    """``python -m moe_fp4 compare --preset tiny <args>`` (under torchrun with ``nproc`` > 1)."""
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc)] if nproc > 1 else \
        [sys.executable]
    cmd = launch + ["-m", "moe_fp4", "compare", "--preset", "tiny", *map(str, args)]
    try:
        return subprocess.run(cmd, env=_env(**env), capture_output=True, text=True, timeout=CLI_TIMEOUT_S, cwd=cwd,
                              check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{' '.join(cmd)} timed out after {CLI_TIMEOUT_S} s:\n{e.stdout}\n{e.stderr}")


def _refused(run: subprocess.CompletedProcess, message: str) -> None:
    """One error line on stderr with ``message``, exit code 2, no traceback, and nothing trained."""
    assert run.returncode == 2, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr
    errors = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(errors) == 1 and errors[0].startswith(ERROR) and message in errors[0], run.stderr
    assert "training" not in run.stdout and " done: " not in run.stdout, run.stdout


def _ok(run: subprocess.CompletedProcess) -> None:
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout}\n{run.stderr}"
    assert "Traceback" not in run.stderr, run.stderr


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """One successful run, shared: 2 steps of the tiny preset with the profiler on (its C++ side is
    what printed "USDT ... profiler_start"), every DeprecationWarning shown (the torch.jit ones were)."""
    out = tmp_path_factory.mktemp("first_run") / "new" / "dir"     # --out need not exist
    run = _compare(["--steps", 2, "--no-plots", "--no-progress", "--profile", "--out", out],
                   PYTHONWARNINGS="always::DeprecationWarning")
    _ok(run)
    return run, json.loads((out / "compare.json").read_text()), out


# ---------------------------------------------------------------------------------------------------
# `--out /nonexistent/dir`: trained every mode, then died with a traceback, losing the results.

def test_unwritable_out_refused_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a regular file, so nothing can be created under it (also as root)")
    run = _compare(["--steps", 2, "--no-progress", "--out", blocker / "sub"])
    _refused(run, f"--out {blocker / 'sub'}: cannot write there")
    assert blocker.read_text().startswith("a regular file")


def test_out_dir_created_and_probe_removed(first_run):
    _, _, out = first_run
    assert sorted(p.name for p in out.iterdir()) == ["compare.json", "profile_bf16.txt", "profile_fp4.txt",
                                                     "profile_fp8.txt"]


def test_write_failure_after_training_keeps_the_results(first_run, tmp_path, capsys, monkeypatch):
    """The directory becomes unwritable after the upfront check: the table is printed first, then one
    line says where the report went instead, and that file holds every number."""
    from moe_fp4.compare.cli import finish

    _, report, _ = first_run
    report = json.loads(json.dumps(report))
    report["modes"]["fp4"]["profile_table"] = "the profiler's table"
    (tmp_path / "file").write_text("")
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))   # where the fallback goes

    code = finish(report, str(tmp_path / "file" / "sub"), plots=True)
    captured = capsys.readouterr()
    assert code == 1
    assert captured.out.splitlines()[1].split()[:2] == ["mode", "tokens/s/GPU"], captured.out
    errors = captured.err.strip().splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"moe-fp4 compare: could not write to {tmp_path / 'file'}"), \
        captured.err
    saved = list((tmp_path / "tmp").iterdir())
    assert len(saved) == 1 and f"wrote the report to {saved[0]} instead" in errors[0]
    kept = json.loads(saved[0].read_text())
    assert kept["modes"]["fp8"]["loss_curve"] == report["modes"]["fp8"]["loss_curve"]
    assert kept["modes"]["fp4"]["profile_table"] == "the profiler's table"   # nothing dropped
    assert f"wrote {saved[0]}" in captured.out


def test_plot_failure_loses_nothing(first_run, tmp_path, capsys, monkeypatch):
    import moe_fp4.compare.plots
    from moe_fp4.compare.cli import write_results

    def broken(*_a):
        raise ValueError("no room for a legend")

    monkeypatch.setattr(moe_fp4.compare.plots, "write_plots", broken)
    written, ok = write_results(json.loads(json.dumps(first_run[1])), str(tmp_path))
    assert not ok and written == [str(tmp_path / "compare.json")]
    assert json.loads((tmp_path / "compare.json").read_text())["modes"].keys() == set(MODES)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["moe-fp4 compare: plots: failed (ValueError: no room for a legend); compare.json has every number"]


# ---------------------------------------------------------------------------------------------------
# `--lr -1` failed only once training had started; `--layers 1` compared three identical models.

@pytest.mark.parametrize("args, message", [
    (["--lr", "-1"], "--lr must be positive, got -1.0"),
    (["--lr", "nan"], "--lr must be positive, got nan"),
    (["--layers", "1"], "--layers 1 leaves no MoE layer (preset tiny starts with 1 dense)"),
    (["--experts", "0"], "--experts must be positive, got 0"),
    (["--layers", "0"], "--layers must be positive, got 0"),
    (["--max-batch", "1", "--budget-gib", "1"], "give one of them"),
    (["--profile", "--profile-steps", "0"], "needs --profile-steps > 0"),
])
def test_bad_arguments_refused_before_training(tmp_path, args, message, capsys, monkeypatch):
    # In process (moe_fp4.compare.cli.main, what `python -m moe_fp4` exits with), starting a process group or
    # training made to fail the test: a subprocess per case cost ~3 s each on the 2-core CI machine for
    # nothing more. The refusals above and below go through a real process.
    import moe_fp4.compare.cli
    import moe_fp4.compare.runner

    def started(*_a, **_k):
        raise AssertionError("the run started before the argument was refused")

    monkeypatch.setattr(moe_fp4.compare.runner, "run", started)
    monkeypatch.setattr(moe_fp4.compare.cli, "_distributed", started)
    for k in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    argv = ["compare", "--preset", "tiny", *args, "--steps", "2", "--no-progress", "--out", str(tmp_path / "out")]
    try:
        code = moe_fp4.compare.cli.main(argv)
    except SystemExit as e:          # an argparse error
        code = e.code
    captured = capsys.readouterr()
    _refused(subprocess.CompletedProcess(argv, code, captured.out, captured.err), message)
    assert not (tmp_path / "out").exists()          # argument errors come before the output check


def test_moe_layer_count_comes_from_the_model_config():
    from moe_fp4.compare.config import CompareConfig
    from moe_fp4.model.decoder import PRESETS

    dense = PRESETS["small"].dense_layers
    with pytest.raises(ValueError, match=f"use --layers {dense + 1} or more"):
        CompareConfig(preset="small", layers=dense)
    assert CompareConfig(preset="small", layers=dense + 1).model.moe_layers == 1


# ---------------------------------------------------------------------------------------------------
# `--max-batch 8` on CPU: minutes of probes with no warning that CPU budgets mean nothing.

def test_max_batch_refused_on_cpu(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("--max-batch is meant for a GPU")
    run = _compare(["--max-batch", 8, "--steps", 2, "--no-progress", "--out", tmp_path])
    _refused(run, "--max-batch needs a GPU: on CPU there is no allocator to measure")
    assert "--allow-cpu-budget" in run.stderr


def test_allow_cpu_budget_lets_max_batch_through(tmp_path, monkeypatch):
    import moe_fp4.compare.cli

    def started(*_a, **_k):
        raise RuntimeError("started")

    monkeypatch.setattr(moe_fp4.compare.cli, "_distributed", started)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="started"):
        moe_fp4.compare.cli.main(["compare", "--preset", "tiny", "--max-batch", "0.02", "--allow-cpu-budget",
                          "--out", str(tmp_path)])


# ---------------------------------------------------------------------------------------------------
# torchrun: rank 0's loss in the progress lines, the mean in the table, profiler noise on every rank.

def test_torchrun_output_is_labelled_and_printed_once(tmp_path):
    run = _compare(["--steps", 2, "--modes", "fp4", "--no-plots", "--out", tmp_path], nproc=2)
    _ok(run)
    lines = run.stdout.splitlines()
    assert sum(line.startswith("moe-fp4 compare: preset tiny") for line in lines) == 1, run.stdout
    assert sum(line.split()[:2] == ["mode", "tokens/s/GPU"] for line in lines) == 1, run.stdout
    progress = [line for line in lines if " step " in line and "/2 " in line]
    assert len(progress) == 2 and all("rank 0 loss" in line for line in progress), run.stdout
    done = next(line for line in lines if line.startswith("  fp4 done: "))
    assert "(slowest rank)" in done and "(largest rank)" in done and "(means over 2 ranks)" in done, done
    assert "note: 2 ranks: tokens/s/GPU and step ms are the slowest rank's" in run.stdout
    assert "USDT" not in run.stderr and "profiler_start" not in run.stderr, run.stderr
    report = json.loads((tmp_path / "compare.json").read_text())
    assert any(n.startswith("2 ranks: ") for n in report["notes"])


# ---------------------------------------------------------------------------------------------------
# `compare --help`: raw reST markup, a dict repr, no defaults shown.

def _help(monkeypatch, capsys, columns: int) -> str:
    from moe_fp4.compare.cli import main

    monkeypatch.setenv("COLUMNS", str(columns))
    with pytest.raises(SystemExit) as e:
        main(["compare", "--help"])
    assert e.value.code == 0
    return capsys.readouterr().out


def test_help_is_written_for_a_terminal(capsys, monkeypatch):
    text = _help(monkeypatch, capsys, 80)
    assert max(len(line) for line in text.splitlines()) < 80, text
    assert "``" not in text and ":func:" not in text and ":class:" not in text
    assert not re.search(r"\{['\"]", text), text           # no dict repr
    assert text.index("options:") < text.index("examples:")  # examples at the end
    assert text.rstrip().splitlines()[-1].strip() == "expert parallelism over 2 GPUs"

    wide = _help(monkeypatch, capsys, 200)
    options = {line.split()[0]: line for line in wide.splitlines() if line.startswith("  --")}
    assert options["--out"].endswith("(default: moe_fp4_compare)"), options["--out"]
    assert options["--lr"].endswith("(default: tiny 0.001, small 0.001, dsv3-layers 0.0003)"), options["--lr"]
    assert options["--profile-steps"].endswith("(default: 3)")
    assert options["--batch"].endswith("(default: tiny 4, small 64, dsv3-layers 2)"), options["--batch"]
    assert "GiB" in options["--max-batch"] and "tokens" in options["--seq"]
    assert "(default: None)" not in wide and "(default: False)" not in wide
    assert "(default: )" not in wide and re.search(r"Default:\s+each\s+mode's\s+own\s+recipe", wide)  # --wire's own
    assert "pip install transformers" in options["--hook"]                  # --hook needs transformers


# ---------------------------------------------------------------------------------------------------
# `moe-fp4 --help` and every one-line error waited for moe_fp4's whole import (torch._dynamo included);
# Ctrl-C while it loaded printed a 40-line traceback.

_LIGHT = ("import sys, moe_fp4, moe_fp4.compare, moe_fp4.compare.cli; "
          "print(sorted(m for m in ('torch', 'triton', 'transformers') if m in sys.modules))")


def test_the_command_line_starts_without_torch():
    # Its modules import torch and the model inside main(), where Ctrl-C is the command line's to handle;
    # --help (the whole parser) and argparse's errors need neither.
    for code in (_LIGHT, _LIGHT.replace("; print(", "; moe_fp4.compare.cli._parser().format_help(); print(")):
        run = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True,
                             timeout=CLI_TIMEOUT_S, cwd=ROOT, check=False)
        assert run.returncode == 0 and run.stdout.strip() == "[]", run.stdout + run.stderr


def test_the_parsers_choices_are_the_models():
    from moe_fp4.compare.cli import PRESET_LR_HELP, PRESET_NAMES, RECOMPUTE_CHOICES
    from moe_fp4.compare.config import PRESET_LR
    from moe_fp4.model.decoder import PRESETS
    from moe_fp4.model.moe import Recompute

    assert PRESET_NAMES == tuple(PRESETS) and PRESET_LR_HELP == PRESET_LR
    assert RECOMPUTE_CHOICES == tuple(r.value for r in Recompute)


def test_the_facade_names_resolve_on_first_use():
    import moe_fp4
    import moe_fp4.compare

    for package in (moe_fp4, moe_fp4.compare):
        missing = [name for name in package.__all__ if getattr(package, name, None) is None]
        assert not missing and set(package.__all__) <= set(dir(package)), (package.__name__, missing)
    assert moe_fp4.register_activation_compression.__module__ == "moe_fp4.saved.hook"
    assert moe_fp4.formats.__name__ == "moe_fp4.formats" and moe_fp4.compare.runner.__name__ == "moe_fp4.compare.runner"
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        moe_fp4.nope   # noqa: B018


@pytest.mark.parametrize("after_s", [0.3, 1.5])
def test_ctrl_c_before_training_is_one_line(tmp_path, after_s):
    # --hook: torch, then transformers in the package check, load for seconds before the first step; SIGINT
    # lands in one of them (on this machine the first step comes after about 5 s).
    import signal
    import time

    cmd = [sys.executable, "-m", "moe_fp4", "compare", "--preset", "tiny", "--hook", "--steps", "2", "--no-progress",
           "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        time.sleep(after_s)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, f"exit {proc.returncode}\n{out}\n{err}"
    assert err.strip().splitlines() == ["moe-fp4: interrupted (Ctrl-C)"], err
    assert "training" not in out, out


def test_hook_with_a_broken_transformers_is_one_line(tmp_path):
    # Installed but failing at import (built for another torch): named before any work, like a missing one.
    (tmp_path / "transformers").mkdir()
    broken = 'raise ImportError("cannot import name \'X\' from \'torch\'")\n'
    (tmp_path / "transformers" / "__init__.py").write_text(broken)
    run = _compare(["--hook", "--steps", "2", "--no-progress", "--out", tmp_path / "out"], PYTHONPATH=str(tmp_path))
    _refused(run, "--hook trains a Hugging Face MoE model: it needs transformers, which is installed but cannot be "
                  "imported (ImportError: cannot import name 'X' from 'torch'); install a transformers that works "
                  "with torch ")


# ---------------------------------------------------------------------------------------------------
# The output: summary rows before the table header, "M" for MiB and millions, torch.jit warnings.

def test_table_header_comes_first(first_run):
    lines = first_run[0].stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["mode", "tokens/s/GPU"])
    rows = [i for i, line in enumerate(lines) if ROW.match(line)]
    assert rows == [header + 1, header + 2, header + 3], first_run[0].stdout
    assert lines[header + 4] == "ratios vs fp8:"
    done = [i for i, line in enumerate(lines) if " done: " in line]
    assert len(done) == 3 and all(i < header for i in done)   # named numbers while training, no bare rows


def test_units_are_unambiguous(first_run):
    out = first_run[0].stdout
    assert not re.search(r"\d M\b", out), out                # neither MiB nor millions as a bare "M"
    assert "million parameters" in out
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["mode", "tokens/s/GPU"])
    for line in lines[header + 1:header + 4]:
        assert line.split()[5] == "MiB", line                 # act mem: "5.1 MiB"


def test_no_warnings_or_profiler_noise(first_run):
    err = first_run[0].stderr
    assert "torch.jit" not in err and "Warning" not in err, err
    assert "USDT" not in err and "profiler_start" not in err, err


# ---------------------------------------------------------------------------------------------------
# The banner: the commit of whatever git repository encloses the install.

def test_banner_and_report_give_version_and_commit(first_run):
    import moe_fp4

    run, report, _ = first_run
    meta = report["meta"]
    assert meta["version"] == moe_fp4.__version__
    assert re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", meta["commit"]), meta["commit"]   # the tests run from a checkout
    assert f"moe_fp4 {meta['version']}, commit {meta['commit']}" in run.stdout.splitlines()[1]


def _git(cwd, *args):
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                   capture_output=True)


def _repo(path, name: str | None):
    """A git repository at ``path`` with one commit (and a pyproject.toml of project ``name``) and a
    copy of moe_fp4/compare/origin.py (where commit() lives) under moe_fp4/ -> that file's path."""
    (path / "moe_fp4" / "compare").mkdir(parents=True)
    shutil.copy(os.path.join(ROOT, "moe_fp4", "compare", "origin.py"),
                path / "moe_fp4" / "compare" / "origin.py")
    if name:
        (path / "pyproject.toml").write_text(f'[project]\nname = "{name}"\nversion = "9"\n')
    _git(path, "init", "-q")
    _git(path, "add", "-A")
    _git(path, "commit", "-q", "-m", "x")
    return str(path / "moe_fp4" / "compare" / "origin.py")


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_commit_only_from_moe_fp4s_own_repository(tmp_path, monkeypatch):
    from moe_fp4.compare import origin

    monkeypatch.delenv("MOE_FP4_COMMIT", raising=False)
    # moe_fp4's own checkout (source tree or editable install): its HEAD
    monkeypatch.setattr(origin, "__file__", _repo(tmp_path / "own", "moe_fp4"))
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path / "own", capture_output=True,
                          text=True, check=True).stdout.strip()
    assert origin.commit() == head
    # another project's repository holding a copy of the package: not its commit
    monkeypatch.setattr(origin, "__file__", _repo(tmp_path / "other", "other-project"))
    assert origin.commit() is None
    # a non-editable install in a virtual environment inside another repository (with a HEAD)
    app = tmp_path / "app"
    _repo(app, "app")
    site = app / ".venv" / "lib" / "site-packages"
    shutil.copytree(app / "moe_fp4", site / "moe_fp4")
    monkeypatch.setattr(origin, "__file__", str(site / "moe_fp4" / "compare" / "origin.py"))
    assert origin.commit() is None
    # recorded when built or copied without git history
    monkeypatch.setenv("MOE_FP4_COMMIT", "abc1234")
    assert origin.commit() == "abc1234"


def test_provenance_without_a_commit():
    from moe_fp4.compare.origin import provenance

    assert provenance({"version": "0.1.0", "commit": None}) == "moe_fp4 0.1.0"
    assert provenance({"version": "0.1.0", "commit": "abc1234"}) == "moe_fp4 0.1.0, commit abc1234"


# ---------------------------------------------------------------------------------------------------
# After the run: the default output directory was not in .gitignore.

@pytest.mark.skipif(shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")),
                    reason="needs git and a checkout")
def test_default_out_dir_is_ignored_by_git():
    from moe_fp4.compare.cli import DEFAULT_OUT

    check = subprocess.run(["git", "check-ignore", "-q", f"{DEFAULT_OUT}/compare.json"], cwd=ROOT, check=False)
    assert check.returncode == 0, f"{DEFAULT_OUT}/ is not in .gitignore"
