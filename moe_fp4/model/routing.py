"""Tokens to their experts' rows and back: :func:`make_routing` (a dropless permutation of the (token, slot)
pairs by expert, each expert's group padded to 128 rows; device counts with no host sync, or one host sync
for exact sizes), :func:`permute`, :func:`row_weights` and :func:`unpermute` (gathers both ways, no
atomics), and :func:`routed_swiglu_experts`, the experts over tokens and their top-k choice: what the MoE
layer (:mod:`moe_fp4.model.moe`) runs on one rank and what other stacks' MoE blocks call
(:mod:`moe_fp4.integrations.hf_experts`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_fp4.exchange.ep import counts_to_host
from moe_fp4.formats.conversions import gather_sum
from moe_fp4.gemm.engines import in_graph_region
from moe_fp4.model.experts import (
    TOKEN_ALIGN,
    Precision,
    gather_expert_tokens,
    grouped_swiglu_experts,
    quantize_expert_tokens,
)
from moe_fp4.model.replay import once
from moe_fp4.saved.hook import StorageFormat


@dataclass(frozen=True)
class Routing:
    """Where each (token, slot) pair goes.

    weights: float32 [T, k] combine weights; experts: int64 [T, k] expert ids;
    dest: int64 [T*k] row of pair (t, j) (flattened t*k + j) in the permuted, padded buffer;
    counts: tokens per expert, padded_counts: rounded up to 128, as E ints (host counts) or int64 [E] tensors
    on the device (device counts, never read on the host);
    rows: the buffer's rows: sum(padded_counts) with host counts, else the static bound
    :func:`rows_bound` (the rows past the groups are a tail of padding rows);
    src_row: int64 [rows], the token of each row (T for padding rows): permute and unpermute's
    backward are gathers through it (no scatter, no atomics); dropped: pairs whose expert id is >= E (an
    expert on another rank: Hugging Face's EP sentinel), which get no row (their dest is ``rows``) and add
    nothing to their token's sum; with device counts their number is not read (None).
    """

    weights: torch.Tensor
    experts: torch.Tensor
    dest: torch.Tensor
    counts: tuple[int, ...] | torch.Tensor
    padded_counts: tuple[int, ...] | torch.Tensor
    src_row: torch.Tensor
    dropped: int | None = 0

    @property
    def rows(self) -> int:
        return self.src_row.shape[0]

    @property
    def on_device(self) -> bool:
        """Whether the counts are device tensors (nothing was read on the host)."""
        return isinstance(self.padded_counts, torch.Tensor)


def rows_bound(pairs: int, num_experts: int, align: int = TOKEN_ALIGN) -> int:
    """The most rows ``pairs`` (token, expert) pairs can take once each of ``num_experts`` groups is padded to
    ``align``: sum(ceil(c_e / align) * align) <= pairs + E (align - 1), a multiple of align. The static size of
    the device-count buffers."""
    return (pairs + num_experts * (align - 1)) // align * align


def host_counts_here(x: torch.Tensor) -> bool:
    """Whether a routing of ``x``'s tokens may read its counts on the host: in eager mode, not under torch.compile
    or CUDA-graph capture (neither can wait for the host)."""
    return not in_graph_region(x)


def make_routing(weights: torch.Tensor, experts: torch.Tensor, num_experts: int, align: int = TOKEN_ALIGN,
                 while_waiting=None, host_counts: bool = True) -> Routing:
    """weights float32 [T, k], experts int64 [T, k] -> Routing (one host sync for the per-expert counts, or
    with ``host_counts=False`` none: device counts over :func:`rows_bound` rows, what torch.compile and CUDA
    graphs need). Expert ids >= num_experts are dropped (see :class:`Routing`); ids must not be negative.

    ``while_waiting``: a callable that queues GPU work independent of the routing (the layer's FC2
    weights and quantized input), run between the counts' copy to the host and the wait for it
    (:func:`moe_fp4.exchange.ep.counts_to_host`); called once, and not again when a checkpoint's recomputation
    replays the routing."""
    # One bucket per expert and a last one for the dropped pairs, which gets no rows.
    flat = experts.flatten().clamp(max=num_experts)
    order = torch.argsort(flat, stable=True)
    # scatter_add, not bincount: bincount reads the maximum on the host (a sync) on CUDA.
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + align - 1) // align * align
    # zero_ on a view: `padded[E] = 0` copies a host scalar, a synchronous pageable copy on CUDA
    padded[num_experts:].zero_()
    start = torch.cumsum(counts, 0) - counts
    pad_start = torch.cumsum(padded, 0) - padded      # the dropped bucket's start is the row count
    sorted_e = flat[order]
    rank = (torch.arange(flat.numel(), device=flat.device) - start[sorted_e]) * (sorted_e < num_experts)
    dest = torch.empty_like(flat)
    t, k = experts.shape
    if not host_counts:
        if while_waiting is not None:
            while_waiting()
        rows = rows_bound(t * k, num_experts, align)
        # a dropped pair's dest is one past the rows, whatever the groups take
        dest[order] = torch.where(sorted_e < num_experts, pad_start[sorted_e] + rank, rows)
        src_row = torch.full((rows + 1,), t, dtype=torch.int64, device=flat.device)
        src_row[dest] = torch.arange(t * k, device=flat.device) // k
        return Routing(weights, experts, dest, counts[:num_experts], padded[:num_experts], src_row[:rows], None)
    dest[order] = pad_start[sorted_e] + rank
    # the host sync: not repeated by a recomputation
    host = once(lambda: counts_to_host(torch.stack([counts, padded]), while_waiting))
    rows, dropped = sum(host[1]), host[0][num_experts]
    # one slot past the rows takes the dropped pairs' writes
    src_row = torch.full((rows + (dropped > 0),), t, dtype=torch.int64, device=flat.device)
    src_row[dest] = torch.arange(t * k, device=flat.device) // k
    return Routing(weights, experts, dest, tuple(host[0][:num_experts]), tuple(host[1][:num_experts]),
                   src_row[:rows], dropped)


def _gather_rows(x: torch.Tensor, src_row: torch.Tensor) -> torch.Tensor:
    """x: [T, H] -> [rows, H] = x[src_row], zero where src_row == T."""
    return torch.cat([x, x.new_zeros(1, x.shape[1])]).index_select(0, src_row)


def _sum_slots(y: torch.Tensor, dest: torch.Tensor, tokens: int, k: int) -> torch.Tensor:
    """y: [rows, H] -> [T, H]: sum over slots j = 0..k-1 of y[dest(t, j)] in float32, rounded once; a dropped
    pair's dest (== rows) adds nothing. One pass (``gather_sum``): no [T, k, H] copy, no zero row appended."""
    return gather_sum(y, dest.view(tokens, k))


class _Permute(torch.autograd.Function):
    """Tokens to their (token, slot) rows and back: two gathers, keeping only the int64 row maps (the
    autograd of index_copy / index_select would keep [T*k, H] or scatter-add with atomics)."""

    @staticmethod
    def forward(ctx, x, dest, src_row, k, values):
        ctx.save_for_backward(dest, src_row)
        ctx.tokens, ctx.k = x.shape[0], k
        if not values:   # the experts read their rows from x_q: only the gradient's path is needed
            return x.new_zeros(()).expand(src_row.shape[0], x.shape[1])
        return _gather_rows(x, src_row)

    @staticmethod
    def backward(ctx, g):
        dest, _ = ctx.saved_tensors
        return _sum_slots(g, dest, ctx.tokens, ctx.k), None, None, None, None


class _Unpermute(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, dest, src_row, tokens, k):
        ctx.save_for_backward(src_row)
        return _sum_slots(y, dest, tokens, k)

    @staticmethod
    def backward(ctx, g):
        (src_row,) = ctx.saved_tensors
        return _gather_rows(g, src_row), None, None, None, None


def permute(x: torch.Tensor, routing: Routing, values: bool = True) -> torch.Tensor:
    """x: [T, H] -> [rows, H]: each (token, slot) pair's row at routing.dest, padding rows zero. With
    ``values=False`` only its gradient's path: a zero-stride [rows, H] of zeros, for experts that take
    their rows from ``x_q`` (backward is the same sum over slots)."""
    return _Permute.apply(x, routing.dest, routing.src_row, routing.experts.shape[1], values)


def row_weights(routing: Routing) -> torch.Tensor:
    """-> float32 [rows]: the router weight of each permuted row (0 for padding rows), on the graph of
    ``routing.weights``: the experts apply it (``grouped_swiglu_experts(..., row_weights=...)``)."""
    w = routing.weights.flatten()
    # a dropped pair's weight lands in one slot past the rows, cut off
    spare = routing.dropped is None or routing.dropped > 0
    return w.new_zeros(routing.rows + spare).scatter(0, routing.dest, w)[:routing.rows]


def unpermute(y: torch.Tensor, routing: Routing) -> torch.Tensor:
    """y: [rows, H] expert outputs already weighted by the experts -> [T, H]: sum over slots j of
    y[dest(t, j)] (summed in float32, rounded once). Keeps only the row map for backward."""
    return _Unpermute.apply(y, routing.dest, routing.src_row, *routing.experts.shape)


def routed_swiglu_experts(x: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, w13: torch.Tensor,
                          w2: torch.Tensor, precision="fp8", storage: str | StorageFormat = "mxfp4",
                          recompute_swiglu: bool = False, fp8_weights=None) -> torch.Tensor:
    """SwiGLU experts over tokens, each token sent to its top-k experts and their outputs summed with its weights.

    x:             bf16 [T, H] tokens.
    top_k_index:   int64 [T, k] expert ids; an id >= E is a slot with no expert here (dropped: adds nothing).
    top_k_weights: float [T, k] (any float dtype) router weights, differentiable.
    w13, w2, precision, storage, recompute_swiglu, fp8_weights: as
                   :func:`moe_fp4.model.experts.grouped_swiglu_experts`.
    -> bf16 [T, H]: sum over j of top_k_weights[t, j] * expert_{top_k_index[t, j]}(x[t]).

    The MoE layer's single-rank path: one host sync for the counts in eager mode, none under torch.compile and
    CUDA-graph capture (device counts over a static bound of rows), the FC1 operand quantized per
    token and gathered to the experts' rows (fp4 keeps its MXFP4 copy per token), the router weights applied
    inside the experts, the combine an unweighted sum in float32 rounded once."""
    if x.dim() != 2 or x.dtype != torch.bfloat16:
        raise ValueError(f"routed_swiglu_experts: x must be bfloat16 [T, H], got {x.dtype} {tuple(x.shape)}")
    if top_k_index.dim() != 2 or top_k_index.shape[0] != x.shape[0] or top_k_index.dtype not in (torch.int64,
                                                                                                  torch.int32):
        raise ValueError(f"routed_swiglu_experts: top_k_index must be int64 [{x.shape[0]}, k], got "
                         f"{top_k_index.dtype} {tuple(top_k_index.shape)}")
    if tuple(top_k_weights.shape) != tuple(top_k_index.shape) or not top_k_weights.is_floating_point():
        raise ValueError(f"routed_swiglu_experts: top_k_weights must be float {tuple(top_k_index.shape)}, got "
                         f"{top_k_weights.dtype} {tuple(top_k_weights.shape)}")
    precision, storage = Precision(precision), StorageFormat(storage)
    routing = make_routing(top_k_weights.float(), top_k_index.long(), w13.shape[0],
                           host_counts=host_counts_here(x))
    tokens = quantize_expert_tokens(x, precision, storage)
    x_q, x_saved, x_saved_rows = (None, None, None) if tokens is None else gather_expert_tokens(tokens,
                                                                                               routing.src_row)
    y = grouped_swiglu_experts(permute(x, routing, values=x_q is None), w13, w2, routing.padded_counts, precision,
                               x_q=x_q, row_weights=row_weights(routing), recompute_swiglu=recompute_swiglu,
                               storage=storage, x_saved=x_saved, x_saved_rows=x_saved_rows, fp8_weights=fp8_weights)
    return unpermute(y, routing)


__all__ = ["Routing", "host_counts_here", "make_routing", "permute", "routed_swiglu_experts", "row_weights",
           "rows_bound", "unpermute"]
