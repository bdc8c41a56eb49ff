"""A request's lifecycle state, its sampling parameters and its multimodal placeholders.

The scheduler and the KV cache manager read and write ``Request``; nothing here imports paddle.
``SamplingParams`` uses vLLM's names so OpenAI/vLLM clients map onto it one to one; the scheduler
itself only reads the stop-related fields (``max_tokens``, ``min_tokens``, ``ignore_eos``,
``stop_token_ids``); the sampler reads the rest.
"""

from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from fdplug.core.multimodal.chunking import spans
from fdplug.errors import InvalidRequestError

SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
MAX_LOGPROBS = 20  # OpenAI's limit for top logprobs


# ---------------------------------------------------------------------------------------------------
# sampling parameters
# ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class SamplingParams:
    """How to sample one sequence. ``validate()`` says what is wrong and the allowed range.

    ``top_k`` 0 or -1 means off; ``temperature`` 0 means greedy; ``max_tokens=None`` means "until
    ``max_model_len``". ``stop`` strings are matched by the detokenizer, not the scheduler.
    ``n > 1`` is fanned out by the engine into ``n`` requests; the scheduler sees one sequence each.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        # OpenAI clients send a single stop string or lists; store tuples so params can be shared.
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif self.stop is None:
            self.stop = ()
        else:
            self.stop = tuple(self.stop)
        self.stop_token_ids = () if self.stop_token_ids is None else tuple(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def validate(self) -> "SamplingParams":
        """Raise InvalidRequestError naming the first bad field and its allowed range."""
        _int_at_least("n", self.n, 1)
        _real_in("temperature", self.temperature, 0.0, math.inf, "[0, inf); 0 means greedy")
        _real_in("top_p", self.top_p, 0.0, 1.0, "(0, 1]", low_open=True)
        _int_at_least("top_k", self.top_k, -1, allowed="-1 or 0 (off), or an integer >= 1")
        _real_in("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        if self.seed is not None:
            _int_at_least("seed", self.seed, -(2**63), allowed="an integer or null")
        _real_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _real_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        _real_in("repetition_penalty", self.repetition_penalty, 0.0, math.inf, "(0, inf); 1 is off",
                 low_open=True)
        if self.max_tokens is not None:
            _int_at_least("max_tokens", self.max_tokens, 1, allowed="an integer >= 1, or null")
        _int_at_least("min_tokens", self.min_tokens, 0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) is greater than max_tokens ({self.max_tokens}).",
                fix="make min_tokens <= max_tokens.")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidRequestError(f"stop must be a list of non-empty strings, got {s!r} in it.",
                                          fix="remove empty or non-string stop entries.")
        for t in self.stop_token_ids:
            _int_at_least("stop_token_ids[]", t, 0, allowed="token ids >= 0")
        if self.logprobs is not None:
            _int_at_least("logprobs", self.logprobs, 0, allowed=f"0..{MAX_LOGPROBS}, or null")
            if self.logprobs > MAX_LOGPROBS:
                raise InvalidRequestError(f"logprobs must be at most {MAX_LOGPROBS}, got {self.logprobs}.",
                                          fix=f"ask for 0..{MAX_LOGPROBS} top logprobs.")
        return self


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_at_least(name: str, value: object, low: int, allowed: str | None = None) -> None:
    allowed = allowed or f"an integer >= {low}"
    if not _is_int(value) or value < low:
        raise InvalidRequestError(f"{name} must be {allowed}, got {value!r}.", fix=f"pass {name} as {allowed}.")


def _real_in(name: str, value: object, low: float, high: float, shown: str, *, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
    if ok:
        ok = (value > low if low_open else value >= low) and (value <= high or high == math.inf)
        ok = ok and not math.isinf(value)
    if not ok:
        raise InvalidRequestError(f"{name} must be in {shown}, got {value!r}.",
                                  fix=f"pass a {name} in {shown}.")


# ---------------------------------------------------------------------------------------------------
# request
# ---------------------------------------------------------------------------------------------------


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after PREEMPTED is final."""

    WAITING = enum.auto()
    WAITING_FOR_FEATURES = enum.auto()  # multimodal features still being fetched: not schedulable
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        """The OpenAI ``finish_reason`` ("stop", "length", "abort", "error"), None while unfinished."""
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True, slots=True)
class MMPlaceholder:
    """A multimodal item's placeholder tokens in the prompt: ``[offset, offset + length)``.

    ``mm_hash`` identifies the item's content; it enters the hash of every KV block the item
    overlaps, so two prompts with the same placeholder tokens but different images never share KV.
    ``span_length`` > 0 tiles the item into spans of that many tokens (the last may be shorter)
    whose tokens attend bidirectionally within their span (an image: one span; a video: one span
    per 2 frames); 0 means the item's tokens are causal like text.
    """

    offset: int
    length: int
    mm_hash: str
    span_length: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(slots=True, eq=False)
