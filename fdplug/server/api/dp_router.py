"""Which data-parallel engine gets a request: the least loaded, preferring one that has its prefix.

Load is vLLM's DP rule, ``4 x waiting + running``, from what the API process knows exactly and at
once (the requests it has in flight on each engine, bumped the moment one is sent, so a burst does
not all land on the engine that looked idle at the last stats message) plus what the engine last
reported waiting (its stats come every 0.25 s while busy): ``in_flight + 3 x waiting``.

Prefix affinity: each engine's recent prompts are remembered as chained hashes of their full
blocks (``block_size`` tokens, rooted in the cache salt, as the engine's prefix cache chains its
own), in a bounded LRU. Among the engines whose load is within ``AFFINITY_SLACK`` of the least,
the one holding the longest leading run of the prompt's blocks wins; then the lower load, then the
lower rank. The engine's cache may have evicted a block the router still remembers (a wasted
preference, never a wrong answer: the engine recomputes what it lacks). An engine marked dead gets
nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

AFFINITY_SLACK = 2          # load units an engine with the prefix may carry above the least loaded one
REMEMBERED_BLOCKS = 65536   # per engine: ~1M tokens of prompts at 16-token blocks, ~5 MB of hashes
WAITING_WEIGHT = 3          # in_flight counts waiting once already: 1 + 3 = vLLM's 4


@dataclass(slots=True)
class EngineLoad:
    """What the router knows about one engine."""

    in_flight: int = 0
    waiting: int = 0          # as last reported by the engine
    alive: bool = True
    blocks: OrderedDict = field(default_factory=OrderedDict)   # block hash -> None, most recent last

    def score(self) -> int:
        return self.in_flight + WAITING_WEIGHT * self.waiting


def block_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """Chained hashes of the prompt's full blocks: block i's depends on every token before its end."""
    hashes, parent = [], hash(("fdplug-dp", salt))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash((parent, tuple(token_ids[start:start + block_size])))
        hashes.append(parent)
    return hashes


class Router:
    """Engine choice for ``size`` data-parallel engines (`choose`), kept current by the client."""

    def __init__(self, size: int, block_size: int, remembered_blocks: int = REMEMBERED_BLOCKS,
                 affinity: bool = True) -> None:
        """``affinity`` False: the least loaded engine only (FDPLUG_DP_PREFIX_AFFINITY=0)."""
        if size < 1 or block_size < 1:
            raise ValueError(f"a router needs at least one engine and a block size, got {size}, {block_size}")
        self.engines = [EngineLoad() for _ in range(size)]
        self.block_size = block_size
        self.remembered_blocks = remembered_blocks
        self.affinity = affinity

    def choose(self, token_ids: list[int], salt: str | None = None, rank: int | None = None) -> int | None:
        """The engine for a prompt (``rank``: the caller's explicit choice, honoured if alive), or
        None when every engine is dead. Does not record anything: `sent` does."""
        if rank is not None:
            return rank if 0 <= rank < len(self.engines) and self.engines[rank].alive else None
        live = [i for i, e in enumerate(self.engines) if e.alive]
        if not live:
            return None
        least = min(self.engines[i].score() for i in live)
        near = [i for i in live if self.engines[i].score() <= least + (AFFINITY_SLACK if self.affinity else 0)]
        hashes = block_hashes(token_ids, self.block_size, salt) if len(near) > 1 and self.affinity else []
        return min(near, key=lambda i: (-self._cached_run(i, hashes), self.engines[i].score(), i))

    def _cached_run(self, rank: int, hashes: list[int]) -> int:
        blocks = self.engines[rank].blocks
        run = 0
        for h in hashes:
            if h not in blocks:
                break
            run += 1
        return run

    def sent(self, rank: int, token_ids: list[int], salt: str | None = None) -> None:
        """A request went to ``rank``: count it in flight and remember its blocks there."""
        engine = self.engines[rank]
        engine.in_flight += 1
        if not self.affinity:
            return
        for h in block_hashes(token_ids, self.block_size, salt):
            engine.blocks[h] = None
            engine.blocks.move_to_end(h)
        while len(engine.blocks) > self.remembered_blocks:
            engine.blocks.popitem(last=False)

    def finished(self, rank: int) -> None:
        engine = self.engines[rank]
        engine.in_flight = max(0, engine.in_flight - 1)

    def reported(self, rank: int, waiting: int) -> None:
        """The engine's stats message: its waiting queue."""
        self.engines[rank].waiting = waiting

    def dead(self, rank: int) -> None:
        engine = self.engines[rank]
        engine.alive, engine.in_flight, engine.waiting = False, 0, 0
        engine.blocks.clear()

    def revived(self, rank: int) -> None:
        """A restarted engine: alive, empty, with a cold cache."""
        self.engines[rank] = EngineLoad()
