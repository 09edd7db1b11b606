"""``experts_implementation="moe_fp4"`` composed with expert parallelism (``ep_implementation``) and FSDP2 on two
gloo CPU ranks (:mod:`moe_fp4.integrations.hf_experts` with :mod:`moe_fp4.integrations.hf`).

Nothing of moe_fp4 is imported at the top of this module: the ranks run_ranks spawns import it again, and
they must not load moe_fp4 before tests/distributed.py has chosen the pure-torch references for them."""

from __future__ import annotations

import os

import pytest
import torch
from optional_stacks import import_or_skip

import_or_skip("transformers.integrations.moe")
_ep_module = import_or_skip("transformers.distributed.expert_parallel")
if not hasattr(_ep_module, "EPImplementationInterface"):
    pytest.skip("this transformers has no EPImplementationInterface (pluggable expert parallelism)",
                allow_module_level=True)

E, VOCAB = 4, 128
MODEL = dict(vocab_size=VOCAB, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_experts_per_tok=2,
             max_position_embeddings=64, tie_word_embeddings=False, intermediate_size=128, moe_intermediate_size=128,
             num_experts=E, num_key_value_heads=2, head_dim=32)


def _model():
    import transformers

    import moe_fp4  # noqa: F401 - registers the experts implementations

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**MODEL), dtype=torch.float32,
                                                          experts_implementation="moe_fp4")
    return model.to(torch.bfloat16)


# experts_implementation="moe_fp4" under ep_implementation (two gloo ranks,
# FSDP2 over the dense weights, two of the four experts per rank), against the same model without EP on each
# rank's own batch. The EP implementation is moe_fp4's with every exchange unquantized, so what differs is the
# rows' grouping only: each expert's rows come from both ranks. The local expert shards' gradients are checked
# against the mean over ranks of the reference's (FSDP averages), the logits and loss per rank.
EP_WORLD, EP_NATIVE = 2, "moe_fp4_test_native_ep"
# Measured (CPU, 2026-11-28, both ranks): logits and loss bit-identical to the reference's (the experts work row
# by row in the forward, so the grouping does not change a value); local expert shards 52.5-52.9 dB (bf16
# gradients: the reference's two ranks rounded before their mean, the EP ones summed over both ranks' rows
# first). Floors: logits 80 dB, shards 51.5 dB; a wrong expert, a dropped slot or an unaveraged gradient would be
# off by far more.
EP_LOGITS_FLOOR_DB, EP_SHARD_FLOOR_DB, EP_LOSS_RTOL = 80.0, 51.5, 1e-6


def _composed_worker(rank, world):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor
    from transformers import DistributedConfig
    from transformers.modeling_utils import PreTrainedModel

    from moe_fp4.formats.metrics import sqnr_db
    from moe_fp4.integrations import hf

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    hf.register(EP_NATIVE, dispatch="native", combine="native", dispatch_grad="native", combine_grad="native")
    ids = torch.randint(0, VOCAB, (world, 2, 32), generator=torch.Generator().manual_seed(5))[rank]
    ref = _model()
    out = ref(ids, labels=ids)
    out.loss.backward()
    names = [n for n, _ in ref.named_parameters() if ".experts." in n]
    mean = {n: dict(ref.named_parameters())[n].grad.float().clone() for n in names}
    for g in mean.values():
        dist.all_reduce(g)
        g /= world
    model = _model()
    dc = DistributedConfig(fsdp_size=world, ep_size=world, ep_implementation=EP_NATIVE)
    dc, _, mesh_manager = PreTrainedModel.prepare_distribute_model(dc)
    model = type(model).maybe_distribute_model(model, dc, mesh_manager)
    got = model(ids, labels=ids)
    got.loss.backward()
    logits = got.logits.full_tensor() if isinstance(got.logits, DTensor) else got.logits
    row = {"logits_db": sqnr_db(out.logits.detach().float(), logits.detach().float()),
           "loss": (out.loss.item(), got.loss.item()), "shards": {}}
    ref_w = {n: p.detach() for n, p in ref.named_parameters()}
    for n, p in model.named_parameters():
        if n in mean and isinstance(p, DTensor):
            local = p.to_local().detach()
            idx = [next(e for e in range(ref_w[n].shape[0]) if torch.equal(ref_w[n][e], local[i]))
                   for i in range(local.shape[0])]
            row["shards"][n] = (idx, sqnr_db(mean[n][idx], p.grad.to_local().float()))
    return row


def test_composes_with_expert_parallelism():
    from distributed import run_ranks

    out = run_ranks(_composed_worker, EP_WORLD)
    for rank, row in enumerate(out):
        print(rank, row)
        ref_loss, loss = row["loss"]
        assert abs(loss - ref_loss) <= EP_LOSS_RTOL * abs(ref_loss), (rank, row)
        assert row["logits_db"] >= EP_LOGITS_FLOOR_DB, (rank, row)
        assert len(row["shards"]) == 4, row                          # 2 layers x gate_up_proj, down_proj
        for n, (idx, db) in row["shards"].items():
            assert len(idx) == E // EP_WORLD and db >= EP_SHARD_FLOOR_DB, (rank, n, idx, db)
    for n in out[0]["shards"]:
        assert sorted(out[0]["shards"][n][0] + out[1]["shards"][n][0]) == list(range(E)), n   # each expert once


def _fsdp_fp8_worker(rank, world, impl):
    """A Qwen3-MoE on moe_fp4's experts under FSDP2 (each decoder layer and the root fully_shard-ed), its expert
    weights all-gathered in FP8 (hf_experts.fp8_all_gather) -> whether loss and every gradient equal the
    unsharded model's, and what the experts read while unsharded."""
    import transformers
    from torch.distributed.fsdp import fully_shard

    import moe_fp4  # noqa: F401 - registers the experts implementations
    from moe_fp4.gemm.fsdp import GatheredFP8Weight
    from moe_fp4.integrations.hf_experts import fp8_all_gather

    torch.set_num_threads(1)

    def build():
        torch.manual_seed(0)
        m = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(**MODEL), dtype=torch.float32,
                                                          experts_implementation=impl)
        return m.to(torch.bfloat16)

    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(5))   # the same on every rank
    ref = build()
    want = ref(ids, labels=ids)
    want.loss.backward()
    model = build()
    names = fp8_all_gather(model)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    seen = []
    experts = model.model.layers[0].mlp.experts
    experts.register_forward_pre_hook(lambda m, _args: seen.append(type(m.gate_up_proj).__name__))
    got = model(ids, labels=ids)
    got.loss.backward()
    ref_p = dict(ref.named_parameters())
    grads = {n: torch.equal(ref_p[n].grad, p.grad.full_tensor()) for n, p in model.named_parameters()}
    return {"names": names, "loss": torch.equal(want.loss, got.loss), "grads": grads, "seen": seen,
            "gathered": GatheredFP8Weight.__name__}


@pytest.mark.parametrize("impl", ["moe_fp4_fp8", "moe_fp4"])
def test_fsdp2_gathers_the_experts_in_fp8_with_the_unsharded_bits(impl):
    from distributed import run_ranks

    for rank, r in enumerate(run_ranks(_fsdp_fp8_worker, 2, impl)):
        assert len(r["names"]) == 2 * MODEL["num_hidden_layers"], r["names"]
        assert r["seen"] == [r["gathered"]], r["seen"]
        assert r["loss"] and all(r["grads"].values()), (rank, {n: ok for n, ok in r["grads"].items() if not ok})
