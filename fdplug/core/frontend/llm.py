"""Offline inference, shaped like vLLM's ``LLM`` so users can switch.

    llm = fdplug.LLM("path/to/model", device="auto", max_model_len=2048)
    outputs = llm.generate(["Hello"], fdplug.SamplingParams(temperature=0, max_tokens=32))

Without a model path it runs the built-in demo model, so the first run works on a fresh machine.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from functools import partial
from typing import Any

from fdplug.core.engine.startup import create_engine
from fdplug.core.frontend.outputs import RequestOutput
from fdplug.core.frontend.processor import (
    Delta,
    InputProcessor,
    OutputProcessor,
    ProcessedPrompt,
    PromptType,
)
from fdplug.core.heap import freeze_startup_heap_once
from fdplug.core.multimodal.inputs import FeaturePartCollector
from fdplug.core.parsers.chat_output import finish_reason, openai_call, parse_whole
from fdplug.core.parsers.tool_choice import check_tool_list, forced_choice, forced_params, forced_parser
from fdplug.core.request import RequestStatus
from fdplug.errors import ConfigError
from fdplug.plugin_api.parsers import ParserContext
from fdplug.plugin_api.sampling_params import SamplingParams

logger = logging.getLogger("fdplug.llm")

OFFLINE_MAX_WAITING = 1 << 30


class LLM:
    """An engine in this process: ``generate`` and ``chat`` run it to completion."""

    def __init__(self, model: str | None = None, device: str = "auto", *, runner: str | None = None,
                 attention_backend: str | None = None, moe_backend: str | None = None,
                 op_kernels: Mapping[str, str] | None = None, reasoning_parser: str | None = None,
                 tool_call_parser: str | None = None, **engine_args: Any) -> None:
        """``reasoning_parser`` / ``tool_call_parser``: as ``fdplug serve``'s flags, for `chat`."""
        from fdplug.core.model.text.tokenizer import Tokenizer
        from fdplug.core.plugin_loading.loader import current_plugins
        from fdplug.core.plugin_loading.selection import select_parsers

        self.parsers = select_parsers(current_plugins(), reasoning_parser, tool_call_parser)

        # offline, every prompt of a generate() call is queued at once: no waiting limit unless asked for
        engine_args.setdefault("max_waiting_requests", OFFLINE_MAX_WAITING)
        self.engine, self.config, self.model_config = create_engine(
            model, device, runner, attention_backend, moe_backend, ops=op_kernels, **engine_args)
        self.tokenizer = Tokenizer.from_dir(self.config.model_dir)
        eos = self.model_config.eos_token_ids or self.tokenizer.eos_token_ids
        self.input_processor = InputProcessor(self.tokenizer, self.model_config.vocab_size,
                                              self.config.max_model_len, eos, self.model_config.multimodal)
        self.output_processor = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()
        freeze_startup_heap_once()   # the model's and the engine's objects: skipped by the collector's full passes
        logger.info("fdplug LLM ready: %s", self.describe())

    def describe(self) -> str:
        s, plan = self.engine.selection, self.engine.kv_plan
        ops = ",".join(f"{op}:{spec.name}" for op, spec in s.ops.items())
        return (f"model={self.config.model_dir} ({self.model_config.architecture}) device={s.device.name} "
                f"runner={s.runner.name} attention={s.attention.name} moe={s.moe.name} ops={ops} "
                f"kv_cache={plan.describe()}")

    # -- generation -------------------------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, (str, Mapping)):
            prompts = [prompts]
        params_list = self._params_for(len(prompts), sampling_params)
        prepared = [(self.input_processor.process(p), self.input_processor.check_params(sp))
                    for p, sp in zip(prompts, params_list)]  # validate everything before queueing anything
        request_ids: list[str] = []
        try:
            for prompt, params in prepared:
                request_ids.append(self._submit(prompt, params))
            self._run(request_ids, use_tqdm)
        except BaseException:   # refused, Ctrl-C in a notebook, an engine error: nothing of the call stays
            for rid in request_ids:
                self._take_back(rid)
            raise
        return [self.output_processor.pop(rid) for rid in request_ids]

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, add_generation_prompt: bool = True,
             tools: Sequence[Mapping[str, Any]] | None = None, tool_choice: Any = "auto",
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate.

        ``tools`` are shown to the model by its template. With ``tool_choice`` "auto" and the LLM's
        ``tool_call_parser`` its calls come back in each output's ``tool_calls`` (finish reason
        "tool_calls"); "required" or ``{"type": "function", "function": {"name": ...}}`` holds the
        answer to valid calls (structured outputs, no parser needed). With a ``reasoning_parser``
        the reasoning comes back in ``reasoning_content``. ``continue_final_message`` (with
        ``add_generation_prompt=False``) has the model go on writing the last message."""
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        tools = list(tools or ())
        if tools:
            check_tool_list(tools)
        forced = forced_choice(tool_choice, tools) if tools else None
        prompts = [self.chat_prompt(c, chat_template, add_generation_prompt, tools or None, continue_final_message)
                   for c in conversations]
        params = self._params_for(len(prompts), sampling_params)
        if forced is not None:
            params = [forced_params(p, tools, forced) for p in params]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)
        for prompt, output in zip(prompts, outputs):
            context = ParserContext(prompt["prompt"], tuple(tools))
            self._parse(output, partial(forced_parser, forced) if forced is not None else
                        partial(self.parsers.choice, context, bool(tools) and tool_choice != "none"))
        return outputs

    @staticmethod
    def _parse(output: RequestOutput, parser_for: Any) -> None:
        for completion in output.outputs:
            parser = parser_for()
            if parser is None:
                return
            answer = parse_whole(parser, completion.text)
            completion.content, completion.reasoning_content = answer.content, answer.reasoning or None
            completion.tool_calls = [openai_call(call) for call in answer.calls]
            completion.finish_reason = finish_reason(completion.finish_reason, bool(answer.calls))

    def chat_prompt(self, conversation: Sequence[Mapping[str, Any]], chat_template: str | None = None,
                    add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    continue_final_message: bool = False) -> dict[str, Any]:
        """The prompt ``generate`` takes for a conversation; feature parts become ``mm_items``."""
        collector = FeaturePartCollector(self.model_config.multimodal, self.tokenizer)
        text = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                  chat_template=chat_template, content_part_handler=collector,
                                                  tools=tools, continue_final_message=continue_final_message)
        return {"prompt": text, "prompt_token_ids": self.input_processor.encode(text, add_special_tokens=False),
                "mm_items": collector.parts}

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None) -> Iterator[Delta]:
        """Generate one prompt, yielding text deltas as they are produced (``fdplug generate`` uses it)."""
        processed = self.input_processor.process(prompt)
        request_id = self._submit(processed, self.input_processor.check_params(sampling_params or SamplingParams()))
        try:
            while not self.output_processor.output(request_id).finished:
                deltas, scheduled = self._step()
                if not scheduled and not deltas:
                    time.sleep(0.002)  # only feature downloads are in flight: do not spin
                yield from (d for d in deltas if d.request_id == request_id)
        finally:   # finished children are no longer in the engine: aborting them is a no-op
            self._take_back(request_id)

    # -- internals --------------------------------------------------------------------------------

    def _params_for(self, n: int, sampling_params: Any) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * n
        if len(sampling_params) != n:
            raise ConfigError(f"got {n} prompts but {len(sampling_params)} sampling params.",
                              fix="pass one SamplingParams for all prompts, or one per prompt.")
        return list(sampling_params)

    def _submit(self, prompt: ProcessedPrompt, params: SamplingParams) -> str:
        request_id = str(next(self._ids))
        requests = self.input_processor.make_requests(request_id, prompt, params)
        self.output_processor.add(request_id, prompt.text, prompt.token_ids, params)
        try:
            for request in requests:
                self.engine.add_request(request)
        except BaseException:   # all of its sequences or none: the ones queued so far are taken back
            self._take_back(request_id)
            raise
        return request_id

    def _take_back(self, request_id: str) -> None:
        """Abort whatever of a request the engine still runs and forget its output."""
        self.engine.abort_requests(self.output_processor.child_ids(request_id))
        self.output_processor.pop(request_id)

    def _step(self) -> tuple[list[Delta], bool]:
        """The deltas of one engine step, and whether it ran anything."""
        outputs, scheduled = self.engine.step()
        deltas, stopped = self.output_processor.process(outputs)
        if stopped:
            self.engine.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return deltas, scheduled

    def _run(self, request_ids: list[str], use_tqdm: bool) -> None:
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm import tqdm

            bar = tqdm(total=len(request_ids), desc="Generating", unit="req", dynamic_ncols=True)
        pending = set(request_ids)
        while pending:
            deltas, scheduled = self._step()
            if not scheduled and not deltas:
                time.sleep(0.002)  # only feature downloads are in flight: do not spin
            done = {rid for rid in pending if self.output_processor.output(rid).finished}
            pending -= done
            if bar is not None and done:
                bar.update(len(done))
            if pending and not self.engine.has_unfinished_requests():
                raise RuntimeError(f"engine has no work but requests {sorted(pending)[:5]} are unfinished")
        if bar is not None:
            bar.close()

