"""Expert-parallel all-to-all that sends MXFP4 (or FP8) payloads, autograd-aware, and drop-ins for
torch's ``all_to_all_single`` functions.

:func:`all_to_all` moves rows like ``torch.distributed.all_to_all_single`` (``input_split_sizes[d]``
rows go to rank d, ``output_split_sizes[s]`` rows come from rank s; None = equal splits). Values
travel in the ``forward`` wire format (:mod:`moe_fp4.wire`: one uint8 message per call, data and
scales per row), their gradients back in the ``backward`` format, and the receiver returns
``output``: the input's float dtype, an FP8BlockTensor, or the MXFP4Tensor as received.

Before moving data, every call runs one small count exchange (an all-gather of each rank's splits,
row size, formats and dtype) and checks that all ranks agree: a mismatch raises the same ValueError
on every rank instead of hanging or scrambling rows. That costs one tiny collective and one host
sync; ``check=False`` skips it for loops that already exchanged their counts (the EP layer does).
"""

from __future__ import annotations

import contextlib
import importlib
import math
import warnings
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
import torch.distributed as dist

from moe_fp4.formats import HIGH_PRECISION_DTYPES, FP8BlockTensor, MXFP4Tensor
from moe_fp4.wire import HIDDEN_MULTIPLE, OutputFormat, WireFormat, pack, unpack

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


def exchange_rows(send: torch.Tensor, input_splits, output_splits, group) -> torch.Tensor:
    """send: uint8 (or any dtype the backend takes) [S, B], rows grouped by destination rank
    -> [R, B] rows grouped by source rank (R = sum(output_splits)). One collective, no checks."""
    out = send.new_empty((sum(output_splits), *send.shape[1:]))
    dist.all_to_all_single(out, send.contiguous(), list(output_splits), list(input_splits), group=group)
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

    def __post_init__(self):
        for name in ("forward", "backward"):
            object.__setattr__(self, name, WireFormat(getattr(self, name)))
        object.__setattr__(self, "output", OutputFormat(self.output))
        if self.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(f"ExchangePlan: dtype must be bfloat16, float16 or float32, got {self.dtype}")

    def reversed(self, fmt: WireFormat) -> "ExchangePlan":
        """The gradient's exchange: splits swapped, ``fmt`` on the wire, back to the float dtype."""
        return ExchangePlan(self.group, self.output_splits, self.input_splits, self.hidden, self.dtype, fmt, fmt,
                            OutputFormat.BF16)


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
    wire = exchange_rows(pack(x, plan.forward), plan.input_splits, plan.output_splits, plan.group)
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
               backward="bf16", output="bf16", check: bool = True):
    """Expert-parallel all-to-all of rows with quantized transport.

    x: bf16/fp16/fp32 [N, H] (autograd flows through), or an FP8BlockTensor / MXFP4Tensor [N, H]
       (sent as is when its format is the wire format; no gradient).
    output_split_sizes / input_split_sizes: rows per rank, as in ``torch.distributed.all_to_all_single``
       (None = equal splits). group: ProcessGroup (default: the world), DeviceMesh or group name.
    forward / backward: wire format of the values / of their gradients: "mxfp4" | "fp8" | "bf16"
       (H must be a multiple of 32 for mxfp4, 128 for fp8).
    output: "bf16" -> x's float dtype [M, H]; "fp8" -> :class:`Received` (FP8BlockTensor, carrier);
       "mxfp4" -> :class:`Received` (MXFP4Tensor as received, carrier). M = sum(output_split_sizes).
    check: run the count exchange that validates the splits, sizes and formats on every rank.
    """
    plan = plan_exchange(x, output_split_sizes, input_split_sizes, group, forward, backward, output, check)
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
# Drop-ins for torch's all_to_all_single functions, and a context manager that swaps them in.


@dataclass(frozen=True)
class SwapConfig:
    """Formats the drop-ins use. Tensors that cannot travel in ``forward`` (integer dtypes, 1-D
    tensors, rows not a multiple of 32 for mxfp4 / 128 for fp8) go through torch's own function.

    ``calls`` counts what the drop-ins did while this config was active: ``calls[(function, outcome)]``
    with outcome ``"compressed"`` or the reason a call went through torch's function unchanged
    (:data:`PASS_REASONS`)."""

    forward: WireFormat = WireFormat.MXFP4
    backward: WireFormat = WireFormat.BF16
    check: bool = True
    calls: dict = field(default_factory=dict, compare=False, hash=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "forward", WireFormat(self.forward))
        object.__setattr__(self, "backward", WireFormat(self.backward))

    def count(self, function: str, outcome: str) -> None:
        key = (function, outcome)
        self.calls[key] = self.calls.get(key, 0) + 1

    def uncompressed_floats(self) -> dict:
        """{(function, reason): calls} of floating-point payloads that went through uncompressed."""
        return {k: n for k, n in self.calls.items() if k[1] in FLOAT_PASS_REASONS}


