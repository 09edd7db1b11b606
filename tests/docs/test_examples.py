"""The examples run as the README says (ep_swap_all_to_all under torchrun, 2 CPU ranks on gloo here), and the
ones written for torchrun also run without it, as one process that says so."""

import math
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# examples/ep_swap_all_to_all.py: MXFP4 dispatch + combine against bf16, measured 14.7-16.9 dB on 2
# ranks and 14.8-16.8 dB on 1 (output, input grad, expert grad); 1 dB under the lowest. With the
# combine in bf16 (the example since issue 28) the values only rise; the floor stays.
SWAP_EXAMPLE_FLOOR_DB = 13.7


def test_ep_swap_all_to_all_example():
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "ep_swap_all_to_all.py")]
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"example timed out: {e.stdout} {e.stderr}")
    assert run.returncode == 0, run.stdout + run.stderr
    found = re.findall(r"rank (\d) +([a-z ]+): SQNR +([\d.]+) dB", run.stdout)
    assert len(found) == 6, run.stdout
    for rank, name, db in found:
        assert float(db) >= SWAP_EXAMPLE_FLOOR_DB, (rank, name, db)
    # Each rank says what it sent: the dispatch in MXFP4 (136 B a 256-value row: 128 B of codes, 8 scales),
    # everything else in bf16.
    sent = re.findall(r"rank (\d) sent: (.*)", run.stdout)
    assert len(sent) == 2, run.stdout
    for _, line in sent:
        parts = dict(re.findall(r"(\w+ \w+ \w+) (\d+) B", line))
        assert set(parts) == {"dispatch forward mxfp4", "dispatch gradient bf16", "combine forward bf16",
                              "combine gradient bf16"}, line
        assert int(parts["dispatch forward mxfp4"]) % 136 == 0 and int(parts["combine forward bf16"]) % 512 == 0
    assert "RuntimeWarning" not in run.stderr, run.stderr


# What torchrun sets; the examples run without it as one process and say so.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID")


