"""How to sample one sequence: ``SamplingParams`` (vLLM's names) and the bounds of every field.

OpenAI/vLLM clients map onto it one to one. The scheduler reads only the stop-related fields
(``max_tokens``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``); the sampler reads the rest.
Bounds that depend on the model (``top_k`` and stop token ids within the vocabulary, lengths within
``max_model_len``) are checked by ``fdplug.core.engine.admission``.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from fdplug.errors import InvalidRequestError, show_value

SAMPLING_EPS = 1e-5  # temperatures below this are greedy, as in vLLM
MAX_LOGPROBS = 20  # OpenAI's limit for top logprobs

# Bounds of every numeric sampling field. Each is honoured end to end: by msgpack between the
# processes, by the per-slot numpy arrays of the input batch (int64, float32) and by the sampler.
MAX_N = 128                       # OpenAI's cap on sequences per request
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_COUNT = 2**31 - 1             # token counts and top_k before the model's own limits apply
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
MAX_STOP_TOKEN_IDS = 1024
STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_STRUCTURED_CHARS = 256 * 1024    # a schema (a forced tool choice's: every tool's), regex or grammar; compiling
#                                      it is bounded by the grammar engine's own limits too
MAX_CHOICES = 256


@dataclass(slots=True)
class SamplingParams:
    """How to sample one sequence. ``validate()`` says what is wrong and the allowed range.

    ``top_k`` 0 or -1 means off; ``temperature`` 0 means greedy; ``max_tokens=None`` means "until
    ``max_model_len``". ``stop`` strings are matched by the detokenizer, not the scheduler.
    ``n > 1`` is fanned out by the engine into ``n`` requests; the scheduler sees one sequence each.
    Limits that depend on the model (``top_k`` and stop token ids within the vocabulary, lengths
    within ``max_model_len``) are checked by ``fdplug.core.engine.admission`` against the running model.
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
    include_stop_str_in_output: bool = False   # vLLM's: the matched stop string stays in the text
    # vLLM's structured outputs: ``{"json": schema}``, ``{"regex": ...}``, ``{"choice": [...]}``,
    # ``{"grammar": lark}`` or ``{"json_object": True}``, kept as ``(kind, text)`` (plain data for msgpack)
    structured_outputs: Any = None
    # the constraint starts once these tokens end the output (or the prompt's last 16 tokens hold
    # them): a reasoning parser's end tag, so a thinking model's answer, not its reasoning, is held
    reasoning_end_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        # OpenAI clients send a single stop string or lists; store tuples so params can be shared.
        # Anything else is kept as given for validate() to name.
        if isinstance(self.stop, str):
            self.stop = (self.stop,)
        elif self.stop is None:
            self.stop = ()
        elif isinstance(self.stop, (list, tuple)):
            self.stop = tuple(self.stop)
        self.structured_outputs = _structured(self.structured_outputs)
        if isinstance(self.reasoning_end_token_ids, list):
            self.reasoning_end_token_ids = tuple(self.reasoning_end_token_ids)
        if self.stop_token_ids is None:
            self.stop_token_ids = ()
        elif isinstance(self.stop_token_ids, (list, tuple)):
            self.stop_token_ids = tuple(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Any of the presence, frequency or repetition penalties is on."""
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1

    def validate(self) -> SamplingParams:
        """Raise InvalidRequestError naming the first bad field (``param``) and its allowed range."""
        _int_in("n", self.n, 1, MAX_N, f"an integer in [1, {MAX_N}]: fdplug caps sequences per request as OpenAI does")
        _real_in("temperature", self.temperature, 0.0, MAX_TEMPERATURE, f"[0, {MAX_TEMPERATURE:g}]; 0 means greedy")
        _real_in("top_p", self.top_p, 0.0, 1.0, "(0, 1]", low_open=True)
        if self.top_k not in (-1, 0):
            _int_in("top_k", self.top_k, 1, MAX_COUNT, "-1 or 0 (off), or an integer from 1 to the vocabulary size")
        _real_in("min_p", self.min_p, 0.0, 1.0, "[0, 1]")
        if self.seed is not None:
            _int_in("seed", self.seed, INT64_MIN, INT64_MAX,
                    f"null or a 64-bit signed integer [{INT64_MIN}, {INT64_MAX}]")
        _real_in("presence_penalty", self.presence_penalty, -2.0, 2.0, "[-2, 2]")
        _real_in("frequency_penalty", self.frequency_penalty, -2.0, 2.0, "[-2, 2]")
        _real_in("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY,
                 f"[{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}]; 1 is off")
        if self.max_tokens is not None:
            _int_in("max_tokens", self.max_tokens, 1, MAX_COUNT, "null or an integer >= 1 (at most max_model_len)")
        _int_in("min_tokens", self.min_tokens, 0, MAX_COUNT, "an integer >= 0 (at most max_tokens)")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                f"min_tokens ({self.min_tokens}) is greater than max_tokens ({self.max_tokens}).",
                fix="make min_tokens <= max_tokens.", param="min_tokens")
        self._validate_stops()
        for flag in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, flag), bool):
                raise InvalidRequestError(f"{flag} must be true or false, got {show_value(getattr(self, flag))}.",
                                          fix=f"pass {flag} as a boolean.", param=flag)
        if self.logprobs is not None:
            _int_in("logprobs", self.logprobs, 0, MAX_LOGPROBS, f"null or an integer in [0, {MAX_LOGPROBS}]")
        if self.structured_outputs is not None:
            _check_structured(self.structured_outputs)
        if not isinstance(self.reasoning_end_token_ids, tuple) or len(self.reasoning_end_token_ids) > 16:
            raise InvalidRequestError("reasoning_end_token_ids must be a list of at most 16 token ids.",
                                      fix="pass the token ids of the reasoning's end tag.",
                                      param="reasoning_end_token_ids")
        for t in self.reasoning_end_token_ids:
            _int_in("reasoning_end_token_ids", t, 0, MAX_COUNT, "a list of token ids of this model's vocabulary")
        return self

    def _validate_stops(self) -> None:
        if not isinstance(self.stop, tuple) or len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"stop must be a string or a list of at most {MAX_STOP_STRINGS} strings.",
                                      fix="send fewer stop strings.", param="stop")
        for s in self.stop:
            if not isinstance(s, str) or not 0 < len(s) <= MAX_STOP_CHARS:
                raise InvalidRequestError(f"stop strings must be non-empty strings of at most {MAX_STOP_CHARS} "
                                          f"characters, got {show_value(s)} in it.",
                                          fix="remove empty, long or non-string stop entries.", param="stop")
        if not isinstance(self.stop_token_ids, tuple) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids.",
                                      fix="send fewer stop token ids.", param="stop_token_ids")
        for t in self.stop_token_ids:
            _int_in("stop_token_ids", t, 0, MAX_COUNT, "a list of token ids of this model's vocabulary")


def _structured(value: Any) -> Any:
    """``{"json": {...}}`` (or ``[kind, text]``, as it crosses processes) -> ``(kind, text)``; other
    values are kept for `validate` to name."""
    if isinstance(value, dict) and len(value) == 1:
        (kind, spec), = value.items()
        if kind == "json_object":
            return ("json_object", "") if spec is True else value
        if kind in ("json", "choice") and not isinstance(spec, str):
            try:
                spec = json.dumps(spec, ensure_ascii=False)
            except (TypeError, ValueError):
                return value
        return (kind, spec) if isinstance(spec, str) else value
    if isinstance(value, list) and len(value) == 2:
        return tuple(value)
    return value


def _check_structured(value: Any) -> None:
    if not (isinstance(value, tuple) and len(value) == 2 and value[0] in STRUCTURED_KINDS
            and isinstance(value[1], str)):
        raise InvalidRequestError(f"structured_outputs must name one of {', '.join(STRUCTURED_KINDS)}, got "
                                  f"{show_value(value)}.", fix='send e.g. {"json": {"type": "object"}} or '
                                  '{"regex": "[0-9]+"}.', param="structured_outputs")
    kind, spec = value
    if len(spec) > MAX_STRUCTURED_CHARS or (kind != "json_object" and not spec):
        raise InvalidRequestError(f"structured_outputs {kind} must be 1 to {MAX_STRUCTURED_CHARS} characters.",
                                  fix="send a smaller schema, regex or grammar.", param="structured_outputs")
    if kind in ("json", "choice"):
        try:
            parsed = json.loads(spec)
        except (ValueError, RecursionError) as exc:
            raise InvalidRequestError(f"structured_outputs {kind} is not JSON ({exc}).", fix="send valid JSON.",
                                      param="structured_outputs") from None
        if kind == "json" and not isinstance(parsed, (dict, bool)):
            raise InvalidRequestError("structured_outputs json must be a JSON schema object.",
                                      fix='send e.g. {"type": "object", "properties": {...}}.',
                                      param="structured_outputs")
        if kind == "choice" and not (isinstance(parsed, list) and 0 < len(parsed) <= MAX_CHOICES
                                     and all(isinstance(c, str) and c for c in parsed)):
            raise InvalidRequestError(f"structured_outputs choice must be 1 to {MAX_CHOICES} non-empty strings.",
                                      fix='send e.g. {"choice": ["yes", "no"]}.', param="structured_outputs")


def child_seed(seed: int | None, index: int) -> int | None:
    """Sequence ``index`` of an ``n > 1`` request uses ``seed + index``, wrapped to stay a signed
    64-bit integer (the largest seed's children must not overflow)."""
    if seed is None:
        return None
    return (seed + index - INT64_MIN) % 2**64 + INT64_MIN


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int_in(name: str, value: object, low: int, high: int, allowed: str) -> None:
    if not _is_int(value) or not low <= value <= high:
        raise InvalidRequestError(f"{name} must be {allowed}, got {show_value(value)}.",
                                  fix=f"pass {name} as {allowed}.", param=name)


def _real_in(name: str, value: object, low: float, high: float, shown: str, *, low_open: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > low if low_open else value >= low) and value <= high
    if not ok:
        raise InvalidRequestError(f"{name} must be in {shown}, got {show_value(value)}.",
                                  fix=f"pass a {name} in {shown}.", param=name)
