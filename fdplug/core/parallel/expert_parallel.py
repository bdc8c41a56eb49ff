"""Expert parallel MoE: a layer's routed experts split over ranks, tokens exchanged with paddle.distributed.

Each of ``size`` ranks holds the contiguous ``1/size`` of the experts (`ExpertShard`) and its own
tokens. `AllGatherExchange` is the exchange that runs on every backend (gloo on CPU, NCCL, BKCL):
``dispatch`` all_gathers every rank's tokens, expert ids and weights (padded to the largest count:
all_gather needs equal shapes), the rank's MoE backend runs its experts on the tokens that chose
them (`ExpertShard.localize`: other experts' entries weigh 0), and ``combine`` all_reduces the
partial outputs and keeps the rank's own rows. paddle 3.3's gloo has no alltoall or reduce_scatter
(NotImplementedError), so this is vLLM's all_gather-then-reduce exchange; a device plugin with a
faster one (DeepEP-style all-to-all) implements the same two methods.

No collective waits on an idle rank: a rank without tokens calls ``dispatch`` with zero rows (a
dummy step), contributes nothing, and gets zero rows back. Numbers: a token's output is the sum of
its experts' parts, added per rank and then across ranks: the same values as one rank, summed in
another order (float rounding apart).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import paddle


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

    def localize(self, topk_ids: Any, topk_weights: Any) -> tuple[Any, Any]:
        """Global ids ``[T, k]`` -> this rank's local ids, other ranks' entries as local expert 0 with
        weight 0 (they add nothing; the backend contract has no "skip" id yet)."""
        local = (topk_ids >= self.first) & (topk_ids < self.first + self.count)
        ids = paddle.where(local, topk_ids - self.first, paddle.zeros_like(topk_ids))
        return ids, paddle.where(local, topk_weights, paddle.zeros_like(topk_weights))


@dataclass(frozen=True, slots=True)
class Dispatched:
    """Every rank's tokens in rank order, and where this rank's rows are among them."""

    hidden: Any          # [T_all, H]
    topk_ids: Any        # [T_all, k]
    topk_weights: Any    # [T_all, k]
    offset: int
    count: int


class AllGatherExchange:
    """all_gather to dispatch, all_reduce to combine (works on gloo); ``group``: paddle's (None: world)."""

    def __init__(self, group: Any = None) -> None:
        import paddle.distributed as dist

        self.dist, self.group = dist, group

    def dispatch(self, hidden: Any, topk_ids: Any, topk_weights: Any) -> Dispatched:
        counts = self._gather(paddle.to_tensor([int(hidden.shape[0])], dtype="int64"))
        sizes = [int(c.numpy()[0]) for c in counts]
        rank = self.dist.get_rank(self.group) if self.group is not None else self.dist.get_rank()
        most = max(1, *sizes)   # a row of padding even when no rank has tokens: no zero-size collective
        parts = [self._gather(_pad(t, most)) for t in (hidden, topk_ids, topk_weights)]
        joined = [paddle.concat([p[:n] for p, n in zip(part, sizes)]) for part in parts]
        return Dispatched(*joined, offset=sum(sizes[:rank]), count=sizes[rank])

    def combine(self, partial: Any, dispatched: Dispatched) -> Any:
        """``partial [T_all, H]``: this rank's experts' part of every token -> its own tokens' sums."""
        total = partial.clone()
        self.dist.all_reduce(total, group=self.group)
        return total[dispatched.offset:dispatched.offset + dispatched.count]

    def _gather(self, tensor: Any) -> list[Any]:
        out: list[Any] = []
        self.dist.all_gather(out, tensor, group=self.group)
        return out


def _pad(tensor: Any, rows: int) -> Any:
    """``tensor`` with zero rows appended up to ``rows`` (all_gather takes equal shapes)."""
    missing = rows - int(tensor.shape[0])
    if missing == 0:
        return tensor
    return paddle.concat([tensor, paddle.zeros([missing, *tensor.shape[1:]], dtype=tensor.dtype)])
