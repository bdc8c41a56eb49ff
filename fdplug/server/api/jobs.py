"""From an OpenAI request to a ``Job``: every field checked, the chat template rendered, every prompt
tokenized, before anything is registered with the engine (``app.py`` runs it in a worker thread).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from fdplug.core.frontend.processor import ProcessedPrompt
from fdplug.core.model.text.chat_messages import check_template_kwargs
from fdplug.core.multimodal.inputs import FeaturePartCollector
from fdplug.core.parsers.chat_output import ChatParsers, ChoiceParser
from fdplug.core.parsers.tool_choice import check_tool_list, forced_choice, forced_params, forced_parser
from fdplug.errors import InvalidRequestError, ModelNotFoundError
from fdplug.plugin_api.parsers import ParserContext
from fdplug.plugin_api.sampling_params import MAX_LOGPROBS, SamplingParams
from fdplug.server.api import openai_types as T
from fdplug.server.api.constraints import structured_outputs
from fdplug.server.api.engine_client import EngineClient
from fdplug.server.api.request_stream import RequestStream


@dataclass(slots=True)
class Job:
    """One HTTP request's sequences: prompt ``i`` is stream ``i``; choice index = i * n + child."""

    kind: str                        # "chat" or "completion"
    id: str
    created: int
    model: str
    n: int
    num_logprobs: int | None
    streams: list[RequestStream] = field(default_factory=list)
    prompt_tokens: int = 0
    parse: Callable[[], ChoiceParser | None] | None = None   # chat: a fresh parser per choice, if any parses
    one_call: bool = False       # parallel_tool_calls false: a choice's first call only
    usage_every_chunk: bool = False  # stream_options.continuous_usage_stats (with include_usage)

    def choice_index(self, stream_index: int, child: int) -> int:
        return stream_index * self.n + child


