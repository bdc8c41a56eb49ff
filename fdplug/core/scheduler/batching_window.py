"""The batching window of an expert-parallel rank: pull a batch bounded by tokens and blocks, waiting
a little for more (FastDeploy's ``get_requests`` with ``FD_EP_BATCHED_TOKEN_TIMEOUT`` semantics).

Why: EP ranks step in lockstep, so a rank that starts a step with one request makes every rank pay
a step for it; waiting up to ``timeout`` (FastDeploy: 0.1 s) for the queue to fill gives each step
more tokens. What the window never does, unlike the code it replaces (FastDeploy seed PR 001):
count a request's tokens and blocks before checking that it fits (a request that does not fit
stays at the head, uncounted), count the head again on a later pass (totals are of the requests
taken, each once), or move a cursor it did not advance (the queue is consumed from the front only,
by the requests taken). A head that alone needs more tokens than the budget is still taken when
the batch is empty and its blocks fit (chunked prefill splits it); one whose blocks do not fit
ends the pull at once and stays at the head for a later one (blocks free as requests finish).

Not wired yet: the EP engine loop (issue "Scale-out I") will pull its requests through it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class WindowBudget:
    """What one pull may take: prompt tokens, KV blocks (prompt plus ``reserved_output_blocks`` a
    request), and requests."""

    max_tokens: int
    free_blocks: int
    block_size: int
    max_requests: int
    reserved_output_blocks: int = 0

    @classmethod
    def of(cls, scheduler: Any) -> WindowBudget:
        """What ``scheduler`` can take now: its token budget, its free KV blocks, its free request slots."""
        config = scheduler.config
        return cls(config.max_num_batched_tokens, scheduler.kv_cache_manager.num_free_blocks, config.block_size,
                   max(1, config.max_num_seqs - len(scheduler.requests)))

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size) + self.reserved_output_blocks


@dataclass(slots=True)
class Pulled:
    """The requests taken, in queue order, and what they count: each once."""

    requests: list[Any] = field(default_factory=list)
    tokens: int = 0
    blocks: int = 0
    waited: float = 0.0


class BatchingWindow:
    """``pull(queue, budget)``: take from the front of ``queue`` what fits, waiting at most
    ``timeout`` seconds for more to arrive (``sleep`` between looks, ``clock`` to measure)."""

    def __init__(self, timeout: float, num_tokens: Callable[[Any], int] = len,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep,
                 poll: float = 0.001) -> None:
        if not timeout >= 0:
            raise ValueError(f"the batching window's timeout must be >= 0 seconds, got {timeout}")
        self.timeout, self.num_tokens, self.clock, self.sleep, self.poll = timeout, num_tokens, clock, sleep, poll

    def pull(self, queue: deque, budget: WindowBudget) -> Pulled:
        pulled = Pulled()
        start = self.clock()
        while True:
            if self._take_what_fits(queue, budget, pulled):
                break                                        # full: the head does not fit, or enough requests
            now = self.clock()
            if now - start >= self.timeout:
                break
            self.sleep(min(self.poll, self.timeout - (now - start)))
        pulled.waited = self.clock() - start
        return pulled

    def _take_what_fits(self, queue: deque, budget: WindowBudget, pulled: Pulled) -> bool:
        """Move requests from the front of ``queue`` while they fit; True once no more can be taken."""
        while queue:
            if len(pulled.requests) >= budget.max_requests:
                return True
            tokens = self.num_tokens(queue[0])
            blocks = budget.blocks_for(tokens)
            over_tokens = pulled.tokens + tokens > budget.max_tokens and pulled.requests
            if over_tokens or pulled.blocks + blocks > budget.free_blocks:
                return True                                  # checked first; nothing counted
            pulled.requests.append(queue.popleft())
            pulled.tokens += tokens
            pulled.blocks += blocks
        return len(pulled.requests) >= budget.max_requests
