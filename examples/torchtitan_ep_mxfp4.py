"""torchtitan's own Qwen3-MoE, expert parallel over 2 ranks, its token dispatch sent as MXFP4 with one line.

    torchrun --nproc-per-node 2 examples/torchtitan_ep_mxfp4.py                  # every SPMD backend
    torchrun --nproc-per-node 2 examples/torchtitan_ep_mxfp4.py --backend spmd_types --combine mxfp4
    torchrun --nproc-per-node 2 examples/torchtitan_ep_mxfp4.py --experts fp4    # moe_fp4's experts too

Tested with torchtitan 0.3.0 (spmd_types 0.2.3) and torch 2.13 on CPU (gloo): `pip install -e ".[test]"`
installs them. The model, its parallelization (``parallelize_qwen3``, EP = 2, no FSDP) and the token
dispatcher are torchtitan's; the only moe_fp4 line is the scope around the step::

    with moe_fp4.swap_all_to_all(dispatch="mxfp4", combine="bf16"):
        loss = step(model)

The swap knows torchtitan's ``AllToAllTokenDispatcher``: its ``_dispatch_token_exchange`` and
``_combine_token_exchange`` are the dispatch and the combine, whichever backend runs underneath
(``spmd_types``, torchtitan's default, reaches ``spmd_types.all_to_all``; ``partial_dtensor`` and
``full_dtensor`` the functional ``all_to_all_single``). Each exchange and its gradient travels in its
own format (the gradients bf16 here); the integer count exchange passes through.

For each backend the example runs the same step three times: torch's own exchange (where gloo can
run it: its list-form all-to-all, which ``spmd_types`` uses, needs equal splits), the swap with every
wire ``native`` (unquantized, the reference), and the swap with the chosen formats. It prints the
loss, the expert weight gradients' SQNR against the reference, the bytes this rank sent per role,
direction and format, and which experts and token dispatcher ran, with the rows per local expert each
layer's experts were handed. On GPUs (NCCL) the same code applies; only CPU is tested.

``--experts fp8`` / ``fp4`` also converts the model config with moe_fp4's ``GroupedExpertsConverter``
(``moe_fp4.integrations.torchtitan``) before the build, as a torchtitan training config naming it in
its ``converters`` does: torchtitan's GroupedExperts run on moe_fp4's grouped FP8 engine (fp4: its
activations saved in MXFP4), and the dispatcher becomes ``PaddedTokenDispatcher`` (torchtitan's
padding dispatcher, a subclass of ``AllToAllTokenDispatcher``: the swap sees the same exchanges). Each
local expert's group is padded to a multiple of 128 rows *after* the all-to-all, so the wire carries
unpadded rows. The engine needs the model dim and the expert ffn to be multiples of 128, so this model
is 128 / 128 (64 / 64 with torchtitan's experts), with one layer (``SIZES`` says why). Each backend
then runs a fourth step, torchtitan's own experts on the same weights with native wires, and prints
the converted model's loss and expert gradients against it, with native wires and with the chosen
formats.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist

import moe_fp4
from moe_fp4.compare.quiet import quiet_third_party
from moe_fp4.formats.metrics import sqnr_db

BACKENDS = ("spmd_types", "partial_dtensor", "full_dtensor")
EXPERT_CHOICES = ("torchtitan", "fp8", "fp4")
HEAD_DIM, VOCAB, EXPERTS, TOP_K, BATCH, SEQ = 16, 256, 4, 2, 2, 16
# (model dim, experts' ffn, layers) per --experts. torchtitan's own experts: the tiny 64 / 64, 2 layers.
# moe_fp4's engine quantizes its weights in 128x128 blocks, so a converted model is 128 / 128; and it
# has 1 layer: with 2, the converted model's layer-1 router sees layer 0's FP8-rounded output, and a
# near-tie flips (measured: one of rank 1's tokens takes another expert pair in layer 1 with fp8 experts
# and native wires than with the MXFP4 dispatch or with torchtitan's experts), which drops the rank-0
# layer-1 experts' gradient SQNR to 9.5-13.6 dB: a measure of that one token, not of the wire or the
# engine. With 1 layer every run routes every token alike (the router sees the same attention output).
SIZES = {"torchtitan": (64, 64, 2), "fp8": (128, 128, 1), "fp4": (128, 128, 1)}


def model_config(experts: str = "torchtitan", dim: int = 64, ffn: int = 64, n_layers: int = 2):
    """A tiny Qwen3-MoE in torchtitan's own config classes (model dim ``dim``, expert ffn ``ffn``, ``n_layers``), its
    experts torchtitan's own or, for ``experts`` "fp8" / "fp4", converted by moe_fp4's
    ``GroupedExpertsConverter`` (the config converter a torchtitan training config names; it also pads the
    token dispatcher's expert groups to 128 rows). torchtitan 0.3 registers only a large MoE debug model
    (8 layers of 64 experts), so the layers come from its (private) builder."""
    from torchtitan.models.common import CosSinRoPE, Embedding, Linear
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.qwen3 import Qwen3Model, _build_qwen3_moe_layers, _qwen3_norm

    init = {"weight": lambda t: torch.nn.init.normal_(t, std=0.02)}
    layers = _build_qwen3_moe_layers(
        n_layers=n_layers, dim=dim, n_heads=4, n_kv_heads=2, head_dim=HEAD_DIM, moe_hidden_dim=ffn,
        num_experts=EXPERTS, top_k=TOP_K, attn_backend="flex", moe_comm_backend="standard",
        rope=CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=SEQ, theta=1e6))
    for layer in layers:   # flex attention needs torch.compile; SDPA runs eagerly on CPU
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    cfg = Qwen3Model.Config(
        vocab_size=VOCAB, dim=dim, norm=_qwen3_norm(dim), layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim, param_init=init),
        lm_head=Linear.Config(in_features=dim, out_features=VOCAB, param_init=init))
    if experts != "torchtitan":
        from moe_fp4.integrations.torchtitan import GroupedExpertsConverter

        cfg = GroupedExpertsConverter.Config(precision=experts).build().convert(cfg)
    return cfg


def experts_ran(model) -> str:
    """What the built model's MoE layers hold: '<experts class> <precision> x<layers>, dispatcher <class>'."""
    from torchtitan.models.common.moe import RoutedExperts

    seen = sorted({(type(m.inner_experts).__name__, getattr(getattr(m.inner_experts, "precision", None), "value",
                                                             "torchtitan"), type(m.token_dispatcher).__name__)
                   for m in model.modules() if isinstance(m, RoutedExperts)})
    layers = sum(isinstance(m, RoutedExperts) for m in model.modules())
    return "; ".join(f"{e} {p} x{layers}, dispatcher {d}" for e, p, d in seen)


def step(backend: str, rank: int, world: int, experts: str = "torchtitan", sizes: tuple[int, int, int] = (64, 64, 2),
         compile_backend: str | None = None) -> tuple[float, dict[str, torch.Tensor], str]:
    """Build the model (same weights on every run; ``experts``, ``sizes`` (dim, ffn, layers): :func:`model_config`'s),
    parallelize it with torchtitan for ``backend`` (and, with ``compile_backend``, compile it as torchtitan does:
    each transformer block with ``fullgraph=True``), run one forward + backward on this rank's tokens ->
    (global mean loss, {expert parameter: local grad}, :func:`experts_ran` and, eager only, the rows per local
    expert each layer's experts were handed)."""
    import spmd_types as spmd
    from torchtitan.components.loss import cross_entropy_loss
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils
    from torchtitan.distributed.full_dtensor import parallelize_inputs
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.models.common.moe import RoutedExperts
    from torchtitan.models.qwen3 import parallelize_qwen3

    dist_utils.set_spmd_backend(backend)   # what torchtitan's Trainer does with parallelism.spmd_backend
    parallelism = ParallelismConfig(expert_parallel_degree=world, spmd_backend=backend)
    dims = ParallelDims.from_config(parallelism, world)
    cfg = model_config(experts, *sizes)
    cfg.update_from_config(config=SimpleNamespace(parallelism=parallelism))
    torch.manual_seed(0)
    model = cfg.build()
    model.init_weights()
    compile_config = (CompileConfig() if compile_backend is None else
                      CompileConfig(enable=True, components=["model"], backend=compile_backend))
    model = parallelize_qwen3(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                              compile_config=compile_config, ac_config=None, dump_folder="", skip_dp=True)
    groups = []   # per layer, the rows per local expert the experts were handed (padding included)
    for m in model.modules():
        if isinstance(m, RoutedExperts) and compile_backend is None:   # a host read: a graph break in a block
            m.inner_experts.register_forward_pre_hook(lambda _m, args: groups.append(args[1].tolist()))
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, VOCAB, (world * BATCH, SEQ + 1), generator=g)[rank * BATCH:(rank + 1) * BATCH]
    inputs, labels = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    kwargs = {"positions": torch.arange(SEQ).repeat(BATCH, 1)}
    if backend == "full_dtensor":
        inputs, labels, kwargs = parallelize_inputs(dims, inputs, labels, kwargs)
    elif backend == "spmd_types":
        inputs, labels, kwargs = annotate_input_spmd_types(dims, inputs, labels, kwargs)
    with dist_utils.get_spmd_context(parallel_dims=dims, spmd_typechecking=False)():
        loss = cross_entropy_loss(model(inputs, **kwargs), labels) / (world * BATCH * SEQ)
        with spmd.no_typecheck():
            loss.backward()
    loss = (loss.to_local() if hasattr(loss, "to_local") else loss).detach().clone()
    dist.all_reduce(loss)
    grads = {n: (p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad).detach().clone()
             for n, p in model.named_parameters() if "experts" in n and p.grad is not None}
    return loss.item(), grads, f"{experts_ran(model)}" + (f"; expert groups {groups}" if groups else "")


