"""OpenAI completions and chat completions on top of the ``EngineClient``.

A request is validated and tokenized completely (``jobs.py``) before anything is queued, so a bad
field never leaves half a batch in the engine. Streaming responses start (HTTP 200) only once the engine has
admitted every sequence: a full waiting queue is still a proper 503, not an error inside a 200.
A client that disconnects aborts its sequences, which frees their KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse

from fdplug.core.frontend.outputs import CompletionOutput, RequestOutput
from fdplug.core.frontend.processor import Delta
from fdplug.errors import EngineRequestError, FdplugError
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.server.api import openai_logprobs as L
from fdplug.server.api import openai_types as T
from fdplug.server.api.chat_answers import ChatDeltas, chat_message_choice
from fdplug.server.api.engine_client import EngineClient
from fdplug.server.api.jobs import Job
from fdplug.server.http.closing_stream import ClosingStream
from fdplug.server.http.error_responses import error_body

logger = logging.getLogger("fdplug.server")

_dumps = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


class Serving:
    """A ``Job``'s sequences on the engine: submitted, answered in one body or streamed, aborted."""

    def __init__(self, client: EngineClient, stream_interval: int = 1) -> None:
        self.client = client
        # tokens per streamed chunk after the first (vLLM's and SGLang's --stream-interval): every chunk is
        # a socket write in this process and a wake-up in the client's, which on a CPU device share the
        # cores with the engine. 1 (default): a chunk per step, as the engine produces them
        self.stream_interval = stream_interval

    # -- sequences --------------------------------------------------------------------------------

    def submit(self, job: Job, prepared: list, params: SamplingParams, queue: asyncio.Queue | None,
               cache_salt: str | None, rank: int | None = None) -> None:
        """``rank``: the data-parallel engine asked for (``X-Data-Parallel-Rank``), else the router's."""
        try:
            for i, prompt in enumerate(prepared):
                rid = job.id if len(prepared) == 1 else f"{job.id}-{i}"
                job.streams.append(self.client.add(rid, prompt, params, cache_salt, queue=queue, rank=rank))
                job.prompt_tokens += len(prompt.token_ids)
        except BaseException:
            self.abort(job)
            raise

    def abort(self, job: Job) -> None:
        for stream in job.streams:
            self.client.abort(stream.request_id)

    def cut_off(self, job: Job, connection: Any, limit: int) -> None:
        """A streaming client stopped reading and its unsent output passed ``limit`` tokens
        (`BacklogQueue`): abort its sequences (their KV blocks free at the next step) and drop its
        connection, rather than hold its output for as long as the engine generates."""
        logger.warning("%s: the client stopped reading (over %d unsent tokens); aborting it and closing the "
                       "connection (--max-stream-backlog)", job.id, limit)
        self.abort(job)
        if connection is not None:      # `connection_guard.ConnectionHandle`
            connection.close()

    # -- non-streaming ----------------------------------------------------------------------------

    async def respond(self, job: Job, http: HTTPRequest) -> JSONResponse:
        """Wait for every sequence (aborting them all if the client leaves), then one JSON body."""
        disconnect = asyncio.create_task(wait_disconnect(http))
        gather = asyncio.ensure_future(asyncio.gather(*(s.final() for s in job.streams)))
        try:
            done, _ = await asyncio.wait({gather, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if gather not in done:              # the client left: free the engine's blocks now
                _drop(gather)
                self.abort(job)
                return JSONResponse({}, status_code=499)   # nobody reads it
            outputs: list[RequestOutput] = gather.result()
        except BaseException:
            _drop(gather)
            self.abort(job)
            raise
        finally:
            disconnect.cancel()
        choices, completion_tokens, cached = [], 0, 0
        for i, output in enumerate(outputs):
            cached += output.num_cached_tokens
            for c in output.outputs:
                _raise_if_failed(c.finish_reason, c.stop_reason, output.error)
                completion_tokens += len(c.token_ids)
                choices.append(self._choice(job, job.choice_index(i, c.index), c, c.finish_reason))
        obj = "text_completion" if job.kind == "completion" else "chat.completion"
        body = T.envelope(obj, job.id, job.created, job.model, choices, T.usage(job.prompt_tokens, completion_tokens,
                                                                               cached))
        if outputs and outputs[0].kv_transfer_params is not None:   # PD prefill: where decode pulls (vLLM's field)
            body["kv_transfer_params"] = outputs[0].kv_transfer_params
        return JSONResponse(body)

    def _choice(self, job: Job, index: int, out: CompletionOutput, finish_reason: str | None) -> dict:
        lp = self._logprobs(job, out.token_ids, out.logprobs)
        if job.kind == "completion":
            return T.completion_choice(index, out.text, finish_reason, lp, out.stop_reason)
        return chat_message_choice(job, index, out.text, finish_reason, lp, out.stop_reason)

    def _logprobs(self, job: Job, token_ids: list[int], entries: list | None,
                  offsets: L.TextOffsets | None = None) -> dict | None:
        if job.num_logprobs is None or entries is None:
            return None
        if job.kind == "completion":
            return L.completion_logprobs(token_ids, entries, job.num_logprobs, offsets)
        return L.chat_logprobs(token_ids, entries, job.num_logprobs)

    # -- streaming --------------------------------------------------------------------------------

    def _hold(self, key: tuple[str, int], delta: Delta, held: dict, started: set) -> Delta | None:
        """``delta`` joined to what this choice holds; None (held) until it has ``stream_interval`` tokens.

        A choice's first token and its finish are never held: TTFT and the end of a stream are as
        without the interval; only the chunks between carry several tokens each.
        """
        previous = held.pop(key, None)
        if previous is not None:
            delta = _merge([previous, delta])[key]
        if delta.finish_reason is None and key in started and len(delta.token_ids) < self.stream_interval:
            held[key] = delta
            return None
        if delta.token_ids:
            started.add(key)
        return delta

    async def stream(self, job: Job, queue: asyncio.Queue, include_usage: bool, http: HTTPRequest) -> Any:
        """Admission first (a refused request gets its status code, not a 200 with an error inside),
        watching for the client leaving meanwhile; then the events. However the response ends, the
        job's sequences end with it: a client gone before the first event is not served for nothing."""
        disconnect = asyncio.create_task(wait_disconnect(http))
        admitted = asyncio.ensure_future(asyncio.gather(*(s.admitted for s in job.streams)))
        try:
            done, _ = await asyncio.wait({admitted, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            if admitted not in done:
                _drop(admitted)
                self.abort(job)
                return JSONResponse({}, status_code=499)   # nobody reads it
            admitted.result()
        except BaseException:
            _drop(admitted)
            self.abort(job)
            raise
        finally:
            disconnect.cancel()
        return ClosingStream(self._events(job, queue, include_usage), lambda: self.abort(job),
                          media_type="text/event-stream", headers={"Cache-Control": "no-cache",
                                                                   "X-Accel-Buffering": "no"})

    async def _events(self, job: Job, queue: asyncio.Queue, include_usage: bool) -> AsyncIterator[bytes]:
        obj = "text_completion" if job.kind == "completion" else "chat.completion.chunk"
        index_of = {s.request_id: i for i, s in enumerate(job.streams)}
        active = set(index_of)
        completion_tokens, cached = 0, 0
        offsets: dict[int, L.TextOffsets] = {}
        held: dict[tuple[str, int], Delta] = {}   # --stream-interval: tokens not sent yet, per choice
        started: set[tuple[str, int]] = set()     # choices whose first token went out (never held)
        chat = ChatDeltas(job)                    # chat: reasoning and tool calls read per choice

        # the envelope is the same for every chunk: encode it once, and only the choices per chunk
        head, tail = _dumps(T.envelope(obj, job.id, job.created, job.model, [], None, include_usage)).encode() \
            .split(b'"choices":[]', 1)
        head, tail = b"data: " + head + b'"choices":', tail + b"\n\n"

        def chunk(choices: list, usage: dict | None = None) -> bytes:
            if usage is None:
                return head + _dumps(choices).encode() + tail
            body = T.envelope(obj, job.id, job.created, job.model, choices, usage, with_usage_field=include_usage)
            return b"data: " + _dumps(body).encode() + b"\n\n"

        try:
            if job.kind == "chat":
                yield chunk([T.chat_delta_choice(job.choice_index(i, c), {"role": "assistant", "content": ""},
                                                 None, None) for i in range(len(job.streams)) for c in range(job.n)],
                            T.usage(job.prompt_tokens, 0) if job.usage_every_chunk else None)
            while active:
                items = [await queue.get()]
                while not queue.empty():
                    items.append(queue.get_nowait())
                choices = []
                for key, delta in _merge(items).items():
                    index = job.choice_index(index_of[key[0]], key[1])
                    _raise_if_failed(delta.finish_reason, delta.stop_reason, delta.error)
                    if self.stream_interval > 1:
                        delta = self._hold(key, delta, held, started)
                        if delta is None:
                            continue
                    completion_tokens += len(delta.token_ids)
                    if not delta.token_ids and not delta.text and delta.finish_reason is None:
                        continue   # a chunk per step with tokens, even while the detokenizer holds text back
                    if job.kind == "completion" and delta.logprobs is not None and index not in offsets:
                        offsets[index] = L.TextOffsets()
                    lp = self._logprobs(job, delta.token_ids, delta.logprobs, offsets.get(index))
                    if job.kind == "completion":
                        choices.append(T.completion_choice(index, delta.text, delta.finish_reason, lp,
                                                           delta.stop_reason))
                        continue
                    body, finish_reason = chat.delta(key, delta)
                    if body or finish_reason is not None or lp is not None:
                        choices.append(T.chat_delta_choice(index, body, finish_reason, lp,
                                                           delta.stop_reason if finish_reason else None))
                if choices:
                    so_far = T.usage(job.prompt_tokens, completion_tokens) if job.usage_every_chunk else None
                    yield chunk(choices, so_far)
                for item in items:
                    if isinstance(item, RequestOutput):
                        active.discard(item.request_id)
                        cached += item.num_cached_tokens
                    elif isinstance(item, tuple):      # (request_id, error)
                        raise item[1]
            if include_usage:
                yield chunk([], T.usage(job.prompt_tokens, completion_tokens, cached))
        except FdplugError as exc:
            self.abort(job)
            yield sse_error(exc)
        except BaseException:  # client gone (cancelled) or a bug: free the engine's blocks either way
            self.abort(job)
            raise
        yield b"data: [DONE]\n\n"


def _merge(items: list) -> dict[tuple[str, int], Delta]:
    """Deltas that queued up while the client was being written to, one per (request, index)."""
    if len(items) == 1:     # the usual case: one step's delta, nothing queued behind it
        item = items[0]
        return {(item.request_id, item.index): item} if isinstance(item, Delta) else {}
    merged: dict[tuple[str, int], Delta] = {}
    for item in items:
        if not isinstance(item, Delta):
            continue
        key = (item.request_id, item.index)
        prev = merged.get(key)
        if prev is None:
            merged[key] = Delta(item.request_id, item.index, item.text, list(item.token_ids),
                                list(item.logprobs) if item.logprobs is not None else None, item.finish_reason,
                                item.stop_reason, item.error)
            continue
        prev.text += item.text
        prev.token_ids.extend(item.token_ids)
        if item.logprobs:
            prev.logprobs = (prev.logprobs or []) + list(item.logprobs)
        prev.finish_reason, prev.stop_reason, prev.error = item.finish_reason, item.stop_reason, item.error
    return merged


def _raise_if_failed(finish_reason: str | None, stop_reason: Any, error: FdplugError | None = None) -> None:
    """A request the engine failed: its typed error (e.g. a feature fetch: 400/502/504), else a 500."""
    if finish_reason != "error":
        return
    if isinstance(error, FdplugError):
        raise error
    raise EngineRequestError(f"the engine failed this request: {stop_reason}",
                             fix="retry; if it fails again, report it with the server log.")


def _drop(future: asyncio.Future) -> None:
    """Cancel a gather nobody will await: its children's cancellation is retrieved, not logged as lost."""
    future.cancel()
    future.add_done_callback(lambda f: f.cancelled() or f.exception())


def sse_error(exc: FdplugError) -> bytes:
    """An error as a server-sent event: a stream that already answered 200 ends with it (vLLM's shape)."""
    body = error_body(exc.message + (f" Fix: {exc.fix}" if exc.fix else ""), exc.error_type,
                      getattr(exc, "param", None), getattr(exc, "code", None) or exc.http_status)
    return b"data: " + _dumps(body).encode() + b"\n\n"


async def wait_disconnect(http: HTTPRequest) -> None:
    while True:
        message = await http.receive()
        if message["type"] == "http.disconnect":
            return
