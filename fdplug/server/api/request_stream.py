"""One request's way back from the engine client to its HTTP handler."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fdplug.core.frontend.outputs import RequestOutput
from fdplug.core.frontend.processor import Delta
from fdplug.errors import FdplugError


class RequestStream:
    """One request's way back to its HTTP handler.

    Streaming handlers pass a queue (shared by the sequences of one HTTP request) and get, in order,
    every ``Delta``, then the final ``RequestOutput``, or ``(request_id, error)`` instead. Non-streaming
    handlers pass none and await ``final()``: no per-token wake-ups for a body sent only at the end.
    """

    __slots__ = ("request_id", "child_ids", "arrival", "queue", "admitted", "result", "_pending",
                 "_first_token", "_last_token", "done")

    def __init__(self, request_id: str, child_ids: list[str], queue: asyncio.Queue | None) -> None:
        loop = asyncio.get_running_loop()
        self.request_id = request_id
        self.child_ids = child_ids
        self.arrival = time.monotonic()
        self.queue = queue
        self.admitted: asyncio.Future[None] = loop.create_future()
        self.result: asyncio.Future[RequestOutput] = loop.create_future()
        self._pending = set(child_ids)        # children the engine has not admitted yet
        self._first_token: float | None = None
        self._last_token: dict[int, float] = {}
        self.done = False

    async def final(self) -> RequestOutput:
        return await self.result

    def child_admitted(self, child_id: str) -> None:
        """The engine admitted one of this request's sequences; ``admitted`` resolves with the last."""
        self._pending.discard(child_id)
        if not self._pending and not self.admitted.done():
            self.admitted.set_result(None)

    def tokens_arrived(self, index: int, now: float) -> tuple[bool, float | None]:
        """Record tokens of sequence ``index`` arriving at ``now``: whether they are the request's
        first (for time to first token) and when that sequence's previous ones came (for inter-token
        latency; None for its first)."""
        first = self._first_token is None
        if first:
            self._first_token = now
        previous = self._last_token.get(index)
        self._last_token[index] = now
        return first, previous

    def end(self, output: RequestOutput, error: FdplugError | None) -> None:
        """Finish: resolve both futures (or fail them with ``error``) and put the last item on the queue."""
        self.done = True
        for future, value in ((self.admitted, None), (self.result, output)):
            if future.done():
                continue
            if error is None:
                future.set_result(value)
            else:
                future.set_exception(error)
                future.exception()  # mark retrieved: nobody may await it (e.g. a stream's result)
        if self.queue is not None:
            self.queue.put_nowait(output if error is None else (self.request_id, error))



class BacklogQueue(asyncio.Queue):
    """A streaming request's queue of events, with a bound on what its client has not taken yet.

    The stream's writer takes everything queued each time the client's socket accepts more, so the
    backlog stays small while the client reads (a single step of a wide request, 128 sequences with
    20 logprobs each, may pass the bound: it counts only while the connection's writes are paused).
    A client that stops reading stops the writer (flow control), and the engine's tokens would pile
    up here for as long as it generates: past ``limit`` tokens (each logprob alternative counted as
    one) with the client taking nothing, ``on_overflow`` runs once, to abort the request and drop
    the connection, instead of the API process growing without end.
    """

    def __init__(self, limit: int, on_overflow: Callable[[], None], write_paused: Callable[[], bool]) -> None:
        super().__init__()
        self.limit = limit
        self.backlog = 0
        self.overflowed = False
        self._on_overflow = on_overflow
        self._write_paused = write_paused

    def put_nowait(self, item: Any) -> None:
        super().put_nowait(item)
        self.backlog += _weight(item)
        if self.backlog > self.limit and not self.overflowed and self._write_paused():
            self.overflowed = True
            self._on_overflow()

    def get_nowait(self) -> Any:     # asyncio.Queue.get ends in get_nowait too
        item = super().get_nowait()
        self.backlog -= _weight(item)
        return item


def _weight(item: Any) -> int:
    if not isinstance(item, Delta):
        return 0
    if item.logprobs:
        return sum(len(entry) for entry in item.logprobs)
    return len(item.token_ids)
