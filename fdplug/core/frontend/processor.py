"""Between users and the engine: prompts in (validated, tokenized), text out (detokenized, stopped).

Shared by the offline ``LLM`` and the API server so both validate and stop the same way. ``n > 1``
fans out into ``n`` engine requests (``<id>#<i>``); their outputs are gathered back here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fdplug.core.engine.admission import (
    check_prompt_length,
    check_sampling,
    check_token_ids,
)
from fdplug.core.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from fdplug.core.model.text.detokenizer import IncrementalDetokenizer
from fdplug.core.multimodal.config import MultimodalConfig
from fdplug.core.multimodal.inputs import (
    FeaturePartCollector,
    MMFeatureInput,
    expand_placeholders,
)
from fdplug.core.request import Request
from fdplug.core.scheduler.output import EngineCoreOutput
from fdplug.errors import FdplugError, InvalidRequestError, error_from_dict
from fdplug.plugin_api.sampling_params import SamplingParams, child_seed
from fdplug.plugin_api.scheduled_work import MMPlaceholder

PromptType = str | Mapping[str, Any]


def picture_parts(data: Any) -> list[dict[str, Any]]:
    """vLLM's ``multi_modal_data``: ``{"image": image or [images]}`` (PIL images) as ``image_pil`` parts."""
    if not isinstance(data, Mapping) or set(data) - {"image"}:
        raise InvalidRequestError(f"multi_modal_data takes an 'image' entry (got {sorted(map(str, data))!r})."
                                  if isinstance(data, Mapping) else "multi_modal_data must be a dict.",
                                  fix='pass {"image": pil_image} or {"image": [pil_image, ...]}.')
    images = data.get("image")
    return [{"type": "image_pil", "image_pil": image} for image in (images if isinstance(images, list) else [images])]


def child_id(request_id: str, index: int, n: int) -> str:
    return request_id if n == 1 else f"{request_id}#{index}"


@dataclass(slots=True)
class ProcessedPrompt:
    """A prompt ready for the engine: text (if any), token ids, and its multimodal items."""

    text: str | None
    token_ids: list[int]
    mm_inputs: list[MMFeatureInput] = field(default_factory=list)
    mm_positions: list[MMPlaceholder] = field(default_factory=list)
    kv_transfer_params: dict | None = None   # PD disaggregation: checked by the server (`server.api.pd_params`)


class InputProcessor:
    """Turns a prompt and sampling parameters into engine ``Request``s, or a typed 400 error."""

    def __init__(self, tokenizer: Any, vocab_size: int, max_model_len: int, eos_token_ids: Sequence[int],
                 mm_config: MultimodalConfig | None = None) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids)
        self.mm_config = mm_config

    def process(self, prompt: PromptType, tenant: str = "", fit: bool = True) -> ProcessedPrompt:
        """Tokenize, then widen multimodal placeholders: ``{"prompt"|"prompt_token_ids", "mm_items": [parts]}``.

        ``mm_items`` are content parts as in chat (``{"type": "image_feature", "image_feature": {...}}``,
        ``image_url``, ``image_pil``), one per placeholder in the prompt, in order; vLLM's
        ``multi_modal_data={"image": <PIL image or list>}`` adds pictures after them. ``fit``: refuse a
        prompt longer than ``max_model_len`` (``/tokenize`` counts it instead).
        """
        parts = prompt.get("mm_items") if isinstance(prompt, Mapping) else None
        if isinstance(prompt, Mapping) and prompt.get("multi_modal_data") is not None:
            parts = [*(parts or ()), *picture_parts(prompt["multi_modal_data"])]
        text, ids = self.tokenize(prompt)
        processed = ProcessedPrompt(text, ids)
        if parts:
            collector = FeaturePartCollector(self.mm_config, self.tokenizer, tenant)
            for part in parts:
                collector(part, 0)
            processed.token_ids, processed.mm_positions = expand_placeholders(ids, collector.items, self.mm_config,
                                                                              self.max_model_len)
            processed.mm_inputs = collector.items
        if fit:
            self.check_length(len(processed.token_ids))
        return processed

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        """``"text"``, ``{"prompt": "text"}`` or ``{"prompt_token_ids": [...]}`` -> (text, ids)."""
        if isinstance(prompt, str):
            text, ids = prompt, self.encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            text, ids = prompt.get("prompt"), self._check_ids(prompt["prompt_token_ids"])
        elif isinstance(prompt, Mapping) and isinstance(prompt.get("prompt"), str):
            text, ids = prompt["prompt"], self.encode(prompt["prompt"], add_special_tokens=True)
        else:
            raise InvalidRequestError(f"a prompt must be a string, {{'prompt': str}} or {{'prompt_token_ids': [...]}}, "
                                      f"got {type(prompt).__name__}.", fix="pass the prompt in one of those forms.")
        return text, ids

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Token ids of a prompt text; one that cannot fit ``max_model_len`` is refused before it is
        tokenized (tokenizing megabytes takes seconds)."""
        chars = getattr(self.tokenizer, "max_token_chars", None)
        if chars and len(text) >= self.max_model_len * chars:
            raise InvalidRequestError(
                f"the prompt has {len(text)} characters: more than {self.max_model_len - 1} tokens (max_model_len is "
                f"{self.max_model_len}) of at most {chars} characters each.",
                fix="shorten the prompt, or start the engine with a larger max_model_len.", param="prompt")
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def check_length(self, num_prompt_tokens: int, max_tokens: int | None = None) -> None:
        check_prompt_length(num_prompt_tokens, self.max_model_len, max_tokens)

    def check_params(self, params: SamplingParams) -> SamplingParams:
        return check_sampling(params, self.vocab_size)

    def make_requests(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                      cache_salt: str | None = None) -> list[Request]:
        """One engine request per output sequence; with a seed, sequence ``i`` uses ``seed + i``."""
        requests = []
        for i in range(params.n):
            child = params if params.n == 1 else dataclasses.replace(params, n=1, seed=child_seed(params.seed, i))
            requests.append(Request(child_id(request_id, i, params.n), prompt.token_ids, child, self.eos_token_ids,
                                    cache_salt=cache_salt, mm_positions=list(prompt.mm_positions),
                                    mm_inputs=list(prompt.mm_inputs), kv_transfer_params=prompt.kv_transfer_params))
        return requests

    def _check_ids(self, ids: Any) -> list[int]:
        return check_token_ids(ids, self.vocab_size)


# ---------------------------------------------------------------------------------------------------
# outputs
# ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Delta:
    """What one engine step added to one output sequence (what a stream sends)."""

    request_id: str
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: FdplugError | None = None   # why the engine failed it (finish_reason "error")


@dataclass(slots=True)
class _Child:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer
    want_logprobs: bool


@dataclass(slots=True)
class _Parent:
    output: RequestOutput
    children: list[_Child] = field(default_factory=list)


class OutputProcessor:
    """Detokenizes engine outputs, applies stop strings, gathers ``n`` children into one output."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, tuple[str, int]] = {}

    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams) -> None:
        parent = _Parent(RequestOutput(request_id, prompt, prompt_ids, []))
        for i in range(params.n):
            detok = IncrementalDetokenizer.for_request(self.tokenizer, prompt_ids, stop=params.stop,
                                                       skip_special_tokens=params.skip_special_tokens,
                                                       include_stop_str_in_output=params.include_stop_str_in_output)
            out = CompletionOutput(i, "", [], logprobs=[] if params.logprobs is not None else None,
                                   cumulative_logprob=0.0 if params.logprobs is not None else None)
            parent.children.append(_Child(out, detok, params.logprobs is not None))
            parent.output.outputs.append(out)
            self._child_to_parent[child_id(request_id, i, params.n)] = (request_id, i)
        self._parents[request_id] = parent

    def has(self, request_id: str) -> bool:
        return request_id in self._parents

    def child_ids(self, request_id: str) -> list[str]:
        return [c for c, (p, _) in self._child_to_parent.items() if p == request_id]

    def process(self, outputs: Sequence[EngineCoreOutput]) -> tuple[list[Delta], list[str]]:
        """Apply a step's outputs. Returns the deltas, and the child ids a stop string ended (to abort)."""
        deltas, stopped = [], []
        for out in outputs:
            key = self._child_to_parent.get(out.request_id)
            if key is None:
                continue
            child = self._parents[key[0]].children[key[1]]
            if child.output.finished():
                continue
            delta = self._apply(key, child, out)
            if child.detokenizer.finished and not out.finished:
                stopped.append(out.request_id)
            deltas.append(delta)
            if child.output.finished():
                self._maybe_finish_parent(key[0])
        return deltas, stopped

    def fail(self, request_id: str, reason: str, error: FdplugError | None = None) -> list[Delta]:
        """End every unfinished output of a parent request with ``reason`` (abort, error)."""
        parent = self._parents.get(request_id)
        if parent is None:
            return []
        deltas = []
        for child in parent.children:
            if not child.output.finished():
                child.output.finish_reason = reason
                deltas.append(Delta(request_id, child.output.index, "", [], None, reason, None, error))
        parent.output.error = error
        self._maybe_finish_parent(request_id)
        return deltas

    def output(self, request_id: str) -> RequestOutput:
        return self._parents[request_id].output

    def pop(self, request_id: str) -> RequestOutput:
        parent = self._parents.pop(request_id)
        for cid in [c for c, (p, _) in self._child_to_parent.items() if p == request_id]:
            del self._child_to_parent[cid]
        return parent.output

    def _apply(self, key: tuple[str, int], child: _Child, out: EngineCoreOutput) -> Delta:
        result = child.output
        new_ids = list(out.new_token_ids)
        text = child.detokenizer.step(new_ids)
        new_logprobs = self._logprobs(out) if child.want_logprobs else None
        error = error_from_dict(out.error) if out.error else None
        if child.detokenizer.finished:                       # a stop string ended it
            result.finish_reason, result.stop_reason = "stop", child.detokenizer.stop_reason
        elif error is not None:
            result.finish_reason, result.stop_reason = "error", error.message
            self._parents[key[0]].output.error = error
        elif out.finished:
            text += child.detokenizer.finish()
            result.finish_reason, result.stop_reason = out.finish_reason, out.stop_reason
        result.text += text
        result.token_ids.extend(new_ids)
        if new_logprobs is not None:
            result.logprobs.extend(new_logprobs)
            result.cumulative_logprob += sum(entry[t].logprob for entry, t in zip(new_logprobs, new_ids))
        parent = self._parents[key[0]].output
        parent.num_cached_tokens = max(parent.num_cached_tokens, out.num_cached_tokens)
        if out.kv_transfer_params is not None:
            parent.kv_transfer_params = out.kv_transfer_params
        return Delta(key[0], result.index, text, new_ids, new_logprobs, result.finish_reason, result.stop_reason,
                     error)

    def _logprobs(self, out: EngineCoreOutput) -> list[dict[int, Logprob]]:
        entries, tok = [], self.tokenizer
        for ids, logprobs, ranks in out.new_logprobs or ():
            entries.append({tid: Logprob(lp, rank, tok.decode([tid], skip_special_tokens=False), tok.token_bytes(tid))
                            for tid, lp, rank in zip(ids, logprobs, ranks)})
        return entries

    def _maybe_finish_parent(self, request_id: str) -> None:
        parent = self._parents[request_id]
        parent.output.finished = all(c.output.finished() for c in parent.children)
