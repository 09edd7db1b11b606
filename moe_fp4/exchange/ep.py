"""Expert-parallel (EP) token dispatch and combine for :class:`moe_fp4.model.moe.MoE`.

E experts are split over the ``world`` ranks of a group, E/world consecutive experts per rank. Per
layer and step:

1. :func:`plan_dispatch` — ONE count exchange (an all-to-all of [world, 1 + E/world] int64: the
   tokens this rank sends each rank, and its (token, expert) pair counts for that rank's experts),
   then ONE host sync for the split sizes. Nothing else in the layer waits for the host.
2. :func:`dispatch` — every token is quantized ONCE into a wire row (:mod:`moe_fp4.exchange.wire`), with its
   k router weights (float32) and expert ids (int32) appended, and sent AT MOST ONCE per
   destination rank, however many of its k experts live there (DeepEP's rule; one copy per
   (token, expert) pair would send up to k times the bytes). The receiver expands the rows into
   its local experts' groups, each padded to 128 rows, straight from the received bytes: an
   MXFP4Tensor (fp4) or FP8BlockTensor (fp8) for the experts' FP8 GEMM, bf16 rows for bf16.
3. The experts apply the router weights (:meth:`Dispatched.row_weights` into
   ``grouped_swiglu_experts(..., row_weights=...)``, a weighted SwiGLU); :func:`combine` sums each
   received row's local expert outputs, keeping nothing for backward, and sends one row back per
   (token, rank); the sender adds them up.

Backward runs the same exchanges in reverse: the combine's gradient goes out (``combine_grad``
format), the router-weight gradients ride in the dispatch gradient's rows (``dispatch_grad``
format) back to their tokens. A rank with no tokens takes part in every collective and returns
zero-row (correct, empty) gradients.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from moe_fp4.exchange.a2a import check_value_formats, exchange_rows, grad_carrier, resolve_group
from moe_fp4.exchange.ep_config import EPConfig
from moe_fp4.exchange.grad_rule import SQRT3, GradWireRule, grad_format
from moe_fp4.exchange.recipes import AUTO
from moe_fp4.exchange.wire import (
    DISPATCH_FORMATS,
    HIDDEN_MULTIPLE,
    UNQUANTIZED,
    OutputFormat,
    WireFormat,
    base_format,
    pack,
    row_bytes,
    unpack,
    unpack_sum,
    views,
)
from moe_fp4.formats.containers import FP8BlockTensor, MXFP4Tensor
from moe_fp4.formats.conversions import gather_sum
from moe_fp4.kernels.fp8 import m_major
from moe_fp4.kernels.grouped_gemm import GROUP_ALIGN
from moe_fp4.kernels.numerics import FP8_EXP_MIN, FP8_TILE


@dataclass(frozen=True)
class DispatchPlan:
    """What the count exchange decided (host ints) and the sender's row order (device).

    send_splits[d]: tokens this rank sends rank d; recv_splits[s]: rows it receives from rank s;
    local_counts[e]: (token, expert) pairs for local expert e over all sources; padded_counts: the
    same rounded up to 128; src_token: int64 [sum(send_splits)], the token of each sent row;
    token_slots: int64 [T, world] (a strided view), the sent row of each (token, destination rank), in
    ascending order (the row count where the token sends that rank nothing): what the combine and the
    dispatch's gradient sum per token (:func:`moe_fp4.formats.conversions.gather_sum`);
    counts_dev: int64 [E_local] local_counts on the device (no host -> device copy, which would sync).
    """

    group: object
    rank: int
    world: int
    num_local: int
    top_k: int
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    local_counts: tuple[int, ...]
    padded_counts: tuple[int, ...]
    src_token: torch.Tensor
    tokens: int
    counts_dev: torch.Tensor
    token_slots: torch.Tensor

    @property
    def received(self) -> int:
        return sum(self.recv_splits)

    @property
    def rows(self) -> int:
        return sum(self.padded_counts)


def counts_to_host(counts: torch.Tensor, while_waiting=None) -> list:
    """counts: an integer tensor (the routing's counts) -> its values as (nested) lists.

    On CUDA through a non-blocking copy into pinned memory and an event: ``while_waiting()`` is called
    after the copy is queued and before the host waits for it, so the GPU work it queues (work that does
    not need the counts, such as the layer's FP8 weights) runs while the host takes the counts and issues
    what follows them; a plain ``tolist()`` would leave the GPU idle from the copy to the host's next
    launch. Elsewhere ``while_waiting()`` then ``tolist()``."""
    if counts.device.type != "cuda":
        if while_waiting is not None:
            while_waiting()
        return counts.tolist()
    host = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
    host.copy_(counts, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(counts.device))   # the copy's stream, whatever device is current
    if while_waiting is not None:
        while_waiting()
    copied.synchronize()
    return host.tolist()


def plan_dispatch(experts: torch.Tensor, num_experts: int, group, while_waiting=None) -> DispatchPlan:
    """experts: int64 [T, k] global expert ids of each token's k slots -> DispatchPlan (one count
    exchange, one host sync; ``while_waiting`` queues GPU work for that sync, :func:`counts_to_host`)."""
    group = resolve_group(group)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise ValueError(f"expert parallelism: {num_experts} experts do not divide over {world} ranks")
    num_local = num_experts // world
    t, k = experts.shape
    dev = experts.device
    to_rank = torch.zeros(t, world, dtype=torch.bool, device=dev)
    to_rank.scatter_(1, experts // num_local, True)
    send_counts = to_rank.sum(0)
    # scatter_add, not bincount: bincount reads the maximum on the host (a sync) on CUDA.
    pairs = torch.zeros(num_experts, dtype=torch.int64, device=dev).scatter_add_(
        0, experts.flatten(), torch.ones(t * k, dtype=torch.int64, device=dev))
    msg = torch.cat([send_counts[:, None], pairs.view(world, num_local)], dim=1)
    ones = [1] * world
    got = exchange_rows(msg, ones, ones, group, role="count")                 # [world, 1 + El] by source
    host = counts_to_host(torch.cat([send_counts, got.flatten()]), while_waiting)
    send_splits = tuple(host[:world])
    table = [host[world + s * (1 + num_local): world + (s + 1) * (1 + num_local)] for s in range(world)]
    recv_splits = tuple(row[0] for row in table)
    local_counts = tuple(sum(row[1 + e] for row in table) for e in range(num_local))
    padded = tuple(-(-c // GROUP_ALIGN) * GROUP_ALIGN for c in local_counts)
    # Rows ordered by destination rank, then token: the True entries of to_rank^T in order, found by
    # a stable sort (its size is known from the counts, so no nonzero() and no second sync).
    flat = (~to_rank.t().reshape(-1)).to(torch.uint8)
    sent = sum(send_splits)
    picked = torch.argsort(flat, stable=True)[:sent]                          # rank * T + token of each row
    src_token = picked % max(t, 1)
    # The inverse, per (rank, token): rows are in rank order, so each token's rows ascend with the rank.
    slots = torch.full((world * t,), sent, dtype=torch.int64, device=dev)
    slots[picked] = torch.arange(sent, device=dev)
    return DispatchPlan(group, rank, world, num_local, k, send_splits, recv_splits, local_counts, padded,
                        src_token, t, got[:, 1:].sum(0), slots.view(world, t).t())


def _meta_offset(fmt: WireFormat, hidden: int, dtype) -> int:
    return -(-row_bytes(fmt, hidden, dtype) // 4) * 4


@dataclass(frozen=True)
class ReceivedRoute:
    """Receiver-side map between received rows (R of them) and expert rows (Rp, padded groups).

    src_row: int64 [Rp], the received row of each expert row (R for padding rows);
    row_pair: int64 [Rp], the received (row, slot) pair of each expert row, flattened (row * k +
    slot), R * k for padding rows: it picks each row's router weight out of the received [R, k];
    row_slots: int64 [R, k], the expert rows of each received row in ascending order, Rp for the slots
    whose expert is not here: what the combine and the dispatch's gradient sum per received row."""

    src_row: torch.Tensor
    row_pair: torch.Tensor
    row_slots: torch.Tensor


def _receiver_route(ids: torch.Tensor, weights: torch.Tensor, plan: DispatchPlan) -> ReceivedRoute:
    r, k = ids.shape
    dev = ids.device
    rows = plan.rows
    local = ids.long() - plan.rank * plan.num_local
    valid = (local >= 0) & (local < plan.num_local)
    key = torch.where(valid, local, plan.num_local).flatten()
    npairs = sum(plan.local_counts)
    order = torch.argsort(key, stable=True)[:npairs]                    # pairs grouped by local expert
    counts = plan.counts_dev
    padded = (counts + GROUP_ALIGN - 1) // GROUP_ALIGN * GROUP_ALIGN
    e = key[order]
    rank_in_group = torch.arange(npairs, device=dev) - (torch.cumsum(counts, 0) - counts)[e]
    dest = (torch.cumsum(padded, 0) - padded)[e] + rank_in_group
    src_row = torch.full((rows,), r, dtype=torch.int64, device=dev)
    src_row[dest] = order // k
    row_pair = torch.full((rows,), r * k, dtype=torch.int64, device=dev)
    row_pair[dest] = order
    # Sorted per row so that each row's expert rows are summed in ascending order (index_add_'s on CPU).
    row_slots = torch.full((r * k,), rows, dtype=torch.int64, device=dev)
    row_slots[order] = dest
    return ReceivedRoute(src_row, row_pair, row_slots.view(r, k).sort(dim=1).values)


def _gathered(recv: torch.Tensor, fmt: WireFormat, hidden: int, src: torch.Tensor, dtype):
    """recv: uint8 [R + 1, B] wire rows, the last one zero -> the rows ``src`` picks, in their wire format:
    MXFP4Tensor or FP8BlockTensor [len(src), H] (expert order; the zero row for padding rows)."""
    d, s = views(recv, fmt, hidden)
    if base_format(fmt) is WireFormat.MXFP4:
        return MXFP4Tensor(d.index_select(0, src), s.index_select(0, src), (src.numel(), hidden), dtype)
    # The zero row's scales must be valid powers of two: 2^-126, an all-zero tile's scale.
    views(recv[-1:], fmt, hidden)[1].fill_(2.0 ** FP8_EXP_MIN)
    return FP8BlockTensor(d.index_select(0, src), m_major(s.index_select(0, src)), (src.numel(), hidden), dtype)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weights, experts, plan: DispatchPlan, fmt: WireFormat, grad_fmt: WireFormat,
                expand: bool, rule: GradWireRule | None):
        t, hidden = x.shape
        k = plan.top_k
        off = _meta_offset(fmt, hidden, x.dtype)
        wire = torch.empty(t, off + 8 * k, dtype=torch.uint8, device=x.device)
        pack(x, fmt, out=wire)
        meta = wire[:, off:]
        meta.view(torch.float32)[:, :k] = weights.detach().float()
        meta.view(torch.int32)[:, k:] = experts.int()
        send = wire.index_select(0, plan.src_token)
        r = plan.received
        recv = torch.empty(r + 1, wire.shape[1], dtype=torch.uint8, device=x.device)
        recv[r].zero_()
        exchange_rows(send, plan.send_splits, plan.recv_splits, plan.group, out=recv[:r], role="dispatch")
        rmeta = recv[:r, off:]
        recv_w = rmeta.view(torch.float32)[:, :k].clone()
        ids = rmeta.view(torch.int32)[:, k:]
        route = _receiver_route(ids, recv_w, plan) if expand else None
        ctx.plan, ctx.route, ctx.grad_fmt, ctx.shape, ctx.dtype = plan, route, grad_fmt, (t, hidden), x.dtype
        ctx.rule = rule
        if not expand:
            local = ids.long() - plan.rank * plan.num_local
            local = torch.where((local >= 0) & (local < plan.num_local), local, plan.num_local)
            return unpack(recv[:r], fmt, hidden, OutputFormat.BF16, x.dtype), recv_w, local, None

        src = route.src_row                                                   # row r: the zero padding row
        if fmt in UNQUANTIZED:
            return views(recv, fmt, hidden, x.dtype)[0].index_select(0, src).to(x.dtype), recv_w, None, route
        if fmt is WireFormat.NVFP4:
            # Each received row to FP8 with its sender's tensor scale (one pass), then expanded; the zero
            # padding row (tensor scale 0) gives zeros with the scale 2^-126.
            f = unpack(recv, fmt, hidden, OutputFormat.FP8, x.dtype)
            xq = FP8BlockTensor(f.data.index_select(0, src), m_major(f.scale.index_select(0, src)),
                                (plan.rows, hidden), x.dtype)
        else:
            xq = _gathered(recv, fmt, hidden, src, x.dtype)       # MXFP4 or FP8 rows, in expert order
        return grad_carrier(plan.rows, hidden, x.dtype, x.device), recv_w, xq, route

    @staticmethod
    def backward(ctx, g_rows, g_w, *_):
        plan, route, fmt = ctx.plan, ctx.route, ctx.grad_fmt
        t, hidden = ctx.shape
        k, r = plan.top_k, plan.received
        # each received row's gradient: the sum of its expert rows' (float32, rounded once)
        sent = g_rows if route is None else gather_sum(g_rows, route.row_slots)
        off = _meta_offset(fmt, hidden, ctx.dtype)
        wire = torch.empty(r, off + 4 * k, dtype=torch.uint8, device=sent.device)
        pack(sent, fmt, out=wire, rank=plan.rank)
        if ctx.rule is not None:
            ctx.rule.record(sent, unpack(wire, fmt, hidden, OutputFormat.BF16, ctx.dtype))
        wire[:, off:].view(torch.float32)[:] = g_w
        back = exchange_rows(wire, plan.recv_splits, plan.send_splits, plan.group, role="dispatch_grad")
        # each token's gradient: the sum of what its destination ranks sent back (float32, rounded once)
        dx = unpack_sum(back, fmt, hidden, plan.token_slots, ctx.dtype)
        dw = gather_sum(back[:, off:].view(torch.float32), plan.token_slots)
        return dx, dw, None, None, None, None, None, None


