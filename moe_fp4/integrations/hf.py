"""Hugging Face transformers (5.x) expert parallelism with MXFP4 dispatch.

Importing this module registers two expert-parallel implementations with transformers'
``EPImplementationInterface``:

| name          | dispatch (forward) | combine, and both gradients |
| ------------- | ------------------ | --------------------------- |
| ``"moe_fp4"`` | MXFP4              | bf16                        |
| ``"moe_fp4_fp8"`` | FP8 1x128      | bf16                        |

so a model built with ``DistributedConfig(..., ep_size=N, ep_implementation="moe_fp4")`` sends its
tokens to the experts' ranks in MXFP4 (:mod:`moe_fp4.exchange.ep`: one count exchange and one host sync per
layer, each token quantized once and sent at most once per destination rank with its router
weights). The experts run the model's own ``experts_forward`` on the dequantized rows, so any HF
experts module works, and :func:`moe_fp4.register_activation_compression` composes with it (it
compresses what those experts save). ``register(name, ...)`` adds other format choices. Import it
(and so register) on every rank before the model is built.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.tensor import DTensor, Replicate, Shard
from transformers.distributed.expert_parallel import EPImplementation, EPImplementationInterface

from moe_fp4.exchange.a2a import check_value_formats, fixed_wire_format
from moe_fp4.exchange.ep import combine, dispatch, plan_dispatch
from moe_fp4.exchange.wire import WireFormat


@dataclass(frozen=True)
class HFEPFormats:
    """Wire formats of one registered implementation (see :class:`moe_fp4.exchange.ep.EPConfig`)."""

    dispatch: WireFormat = WireFormat.MXFP4
    combine: WireFormat = WireFormat.BF16
    dispatch_grad: WireFormat = WireFormat.BF16
    combine_grad: WireFormat = WireFormat.BF16

    def __post_init__(self):
        for name in ("dispatch", "combine", "dispatch_grad", "combine_grad"):
            object.__setattr__(self, name, fixed_wire_format("HFEPFormats", name, getattr(self, name)))
        check_value_formats("HFEPFormats", dispatch=self.dispatch, combine=self.combine)


class MoeFp4EP(EPImplementation):
    """An ``EPImplementation`` that moves tokens with :func:`moe_fp4.exchange.ep.dispatch` / :func:`combine`.

    Called with this rank's ``hidden_states`` [T, H], ``top_k_index`` int64 [T, k] (global expert
    ids) and ``top_k_weights`` [T, k]; returns [T, H], each token's weighted sum of its experts'
    outputs. With tensor parallelism (the TP group shares a batch), each TP rank sends a disjoint
    slice of the rows and the outputs are gathered back, as transformers' own all-to-all EP does.
    """

    formats = HFEPFormats()

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        tokens, hidden = hidden_states.shape
        tp = self.tp_mesh.size() > 1
        if tp:
            # Replicate -> Shard(0) keeps a local chunk (no communication); its backward gathers gradients.
            hidden_states, top_k_index, top_k_weights = (
                DTensor.from_local(t, self.tp_mesh, [Replicate()], run_check=False)
                .redistribute(self.tp_mesh, [Shard(0)]).to_local()
                for t in (hidden_states, top_k_index, top_k_weights))
        group = self.ep_mesh.get_group()
        f = self.formats
        plan = plan_dispatch(top_k_index, self.num_local_experts * self.ep_mesh.size(), group)
        sent = dispatch(hidden_states, top_k_weights.float(), top_k_index, plan, f.dispatch, f.dispatch_grad,
                        expand=False)
        rows, weights = sent.x, sent.weights.to(sent.x.dtype)
        if rows.shape[0] == 0:
            # Run the experts on one dummy row so that their parameters stay on this rank's backward
            # graph (FSDP reduces their gradients over all ranks).
            out = self.experts_forward(rows.sum(0, keepdim=True), sent.local_ids.new_zeros(1, 1),
                                       weights.new_zeros(1, 1))[:0]
        else:
            out = self.experts_forward(rows, sent.local_ids, weights)
        y = combine(out.to(hidden_states.dtype), sent, plan, f.combine, f.combine_grad)
        if not tp:
            return y
        return DTensor.from_local(y.contiguous(), self.tp_mesh, [Shard(0)], shape=(tokens, hidden),
                                  stride=(hidden, 1)).full_tensor()


def register(name: str, dispatch="mxfp4", combine="bf16", dispatch_grad="bf16", combine_grad="bf16") -> type:
    """Register a :class:`MoeFp4EP` with these wire formats under ``name`` -> the registered class."""
    formats = HFEPFormats(dispatch, combine, dispatch_grad, combine_grad)
    cls = type(f"MoeFp4EP_{name}", (MoeFp4EP,), {"formats": formats})
    EPImplementationInterface.register(name, cls)
    return cls


register("moe_fp4")
register("moe_fp4_fp8", dispatch="fp8")

__all__ = ["HFEPFormats", "MoeFp4EP", "register"]

