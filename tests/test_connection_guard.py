"""Per-connection bounds on a real uvicorn server (in a thread), probed with raw sockets.

Head size and count (431), idle connections and partial requests (slowloris: closed, 408 where a response can
still be sent), a client that stops reading a stream (aborted; the app sees the disconnect), and the cases that
must keep working: keep-alive, a slow app, a slow but steady reader. Every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import threading
import time
from dataclasses import dataclass, field

import click
import pytest
import uvicorn
from click.testing import CliRunner
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import (
    JSONResponse,
    PlainTextResponse,
    Response,
    StreamingResponse,
)
from starlette.routing import Route

from fdplug.cli.http import connection_options, limits_from
from fdplug.server.http.connection_guard import EXTENSION, ConnectionLimits, uvicorn_kwargs

FAST = ConnectionLimits(idle_timeout=0.5, request_timeout=1.0, write_timeout=1.0)
CHUNK = 64 * 1024
STREAM_BYTES = 200 * 1024 * 1024
BLOB_BYTES = 16 * 1024 * 1024   # more than the kernel buffers of both ends hold


@dataclass(slots=True)
class Progress:
    """How far the /stream generator got and how it ended (written by the server thread)."""

    sent: int = 0
    completed: bool = False
    cancelled: bool = False
    disconnected: bool = False
    ended: threading.Event = field(default_factory=threading.Event)


class RecordedStream(StreamingResponse):
    """Starlette's stream, noting whether it saw ``http.disconnect`` and was cancelled."""

    def __init__(self, progress: Progress) -> None:
        super().__init__(self.chunks(progress))
        self.progress = progress

    @staticmethod
    async def chunks(progress: Progress):
        block = b"x" * CHUNK
        for _ in range(STREAM_BYTES // CHUNK):
            progress.sent += CHUNK
            yield block
            await asyncio.sleep(0)   # like a real stream, which awaits its source: cancellation lands here

    async def listen_for_disconnect(self, receive) -> None:
        await super().listen_for_disconnect(receive)
        self.progress.disconnected = True

    async def stream_response(self, send) -> None:
        try:
            await super().stream_response(send)
            self.progress.completed = True
        except asyncio.CancelledError:
            self.progress.cancelled = True
            raise
        finally:
            self.progress.ended.set()


def build_app(progress: Progress) -> Starlette:
    async def health(request: Request):
        return JSONResponse({"status": "ok"})

    async def echo(request: Request):
        try:
            return JSONResponse({"length": len(await request.body())})
        except ClientDisconnect:
            return PlainTextResponse("gone", status_code=499)

    async def slow(request: Request):
        await asyncio.sleep(float(request.query_params["s"]))
        return JSONResponse({"status": "ok"})

    async def drop(request: Request):
        request.scope["extensions"][EXTENSION].close()
        return JSONResponse({"status": "dropped"})

    async def stream(request: Request):
        return RecordedStream(progress)

    async def blob(request: Request):
        return Response(b"b" * BLOB_BYTES)

    return Starlette(routes=[Route("/health", health), Route("/echo", echo, methods=["POST"]),
                             Route("/slow", slow), Route("/drop", drop), Route("/stream", stream),
                             Route("/blob", blob)])


@dataclass(slots=True)
class Running:
    port: int
    progress: Progress
    server: uvicorn.Server
    thread: threading.Thread
    listener: socket.socket

    def connect(self, timeout: float = 5.0) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=timeout)
        sock.settimeout(timeout)
        return sock


def loop_factory(name: str):
    if name == "uvloop":
        uvloop = pytest.importorskip("uvloop")
        return uvloop.new_event_loop
    return asyncio.new_event_loop


