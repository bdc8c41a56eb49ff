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
lockstep of whole forward passes is `lockstep.LockstepGroup`'s). A rank whose experts failed
calls ``combine`` with ``failed``: every rank whose tokens they served raises `ExpertsFailedError`
after the collective instead of using the missing rows (its fault containment takes it from there).
The exchanges call paddle.distributed through a `Collectives` (the lockstep group's turns a failed
collective into a `ParallelGroupError`, and times them); local checks run before any collective,
so a bad input fails on its rank alone. A MoE backend with a faster exchange of its own
(DeepEP-style) brings it with ``make_exchange``.

Numbers: a token's output is the sum of its ``K`` weighted expert rows; here they are added per
rank, then across ranks, so the order of the float additions differs from one rank's backend.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import paddle

from fdplug.plugin_api.moe import ExpertBatch, ExpertsFailedError


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


def choose_exchange(backend: Any, group: Any, shard: ExpertShard, counts: Any = None,
                    comm: Collectives | None = None) -> Any:
    """The MoE backend's own exchange, else all_to_all where the collective backend has it, else
    all_gather + all_reduce (``counts``: every rank's tokens in the pass, if the caller knows them;
    ``comm``: how the core's exchanges call paddle.distributed). Every rank must call this (the
    probe is a collective)."""
    make = getattr(backend, "make_exchange", None)
    if make is not None:
        exchange = make(group, shard.rank, shard.size, shard.num_experts)
        if exchange is not None:
            return exchange
    comm = comm or Collectives(group)
    return AllToAllExchange(shard, comm) if has_all_to_all(group) else AllGatherExchange(shard, comm, counts)


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


class Collectives:
    """The paddle.distributed calls the core's exchanges make, on ``group`` (None: the world);
    ``run`` is the hook a caller wraps them with (`lockstep.LockstepGroup`: errors, timing)."""

    def __init__(self, group: Any = None) -> None:
        import paddle.distributed as dist

        self.dist, self.group = dist, group

    def run(self, call: Any) -> Any:
        return call()

    def all_gather(self, out: list, tensor: Any) -> None:
        self.run(lambda: self.dist.all_gather(out, tensor, group=self.group))

    def all_reduce(self, tensor: Any) -> None:
        self.run(lambda: self.dist.all_reduce(tensor, group=self.group))

    def alltoall_single(self, out: Any, tensor: Any, in_splits: list[int] | None = None,
                        out_splits: list[int] | None = None) -> None:
        self.run(lambda: self.dist.alltoall_single(out, tensor, in_splits, out_splits, group=self.group))


def _check_inputs(hidden: Any, topk_weights: Any, topk_ids: Any, most: int | None = None) -> None:
    """Shapes every rank agrees on, checked before any collective (a mismatch there is fatal)."""
    rows = int(hidden.shape[0])
    if len(hidden.shape) != 2 or list(topk_ids.shape) != [rows, topk_ids.shape[-1]] \
            or list(topk_weights.shape) != list(topk_ids.shape):
        raise ValueError(f"expert exchange: hidden {list(hidden.shape)}, topk_ids {list(topk_ids.shape)} and "
                         f"topk_weights {list(topk_weights.shape)} do not describe the same tokens")
    if most is not None and rows > most:
        raise ValueError(f"expert exchange: {rows} tokens, but this rank announced {most} for the pass")


