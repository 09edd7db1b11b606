"""FSDP2 (fully_shard) of the MoE layer with its expert weights all-gathered in FP8 (moe_fp4.model.fsdp): the bytes
each all-gather sends (counted at FSDP's all-gather call), and the outputs and gradients against the unsharded
layer, bit for bit, on 2 and 4 gloo ranks, with reshard_after_forward on and off and with gradient accumulation
(two backward passes before the optimizer step), then one AdamW step on the sharded parameters and a forward of the
stepped weights.

Every rank feeds the same rows, so FSDP's averaged reduce-scatter of identical gradients over 2 or 4 ranks is exact
and the sharded gradients equal the unsharded layer's bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from distributed import run_ranks

# MoEConfig(hidden=128, ffn=128, num_experts=4, top_k=2, shared_ffn=128), made in each rank: moe_fp4 is imported
# there, after tests/distributed.py turns the interpreter off (the ranks run the pure-torch references).
CONFIG = dict(hidden=128, ffn=128, num_experts=4, top_k=2, shared_ffn=128)


def _gathered_bytes(log):
    """Patches FSDP2's default all-gather to record each call's input bytes (what this rank sends)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as coll

    real = coll.DefaultAllGather.__call__

    def counted(self, output_tensor, input_tensor, group, async_op=False):
        log.append(input_tensor.numel() * input_tensor.element_size())
        return real(self, output_tensor, input_tensor, group, async_op)

    coll.DefaultAllGather.__call__ = counted


def _run(rank, world, precision, reshard, micro):
    """-> for each all-gather kind (FP8 through fp8_all_gather, and FSDP's own), whether every output and
    gradient equals the unsharded layer's, and the bytes this rank's all-gathers sent."""
    from torch.distributed.fsdp import fully_shard

    from moe_fp4.model.fsdp import fp8_all_gather
    from moe_fp4.model.moe import MoE, MoEConfig

    config = MoEConfig(**CONFIG)
    torch.manual_seed(0)
    ref = MoE(config, precision)
    xs = [torch.randn(40, config.hidden, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(10 + i))
          for i in range(micro)]
    dys = [torch.randn(40, config.hidden, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(20 + i))
           for i in range(micro)]
    ref_out = []
    for x, dy in zip(xs, dys):
        xr = x.clone().requires_grad_()
        y = ref(xr)
        y.backward(dy)
        ref_out.append((y, xr.grad))
    # then one AdamW step and a forward of the stepped weights: training continues identically
    x_next = torch.randn(40, config.hidden, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(30))
    ref_grads = {name: p.grad.clone() for name, p in ref.named_parameters()}
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    torch.optim.AdamW(ref.parameters(), lr=1e-2, foreach=False).step()
    with torch.no_grad():
        y_next = ref(x_next)
    sent = []
    _gathered_bytes(sent)
    out = {"params": {name: tuple(p.shape) for name, p in ref.named_parameters()}}
    for kind in ("fp8", "native"):
        sharded = MoE(config, precision)
        sharded.load_state_dict(start)
        names = fp8_all_gather(sharded) if kind == "fp8" else []
        fully_shard(sharded, reshard_after_forward=reshard)
        sent.clear()
        same = []
        for (x, dy), (y_ref, dx_ref) in zip(zip(xs, dys), ref_out):
            xs_ = x.clone().requires_grad_()
            y = sharded(xs_)
            y.backward(dy)          # gradients accumulate over the micro-batches, as in the reference
            same.append(torch.equal(y, y_ref) and torch.equal(xs_.grad, dx_ref) and not y.isnan().any().item())
        grads = {name: torch.equal(ref_grads[name], q.grad.full_tensor()) for name, q in sharded.named_parameters()}
        n_sent = sum(sent)
        torch.optim.AdamW(sharded.parameters(), lr=1e-2, foreach=False).step()
        with torch.no_grad():
            stepped = torch.equal(sharded(x_next), y_next)
        out[kind] = {"names": names, "same": same, "grads": grads, "sent": n_sent, "stepped": stepped}
    return out


