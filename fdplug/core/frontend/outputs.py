"""What generation returns, shaped like vLLM's so code can switch between the two."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class Logprob:
    """One candidate token's log-probability under the model, its rank, its text, and its bytes (the
    text of a token that holds part of a character is U+FFFD; its bytes are what it holds)."""

    logprob: float
    rank: int
    decoded_token: str | None = None
    token_bytes: bytes | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One generated sequence (``n`` of them per request)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None   # "stop" | "length" | "abort" | "error" ("tool_calls": `LLM.chat` with tools)
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    # `LLM.chat` with a reasoning or tool parser on: the answer without its reasoning and calls, the
    # reasoning, and the calls (OpenAI's shape: {"id", "type": "function", "function": {name, arguments}})
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict] | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's prompt and its outputs so far (complete when ``finished``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0
    error: Any = None            # the typed FdplugError that failed this request (finish_reason "error")
    kv_transfer_params: dict | None = None   # PD prefill: where a decode instance pulls this prompt's KV
    metrics: dict[str, float] = field(default_factory=dict)
