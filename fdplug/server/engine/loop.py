"""The engine process's step loop: drain messages, step, send outputs; until shutdown or the parent is gone.

The loop only ever blocks in a ZMQ poll when it has nothing to do, and never waits on a client.

Expert parallel (a `LockstepGroup`): the loop keeps the group's lockstep
(`fdplug.core.parallel.lockstep`): an iteration that ran no forward pass takes part in the round
anyway (``idle_round``: a dummy pass when another rank runs one), an idle group sleeps in the poll
like one engine, and a rank about to start a step from idle first waits up to
``FD_EP_BATCHED_TOKEN_TIMEOUT`` for more requests (`BatchingWindow`: a step every rank must join
should carry more than one request). A shutdown of any rank ends every rank's loop.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from typing import Any

import zmq

from fdplug.errors import FdplugError, InvalidRequestError, ParallelGroupError
from fdplug.server.engine import protocol as P

logger = logging.getLogger("fdplug.engine_process")

IDLE_POLL_MS = 100        # nothing to run: wait this long for a message, then check the parent
STALLED_POLL_MS = 5       # requests exist but none could be scheduled (e.g. waiting for features)
STATS_INTERVAL_S = 0.25   # busy: attach stats to outputs at most this often
HEARTBEAT_S = 1.0         # idle: send stats at least this often (the API's /metrics stays fresh)


class EngineLoop:
    """Drain messages, step, send outputs; until shutdown or the parent is gone."""

    def __init__(self, core: Any, input_socket: Any, output_socket: Any, parent_pid: int, group: Any = None,
                 window_seconds: float = 0.0) -> None:
        """``group``: this engine's `LockstepGroup` (expert parallel), whose requests go through a
        batching window of ``window_seconds``."""
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.running = True
        self._last_stats_time = 0.0
        self._last_stats: dict | None = None
        self.group, self.window_seconds = group, window_seconds
        self.arrivals: deque = deque()    # expert parallel: requests received, not yet handed to the core
        self.aborted: set[str] = set()    # aborted while a pull of the window was under way
        self.window = None
        if group is not None:
            from fdplug.core.scheduler.batching_window import BatchingWindow

            self.window = BatchingWindow(window_seconds, num_tokens=lambda r: r.num_prompt_tokens,
                                         sleep=self._wait_for_more)

    def run(self) -> None:
        from fdplug.core.request import RequestStatus

        stalled = False
        while self.running or self.group is not None:
            if os.getppid() != self.parent_pid:
                logger.warning("the API process is gone; the engine process exits")
                return
            busy = self.core.has_unfinished_requests() or bool(self.arrivals)
            group_busy = self.group is not None and self.group.busy
            self._drain(0 if (busy and not stalled) or group_busy else STALLED_POLL_MS if busy else IDLE_POLL_MS)
            if self.group is None and not self.running:
                break
            rounds = self.group.headers if self.group is not None else 0
            if self.arrivals and self.running:
                self._admit_arrivals()
            if self.running and self.core.has_unfinished_requests():
                try:
                    outputs, scheduled = self.core.step()
                except ParallelGroupError:
                    if self.group is None or not self.group.leaving:
                        raise
                    break              # another rank stopped the group during this step's re-runs
                stalled = not outputs and not scheduled   # only feature downloads are in flight
                stats = self._stats_if(due=time.monotonic() - self._last_stats_time >= STATS_INTERVAL_S)
                if outputs or stats is not None:
                    self._send([P.OUTPUTS, [P.encode_output(o) for o in outputs], stats])
            else:
                stalled = False
                stats = self._stats_if(due=time.monotonic() - self._last_stats_time >= HEARTBEAT_S, changed=True)
                if stats is not None:
                    self._send([P.STATS, stats])
            if self.group is not None:
                if self.group.headers == rounds:     # no pass of ours this iteration: join the round
                    self.group.idle_round(leaving=not self.running)
                if self.group.leaving:
                    if self.running:
                        logger.warning("another rank of the expert-parallel group is stopping; so does this one")
                    break
        # told to shut down: free every request's blocks before the process goes
        self.core.abort_requests(list(self.core.scheduler.requests), RequestStatus.FINISHED_ABORTED)

    def _drain(self, timeout_ms: int) -> None:
        if not self.poller.poll(timeout_ms):
            return
        admitted: list[str] = []
        rejected: list[list] = []
        while self.running:
            try:
                data = self.input.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                self._handle(P.unpack(data), admitted, rejected)
            except Exception:   # a malformed message (a bug in the sender) must not stop the loop
                logger.exception("ignoring a message the engine could not handle")
        if admitted or rejected:
            self._send([P.ADMITTED, admitted, rejected])

    def _handle(self, message: list, admitted: list[str], rejected: list[list]) -> None:
        from fdplug.core.request import RequestStatus

        tag = message[0]
        if tag == P.ADD:
            for item in message[1]:
                try:
                    request = P.decode_request(item)
                    if self.group is not None:     # checked now, handed to the core by the batching window
                        self.core.validate(request, also_waiting=len(self.arrivals))
                        self.arrivals.append(request)
                        continue
                    self.core.add_request(request)
                    admitted.append(request.request_id)
                except Exception as exc:  # noqa: BLE001 -- refused (typed), or unreadable: keep serving
                    rejected.append([_request_id(item), _refusal(exc)])
        elif tag == P.ABORT:
            if self.group is not None:     # in the window's queue (filtered in place: a pull may be reading it)
                self.aborted.update(message[1])
                kept = [r for r in self.arrivals if r.request_id not in self.aborted]
                self.arrivals.clear()
                self.arrivals.extend(kept)
            self.core.abort_requests(message[1], RequestStatus(message[2]))
        elif tag == P.WAKE:
            pass       # a peer rank got work: the poll that read this ends, the round follows
        elif tag == P.SHUTDOWN:
            self.running = False
        else:
            logger.error("ignoring an unknown message %r", tag)

    def _admit_arrivals(self) -> None:
        """Expert parallel: hand the core what the batching window takes (waiting for more only
        when the whole group is idle: this rank's next step starts a round every rank joins; a busy
        peer is never kept waiting). A head the window cannot fit while the core is empty goes
        anyway: admission judges it."""
        from fdplug.core.scheduler.batching_window import WindowBudget

        core = self.core
        idle = not core.has_unfinished_requests()
        self.window.timeout = self.window_seconds if idle and not self.group.busy else 0.0
        config = core.scheduler.config
        budget = WindowBudget(config.max_num_batched_tokens,
                              core.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
                              config.block_size, max(1, config.max_num_seqs - len(core.scheduler.requests)))
        self.aborted.clear()
        taken = [r for r in self.window.pull(self.arrivals, budget).requests if r.request_id not in self.aborted]
        if not taken and idle and self.arrivals:
            taken = [self.arrivals.popleft()]
        admitted: list[str] = []
        rejected: list[list] = []
        for request in taken:
            try:
                core.add_request(request)
                admitted.append(request.request_id)
            except Exception as exc:  # noqa: BLE001 -- refused, this request only
                rejected.append([request.request_id, _refusal(exc)])
        if admitted or rejected:
            self._send([P.ADMITTED, admitted, rejected])

    def _wait_for_more(self, seconds: float) -> None:
        """The batching window's sleep: read messages for up to ``seconds`` (new requests join the queue)."""
        self._drain(max(1, int(seconds * 1000)))

    def _stats_if(self, due: bool, changed: bool = False) -> dict | None:
        if not (due or changed):
            return None
        stats = P.encode_stats(self.core.stats())
        stats["num_waiting"] += len(self.arrivals)     # expert parallel: in the batching window's queue
        if due or (changed and stats != self._last_stats):
            self._last_stats, self._last_stats_time = stats, time.monotonic()
            return stats
        return None

    def _send(self, message: list) -> None:
        self.output.send(P.pack(message), copy=False)


def _refusal(exc: Exception) -> Any:
    """Why a request was not admitted, as the API process reads it: its typed error, or (not a
    request the engine can read: a bug in the sender) an InvalidRequestError saying so."""
    if isinstance(exc, FdplugError):
        return P.encode_error(exc)
    logger.exception("could not admit a request")
    return P.encode_error(InvalidRequestError(f"the engine could not read this request ({type(exc).__name__}).",
                                              fix="report it with the server log: the API process sent a "
                                                  "malformed request."))


def _request_id(item: Any) -> str:
    return item[0] if isinstance(item, list) and item and isinstance(item[0], str) else ""