class JobBuilder:
    def __init__(self, client: EngineClient, model_name: str, trust_request_chat_template: bool = False,
                 parsers: ChatParsers | None = None, auto_tool_choice: bool = False) -> None:
        self.client = client
        self.model_name = model_name
        self.parsers = parsers or ChatParsers()
        self.auto_tool_choice = auto_tool_choice   # --enable-auto-tool-choice (with a --tool-call-parser)
        end_tag = self.parsers.reasoning.end_tag if self.parsers.reasoning is not None else ""
        self.reasoning_gate = tuple(client.tokenizer.encode(end_tag, add_special_tokens=False)) if end_tag else ()
        # a chat template is code: one from a request runs only if the operator trusts the clients
        # (--trust-request-chat-template, vLLM's flag since CVE-2025-61620); it is budgeted either way
        self.trust_request_chat_template = trust_request_chat_template

    @functools.cached_property
    def _storages(self) -> tuple[Any, float]:
        from fdplug.core.config import EngineConfig
        from fdplug.core.multimodal.fetch import FeatureFetcher
        from fdplug.core.plugin_loading.loader import current_plugins
        from fdplug.core.plugin_loading.selection import select_storages

        config = EngineConfig()
        return FeatureFetcher(select_storages(current_plugins()), config), config.fetch_timeout

    def fetch_image(self, url: str) -> bytes:
        """An http(s) ``image_url``'s bytes, through the storage that serves feature URLs of its scheme
        (its host allow-list, size limit and timeout), on this request's worker thread."""
        fetcher, timeout = self._storages
        return next(iter(fetcher.fetch_many([url], timeout=timeout)))

    def check_model(self, model: str | None) -> str:
        if model is not None and model != self.model_name:
            err = ModelNotFoundError(f"the model {model!r} does not exist on this server.",
                                     fix=f"use model {self.model_name!r} (GET /v1/models lists it).")
            err.param, err.code = "model", "model_not_found"  # type: ignore[attr-defined]
            raise err
        return self.model_name

    def check_sequences(self, num_prompts: int, n: int) -> None:
        """A request may ask for at most as many sequences as the engine can ever queue: beyond that a
        503 "retry later" would be a lie, so it is a 400 (checked before anything is tokenized)."""
        limit = self.client.info.max_waiting_requests
        if num_prompts * n > limit:
            raise InvalidRequestError(
                f"this request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x n={n}), but this "
                f"server queues at most {limit} (--max-waiting-requests).",
                fix="send fewer prompts per request or a smaller n, or start the server with a larger "
                    "--max-waiting-requests.", param="n" if n > 1 else "prompt")

    # both take a request and its params as `parse_job_request` checked them

    def completion_job(self, req: T.CompletionRequest, params: SamplingParams) -> tuple[Job, list[ProcessedPrompt],
                                                                                       SamplingParams]:
        model = self.check_model(req.model)
        params = self.client.input_processor.check_params(params)
        prompts = _prompts(req.prompt)
        self.check_sequences(len(prompts), params.n)
        prepared = [self.client.input_processor.process(p) for p in prompts]
        for prompt in prepared:
            self.client.input_processor.check_length(len(prompt.token_ids), params.max_tokens)
        job = Job("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, params.n, req.logprobs)
        return job, prepared, params

    def chat_job(self, req: T.ChatCompletionRequest, params: SamplingParams, tenant: str = "") -> tuple[
            Job, list[ProcessedPrompt], SamplingParams]:
        model = self.check_model(req.model)
        params = self.client.input_processor.check_params(params)
        self.check_sequences(1, params.n)
        tools = self.check_tools(req)
        try:
            text, prompt = self.chat_prompt(req, tools, tenant)
            self.client.input_processor.check_length(len(prompt.token_ids), params.max_tokens)
        except InvalidRequestError as exc:      # the chat's prompt is its messages
            if getattr(exc, "param", None) == "prompt":
                exc.param = "messages"  # type: ignore[attr-defined]
            raise
        job = Job("chat", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, params.n, params.logprobs)
        forced = forced_choice(req.tool_choice, req.tools)
        job.one_call = req.parallel_tool_calls is False
        if forced is not None:      # the answer is held to the calls' schema, and read as calls
            params = forced_params(params, tools, forced, job.one_call)
            job.parse = partial(forced_parser, forced)
        elif self.parsers.reasoning is not None or tools is not None:
            params = self.after_reasoning(params)
            context = ParserContext(text, tuple(tools or ()), dict(req.chat_template_kwargs or {}))
            job.parse = partial(self.parsers.choice, context, tools is not None)
        return job, [prompt], params

    def after_reasoning(self, params: SamplingParams) -> SamplingParams:
        """With a reasoning parser on, an output constraint holds the answer after the reasoning's end tag."""
        if params.structured_outputs is None or not self.reasoning_gate:
            return params
        return dataclasses.replace(params, reasoning_end_token_ids=self.reasoning_gate)

    def chat_prompt(self, req: T.ChatCompletionRequest | T.TokenizeChatRequest, tools: list[dict] | None,
                    tenant: str = "", add_special_tokens: bool = False,
                    fit: bool = True) -> tuple[str, ProcessedPrompt]:
        """The conversation through the chat template (``tools`` shown to the model), tokenized."""
        kwargs = dict(req.chat_template_kwargs or {})
        if getattr(req, "reasoning_effort", None) is not None:     # as vLLM passes it (gpt-oss templates read it)
            kwargs.setdefault("reasoning_effort", req.reasoning_effort)
        template, where = req.chat_template, "chat_template"
        if "chat_template" in kwargs:
            template, where = kwargs.pop("chat_template"), "chat_template_kwargs.chat_template"
        self.check_template(template, where)
        tokenizer, processor = self.client.tokenizer, self.client.input_processor
        collector = FeaturePartCollector(processor.mm_config, tokenizer, tenant, self.fetch_image)
        text = tokenizer.apply_chat_template(req.messages, add_generation_prompt=req.add_generation_prompt,
                                             chat_template=template, content_part_handler=collector,
                                             variables=check_template_kwargs(kwargs), tools=tools,
                                             continue_final_message=req.continue_final_message)
        return text, processor.process({"prompt": text, "prompt_token_ids": processor.encode(text, add_special_tokens),
                                        "mm_items": collector.parts}, tenant, fit)

    def tokenize(self, body: bytes, tenant: str = "") -> dict:
        """vLLM's ``POST /tokenize``: a prompt, or messages through the chat template (the count is the
        ``usage.prompt_tokens`` the same request would report). A prompt longer than ``max_model_len``
        is counted, not refused: clients ask "does it fit?" (text past what could ever fit is refused
        before it is tokenized, as everywhere)."""
        try:
            chat = "messages" in json.loads(body)
        except (ValueError, TypeError, RecursionError):
            chat = False      # parse_request says what is wrong with it
        req = T.parse_request(T.TokenizeChatRequest if chat else T.TokenizeCompletionRequest, body)
        self.check_model(req.model)
        processor = self.client.input_processor
        if chat:
            if req.tools:
                check_tool_list(req.tools)
            ids = self.chat_prompt(req, req.tools or None, tenant, req.add_special_tokens, fit=False)[1].token_ids
        else:
            ids = processor.encode(req.prompt, req.add_special_tokens)
            ids = processor.process({"prompt": req.prompt, "prompt_token_ids": ids}, fit=False).token_ids
        strs = [self.client.tokenizer.id_to_token(i) for i in ids] if req.return_token_strs else None
        return {"count": len(ids), "max_model_len": self.client.info.max_model_len, "tokens": ids,
                "token_strs": strs}

    def detokenize(self, body: bytes) -> dict:
        """vLLM's ``POST /detokenize``: token ids (each checked against the vocabulary) -> text."""
        req = T.parse_request(T.DetokenizeRequest, body)
        self.check_model(req.model)
        ids = self.client.input_processor.tokenize({"prompt_token_ids": req.tokens})[1]
        return {"prompt": self.client.tokenizer.decode(ids, skip_special_tokens=False)}

    def check_tools(self, req: T.ChatCompletionRequest) -> list[dict] | None:
        """The tools the template shows the model, checked; None when none may be called."""
        choice = req.tool_choice
        if not req.tools:
            if choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice names a tool, but the request has no tools.",
                                          fix="send the tools, or leave tool_choice out.", param="tool_choice")
            return None
        check_tool_list(req.tools)
        if choice == "none":
            return None
        if forced_choice(req.tool_choice, req.tools) is not None:
            return req.tools
        if not self.auto_tool_choice or self.parsers.tools is None:
            raise InvalidRequestError(
                "this server does not answer tools: the model's calls are read by a tool-call parser, and none is on.",
                fix="start the server with --enable-auto-tool-choice --tool-call-parser NAME, or send "
                    'tool_choice "none".', param="tools")
        return req.tools

    def check_template(self, template: Any, where: str) -> None:
        """A template named in a request: one of the model's own, or (trusted clients only) its source."""
        if template is None:
            return
        if not isinstance(template, str):
            raise InvalidRequestError(f"{where} must be a string.", fix="name a template or leave it out.", param=where)
        if self.client.tokenizer.is_named_template(template) or self.trust_request_chat_template:
            return
        raise InvalidRequestError(
            f"{where}: this server does not run chat templates sent in requests (a template is code), and "
            f"{template!r:.40} is not one of the model's ({', '.join(sorted(self.client.tokenizer.chat_templates))}).",
            fix="leave it out to use the model's template, or start the server with --trust-request-chat-template "
                "if every client is trusted.", param=where)


