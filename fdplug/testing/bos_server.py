"""A loopback server that speaks enough of the BOS protocol for the real ``bce-python-sdk``.

Tests and ``bench/feature_download.py`` use it instead of mocks: the SDK signs, connects, parses
errors and times out exactly as it would against BOS. It serves path-style ``GET /bucket/key`` from
memory, checks that ``Authorization`` has the ``bce-auth-v1/...`` form (and, if given, the access
key), and can inject per-key latency, error statuses, throttling and dropped connections for the
first N requests of a key. Every request is counted per key with its arrival time, and the most
requests it answered at once is kept (``max_in_flight``: whether a client really fetched in parallel).

    with LoopbackBos(access_key="AK") as bos:
        bos.put("bucket", "a/b.npy", data, latency=0.02)
        bos.fail("bucket", "a/b.npy", status=503, code="SlowDown", times=2)
        ... BosSettings(endpoint=bos.endpoint, access_key="AK", secret_key="SK") ...
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
import uuid
from collections import defaultdict, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

AUTH_RE = re.compile(r"^bce-auth-v1/(?P<ak>[^/]+)/\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ/\d+/[^/]*/[0-9a-f]{64}$")
Key = tuple[str, str]


@dataclass(slots=True)
class Fault:
    """What the next ``times`` requests of a key get instead of the object (``status=None``: a dropped connection)."""

    times: int
    status: int | None
    code: str = ""


class _Server(ThreadingHTTPServer):
    """Connections are handled by a pool of ready threads, not a new thread each: starting a thread per
    connection serialised bursts of parallel requests by milliseconds, which the benchmark would measure."""

    daemon_threads = True
    request_queue_size = 256  # a burst of parallel connects must not overflow the accept queue
    bos: LoopbackBos

    def __init__(self, address: tuple[str, int], handler: type, workers: int = 128) -> None:
        super().__init__(address, handler)
        self.pool = ThreadPoolExecutor(workers, thread_name_prefix="loopback-bos-conn")

    def process_request(self, request, client_address) -> None:
        self.pool.submit(self.process_request_thread, request, client_address)

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):  # clients that gave up are normal
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        self.pool.shutdown(wait=False, cancel_futures=True)


class LoopbackBos:
    """The server and its knobs. Start with ``with`` (or ``start()``/``stop()``); thread-safe."""

    def __init__(self, *, access_key: str | None = None, latency: float = 0.0) -> None:
        self.access_key = access_key
        self.default_latency = latency
        self._objects: dict[Key, bytes] = {}
        self._latency: dict[Key, float] = {}
        self._faults: dict[Key, deque[Fault]] = defaultdict(deque)
        self._requests: dict[Key, list[float]] = defaultdict(list)
        self._in_flight = 0
        self.max_in_flight = 0   # the most requests being answered at once since the server started
        self._lock = threading.Lock()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------------------

    def start(self) -> LoopbackBos:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.bos = self
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="loopback-bos", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join(timeout=5)
            self._server = self._thread = None

    def __enter__(self) -> LoopbackBos:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        assert self._server is not None, "start the server first"
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    # -- content and faults ----------------------------------------------------------------------------

    def put(self, bucket: str, key: str, data: bytes, *, latency: float | None = None) -> str:
        """Store an object; returns its ``bos://`` URL."""
        with self._lock:
            self._objects[(bucket, key)] = bytes(data)
            if latency is not None:
                self._latency[(bucket, key)] = latency
        return f"bos://{bucket}/{key}"

    def set_latency(self, bucket: str, key: str, seconds: float) -> None:
        with self._lock:
            self._latency[(bucket, key)] = seconds

    def fail(self, bucket: str, key: str, *, status: int = 503, code: str = "SlowDown", times: int = 1) -> None:
        """The next ``times`` requests of the key get ``status`` with BOS error ``code``."""
        with self._lock:
            self._faults[(bucket, key)].append(Fault(times, status, code))

    def drop(self, bucket: str, key: str, *, times: int = 1) -> None:
        """The next ``times`` requests of the key see the connection closed without a response."""
        with self._lock:
            self._faults[(bucket, key)].append(Fault(times, None))

    # -- what was asked --------------------------------------------------------------------------------

    def request_times(self, bucket: str, key: str) -> list[float]:
        """``time.monotonic()`` of each request of the key, in arrival order."""
        with self._lock:
            return list(self._requests.get((bucket, key), ()))

    def request_count(self, bucket: str | None = None, key: str | None = None) -> int:
        with self._lock:
            if bucket is not None and key is not None:
                return len(self._requests.get((bucket, key), ()))
            return sum(len(times) for times in self._requests.values())

    def requested_keys(self) -> set[Key]:
        with self._lock:
            return {k for k, times in self._requests.items() if times}

    # -- used by the handler ---------------------------------------------------------------------------

    def _answering(self, delta: int) -> None:
        """A request starts (+1) or ends (-1) being answered."""
        with self._lock:
            self._in_flight += delta
            self.max_in_flight = max(self.max_in_flight, self._in_flight)

    def _admit(self, key: Key, authorized: bool = True) -> tuple[float, Fault | None, bytes | None]:
        """Count the request; for an authorized one, take the next injected fault and the object."""
        with self._lock:
            self._requests[key].append(time.monotonic())
            if not authorized:
                return 0.0, None, None
            fault = None
            queue = self._faults.get(key)
            if queue:
                fault = Fault(1, queue[0].status, queue[0].code)
                queue[0].times -= 1
                if queue[0].times <= 0:
                    queue.popleft()
            return self._latency.get(key, self.default_latency), fault, self._objects.get(key)


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._in_flight = True
        self.server.bos._answering(+1)
        try:
            self._get()
        finally:
            self._answered()

    def _answered(self) -> None:
        """The request stops counting as in flight before its response's first byte: a client that
        has read the response may send its next request before this thread runs again (on a loaded
        machine a sequential client was seen two in flight when this ran after the write)."""
        if self._in_flight:
            self._in_flight = False
            self.server.bos._answering(-1)

    def _get(self) -> None:
        bos = self.server.bos
        parts = unquote(urlsplit(self.path).path).lstrip("/").split("/", 1)
        key: Key = (parts[0], parts[1] if len(parts) > 1 else "")
        auth = AUTH_RE.match(self.headers.get("Authorization", ""))
        if auth is None or (bos.access_key is not None and auth["ak"] != bos.access_key):
            bos._admit(key, authorized=False)
            return self._error(403, "AccessDenied", "signature missing or access key unknown")
        latency, fault, data = bos._admit(key)
        if latency > 0:
            time.sleep(latency)
        if fault is not None and fault.status is None:
            self.close_connection = True  # say nothing: the client sees the connection drop
            return
        if fault is not None:
            return self._error(fault.status, fault.code, "injected fault")
        if data is None:
            return self._error(404, "NoSuchKey", "The specified key does not exist.")
        self._answered()
        self.send_response(200)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(data)))
        self.send_header("x-bce-request-id", str(uuid.uuid4()))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"code": code, "message": message, "requestId": str(uuid.uuid4())}).encode()
        self._answered()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass
