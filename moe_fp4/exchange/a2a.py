"""Expert-parallel all-to-all that sends MXFP4 (or FP8) payloads, autograd-aware. The drop-ins for
torch's ``all_to_all_single`` functions that route another stack's calls here are in
:mod:`moe_fp4.exchange.swap`.

:func:`all_to_all` moves rows like ``torch.distributed.all_to_all_single`` (``input_split_sizes[d]``
rows go to rank d, ``output_split_sizes[s]`` rows come from rank s; None = equal splits). Values
travel in the ``forward`` wire format (:mod:`moe_fp4.exchange.wire`: one uint8 message per call, data and
scales per row), their gradients back in the ``backward`` format, and the receiver returns
``output``: the input's float dtype, an FP8BlockTensor, or the MXFP4Tensor as received.

Before moving data, every call runs one small count exchange (an all-gather of each rank's splits,
row size, formats and dtype) and checks that all ranks agree: a mismatch raises the same ValueError
on every rank instead of hanging or scrambling rows. That costs one tiny collective and one host
sync; ``check=False`` skips it for loops that already exchanged their counts (the EP layer does).
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_fp4.exchange.wire import HIDDEN_MULTIPLE, STOCHASTIC, OutputFormat, WireFormat, pack, unpack
from moe_fp4.formats.containers import HIGH_PRECISION_DTYPES, FP8BlockTensor, MXFP4Tensor

_DTYPE_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_FORMAT_CODE = {f: i for i, f in enumerate(WireFormat)}
_OUTPUT_CODE = {f: i for i, f in enumerate(OutputFormat)}


# torch's own functions, as they were before moe_fp4.exchange.swap.swap_all_to_all replaced them in
# their modules: the exchange below (and each drop-in's fall-through) must call the original, not the
# drop-in that would route it back here.
_TORCH_C10D = "torch.distributed.distributed_c10d"
_originals: dict[tuple[str, str], object] = {}


def _original(module: str, name: str):
    key = (module, name)
    if key not in _originals:
        _originals[key] = getattr(importlib.import_module(module), name)
    return _originals[key]


def resolve_group(group):
    """None (the default group), a ProcessGroup, a DeviceMesh (1-D), a (DeviceMesh, dim) pair or a
    group name -> ProcessGroup."""
    if group is None:
        return dist.group.WORLD
    if isinstance(group, dist.ProcessGroup):
        return group
    if isinstance(group, str):
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(group)
    if isinstance(group, tuple) and len(group) == 2:
        mesh, dim = group
        return mesh.get_group(dim)
    if hasattr(group, "get_group"):
        return group.get_group()
    raise TypeError(f"moe_fp4 all_to_all: unsupported group {type(group).__name__} (pass a ProcessGroup, a "
                    f"DeviceMesh, a (DeviceMesh, dim) pair or a group name)")


def _count_device(group) -> torch.device:
    """Where the small count tensors live: CUDA for an NCCL-only group, CPU otherwise (gloo)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _device_problem(device: torch.device, group) -> str | None:
    backend = dist.get_backend(group)
    if device.type == "cuda" and "nccl" not in backend:
        return f"a CUDA tensor on a {backend} group (use an NCCL group for CUDA tensors)"
    if device.type != "cuda" and backend == "nccl":
        return f"a {device.type} tensor on an NCCL group (NCCL moves CUDA tensors only)"
    return None


class WireBytes:
    """Bytes this process sent to other ranks, per role (``exchange_rows(..., role=...)``): host ints from
    the shapes and splits, so counting costs no sync. The EP layer counts "count", "dispatch",
    "combine", "dispatch_grad" and "combine_grad"; rows a rank keeps for itself are not counted (they
    cross no link). :meth:`take` reads and resets. Beside the bytes, the most rows one exchange of each role
    delivered to this rank, its own included (:meth:`take_rows_max`): under expert parallelism the dispatch's
    rows are what this rank's experts hold activations for, and they follow the routing's balance."""

    def __init__(self):
        self.sent: dict[str, int] = {}
        self.rows_max: dict[str, int] = {}

    def add(self, role: str, send: torch.Tensor, input_splits, group, output_splits=()) -> None:
        rows = sum(input_splits) - input_splits[dist.get_rank(group)]
        row = send[0].numel() * send.element_size() if send.shape[0] else 0
        self.sent[role] = self.sent.get(role, 0) + rows * row
        self.rows_max[role] = max(self.rows_max.get(role, 0), sum(output_splits))

    def take(self) -> dict[str, int]:
        out, self.sent = self.sent, {}
        return out

    def take_rows_max(self) -> dict[str, int]:
        """-> {role: the most rows one exchange of that role received here} since the last call; resets."""
        out, self.rows_max = self.rows_max, {}
        return out


