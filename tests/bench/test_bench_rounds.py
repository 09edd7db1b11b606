"""The benchmarks time their variants in rotated rounds (bench/moe_layer.py the precisions,
bench/experts.py the experts, bench/gemm.py the picked engines beside cuBLAS): each variant must take
every position in the order equally often, get all of its timed runs, and an untimed run after every
switch (bench/RESULTS.md, 2026-11-26, 65beb0b: timed one after the other, the later variant paid for the
process's drift). Checked on the scheduling alone, with the steps and timers replaced by recorders."""

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
experts_bench = _load("experts")


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
    m, log = _Layer(), []
    opts = {p: f"opt-{p}" for p in precisions}

    def fake_step(layer, x, g, opt=None):
        log.append(("untimed", layer.precision, opt))

    def fake_time_steps(layer, x, g, n, device, opt=None):
        log.append(("timed", layer.precision, opt))
        return [float(len(log))] * n

    monkeypatch.setattr(moe_layer, "step", fake_step)
    monkeypatch.setattr(moe_layer, "time_steps", fake_time_steps)
    monkeypatch.setattr(moe_layer, "zero", lambda layer, x: None)
    out = moe_layer.time_interleaved(m, precisions, None, None, warmup=2, iters=iters, rounds=rounds,
                                     device=moe_layer.torch.device("cpu"), opts=opts)

    per_round = max(1, iters // rounds)
    assert list(out) == precisions
    for p in precisions:
        assert len(out[p]) == rounds and all(len(r) == per_round for r in out[p])
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
    calls = []

    def fake_timed(fn, warmup, n, back_to_back=False):
        calls.append((fn(), warmup, n, back_to_back))
        return float({"cublas": 2.0, "gluon": 1.0, "bf16": 3.0}[calls[-1][0]] + len(calls) * 1e-3)

    monkeypatch.setattr(gemm_bench, "timed", fake_timed)
    fns = {name: (lambda name=name: name) for name in ("cublas", "gluon", "bf16")}
    out = gemm_bench.interleaved_ms(fns, warmup=4, iters=iters, rounds=rounds, back_to_back=True)
    assert calls[:3] == [(n, 4, 1, True) for n in fns]          # each warmed up once, in the given order
    body = calls[3:]
    per_round = max(1, iters // rounds)
    assert all(w == 1 and n == per_round and b for _, w, n, b in body)   # one untimed call at each switch
    _check_rotation([c[0] for c in body], list(fns), rounds)
    assert body[0][0] == "cublas"
    assert list(out) == list(fns) and out["gluon"] < out["cublas"] < out["bf16"]


def test_experts_variants_rotate(monkeypatch):
    log = []
    monkeypatch.setattr(experts_bench.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(experts_bench, "step_times", lambda unit, n: (log.append(("timed", unit.name, n)) or [1.0] * n))

    class Unit:
        def __init__(self, name):
            self.name = name

        def __call__(self):
            log.append(("untimed", self.name))

    units = {n: Unit(n) for n in ("torch bf16", "moe_fp4 fp8", "moe_fp4 fp4")}
    out = experts_bench.interleaved(units, warmup=2, iters=20, rounds=6)
    assert log[:6] == [("untimed", n) for n in units for _ in range(2)]
    body = log[6:]
    assert all(a[0] == "untimed" and b == ("timed", a[1], 3) for a, b in zip(body[::2], body[1::2]))
    _check_rotation([b[1] for b in body[1::2]], list(units), 6)
    assert {n: len(t) for n, t in out.items()} == {n: 18 for n in units}
