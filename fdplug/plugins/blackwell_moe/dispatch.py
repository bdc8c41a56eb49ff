"""Token bookkeeping for a grouped-GEMM MoE backend built on DeepGEMM-style kernels (Blackwell FP8 MoE).

Routing gives every token K expert ids (`topk_ids` [T, K]); each (token, k) pair is an *assignment*,
numbered flat as t * K + k. DeepGEMM's grouped GEMMs do not take a list of assignments: they take
the rows of all experts laid out in one tensor, in one of two layouts.

Contiguous layout (`m_grouped_*_gemm_*_contiguous`): the rows of expert 0, then those of expert 1,
and so on, each expert's block padded up to a multiple of `ALIGNMENT` rows, so that no M tile of the
kernel straddles two experts. A per-row int32 `m_indices` names each row's expert, -1 for padding
rows, which the kernel skips. The total M is data dependent, so building it costs one host sync;
it suits prefill, where the batch is large and the padding (under `ALIGNMENT` rows per expert) is small.

Masked layout (`m_grouped_*_gemm_*_masked`): a fixed [E, capacity] grid of rows; expert e uses its
first `masked_m[e]` rows and the kernel ignores the rest. Every shape is fixed by the capacity, so
this layout is what decode steps under CUDA graphs use; it wastes rows when the load is uneven.

Within an expert, rows always follow increasing flat assignment order (a stable sort), so that both
layouts and every backend see the same row order. The plans below are pure Paddle tensor ops: they
run on the CPU here and on the GPU unchanged, syncing with the host only to validate ids and where a
buffer size must be known. `gather_rows` builds a layout from the token activations and `combine`
sums each token's expert outputs back, weighted, in k order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle

ALIGNMENT = 128  # DeepGEMM's M alignment for the contiguous layout (get_mk_alignment_for_contiguous_layout)


@dataclass(frozen=True, slots=True)
class ContiguousPlan:
    """Contiguous layout: the rows of expert 0, then expert 1, ..., each expert's block padded to a
    multiple of `alignment` rows."""

    rows: Any  # [T*K] int64: padded row that assignment (t, k) (flat index t*K + k) occupies
    token_of_row: Any  # [M] int64: source token of each row (padding rows: 0, any valid index)
    m_indices: Any  # [M] int32: expert id of each row, -1 for padding rows (DeepGEMM's grouped layout)
    counts: Any  # [E] int64: assignments per expert (before padding)
    num_rows: int  # M, a multiple of alignment (0 when T == 0)


@dataclass(frozen=True, slots=True)
class MaskedPlan:
    """Masked layout: a fixed [E, capacity] grid of rows; expert e uses its first masked_m[e] rows."""

    rows: Any  # [T*K] int64: flat row index e * capacity + slot of assignment (t, k)
    token_of_row: Any  # [E * capacity] int64 (unused rows: 0)
    masked_m: Any  # [E] int32: rows used per expert
    capacity: int


@dataclass(frozen=True, slots=True)
class _Sorted:
    """The assignments grouped by expert, which both layouts start from."""

    ids: Any  # [N] int64: flat expert ids, N = T * K
    order: Any  # [N] int64: flat assignment indices, stably sorted by expert
    sorted_ids: Any  # [N] int64: ids[order]
    rank: Any  # [N] int64: position of order[i] among its expert's assignments
    counts: Any  # [E] int64


def _flat_ids(topk_ids: Any, num_experts: int) -> Any:
    """Flatten and validate with one min/max sync: an out-of-range id would otherwise scatter
    out of bounds on the GPU (silent corruption) instead of failing here."""
    if len(topk_ids.shape) != 2:
        raise ValueError(f"topk_ids must be [T, K], got shape {list(topk_ids.shape)}")
    ids = topk_ids.astype("int64").reshape([-1])
    if ids.shape[0] == 0:
        return ids
    lo, hi = (int(v) for v in paddle.stack([ids.min(), ids.max()]).numpy())
    if lo < 0 or hi >= num_experts:
        bad = lo if lo < 0 else hi
        raise ValueError(f"topk_ids holds expert id {bad}, outside [0, {num_experts})")
    return ids


def _exclusive_cumsum(x: Any) -> Any:
    return paddle.cumsum(x) - x


def _sort_by_expert(ids: Any, num_experts: int) -> _Sorted:
    """A stable argsort keeps each expert's rows in flat assignment order, whatever the device."""
    counts = paddle.bincount(ids, minlength=num_experts).astype("int64")
    order = paddle.argsort(ids, stable=True)
    sorted_ids = paddle.gather(ids, order)
    starts = _exclusive_cumsum(counts)
    rank = paddle.arange(ids.shape[0], dtype="int64") - paddle.gather(starts, sorted_ids)
    return _Sorted(ids, order, sorted_ids, rank, counts)


def _scatter(size: int, fill: int, dtype: str, index: Any, values: Any) -> Any:
    """A buffer of `size` entries equal to `fill`, with values written at (unique) index."""
    base = paddle.full([size], fill, dtype=dtype)
    return paddle.scatter(base, index, values.astype(dtype), overwrite=True)


def plan_contiguous(topk_ids: Any, num_experts: int, alignment: int = ALIGNMENT) -> ContiguousPlan:
    """Lay the assignments out expert after expert, each block padded to `alignment` rows."""
    ids = _flat_ids(topk_ids, num_experts)
    n, k = ids.shape[0], topk_ids.shape[1]
    if n == 0:
        empty = paddle.zeros([0], dtype="int64")
        return ContiguousPlan(empty, empty, paddle.zeros([0], dtype="int32"),
                              paddle.zeros([num_experts], dtype="int64"), 0)
    s = _sort_by_expert(ids, num_experts)
    padded = (s.counts + alignment - 1) // alignment * alignment
    block_start = _exclusive_cumsum(padded)
    num_rows = int(padded.sum())  # host sync: the buffer size depends on the routing
    row_of_sorted = paddle.gather(block_start, s.sorted_ids) + s.rank
    return ContiguousPlan(
        rows=_scatter(n, 0, "int64", s.order, row_of_sorted),
        token_of_row=_scatter(num_rows, 0, "int64", row_of_sorted, s.order // k),
        m_indices=_scatter(num_rows, -1, "int32", row_of_sorted, s.sorted_ids),
        counts=s.counts,
        num_rows=num_rows,
    )


def plan_masked(topk_ids: Any, num_experts: int, capacity: int) -> MaskedPlan:
    """Give each expert a fixed `capacity` rows; fail loudly rather than drop assignments.

    A backend passes num_max_dispatch_tokens_per_rank: one token picks an expert at most once, so
    an expert gets at most T rows and the budget only overflows when T exceeds it.
    """
    ids = _flat_ids(topk_ids, num_experts)
    n, k = ids.shape[0], topk_ids.shape[1]
    size = num_experts * capacity
    if n == 0:
        return MaskedPlan(paddle.zeros([0], dtype="int64"), paddle.zeros([size], dtype="int64"),
                          paddle.zeros([num_experts], dtype="int32"), capacity)
    s = _sort_by_expert(ids, num_experts)
    most = int(s.counts.max())
    if most > capacity:
        expert = int(paddle.argmax(s.counts))
        raise ValueError(
            f"expert {expert} got {most} assignments, more than the masked layout's capacity of "
            f"{capacity} rows per expert; raise num_max_dispatch_tokens_per_rank or use the contiguous layout")
    row_of_sorted = s.sorted_ids * capacity + s.rank
    return MaskedPlan(
        rows=_scatter(n, 0, "int64", s.order, row_of_sorted),
        token_of_row=_scatter(size, 0, "int64", row_of_sorted, s.order // k),
        masked_m=s.counts.astype("int32"),
        capacity=capacity,
    )


def _used_rows(plan: ContiguousPlan | MaskedPlan) -> Any:
    """[rows] bool: rows that hold an assignment (the rest are padding or unused)."""
    if isinstance(plan, ContiguousPlan):
        return plan.m_indices >= 0
    slots = paddle.arange(plan.capacity, dtype="int32").unsqueeze(0)
    return (slots < plan.masked_m.unsqueeze(1)).reshape([-1])


def gather_rows(x: Any, plan: ContiguousPlan | MaskedPlan) -> Any:
    """x [T, ...] -> the layout's rows [M or E * capacity, ...], padding and unused rows zero.

    The rows are zeroed (not left as copies of token 0) so that a kernel that does read them,
    or a per-row scale computed over them, sees nothing. Paddle's CPU build cannot gather float8
    tensors: callers gather a uint8 view (`x.view("uint8")`) and view the result back.
    """
    num_rows = plan.token_of_row.shape[0]
    if x.shape[0] == 0 or num_rows == 0:
        return paddle.zeros([num_rows, *x.shape[1:]], dtype=x.dtype)
    out = paddle.gather(x, plan.token_of_row)
    unused = ~_used_rows(plan)
    return paddle.masked_fill(out, unused.reshape([num_rows] + [1] * (len(x.shape) - 1)), 0)


def combine(y: Any, plan: ContiguousPlan | MaskedPlan, topk_weights: Any) -> Any:
    """y [rows, H] -> [T, H]: out[t] = sum_k topk_weights[t, k] * y[plan.rows[t * K + k]].

    Accumulated in float32 and summed in k order by an explicit loop (a reduction kernel may
    reorder the adds), so every backend rounds a token's output the same way.
    """
    t, k = topk_weights.shape
    hidden = y.shape[-1]
    if t == 0:
        return paddle.zeros([0, hidden], dtype=y.dtype)
    picked = paddle.gather(y, plan.rows).astype("float32").reshape([t, k, hidden])
    w = topk_weights.astype("float32")
    out = picked[:, 0] * w[:, 0:1]
    for j in range(1, k):
        out = out + picked[:, j] * w[:, j:j + 1]
    return out.astype(y.dtype)
