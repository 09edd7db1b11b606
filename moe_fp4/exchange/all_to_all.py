"""Expert-parallel all-to-all that sends MXFP4 (or FP8) payloads, autograd-aware, and drop-ins for
torch's ``all_to_all_single`` functions.

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

import contextlib
import dataclasses
import enum
import importlib
import sys
import math
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_fp4.formats.containers import HIGH_PRECISION_DTYPES, FP8BlockTensor, MXFP4Tensor
from moe_fp4.exchange.wire import HIDDEN_MULTIPLE, STOCHASTIC, OutputFormat, WireFormat, pack, unpack

_DTYPE_CODE = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 3}
_FORMAT_CODE = {f: i for i, f in enumerate(WireFormat)}
_OUTPUT_CODE = {f: i for i, f in enumerate(OutputFormat)}


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


def exchange_rows(send: torch.Tensor, input_splits, output_splits, group, out: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """send: uint8 (or any dtype the backend takes) [S, B], rows grouped by destination rank
    -> [R, B] rows grouped by source rank (R = sum(output_splits)), written into ``out`` when given.
    One collective, no checks. It calls torch's own ``all_to_all_single`` even inside
    :func:`swap_all_to_all` (whose drop-in would only pass the bytes on, and count them)."""
    if out is None:
        out = send.new_empty((sum(output_splits), *send.shape[1:]))
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
            return f"the row size H = {hidden} must be a multiple of {HIDDEN_MULTIPLE[fmt]} for the {fmt.value} wire format"
    if output is not OutputFormat.BF16 and hidden % HIDDEN_MULTIPLE[WireFormat(output.value)]:
        return f"output='{output.value}' needs H = {hidden} to be a multiple of {HIDDEN_MULTIPLE[WireFormat(output.value)]}"
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


# ------------------------------------------------------------------------------------------------
# Drop-ins for torch's all-to-all functions, and a context manager that swaps them in.


class Role(str, enum.Enum):
    """Which exchange of an EP layer a call is: each has its own wire formats in :class:`SwapConfig`."""

    DISPATCH = "dispatch"   # tokens to their experts' ranks
    COMBINE = "combine"     # expert outputs back to their tokens' ranks


# The roles of the exchanges running now (innermost last): exchange_role() and the marked methods push.
_ROLES: list[Role] = []


@contextlib.contextmanager
def exchange_role(role):
    """Inside this scope (or a function decorated with it), every all-to-all that the swap's drop-ins
    take is the ``role`` exchange ("dispatch" | "combine") and travels in that role's formats; its
    gradient (the drop-ins are autograd functions) goes back in the role's gradient format, wherever
    autograd runs it. Scopes nest; the innermost wins. For a dispatcher the swap does not know::

        with moe_fp4.exchange_role("combine"):
            y = all_to_all_single(expert_out, input_splits, output_splits, group)
    """
    role = Role(role)
    _ROLES.append(role)
    try:
        yield role
    finally:
        _ROLES.pop()


@dataclass(frozen=True)
class SwapConfig:
    """Wire formats the drop-ins use, per role and direction (:class:`Role`): the dispatch and the
    combine, and the gradient of each. A call made outside any role scope (:func:`exchange_role`, or a
    method in :data:`KNOWN_ROLES` / ``swap_all_to_all(roles=...)``) takes the ``unmarked`` role.
    Tensors that cannot travel in their format (integer dtypes, 1-D tensors, rows not a multiple of
    32 for mxfp4 / 128 for fp8) go through torch's own function.

    ``calls`` counts what the drop-ins did while this config was active: ``calls[(function, role,
    outcome)]``, role ``"dispatch"``, ``"combine"`` or ``"unmarked"`` (:data:`UNMARKED`, sent in the
    ``unmarked`` role's formats), outcome ``"compressed"`` (sent in the role's formats, quantized or
    not) or the reason a call went through torch's function unchanged (:data:`PASS_REASONS`).
    ``wire`` counts the bytes the drop-ins put on the wire: ``wire[(role, direction, format)]``,
    direction ``"forward"`` or ``"gradient"`` (the bytes this rank sent: the packed rows handed to the
    collective)."""

    dispatch: WireFormat = WireFormat.MXFP4
    combine: WireFormat = WireFormat.BF16
    dispatch_grad: WireFormat = WireFormat.BF16
    combine_grad: WireFormat = WireFormat.BF16
    unmarked: Role = Role.DISPATCH
    check: bool = True
    calls: dict = field(default_factory=dict, compare=False, hash=False, repr=False)
    wire: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        for name in ("dispatch", "combine", "dispatch_grad", "combine_grad"):
            object.__setattr__(self, name, fixed_wire_format(type(self).__name__, name, getattr(self, name)))
        check_value_formats(type(self).__name__, dispatch=self.dispatch, combine=self.combine)
        object.__setattr__(self, "unmarked", Role(self.unmarked))

    def formats(self, role: Role) -> tuple[WireFormat, WireFormat]:
        """(values, gradients) wire formats of a ``role`` exchange."""
        if Role(role) is Role.DISPATCH:
            return self.dispatch, self.dispatch_grad
        return self.combine, self.combine_grad

    def role(self) -> Role | None:
        """The role of a call made now: the innermost role scope's, None outside every scope."""
        return _ROLES[-1] if _ROLES else None

    def count(self, function: str, role: Role | None, outcome: str) -> None:
        key = (function, _label(role), outcome)
        self.calls[key] = self.calls.get(key, 0) + 1

    def ledger(self, role: Role | None):
        """A callable for :func:`all_to_all`'s ``ledger`` that adds to ``wire`` under ``role``."""
        def record(direction: str, fmt: WireFormat, nbytes: int) -> None:
            key = (_label(role), direction, WireFormat(fmt).value)
            self.wire[key] = self.wire.get(key, 0) + int(nbytes)
        return record

    def uncompressed_floats(self) -> dict:
        """{(function, role, reason): calls} of floating-point payloads that went through uncompressed."""
        return {k: n for k, n in self.calls.items() if k[2] in FLOAT_PASS_REASONS}

    def unmarked_calls(self) -> int:
        """Floating-point calls sent while no role scope was active (in the ``unmarked`` role's formats)."""
        return sum(n for (_, role, outcome), n in self.calls.items() if role == UNMARKED and outcome == "compressed")