class Request:
    """One sequence being generated: its tokens, progress and KV bookkeeping.

    ``num_computed_tokens`` counts tokens whose KV is in the cache: it is advanced by
    ``Scheduler.update_from_output`` after the model ran, so it never counts a token whose KV a
    failed step did not write. ``block_hashes`` are the chained hashes of the full blocks of
    ``all_token_ids``, extended by the KV cache manager as blocks fill.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (models often have several)
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    mm_positions: list[MMPlaceholder] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    mm_inputs: list = field(default_factory=list)  # what to fetch, aligned with mm_positions (MMFeatureInput)
    mm_spans: list[tuple[int, int]] = field(default_factory=list, init=False)  # bidirectional [start, end)

    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=0, init=False)  # prefix-cache hit at first scheduling
    num_preemptions: int = field(default=0, init=False)
    block_hashes: list[bytes] = field(default_factory=list, init=False)
    stop_reason: int | str | None = field(default=None, init=False)  # the stop token or string
    _all_token_ids: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError(f"request_id must be a non-empty string, got {self.request_id!r}.",
                                      fix="give every request a unique non-empty id.")
        self.prompt_token_ids = list(self.prompt_token_ids)
        self.eos_token_ids = tuple(self.eos_token_ids)
        if not self.prompt_token_ids:
            raise InvalidRequestError("the prompt is empty.", fix="send at least one prompt token.")
        if min(self.prompt_token_ids) < 0:
            raise InvalidRequestError(f"prompt token ids must be >= 0, got {min(self.prompt_token_ids)}.",
                                      fix="tokenize the prompt with the model's tokenizer.")
        if self.cache_salt is not None and not isinstance(self.cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a string, got {type(self.cache_salt).__name__}.",
                                      fix="pass cache_salt as a string or leave it out.")
        if self.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FEATURES):
            raise InvalidRequestError(f"a new request must be WAITING or WAITING_FOR_FEATURES, got {self.status.name}.",
                                      fix="create a fresh Request instead of reusing one.")
        self.mm_positions = sorted(self.mm_positions, key=lambda item: item.offset)
        self._check_mm_positions()
        self.mm_spans = spans(self.mm_positions)
        self.sampling_params.validate()
        self._all_token_ids = list(self.prompt_token_ids)

    def _check_mm_positions(self) -> None:
        end = 0
        for item in self.mm_positions:
            if item.offset < end or item.length < 1 or item.offset + item.length > self.num_prompt_tokens:
                raise InvalidRequestError(
                    f"multimodal placeholder (offset={item.offset}, length={item.length}) overlaps another "
                    f"or lies outside the {self.num_prompt_tokens}-token prompt.",
                    fix="give each item a non-empty placeholder range inside the prompt, without overlaps.")
            end = item.offset + item.length

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens. Read-only by convention: append through ``append_output_token``."""
        return self._all_token_ids

    @property
    def max_tokens(self) -> int | None:
        return self.sampling_params.max_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason
