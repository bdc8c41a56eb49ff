"""Tokenizer: a Hugging Face ``tokenizer.json`` plus the model's chat template.

Why not transformers: the server needs encode/decode and the chat template, nothing else, and
``tokenizers`` (Rust) + ``jinja2`` are light. The behaviour follows transformers where a model
relies on it: where the chat template comes from (``chat_template.jinja`` first), the Jinja
environment (sandboxed, ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson``,
``strftime_now``, the ``{% generation %}`` tag), the variables a template sees, and which ids end
generation (the tokenizer's EOS and every ``eos_token_id`` of ``generation_config.json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from fdplug.errors import InvalidRequestError, ModelLoadError

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")

ContentPartHandler = Callable[[Mapping[str, Any], int], str]
"""Turns one non-text content part of message ``index`` into the prompt text that stands for it.

The extension point for multimodal input: a handler records the item (an image, a feature URL) on
the side and returns its placeholder (e.g. ``<|vision_start|><|image_pad|><|vision_end|>``). It
raises an ``FdplugError`` to reject the part. Without a handler, non-text parts are rejected.
"""


@dataclass(slots=True)
class Tokenizer:
    """A model's tokenizer: ids <-> text, special and end-of-sequence ids, chat templates."""

    backend: HFTokenizer = field(repr=False)
    chat_templates: dict[str, str] = field(repr=False)  # name -> Jinja source; a lone one is "default"
    special_tokens: dict[str, str]  # bos_token/eos_token/pad_token/unk_token -> text, when set
    eos_token_ids: tuple[int, ...]  # every id that ends generation, the tokenizer's EOS first
    special_token_ids: frozenset[int]
    add_bos_token: bool | None = None  # None: as tokenizer.json's post-processor does

    # ------------------------------------------------------------------------------------------------
    # loading
    # ------------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (``tokenizer.json`` is required)."""
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"no tokenizer.json in {model_dir}.",
                                 fix="point --model at a Hugging Face model directory that has a fast tokenizer "
                                     "(tokenizer.json); convert a slow-only tokenizer with transformers first.")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # tokenizers raises a bare Exception on malformed files
            raise ModelLoadError(f"{path} could not be read: {exc}.",
                                 fix="re-download the model's tokenizer.json.") from None
        config = _read_json(model_dir / "tokenizer_config.json")
        generation_config = _read_json(model_dir / "generation_config.json")
        specials = {k: t for k in _SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        return cls(
            backend=backend,
            chat_templates=_load_chat_templates(model_dir, config),
            special_tokens=specials,
            eos_token_ids=_eos_ids(backend, specials.get("eos_token"), generation_config),
            special_token_ids=_special_ids(backend, config, specials),
            add_bos_token=config.get("add_bos_token"),
        )

    # ------------------------------------------------------------------------------------------------
    # ids and text
    # ------------------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (a model may pad its embedding beyond)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("bos_token"))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.special_tokens.get("pad_token"))

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token text in ``text`` (``<|im_start|>``) becomes its id.

        Encode a rendered chat template with ``add_special_tokens=False``: the template already
        wrote the BOS it wants, and adding another one changes what the model sees.
        """
        encoding = self.backend.encode(text, add_special_tokens=add_special_tokens)
        ids = encoding.ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None or self.add_bos_token is None:
            return ids
        added_bos = bool(ids) and ids[0] == bos and encoding.special_tokens_mask[0] == 1
        if self.add_bos_token and not added_bos:
            return [bos, *ids]  # tokenizer_config asks for a BOS the post-processor does not add
        if not self.add_bos_token and added_bos:
            return ids[1:]  # ... or forbids one it adds (transformers rebuilds the post-processor)
        return ids

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``token_ids``; ids the tokenizer does not know (embedding padding) are dropped."""
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    # ------------------------------------------------------------------------------------------------
    # chat template
    # ------------------------------------------------------------------------------------------------

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_templates)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None, *,
                            chat_template: str | None = None, documents: Sequence[Mapping[str, Any]] | None = None,
                            content_part_handler: ContentPartHandler | None = None, **kwargs: Any) -> str:
        """The prompt text for a conversation, rendered by the model's chat template in a sandbox.

        ``chat_template`` is a template name (``"tool_use"``) or a template's source; ``kwargs``
        become template variables (e.g. ``enable_thinking``). Raises ``InvalidRequestError`` for a
        malformed conversation, a model without a template, or a template that fails or raises.
        """
        source = self._select_template(chat_template, tools)
        context = {
            **self.special_tokens,
            **kwargs,
            "messages": normalize_messages(messages, content_part_handler),
            "tools": _check_dicts(tools, "tools"),
            "documents": _check_dicts(documents, "documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        return render_template(source, context)

    def _select_template(self, chat_template: str | None, tools: Any) -> str:
        """transformers' rule: an explicit name or source, else "tool_use" when tools are given, else "default"."""
        if chat_template is not None:
            if chat_template in self.chat_templates:
                return self.chat_templates[chat_template]
            if "{{" in chat_template or "{%" in chat_template:
                return chat_template
            raise InvalidRequestError(f"the model has no chat template named {chat_template!r}.",
                                      fix=f"use one of {sorted(self.chat_templates)} or pass a template's source.")
        if tools and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if "default" in self.chat_templates:
            return self.chat_templates["default"]
        if self.chat_templates:
            names = sorted(self.chat_templates)
            raise InvalidRequestError(f"the model has several chat templates {names} and no default.",
                                      fix="name the one to use (chat_template=NAME).")
        raise InvalidRequestError("this model has no chat template, so chat messages cannot be turned into a prompt.",
                                  fix="use the completions API with a plain prompt, pass a template "
                                      "(--chat-template), or use a model that ships one (chat_template.jinja).")


# ---------------------------------------------------------------------------------------------------
# messages
# ---------------------------------------------------------------------------------------------------


def normalize_messages(messages: Sequence[Mapping[str, Any]],
                       content_part_handler: ContentPartHandler | None = None) -> list[dict[str, Any]]:
    """Validated copies of OpenAI-style messages in the shape HF templates expect.

    Content becomes a string (text parts joined by newlines, other parts through the handler); a
    tool call's JSON ``arguments`` string becomes a dict, since templates render it with ``tojson``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects.",
                                  fix='send e.g. [{"role": "user", "content": "Hello"}].')
    return [_normalize_message(m, i, content_part_handler) for i, m in enumerate(messages)]


def _normalize_message(message: Any, index: int, handler: ContentPartHandler | None) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"messages[{index}] is a {type(message).__name__}, not an object.",
                                  fix='give each message as {"role": ..., "content": ...}.')
    role = message.get("role")
    if role not in ROLES:
        raise InvalidRequestError(f"messages[{index}] has role {role!r}.", fix=f"use one of {sorted(ROLES)}.")
    out = dict(message)
    out["content"] = _content_text(message.get("content"), index, role, handler)
    if message.get("tool_calls"):
        out["tool_calls"] = [_normalize_tool_call(c, index) for c in message["tool_calls"]]
    return out


def _content_text(content: Any, index: int, role: str, handler: ContentPartHandler | None) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""  # an assistant turn may carry only tool calls (or be a prefill)
        raise InvalidRequestError(f"messages[{index}] ({role}) has no content.", fix="give it a content string.")
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        return "\n".join(_part_text(part, index, handler) for part in content)
    raise InvalidRequestError(f"messages[{index}].content is a {type(content).__name__}.",
                              fix="give content as a string or a list of content parts.")


def _part_text(part: Any, index: int, handler: ContentPartHandler | None) -> str:
    if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
        raise InvalidRequestError(f"messages[{index}].content has a part without a type.",
                                  fix='give each part as {"type": "text", "text": ...}.')
    if part["type"] == "text":
        if not isinstance(part.get("text"), str):
            raise InvalidRequestError(f"messages[{index}].content has a text part without a text string.",
                                      fix='give text parts as {"type": "text", "text": "..."}.')
        return part["text"]
    if handler is None:
        raise InvalidRequestError(f"messages[{index}].content has a {part['type']!r} part; this model takes text only.",
                                  fix="send text parts only, or serve a multimodal model.")
    return handler(part, index)


def _normalize_tool_call(call: Any, index: int) -> Any:
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise InvalidRequestError(f"messages[{index}] has a tool call whose arguments are not valid JSON.",
                                      fix="send function.arguments as a JSON object string.") from None
    return {**call, "function": {**function, "arguments": arguments}}


def _check_dicts(items: Any, what: str) -> list[dict[str, Any]] | None:
    if items is None:
        return None
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not all(
            isinstance(i, Mapping) for i in items):
        raise InvalidRequestError(f"{what} must be a list of objects.", fix=f"send {what} as a JSON list of objects.")
    return [dict(i) for i in items]


# ---------------------------------------------------------------------------------------------------
# rendering
# ---------------------------------------------------------------------------------------------------


class _TemplateRaised(Exception):
    """What ``raise_exception(...)`` in a template raises: the template's own verdict on the input."""


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment, except that touching an unsafe attribute fails loudly.

    The stock sandbox renders ``{{ ''.__class__ }}`` as an empty string and fails only one step
    later; a template that probes Python internals is never legitimate, so stop it at once.
    """

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe.")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (transformers' assistant-mask marker) renders its body."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    """transformers' ``tojson``: no HTML escaping and key order kept, unlike Jinja's built-in."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once per distinct source."""
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno}).",
                                  fix="fix the template or pass a working one (--chat-template).") from None