def _label(role: Role | None) -> str:
    return UNMARKED if role is None else Role(role).value


# The role label of a call made outside every role scope (in SwapConfig.calls and .wire).
UNMARKED = "unmarked"

# Why a drop-in handed a call to torch's function. Integer tensors and 1-D vectors are the count
# exchanges an EP loop makes (expected); the others are floating-point payloads that did not travel
# in the wire format, which swap_all_to_all(report=True) warns about.
# spmd_types' own all_to_all, for arguments the drop-in does not take, ends in torch.distributed.all_to_all,
# whose drop-in sees (and counts) that call: not an uncompressed payload in itself.
PASS_REASONS = ("integer or 1-D", "row size", "async_op", "mixed shapes or dtypes", "to spmd_types' own")
FLOAT_PASS_REASONS = PASS_REASONS[1:4]


_ACTIVE: list[SwapConfig] = []


def _config() -> SwapConfig:
    return _ACTIVE[-1] if _ACTIVE else SwapConfig()


def _pass_reason(t: torch.Tensor, fmts) -> str | None:
    """None when t can travel in the formats ``fmts``, else why not (one of PASS_REASONS)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in HIGH_PRECISION_DTYPES or t.dim() < 2:
        return PASS_REASONS[0]
    row = math.prod(t.shape[1:])
    if row == 0 or row % max(HIDDEN_MULTIPLE[f] for f in fmts):
        return PASS_REASONS[1]
    return None


def _take(tensors, function: str, reason: str | None = None):
    """-> (config, role, formats or None): whether this call travels in its role's formats (None: it
    goes through torch's function). Counts the call either way."""
    cfg = _config()
    role = cfg.role()
    fmts = cfg.formats(cfg.unmarked if role is None else role)
    for t in tensors:
        reason = reason or _pass_reason(t, fmts)
    cfg.count(function, role, reason or "compressed")
    return cfg, role, (None if reason else fmts)


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))  # not -1: a [0, H] tensor has no -1 to infer


def _dropin(t, output_split_sizes, input_split_sizes, group, cfg: SwapConfig, role: Role | None, fmts
            ) -> torch.Tensor:
    out = all_to_all(_as_rows(t), output_split_sizes, input_split_sizes, group, forward=fmts[0], backward=fmts[1],
                     output="bf16", check=cfg.check, ledger=cfg.ledger(role))
    return out.view(out.shape[0], *t.shape[1:])


