"""The EP batching window, scenario by scenario, on a fake clock (requests are token lists here).

Three tests are the three defects of FastDeploy's ``get_requests`` (seed PR 001) this must not have:
counting a request before checking it fits, counting the head again on a later pass, and moving a
cursor that was not advanced.
"""

from __future__ import annotations

from collections import deque

import pytest

from fdplug.core.scheduler.batching_window import BatchingWindow, WindowBudget


class FakeTime:
    """A clock that moves only when the window sleeps; ``arrivals[t]`` join the queue at time t."""

    def __init__(self, queue: deque, arrivals: dict[float, list] | None = None) -> None:
        self.now, self.queue, self.arrivals, self.sleeps = 0.0, queue, dict(arrivals or {}), 0

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps += 1
        self.now += seconds
        for at in sorted(t for t in self.arrivals if t <= self.now + 1e-12):
            self.queue.extend(self.arrivals.pop(at))


def req(n: int, tag: int = 0) -> list[int]:
    return [tag] * n


def window(queue: deque, arrivals: dict | None = None, timeout: float = 0.1) -> tuple[BatchingWindow, FakeTime]:
    fake = FakeTime(queue, arrivals)
    return BatchingWindow(timeout, clock=fake.clock, sleep=fake.sleep, poll=0.01), fake


BUDGET = WindowBudget(max_tokens=100, free_blocks=10, block_size=16, max_requests=8)


def test_takes_what_fits_in_order_and_stops_at_the_first_that_does_not():
    queue = deque([req(40, 1), req(50, 2), req(20, 3), req(5, 4)])
    pulled = window(queue)[0].pull(queue, BUDGET)
    assert [r[0] for r in pulled.requests] == [1, 2]          # 3 would make 110 tokens: it and 4 stay
    assert (pulled.tokens, pulled.blocks) == (90, 3 + 4)
    assert [r[0] for r in queue] == [3, 4]


def test_a_request_that_does_not_fit_is_not_counted():
    """FastDeploy counted tokens and blocks before the check: a rejected request's count stayed in
    the totals. Here the totals are exactly the taken requests'."""
    queue = deque([req(30, 1), req(16 * 9, 2)])                # 2 needs 9 blocks: 2 + 9 > 10
    pulled = window(queue)[0].pull(queue, BUDGET)
    assert [r[0] for r in pulled.requests] == [1]
    assert (pulled.tokens, pulled.blocks) == (30, 2)
    assert len(queue[0]) == 16 * 9                           # still at the head, for the next pull


def test_the_head_is_counted_once_across_waiting_passes():
    """FastDeploy restarted each pass at the head with the totals kept: the head counted again per
    pass, so later requests were refused for tokens that were not there. Here: 60 taken, then after
    waits a 40 arrives: 100 fits exactly, and is taken."""
    queue = deque([req(60, 1)])
    win, fake = window(queue, {0.05: [req(40, 2)]})
    pulled = win.pull(queue, BUDGET)
    assert [r[0] for r in pulled.requests] == [1, 2] and pulled.tokens == 100
    assert fake.sleeps >= 5                                    # it did wait for the second one
    assert pulled.blocks == 4 + 3


def test_no_request_is_skipped_or_reordered_when_a_pass_takes_nothing():
    """FastDeploy decremented its cursor unconditionally: after a pass that took nothing, requests
    were skipped or read twice. Here the queue is consumed from the front only."""
    budget = WindowBudget(max_tokens=100, free_blocks=2, block_size=16, max_requests=8)
    queue = deque([req(40, 1), req(10, 2)])                   # 1 needs 3 blocks of the 2 free: nothing fits
    win, fake = window(queue)
    assert win.pull(queue, budget).requests == [] and fake.sleeps == 0   # a blocked head: no point waiting
    queue.append(req(5, 3))
    assert [r[0] for r in queue] == [1, 2, 3]                 # nothing skipped, nothing read twice, in order
    pulled = win.pull(queue, WindowBudget(max_tokens=100, free_blocks=10, block_size=16, max_requests=8))
    assert [r[0] for r in pulled.requests] == [1, 2, 3] and pulled.tokens == 55