def _env_without_torchrun() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS}
    return dict(env, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")


def test_ep_swap_all_to_all_example_without_torchrun():
    """`python examples/ep_swap_all_to_all.py`: one process (gloo, world size 1), one line saying so, no traceback."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "ep_swap_all_to_all.py")],
                         env=_env_without_torchrun(), capture_output=True, text=True, timeout=120, cwd=ROOT,
                         check=False)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "Traceback" not in out, out
    assert re.search(r"^not launched by torchrun: one process \((gloo|nccl), world size 1\); for 2 ranks: "
                     r"torchrun --nproc-per-node 2 examples/ep_swap_all_to_all.py$", run.stdout, re.MULTILINE), out
    assert re.search(r"^1 rank on (cpu|cuda): ", run.stdout, re.MULTILINE), out
    found = re.findall(r"rank 0 +([a-z ]+): SQNR +([\d.]+) dB", run.stdout)
    assert len(found) == 3, run.stdout
    for name, db in found:
        assert float(db) >= SWAP_EXAMPLE_FLOOR_DB, (name, db)


# examples/hf_register_hooks.py at its default size on CPU (qwen3_moe, hidden 128, 2 layers, 4 experts top-2,
# 2 x 128 tokens). MXFP4 stores 4.25 bits per bf16 element: measured 1572864 -> 417792 bytes, 0.266x.
HF_HOOK_MAX_RATIO = 0.27
# Gradient SQNR with the hook vs without, measured 16.0 (expert weights), 30.3 (attention weights) and 28.0 dB
# (all); 16.0-16.6, 26.2-36.4, 24.2-33.8 dB over other sizes. Floors 1.5 dB under the default-size values.
HF_HOOK_GRAD_FLOOR_DB = {"expert weights": 14.5, "attention weights": 28.8, "all": 26.5}


def test_hf_register_hooks_example():
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, os.path.join(ROOT, "examples", "hf_register_hooks.py"), "--device", "cpu"]
    try:
        run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=ROOT, check=False)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"example timed out: {e.stdout} {e.stderr}")
    out = run.stdout
    assert run.returncode == 0, out + run.stderr

    assert re.search(r"^hooked (\d+) expert modules", out, re.MULTILINE).group(1) == "2", out
    before, after = map(int, re.search(r"saved for backward: (\d+) bytes bf16 -> (\d+) bytes MXFP4", out).groups())
    assert 0 < after < before * HF_HOOK_MAX_RATIO, (before, after)
    assert int(re.search(r"^memory saved: (\d+) bytes", out, re.MULTILINE).group(1)) == before - after, out

    sqnr = {g: float(db) for g, db in re.findall(r"^gradient SQNR ([a-z ]+): ([\d.]+|inf) dB", out, re.MULTILINE)}
    assert sqnr.keys() == HF_HOOK_GRAD_FLOOR_DB.keys(), out
    for group, floor in HF_HOOK_GRAD_FLOOR_DB.items():
        assert floor <= sqnr[group] < math.inf, (group, sqnr[group])

    ref_loss, hook_loss = map(float, re.search(r"loss without hook (\S+), with hook (\S+)", out).groups())
    assert math.isfinite(ref_loss) and hook_loss == ref_loss, out  # the hook changes backward only
    train = [float(v) for v in re.findall(r"^train step \d+ loss (\S+)", out, re.MULTILINE)]
    assert len(train) == 3 and all(map(math.isfinite, train)) and train[-1] < train[0], train
    assert "after handle.remove(): loss and gradients bit-identical to the unhooked step" in out, out


def test_throughput_vs_fp8_example():
    """examples/throughput_vs_fp8.py at its CPU size without torchrun: one process, one line saying so, both
    modes train, fp4 keeps less for backward."""
    run = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "throughput_vs_fp8.py")],
                         env=_env_without_torchrun(), capture_output=True, text=True, timeout=180, cwd=ROOT,
                         check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stdout + run.stderr, run.stdout + run.stderr
    assert re.search(r"^not launched by torchrun: one process on (cpu|cuda) \(world size 1, no expert parallelism\); "
                     r"for EP over 2 ranks: torchrun --nproc-per-node 2 examples/throughput_vs_fp8.py$",
                     run.stdout, re.MULTILINE), run.stdout
    m = re.search(r"fp4 vs fp8: tokens/s ([\d.]+)x, activation memory (-?[\d.]+)% lower, "
                  r"held-out loss ([\d.]+) vs ([\d.]+)", run.stdout)
    assert m, run.stdout
    assert float(m.group(2)) > 0, run.stdout
    assert all(math.isfinite(float(m.group(i))) for i in (3, 4)), run.stdout


# examples/torchao_fp8_plus_mxfp4.py on 2 CPU ranks (no sm90 GPU: the experts stay bf16, so this checks
# moe_fp4's hook and swap composed with the EP block; the GPU run with torchao's FP8 is in
# bench/RESULTS.md). Gradient SQNR against the plain block, measured (both ranks): + hook 16.2-16.3 dB,
# + hook + MXFP4 dispatch 12.5 dB; the floors 1 dB under.
TORCHAO_EXAMPLE_FLOOR_DB = {"torchao + hook": 15.2, "torchao + hook + mxfp4 dispatch": 11.5}


def test_torchao_fp8_plus_mxfp4_example():
    env = dict(os.environ, TRITON_INTERPRET="0", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           os.path.join(ROOT, "examples", "torchao_fp8_plus_mxfp4.py")]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert run.returncode == 0, run.stdout + run.stderr
    assert re.search(r"^2 ranks on cpu: experts in bf16 \(torchao's FP8 grouped GEMM needs an sm90 GPU\)$",
                     run.stdout, re.MULTILINE), run.stdout
    lines = re.findall(r"^  rank (\d) +(torchao[a-z0-9 +]*): loss ([\d.]+)(.*)$", run.stdout, re.MULTILINE)
    assert sorted((int(r), v) for r, v, _, _ in lines) == sorted(
        (r, v) for r in (0, 1) for v in ("torchao", "torchao + hook", "torchao + hook + mxfp4 dispatch")), run.stdout
    losses = {(int(r), v): float(loss) for r, v, loss, _ in lines}
    for rank, variant, _, rest in lines:
        if variant == "torchao":
            assert rest == "", rest
            continue
        db = float(re.search(r"gradients SQNR >= ([\d.]+) dB", rest).group(1))
        assert db >= TORCHAO_EXAMPLE_FLOOR_DB[variant], (rank, variant, db)
        n, before, after = map(int, re.search(r"hook: (\d+) tensors compressed, (\d+) -> (\d+) B", rest).groups())
        assert n > 0 and 0 < after < before / 3, (rank, variant, rest)   # MXFP4: 4.25 of 16 bits, plus padding
        if variant == "torchao + hook":
            # the hook changes only what backward reads: the forward is the same
            assert losses[(int(rank), variant)] == losses[(int(rank), "torchao")]
        else:
            sent = dict(re.findall(r"(\w+ \w+ \w+) (\d+) B", rest.split("sent ")[1]))
            assert set(sent) == {"dispatch forward mxfp4", "combine forward bf16", "combine gradient bf16",
                                 "dispatch gradient bf16"}, rest
            assert int(sent["dispatch forward mxfp4"]) == 256 * 2 * 136   # tokens x top-k rows of 136 B
