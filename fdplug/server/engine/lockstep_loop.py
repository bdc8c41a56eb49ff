"""An expert-parallel rank's step loop: the engine loop, kept in lockstep with its group.

Every rank of an expert-parallel group must join every forward pass (the experts' exchange is a
collective), so `LockstepEngineLoop` keeps the group's lockstep (`fdplug.core.parallel.lockstep`):
an iteration that ran no forward pass takes part in the round anyway (``idle_round``: a dummy pass
when another rank runs one), an idle group sleeps in the poll like one engine, and a rank about to
start a step from idle first waits up to ``FD_EP_BATCHED_TOKEN_TIMEOUT`` for more requests
(`BatchingWindow`: a step every rank must join should carry more than one request). A shutdown of
any rank ends every rank's loop.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.batching_window import BatchingWindow, WindowBudget
from fdplug.errors import ParallelGroupError
from fdplug.server.engine import protocol as P
from fdplug.server.engine.loop import EngineLoop, refusal

logger = logging.getLogger("fdplug.engine_process")


class LockstepEngineLoop(EngineLoop):
    """The engine loop of one rank of an expert-parallel `LockstepGroup`."""

    def __init__(self, core: Any, input_socket: Any, output_socket: Any, parent_pid: int, group: Any,
                 window_seconds: float) -> None:
        """Requests go through a batching window of ``window_seconds`` before the core takes them."""
        super().__init__(core, input_socket, output_socket, parent_pid)
        self.group, self.window_seconds = group, window_seconds
        self.arrivals: deque = deque()    # requests received, not yet handed to the core
        self.aborted: set[str] = set()    # aborted while a pull of the window was under way
        self.window = BatchingWindow(window_seconds, num_tokens=lambda r: r.num_prompt_tokens,
                                     sleep=self._wait_for_more)
        self.rounds = 0

    def _looping(self) -> bool:
        return True     # a shutdown leaves with the group (`_end_iteration`), never alone

    def _has_work(self) -> bool:
        return super()._has_work() or bool(self.arrivals)

    def _poll_ms(self, stalled: bool) -> int:
        return 0 if self.group.busy else super()._poll_ms(stalled)

    def _begin_iteration(self) -> None:
        self.rounds = self.group.headers
        if self.arrivals and self.running:
            self._admit_arrivals()

    def _step(self) -> tuple[list, bool] | None:
        try:
            return self.core.step()
        except ParallelGroupError:
            if not self.group.leaving:
                raise
            return None              # another rank stopped the group during this step's re-runs

    def _end_iteration(self) -> bool:
        if self.group.headers == self.rounds:     # no pass of ours this iteration: join the round
            self.group.idle_round(leaving=not self.running)
        if self.group.leaving and self.running:
            logger.warning("another rank of the expert-parallel group is stopping; so does this one")
        return self.group.leaving

    def _add(self, request: Request) -> bool:
        """Checked now, handed to the core by the batching window."""
        self.core.validate(request, also_waiting=len(self.arrivals))
        self.arrivals.append(request)
        return False

    def _abort(self, request_ids: list[str], status: RequestStatus) -> None:
        """Also out of the window's queue (filtered in place: a pull may be reading it)."""
        self.aborted.update(request_ids)
        kept = [r for r in self.arrivals if r.request_id not in self.aborted]
        self.arrivals.clear()
        self.arrivals.extend(kept)
        super()._abort(request_ids, status)

    def _waiting_elsewhere(self) -> int:
        return len(self.arrivals)

    def _admit_arrivals(self) -> None:
        """Hand the core what the batching window takes (waiting for more only when the whole group
        is idle: this rank's next step starts a round every rank joins; a busy peer is never kept
        waiting). A head the window cannot fit while the core is empty goes anyway: admission
        judges it."""
        idle = not self.core.has_unfinished_requests()
        self.window.timeout = self.window_seconds if idle and not self.group.busy else 0.0
        self.aborted.clear()
        pulled = self.window.pull(self.arrivals, WindowBudget.of(self.core.scheduler)).requests
        taken = [r for r in pulled if r.request_id not in self.aborted]
        if not taken and idle and self.arrivals:
            taken = [self.arrivals.popleft()]
        admitted: list[str] = []
        rejected: list[list] = []
        for request in taken:
            try:
                self.core.add_request(request)
                admitted.append(request.request_id)
            except Exception as exc:  # noqa: BLE001 -- refused, this request only
                rejected.append([request.request_id, refusal(exc)])
        if admitted or rejected:
            self._send([P.ADMITTED, admitted, rejected])

    def _wait_for_more(self, seconds: float) -> None:
        """The batching window's sleep: read messages for up to ``seconds`` (new requests join the queue)."""
        self._drain(max(1, int(seconds * 1000)))
