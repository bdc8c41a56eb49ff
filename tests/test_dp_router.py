"""The data-parallel router, scenario by scenario: which engine each request goes to, and why."""

from __future__ import annotations

import pytest

from fdplug.server.api.dp_router import AFFINITY_SLACK, Router, block_hashes

BS = 4


def prompt(*blocks: int, tail: int = 0) -> list[int]:
    """A prompt of whole 4-token blocks named by a number each, plus ``tail`` extra tokens."""
    return [b * 100 + i for b in blocks for i in range(BS)] + list(range(9000, 9000 + tail))


def test_the_least_loaded_engine_wins_and_a_burst_spreads_at_once():
    router = Router(3, BS)
    picks = []
    for i in range(6):           # no stats in between: the in-flight counts alone spread them
        rank = router.choose(prompt(10 + i))
        router.sent(rank, prompt(10 + i))
        picks.append(rank)
    assert picks == [0, 1, 2, 0, 1, 2]
    router.finished(1)
    assert router.choose(prompt(50)) == 1


def test_waiting_counts_four_times_running():
    """vLLM's 4 x waiting + running: in flight counts each once, a reported waiting one 3 more."""
    router = Router(2, BS)
    for _ in range(4):
        router.sent(0, prompt(1))           # engine 0: 4 running
    router.sent(1, prompt(2))
    router.sent(1, prompt(3))
    router.reported(1, waiting=2)           # engine 1: 2 in flight, both waiting: 2 + 6 = 8 > 4
    assert router.engines[1].score() == 8 and router.engines[0].score() == 4
    assert router.choose(prompt(4)) == 0


def test_a_cached_prefix_wins_within_the_slack_and_not_beyond():
    router = Router(2, BS)
    shared = prompt(7, 8, 9)
    router.sent(1, shared)                  # engine 1 has seen blocks 7, 8, 9
    assert router.choose(prompt(7, 8, 9, tail=3)) == 1          # 1 vs 0 in flight: within the slack
    for _ in range(AFFINITY_SLACK):
        router.sent(1, prompt(60))
    assert router.engines[1].score() == AFFINITY_SLACK + 1
    assert router.choose(prompt(7, 8, 9, tail=3)) == 0          # beyond it: load wins
    assert router.choose(prompt(5)) == 0                        # no prefix anywhere: load


def test_without_affinity_only_load_and_rank_decide():
    router = Router(2, BS, affinity=False)
    router.sent(1, prompt(7, 8, 9))
    assert router.engines[1].blocks == {}                        # nothing remembered
    assert router.choose(prompt(7, 8, 9, tail=3)) == 0           # 1 in flight on engine 1: engine 0
    router.finished(1)
    assert router.choose(prompt(7, 8, 9, tail=3)) == 0           # a tie: the lower rank


def test_the_longest_leading_run_of_blocks_wins_and_chains_are_by_position():
    router = Router(3, BS)
    router.sent(1, prompt(1, 2))
    router.sent(2, prompt(1, 2, 3))
    router.sent(0, prompt(9))
    assert router.choose(prompt(1, 2, 3, 4)) == 2
    assert router.choose(prompt(2, 3)) == 0      # blocks 2, 3 at another position are other prefixes: load, then rank
    assert router.choose(prompt(1, 2, 3), salt="tenant-b") == 0   # another cache salt shares nothing


def test_dead_engines_get_nothing_and_an_explicit_rank_is_honoured_if_alive():
    router = Router(3, BS)
    router.dead(0)
    assert router.choose(prompt(1)) == 1
    assert router.choose(prompt(1), rank=2) == 2
    assert router.choose(prompt(1), rank=0) is None and router.choose(prompt(1), rank=3) is None
    router.dead(1)
    router.dead(2)
    assert router.choose(prompt(1)) is None
    router.revived(0)
    assert router.choose(prompt(1)) == 0 and router.engines[0].in_flight == 0


def test_remembered_blocks_are_bounded_least_recent_first():
    router = Router(2, BS, remembered_blocks=3)
    router.sent(1, prompt(1, 2))
    router.sent(1, prompt(3, 4))        # 4 blocks seen: the oldest (block 1's chain) is forgotten
    router.finished(1)
    router.finished(1)
    assert len(router.engines[1].blocks) == 3
    assert router.choose(prompt(1, 2)) == 0      # its first block is gone: no run, load and rank decide
    assert router.choose(prompt(3, 4)) == 1


def test_block_hashes_cover_only_full_blocks():
    assert len(block_hashes(list(range(11)), 4)) == 2
    assert block_hashes(list(range(8)), 4)[0] == block_hashes(list(range(4)), 4)[0]
    assert block_hashes(list(range(8)), 4)[1] != block_hashes(list(range(4, 8)), 4)[0]
    with pytest.raises(ValueError):
        Router(0, 4)


def test_engines_split_the_cores_or_take_a_device_each(monkeypatch):
    import os

    from fdplug.errors import ConfigError
    from fdplug.server.engine.engine_set import data_parallel_ranks

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {4, 5, 6, 7, 8})
    args = {"max_num_seqs": 8}
    assert data_parallel_ranks(args, 1, cpu=True) == [(args, None)]
    assert [cpus for _, cpus in data_parallel_ranks(args, 2, cpu=True)] == [[4, 5], [6, 7, 8]]
    assert [cpus for _, cpus in data_parallel_ranks(args, 7, cpu=True)] == [[4], [5], [6], [7], [8], [4], [5]]
    assert [a["device_index"] for a, _ in data_parallel_ranks(args, 3, cpu=False)] == [0, 1, 2]
    assert args == {"max_num_seqs": 8}                      # each engine gets its own copy
    with pytest.raises(ConfigError, match="at least 1"):
        data_parallel_ranks(args, 0, cpu=True)
