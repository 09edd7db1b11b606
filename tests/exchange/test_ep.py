"""The expert-parallel MoE layer on gloo (spawned CPU processes), world sizes 2, 4 and 8.

Each rank holds its own tokens (uneven counts, one rank with none) and E/world experts. Every rank
also builds the same layer without EP holding all E experts and runs it on ALL ranks' tokens, so
the EP layer's output and input gradient on rank r compare with the reference's rows of rank r,
its expert-weight gradients with the reference's slice for rank r's experts, and the router
gradient summed over ranks with the reference's.

The reference for fp4 runs on the MXFP4 round trip of the tokens: fp4 dispatches MXFP4 and converts
it to FP8 directly (exactly the dequantized values), so the two agree up to accumulation order.
What differs everywhere: the EP combine applies the router weights in float32 on the experts' rank
(the reference's unpermute multiplies by bf16-rounded weights), and FP8 re-quantization of the
output gradients turns those last-bit differences into occasional code flips.
"""

import math

import pytest
import torch

from distributed import run_ranks

CONFIG = dict(hidden=256, ffn=128, num_experts=4, top_k=2)
# Tokens per rank: one rank with none at every width (two at world 8, one expert per rank, E = 8).
TOKENS = {2: [40, 0], 4: [24, 0, 40, 8], 8: [24, 0, 40, 8, 8, 16, 0, 32]}


def config(world: int) -> dict:
    """CONFIG with E a multiple of the world (E = 8 at world 8)."""
    return {**CONFIG, "num_experts": max(CONFIG["num_experts"], world)}


# SQNR floors (dB) of the EP layer against the same layer without EP, 1 dB under the lowest value
# measured on any rank at world 2 and 4: bf16 out 49.42, dx 44.38, w13 45.38, w2 45.73, router 44.39;
# fp8 out 49.30, dx 33.26, w13 32.47, w2 36.78, router 44.97; fp4 out 49.45, dx 33.44, w13 29.47,
# w2 34.77, router 43.78.
EP_MATCH_FLOOR_DB = {
    "bf16": {"out": 48.4, "dx": 43.3, "w13": 44.3, "w2": 44.7, "router": 43.3},
    "fp8": {"out": 48.3, "dx": 32.2, "w13": 31.4, "w2": 35.7, "router": 43.9},
    "fp4": {"out": 48.4, "dx": 32.4, "w13": 28.4, "w2": 33.7, "router": 42.7},
}
# At world 8 (E = 8, one expert per rank; 2026-11-23, CPU) out, dx, w13 and w2 are bit-identical on
# every rank (SQNR inf) in all three precisions; the summed router gradient is at 48.25 dB at the lowest.
# Quantized combine and gradient exchanges (combine mxfp4, dispatch_grad fp8, combine_grad mxfp4)
# against the bf16 defaults, fp8 layer: measured out 18.54, dx 23.04 dB at the lowest at world 2 and 4;
# floors 1 dB under. At world 8 the lowest are out 18.30, dx 23.15 (every rank).
QUANTIZED_COMM_FLOOR_DB = {"out": 17.5, "dx": 22.0}


def _layers(rank, world, precision, ep_kwargs=None, device="cpu"):
    from moe_fp4.exchange.ep import EPConfig
    from moe_fp4.model.moe import MoE, MoEConfig

    cfg = MoEConfig(**config(world))
    torch.manual_seed(0)
    ref = MoE(cfg, precision, device=device)
    m = MoE(cfg, precision, device=device, ep=EPConfig(**(ep_kwargs or {})))
    el = m.num_local_experts
    with torch.no_grad():
        m.router.weight.copy_(ref.router.weight)
        m.w13.copy_(ref.w13[rank * el:(rank + 1) * el])
        m.w2.copy_(ref.w2[rank * el:(rank + 1) * el])
    return ref, m, el