class GradSlot:
    """Where :func:`combine`'s backward leaves the combine's gradient for the experts, quantized as it arrived,
    instead of decoding it to bf16 for the experts to quantize again.

    A quantized combine gradient feeds the experts' FC2 dgrad (FP8 rows) and wgrad (FP8 along tokens)
    and nothing else: for MXFP4 (mxfp4, mxfp4-sr) and FP8 rows the backward gathers the received rows
    into expert order in their own format (MXFP4Tensor or FP8BlockTensor [Rp, H], padding rows zero) and
    ``put``s them here, returning a zero-stride gradient for y; the experts (``grouped_swiglu_experts(...,
    grad_slot=)``) ``take`` them and convert them to their two GEMM operands directly, bit for bit what
    they would make of the decoded rows. Other formats leave the slot empty (the bf16 gradient then
    travels as usual). Valid only where the experts' output goes to :func:`combine` alone. It also carries
    the sqrt(3) rule's per-row rounding errors to the experts, whatever the format (``put(None, ...)``)."""

    FORMATS = (WireFormat.MXFP4, WireFormat.MXFP4_SR, WireFormat.FP8)

    def __init__(self):
        self.rows = None
        self.noise = None

    def put(self, rows, row_err2: torch.Tensor | None = None, rule: GradWireRule | None = None) -> None:
        """rows: the gradient rows in expert order; row_err2: float32 [Rp], each row's squared rounding error
        (0 for padding rows), with the ``rule`` the experts tell the FC2 weight gradient's noise."""
        self.rows = rows
        self.noise = None if row_err2 is None or rule is None else (row_err2, rule)

    def take(self):
        rows, self.rows = self.rows, None
        return rows

    def take_noise(self):
        """-> (row_err2, rule) put with the rows, or None."""
        noise, self.noise = self.noise, None
        return noise


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, route: ReceivedRoute, plan: DispatchPlan, fmt: WireFormat, grad_fmt: WireFormat,
                rule: GradWireRule | None, slot: GradSlot | None):
        hidden = y.shape[1]
        # Sum each received row's expert rows (already weighted by the experts): nothing saved.
        z = y if route is None else gather_sum(y, route.row_slots)
        back = exchange_rows(pack(z, fmt), plan.recv_splits, plan.send_splits, plan.group, role="combine")
        ctx.route, ctx.plan, ctx.grad_fmt, ctx.rule = route, plan, grad_fmt, rule
        ctx.slot = slot if route is not None and grad_fmt in GradSlot.FORMATS else None
        ctx.noise_slot = slot if route is not None and rule is not None else None
        return unpack_sum(back, fmt, hidden, plan.token_slots, y.dtype)

    @staticmethod
    def backward(ctx, g):
        route, plan, fmt = ctx.route, ctx.plan, ctx.grad_fmt
        hidden, r = g.shape[1], plan.received
        g_send = g.index_select(0, plan.src_token).contiguous()
        wire = pack(g_send, fmt, rank=plan.rank)
        err2 = None
        if ctx.rule is not None:
            err2 = ctx.rule.record(g_send, unpack(wire, fmt, hidden, OutputFormat.BF16, g.dtype))
        none = (None,) * 6
        row_err2 = None
        if err2 is not None and ctx.noise_slot is not None:
            # The sqrt(3) rule on the FC2 weight gradient: each row's squared rounding error goes beside it
            # (4 bytes a row, not counted as the payload's), for the experts to weigh by their FC2 input.
            e = torch.zeros(r + 1, dtype=torch.float32, device=g.device)
            exchange_rows(err2.contiguous().view(-1, 1), plan.send_splits, plan.recv_splits, plan.group,
                          out=e[:r].view(-1, 1))
            row_err2 = e.index_select(0, route.src_row)
        if ctx.slot is not None:
            got = torch.empty(r + 1, wire.shape[1], dtype=torch.uint8, device=g.device)
            got[r].zero_()
            exchange_rows(wire, plan.send_splits, plan.recv_splits, plan.group, out=got[:r], role="combine_grad")
            ctx.slot.put(_gathered(got, fmt, hidden, route.src_row, g.dtype), row_err2, ctx.rule)
            return (grad_carrier(plan.rows, hidden, g.dtype, g.device), *none)
        if row_err2 is not None:
            ctx.noise_slot.put(None, row_err2, ctx.rule)    # the rows go through autograd as bf16
        got = exchange_rows(wire, plan.send_splits, plan.recv_splits, plan.group, role="combine_grad")
        recv = unpack(got, fmt, hidden, OutputFormat.BF16, g.dtype)
        if route is None:
            return (recv, *none)
        recv = torch.cat([recv, recv.new_zeros(1, hidden)])
        return (recv.index_select(0, route.src_row), *none)


