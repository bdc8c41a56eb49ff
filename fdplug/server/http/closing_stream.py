"""A streaming response that runs a closer when it ends, whether or not its body ever started."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse


class ClosingStream(StreamingResponse):
    """A streaming response that runs ``on_close`` (a function or a coroutine function) when it
    ends, even if its body never started (a disconnect right after admission cancels the response
    before the first event): a job's sequences, a relayed upstream stream, end with it."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Any], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            result = self._on_close()
            if inspect.isawaitable(result):
                await result
