"""torchtitan's model with moe_fp4's converter under FSDP2 (fully_shard per block and the root), the converted
experts' weights all-gathered in FP8 (``moe_fp4.integrations.torchtitan.fp8_all_gather``), on two gloo ranks: the
loss and every gradient equal the unsharded model's bit for bit (every rank feeds the same tokens).

Nothing of moe_fp4 is imported at the top of this module: the spawned ranks import it after tests/distributed.py
has turned the interpreter off for them."""

from __future__ import annotations

import pytest
import torch
from optional_stacks import import_or_skip

import_or_skip("torchtitan.models.qwen3", "torchtitan.models.common.moe")


def _worker(rank, world, precision):
    from test_torchtitan_experts import _convert, _tiny_qwen3
    from torch.distributed.fsdp import fully_shard

    from moe_fp4.gemm.fsdp import GatheredFP8Weight
    from moe_fp4.integrations.torchtitan import MoEFP4GroupedExperts, fp8_all_gather

    torch.set_num_threads(1)

    def build():
        torch.manual_seed(0)
        m = _convert(_tiny_qwen3(), precision=precision).build()
        m.init_weights()
        return m

    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(7))   # the same on every rank
    ref = build()
    want = torch.nn.functional.cross_entropy(ref(ids).flatten(0, 1).float(), ids.flatten())
    want.backward()
    model = build()
    model.load_state_dict(ref.state_dict())
    names = fp8_all_gather(model)
    for layer in model.layers.values():
        fully_shard(layer)
    fully_shard(model)
    seen = []
    real = MoEFP4GroupedExperts.engine_weights

    def engine_weights(self):   # what the experts read while FSDP holds them unsharded (moe_fp4's routing)
        seen.append(isinstance(self.w1_EFD, GatheredFP8Weight))
        return real(self)

    MoEFP4GroupedExperts.engine_weights = engine_weights
    got = torch.nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())
    got.backward()
    ref_p = dict(ref.named_parameters())
    grads = {n: torch.equal(ref_p[n].grad, p.grad.full_tensor()) for n, p in model.named_parameters()
             if p.grad is not None}
    return {"names": names, "loss": torch.equal(want, got), "grads": grads, "seen": seen}


@pytest.mark.parametrize("precision", ["fp8", "fp4"])
def test_converted_experts_gather_in_fp8_under_fsdp2_with_the_unsharded_bits(precision):
    from distributed import run_ranks

    for rank, r in enumerate(run_ranks(_worker, 2, precision)):
        assert len(r["names"]) == 3 * 2, r["names"]                      # w1, w2, w3 of both MoE layers
        assert r["seen"] == [True, True], r["seen"]
        assert r["loss"] and r["grads"] and all(r["grads"].values()), (rank, r)