def _tokens(world, precision, device="cpu"):
    import moe_fp4

    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(t, CONFIG["hidden"], generator=g).to(torch.bfloat16).to(device) for t in TOKENS[world]]
    if precision == "fp4":
        xs = [moe_fp4.quantize_mxfp4(x).dequantize() for x in xs]
    return xs


def _step(layer, x):
    x = x.clone().requires_grad_()
    y = layer(x)
    y.float().square().sum().backward()
    return y.detach(), x.grad


def _reference(ref, xs):
    """The layer without EP on all ranks' tokens -> (output, input gradient, w13, w2 and router gradients).
    Every rank would compute the same tensors (same seeds and tokens): rank 0 computes them once and
    broadcasts them, so world 8 does not run the reference 8 times over on the 2-core CI machine."""
    import torch.distributed as dist

    got = [None]
    if dist.get_rank() == 0:
        y, dx = _step(ref, torch.cat(xs))
        got = [tuple(t.cpu() for t in (y, dx, ref.w13.grad, ref.w2.grad, ref.router.weight.grad))]
    dist.broadcast_object_list(got, src=0)   # as CPU tensors: a pickled CUDA tensor would land on rank 0's GPU
    return tuple(t.to(xs[0].device) for t in got[0])


def _compare(rank, world, precision, ep_kwargs=None, device="cpu"):
    import torch.distributed as dist

    from moe_fp4.formats.metrics import sqnr_db

    ref, m, el = _layers(rank, world, precision, ep_kwargs, device)
    xs = _tokens(world, precision, device)
    off, t = sum(TOKENS[world][:rank]), TOKENS[world][rank]
    y_ref, dx_ref, w13_ref, w2_ref, router_ref = _reference(ref, xs)
    y, dx = _step(m, xs[rank])
    router = m.router.weight.grad.clone()
    dist.all_reduce(router)
    experts = slice(rank * el, (rank + 1) * el)

    def db(a, b):
        return sqnr_db(a.float(), b.float()) if a.numel() else float("inf")

    return {"out": db(y_ref[off:off + t], y), "dx": db(dx_ref[off:off + t], dx),
            "w13": db(w13_ref[experts], m.w13.grad), "w2": db(w2_ref[experts], m.w2.grad),
            "router": db(router_ref, router), "shape": tuple(y.shape)}


def _against_default_wire(rank, world, formats, token_scale=1.0):
    """The fp8 layer with the wire ``formats`` against the same layer with the default wire (fp8
    dispatch, bf16 otherwise), on this rank's tokens times ``token_scale`` -> output and input-gradient
    SQNR in dB (inf for a rank without tokens)."""
    from moe_fp4.formats.metrics import sqnr_db

    _, m_q, _ = _layers(rank, world, "fp8", formats)
    _, m_b, _ = _layers(rank, world, "fp8")
    x = _tokens(world, "fp8")[rank] * token_scale
    yq, dxq = _step(m_q, x)
    yb, dxb = _step(m_b, x)
    if not x.shape[0]:
        return {"out": float("inf"), "dx": float("inf")}
    return {"out": sqnr_db(yb.float(), yq.float()), "dx": sqnr_db(dxb.float(), dxq.float())}


def _quantized_comm(rank, world):
    """Quantized combine / gradient exchanges against the bf16 defaults."""
    return _against_default_wire(rank, world, dict(combine="mxfp4", dispatch_grad="fp8", combine_grad="mxfp4"))


