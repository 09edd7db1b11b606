"""The benchmarks time their variants in rotated rounds (bench/harness.py's ``interleaved``: bench/moe_layer.py
the precisions, bench/experts.py the experts, bench/gemm.py the picked engines beside cuBLAS): each variant
must take every position in the order equally often, get all of its timed runs, and an untimed run after
every switch (timed one after the other, the later variant would pay for the process's drift; bench/RESULTS.md).
Checked on the scheduling alone, with the steps and timers replaced by recorders."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    """bench/<name>.py as a private module; bench/'s own module names (gemm, ...) that it imports stay
    out of other tests' imports."""
    path, modules = list(sys.path), set(sys.modules)
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = path
        for extra in set(sys.modules) - modules:
            if not extra.startswith(("moe_fp4", "torch", "triton", "_bench_")) and (BENCH / f"{extra}.py").exists():
                sys.modules.pop(extra, None)
    return mod


moe_layer = _load("moe_layer")
gemm_bench = _load("gemm")
harness = _load("harness")


def _fake_timer(monkeypatch, bench, state: dict, value):
    """Replaces the CUDA-event timer and the synchronize of ``bench``'s own copy of bench/harness.py: the
    fake timer runs fn once with state["timed"] set and returns ``value(state)`` n times."""
    def fake_run_times(fn, n, *, back_to_back=False, before=None, device=None, **kw):
        state["timed"] = True
        state.setdefault("blocks", []).append((n, back_to_back))
        fn()
        state["timed"] = False
        return [value(state)] * n

    monkeypatch.setitem(bench.interleaved.__globals__, "run_times", fake_run_times)
    monkeypatch.setitem(bench.interleaved.__globals__, "sync", lambda device=None: None)


