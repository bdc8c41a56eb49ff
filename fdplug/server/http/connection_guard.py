"""Bounded resources per HTTP connection: head size and count, idle and partial-request timeouts, stalled writes.
uvicorn's httptools protocol buffers a head of any size (a 64 MiB header stalls the loop) and keeps a connection
that sends nothing, half a head or part of a body open for ever (slowloris): a subclass of it bounds each."""

from __future__ import annotations

import asyncio
import fcntl
import functools
import http
import json
import logging
import struct
import termios
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from fdplug.server.http.limits import ConnectionLimits

logger = logging.getLogger(__name__)

LINGER = 1.0   # seconds a refused connection still reads (and drops) so that its client can read the refusal
EXTENSION = "fdplug.connection"


@dataclass(slots=True)
class ConnectionHandle:
    """``scope["extensions"]["fdplug.connection"]``: lets the app drop its client's connection, e.g. a
    stream whose unsent output passed its bound (the request is then aborted like a disconnect)."""

    transport: asyncio.Transport
    flow: Any                         # uvicorn's FlowControl of the connection

    @property
    def write_paused(self) -> bool:
        """The client is not taking what was written (the transport's buffer is over its high mark)."""
        return bool(self.flow.write_paused)

    def close(self) -> None:
        """Drop the connection now, unsent output included."""
        self.transport.abort()


def error_response(status: int, message: str, default_headers: list[tuple[bytes, bytes]]) -> bytes:
    """A complete ``Connection: close`` response carrying an OpenAI error object."""
    error = {"message": message, "type": "invalid_request_error", "param": None, "code": status}
    body = json.dumps({"error": error}).encode()
    head = [f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode()]
    head += [name + b": " + value + b"\r\n" for name, value in default_headers]
    head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
             b"connection: close\r\n\r\n"]
    return b"".join(head) + body


class GuardedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with ``limits`` enforced on each connection. The head is fed to the parser at
    most ``max_header_bytes`` at a time: one that never ends is cut at the limit, not buffered. Timers are
    ``loop.call_later`` handles, all cancelled in connection_lost (a fired one is harmless to cancel)."""

    def __init__(self, *args: Any, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limits = limits
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._reading_head = True     # the next bytes fed belong to a request head
        self._in_request = False      # from a request's first byte until its whole body has arrived
        self._rejected = False        # answered (431/408) and closing: nothing more is parsed
        self._head_bytes = 0          # bytes fed since the head began (raw, CRLFs included)
        self._parsed_bytes = 0        # URL and header bytes the parser reported (bounds pipelined heads too)
        self._header_count = self._paused_unsent = 0
        self._handle: ConnectionHandle | None = None

    def _arm(self, name: str, delay: float, callback: Callable[[], None]) -> None:
        self._disarm(name)
        if delay > 0:
            self._timers[name] = self.loop.call_later(delay, callback)

    def _disarm(self, name: str) -> None:
        if (handle := self._timers.pop(name, None)) is not None:
            handle.cancel()

    def _disarm_all(self) -> None:
        for name in list(self._timers):
            self._disarm(name)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._handle = ConnectionHandle(transport, self.flow)
        self._arm("idle", self.limits.idle_timeout, self._close_when_drained)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_all()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """Feed the parser, a head at most up to its byte budget: past it the request is refused."""
        while data and not self._rejected and not self.transport.is_closing():
            chunk = data
            if self._reading_head:
                budget = self.limits.max_header_bytes - self._head_bytes
                chunk = data[:budget]
                self._head_bytes += len(chunk)
            data = data[len(chunk):]
            super().data_received(chunk)
            if self._reading_head and self._head_bytes >= self.limits.max_header_bytes and not self._rejected:
                self._refuse_head_bytes()

    def send_400_response(self, msg: str) -> None:
        """Malformed HTTP (httptools' parse error): an OpenAI error object too, not uvicorn's plain text."""
        if not self._rejected:   # a parse error past a refusal must not add a second response
            self._reject(400, "The request is not valid HTTP/1.1 (a malformed request line, header or body "
                              "framing); send a well-formed request.")

    def on_message_begin(self) -> None:
        if not self._rejected:
            super().on_message_begin()
            self._in_request, self._parsed_bytes, self._header_count = True, 0, 0
            self._disarm("idle")
            self._arm("request", self.limits.request_timeout, self._request_expired)

    def on_url(self, url: bytes) -> None:
        if not self._rejected and self._within_head(len(url)):
            super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._rejected:
            return
        self._header_count += 1
        if self._header_count > self.limits.max_header_count:
            self._reject(431, f"The request has more than {self.limits.max_header_count} header fields "
                              "(--max-header-count); send fewer headers.")
        elif self._within_head(len(name) + len(value) + 4):   # ": " and CRLF
            super().on_header(name, value)

    def _within_head(self, size: int) -> bool:
        self._parsed_bytes += size   # exact for a pipelined head too (its raw bytes may share a chunk)
        if self._parsed_bytes > self.limits.max_header_bytes:
            self._refuse_head_bytes()
        return not self._rejected

    def on_headers_complete(self) -> None:
        if not self._rejected:   # the scope is the dict the cycle shares; its task has not run yet
            self._reading_head = False
            super().on_headers_complete()
            self.scope.setdefault("extensions", {})[EXTENSION] = self._handle  # type: ignore[typeddict-item]

    def on_body(self, body: bytes) -> None:
        if not self._rejected:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if not self._rejected:
            super().on_message_complete()
            self._reading_head, self._in_request, self._head_bytes = True, False, 0
            self._disarm("request")
            self._maybe_idle()   # the app may have answered before the body had all arrived

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._unset_keepalive_if_required()   # uvicorn's keep-alive timer: the idle timer replaces it
        if self.transport.is_closing():   # Connection: close
            self._close_when_drained()
        self._maybe_idle()

    def _maybe_idle(self) -> None:   # idle: no request arriving and every response complete
        done = self.cycle is None or self.cycle.response_complete   # self.cycle: the latest request's
        if done and not self._in_request and not self.pipeline and not self.transport.is_closing():
            self._arm("idle", self.limits.idle_timeout, self._close_when_drained)

    def pause_writing(self) -> None:
        super().pause_writing()
        self._watch_writes()

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self.transport.is_closing():   # closing: what is left must still drain, or be dropped
            self._disarm("write")

    def _close_when_drained(self) -> None:
        """Close; output still pending is watched like paused writes (a client reading none of it is dropped)."""
        self.transport.close()
        if self.transport.get_write_buffer_size():
            self._watch_writes()

    def _watch_writes(self) -> None:
        self._paused_unsent = self._unsent()
        self._arm("write", self.limits.write_timeout, self._write_stalled)

    def _unsent(self) -> int:
        """Output the client has not acknowledged: the transport's buffer and (Linux) the socket's send queue;
        the buffer alone moves in steps of a third of the kernel's (megabytes): too coarse for a slow reader."""
        unsent = self.transport.get_write_buffer_size()
        try:
            queued = fcntl.ioctl(self.transport.get_extra_info("socket").fileno(), termios.TIOCOUTQ, b"\0" * 4)
            return unsent + struct.unpack("i", queued)[0]
        except (AttributeError, OSError, ValueError):   # not a socket, or no SIOCOUTQ here
            return unsent

    def _write_stalled(self) -> None:
        """Paused for write_timeout: alive if the client took some output meanwhile, else aborted."""
        if not self.transport.get_write_buffer_size():   # all handed to the kernel
            return
        if self._unsent() < self._paused_unsent:
            self._watch_writes()
            return
        logger.info("%s: client read nothing for %g s (--write-timeout): connection aborted",
                    self.client, self.limits.write_timeout)
        self.transport.abort()

    def _request_expired(self) -> None:
        # the server holding the body back (app busy, pipelining, 100-continue) is not the client's delay
        if self.flow.read_paused or (not self._reading_head and self.cycle.waiting_for_100_continue):
            self._arm("request", self.limits.request_timeout, self._request_expired)
            return
        self._reject(408, f"The request did not arrive in full within {self.limits.request_timeout:g} s of its "
                          "first byte (--request-timeout); send it without pauses.")

    def _refuse_head_bytes(self) -> None:
        self._reject(431, f"The request line and headers take more than {self.limits.max_header_bytes} bytes "
                          "(--max-header-bytes); send fewer or smaller headers.")

    def _can_respond(self) -> bool:
        """Whether an error response would not land inside another response (pipelining, a started one)."""
        if self._reading_head:   # self.cycle is the previous request's
            return not self.pipeline and (self.cycle is None or self.cycle.response_complete)
        return not self.pipeline and not self.cycle.response_started

    def _reject(self, status: int, message: str) -> None:
        """Answer ``status`` and close (lingering) where a response can still be sent, else abort."""
        self._rejected = True
        logger.info("%s: %d %s", self.client, status, message)
        if self.transport.is_closing():   # its pending output, if any, is already watched
            return
        self._disarm_all()
        if not self._can_respond():   # another response is on the wire: cut it, its app sees a disconnect
            self.transport.abort()
            return
        if not self._reading_head:   # this request's app: it sees a disconnect, its sends are dropped
            self.cycle.disconnected, self.cycle.waiting_for_100_continue = True, False
            self.cycle.message_event.set()
        self.transport.write(error_response(status, message, self.server_state.default_headers))
        if self.transport.can_write_eof():   # a close with unread input would reset and lose the answer
            self.transport.write_eof()
            self._arm("linger", LINGER, self.transport.abort)
        else:
            self.transport.close()


def uvicorn_kwargs(limits: ConnectionLimits) -> dict[str, Any]:
    """``uvicorn.Config(app, **uvicorn_kwargs(limits), ...)``: the guarded protocol with ``limits`` bound;
    uvicorn's keep-alive set to the idle timeout so the two agree (the protocol cancels uvicorn's own timer);
    WebSocket upgrades off (the API has none, and an upgraded connection would leave the guard)."""
    factory = functools.partial(GuardedHttpToolsProtocol, limits=limits)
    return {"http": factory, "timeout_keep_alive": limits.idle_timeout or 5, "ws": "none"}
