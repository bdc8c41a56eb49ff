"""A request's lifecycle state and its multimodal placeholders.

The scheduler and the KV cache manager read and write ``Request``; nothing here imports paddle.
Its sampling parameters are ``fdplug.plugin_api.sampling_params.SamplingParams`` (importable from here too,
as they always were).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.plugin_api.scheduled_work import MMPlaceholder, spans


class RequestStatus(enum.IntEnum):
    """Where a request is in its life. Every status after PREEMPTED is final."""

    WAITING = enum.auto()
    WAITING_FOR_FEATURES = enum.auto()  # multimodal features still being fetched: not schedulable
    WAITING_FOR_REMOTE_KV = enum.auto()  # its prompt's KV being pulled from a prefill instance: not schedulable
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
    def is_unstarted(self) -> bool:
        """Never scheduled yet: waiting, or held by a step extension (features, remote KV)."""
        return self < RequestStatus.RUNNING

    @property
    def is_schedulable_wait(self) -> bool:
        """Waiting, and the scheduler may take it (not waiting on features or remote KV)."""
        return self in (RequestStatus.WAITING, RequestStatus.PREEMPTED)

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
    kv_transfer_params: dict | None = None   # PD disaggregation (`core.kv_transfer`): what to offer, or pull
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
