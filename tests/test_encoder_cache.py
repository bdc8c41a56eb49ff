"""Encoder cache: pinned entries stay, unpinned ones go least-recently-used first, sized in rows."""

from __future__ import annotations

import numpy as np

from fdplug.core.multimodal.encoder_cache import EncoderCache


def rows(n: int) -> np.ndarray:
    return np.zeros((n, 2), np.float32)


def test_empty_cache_fills_and_hits():
    cache = EncoderCache(10)
    assert not cache.acquire("a", "r1") and cache.misses == 1
    cache.put("a", rows(4), "r1")
    assert "a" in cache and cache.rows == 4
    assert cache.acquire("a", "r2") and cache.hits == 1


def test_unheld_entries_are_evicted_lru_when_over_size():
    cache = EncoderCache(10)
    for name in "abc":
        cache.put(name, rows(4), "r")  # 12 rows > 10, but every entry is held
    assert cache.rows == 12 and len(cache) == 3
    cache.release("r", ["b", "a", "c"])  # release order is the LRU order
    assert "b" not in cache and "a" in cache and "c" in cache and cache.rows == 8
    cache.acquire("a", "r2")
    cache.put("d", rows(4), "r3")        # over size again: the oldest unheld ("c") goes, "a" is held
    assert "c" not in cache and "a" in cache and "d" in cache


def test_an_entry_larger_than_the_cache_lives_while_held():
    cache = EncoderCache(3)
    cache.put("big", rows(8), "r")
    assert "big" in cache
    cache.release("r", ["big"])
    assert "big" not in cache and cache.rows == 0


def test_size_zero_keeps_nothing_once_released():
    cache = EncoderCache(0)
    cache.put("a", rows(1), "r1")
    cache.acquire("a", "r2")
    cache.release("r1", ["a"])
    assert "a" in cache  # still held by r2
    cache.release("r2", ["a"])
    assert "a" not in cache