_TORCH_FUNCOL = "torch.distributed._functional_collectives"
_TORCH_NN = "torch.distributed.nn.functional"
_TORCH_C10D = "torch.distributed.distributed_c10d"
_TORCH_DIST = "torch.distributed"
_SPMD_TYPES = "spmd_types"
_originals: dict[tuple[str, str], object] = {}


def _original(module: str, name: str):
    key = (module, name)
    if key not in _originals:
        _originals[key] = getattr(importlib.import_module(module), name)
    return _originals[key]


def functional_all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag: str = ""):
    """Drop-in for ``torch.distributed._functional_collectives.all_to_all_single``: same signature
    and rows, values sent in the active :class:`SwapConfig`'s formats for the call's role.
    Differentiable, as torch's is (its ``all_to_all_single_autograd`` calls this very name, so a
    swapped-in function without autograd would drop the gradient there too)."""
    cfg, role, fmts = _take([self], "all_to_all_single")
    if fmts is None:
        return _original(_TORCH_FUNCOL, "all_to_all_single")(self, output_split_sizes, input_split_sizes, group, tag)
    return _dropin(self, output_split_sizes, input_split_sizes, group, cfg, role, fmts)


def functional_all_to_all_single_autograd(self, output_split_sizes, input_split_sizes, group, tag: str = ""):
    """Drop-in for ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (what
    torchtitan's token dispatcher calls): same signature, gradients back in the role's gradient format."""
    cfg, role, fmts = _take([self], "all_to_all_single_autograd")
    if fmts is None:
        return _original(_TORCH_FUNCOL, "all_to_all_single_autograd")(
            self, output_split_sizes, input_split_sizes, group, tag)
    return _dropin(self, output_split_sizes, input_split_sizes, group, cfg, role, fmts)


def _into(output, input, output_split_sizes, input_split_sizes, group, cfg, role, fmts) -> torch.Tensor:
    """The in-place drop-ins' exchange: rows of ``input`` in ``fmts``, written into ``output`` [M, ...]
    (None / empty output splits: equal ones) -> the exchanged tensor (on the autograd graph)."""
    if not output_split_sizes:
        world = dist.get_world_size(resolve_group(group))
        output_split_sizes = [output.shape[0] // world] * world
    out = _dropin(input, output_split_sizes, input_split_sizes, group, cfg, role, fmts)
    if tuple(out.shape) != tuple(output.shape):
        raise ValueError(f"all_to_all_single: output has shape {tuple(output.shape)}, the exchange gives "
                         f"{tuple(out.shape)}")
    with torch.no_grad():
        output.copy_(out)
    return out


def nn_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
    """Drop-in for ``torch.distributed.nn.functional.all_to_all_single``: fills ``output`` [M, ...]
    and returns it, differentiable with respect to ``input``."""
    cfg, role, fmts = _take([input], "nn.all_to_all_single")
    if fmts is None:
        return _original(_TORCH_NN, "all_to_all_single")(output, input, output_split_sizes, input_split_sizes,
                                                         dist.group.WORLD if group is None else group)
    # torch's version writes into `output` and returns it; the returned tensor carries the gradient.
    return _into(output, input, output_split_sizes, input_split_sizes, group, cfg, role, fmts)


def c10d_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                           async_op: bool = False):
    """Drop-in for ``torch.distributed.all_to_all_single`` (c10d, in place): fills ``output`` [M, ...]
    with the rows in the role's format and returns None, like torch's (not differentiable).
    ``async_op=True`` goes through torch's function (no work handle to give back), counted."""
    cfg, role, fmts = _take([input], "c10d.all_to_all_single", PASS_REASONS[2] if async_op else None)
    if fmts is None:
        return _original(_TORCH_C10D, "all_to_all_single")(output, input, output_split_sizes, input_split_sizes,
                                                           group=group, async_op=async_op)
    with torch.no_grad():
        _into(output, input, output_split_sizes, input_split_sizes, group, cfg, role, fmts)
    return None