def _check_rotation(order: list[str], names: list[str], rounds: int) -> None:
    """order: the timed blocks' names in the order they ran -> round r starts at name r mod n, and over
    whole cycles of n rounds each name holds each position equally often."""
    per = [order[i:i + len(names)] for i in range(0, len(order), len(names))]
    assert len(per) == rounds
    for r, o in enumerate(per):
        k = r % len(names)
        assert o == names[k:] + names[:k]
    full = rounds // len(names) * len(names)
    for pos in range(len(names)):
        held = [o[pos] for o in per[:full]]
        assert all(held.count(n) == full // len(names) for n in names)


class _Layer:
    precision = None


@pytest.mark.parametrize("precisions,rounds,iters", [(["bf16", "fp8", "fp4"], 6, 12), (["fp8", "fp4"], 5, 20),
                                                     (["fp4"], 3, 2)])
def test_rounds_rotate_the_order_and_time_every_step(monkeypatch, precisions, rounds, iters):
    m, log, state = _Layer(), [], {"timed": False}
    opts = {p: f"opt-{p}" for p in precisions}

    def fake_step(layer, x, g, opt=None):
        log.append(("timed" if state["timed"] else "untimed", layer.precision, opt))

    monkeypatch.setattr(moe_layer, "step", fake_step)
    monkeypatch.setattr(moe_layer, "zero", lambda layer, x: None)
    _fake_timer(monkeypatch, moe_layer, state, lambda st: float(len(log)))
    out = moe_layer.time_interleaved(m, precisions, None, None, warmup=2, iters=iters, rounds=rounds,
                                     device=moe_layer.torch.device("cpu"), opts=opts)

    per_round = max(1, iters // rounds)
    assert list(out) == precisions
    for p in precisions:
        assert len(out[p]) == rounds and all(len(r) == per_round for r in out[p])
    assert all(n == per_round and not b2b for n, b2b in state["blocks"])   # each step from an idle GPU
    # Warm-up first (each precision its own), then per round: an untimed step right before each timed block,
    # with the precision's own optimizer every time.
    warm = log[:2 * len(precisions)]
    assert warm == [("untimed", p, opts[p]) for p in precisions for _ in range(2)]
    body = log[2 * len(precisions):]
    assert len(body) == 2 * rounds * len(precisions)
    order = []
    for (kind1, p1, o1), (kind2, p2, o2) in zip(body[::2], body[1::2]):
        assert (kind1, kind2) == ("untimed", "timed") and p1 == p2 and o1 == o2 == opts[p1]
        order.append(p1)
    _check_rotation(order, precisions, rounds)


def test_add_times_reports_all_rounds(monkeypatch):
    row = {"tokens": 100}
    monkeypatch.setattr(moe_layer, "gemm_flop", lambda m, t: 1e12)
    moe_layer.add_times(None, row, [[1.0, 3.0], [2.0, 5.0]])
    assert row["step_s_median"] == 2.5 and row["step_s_min"] == 1.0
    assert row["step_s_round_medians"] == [2.0, 3.5]
    assert row["tokens_per_s"] == 40.0 and row["gemm_tflops"] == 0.4


@pytest.mark.parametrize("argv", [["--rounds", "0"], ["--rounds", "-1"], ["--iters", "0"]])
def test_rounds_and_iters_must_be_positive(argv):
    with pytest.raises(SystemExit):
        moe_layer.parse_args(argv)


@pytest.mark.parametrize("rounds,iters", [(5, 20), (3, 2), (1, 7)])
def test_gemm_head_to_head_rotates_with_cublas_first(monkeypatch, rounds, iters):
    log, state = [], {"timed": False}
    speed = {"cublas": 2.0, "gluon": 1.0, "bf16": 3.0}

    def run(name):
        log.append(("timed" if state["timed"] else "untimed", name))

    _fake_timer(monkeypatch, gemm_bench, state, lambda st: speed[log[-1][1]] + len(log) * 1e-3)
    fns = {name: (lambda name=name: run(name)) for name in speed}
    out = gemm_bench.interleaved_ms(fns, warmup=4, iters=iters, rounds=rounds, back_to_back=True)
    assert log[:12] == [("untimed", n) for n in fns for _ in range(4)]     # each warmed up, in the given order
    body = log[12:]
    per_round = max(1, iters // rounds)
    assert all(a == ("untimed", b[1]) and b[0] == "timed" for a, b in zip(body[::2], body[1::2]))
    assert state["blocks"] == [(per_round, True)] * (rounds * len(fns))   # one untimed call at each switch
    _check_rotation([b[1] for b in body[1::2]], list(fns), rounds)
    assert body[0][1] == "cublas"
    assert list(out) == list(fns) and out["gluon"] < out["cublas"] < out["bf16"]


def test_interleaved_enters_each_turn_and_sets_up_each_run():
    """harness.interleaved on CPU (wall clock): enter(name) at each turn and before the warm-up, before()
    ahead of every run, timed or not; bench/experts.py calls it with neither."""
    log = []
    runs = {n: (lambda n=n: log.append(("run", n))) for n in ("torch bf16", "moe_fp4 fp8", "moe_fp4 fp4")}
    out = harness.interleaved(runs, warmup=2, iters=20, rounds=6, enter=lambda n: log.append(("enter", n)),
                              before=lambda: log.append(("before",)), device="cpu")
    assert {n: [len(r) for r in v] for n, v in out.items()} == {n: [3] * 6 for n in runs}
    assert all(t >= 0 for v in out.values() for r in v for t in r)
    warm = [e for n in runs for e in [("enter", n)] + [("before",), ("run", n)] * 2]
    assert log[:len(warm)] == warm
    turns, body = [], log[len(warm):]
    while body:
        (kind, name), rest = body[0], body[1:]
        assert kind == "enter" and rest[:8] == [("before",), ("run", name)] * 4   # 1 untimed + 3 timed
        turns.append(name)
        body = rest[8:]
    _check_rotation(turns, list(runs), 6)


def test_run_times_off_cuda_and_the_record():
    calls = []
    times = harness.run_times(lambda: calls.append("run"), 3, before=lambda: calls.append("before"), device="cpu")
    assert len(times) == 3 and all(t >= 0 for t in times) and calls == ["before", "run"] * 3
    rec = harness.run_record("cpu")
    assert {"device", "device_type", "torch", "triton", "moe_fp4", "commit", "argv", "date"} <= set(rec)
    assert rec["device_type"] == "cpu" and rec["device"].startswith("cpu")