def render_template(source: str, context: Mapping[str, Any]) -> str:
    """Render a chat template; every failure becomes a InvalidRequestError that says whose fault it is."""
    template = compile_template(source)
    try:
        return template.render(**context)
    except _TemplateRaised as exc:
        raise InvalidRequestError(f"the model's chat template rejected the conversation: {exc}",
                                  fix="change the messages to what this model accepts "
                                      "(e.g. alternate user and assistant turns).") from None
    except SecurityError as exc:
        raise InvalidRequestError(f"the chat template tried an operation the sandbox forbids: {exc}",
                                  fix="use a template that does not reach into Python internals.") from None
    except Exception as exc:  # a template is code: any error in it is about this template and input
        raise InvalidRequestError(f"rendering the chat template failed: {type(exc).__name__}: {exc}",
                                  fix="check that the messages have the fields this model's template "
                                      "expects, or pass a working template (--chat-template).") from exc


# ---------------------------------------------------------------------------------------------------
# loading helpers
# ---------------------------------------------------------------------------------------------------


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        raise ModelLoadError(f"{path} is not valid JSON: {exc}.", fix="re-download the model's files.") from None
    return data if isinstance(data, dict) else {}


def _token_text(token: Any) -> str | None:
    """A special token as tokenizer_config gives it: a string or an AddedToken dict."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else None


def _load_chat_templates(model_dir: Path, config: Mapping[str, Any]) -> dict[str, str]:
    """Named templates; ``chat_template.jinja`` wins over tokenizer_config, as in transformers."""
    templates: dict[str, str] = {}
    raw = config.get("chat_template")
    if isinstance(raw, str):
        templates["default"] = raw
    elif isinstance(raw, list):
        templates |= {t["name"]: t["template"] for t in raw if isinstance(t, Mapping) and "name" in t}
    processor = _read_json(model_dir / "chat_template.json").get("chat_template")
    if isinstance(processor, str):
        templates["default"] = processor
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates["default"] = jinja_file.read_text(encoding="utf-8")
    extra = model_dir / "additional_chat_templates"
    if extra.is_dir():
        templates |= {p.stem: p.read_text(encoding="utf-8") for p in sorted(extra.glob("*.jinja"))}
    return templates


def _eos_ids(backend: HFTokenizer, eos_token: str | None, generation_config: Mapping[str, Any]) -> tuple[int, ...]:
    ids = [backend.token_to_id(eos_token)] if eos_token is not None else []
    extra = generation_config.get("eos_token_id")
    ids += extra if isinstance(extra, list) else [extra]
    return tuple(dict.fromkeys(i for i in ids if isinstance(i, int)))


def _special_ids(backend: HFTokenizer, config: Mapping[str, Any], specials: Mapping[str, str]) -> frozenset[int]:
    ids = {i for i, tok in backend.get_added_tokens_decoder().items() if tok.special}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if isinstance(entry, Mapping) and entry.get("special") and str(key).isdigit():
            ids.add(int(key))
    names = [*specials.values(), *map(_token_text, config.get("additional_special_tokens") or [])]
    ids |= {i for n in names if n is not None and (i := backend.token_to_id(n)) is not None}
    return frozenset(ids)
