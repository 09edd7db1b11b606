"""The drop-ins for torch's all-to-all functions, and the scope that swaps them in.

:func:`swap_all_to_all` replaces torch's ``all_to_all_single`` functions (functional collectives,
``torch.distributed.nn``, ``torch.distributed``, spmd_types) inside its scope with drop-ins that send
each exchange of an expert-parallel layer in its own wire formats through
:func:`moe_fp4.exchange.a2a.all_to_all`, so another stack's EP code (torchtitan's dispatcher,
Hugging Face's) sends MXFP4 without a rewrite. :func:`exchange_role` marks which exchange
(dispatch or combine) a call is where the swap does not know the dispatcher.

The drop-ins run eagerly only: inside a torch.compile region they raise RuntimeError (``_EAGER_ONLY``).

One idea at over 500 lines, kept whole: a drop-in for each of torch's all-to-all names and the scope that swaps
them in, all reading one role and format bookkeeping (the active config, the roles, the counts)."""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from moe_fp4.exchange.a2a import (
    _TORCH_C10D,
    _original,
    all_to_all,
    check_value_formats,
    fixed_wire_format,
    resolve_group,
)
from moe_fp4.exchange.wire import HIDDEN_MULTIPLE, WireFormat
from moe_fp4.formats.choices import Choice
from moe_fp4.formats.containers import HIGH_PRECISION_DTYPES


class Role(Choice):
    """Which exchange of an EP layer a call is: each has its own wire formats in :class:`SwapConfig`."""

    __parameter__ = "role"

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


_EAGER_ONLY = ("the swap's exchanges run eagerly only (they read their counts on the host and call c10d's "
               "collective). Compile without the swap (torch's own exchange; the converted experts compile under "
               "expert parallelism), or run the swapped step eagerly")


def _take(tensors, function: str, reason: str | None = None):
    """-> (config, role, formats or None): whether this call travels in its role's formats (None: it
    goes through torch's function). Counts the call either way. Refuses under torch.compile (module docstring)."""
    if _ACTIVE and torch.compiler.is_compiling():
        raise RuntimeError(f"moe_fp4.swap_all_to_all: {function} under torch.compile; {_EAGER_ONLY}")
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
_TORCH_DIST = "torch.distributed"
_SPMD_TYPES = "spmd_types"


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
        from spmd_types._mesh import _pg_for_axis  # a mesh axis name or MeshAxis -> its ProcessGroup

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


def _swapped_targets() -> list:
    """-> [(module, attribute, drop-in, torch's (module, name))] for the :data:`SWAPPED` attributes whose
    module is imported (torch's own always are)."""
    return [(importlib.import_module(m), a, f, (m, a)) for m, a, f in SWAPPED
            if m in sys.modules or m.startswith("torch.")]


def _role_specs(roles) -> list[tuple[Role, str]]:
    """-> [(role, "module:Class.method")] of the methods to mark: the :data:`KNOWN_ROLES` whose module is
    imported, then those ``roles`` names (a spec or a list of specs per role)."""
    specs = [(role, spec) for role, known in KNOWN_ROLES.items() for spec in known
             if spec.partition(":")[0] in sys.modules]
    for role, given in (roles or {}).items():
        specs.extend((Role(role), spec) for spec in ([given] if isinstance(given, str) else given))
    return specs


def _importer_targets(modules, targets) -> list:
    """modules: module objects or dotted names -> the targets (as :func:`_swapped_targets`') of their
    attributes that hold torch's original of a swapped name they imported into their own namespace,
    leaving out what ``targets`` already holds."""
    found = []
    for mod in modules:
        mod = importlib.import_module(mod) if isinstance(mod, str) else mod
        for m, a, f in SWAPPED:
            if (m in sys.modules and getattr(mod, a, None) is _original(m, a) and mod is not sys.modules[m]
                    and all(t[0] is not mod or t[1] != a for t in targets + found)):
                found.append((mod, a, f, (m, a)))
    return found


def _patch(targets, marks, patches: list) -> None:
    """Put each target's drop-in in place and wrap each marked (role, owner, name) method in its role,
    appending (object, attribute, what it held; _MISSING: nothing of its own) to ``patches`` as it goes,
    so that :func:`_restore` undoes a patch that stopped halfway."""
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


def _restore(patches) -> None:
    """Undo :func:`_patch`'s patches, last first."""
    for obj, attr, old in reversed(patches):
        if old is _MISSING:
            delattr(obj, attr)   # the method was inherited: the class gets none of its own back
        else:
            setattr(obj, attr, old)


def _unswap_new_imports(imported_before) -> None:
    """A module first imported inside the scope that imported a swapped name took the drop-in: give it
    torch's function, or it would send MXFP4 ever after. Reads each module's own namespace only
    (getattr would run a lazy module's ``__getattr__``)."""
    for name in set(sys.modules) - imported_before:
        namespace = getattr(sys.modules.get(name), "__dict__", None) or {}
        for m, a, f in SWAPPED:
            if namespace.get(a) is f:
                namespace[a] = _original(m, a)


def _report(cfg: SwapConfig) -> None:
    """The warnings of ``swap_all_to_all(report=True)`` on leaving the scope (stacklevel: the caller's
    ``with``, through this function, the generator and contextlib's ``__exit__``)."""
    if missed := cfg.uncompressed_floats():
        said = ", ".join(f"{fn} [{role}] ({why}): {n}" for (fn, role, why), n in sorted(missed.items()))
        warnings.warn(f"swap_all_to_all: floating-point all-to-all calls went through torch's function "
                      f"uncompressed, not in their role's wire format: {said}", RuntimeWarning, stacklevel=4)
    if (unmarked_n := cfg.unmarked_calls()) and cfg.formats(Role.DISPATCH) != cfg.formats(Role.COMBINE):
        warnings.warn(f"swap_all_to_all: {unmarked_n} all-to-all call(s) ran outside any dispatch/combine scope and "
                      f"were sent as the {cfg.unmarked.value} ({'/'.join(f.value for f in cfg.formats(cfg.unmarked))})"
                      f"; mark the other exchange with moe_fp4.exchange_role(...) or swap_all_to_all(roles=...)",
                      RuntimeWarning, stacklevel=4)


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
    targets = _swapped_targets()
    specs = _role_specs(roles)
    marks = [(role, *_resolve_method(spec)) for role, spec in specs]   # every spec checked before any patch
    # A marked method's module may call an all-to-all it imported by name (torchtitan's dispatcher).
    targets += _importer_targets([*modules, *(spec.partition(":")[0] for _, spec in specs)], targets)
    patches = []
    imported_before = set(sys.modules)
    try:
        _patch(targets, marks, patches)
        _ACTIVE.append(cfg)
        yield cfg
    finally:
        if _ACTIVE and _ACTIVE[-1] is cfg:
            _ACTIVE.pop()
        _restore(patches)
        _unswap_new_imports(imported_before)
    if report:
        _report(cfg)


__all__ = ["FLOAT_PASS_REASONS", "KNOWN_ROLES", "PASS_REASONS", "Role", "SWAPPED", "SwapConfig", "UNMARKED",
           "c10d_all_to_all", "c10d_all_to_all_single", "exchange_role", "functional_all_to_all_single",
           "functional_all_to_all_single_autograd", "nn_all_to_all_single", "spmd_all_to_all", "swap_all_to_all"]