def c10d_all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """Drop-in for ``torch.distributed.all_to_all``, the list form: ``input_tensor_list[d]`` goes to rank
    d, ``output_tensor_list[s]`` is filled with what rank s sent. The rows of all inputs travel as one
    exchange in the role's format (any row counts, also on gloo, whose own list all-to-all needs equal
    sizes) and are written into the outputs in their dtype. Like torch's, it is not differentiable and
    returns None. Passed to torch's function unchanged (and counted): ``async_op=True`` (no work handle
    to give back), tensors that cannot travel quantized, and lists whose tensors differ in dtype or
    row shape."""
    tensors = list(input_tensor_list) + list(output_tensor_list)
    reason = PASS_REASONS[2] if async_op else None
    if reason is None and all(isinstance(t, torch.Tensor) for t in tensors) and \
            len({(t.dtype, tuple(t.shape[1:])) for t in tensors}) > 1:
        reason = PASS_REASONS[3]
    cfg, role, fmts = _take(tensors, "all_to_all", reason)
    if fmts is None:
        return _original(_TORCH_C10D, "all_to_all")(output_tensor_list, input_tensor_list, group=group,
                                                    async_op=async_op)
    sends = [t.shape[0] for t in input_tensor_list]
    recvs = [t.shape[0] for t in output_tensor_list]
    with torch.no_grad():
        x = torch.cat([_as_rows(t) for t in input_tensor_list])
        out = all_to_all(x, recvs, sends, group, forward=fmts[0], backward=fmts[1], output="bf16", check=cfg.check,
                         ledger=cfg.ledger(role))
        for o, part in zip(output_tensor_list, out.split(recvs)):
            o.copy_(part.view(o.shape))
    return None


def _spmd_rows(spmd, src, dst, split_dim, concat_dim) -> bool:
    """Whether spmd_types.all_to_all(x, ...) splits and concatenates on dim 0, as all_to_all_single
    moves rows (V -> V with split sizes, the S(i) -> S(j) and mixed forms with i = j = 0, V -> V stack
    on dim 0)."""
    def shard_dim(p):
        return p.dim if isinstance(p, spmd.Shard) else None

    if not all(p is spmd.V or shard_dim(p) is not None for p in (src, dst)):
        return False
    split = shard_dim(dst) if shard_dim(dst) is not None else (split_dim or 0)
    concat = shard_dim(src) if shard_dim(src) is not None else (concat_dim or 0)
    return split == 0 and concat == 0 and split_dim in (None, 0) and concat_dim in (None, 0)


def spmd_all_to_all(x, axis, *, src=None, dst=None, split_dim=None, concat_dim=None, output_split_sizes=None,
                    input_split_sizes=None, op_dtype=None, out_dtype=None, backward_options=None):
    """Drop-in for ``spmd_types.all_to_all`` (what torchtitan's default ``spmd_types`` backend calls):
    an all-to-all of rows (split and concatenated on dim 0: torchtitan's V -> V with split sizes, the
    S(0) -> S(0) forms, and V -> V "stack" of an x with one entry per rank) travels through
    :func:`all_to_all` in the role's formats, differentiable, its gradient back in the role's gradient
    format. Anything else (other dims, dtype options, spmd type checking on) goes to spmd_types' own,
    counted; that ends in ``torch.distributed.all_to_all``, whose drop-in takes it in the role's
    forward format (but, not differentiable, cannot tell its gradient's role: it arrives unmarked)."""
    spmd = sys.modules[_SPMD_TYPES]
    src = spmd.V if src is None else src
    dst = spmd.V if dst is None else dst
    sizes_given = output_split_sizes is not None or input_split_sizes is not None
    pg = axis
    plain = (isinstance(x, torch.Tensor) and not torch.overrides.has_torch_function_unary(x)
             and op_dtype is None and out_dtype is None and not backward_options and not spmd.is_type_checking())
    if plain and not isinstance(pg, dist.ProcessGroup):
        from spmd_types._mesh import _pg_for_axis   # a mesh axis name or MeshAxis -> its ProcessGroup

        pg = _pg_for_axis(axis)
    plain = plain and _spmd_rows(spmd, src, dst, split_dim, concat_dim)
    if plain and src is spmd.V and dst is spmd.V and not sizes_given:
        plain = x.dim() >= 2 and x.shape[0] == dist.get_world_size(pg)   # stack: one entry per rank
    cfg, role, fmts = _take([x], "spmd_types.all_to_all", None if plain else PASS_REASONS[4])
    if fmts is None:
        return _original(_SPMD_TYPES, "all_to_all")(
            x, axis, src=src, dst=dst, split_dim=split_dim, concat_dim=concat_dim,
            output_split_sizes=output_split_sizes, input_split_sizes=input_split_sizes, op_dtype=op_dtype,
            out_dtype=out_dtype, backward_options=backward_options)
    return _dropin(x, output_split_sizes, input_split_sizes, pg, cfg, role, fmts)