WIRE_BYTES = WireBytes()


def exchange_rows(send: torch.Tensor, input_splits, output_splits, group, out: torch.Tensor | None = None,
                  role: str | None = None) -> torch.Tensor:
    """send: uint8 (or any dtype the backend takes) [S, B], rows grouped by destination rank
    -> [R, B] rows grouped by source rank (R = sum(output_splits)), written into ``out`` when given.
    One collective, no checks. It calls torch's own ``all_to_all_single`` even inside
    :func:`swap_all_to_all` (whose drop-in would only pass the bytes on, and count them). ``role``:
    the bytes sent to other ranks are added to :data:`WIRE_BYTES` under that name."""
    if out is None:
        out = send.new_empty((sum(output_splits), *send.shape[1:]))
    if role is not None:
        WIRE_BYTES.add(role, send, input_splits, group, output_splits)
    _original(_TORCH_C10D, "all_to_all_single")(out, send.contiguous(), list(output_splits), list(input_splits),
                                                group=group)
    return out


def all_gather_counts(local: torch.Tensor, group) -> torch.Tensor:
    """local: int64 [L] -> int64 [world, L], every rank's vector (one small collective)."""
    world = dist.get_world_size(group)
    out = local.new_empty(world * local.numel())
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, local.contiguous(), group=group)
    return out.view(world, -1)


@dataclass(frozen=True)
class ExchangePlan:
    """One all-to-all: who sends how many rows where, and in which formats (validated)."""

    group: object
    input_splits: tuple[int, ...]
    output_splits: tuple[int, ...]
    hidden: int
    dtype: torch.dtype
    forward: WireFormat
    backward: WireFormat
    output: OutputFormat
    # "forward" or "gradient", and a callable (direction, format, bytes) told what each exchange of
    # this plan put on the wire (swap_all_to_all's byte count); neither affects the exchange.
    direction: str = "forward"
    ledger: object = field(default=None, compare=False)

    def __post_init__(self):
        for name in ("forward", "backward"):
            object.__setattr__(self, name, WireFormat(getattr(self, name)))
        object.__setattr__(self, "output", OutputFormat(self.output))
        if self.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"ExchangePlan: dtype must be bfloat16, float16 or float32, got {self.dtype}")

    def reversed(self, fmt: WireFormat) -> "ExchangePlan":
        """The gradient's exchange: splits swapped, ``fmt`` on the wire, back to the float dtype."""
        return ExchangePlan(self.group, self.output_splits, self.input_splits, self.hidden, self.dtype, fmt, fmt,
                            OutputFormat.BF16, "gradient", self.ledger)


def fixed_wire_format(owner: str, name: str, value) -> WireFormat:
    """value -> its WireFormat; a clear ValueError for "auto", the sqrt(3) rule, which lives in moe_fp4's
    MoE layer (EPConfig: each layer keeps its rule) and not in the exchanges configured here."""
    if value == "auto":
        raise ValueError(f"{owner}: {name}='auto' (the sqrt(3) rule) is available for moe_fp4's MoE layer "
                         f"(EPConfig, moe-fp4 compare --wire); here give a format: "
                         f"{', '.join(f.value for f in WireFormat)}")
    return WireFormat(value)


def check_value_formats(owner: str, **formats) -> None:
    """Raise ValueError if a values (forward) exchange is given a stochastic format: those are for
    gradients (their rounding is unbiased, not nearest)."""
    for name, fmt in formats.items():
        if WireFormat(fmt) in STOCHASTIC:
            raise ValueError(f"{owner}: {name}={WireFormat(fmt).value} rounds stochastically, which is for "
                             f"gradients only; use it for {name}_grad, and a nearest format "
                             f"({WireFormat(fmt).value.removesuffix('-sr')}) for {name}")