def _plan(rank, world):
    """plan_dispatch: each token goes once to each distinct rank among its experts' ranks."""
    from moe_fp4.exchange.ep import plan_dispatch

    num_experts, k = 8, 3
    g = torch.Generator().manual_seed(10 + rank)
    t = 5 + 3 * rank
    experts = torch.stack([torch.randperm(num_experts, generator=g)[:k] for _ in range(t)])
    plan = plan_dispatch(experts, num_experts, None)
    el = num_experts // world
    dest = [sorted({int(e) // el for e in row}) for row in experts]
    want_splits = tuple(sum(d in row for row in dest) for d in range(world))
    want_tokens = [i for d in range(world) for i, row in enumerate(dest) if d in row]
    return {"send": plan.send_splits == want_splits, "order": plan.src_token.tolist() == want_tokens,
            "recv": plan.recv_splits, "sent": want_splits, "local_counts": plan.local_counts,
            "pairs": [int(((experts // el) == d).sum()) for d in range(world)],
            "pair_counts": [int((experts == e).sum()) for e in range(num_experts)]}


def _nvfp4_dispatch(rank, world):
    """An NVFP4 dispatch (rows converted to FP8 on arrival, each with its sender's tensor scale) against
    the fp8 dispatch; each rank's tokens 10x the previous rank's, so a row decoded with another sender's
    tensor scale would be off by powers of ten."""
    return _against_default_wire(rank, world, dict(dispatch="nvfp4"), token_scale=10.0 ** rank)


def _auto_rule(rank, world):
    """Gradient wires on "auto" (the sqrt(3) rule): this rank's own sums of the sent gradients' squares
    and of their noise's, and the ratio every rank computes from the group's sums."""
    from moe_fp4.model.moe import end_grad_wire_step

    _, m, _ = _layers(rank, world, "fp8", dict(dispatch_grad="auto", combine_grad="auto"))
    _step(m, _tokens(world, "fp8")[rank])
    local = {g: r.sums.tolist() for g, r in m.grad_rules.items()}
    ratios = end_grad_wire_step(m)[""]
    return {"local": local, "ratio": ratios}


def _ep_case(rank, world):
    torch.set_num_threads(1)   # up to 8 ranks share the CI machine's 2 cores
    out = {p: _compare(rank, world, p) for p in ("bf16", "fp8", "fp4")}
    out["quantized_comm"] = _quantized_comm(rank, world)
    out["auto"] = _auto_rule(rank, world)
    out["nvfp4_dispatch"] = _nvfp4_dispatch(rank, world)
    out["plan"] = _plan(rank, world)
    return out


@pytest.fixture(scope="module", params=[2, 4, 8], ids=lambda w: f"world{w}")
def ep_results(request):
    world = request.param
    return world, run_ranks(_ep_case, world)


@pytest.mark.parametrize("precision", ["bf16", "fp8", "fp4"])
def test_ep_layer_matches_layer_without_ep(ep_results, precision):
    world, results = ep_results
    for rank, res in enumerate(results):
        got = res[precision]
        assert got["shape"] == (TOKENS[world][rank], CONFIG["hidden"])
        for name, floor in EP_MATCH_FLOOR_DB[precision].items():
            assert got[name] >= floor, (rank, name, got[name])


def test_ep_quantized_combine_and_gradients(ep_results):
    world, results = ep_results
    for rank, res in enumerate(results):
        assert all(v == v for v in res["quantized_comm"].values()), (rank, res["quantized_comm"])
        for name, floor in QUANTIZED_COMM_FLOOR_DB.items():
            assert res["quantized_comm"][name] >= floor, (rank, name, res["quantized_comm"][name])


def test_dispatch_plan_sends_each_token_once_per_rank(ep_results):
    world, results = ep_results
    plans = [r["plan"] for r in results]
    num_local = 8 // world
    for rank, p in enumerate(plans):
        assert p["send"] and p["order"], rank
        # What rank d receives from s is what s sends d; its per-expert counts are the pairs for its experts.
        assert list(p["recv"]) == [plans[s]["sent"][rank] for s in range(world)]
        want = [sum(plans[s]["pair_counts"][rank * num_local + e] for s in range(world)) for e in range(num_local)]
        assert list(p["local_counts"]) == want
    # Fewer rows than (token, expert) pairs whenever two of a token's experts share a rank.
    assert sum(sum(p["sent"]) for p in plans) <= sum(sum(p["pairs"]) for p in plans)


# ---------------------------------------------------------------------------------------------
# Recomputation under expert parallelism (issue 30, moe_fp4.model.moe.Recompute; the single-process policies are
# in test_recompute.py): no exchange is repeated and the gradients are bit-identical to no recomputation.

def _ep_policies(rank, world):
    from moe_fp4.exchange import ep as ep_mod
    from moe_fp4.exchange.ep import EPConfig
    from moe_fp4.model.decoder import PRESETS, DecoderLM

    calls = {"n": 0}
    original = ep_mod.exchange_rows

    def counted(*a, **k):
        calls["n"] += 1
        return original(*a, **k)

    ep_mod.exchange_rows = counted
    cfg = PRESETS["tiny"]
    torch.manual_seed(100 + rank)   # each rank its own tokens: rows reveal where they came from
    ids = torch.randint(0, cfg.vocab, (2, cfg.seq))
    targets = torch.randint(0, cfg.vocab, (2, cfg.seq))
    out = {}
    for precision in ("bf16", "fp8", "fp4"):
        ref = None
        for policy in ("none", "moe", "layer"):
            model = DecoderLM(cfg, precision, ep=EPConfig(), seed=0, recompute=policy)
            calls["n"] = 0
            loss = model(ids, targets)
            fwd = calls["n"]
            loss.backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            ref = ref or (loss.item(), grads)
            # -> (exchanges in forward, in backward, loss equal to none's, parameters whose gradient differs)
            out[f"{precision} {policy}"] = (fwd, calls["n"] - fwd, loss.item() == ref[0],
                                            [n for n in grads if not torch.equal(grads[n], ref[1][n])])
    return out


def test_ep_recompute_repeats_no_exchange_and_matches():
    for rank, rank_out in enumerate(run_ranks(_ep_policies, 2)):
        for precision in ("bf16", "fp8", "fp4"):
            fwd0, bwd0, _, _ = rank_out[f"{precision} none"]
            assert fwd0 > 0 and bwd0 > 0
            for policy in ("moe", "layer"):
                fwd, bwd, same_loss, differ = rank_out[f"{precision} {policy}"]
                assert (fwd, bwd) == (fwd0, bwd0), (rank, precision, policy, (fwd, bwd), (fwd0, bwd0))
                assert same_loss and not differ, (rank, precision, policy, differ)


def test_ep_sqrt3_rule_decides_from_the_whole_group(ep_results):
    # Each rank measures its own sent rows; the ratio is sqrt(sum of signal / sum of noise) over the group,
    # the same on every rank, so every rank switches at the same step.
    world, results = ep_results
    for g in ("dispatch_grad", "combine_grad"):
        signal = sum(res["auto"]["local"][g][0] for res in results)
        noise = sum(res["auto"]["local"][g][1] for res in results)
        want = math.sqrt(signal / noise)
        for rank, res in enumerate(results):
            assert res["auto"]["ratio"][g] == pytest.approx(want, rel=1e-5), (g, rank)


def test_ep_nvfp4_dispatch_feeds_the_expert_gemms(ep_results):
    world, results = ep_results
    for rank, res in enumerate(results):
        for name, floor in NVFP4_DISPATCH_FLOOR_DB.items():
            assert res["nvfp4_dispatch"][name] >= floor, (rank, name, res["nvfp4_dispatch"])


# NVFP4 dispatch against the fp8 dispatch, fp8 layer (CPU, 2026-11-26): measured out 15.87-17.07 dB, dx
# 13.87-19.46 dB over every rank with tokens at worlds 2, 4 and 8. Floors 1 dB under the lowest. A row
# decoded with another sender's tensor scale would be off by at least 10x (SQNR below 0 dB).
NVFP4_DISPATCH_FLOOR_DB = {"out": 14.8, "dx": 12.8}
