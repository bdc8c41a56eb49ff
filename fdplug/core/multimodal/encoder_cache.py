"""Encoder-feature cache: features by ``mm_hash``, shared by every request on every device.

Sized in feature rows. Entries a request holds are pinned; entries nobody holds stay cached and
are evicted least-recently-used first when the cache is over its size. An entry larger than the
whole cache is still admitted while a request holds it (the request could not run otherwise).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class _Entry:
    features: np.ndarray
    holders: set[str] = field(default_factory=set)


class EncoderCache:
    def __init__(self, capacity_rows: int) -> None:
        self.capacity_rows = capacity_rows
        self._entries: dict[str, _Entry] = {}
        self._unheld: OrderedDict[str, None] = OrderedDict()   # LRU order, oldest first
        self.rows = 0
        self.hits = 0
        self.misses = 0

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def acquire(self, mm_hash: str, holder: str) -> bool:
        """Pin an entry for ``holder`` if it is cached; counts a hit or a miss."""
        entry = self._entries.get(mm_hash)
        if entry is None:
            self.misses += 1
            return False
        self.hits += 1
        entry.holders.add(holder)
        self._unheld.pop(mm_hash, None)
        return True

    def put(self, mm_hash: str, features: np.ndarray, holder: str) -> None:
        """Insert (or re-pin) features, held by ``holder``, then evict unheld entries over size."""
        entry = self._entries.get(mm_hash)
        if entry is None:
            entry = self._entries[mm_hash] = _Entry(features)
            self.rows += len(features)
        entry.holders.add(holder)
        self._unheld.pop(mm_hash, None)
        self._evict()

    def held_by(self, mm_hash: str, holder: str) -> bool:
        entry = self._entries.get(mm_hash)
        return entry is not None and holder in entry.holders

    def get(self, mm_hash: str) -> np.ndarray:
        return self._entries[mm_hash].features

    def release(self, holder: str, mm_hashes: list[str]) -> None:
        """Unpin a holder's entries; they stay cached (most recently used) until evicted."""
        for mm_hash in mm_hashes:
            entry = self._entries.get(mm_hash)
            if entry is None or holder not in entry.holders:
                continue
            entry.holders.discard(holder)
            if not entry.holders:
                self._unheld[mm_hash] = None
        self._evict()

    def _evict(self) -> None:
        while self.rows > self.capacity_rows and self._unheld:
            mm_hash, _ = self._unheld.popitem(last=False)
            self.rows -= len(self._entries.pop(mm_hash).features)
