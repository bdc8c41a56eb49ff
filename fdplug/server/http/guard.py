"""The guard in front of an HTTP front's app: the drain's door, the API key, the body size.

Plain ASGI (not ``BaseHTTPMiddleware``, which would buffer streaming responses); `fdplug serve`'s
app and `fdplug router`'s both run behind it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from fdplug.errors import AuthenticationError, FdplugError, RequestTooLargeError
from fdplug.server.http.error_responses import error_body

if TYPE_CHECKING:
    from fdplug.server.http.drain import Drain

OPEN_PATHS = ("/health", "/metrics", "/version")   # never need the API key: probes and scrapers


class Guard:
    """Before the app runs: the drain's door (`Drain`), the API key (constant-time compare) on
    ``/v1/*``, then the body size limit. Probes (``/health``, ``/metrics``, ``/version``) pass.

    The limit is checked on ``Content-Length`` and again while the body is read (chunked uploads
    have none); an accepted body is handed to the app as one message. Every request let in counts
    as in flight until the app has answered it to the end, and one that uvicorn cancels before its
    answer started (its shutdown grace ended) still gets a JSON 503.
    """

    def __init__(self, app: Any, api_key: str | None, max_body_bytes: int, metrics: Any, drain: Drain) -> None:
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.drain = drain

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http" or scope["path"].startswith(OPEN_PATHS):
            return await self.app(scope, receive, send)
        if self.drain.draining:
            return await self._reject(send, self.drain.refusal())
        started = False

        async def tracked(message: dict) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        self.drain.active += 1
        try:
            await self._guard(scope, receive, tracked)
        except asyncio.CancelledError:
            if started or not self.drain.draining:
                raise
            await self._reject(send, self.drain.refusal())
        finally:
            self.drain.active -= 1

    async def _guard(self, scope: dict, receive: Callable, send: Callable) -> None:
        headers = dict(scope.get("headers") or ())
        if self.api_key is not None and not self._authorized(headers):
            return await self._reject(send, AuthenticationError(
                "missing or incorrect API key.", fix="send it as the header `Authorization: Bearer <key>`."),
                code="invalid_api_key", extra_headers=[(b"www-authenticate", b"Bearer")])
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        too_large = RequestTooLargeError(f"the request body is over this server's limit of {self.max_body_bytes} "
                                         "bytes.", fix="send a smaller request, or start the server with a larger "
                                                       "--max-body-bytes.")
        length = headers.get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            return await self._reject(send, too_large)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                return await self._reject(send, too_large)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    def _authorized(self, headers: dict) -> bool:
        auth = headers.get(b"authorization", b"")
        scheme, _, token = auth.partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)

    async def _reject(self, send: Callable, exc: FdplugError, code: str | None = None,
                      extra_headers: list | None = None) -> None:
        self.metrics.http_error(exc.http_status)
        message = exc.message + (f" Fix: {exc.fix}" if exc.fix else "")
        body = json.dumps(error_body(message, exc.error_type, None, code or exc.http_status)).encode()
        await send({"type": "http.response.start", "status": exc.http_status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close"), *(extra_headers or [])]})
        await send({"type": "http.response.body", "body": body, "more_body": False})