def test_waits_at_most_the_timeout_and_not_at_all_when_full():
    queue = deque([req(10, 1)])
    win, fake = window(queue, {5.0: [req(10, 2)]})
    pulled = win.pull(queue, BUDGET)
    assert [r[0] for r in pulled.requests] == [1] and 0.1 <= pulled.waited <= 0.1 + 1e-9
    full = deque([req(10, i) for i in range(10)])
    win, fake = window(full, timeout=10.0)
    pulled = win.pull(full, BUDGET)
    assert len(pulled.requests) == 8 and fake.sleeps == 0 and pulled.waited == 0.0


def test_a_long_prompt_alone_is_taken_for_chunking_but_never_beyond_the_blocks():
    queue = deque([req(150, 1), req(5, 2)])                    # 150 tokens > 100: alone, its 10 blocks fit
    pulled = window(queue)[0].pull(queue, BUDGET)
    assert [r[0] for r in pulled.requests] == [1] and pulled.blocks == 10
    huge = deque([req(16 * 11, 3)])                            # 11 blocks of the 10 free: it waits
    assert window(huge)[0].pull(huge, BUDGET).requests == [] and len(huge) == 1


def test_reserved_output_blocks_count_per_request_and_a_bad_timeout_is_refused():
    budget = WindowBudget(max_tokens=100, free_blocks=6, block_size=16, max_requests=8, reserved_output_blocks=2)
    queue = deque([req(16, 1), req(16, 2), req(16, 3)])        # 1 + 2 blocks each: two fit in 6
    assert len(window(queue)[0].pull(queue, budget).requests) == 2
    with pytest.raises(ValueError, match=">= 0"):
        BatchingWindow(-1.0)


# -- the window in an expert-parallel engine loop ----------------------------------------------------


class LoopCore:
    """What `LockstepEngineLoop` reads of an engine core, recording what it is handed."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.added: list[str] = []
        self.aborted: list[str] = []
        self.scheduler = SimpleNamespace(requests={}, kv_cache_manager=SimpleNamespace(num_free_blocks=100),
                                         config=SimpleNamespace(max_num_batched_tokens=512, block_size=16,
                                                                max_num_seqs=8))

    def has_unfinished_requests(self) -> bool:
        return False

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def abort_requests(self, ids, status) -> None:
        self.aborted += list(ids)


def test_a_request_aborted_while_the_window_waits_is_never_handed_to_the_engine():
    """The window took ``a`` and ``b`` and waits for more; an abort of ``a`` arrives meanwhile:
    only ``b`` reaches the core, and the queue (filtered in place, not replaced under the pull)
    does not hand ``a`` over again later."""
    from types import SimpleNamespace

    import zmq

    from fdplug.core.request import RequestStatus
    from fdplug.server.engine import protocol as P
    from fdplug.server.engine.lockstep_loop import LockstepEngineLoop

    ctx = zmq.Context()
    to_engine, engine_in = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_out, from_engine = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    engine_in.bind("inproc://in"), to_engine.connect("inproc://in")
    from_engine.bind("inproc://out"), engine_out.connect("inproc://out")
    try:
        core = LoopCore()
        loop = LockstepEngineLoop(core, engine_in, engine_out, parent_pid=0, group=SimpleNamespace(busy=False),
                                  window_seconds=0.05)
        loop.arrivals.extend(SimpleNamespace(request_id=rid, num_prompt_tokens=8) for rid in ("a", "b"))
        to_engine.send(P.pack([P.ABORT, ["a"], int(RequestStatus.FINISHED_ABORTED)]))
        loop._admit_arrivals()
        assert core.added == ["b"] and core.aborted == ["a"] and not loop.arrivals
        assert P.unpack(from_engine.recv(zmq.NOBLOCK)) == [P.ADMITTED, ["b"], []]
        loop._admit_arrivals()
        assert core.added == ["b"]
    finally:
        for sock in (to_engine, engine_in, engine_out, from_engine):
            sock.close(0)
        ctx.term()