def _worst_sqnr(ref: dict, got: dict) -> float:
    """The lowest SQNR (dB) of ``got``'s tensors against ``ref``'s; nan if any is nan (min() would drop it)."""
    db = [sqnr_db(ref[n].float(), got[n].float()) for n in ref]
    return math.nan if any(math.isnan(v) for v in db) else min(db)


def swapped_steps(a, rank: int, world: int, sizes) -> None:
    """For each backend: torch's own exchange, the swap with native wires and with the chosen formats (the
    module docstring); rank 0 prints every rank's lines."""
    native = dict(dispatch="native", combine="native", dispatch_grad="native", combine_grad="native")
    for backend in BACKENDS if a.backend == "all" else (a.backend,):
        with moe_fp4.swap_all_to_all(**native):
            ref_loss, ref, ran = step(backend, rank, world, a.experts, sizes)
        with moe_fp4.swap_all_to_all(dispatch=a.dispatch, combine=a.combine) as cfg:
            loss, got, _ = step(backend, rank, world, a.experts, sizes)
        own = "not run (gloo's list all-to-all needs equal splits)"
        if backend != "spmd_types":
            own_loss, own_grads, _ = step(backend, rank, world, a.experts, sizes)
            same = own_loss == ref_loss and all(torch.equal(own_grads[n], ref[n]) for n in ref)
            own = "identical to native" if same else "DIFFERS from native"
        sent = ", ".join(f"{role} {direction} {fmt} {n} B" for (role, direction, fmt), n in sorted(cfg.wire.items()))
        lines = [f"[{backend}] rank {rank}: loss native {ref_loss:.6f}, {a.dispatch}/{a.combine} {loss:.6f}; "
                 f"expert grads SQNR >= {_worst_sqnr(ref, got):.1f} dB over {len(ref)}; torch's own exchange: {own}",
                 f"[{backend}] rank {rank} sent: {sent}",
                 f"[{backend}] rank {rank} experts: {ran}; dim {sizes[0]}, ffn {sizes[1]}, layers {sizes[2]}"]
        if a.experts != "torchtitan":   # the converted model against torchtitan's own experts, same weights
            with moe_fp4.swap_all_to_all(**native):
                tt_loss, tt, _ = step(backend, rank, world, "torchtitan", sizes)
            rel, swapped_rel = abs(ref_loss - tt_loss) / abs(tt_loss), abs(loss - tt_loss) / abs(tt_loss)
            lines.append(f"[{backend}] rank {rank} against torchtitan's experts (native wires, loss {tt_loss:.6f}): "
                         f"{a.experts} native loss rel {rel:.2e}, expert grads SQNR >= {_worst_sqnr(tt, ref):.1f} dB; "
                         f"{a.experts} {a.dispatch}/{a.combine} loss rel {swapped_rel:.2e}, expert grads SQNR >= "
                         f"{_worst_sqnr(tt, got):.1f} dB")
        every = [None] * world
        dist.all_gather_object(every, lines)   # rank 0 prints all ranks' lines, in order
        if rank == 0:
            print("\n".join(line for ranks_lines in every for line in ranks_lines), flush=True)