def _bytes_per_gather(shapes, world, fp8_names):
    """What one rank sends per all-gather of the layer: each parameter's shard padded to ceil(dim0 / world) rows
    (FSDP's even shards); the FP8-gathered ones as 1-byte codes and a float32 scale per 128x128 block, the
    others in bf16."""
    total = {}
    for name, shape in shapes.items():
        rows = -(-shape[0] // world)
        rest = 1
        for d in shape[1:]:
            rest *= d
        if name in fp8_names:
            total[name] = rows * rest + rows * (shape[1] // 128) * (shape[2] // 128) * 4
        else:
            total[name] = rows * rest * 2
    return total


@pytest.mark.parametrize("world,reshard,micro,precision", [(2, False, 2, "fp4"), (4, True, 2, "fp8")])
def test_fp8_all_gather_sends_half_the_bytes_and_keeps_the_bits(world, reshard, micro, precision):
    for rank, r in enumerate(run_ranks(_run, world, precision, reshard, micro)):
        a, b = r["fp8"], r["native"]
        assert sorted(a["names"]) == ["shared_w13", "shared_w2", "w13", "w2"], a["names"]
        for kind in (a, b):
            assert all(kind["same"]) and all(kind["grads"].values()) and kind["stepped"], (rank, kind)
        # The bf16 run's bytes give the number of all-gathers (forward, and backward when resharded). The routed
        # experts (4, divisible by the ranks) go as FP8; the shared expert (1: not whole experts per rank) in bf16.
        bf16_bytes = _bytes_per_gather(r["params"], world, ())
        fp8_bytes = _bytes_per_gather(r["params"], world, ("w13", "w2"))
        gathers = b["sent"] / sum(bf16_bytes.values())
        assert gathers == (2 * micro if reshard else micro), gathers
        assert a["sent"] == gathers * sum(fp8_bytes.values()), (a["sent"], fp8_bytes)
        ratio = (fp8_bytes["w13"] + fp8_bytes["w2"]) / (bf16_bytes["w13"] + bf16_bytes["w2"])
        assert ratio == pytest.approx((1 + 4 / 128 ** 2) / 2, rel=1e-9) and ratio <= 0.51, ratio


def test_gathered_weight_gives_its_codes_and_refuses_reading_values():
    import moe_fp4
    from moe_fp4.gemm.engines import FP8_WEIGHTS, quantize_fp8_weight
    from moe_fp4.gemm.fsdp import GatheredFP8Weight
    from moe_fp4.model.fsdp import fp8_all_gather
    from moe_fp4.model.moe import MoE, MoEConfig

    w = torch.randn(2, 128, 256, dtype=torch.bfloat16)
    q = quantize_fp8_weight(w)
    g = torch.nn.Parameter(GatheredFP8Weight(q.data, q.scale, torch.bfloat16), requires_grad=True)
    assert g.shape == w.shape and g.dtype == torch.bfloat16
    got = FP8_WEIGHTS.weight(g)
    assert got.data is q.data and got.scale is q.scale and g not in FP8_WEIGHTS     # no copy, nothing cached
    with pytest.raises(NotImplementedError, match="all-gathered by FSDP2 in FP8"):
        g.float()
    layer = MoE(MoEConfig(**CONFIG), "fp8")
    assert fp8_all_gather(MoE(MoEConfig(**CONFIG), "bf16")) == []                   # bf16 GEMMs read bf16
    with pytest.raises(RuntimeError, match="pinned"):
        fp8_all_gather(layer.pin_fp8_weights())
    del moe_fp4


def _checkpoints(rank, world, path):
    """After one training step of the FP8-gathered sharded layer: its full state dict (plain tensors, the masters'
    dtype, nothing FP8) loads into an unsharded layer; a DCP checkpoint of its shards loads into a fresh sharded
    one; a plain unsharded checkpoint loads into a sharded FP8-gathered one. Each continues with the unsharded
    reference's forward, bit for bit."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, set_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from moe_fp4.model.fsdp import fp8_all_gather
    from moe_fp4.model.moe import MoE, MoEConfig

    config = MoEConfig(**CONFIG)

    def sharded_layer(state=None):
        m = MoE(config, "fp8")
        if state is not None:
            m.load_state_dict(state)
        fp8_all_gather(m)
        fully_shard(m)
        return m

    torch.manual_seed(0)
    ref = MoE(config, "fp8")
    start = {k: v.clone() for k, v in ref.state_dict().items()}
    model = sharded_layer(start)
    x, dy = (torch.randn(40, config.hidden, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(s))
             for s in (1, 2))
    for m in (ref, model):
        m(x).backward(dy)
        torch.optim.AdamW(m.parameters(), lr=1e-2, foreach=False).step()
    with torch.no_grad():
        want = ref(x)
    out = {}
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    out["plain"] = all(type(v) is torch.Tensor and v.dtype == ref.state_dict()[k].dtype for k, v in full.items())
    out["same_keys"] = sorted(full) == sorted(ref.state_dict())
    out["full_equals_ref"] = all(torch.equal(v, ref.state_dict()[k]) for k, v in full.items())
    unsharded = MoE(config, "fp8")
    unsharded.load_state_dict(full)
    with torch.no_grad():
        out["unsharded_continues"] = torch.equal(unsharded(x), want)
    dcp.save(get_model_state_dict(model), checkpoint_id=path)
    fresh = sharded_layer()
    state = get_model_state_dict(fresh)
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(fresh, state)
    with torch.no_grad():
        out["dcp_continues"] = torch.equal(fresh(x), want)
    other = sharded_layer()
    set_model_state_dict(other, ref.state_dict(), options=StateDictOptions(full_state_dict=True))
    with torch.no_grad():
        out["plain_into_sharded"] = torch.equal(other(x), want)
    return out


def test_checkpoints_of_the_fp8_gathered_layer_hold_plain_weights_and_round_trip(tmp_path):
    for rank, r in enumerate(run_ranks(_checkpoints, 2, str(tmp_path / "dcp"))):
        assert all(r.values()), (rank, r)