class AllGatherExchange:
    """all_gather to dispatch, all_reduce to combine: runs on every backend (gloo included)."""

    name = "all_gather"

    def __init__(self, shard: ExpertShard, comm: Collectives | None = None, counts: Any = None) -> None:
        """``counts()``: every rank's token count in the pass under way (None: gathered each layer)."""
        self.shard, self.comm, self.counts = shard, comm or Collectives(), counts

    def dispatch(self, hidden: Any, topk_weights: Any, topk_ids: Any) -> ExpertBatch:
        rows = int(hidden.shape[0])
        if self.counts is None:
            _check_inputs(hidden, topk_weights, topk_ids)
            sizes = [int(c.numpy()[0]) for c in self._gather(paddle.to_tensor([rows], dtype="int64"))]
        else:   # a rank finishing a failed pass sends no rows where its header said some: padding stands in
            sizes = list(self.counts())
            _check_inputs(hidden, topk_weights, topk_ids, sizes[self.shard.rank])
        most = max(1, *sizes)   # a row of padding when no rank has tokens: no zero-size collective
        parts = (hidden, topk_ids, topk_weights)     # one byte buffer, one collective; padded ids -1: nobody's
        packed = paddle.concat([_pad(t, most, -1 if t is topk_ids else 0).view(paddle.uint8) for t in parts], axis=1)
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

    def combine(self, expert_out: Any, batch: ExpertBatch, failed: bool = False) -> Any:
        """The partial sums all_reduced in float32, with one more row: whether any rank's experts failed."""
        tokens, total, offset, count = batch.state
        partial = paddle.zeros([total + 1, int(expert_out.shape[1])], dtype="float32")
        if int(tokens.shape[0]) and not failed:
            partial = paddle.index_add(partial, tokens, 0, expert_out.astype("float32"))
        if failed:
            partial[total, 0] = 1.0
        self.comm.all_reduce(partial)
        if float(partial[total, 0]) > 0:
            raise ExpertsFailedError("the experts of another rank of the expert-parallel group failed in this layer")
        return partial[offset:offset + count].astype(expert_out.dtype)

    def _gather(self, tensor: Any) -> list[Any]:
        out: list[Any] = []
        self.comm.all_gather(out, tensor)
        return out


class AllToAllExchange:
    """Each assignment sent once to its expert's rank and its row sent back (``alltoall_single``
    with per-rank split sizes, after one all_to_all of the counts)."""

    name = "all_to_all"

    def __init__(self, shard: ExpertShard, comm: Collectives | None = None) -> None:
        self.shard, self.comm = shard, comm or Collectives()

    def dispatch(self, hidden: Any, topk_weights: Any, topk_ids: Any) -> ExpertBatch:
        _check_inputs(hidden, topk_weights, topk_ids)
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

    def combine(self, expert_out: Any, batch: ExpertBatch, failed: bool = False) -> Any:
        """Each row home with one more column: whether the rank that ran it failed (only ranks whose
        tokens it served hear of it)."""
        tokens, send, recv, count = batch.state
        flag = paddle.full([int(expert_out.shape[0]), 1], 1.0 if failed else 0.0, dtype="float32")
        back = self._all_to_all(paddle.concat([expert_out.astype("float32"), flag], axis=1), recv, send)
        if int(back.shape[0]) and float(back[:, -1].max()) > 0:
            raise ExpertsFailedError("the experts of another rank of the expert-parallel group failed in this layer")
        out = paddle.zeros([count, int(expert_out.shape[1])], dtype="float32")
        if int(tokens.shape[0]):
            out = paddle.index_add(out, tokens, 0, back[:, :-1])
        return out.astype(expert_out.dtype)

    def _counts(self, send: list[int]) -> list[int]:
        recv = paddle.zeros([self.shard.size], dtype="int64")
        self.comm.alltoall_single(recv, paddle.to_tensor(send, dtype="int64"))
        return [int(n) for n in recv.numpy()]

    def _all_to_all(self, tensor: Any, send: list[int], recv: list[int]) -> Any:
        out = paddle.empty([sum(recv), *tensor.shape[1:]], dtype=tensor.dtype)
        self.comm.alltoall_single(out, tensor, send, recv)
        return out


def _pad(tensor: Any, rows: int, fill: int = 0) -> Any:
    """``tensor`` with ``fill`` rows appended up to ``rows`` (all_gather takes equal shapes)."""
    missing = rows - int(tensor.shape[0])
    if missing == 0:
        return tensor
    return paddle.concat([tensor, paddle.full([missing, *tensor.shape[1:]], fill, dtype=tensor.dtype)])