def _check_hidden(hidden: int, formats, fn: str) -> None:
    for f in formats:
        if hidden % HIDDEN_MULTIPLE[f]:
            raise ValueError(f"{fn}: H = {hidden} must be a multiple of {HIDDEN_MULTIPLE[f]} for {f.value} on the wire")


@dataclass(frozen=True)
class Dispatched:
    """The receiver's expert input.

    Expanded (the MoE layer): x: [Rp, H] bf16 rows grouped by local expert, 128-aligned (bf16
    dispatch), or a zero-stride gradient carrier of that shape (quantized dispatch); x_q: the
    MXFP4Tensor / FP8BlockTensor rows, or None; route: the row map :func:`combine` uses.
    Not expanded (``expand=False``, for expert code that takes k ids per row, e.g. Hugging Face's
    ``experts_forward``): x: the R received rows in the input's dtype (dequantized in one pass, on
    the graph); local_ids: int64 [R, k] local expert ids, ``num_local`` where the slot's expert
    lives on another rank; route None. weights: float32 [R, k] router weights (on the graph)."""

    x: torch.Tensor
    x_q: MXFP4Tensor | FP8BlockTensor | None
    weights: torch.Tensor
    route: ReceivedRoute | None
    local_ids: torch.Tensor | None = None

    def row_weights(self) -> torch.Tensor:
        """-> float32 [Rp]: the router weight of each expert row (0 for padding rows), on the graph
        of ``weights`` (expanded dispatch only)."""
        if self.route is None:
            raise ValueError("Dispatched.row_weights: only an expanded dispatch has expert rows")
        w = torch.cat([self.weights.flatten(), self.weights.new_zeros(1)])
        return w.index_select(0, self.route.row_pair)


def dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, plan: DispatchPlan,
             fmt: WireFormat, grad_fmt: WireFormat | str = WireFormat.BF16, expand: bool = True,
             rule: GradWireRule | None = None) -> Dispatched:
    """x: bf16 [T, H], weights: float32 [T, k], experts: int64 [T, k] -> Dispatched (one collective;
    backward: one collective). fmt: "mxfp4" | "fp8" | "nvfp4" | "bf16" | "native" on the wire (nvfp4 rows
    are converted to FP8 1x128 on arrival for the expert GEMMs, or decoded with ``expand=False``);
    grad_fmt: any format, the -sr ones included, or "auto" with its ``rule`` (:class:`GradWireRule`, which
    then also measures the sent gradient's norm over its noise)."""
    fmt, grad_fmt = WireFormat(fmt), grad_format(grad_fmt, rule)
    rule = rule if rule is not None and grad_fmt is rule.fmt else None
    check_value_formats("dispatch", fmt=fmt)
    if expand and fmt not in DISPATCH_FORMATS:
        raise ValueError(f"dispatch: fmt={fmt.value} cannot feed the expert GEMMs; use one of "
                         f"{', '.join(f.value for f in DISPATCH_FORMATS)}, or expand=False")
    _check_hidden(x.shape[1], (fmt, grad_fmt), "dispatch")
    if expand and fmt is WireFormat.NVFP4 and x.shape[1] % FP8_TILE:
        raise ValueError(f"dispatch: H = {x.shape[1]} must be a multiple of {FP8_TILE} for NVFP4 rows converted to "
                         f"the GEMMs' FP8 1x128")
    xe, recv_w, extra, route = _Dispatch.apply(x.contiguous(), weights, experts, plan, fmt, grad_fmt, expand, rule)
    if not expand:
        return Dispatched(xe, None, recv_w, None, extra)
    return Dispatched(xe, extra, recv_w, route)


