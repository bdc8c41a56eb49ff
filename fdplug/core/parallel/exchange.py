"""Expert parallel exchanges: a MoE layer's work moved between the ranks that hold its experts.

Each of ``size`` ranks holds the contiguous ``1/size`` of a layer's experts (`ExpertShard`) and its
own tokens. An exchange (`fdplug.plugin_api.moe.ExpertExchange`) ``dispatch``es every (token,
expert) assignment to the rank holding the expert, one row each, and ``combine``s the rows the
experts produced back into the tokens' ranks, summed per token. Two come with the core; which one
runs is decided by what the collective backend can do (`choose_exchange`), never by device name:

- `AllToAllExchange`: ``alltoall_single`` where the backend has it (NCCL, BKCL): each assignment
  travels once, to its expert's rank and back.
- `AllGatherExchange`: all_gather + all_reduce, which every backend has (paddle 3.3's gloo has no
  all_to_all or reduce_scatter: NotImplementedError): every rank sees every token, runs the
  assignments of its experts, and the partial sums are all_reduced (vLLM's naive exchange). Two
  collectives a layer: the tokens, ids and weights travel as one byte buffer, and every rank's
  token count comes from the pass's header (``counts``) rather than a gather of its own (on
  loopback gloo a collective costs ~0.3-2 ms whatever its size, up to ~4 MB).

A rank without tokens calls both with zero rows: no collective ever waits on an idle rank (the
lockstep of whole forward passes is `lockstep.LockstepGroup`'s). A MoE backend with a faster
exchange of its own (DeepEP-style) brings it with ``make_exchange``.

Numbers: a token's output is the sum of its ``K`` weighted expert rows; here they are added per
rank, then across ranks, so the order of the float additions differs from one rank's backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import paddle

from fdplug.plugin_api.moe import ExpertBatch


@dataclass(frozen=True, slots=True)
class ExpertShard:
    """Rank ``rank`` of ``size`` holds experts ``[first, first + count)`` of ``num_experts``."""

    rank: int
    size: int
    num_experts: int

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size or self.num_experts % self.size:
            raise ValueError(f"{self.num_experts} experts do not split over {self.size} ranks "
                             f"(rank {self.rank}): the count must divide evenly")

    @property
    def count(self) -> int:
        return self.num_experts // self.size

    @property
    def first(self) -> int:
        return self.rank * self.count

    def owner(self, topk_ids: Any) -> Any:
        """The rank holding each global expert id."""
        return topk_ids // self.count

    def assignments(self, topk_ids: Any, topk_weights: Any) -> tuple[Any, Any, Any]:
        """The (token, k) entries of ``[T, K]`` routed to this rank's experts, token-major:
        ``(token index [A], local ids [A, 1], weights [A, 1])``."""
        k = int(topk_ids.shape[1])
        flat_ids = topk_ids.reshape([-1])
        mine = (flat_ids >= self.first) & (flat_ids < self.first + self.count)
        index = paddle.nonzero(mine).reshape([-1]) if int(flat_ids.shape[0]) else flat_ids
        return (index // k, (paddle.gather(flat_ids, index) - self.first).unsqueeze(-1),
                paddle.gather(topk_weights.reshape([-1]), index).unsqueeze(-1))


def choose_exchange(backend: Any, group: Any, shard: ExpertShard, counts: Any = None) -> Any:
    """The MoE backend's own exchange, else all_to_all where the collective backend has it, else
    all_gather + all_reduce (``counts``: every rank's tokens in the pass, if the caller knows them).
    Every rank must call this (the probe is a collective)."""
    make = getattr(backend, "make_exchange", None)
    if make is not None:
        exchange = make(group, shard.rank, shard.size, shard.num_experts)
        if exchange is not None:
            return exchange
    return AllToAllExchange(shard, group) if has_all_to_all(group) else AllGatherExchange(shard, group, counts)


def has_all_to_all(group: Any = None) -> bool:
    """Whether the group's collective backend runs ``alltoall_single`` (one tiny call; gloo raises
    NotImplementedError on every rank before anything is sent)."""
    import paddle.distributed as dist

    size = dist.get_world_size(group) if group is not None else dist.get_world_size()
    out = paddle.zeros([size], dtype="int64")
    try:
        dist.alltoall_single(out, paddle.arange(size, dtype="int64"), group=group)
    except NotImplementedError:
        return False
    return True


class AllGatherExchange:
    """all_gather to dispatch, all_reduce to combine: runs on every backend (gloo included)."""

    name = "all_gather"

    def __init__(self, shard: ExpertShard, group: Any = None, counts: Any = None) -> None:
        """``counts()``: every rank's token count in the pass under way (None: gathered each layer)."""
        import paddle.distributed as dist

        self.shard, self.dist, self.group, self.counts = shard, dist, group, counts

    def dispatch(self, hidden: Any, topk_weights: Any, topk_ids: Any) -> ExpertBatch:
        rows = int(hidden.shape[0])
        if self.counts is None:
            sizes = [int(c.numpy()[0]) for c in self._gather(paddle.to_tensor([rows], dtype="int64"))]
        else:   # a rank finishing a failed pass sends no rows, where its header said some: zeros stand in
            sizes = list(self.counts())
        most = max(1, *sizes)   # a row of padding when no rank has tokens: no zero-size collective
        parts = (hidden, topk_ids, topk_weights)     # one byte buffer, one collective
        packed = paddle.concat([_pad(t, most).view(paddle.uint8) for t in parts], axis=1)
        every = paddle.concat([p[:n] for p, n in zip(self._gather(packed), sizes)])
        if not sum(sizes):       # nobody has tokens (a round of dummies): nothing to run here
            empty = paddle.zeros([0], dtype="int64")
            return ExpertBatch(hidden[:0], empty.reshape([0, 1]), topk_weights[:0, :1], state=(empty, 0, 0, 0))
        widths = [math.prod(t.shape[1:]) * t.element_size() for t in parts]
        every_hidden, every_ids, every_weights = (chunk.contiguous().view(t.dtype)
                                                  for chunk, t in zip(paddle.split(every, widths, axis=1), parts))
        tokens, ids, weights = self.shard.assignments(every_ids, every_weights)
        offset = sum(sizes[:self.shard.rank])
        return ExpertBatch(paddle.gather(every_hidden, tokens), ids, weights,
                           state=(tokens, sum(sizes), offset, sizes[self.shard.rank]))

    def combine(self, expert_out: Any, batch: ExpertBatch) -> Any:
        tokens, total, offset, count = batch.state
        partial = paddle.zeros([max(1, total), int(expert_out.shape[1])], dtype=expert_out.dtype)  # gloo: no empty
        if int(tokens.shape[0]):
            partial = paddle.index_add(partial, tokens, 0, expert_out)
        self.dist.all_reduce(partial, group=self.group)
        return partial[offset:offset + count]

    def _gather(self, tensor: Any) -> list[Any]:
        out: list[Any] = []
        self.dist.all_gather(out, tensor, group=self.group)
        return out