# Why a drop-in handed a call to torch's function. Integer tensors and 1-D vectors are the count
# exchanges an EP loop makes (expected); the others are floating-point payloads that did not travel
# in the wire format, which swap_all_to_all(report=True) warns about.
PASS_REASONS = ("integer or 1-D", "row size", "async_op", "mixed shapes or dtypes")
FLOAT_PASS_REASONS = PASS_REASONS[1:]


_ACTIVE: list[SwapConfig] = []


def _config() -> SwapConfig:
    return _ACTIVE[-1] if _ACTIVE else SwapConfig()


def _pass_reason(t: torch.Tensor, cfg: SwapConfig) -> str | None:
    """None when t can travel in cfg's formats, else why not (one of PASS_REASONS)."""
    if not isinstance(t, torch.Tensor) or t.dtype not in HIGH_PRECISION_DTYPES or t.dim() < 2:
        return PASS_REASONS[0]
    row = math.prod(t.shape[1:])
    if row == 0 or row % max(HIDDEN_MULTIPLE[cfg.forward], HIDDEN_MULTIPLE[cfg.backward]):
        return PASS_REASONS[1]
    return None


def _quantizable(t: torch.Tensor, cfg: SwapConfig, function: str) -> bool:
    """Whether t travels in cfg's formats; counts the call either way."""
    reason = _pass_reason(t, cfg)
    cfg.count(function, reason or "compressed")
    return reason is None


def _as_rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], math.prod(t.shape[1:]))  # not -1: a [0, H] tensor has no -1 to infer


def _dropin(t, output_split_sizes, input_split_sizes, group, cfg: SwapConfig) -> torch.Tensor:
    out = all_to_all(_as_rows(t), output_split_sizes, input_split_sizes, group, forward=cfg.forward,
                     backward=cfg.backward, output="bf16", check=cfg.check)
    return out.view(out.shape[0], *t.shape[1:])


_TORCH_FUNCOL = "torch.distributed._functional_collectives"
_TORCH_NN = "torch.distributed.nn.functional"
_TORCH_C10D = "torch.distributed.distributed_c10d"
_TORCH_DIST = "torch.distributed"
_originals: dict[tuple[str, str], object] = {}


def _original(module: str, name: str):
    key = (module, name)
    if key not in _originals:
        _originals[key] = getattr(importlib.import_module(module), name)
    return _originals[key]


def functional_all_to_all_single(self, output_split_sizes, input_split_sizes, group, tag: str = ""):
    """Drop-in for ``torch.distributed._functional_collectives.all_to_all_single``: same signature
    and rows, values sent in the active :class:`SwapConfig`'s format. Differentiable, as torch's is
    (its ``all_to_all_single_autograd`` calls this very name, so a swapped-in function without
    autograd would drop the gradient there too)."""
    cfg = _config()
    if not _quantizable(self, cfg, "all_to_all_single"):
        return _original(_TORCH_FUNCOL, "all_to_all_single")(self, output_split_sizes, input_split_sizes, group, tag)
    return _dropin(self, output_split_sizes, input_split_sizes, group, cfg)


def functional_all_to_all_single_autograd(self, output_split_sizes, input_split_sizes, group, tag: str = ""):
    """Drop-in for ``torch.distributed._functional_collectives.all_to_all_single_autograd`` (what
    torchtitan's token dispatcher calls): same signature, gradients back in ``backward`` format."""
    cfg = _config()
    if not _quantizable(self, cfg, "all_to_all_single_autograd"):
        return _original(_TORCH_FUNCOL, "all_to_all_single_autograd")(
            self, output_split_sizes, input_split_sizes, group, tag)
    return _dropin(self, output_split_sizes, input_split_sizes, group, cfg)