@pytest.fixture
def serve():
    """``serve(limits, loop)`` starts the app behind the guard in a thread; every server is stopped after."""
    started: list[Running] = []

    def start(limits: ConnectionLimits = FAST, loop: str = "uvloop") -> Running:
        factory = loop_factory(loop)
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen(1024)
        progress = Progress()
        config = uvicorn.Config(build_app(progress), log_config=None, log_level="warning", access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1, **uvicorn_kwargs(limits))
        server = uvicorn.Server(config)

        def run() -> None:
            with asyncio.Runner(loop_factory=factory) as runner:
                runner.run(server.serve(sockets=[listener]))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        running = Running(listener.getsockname()[1], progress, server, thread, listener)
        started.append(running)
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)
        return running

    try:
        yield start
    finally:
        for running in started:
            running.server.should_exit = True
        for running in started:
            running.thread.join(timeout=10)
            running.listener.close()
            assert not running.thread.is_alive(), "server did not stop"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def read_all(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """Everything until the server closes (a reset after data counts as a close)."""
    data = b""
    while len(data) < limit:
        try:
            part = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            break
        if not part:
            break
        data += part
    return data


def parse(raw: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = raw.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), headers, body


def assert_openai_error(raw: bytes, status: int, words: str) -> None:
    code, headers, body = parse(raw)
    assert code == status, raw[:300]
    assert headers["content-type"] == "application/json" and headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == status and error["type"] == "invalid_request_error" and error["param"] is None
    assert words in error["message"], error


def request(sock: socket.socket, path: str = "/health", extra: bytes = b"") -> tuple[int, dict, bytes]:
    """One keep-alive GET with a Content-Length response, read exactly."""
    sock.sendall(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: t\r\n" + extra + b"\r\n")
    raw = b""
    while b"\r\n\r\n" not in raw:
        part = sock.recv(65536)
        assert part, f"closed after {raw!r}"
        raw += part
    code, headers, body = parse(raw)
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return code, headers, body


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_idle_connections_are_closed_and_their_descriptors_freed(serve, loop):
    running = serve(loop=loop)
    baseline = open_fds()
    clients = [running.connect() for _ in range(300)]
    clients[-1].settimeout(FAST.idle_timeout / 5)
    with pytest.raises(TimeoutError):   # open before the idle timeout (a loaded machine fires timers late, not early)
        clients[-1].recv(1)
    clients[-1].settimeout(5)
    assert [c.recv(1) for c in clients] == [b""] * 300   # ...closed by the server after it
    deadline = time.monotonic() + 3
    while open_fds() != baseline + 300 and time.monotonic() < deadline:   # only the client ends are left
        time.sleep(0.02)
    assert open_fds() == baseline + 300
    for c in clients:
        c.close()
    assert open_fds() == baseline
    assert not running.server.server_state.connections


@pytest.mark.parametrize("partial", [b"GET /health HTTP/1.1\r\nHost: t\r\nX-Partial: ab",
                                     b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nabc"],
                         ids=["half a head", "3 of 100 body bytes"])
def test_a_partial_request_gets_408_after_request_timeout(serve, partial):
    running = serve()
    with running.connect() as sock:
        started = time.monotonic()
        sock.sendall(partial)
        raw = read_all(sock)
        assert time.monotonic() - started >= FAST.request_timeout * 0.9
    assert_openai_error(raw, 408, "--request-timeout")


def test_head_bytes_limit_is_exact(serve):
    running = serve()
    head = b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: \r\n\r\n"
    filler = b"a" * (FAST.max_header_bytes - len(head))
    with running.connect() as sock:   # exactly at the limit: served
        assert request(sock, extra=b"X-Big: " + filler + b"\r\n")[0] == 200
    with running.connect() as sock:   # one byte over: refused
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: " + filler + b"a\r\n\r\n")
        assert_openai_error(read_all(sock), 431, "send fewer or smaller headers")


def test_a_32_mib_header_is_cut_while_health_answers(serve):
    running = serve()
    outcome: dict[str, object] = {}

    def send_big() -> None:
        with running.connect(timeout=10) as sock:
            try:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\nX-Big: ")
                block = b"a" * (256 * 1024)
                for _ in range(128):
                    sock.sendall(block)
                    outcome["sent"] = outcome.get("sent", 0) + len(block)
            except (BrokenPipeError, ConnectionResetError):
                outcome["cut"] = True
            outcome["reply"] = read_all(sock)

    sender = threading.Thread(target=send_big, daemon=True)
    sender.start()
    deadline = time.monotonic() + 5
    while not outcome and time.monotonic() < deadline:
        time.sleep(0.001)
    with running.connect() as sock:
        started = time.monotonic()
        code = request(sock)[0]
        health_seconds = time.monotonic() - started
    sender.join(timeout=10)
    assert not sender.is_alive()
    assert code == 200 and health_seconds < 2.0, health_seconds
    reply = outcome["reply"]
    if reply:   # the refusal reached the client; else the connection was cut
        assert_openai_error(reply, 431, "--max-header-bytes")
    else:
        assert outcome.get("cut") or outcome.get("sent", 0) < 32 * 1024 * 1024


def test_header_count_limit(serve):
    running = serve()
    many = b"".join(b"X-H%d: v\r\n" % i for i in range(FAST.max_header_count))   # with Host: one too many
    with running.connect() as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: t\r\n" + many + b"\r\n")
        assert_openai_error(read_all(sock), 431, "fewer headers")
    with running.connect() as sock:
        assert request(sock, extra=many[many.index(b"\r\n") + 2:])[0] == 200   # Host + 99: at the limit


def start_stream(running: Running, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(5)
    sock.connect(("127.0.0.1", running.port))
    sock.sendall(b"GET /stream HTTP/1.1\r\nHost: t\r\n\r\n")
    return sock


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_a_client_that_stops_reading_is_aborted(serve, loop):
    running = serve(loop=loop)
    with start_stream(running):
        assert running.progress.ended.wait(timeout=FAST.write_timeout + 5), running.progress
    progress = running.progress
    assert progress.disconnected and progress.cancelled and not progress.completed
    assert progress.sent < 64 * 1024 * 1024, progress.sent   # buffers' worth, not the stream


def test_a_closing_response_nobody_reads_is_dropped(serve):
    running = serve()
    connections = running.server.server_state.connections
    with running.connect() as sock:
        sock.sendall(b"GET /blob HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        started = time.monotonic()
        while not connections and time.monotonic() < started + 5:
            time.sleep(0.01)
        assert connections
        while connections and time.monotonic() < started + 2 * FAST.write_timeout + 5:
            time.sleep(0.05)
        assert not connections   # its descriptor and buffers are freed...
        assert time.monotonic() - started >= FAST.write_timeout * 0.9   # ...by the write timeout


def test_a_slow_but_steady_reader_is_not_cut(serve):
    running = serve()
    received = 0
    with start_stream(running) as sock:
        for _ in range(40):   # 64 KiB every 50 ms for 2 s: twice the write timeout
            part = sock.recv(CHUNK)
            assert part, "cut"
            received += len(part)
            time.sleep(0.05)
        assert not running.progress.ended.is_set(), running.progress
    assert received > 20 * CHUNK


def test_keep_alive_and_a_slow_app_still_work(serve):
    running = serve()
    with running.connect() as sock:
        for _ in range(3):
            code, _, body = request(sock)
            assert (code, json.loads(body)) == (200, {"status": "ok"})
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello")
        assert json.loads(parse(read_until(sock, b"}"))[2]) == {"length": 5}
        # an app slower than both the idle and the request timeouts is not cut
        assert request(sock, "/slow?s=%g" % (FAST.request_timeout * 1.5))[0] == 200
        assert request(sock)[0] == 200
        assert read_all(sock) == b""   # then idle: closed


def test_a_body_behind_the_head_and_pipelined_requests(serve):
    running = serve()
    body = b"z" * 1_000_000   # far past the head budget, in the same packets as the head
    with running.connect() as sock:
        sock.sendall(b"POST /echo HTTP/1.1\r\nHost: t\r\nContent-Length: %d\r\n\r\n" % len(body) + body
                     + b"GET /health HTTP/1.1\r\nHost: t\r\n\r\n"
                     + b"GET /health HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        raw = read_all(sock)
    assert raw.count(b"HTTP/1.1 200 OK") == 3 and b'{"length":1000000}' in raw, raw[:500]


def read_until(sock: socket.socket, end: bytes) -> bytes:
    raw = b""
    while not raw.endswith(end):
        part = sock.recv(65536)
        assert part, raw
        raw += part
    return raw


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_the_app_can_drop_its_connection(serve, loop):
    running = serve(loop=loop)
    with running.connect() as sock:
        sock.sendall(b"GET /drop HTTP/1.1\r\nHost: t\r\n\r\n")
        assert read_all(sock) == b""
    with running.connect() as sock:
        assert request(sock)[0] == 200


def test_flags_and_config():
    @click.command()
    @connection_options
    def cmd(**kw):
        limits = limits_from(kw)
        assert kw == {}
        click.echo(repr(limits))

    out = CliRunner().invoke(cmd, ["--idle-timeout", "2", "--max-header-count", "50"])
    assert out.exit_code == 0, out.output
    assert "max_header_count=50" in out.output and "idle_timeout=2.0" in out.output
    assert "max_header_bytes=65536" in out.output
    help_text = CliRunner().invoke(cmd, ["--help"]).output
    for flag in ("--max-header-bytes", "--max-header-count", "--idle-timeout", "--request-timeout",
                 "--write-timeout"):
        assert flag in help_text
    assert CliRunner().invoke(cmd, ["--max-header-bytes", "0"]).exit_code != 0
    kwargs = uvicorn_kwargs(FAST)
    assert kwargs["timeout_keep_alive"] == FAST.idle_timeout and callable(kwargs["http"])
    with pytest.raises(ValueError):
        ConnectionLimits(request_timeout=-1)