def parse_job_request(path: str, body: bytes) -> tuple[T.CompletionRequest | T.ChatCompletionRequest,
                                                      SamplingParams]:
    """A completions or chat body (``path`` says which) and its ``SamplingParams``, with every check
    that needs no model: its JSON, fields and types (strict), the fields fdplug cannot honour, and
    the sampling values' ranges (the vocabulary's bounds are the engine client's).

    The server runs it before tokenizing, ``fdplug router`` before relaying: one parser, one contract.
    """
    model = T.ChatCompletionRequest if path.endswith("/chat/completions") else T.CompletionRequest
    req = T.parse_request(model, body)
    T.unsupported(req)
    if isinstance(req, T.ChatCompletionRequest):
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise InvalidRequestError(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}.",
                                      fix=f"ask for at most {MAX_LOGPROBS} alternatives.", param="top_logprobs")
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
    else:
        max_tokens, logprobs = req.max_tokens, req.logprobs

    def pick(value: Any, default: Any) -> Any:
        return default if value is None else value

    params = SamplingParams(
        n=req.n, temperature=pick(req.temperature, 1.0), top_p=pick(req.top_p, 1.0), top_k=pick(req.top_k, 0),
        min_p=pick(req.min_p, 0.0), seed=req.seed, presence_penalty=pick(req.presence_penalty, 0.0),
        frequency_penalty=pick(req.frequency_penalty, 0.0),
        repetition_penalty=pick(req.repetition_penalty, 1.0), max_tokens=max_tokens, min_tokens=req.min_tokens,
        stop=req.stop or (), stop_token_ids=req.stop_token_ids or (), ignore_eos=req.ignore_eos,
        logprobs=logprobs, skip_special_tokens=req.skip_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, structured_outputs=structured_outputs(req))
    return req, params.validate()


def _prompts(prompt: Any) -> list:
    """OpenAI's four prompt forms -> a list of prompts for ``InputProcessor.tokenize``."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("prompt is empty.", fix="send a string, a list of strings or token ids.")
    if isinstance(prompt[0], int):
        return [{"prompt_token_ids": prompt}]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [{"prompt_token_ids": ids} for ids in prompt]
