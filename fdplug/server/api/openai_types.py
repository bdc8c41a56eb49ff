"""OpenAI request models (pydantic) and the response shapes, as the OpenAI API defines them.

Unknown-field policy: a request field that is neither OpenAI's nor one of the vLLM extras below is
rejected with a 400 naming it ("unrecognized request argument supplied: X"), as the OpenAI API
itself does. Silently ignoring it would hide a typo (``max_token``) or a feature fdplug lacks behind
a plausible-looking answer. OpenAI fields that only carry bookkeeping (``user``, ``metadata``,
``store``, ``service_tier``) are accepted and ignored; OpenAI fields fdplug cannot honour
(``logit_bias``, ``echo``, ``suffix``, ``best_of`` != ``n``) are rejected by ``unsupported()``.
``tools`` and the output constraints are checked by the server (`tools`, `constraints`), which
knows its parsers.

Requests are validated from the raw JSON in strict mode: ``"max_tokens": "5"`` is an error, not 5.
Responses are plain dicts (built per chunk on the hot path, where pydantic would cost time).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from fdplug.errors import InvalidRequestError, show_value

# ---------------------------------------------------------------------------------------------------
# requests
# ---------------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_left_out(cls, data: Any) -> Any:
        """OpenAI types its optional fields "or null": a null is the field left out, so it takes the
        default (``"stream": null`` is a plain request, ``"max_tokens": null`` on completions is 16).
        An unknown field stays, null or not, to be refused by name."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False   # vLLM's: with include_usage, the usage so far in every chunk


class _SamplingRequest(_Strict):
    """The fields completions and chat share."""

    model: str | None = None            # None: the served model
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = None
    temperature: float | None = None     # None: 1.0 (OpenAI's default)
    top_p: float | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None   # completions too, as vLLM takes it
    # accepted and ignored: bookkeeping only
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None   # vLLM's: PD instances only (fdplug serve --role)
    structured_outputs: dict[str, Any] | None = None   # vLLM's: {"json" | "regex" | "choice" | "grammar": ...}
    guided_json: dict[str, Any] | str | None = None    # vLLM's older names of the same
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16          # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None   # a template variable
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False   # the last message left open: the model goes on writing it
    chat_template: str | None = None     # a model template's name, or (--trust-request-chat-template) source
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeCompletionRequest(_Strict):
    """vLLM's ``POST /tokenize`` of a prompt."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's ``POST /tokenize`` of a conversation, through the chat template as chat completions do."""

    model: str | None = None
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None   # as chat's
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[int]


def parse_request(model: type[BaseModel], body: bytes) -> Any:
    """Validate a JSON body; every problem becomes a 400 ``InvalidRequestError`` naming the field."""
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _invalid(exc: ValidationError) -> InvalidRequestError:
    errors = exc.errors(include_url=False)
    first = errors[0]
    param = _param(first.get("loc", ()))
    kind = first.get("type", "")
    root = first.get("loc", ("",))[:1]
    if sum(e.get("loc", ())[:1] == root for e in errors) > 1:   # a union: no alternative matched
        kind, param = "union", _param(root)
    if kind == "extra_forbidden":
        err = InvalidRequestError(f"unrecognized request argument supplied: {param}.",
                                  fix="remove it: fdplug rejects fields it does not know (see docs/serving.md).")
    elif kind == "json_invalid":
        err = InvalidRequestError(f"the body is not valid JSON: {first.get('msg')}.",
                                  fix="send a JSON object with Content-Type: application/json.")
    elif kind == "union":
        err = InvalidRequestError(f"{param} does not have any of the accepted types "
                                  f"(got {show_value(first.get('input'))}).",
                                  fix="send a value of the documented type (OpenAI API reference).")
    elif kind == "missing":
        err = InvalidRequestError(f"{param} is required.", fix=f"add {param} to the request.")
    else:
        err = InvalidRequestError(f"{param or 'the body'}: {first.get('msg')} (got {show_value(first.get('input'))}).",
                                  fix="send a value of the documented type (OpenAI API reference).")
    err.param = param  # type: ignore[attr-defined]
    return err


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "literal"}


def _param(loc: tuple) -> str | None:
    """``("prompt", "list[int]", 1)`` -> ``"prompt.1"``: pydantic's union tags are not field names."""
    parts = [str(p) for p in loc if not (isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or "-" in p))]
    return ".".join(parts) or None


def unsupported(req: CompletionRequest | ChatCompletionRequest) -> None:
    """Reject OpenAI fields that are well-formed but that fdplug cannot honour."""
    def refuse(param: str, what: str, fix: str) -> None:
        err = InvalidRequestError(what, fix=fix)
        err.param = param  # type: ignore[attr-defined]
        raise err

    if req.logit_bias:
        refuse("logit_bias", "logit_bias is not supported.", "leave logit_bias out.")
    if req.stream_options is not None and not req.stream:
        refuse("stream_options", "stream_options is only allowed when stream is true.", "set stream: true or drop it.")
    if isinstance(req, CompletionRequest):
        if req.echo:
            refuse("echo", "echo is not supported.", "leave echo out; the prompt is yours already.")
        if req.suffix:
            refuse("suffix", "suffix (insertion) is not supported.", "leave suffix out.")
        if req.best_of is not None and req.best_of != req.n:
            refuse("best_of", f"best_of must equal n ({req.n}); fdplug does not rank candidates.",
                   "leave best_of out.")
    else:
        if req.top_logprobs is not None and not req.logprobs:
            refuse("top_logprobs", "top_logprobs needs logprobs: true.", "set logprobs: true.")


# ---------------------------------------------------------------------------------------------------
# responses
# ---------------------------------------------------------------------------------------------------


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    body = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


def model_card(name: str, created: int, root: str, max_model_len: int) -> dict:
    return {"id": name, "object": "model", "created": created, "owned_by": "fdplug", "root": root,
            "parent": None, "max_model_len": max_model_len}


def completion_choice(index: int, text: str, finish_reason: str | None, logprobs: dict | None,
                      stop_reason: int | str | None = None) -> dict:
    """``stop_reason`` (vLLM's): the stop string or stop token id that ended the choice; None for EOS."""
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_choice(index: int, text: str | None, finish_reason: str | None, logprobs: dict | None,
                reasoning: str | None = None, tool_calls: list[dict] | None = None, parsed: bool = False,
                stop_reason: int | str | None = None) -> dict:
    """``parsed``: a reasoning parser read the text (the message then has ``reasoning_content``)."""
    message = {"role": "assistant", "content": text, "refusal": None, "tool_calls": tool_calls or []}
    if parsed:
        message["reasoning_content"] = reasoning or None
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def chat_delta_choice(index: int, delta: dict, finish_reason: str | None, logprobs: dict | None,
                      stop_reason: int | str | None = None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason,
            "stop_reason": stop_reason}


def envelope(object_: str, id_: str, created: int, model: str, choices: list, usage_: dict | None = None,
             with_usage_field: bool = True) -> dict:
    body = {"id": id_, "object": object_, "created": created, "model": model, "choices": choices}
    if with_usage_field:
        body["usage"] = usage_
    return body
