"""The engine process's step loop: drain messages, step, send outputs; until shutdown or the parent is gone.

The loop only ever blocks in a ZMQ poll when it has nothing to do, and never waits on a client.
One engine runs `EngineLoop`; an engine that is one rank of an expert-parallel group runs its
subclass `fdplug.server.engine.lockstep_loop.LockstepEngineLoop`, which keeps the group's lockstep
through the hooks below (vLLM's ``DPEngineCoreProc`` over ``EngineCoreProc``).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from fdplug.core.request import Request, RequestStatus
from fdplug.errors import FdplugError, InvalidRequestError
from fdplug.server.engine import protocol as P

logger = logging.getLogger("fdplug.engine_process")

IDLE_POLL_MS = 100        # nothing to run: wait this long for a message, then check the parent
STALLED_POLL_MS = 5       # requests exist but none could be scheduled (e.g. waiting for features)
STATS_INTERVAL_S = 0.25   # busy: attach stats to outputs at most this often
HEARTBEAT_S = 1.0         # idle: send stats at least this often (the API's /metrics stays fresh)


class EngineLoop:
    """Drain messages, step, send outputs; until shutdown or the parent is gone."""

    def __init__(self, core: Any, input_socket: Any, output_socket: Any, parent_pid: int) -> None:
        self.core = core
        self.input = input_socket
        self.output = output_socket
        self.parent_pid = parent_pid
        self.poller = zmq.Poller()
        self.poller.register(input_socket, zmq.POLLIN)
        self.running = True
        self._last_stats_time = 0.0
        self._last_stats: dict | None = None

    def run(self) -> None:
        stalled = False
        while self._looping():
            if os.getppid() != self.parent_pid:
                logger.warning("the API process is gone; the engine process exits")
                return
            self._drain(self._poll_ms(stalled))
            if not self._looping():
                break
            self._begin_iteration()
            if self.running and self.core.has_unfinished_requests():
                ran = self._step()
                if ran is None:
                    break
                outputs, scheduled = ran
                stalled = not outputs and not scheduled   # only feature downloads are in flight
                stats = self._stats_if(due=time.monotonic() - self._last_stats_time >= STATS_INTERVAL_S)
                if outputs or stats is not None:
                    self._send([P.OUTPUTS, [P.encode_output(o) for o in outputs], stats])
            else:
                stalled = False
                stats = self._stats_if(due=time.monotonic() - self._last_stats_time >= HEARTBEAT_S, changed=True)
                if stats is not None:
                    self._send([P.STATS, stats])
            if self._end_iteration():
                break
        # told to shut down: free every request's blocks before the process goes
        self.core.abort_requests(list(self.core.scheduler.requests), RequestStatus.FINISHED_ABORTED)

    # -- the hooks a lockstep loop overrides ------------------------------------------------------

    def _looping(self) -> bool:
        """Whether the loop goes on (checked before and after each drain): until told to shut down."""
        return self.running

    def _has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def _poll_ms(self, stalled: bool) -> int:
        """How long a drain may wait for a message: not at all with work to do, a little when the
        work is stalled (downloads in flight), a heartbeat's while when idle."""
        busy = self._has_work()
        if busy and not stalled:
            return 0
        return STALLED_POLL_MS if busy else IDLE_POLL_MS

    def _begin_iteration(self) -> None:
        """Before this iteration's step, if any."""

    def _step(self) -> tuple[list, bool] | None:
        """One engine step: ``(outputs, scheduled)``; None ends the loop."""
        return self.core.step()

    def _end_iteration(self) -> bool:
        """After this iteration; True ends the loop."""
        return False

    def _add(self, request: Request) -> bool:
        """A request arrived: True if the core took it now (else it was queued for later)."""
        self.core.add_request(request)
        return True

    def _abort(self, request_ids: list[str], status: RequestStatus) -> None:
        self.core.abort_requests(request_ids, status)

    def _waiting_elsewhere(self) -> int:
        """Requests received and not yet handed to the core (they count as waiting in the stats)."""
        return 0

    # -- messages ---------------------------------------------------------------------------------

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
        tag = message[0]
        if tag == P.ADD:
            for item in message[1]:
                try:
                    request = P.decode_request(item)
                    if self._add(request):
                        admitted.append(request.request_id)
                except Exception as exc:  # noqa: BLE001 -- refused (typed), or unreadable: keep serving
                    rejected.append([_request_id(item), refusal(exc)])
        elif tag == P.ABORT:
            self._abort(message[1], RequestStatus(message[2]))
        elif tag == P.WAKE:
            pass       # a peer rank got work: the poll that read this ends, the round follows
        elif tag == P.SHUTDOWN:
            self.running = False
        else:
            logger.error("ignoring an unknown message %r", tag)

    def _stats_if(self, due: bool, changed: bool = False) -> dict | None:
        if not (due or changed):
            return None
        stats = P.encode_stats(self.core.stats())
        stats["num_waiting"] += self._waiting_elsewhere()
        if due or (changed and stats != self._last_stats):
            self._last_stats, self._last_stats_time = stats, time.monotonic()
            return stats
        return None

    def _send(self, message: list) -> None:
        self.output.send(P.pack(message), copy=False)


def refusal(exc: Exception) -> Any:
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
