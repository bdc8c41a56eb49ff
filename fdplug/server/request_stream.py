"""One request's way back from the engine client to its HTTP handler."""

from __future__ import annotations

import asyncio
import time

from fdplug.core.frontend.outputs import RequestOutput
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

    def _end(self, output: RequestOutput, error: FdplugError | None) -> None:
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