def _splits(sizes, n: int, world: int, what: str) -> tuple[tuple[int, ...] | None, str | None]:
    """-> (splits, problem): None sizes mean n / world rows each (n must divide)."""
    if sizes is None or len(sizes) == 0:
        if n % world:
            return None, f"{what} is None (equal splits), but {n} rows do not divide into {world} ranks"
        return (n // world,) * world, None
    sizes = tuple(int(s) for s in sizes)
    if len(sizes) != world:
        return None, f"{what} has {len(sizes)} entries for a group of {world} ranks"
    if any(s < 0 for s in sizes):
        return None, f"{what} = {list(sizes)} holds a negative size"
    return sizes, None


def _local_problem(x, n: int, hidden: int, dtype, forward, backward, output, group, in_sizes) -> str | None:
    if dtype not in HIGH_PRECISION_DTYPES:
        return f"x must be bfloat16, float16 or float32 (or an FP8BlockTensor / MXFP4Tensor), got {dtype}"
    if forward in STOCHASTIC:
        return (f"the {forward.value} wire format rounds stochastically, for gradients only: give it as the "
                f"backward format")
    for fmt in (forward, backward):
        if hidden % HIDDEN_MULTIPLE[fmt]:
            return (f"the row size H = {hidden} must be a multiple of {HIDDEN_MULTIPLE[fmt]} for the {fmt.value} "
                    "wire format")
    if output is not OutputFormat.BF16 and hidden % HIDDEN_MULTIPLE[WireFormat(output.value)]:
        return (f"output='{output.value}' needs H = {hidden} to be a multiple of "
                f"{HIDDEN_MULTIPLE[WireFormat(output.value)]}")
    device = x.device if isinstance(x, torch.Tensor) else x.data.device
    problem = _device_problem(device, group)
    if problem:
        return f"x is {problem}"
    if in_sizes is not None and sum(in_sizes) != n:
        return f"input_split_sizes sum to {sum(in_sizes)}, but x has {n} rows"
    return None


def plan_exchange(x, output_split_sizes, input_split_sizes, group, forward, backward, output,
                  check: bool = True, fn: str = "all_to_all") -> ExchangePlan:
    """Validate one call on this rank and, with ``check``, against every other rank (one all-gather
    of the splits, row size, formats and dtype; one host sync). Any problem on any rank raises the
    same ValueError/TypeError on every rank."""
    group = resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    # Every problem found here is raised only after the count exchange, so that all ranks raise
    # together instead of the others waiting in a collective this rank never joins.
    problem, cls = None, ValueError
    try:
        forward, backward, output = WireFormat(forward), WireFormat(backward), OutputFormat(output)
    except ValueError as e:
        problem = f"{e} (wire formats: {', '.join(f.value for f in WireFormat)})"
        forward, backward, output = WireFormat.BF16, WireFormat.BF16, OutputFormat.BF16
    n, hidden, dtype = 0, 0, None
    if isinstance(x, (MXFP4Tensor, FP8BlockTensor)):
        n, hidden, dtype = x.m, x.k, x.dtype
    elif isinstance(x, torch.Tensor):
        if x.dim() == 2:
            (n, hidden), dtype = x.shape, x.dtype
        else:
            problem = problem or f"x must be [N, H], got shape {tuple(x.shape)}"
    elif problem is None:
        problem, cls = f"x must be a tensor, an FP8BlockTensor or an MXFP4Tensor, got {type(x).__name__}", TypeError
    in_sizes = out_sizes = None
    if problem is None:
        in_sizes, problem = _splits(input_split_sizes, n, world, "input_split_sizes")
    if problem is None:
        problem = _local_problem(x, n, hidden, dtype, forward, backward, output, group, in_sizes)
        if problem is not None and dtype not in HIGH_PRECISION_DTYPES:
            cls = TypeError
    if problem is None:
        out_sizes, problem = _splits(output_split_sizes, n, world, "output_split_sizes")
    if not check:
        if problem:
            raise cls(f"{fn} on rank {rank}: {problem}")
        return ExchangePlan(group, in_sizes, out_sizes, hidden, dtype, forward, backward, output)

    # [ok, H, dtype, formats x3, in_splits x world, out_splits x world]
    ok = problem is None
    local = [int(ok), hidden, _DTYPE_CODE.get(dtype, 0), _FORMAT_CODE[forward], _FORMAT_CODE[backward],
             _OUTPUT_CODE[output], *(in_sizes if ok else (0,) * world), *(out_sizes if ok else (0,) * world)]
    table = all_gather_counts(torch.tensor(local, dtype=torch.int64, device=_count_device(group)), group).tolist()
    if problem:
        raise cls(f"{fn} on rank {rank}: {problem}")
    bad = [r for r, row in enumerate(table) if not row[0]]
    if bad:
        raise ValueError(f"{fn}: rank(s) {bad} rejected their input (see the error raised there); no data was sent")
    names = ("H", "dtype", "forward format", "backward format", "output format")
    for i, name in enumerate(names, start=1):
        values = [row[i] for row in table]
        if len(set(values)) > 1:
            raise ValueError(f"{fn}: ranks disagree on {name}: {values} by rank")
    for s in range(world):
        for d in range(world):
            sent, expected = table[s][6 + d], table[d][6 + world + s]
            if sent != expected:
                raise ValueError(f"{fn}: rank {s} sends {sent} rows to rank {d}, but rank {d} expects {expected} "
                                 f"from rank {s} (input_split_sizes and output_split_sizes disagree across ranks)")
    return ExchangePlan(group, in_sizes, out_sizes, hidden, dtype, forward, backward, output)


def run_exchange(x, plan: ExchangePlan):
    """Pack x in plan.forward, exchange, unpack to plan.output (no autograd, no checks)."""
    send = pack(x, plan.forward, rank=dist.get_rank(plan.group) if plan.forward in STOCHASTIC else 0)
    if plan.ledger is not None:
        plan.ledger(plan.direction, plan.forward, send.numel())
    wire = exchange_rows(send, plan.input_splits, plan.output_splits, plan.group)
    return unpack(wire, plan.forward, plan.hidden, plan.output, plan.dtype)


def grad_carrier(rows: int, hidden: int, dtype, device) -> torch.Tensor:
    """A [rows, hidden] zero-stride tensor: stands in for a quantized output on the autograd graph."""
    return torch.zeros((), dtype=dtype, device=device).expand(rows, hidden)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: ExchangePlan):
        ctx.plan = plan
        out = run_exchange(x, plan)
        if plan.output is OutputFormat.BF16:
            return out
        return grad_carrier(out.m, out.k, x.dtype, x.device), out

    @staticmethod
    def backward(ctx, grad, *_):
        back = ctx.plan.reversed(ctx.plan.backward)
        return run_exchange(grad.contiguous(), back), None


