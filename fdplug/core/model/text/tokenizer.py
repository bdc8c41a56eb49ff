"""Tokenizer: a Hugging Face ``tokenizer.json`` plus the model's chat template.

Why not transformers: the server needs encode/decode and the chat template, nothing else, and
``tokenizers`` (Rust) + ``jinja2`` are light. The behaviour follows transformers where a model
relies on it: where the chat template comes from (``chat_template.jinja`` first), the variables a
template sees, and which ids end generation (the tokenizer's EOS and every ``eos_token_id`` of
``generation_config.json``). Templates render in ``chat_template.py``'s sandbox, on a work budget.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from fdplug.core.model.text.chat_messages import (
    ContentPartHandler,
    check_dicts,
    normalize_messages,
    open_final_message,
)
from fdplug.core.model.text.chat_template import render_template
from fdplug.core.model.text.content_format import template_traits
from fdplug.core.model.text.gguf_tokenizer import tokenizer_from_gguf
from fdplug.core.model.text.token_bytes import TokenBytes
from fdplug.errors import InvalidRequestError, ModelLoadError

_SPECIAL_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


@dataclass(slots=True)
class Tokenizer:
    """A model's tokenizer: ids <-> text, special and end-of-sequence ids, chat templates."""

    backend: HFTokenizer = field(repr=False)
    chat_templates: dict[str, str] = field(repr=False)  # name -> Jinja source; a lone one is "default"
    special_tokens: dict[str, str]  # bos_token/eos_token/pad_token/unk_token -> text, when set
    eos_token_ids: tuple[int, ...]  # every id that ends generation, the tokenizer's EOS first
    special_token_ids: frozenset[int]
    add_bos_token: bool | None = None  # None: as tokenizer.json's post-processor does
    _max_token_chars: int | None = field(default=None, init=False, repr=False)
    _token_bytes: TokenBytes | None = field(default=None, init=False, repr=False)

    # ------------------------------------------------------------------------------------------------
    # loading
    # ------------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load from a Hugging Face model directory (``tokenizer.json`` is required), or from the
        metadata of a GGUF file (`gguf_file.gguf_path`: a ``.gguf`` or a directory holding one)."""
        from fdplug.core.model.checkpoint.gguf_file import gguf_path, open_gguf

        if (gguf := gguf_path(model_dir)) is not None:
            return cls.from_gguf_metadata(open_gguf(gguf).metadata)
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

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Load from a GGUF file's metadata (``{key: field.contents()}`` of ``gguf.GGUFReader``): the
        file has no tokenizer.json, so ``gguf_tokenizer`` rebuilds one from the vocabulary it stores.
        ``tokenizer.chat_template`` is the "default" template, ``tokenizer.chat_template.NAME`` NAME."""
        gguf = tokenizer_from_gguf(metadata)
        templates = dict(gguf.chat_templates)
        if gguf.chat_template is not None:
            templates["default"] = gguf.chat_template
        return cls(
            backend=gguf.backend,
            chat_templates=templates,
            special_tokens=gguf.special_tokens,
            eos_token_ids=gguf.eos_token_ids,
            special_token_ids=gguf.special_token_ids,
            add_bos_token=gguf.add_bos_token,
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

    def token_bytes(self, token_id: int) -> bytes:
        """The token's own bytes (logprobs' ``bytes``): part of a character where it splits one."""
        if self._token_bytes is None:
            self._token_bytes = TokenBytes(self.backend)
        return self._token_bytes(token_id)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. Special-token text in ``text`` (``<|im_start|>``) becomes its id.

        Encode a rendered chat template with ``add_special_tokens=False``: the template already
        wrote the BOS it wants, and adding another one changes what the model sees.
        """
        # encode_batch releases the GIL (encode holds it for the whole call: the API process's event
        # loop stood still for the seconds a megabyte prompt takes)
        encoding = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0]
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

    @property
    def max_token_chars(self) -> int:
        """The most characters one token can stand for: a text of n characters has at least
        n / max_token_chars tokens, so a text too long for any context is refused untokenized."""
        if self._max_token_chars is None:
            self._max_token_chars = max((len(t) for t in self.backend.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

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
                            content_part_handler: ContentPartHandler | None = None,
                            variables: Mapping[str, Any] | None = None, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """The prompt text for a conversation, rendered by the model's chat template in a sandbox.

        ``chat_template`` is a template name (``"tool_use"``) or a template's source; ``variables``
        (a request's ``chat_template_kwargs``, checked by ``check_template_kwargs``: a dict, so no
        name of it can collide with an argument of this method) and ``kwargs`` become template
        variables (e.g. ``enable_thinking``). Raises ``InvalidRequestError`` for a malformed
        conversation, a model without a template, or a template that fails, raises or goes over its
        work budget. ``continue_final_message`` leaves the last message open (transformers' and vLLM's
        option): the prompt ends right after its text, so the model goes on writing it.
        """
        if continue_final_message and add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt are both true.",
                                      fix="set add_generation_prompt: false to continue the last message.",
                                      param="continue_final_message")
        source = self._select_template(chat_template, tools)
        traits = template_traits(source)
        messages = normalize_messages(messages, content_part_handler, traits.reads_content_parts)
        if not traits.names_developer_role:   # OpenAI's newer name of the system role, for templates before it
            messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
        context = {
            **self.special_tokens,
            **(variables or {}),
            **kwargs,
            "messages": messages,
            "tools": check_dicts(tools, "tools"),
            "documents": check_dicts(documents, "documents"),
            "add_generation_prompt": add_generation_prompt,
        }
        prompt = render_template(source, context)
        if not continue_final_message:
            return prompt
        return open_final_message(prompt, messages,
                                  lambda marked: render_template(source, {**context, "messages": marked}))

    def is_named_template(self, chat_template: str) -> bool:
        """Whether ``chat_template`` names one of the model's own templates (not a template's source)."""
        return chat_template in self.chat_templates

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