def combine(y: torch.Tensor, sent: Dispatched, plan: DispatchPlan, fmt: WireFormat = WireFormat.BF16,
            grad_fmt: WireFormat | str = WireFormat.BF16, rule: GradWireRule | None = None,
            slot: GradSlot | None = None) -> torch.Tensor:
    """y: bf16 [Rp, H] expert outputs in the dispatched row order, already multiplied by their router
    weights (``grouped_swiglu_experts(..., row_weights=sent.row_weights())``), or, for a dispatch
    with ``expand=False``, [R, H] rows already reduced over their local experts with the router
    weights -> bf16 [T, H]: for each token the sum of its k experts' weighted outputs (one
    collective; backward: one collective). Nothing is saved for backward. grad_fmt, rule: as for
    :func:`dispatch`. slot: a :class:`GradSlot` the experts that made y were given, where y goes to
    this combine alone: a quantized gradient (mxfp4, mxfp4-sr, fp8) then reaches them as it arrived."""
    fmt, grad_fmt = WireFormat(fmt), grad_format(grad_fmt, rule)
    rule = rule if rule is not None and grad_fmt is rule.fmt else None
    check_value_formats("combine", fmt=fmt)
    _check_hidden(y.shape[1], (fmt, grad_fmt), "combine")
    return _Combine.apply(y, sent.route, plan, fmt, grad_fmt, rule, slot)


__all__ = ["AUTO", "DispatchPlan", "Dispatched", "EPConfig", "GradSlot", "GradWireRule", "ReceivedRoute", "SQRT3",
           "combine", "counts_to_host", "dispatch", "grad_format", "plan_dispatch"]
