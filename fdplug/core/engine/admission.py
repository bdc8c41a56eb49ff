"""What a request must satisfy against the running model, checked wherever it enters.

The API process checks a request before it registers or queues anything (a bad field is a 400 with
nothing to clean up), and the engine checks it again when it admits it: the Python API
(``fdplug.LLM``) and any other caller of ``EngineCore.add_request`` are held to the same rules, and
no value the model cannot take (a token id outside the vocabulary, a ``top_k`` wider than it, a
placeholder whose item has another size) reaches a step, where it would fail every request that
shares it. Field ranges that do not depend on the model live in ``SamplingParams.validate``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fdplug.core.request import Request
from fdplug.errors import InvalidRequestError, show_value
from fdplug.plugin_api.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """The running model's limits a request is checked against."""

    vocab_size: int
    max_model_len: int
    grammars: Callable[[], Any] | None = None   # the model's `GrammarCompiler` (structured outputs), built on use;
    runner: str = ""                            # None: the runner cannot hold outputs to a constraint


def check_token_ids(ids: Any, vocab_size: int, param: str = "prompt") -> list[int]:
    """A list of Python ints in ``[0, vocab_size)``, or a 400 naming the first bad one."""
    if not isinstance(ids, (list, tuple)):
        raise InvalidRequestError(f"token ids must be a list of integers, got {show_value(ids)}.",
                                  fix="pass token ids as a list of ints.", param=param)
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size:
            raise InvalidRequestError(
                f"token id {show_value(t)} at position {i} is outside the vocabulary [0, {vocab_size}) of this model.",
                fix="tokenize with this model's tokenizer.", param=param)
    return list(ids)


def check_sampling(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """``params.validate()``, then the bounds the vocabulary sets."""
    return check_vocabulary_bounds(params.validate(), vocab_size)


def check_vocabulary_bounds(params: SamplingParams, vocab_size: int) -> SamplingParams:
    """The bounds the vocabulary sets: ``top_k`` and stop token ids."""
    if params.top_k > vocab_size:
        raise InvalidRequestError(f"top_k must be -1 or 0 (off), or at most the vocabulary size {vocab_size}, "
                                  f"got {params.top_k}.", fix=f"pass a top_k in [1, {vocab_size}], or -1.",
                                  param="top_k")
    bad = [t for t in params.stop_token_ids if not t < vocab_size]
    if bad:
        raise InvalidRequestError(f"stop_token_ids {bad[:5]} are outside the vocabulary [0, {vocab_size}).",
                                  fix="use token ids of this model's tokenizer.", param="stop_token_ids")
    return params


def check_prompt_length(num_prompt_tokens: int, max_model_len: int, max_tokens: int | None = None) -> None:
    """A non-empty prompt that leaves room for at least one token (and ``max_tokens``, if given)."""
    if num_prompt_tokens == 0:
        raise InvalidRequestError("the prompt is empty.", fix="send a prompt of at least one token.",
                                  param="prompt")
    if num_prompt_tokens >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {num_prompt_tokens} tokens, but max_model_len is {max_model_len}, which "
            f"leaves room for at most {max_model_len - 1} prompt tokens.",
            fix="shorten the prompt, or start the engine with a larger max_model_len.", param="prompt")
    if max_tokens is not None and num_prompt_tokens + max_tokens > max_model_len:
        raise InvalidRequestError(
            f"this model's maximum context length is {max_model_len} tokens, but {num_prompt_tokens + max_tokens} "
            f"were requested ({num_prompt_tokens} in the prompt, {max_tokens} for the completion).",
            fix=f"lower max_tokens to at most {max_model_len - num_prompt_tokens}, or shorten the prompt.",
            param="max_tokens")


def check_request(request: Request, limits: ModelLimits) -> None:
    """The engine's admission check: everything a step will read of this request fits the model.

    ``Request`` validated its sampling parameters when it was built, and the scheduler checks its
    length; what is left is what only the model knows."""
    check_token_ids(request.prompt_token_ids, limits.vocab_size)
    check_vocabulary_bounds(request.sampling_params, limits.vocab_size)
    for t in request.eos_token_ids:
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise InvalidRequestError(f"eos token ids must be integers >= 0, got {show_value(t)}.",
                                      fix="pass the model's eos token ids.")
    _check_items(request.mm_positions, request.mm_inputs)
    if request.sampling_params.structured_outputs is not None:
        if limits.grammars is None:
            raise InvalidRequestError(f"the model runner {limits.runner!r} cannot hold an output to a constraint.",
                                      fix="leave structured_outputs / response_format out, or use a runner that "
                                          "can (the core's default runner does).", param="structured_outputs")
        limits.grammars().matcher(*request.sampling_params.structured_outputs)   # a 400 if it does not compile


def _check_items(positions: Sequence[Any], inputs: Sequence[Any]) -> None:
    """Every placeholder has its item to fetch, of exactly the placeholder's size."""
    if len(inputs) != len(positions):
        raise InvalidRequestError(f"the request has {len(positions)} multimodal placeholders but {len(inputs)} "
                                  "items to fill them.", fix="give one feature item per placeholder.")
    for i, (pos, item) in enumerate(zip(positions, inputs)):
        if item.num_tokens != pos.length or not 0 <= pos.span_length <= pos.length:
            raise InvalidRequestError(
                f"multimodal item {i} has {item.num_tokens} tokens but its placeholder is {pos.length} tokens "
                f"(bidirectional spans of {pos.span_length}).", fix="widen each placeholder to its item's size.")
        if tuple(pos.grid_thw) not in ((), tuple(item.grid_thw)) or pos.modality != item.modality:
            raise InvalidRequestError(
                f"multimodal item {i} is a {item.modality} of grid {list(item.grid_thw)}, but its placeholder says a "
                f"{pos.modality} of grid {list(pos.grid_thw)}.", fix="keep each placeholder's grid its item's.")
