"""The built-in tool-call parsers: the formats of the model families fdplug runs.

- ``hermes`` (Qwen2.5, Qwen3, the demo's ChatML template) and ``ernie`` (ERNIE-4.5): each call a
  JSON object ``{"name": ..., "arguments": {...}}`` between ``<tool_call>`` and ``</tool_call>``;
- ``glm45``: ``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs (a
  value is JSON where the tool's schema says the parameter is not a string);
- ``llama3_json``: Llama 3's bare JSON answer ``{"name": ..., "parameters": {...}}`` (several
  separated by ``;``, optionally after ``<|python_tag|>``).

A call is emitted whole, once its closing tag (or the answer's end) shows it complete: its
arguments are one fragment, so streamed and whole answers carry the same calls whatever the token
boundaries. A call that does not parse (bad JSON, no name) is given back as text, never raised;
text around calls is content, and the whitespace between them is dropped.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from fdplug.core.model.text.detokenizer import held_prefix
from fdplug.plugin_api.parsers import ParserContext, ToolCallDelta, ToolDelta, ToolParserSpec

Body = Callable[[str], "tuple[str, str] | None"]    # a call's text -> (name, arguments JSON), or None


def call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def arguments_json(arguments: Any) -> str | None:
    """A call's arguments as the JSON object text the API returns; None if they are not an object."""
    try:
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        return json.dumps(arguments, ensure_ascii=False, allow_nan=False) if isinstance(arguments, dict) else None
    except (ValueError, RecursionError):     # not JSON, NaN (not JSON either), nested past Python's stack
        return None


def json_call(text: str, arguments_key: str = "arguments") -> tuple[str, str] | None:
    """``{"name": ..., "arguments": {...}}`` -> ``(name, arguments JSON)``; None for anything else."""
    try:
        return call_of(json.loads(text), arguments_key)
    except (ValueError, RecursionError):
        return None