# (module, attribute, replacement) that swap_all_to_all touches. torch.distributed re-exports
# distributed_c10d's all_to_all and all_to_all_single: both names are replaced. Modules not imported
# when the swap starts (spmd_types) are left alone.
SWAPPED = (
    (_TORCH_FUNCOL, "all_to_all_single", functional_all_to_all_single),
    (_TORCH_FUNCOL, "all_to_all_single_autograd", functional_all_to_all_single_autograd),
    (_TORCH_NN, "all_to_all_single", nn_all_to_all_single),
    (_TORCH_C10D, "all_to_all_single", c10d_all_to_all_single),
    (_TORCH_DIST, "all_to_all_single", c10d_all_to_all_single),
    (_TORCH_C10D, "all_to_all", c10d_all_to_all),
    (_TORCH_DIST, "all_to_all", c10d_all_to_all),
    (_SPMD_TYPES, "all_to_all", spmd_all_to_all),
)

# Methods of EP dispatchers the swap knows, by role: "module:Class.method". Each all-to-all made
# inside one (and its gradient) travels in that role's formats. torchtitan (0.3): the token
# dispatcher's exchange methods, which every backend's path goes through (funcol, spmd_types).
KNOWN_ROLES = {
    Role.DISPATCH: ("torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._dispatch_token_exchange",),
    Role.COMBINE: ("torchtitan.models.common.token_dispatcher:AllToAllTokenDispatcher._combine_token_exchange",),
}


def _resolve_method(spec: str):
    """"module:Class.method" -> (owner, attribute name); the module is imported."""
    module, _, qual = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not module or not qual:
        raise ValueError(f"swap_all_to_all roles: {spec!r} is not 'module:Class.method'")
    owner = importlib.import_module(module)
    *path, name = qual.split(".")
    for part in path:
        owner = getattr(owner, part, None)
    if not callable(getattr(owner, name, None)):
        raise ValueError(f"swap_all_to_all roles: {spec!r} names no function")
    return owner, name


_MISSING = object()


def _marked(fn, role: Role):
    import functools

    @functools.wraps(fn)
    def in_role(*args, **kwargs):
        with exchange_role(role):
            return fn(*args, **kwargs)

    in_role.__moe_fp4_role__ = role
    return in_role