class Received(NamedTuple):
    """A quantized all-to-all output. ``value``: FP8BlockTensor or MXFP4Tensor [M, H]; ``grad_carrier``:
    a [M, H] tensor of the input's dtype on the autograd graph (zero-stride): hand it to the consumer
    as the tensor whose gradient is d(loss)/d(value), e.g. ``grouped_swiglu_experts(carrier, ...,
    x_q=value)``; its gradient goes back through the reverse exchange."""

    value: FP8BlockTensor | MXFP4Tensor
    grad_carrier: torch.Tensor


def all_to_all(x, output_split_sizes=None, input_split_sizes=None, group=None, *, forward="mxfp4",
               backward="bf16", output="bf16", check: bool = True, ledger=None):
    """Expert-parallel all-to-all of rows with quantized transport.

    x: bf16/fp16/fp32 [N, H] (autograd flows through), or an FP8BlockTensor / MXFP4Tensor [N, H]
       (sent as is when its format is the wire format; no gradient).
    output_split_sizes / input_split_sizes: rows per rank, as in ``torch.distributed.all_to_all_single``
       (None = equal splits). group: ProcessGroup (default: the world), DeviceMesh or group name.
    forward / backward: wire format of the values / of their gradients: "mxfp4" | "fp8" | "bf16" |
       "native" (H must be a multiple of 32 for mxfp4, 128 for fp8; bf16 rounds to bfloat16, native
       sends x's own dtype).
    output: "bf16" -> x's float dtype [M, H]; "fp8" -> :class:`Received` (FP8BlockTensor, carrier);
       "mxfp4" -> :class:`Received` (MXFP4Tensor as received, carrier). M = sum(output_split_sizes).
    check: run the count exchange that validates the splits, sizes and formats on every rank.
    ledger: optional callable (direction "forward" | "gradient", WireFormat, bytes), called with what
       each exchange (this one and its gradient's) puts on the wire.
    """
    plan = plan_exchange(x, output_split_sizes, input_split_sizes, group, forward, backward, output, check)
    if ledger is not None:
        plan = dataclasses.replace(plan, ledger=ledger)
    if isinstance(x, torch.Tensor):
        x = x.contiguous()
        out = _AllToAll.apply(x, plan)
    else:
        out = run_exchange(x, plan)
        if plan.output is not OutputFormat.BF16:
            out = (grad_carrier(out.m, out.k, plan.dtype, out.device), out)
    if plan.output is OutputFormat.BF16:
        return out
    return Received(out[1], out[0])


__all__ = ["ExchangePlan", "Received", "WIRE_BYTES", "WireBytes", "all_to_all", "exchange_rows", "plan_exchange",
           "resolve_group"]