def call_of(value: Any, arguments_key: str = "arguments") -> tuple[str, str] | None:
    """A decoded call object -> ``(name, arguments JSON)``; None if it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    other = "parameters" if arguments_key == "arguments" else "arguments"    # models write either
    arguments = arguments_json(value.get(arguments_key, value.get(other, {})))
    return None if arguments is None else (value["name"], arguments)


class CallCollector:
    """Text in, content and whole calls out; whitespace next to a call is held, then dropped."""

    def __init__(self) -> None:
        self.index = 0
        self.space = ""

    def text(self, out: ToolDelta, text: str) -> None:
        text = self.space + text
        kept = text.rstrip()
        self.space = text[len(kept):]
        if kept:
            out.content += kept

    def call(self, out: ToolDelta, name: str, arguments: str) -> None:
        out.calls.append(ToolCallDelta(self.index, call_id(), name, arguments))
        self.index += 1
        self.space = ""


class TaggedParser:
    """Calls between an opening and a closing tag, each body read by ``body``."""

    def __init__(self, body: Body, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> None:
        self.body, self.open_tag, self.close_tag = body, open_tag, close_tag
        self.calls = CallCollector()
        self.buffer = ""
        self.in_call = False

    def feed(self, text: str) -> ToolDelta:
        self.buffer += text
        out = ToolDelta()
        while self._advance(out):
            pass
        return out

    def end(self) -> ToolDelta:
        out = ToolDelta()
        rest, self.buffer = self.buffer, ""
        if self.in_call:      # stopped before the closing tag: a call if its body is whole
            self._call(out, rest, closed=False)
        else:
            self.calls.text(out, rest)
        return out

    def _advance(self, out: ToolDelta) -> bool:
        if not self.in_call:
            i = self.buffer.find(self.open_tag)
            if i < 0:
                keep = held_prefix(self.buffer, (self.open_tag,))
                self.calls.text(out, self.buffer[:len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep:]
                return False
            self.calls.text(out, self.buffer[:i])
            self.buffer, self.in_call = self.buffer[i + len(self.open_tag):], True
            return True
        j = self.buffer.find(self.close_tag)
        if j < 0:
            return False
        body, self.buffer, self.in_call = self.buffer[:j], self.buffer[j + len(self.close_tag):], False
        self._call(out, body, closed=True)
        return True

    def _call(self, out: ToolDelta, body: str, closed: bool) -> None:
        parsed = self.body(body.strip())
        if parsed is None:
            self.calls.text(out, self.open_tag + body + (self.close_tag if closed else ""))
        else:
            self.calls.call(out, *parsed)


class BareJsonParser:
    """Llama 3: an answer that is JSON call(s) from its first character, else plain text."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self.calls = CallCollector()
        self.buffer = ""
        self.mode: str | None = None     # "calls" (held to the end) or "text"

    def feed(self, text: str) -> ToolDelta:
        out = ToolDelta()
        self.buffer += text
        if self.mode is None:
            head = self.buffer.lstrip()
            if not head or (self.PYTHON_TAG.startswith(head) and head != self.PYTHON_TAG):
                return out
            self.mode = "calls" if head.startswith(("{", self.PYTHON_TAG)) else "text"
        if self.mode == "text":
            self.calls.text(out, self.buffer)
            self.buffer = ""
        return out

    def end(self) -> ToolDelta:
        out = ToolDelta()
        rest, self.buffer = self.buffer, ""
        parsed = _json_calls(rest.strip().removeprefix(self.PYTHON_TAG)) if self.mode == "calls" else None
        if parsed is None:
            self.calls.text(out, rest)
        else:
            for name, arguments in parsed:
                self.calls.call(out, name, arguments)
        return out


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    """``{...}; {...}`` -> every call, or None if any part is not one."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and text[i] in " \t\r\n;":
            i += 1
        if i == len(text):
            return calls or None
        try:
            value, i = decoder.raw_decode(text, i)
        except (ValueError, RecursionError):
            return None
        call = call_of(value, "parameters")
        if call is None:
            return None
        calls.append(call)


def glm45_body(tools: Mapping[str, Mapping[str, str]]) -> Body:
    """``NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>...`` -> (name, arguments JSON)."""

    def body(text: str) -> tuple[str, str] | None:
        k = text.find("<arg_key>")
        name, rest = (text, "") if k < 0 else (text[:k], text[k:])
        name = name.strip()
        pairs = _glm45_pairs(rest)
        if not name or "\n" in name or pairs is None:
            return None
        types = tools.get(name, {})
        arguments = {key.strip(): _typed(value, types.get(key.strip())) for key, value in pairs}
        try:
            return name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except ValueError:
            return None
    return body


def _glm45_pairs(text: str) -> list[tuple[str, str]] | None:
    """``<arg_key>K</arg_key><arg_value>V</arg_value>...`` (whitespace between) -> pairs; None if
    anything else is there. One left-to-right scan: linear in the text, whatever the model wrote."""
    pairs, i = [], 0
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i == len(text):
            return pairs
        key, i = _tagged(text, i, "arg_key")
        if key is None:
            return None
        while i < len(text) and text[i].isspace():
            i += 1
        value, i = _tagged(text, i, "arg_value")
        if value is None:
            return None
        pairs.append((key, value))


def _tagged(text: str, i: int, tag: str) -> tuple[str | None, int]:
    """The content of ``<tag>...</tag>`` starting at ``i``, and where it ends; (None, i) if not there."""
    open_tag, close_tag = f"<{tag}>", f"</{tag}>"
    if not text.startswith(open_tag, i):
        return None, i
    end = text.find(close_tag, i + len(open_tag))
    return (None, i) if end < 0 else (text[i + len(open_tag):end], end + len(close_tag))


def _typed(value: str, kind: str | None) -> Any:
    if kind == "string":
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError):
        return value


def parameter_types(context: ParserContext) -> dict[str, dict[str, str]]:
    """tool name -> parameter name -> its JSON schema type (what glm45's string values become)."""
    found: dict[str, dict[str, str]] = {}
    for tool in context.tools:
        function = tool.get("function", {}) if isinstance(tool, Mapping) else {}
        properties = (function.get("parameters") or {}).get("properties") or {}
        if isinstance(function.get("name"), str) and isinstance(properties, Mapping):
            found[function["name"]] = {k: v.get("type") for k, v in properties.items() if isinstance(v, Mapping)}
    return found


def tool_specs() -> list[ToolParserSpec]:
    return [
        ToolParserSpec("hermes", lambda context: TaggedParser(json_call),
                       "Qwen2.5 / Qwen3 / ChatML: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"),
        ToolParserSpec("ernie", lambda context: TaggedParser(json_call),
                       "ERNIE-4.5: <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"),
        ToolParserSpec("glm45", lambda context: TaggedParser(glm45_body(parameter_types(context))),
                       "GLM-4.5: <tool_call>NAME <arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>"),
        ToolParserSpec("llama3_json", lambda context: BareJsonParser(),
                       "Llama 3: the answer is {\"name\": ..., \"parameters\": {...}} (several: '; ')"),
    ]