@contextlib.contextmanager
def swap_all_to_all(dispatch="mxfp4", combine="bf16", dispatch_grad="bf16", combine_grad="bf16", *,
                    unmarked="dispatch", roles=None, modules=(), check: bool = True, report: bool = True,
                    forward=None, backward=None):
    """Inside the scope, torch's all-to-all functions send MXFP4 (or the chosen formats) payloads,
    with the dispatch and the combine told apart.

    Formats ("mxfp4" | "fp8" | "bf16" | "native") per role and direction: ``dispatch`` (tokens to the
    experts), ``combine`` (expert outputs back), and the gradient of each. ``forward`` / ``backward``,
    when given, set both roles at once (one format for every exchange, and one for every gradient).

    Which call is which: a call made inside a role scope has that role. The scopes are
    :func:`exchange_role` in your code, the methods in :data:`KNOWN_ROLES` (torchtitan's token
    dispatcher), and ``roles={"dispatch": ["module:Class.method", ...], "combine": [...]}`` for another
    dispatcher's methods; those methods are wrapped for the scope. A call outside every scope takes
    the ``unmarked`` role. The drop-ins are autograd functions: a gradient travels in its role's
    gradient format wherever autograd runs it.

    Replaces the attributes listed in :data:`SWAPPED` (the functional ``all_to_all_single`` and
    ``all_to_all_single_autograd``, ``torch.distributed.nn.functional.all_to_all_single``, c10d's
    ``all_to_all_single`` and the list form ``all_to_all``, and ``spmd_types.all_to_all`` where that is
    imported) and, for code that imported one of those names into its own namespace, the same-named
    attributes of each module in ``modules`` (module objects or dotted names) that currently hold the
    original. Everything is restored on exit, also on error. Nesting works (the innermost formats
    apply). Not thread-safe: it changes module attributes process-wide. Import the dispatcher before
    entering the scope: a module first imported inside it gets its names back on exit, but its
    methods are marked only if it was imported when the scope began.

    Yields the :class:`SwapConfig`: ``calls`` counts each drop-in call by role and outcome, ``wire``
    the bytes sent per role, direction and format. With ``report`` (the default), leaving the scope
    warns once if a floating-point payload went through uncompressed (row size, ``async_op``, mixed
    lists), and if calls outside every role scope took the ``unmarked`` role
    while the two roles' formats differ, so a wire believed to be MXFP4 (or BF16) that was not is
    said. Calls made through a name the swap does not reach are not seen at all: no ``"compressed"``
    entry in ``calls`` says so.
    """
    if forward is not None:
        dispatch = combine = forward
    if backward is not None:
        dispatch_grad = combine_grad = backward
    cfg = SwapConfig(dispatch, combine, dispatch_grad, combine_grad, unmarked, check)
    targets = []
    for m, a, f in SWAPPED:
        if m in sys.modules or m.startswith("torch."):
            targets.append((importlib.import_module(m), a, f, (m, a)))
    specs = [(role, spec) for role, known in KNOWN_ROLES.items() for spec in known
             if spec.partition(":")[0] in sys.modules]
    for role, given in (roles or {}).items():
        specs.extend((Role(role), spec) for spec in ([given] if isinstance(given, str) else given))
    marks = [(role, *_resolve_method(spec)) for role, spec in specs]   # every spec checked before any patch
    # A marked method's module may call an all-to-all it imported by name (torchtitan's dispatcher).
    modules = list(modules) + [spec.partition(":")[0] for _, spec in specs]
    for mod in modules:
        mod = importlib.import_module(mod) if isinstance(mod, str) else mod
        for m, a, f in SWAPPED:
            if (m in sys.modules and getattr(mod, a, None) is _original(m, a) and mod is not sys.modules[m]
                    and all(t[0] is not mod or t[1] != a for t in targets)):
                targets.append((mod, a, f, (m, a)))
    patches = []   # (object, attribute, what it held; _MISSING: it held nothing of its own)
    imported_before = set(sys.modules)
    try:
        for mod, attr, fn, key in targets:
            _original(*key)
            patches.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, fn)
        for role, owner, name in marks:
            current = getattr(owner, name)
            if getattr(current, "__moe_fp4_role__", None) is role:
                continue   # already marked (an enclosing swap, or listed twice)
            patches.append((owner, name, vars(owner).get(name, _MISSING)))
            setattr(owner, name, _marked(current, role))
        _ACTIVE.append(cfg)
        yield cfg
    finally:
        if _ACTIVE and _ACTIVE[-1] is cfg:
            _ACTIVE.pop()
        for obj, attr, old in reversed(patches):
            if old is _MISSING:
                delattr(obj, attr)   # the method was inherited: the class gets none of its own back
            else:
                setattr(obj, attr, old)
        # A module first imported inside the scope that imported a swapped name took the drop-in:
        # give it torch's function, or it would send MXFP4 ever after.
        # (The module's own namespace only: getattr would run a lazy module's __getattr__.)
        for name in set(sys.modules) - imported_before:
            namespace = getattr(sys.modules.get(name), "__dict__", None) or {}
            for m, a, f in SWAPPED:
                if namespace.get(a) is f:
                    namespace[a] = _original(m, a)
    if not report:
        return
    if missed := cfg.uncompressed_floats():
        said = ", ".join(f"{fn} [{role}] ({why}): {n}" for (fn, role, why), n in sorted(missed.items()))
        warnings.warn(f"swap_all_to_all: floating-point all-to-all calls went through torch's function "
                      f"uncompressed, not in their role's wire format: {said}", RuntimeWarning, stacklevel=3)
    if (unmarked_n := cfg.unmarked_calls()) and cfg.formats(Role.DISPATCH) != cfg.formats(Role.COMBINE):
        warnings.warn(f"swap_all_to_all: {unmarked_n} all-to-all call(s) ran outside any dispatch/combine scope and "
                      f"were sent as the {cfg.unmarked.value} ({'/'.join(f.value for f in cfg.formats(cfg.unmarked))})"
                      f"; mark the other exchange with moe_fp4.exchange_role(...) or swap_all_to_all(roles=...)",
                      RuntimeWarning, stacklevel=3)


__all__ = [
    "ExchangePlan",
    "FLOAT_PASS_REASONS",
    "KNOWN_ROLES",
    "PASS_REASONS",
    "Received",
    "Role",
    "SWAPPED",
    "SwapConfig",
    "UNMARKED",
    "all_to_all",
    "c10d_all_to_all",
    "c10d_all_to_all_single",
    "exchange_role",
    "exchange_rows",
    "functional_all_to_all_single",
    "functional_all_to_all_single_autograd",
    "nn_all_to_all_single",
    "plan_exchange",
    "resolve_group",
    "spmd_all_to_all",
    "swap_all_to_all",
]
