"""The API process's side of the engine: submit requests, route outputs, notice the engine dying.

One asyncio task reads the engine's output socket and runs the ``OutputProcessor`` (the same one
the offline ``LLM`` uses: detokenization, stop strings, ``n`` fan-in), then puts each request's
``Delta``s on that request's own queue; HTTP handlers only ever await their queue. A second task
watches the engine process: if it exits (or goes silent past the stall timeout with work in
flight), every request gets an ``EngineDeadError`` and ``on_engine_dead`` stops the server.

Nothing here blocks the event loop on ZMQ: receives are ``zmq.asyncio`` awaits, sends are
non-blocking onto a socket without a high-water mark (they cannot wait).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import zmq

from fdplug.core.frontend.processor import (
    InputProcessor,
    OutputProcessor,
    ProcessedPrompt,
)
from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.request import RequestStatus
from fdplug.errors import (
    EngineDeadError,
    EngineRequestError,
    FdplugError,
    InvalidRequestError,
    ServerShuttingDownError,
)
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.server.api.metrics import ServerMetrics
from fdplug.server.api.request_stream import RequestStream
from fdplug.server.engine import protocol as P

logger = logging.getLogger("fdplug.server")

WATCHDOG_INTERVAL_S = 0.2


class EngineClient:
    """Submit, abort and stream requests of one engine process."""

    def __init__(self, engine: Any, info: P.EngineInfo, tokenizer: Any, metrics: ServerMetrics,
                 stall_timeout: float, rank: int = 0, data_parallel_size: int = 1) -> None:
        """``rank`` of ``data_parallel_size`` engines (`dp_client`): its label in the metrics, and
        whether its death stops the server (the last engine's does)."""
        self.engine = engine                 # engine.process.EngineProcess: sockets, poll(), pid
        self.info = info
        self.rank, self.data_parallel_size = rank, data_parallel_size
        self.num_waiting = 0                 # as the engine last reported (the router's load)
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.stall_timeout = stall_timeout
        mm_config = ModelConfig.from_dir(info.model_dir).multimodal
        self.input_processor = InputProcessor(tokenizer, info.vocab_size, info.max_model_len, info.eos_token_ids,
                                              mm_config)
        self.output_processor = OutputProcessor(tokenizer)
        self.streams: dict[str, RequestStream] = {}
        self.child_to_parent: dict[str, str] = {}
        self.error: FdplugError | None = None     # set once: the engine died or the server is stopping
        self.on_engine_dead: Callable[[], None] | None = None
        self._last_message = time.monotonic()
        self._tasks: list[asyncio.Task] = []

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> None:
        self.metrics.engine_alive_is(self.rank, True)
        self._tasks = [asyncio.create_task(self._read_loop(), name="fdplug-engine-reader"),
                       asyncio.create_task(self._watchdog(), name="fdplug-engine-watchdog")]

    @property
    def healthy(self) -> bool:
        return self.error is None

    def engines(self) -> list[dict[str, Any]]:
        return [{"rank": self.rank, **self.engine_status()}]

    def engine_status(self) -> dict[str, Any]:
        """For ``/health``: the engine's pid, whether it runs, the requests in flight on it."""
        return {"pid": self.engine.pid, "alive": not isinstance(self.error, EngineDeadError),
                "in_flight": len(self.streams)}

    def begin_shutdown(self) -> None:
        """Refuse new requests and end every request in flight with a 503 (SIGINT/SIGTERM)."""
        if self.error is None:
            self.error = ServerShuttingDownError("the server is shutting down; the request was aborted.",
                                                 fix="retry against a running server.")
        self._fail_all(self.error, send_aborts=True)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # -- requests ---------------------------------------------------------------------------------

    def add(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
            cache_salt: str | None = None, queue: asyncio.Queue | None = None,
            rank: int | None = None) -> RequestStream:
        """Queue a validated request on the engine; its events arrive through the returned stream.
        ``rank``: the engine asked for (only this one's, or None)."""
        if rank is not None and rank != self.rank:
            raise InvalidRequestError(f"data-parallel rank {rank}"
                                      f" is not one of this server's engines (0..{self.rank}).",
                                      fix="leave X-Data-Parallel-Rank out, or name an engine that exists.",
                                      param="X-Data-Parallel-Rank")
        if self.error is not None:   # a fresh copy: re-raising one instance would grow its traceback
            raise type(self.error)(self.error.message, fix=self.error.fix)
        prompt_ids = prompt.token_ids
        requests = self.input_processor.make_requests(request_id, prompt, params, cache_salt=cache_salt)
        # encoded before anything is registered: a value msgpack cannot carry fails here with nothing to undo
        message = P.pack([P.ADD, [P.encode_request(r) for r in requests]])
        stream = RequestStream(request_id, [r.request_id for r in requests], queue)
        try:
            self.output_processor.add(request_id, prompt.text, prompt_ids, params)
            self.streams[request_id] = stream
            for r in requests:
                self.child_to_parent[r.request_id] = request_id
        except BaseException:
            self._unregister(stream)
            raise
        self._send_packed(P.ADD, message)
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        self.metrics.engine_requests.labels(self.metrics.model_name, str(self.rank)).inc()
        return stream

    def _unregister(self, stream: RequestStream) -> None:
        """Forget a request in this process (the engine's side is the caller's to end)."""
        if self.output_processor.has(stream.request_id):
            self.output_processor.pop(stream.request_id)
        self.streams.pop(stream.request_id, None)
        for child in stream.child_ids:
            self.child_to_parent.pop(child, None)

    def num_registered(self) -> int:
        """Requests this process tracks: every one of them is in flight (a leak shows here)."""
        return len(self.streams)

    def abort(self, request_id: str) -> None:
        """The client went away: end the request and free its KV blocks in the engine."""
        stream = self.streams.get(request_id)
        if stream is not None and not stream.done:
            self._finish_stream(stream, None, reason="abort", send_abort=RequestStatus.FINISHED_ABORTED)

    # -- engine messages --------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        """Each engine message, then the event loop's turn: a burst queued while this process was off its
        core (a waiting message needs no yield) starved the writers and the backlog bound (test_hostile_clients)."""
        socket = self.engine.output_socket
        while True:
            data = await socket.recv()
            self._last_message = time.monotonic()
            try:
                self._handle(P.unpack(data))
            except Exception:  # a bug here must not stop the reader: log it and go on
                logger.exception("failed to handle a message from the engine")
            await asyncio.sleep(0)

    def _handle(self, message: list) -> None:
        tag = message[0]
        if tag == P.OUTPUTS:
            self._on_outputs([P.decode_output(o) for o in message[1]])
            if message[2] is not None:
                self._on_stats(P.decode_stats(message[2]))
        elif tag == P.STATS:
            self._on_stats(P.decode_stats(message[1]))
        elif tag == P.ADMITTED:
            self._on_admitted(message[1], message[2])
        elif tag == P.FATAL:
            logger.error("the engine loop crashed: %s", P.decode_error(message[1]).message)
        else:
            logger.error("ignoring an unexpected message %r from the engine", tag)

    def _on_stats(self, stats: Any) -> None:
        self.num_waiting = stats.num_waiting
        self.metrics.update_engine(stats, self.rank)

    def _on_admitted(self, admitted: list[str], rejected: list[list]) -> None:
        for child in admitted:
            stream = self.streams.get(self.child_to_parent.get(child, ""))
            if stream is not None:
                stream.child_admitted(child)
        for child, error in rejected:
            stream = self.streams.get(self.child_to_parent.get(child, ""))
            if stream is not None and not stream.done:
                self._finish_stream(stream, P.decode_error(error), reason="rejected",
                                    send_abort=RequestStatus.FINISHED_ABORTED)

    def _on_outputs(self, outputs: list) -> None:
        try:
            deltas, stopped = self.output_processor.process(outputs)
        except Exception:  # one output it cannot handle (a bug): find it, fail its request alone
            logger.exception("failed to process a step's outputs; processing them one by one")
            deltas, stopped = self._process_each(outputs)
        if stopped:
            self._send([P.ABORT, stopped, int(RequestStatus.FINISHED_STOPPED)])
        now = time.monotonic()
        touched: dict[str, RequestStream] = {}
        for delta in deltas:
            stream = self.streams.get(delta.request_id)
            if stream is None:
                continue
            if delta.token_ids:
                first, previous = stream.tokens_arrived(delta.index, now)
                if first:
                    self.metrics.ttft.observe(now - stream.arrival)
                if previous is not None:
                    self.metrics.itl.observe(now - previous)
                self.metrics.generation_tokens.inc(len(delta.token_ids))
            if stream.queue is not None:
                stream.queue.put_nowait(delta)
            touched[delta.request_id] = stream
        for stream in touched.values():
            if self.output_processor.output(stream.request_id).finished:
                self._finish_stream(stream, None, reason=None)

    def _process_each(self, outputs: list) -> tuple[list, list]:
        deltas, stopped = [], []
        for out in outputs:
            try:
                d, s = self.output_processor.process([out])
            except Exception:  # noqa: BLE001
                stream = self.streams.get(self.child_to_parent.get(out.request_id, ""))
                if stream is not None and not stream.done:
                    self._finish_stream(stream, EngineRequestError(
                        "the server failed to process this request's output.",
                        fix="retry; if it fails again, report it with the server log."), reason="error",
                        send_abort=RequestStatus.FINISHED_ABORTED)
                continue
            deltas += d
            stopped += s
        return deltas, stopped

    def _finish_stream(self, stream: RequestStream, error: FdplugError | None, reason: str | None,
                       send_abort: RequestStatus | None = None) -> None:
        """End a request exactly once: pop its output, tell the engine if needed, wake its handler."""
        stream.done = True
        if reason is not None:
            self.output_processor.fail(stream.request_id, reason, error)
        output = self.output_processor.output(stream.request_id)
        self._unregister(stream)
        if send_abort is not None and not isinstance(self.error, EngineDeadError):
            self._send([P.ABORT, stream.child_ids, int(send_abort)])
        for completion in output.outputs:
            self.metrics.finished(completion.finish_reason or "abort")
        self.metrics.e2e.observe(time.monotonic() - stream.arrival)
        stream.end(output, error)

    def _fail_all(self, error: FdplugError, send_aborts: bool) -> None:
        for stream in list(self.streams.values()):
            self._finish_stream(stream, error, reason="abort" if send_aborts else "error",
                                send_abort=RequestStatus.FINISHED_ABORTED if send_aborts else None)

    def _send(self, message: list) -> None:
        self._send_packed(message[0], P.pack(message))

    def _send_packed(self, tag: str, data: bytes) -> None:
        try:
            self.engine.input_socket.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # no peer (the engine is gone): the watchdog reports it
            logger.debug("could not send %s to the engine: %s", tag, exc)

    # -- watchdog ---------------------------------------------------------------------------------

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            code = self.engine.poll()
            if code is None and self.streams and time.monotonic() - self._last_message > self.stall_timeout:
                logger.error("the engine sent nothing for %.0f s with %d requests in flight; killing it",
                             self.stall_timeout, len(self.streams))
                self.engine.kill()
                code = self.engine.poll()
            if code is not None and not isinstance(self.error, EngineDeadError):
                self._engine_died(code)
                return

    def _engine_died(self, code: int | None) -> None:
        shutting_down = isinstance(self.error, ServerShuttingDownError)
        which = (f"data-parallel engine {self.rank} (pid {self.engine.pid})" if self.data_parallel_size > 1
                 else f"the engine process (pid {self.engine.pid})")
        after = ("its requests failed; the other engines keep serving" if self.data_parallel_size > 1
                 else "the server is stopping")
        self.error = EngineDeadError(f"{which} exited with status {code}; {after}.",
                                     fix="see the server log for the cause, then restart `fdplug serve`.")
        self.metrics.engine_alive_is(self.rank, False)
        if not shutting_down:
            logger.error("%s", self.error.message)
        self._fail_all(self.error, send_aborts=False)
        if self.on_engine_dead is not None and not shutting_down:
            self.on_engine_dead()