class AllToAllExchange:
    """Each assignment sent once to its expert's rank and its row sent back (``alltoall_single``
    with per-rank split sizes, after one all_to_all of the counts)."""

    name = "all_to_all"

    def __init__(self, shard: ExpertShard, group: Any = None) -> None:
        import paddle.distributed as dist

        self.shard, self.dist, self.group = shard, dist, group

    def dispatch(self, hidden: Any, topk_weights: Any, topk_ids: Any) -> ExpertBatch:
        size, k = self.shard.size, int(topk_ids.shape[1])
        flat_ids = topk_ids.reshape([-1])
        owner = self.shard.owner(flat_ids)
        order = paddle.argsort(owner, stable=True)             # assignments grouped by destination rank
        send = [int(n) for n in paddle.bincount(owner, minlength=size).numpy()] if int(owner.shape[0]) else [0] * size
        recv = self._counts(send)
        tokens = order // k
        sent_ids = paddle.gather(flat_ids, order)
        local_ids = self._all_to_all(sent_ids - paddle.gather(owner, order) * self.shard.count, send, recv)
        weights = self._all_to_all(paddle.gather(topk_weights.reshape([-1]), order), send, recv)
        rows = self._all_to_all(paddle.gather(hidden, tokens), send, recv)
        return ExpertBatch(rows, local_ids.unsqueeze(-1), weights.unsqueeze(-1),
                           state=(tokens, send, recv, int(hidden.shape[0])))

    def combine(self, expert_out: Any, batch: ExpertBatch) -> Any:
        tokens, send, recv, count = batch.state
        back = self._all_to_all(expert_out, recv, send)     # each row home, in the order it left
        out = paddle.zeros([count, int(expert_out.shape[1])], dtype=expert_out.dtype)
        return paddle.index_add(out, tokens, 0, back) if int(tokens.shape[0]) else out

    def _counts(self, send: list[int]) -> list[int]:
        recv = paddle.zeros([self.shard.size], dtype="int64")
        self.dist.alltoall_single(recv, paddle.to_tensor(send, dtype="int64"), group=self.group)
        return [int(n) for n in recv.numpy()]

    def _all_to_all(self, tensor: Any, send: list[int], recv: list[int]) -> Any:
        out = paddle.empty([sum(recv), *tensor.shape[1:]], dtype=tensor.dtype)
        self.dist.alltoall_single(out, tensor, send, recv, group=self.group)
        return out


def _pad(tensor: Any, rows: int) -> Any:
    """``tensor`` with zero rows appended up to ``rows`` (all_gather takes equal shapes)."""
    missing = rows - int(tensor.shape[0])
    if missing == 0:
        return tensor
    return paddle.concat([tensor, paddle.zeros([missing, *tensor.shape[1:]], dtype=tensor.dtype)])