def nn_all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
    """Drop-in for ``torch.distributed.nn.functional.all_to_all_single``: fills ``output`` [M, ...]
    and returns it, differentiable with respect to ``input``."""
    cfg = _config()
    if not _quantizable(input, cfg, "nn.all_to_all_single"):
        return _original(_TORCH_NN, "all_to_all_single")(output, input, output_split_sizes, input_split_sizes,
                                                         dist.group.WORLD if group is None else group)
    if output_split_sizes is None:
        world = dist.get_world_size(resolve_group(group))
        output_split_sizes = [output.shape[0] // world] * world
    out = _dropin(input, output_split_sizes, input_split_sizes, group, cfg)
    if tuple(out.shape) != tuple(output.shape):
        raise ValueError(f"all_to_all_single: output has shape {tuple(output.shape)}, the exchange gives "
                         f"{tuple(out.shape)}")
    # torch's version writes into `output` and returns it; the returned tensor carries the gradient.
    with torch.no_grad():
        output.copy_(out)
    return out


def c10d_all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """Drop-in for ``torch.distributed.all_to_all``, the list form: ``input_tensor_list[d]`` goes to rank
    d, ``output_tensor_list[s]`` is filled with what rank s sent. The rows of all inputs travel as one
    exchange in the active :class:`SwapConfig`'s forward format (any row counts, also on gloo, whose
    own list all-to-all needs equal sizes) and are written into the outputs in their dtype. Like
    torch's, it is not differentiable and returns None. Passed to torch's function unchanged (and
    counted): ``async_op=True`` (no work handle to give back), tensors that cannot travel quantized,
    and lists whose tensors differ in dtype or row shape."""
    cfg = _config()
    tensors = list(input_tensor_list) + list(output_tensor_list)
    reason = PASS_REASONS[2] if async_op else None
    for t in tensors:
        reason = reason or _pass_reason(t, cfg)
    if reason is None and len({(t.dtype, tuple(t.shape[1:])) for t in tensors}) != 1:
        reason = PASS_REASONS[3]
    cfg.count("all_to_all", reason or "compressed")
    if reason is not None:
        return _original(_TORCH_C10D, "all_to_all")(output_tensor_list, input_tensor_list, group=group,
                                                    async_op=async_op)
    sends = [t.shape[0] for t in input_tensor_list]
    recvs = [t.shape[0] for t in output_tensor_list]
    with torch.no_grad():
        x = torch.cat([_as_rows(t) for t in input_tensor_list])
        out = all_to_all(x, recvs, sends, group, forward=cfg.forward, backward=cfg.backward, output="bf16",
                         check=cfg.check)
        for o, part in zip(output_tensor_list, out.split(recvs)):
            o.copy_(part.view(o.shape))
    return None


# (module, attribute, replacement) that swap_all_to_all touches. torch.distributed re-exports
# distributed_c10d's all_to_all: both names are replaced.
SWAPPED = (
    (_TORCH_FUNCOL, "all_to_all_single", functional_all_to_all_single),
    (_TORCH_FUNCOL, "all_to_all_single_autograd", functional_all_to_all_single_autograd),
    (_TORCH_NN, "all_to_all_single", nn_all_to_all_single),
    (_TORCH_C10D, "all_to_all", c10d_all_to_all),
    (_TORCH_DIST, "all_to_all", c10d_all_to_all),
)


@contextlib.contextmanager
def swap_all_to_all(forward="mxfp4", backward="bf16", check: bool = True, modules=(), report: bool = True):
    """Inside the scope, torch's all-to-all functions send MXFP4 (or ``forward``) payloads.

    Replaces the attributes listed in :data:`SWAPPED` (``torch.distributed._functional_collectives.
    all_to_all_single`` and ``all_to_all_single_autograd``, ``torch.distributed.nn.functional.
    all_to_all_single``, ``torch.distributed.all_to_all``, the list form) and, for code that imported
    one of those names into its own namespace, the same-named attributes of each module in ``modules``
    (module objects or dotted names) that currently hold torch's function. Everything is restored on
    exit, also on error. Nesting works (the innermost formats apply). Not thread-safe: it changes
    module attributes process-wide.

    Yields the :class:`SwapConfig`, whose ``calls`` count each drop-in call by outcome. With ``report``
    (the default), leaving the scope warns once if any floating-point payload went through
    uncompressed (row size, ``async_op``, mixed lists), so a wire believed to be MXFP4 that was not
    is said. Calls made through a name the swap does not reach are not seen at all: count them with
    ``calls`` (no ``"compressed"`` entry means nothing went through the drop-ins).
    """
    cfg = SwapConfig(forward, backward, check)
    patches = []
    targets = [(importlib.import_module(m), a, f, (m, a)) for m, a, f in SWAPPED]
    for mod in modules:
        mod = importlib.import_module(mod) if isinstance(mod, str) else mod
        for m, a, f in SWAPPED:
            if getattr(mod, a, None) is _original(m, a):
                targets.append((mod, a, f, (m, a)))
    try:
        for mod, attr, fn, key in targets:
            _original(*key)
            patches.append((mod, attr, getattr(mod, attr)))
            setattr(mod, attr, fn)
        _ACTIVE.append(cfg)
        yield cfg
    finally:
        if _ACTIVE and _ACTIVE[-1] is cfg:
            _ACTIVE.pop()
        for mod, attr, old in reversed(patches):
            setattr(mod, attr, old)
    if report and (missed := cfg.uncompressed_floats()):
        said = ", ".join(f"{fn} ({why}): {n}" for (fn, why), n in sorted(missed.items()))
        warnings.warn(f"swap_all_to_all: floating-point all-to-all calls went through torch's function "
                      f"uncompressed, not in {cfg.forward.value}: {said}", RuntimeWarning, stacklevel=3)


__all__ = [
    "ExchangePlan",
    "Received",
    "SWAPPED",
    "SwapConfig",
    "FLOAT_PASS_REASONS",
    "PASS_REASONS",
    "all_to_all",
    "c10d_all_to_all",
    "exchange_rows",
    "functional_all_to_all_single",
    "functional_all_to_all_single_autograd",
    "nn_all_to_all_single",
    "plan_exchange",
    "resolve_group",
    "swap_all_to_all",
]