def compiled_against_eager(backend: str, rank: int, world: int, experts: str, sizes) -> None:
    """One step eager and one compiled (torchtitan's per-block compile), torch's own exchange: rank 0 prints each
    rank's losses and whether the compiled step gave the eager loss and expert gradients bit for bit."""
    from torch._dynamo.utils import counters

    on_gpu = torch.cuda.is_available() and dist.get_backend() == "nccl"
    for b in BACKENDS if backend == "all" else (backend,):
        if b == "spmd_types" and not on_gpu:
            if rank == 0:
                print(f"[{b}] not compiled here: gloo's list all-to-all, which it runs, needs equal splits", flush=True)
            continue
        torch._dynamo.reset()
        counters.clear()
        eager_loss, eager, _ = step(b, rank, world, experts, sizes)
        loss, got, ran = step(b, rank, world, experts, sizes, compile_backend="inductor" if on_gpu else "aot_eager")
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        same = loss == eager_loss and eager.keys() == got.keys() and all(torch.equal(eager[n], got[n]) for n in eager)
        line = (f"[{b}] rank {rank} compiled: loss eager {eager_loss:.6f}, compiled {loss:.6f}; expert grads "
                f"{'identical' if same else 'DIFFER'} over {len(eager)}; {graphs} graphs, {breaks} graph breaks; "
                f"experts: {ran}")
        every = [None] * world
        dist.all_gather_object(every, line)
        if rank == 0:
            print("\n".join(every), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", choices=("all", *BACKENDS), default="all")
    p.add_argument("--dispatch", default="mxfp4", help="the dispatch's wire format (default: mxfp4)")
    p.add_argument("--combine", default="bf16", help="the combine's wire format (default: bf16)")
    p.add_argument("--experts", choices=EXPERT_CHOICES, default="torchtitan",
                   help="torchtitan's own GroupedExperts (default; dim 64, ffn 64), or converted by moe_fp4's "
                        "GroupedExpertsConverter to its fp8 / fp4 engine (dim 128, ffn 128)")
    p.add_argument("--compile", action="store_true",
                   help="instead: torch's own exchange, eager against compiled as torchtitan compiles (each block "
                        "fullgraph=True; backend aot_eager on CPU, inductor on GPUs); on gloo partial_dtensor and "
                        "full_dtensor only (spmd_types' list all-to-all needs equal splits there)")
    a = p.parse_args()
    if "RANK" not in os.environ:
        raise SystemExit("run it with 2 ranks: torchrun --nproc-per-node 2 examples/torchtitan_ep_mxfp4.py")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.models.qwen3  # noqa: F401  (before the swap: it marks the token dispatcher's methods)

    # torchtitan picks "cuda" for its device mesh when no accelerator is found; these ranks are CPU ones.
    parallel_dims.device_type = "cpu"
    torch.autograd.set_multithreading_enabled(False)   # as torchtitan's init_distributed does
    torch.set_num_threads(1)
    sizes = SIZES[a.experts]
    if a.compile:
        compiled_against_eager(a.backend, rank, world, a.experts, sizes)
    else:
        swapped_steps(a, rank, world, sizes)
    dist.barrier()   # no rank tears its process groups down while another still uses them
    dist.destroy_process_group()


if __name__ == "__main__":
    # torchtitan imports torchao, which reports the prebuilt extensions it cannot load here and its enums'
    # pytree registration, and its router enters autocast(float32), which CPU autocast declines: known-harmless
    # lines, dropped while the example runs (nothing else is).
    with quiet_third_party():
        main()
    # The run is over: exiting here skips the interpreter's teardown of torch's gloo state, which now and
    # then aborts ("terminate called without an active exception") after every rank has finished.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
