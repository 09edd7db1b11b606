"""bench/moe_layer.py times its precisions in rotated rounds: each precision must take every position
in the order equally often, get all of its timed steps, and a step after every switch that is not timed
(bench/RESULTS.md, ninth session: timed one after the other, the later precision paid for the process's
drift). Checked on the scheduling alone, with the layer's step and timer replaced by recorders."""

import importlib.util
from pathlib import Path

import pytest

_SPEC = importlib.util.spec_from_file_location(
    "_bench_moe_layer", Path(__file__).resolve().parents[1] / "bench" / "moe_layer.py")
moe_layer = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(moe_layer)


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
    # Round r starts at precision r mod n: over n rounds each precision holds each position once.
    rounds_order = [order[i:i + len(precisions)] for i in range(0, len(order), len(precisions))]
    for r, o in enumerate(rounds_order):
        k = r % len(precisions)
        assert o == precisions[k:] + precisions[:k]
    full = rounds // len(precisions) * len(precisions)
    for pos in range(len(precisions)):
        held = [o[pos] for o in rounds_order[:full]]
        assert all(held.count(p) == full // len(precisions) for p in precisions)


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
