"""Chat messages as HF templates expect them: OpenAI-style messages checked and normalized, tool
calls parsed, and the template variables a request may set.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from fdplug.errors import InvalidRequestError, show_value

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

ContentPartHandler = Callable[[Mapping[str, Any], int], str]
"""Turns one non-text content part of message ``index`` into the prompt text that stands for it.

The extension point for multimodal input: a handler records the item (an image, a feature URL) on
the side and returns its placeholder (e.g. ``<|vision_start|><|image_pad|><|vision_end|>``). It
raises an ``FdplugError`` to reject the part. Without a handler, non-text parts are rejected.
"""


TEMPLATE_ARGUMENTS = frozenset({"messages", "add_generation_prompt", "tools", "documents", "chat_template",
                                "content_part_handler"})
"""``apply_chat_template``'s own arguments and the variables it sets: not template kwargs."""


def check_template_kwargs(kwargs: Mapping[str, Any] | None, param: str = "chat_template_kwargs") -> dict[str, Any]:
    """Extra template variables from a request, refusing the names ``apply_chat_template`` sets itself
    (a collision was a TypeError, a 500, and would let a kwarg override the conversation)."""
    kwargs = dict(kwargs or {})
    for name in kwargs:
        if name in TEMPLATE_ARGUMENTS:
            raise InvalidRequestError(f"{param} may not set {name!r}: it is an argument of its own.",
                                      fix=f"send {name} as a request field (where the API has one), not in {param}.",
                                      param=f"{param}.{name}")
        if name.startswith("_"):    # the renderer's own globals (and Python's) start with underscores
            raise InvalidRequestError(f"{param} may not set {name!r}: names starting with '_' are reserved.",
                                      fix="name template variables without a leading underscore.",
                                      param=f"{param}.{name}")
    return kwargs


def normalize_messages(messages: Sequence[Mapping[str, Any]], content_part_handler: ContentPartHandler | None = None,
                       content_parts: bool = False) -> list[dict[str, Any]]:
    """Validated copies of OpenAI-style messages in the shape HF templates expect.

    A list of content parts becomes a string (text parts joined by newlines, other parts through the
    handler), or with ``content_parts`` (a template that renders the parts itself: content_format.py)
    stays a list of ``{"type": "text", "text"}`` and ``{"type": "image"|"video"}`` parts, each item
    still recorded by the handler. A tool call's JSON ``arguments`` string becomes a dict, since
    templates render it with ``tojson``.
    """
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of {role, content} objects.",
                                  fix='send e.g. [{"role": "user", "content": "Hello"}].', param="messages")
    return [_normalize_message(m, i, content_part_handler, content_parts) for i, m in enumerate(messages)]


def _normalize_message(message: Any, index: int, handler: ContentPartHandler | None,
                       as_parts: bool) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"messages[{index}] is a {type(message).__name__}, not an object.",
                                  fix='give each message as {"role": ..., "content": ...}.')
    role = message.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise InvalidRequestError(f"messages[{index}] has role {show_value(role)}.", fix=f"use one of {sorted(ROLES)}.",
                                  param=f"messages.{index}.role")
    out = dict(message)
    out["content"] = _content(message.get("content"), index, role, handler, as_parts)
    if message.get("tool_calls") is not None:
        out["tool_calls"] = _normalize_tool_calls(message["tool_calls"], f"messages.{index}.tool_calls")
    return out


def _content(content: Any, index: int, role: str, handler: ContentPartHandler | None,
             as_parts: bool) -> str | list[dict[str, str]]:
    if isinstance(content, str):
        return content
    if content is None:
        if role == "assistant":
            return ""  # an assistant turn may carry only tool calls (or be a prefill)
        raise InvalidRequestError(f"messages[{index}] ({role}) has no content.", fix="give it a content string.",
                                  param=f"messages.{index}.content")
    if isinstance(content, Sequence) and not isinstance(content, (str, bytes)):
        if as_parts:
            return [_template_part(part, index, handler) for part in content]
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


def _template_part(part: Any, index: int, handler: ContentPartHandler | None) -> dict[str, str]:
    """A part as a parts-reading template gets it: its text, or its item's modality (the handler
    records the item; the template writes its placeholder)."""
    text = _part_text(part, index, handler)
    if part["type"] == "text":
        return {"type": "text", "text": text}
    return {"type": "video" if part["type"].startswith("video") else "image"}


FINAL_MARKER = "\ue000fdplug-final\ue001"   # private-use characters: no template gives them a meaning


def open_final_message(prompt: str, messages: Sequence[Mapping[str, Any]],
                       render: Callable[[list[dict[str, Any]]], str]) -> str:
    """The rendered ``prompt`` cut right after the last message's text (``continue_final_message``:
    the model goes on writing that message, no end-of-turn after it). Where that text starts is found
    by rendering the conversation again with FINAL_MARKER as the text (``render``): a short text
    ("end") could otherwise be found inside the template's own closing tokens. A template that moves
    the text (the marker's render differs before it) falls back to its last occurrence, as
    transformers finds it."""
    last = messages[-1]
    content, parts = last["content"], None
    if not isinstance(content, str):    # a parts-reading template's list: its last text part
        parts = [i for i, p in enumerate(content) if p.get("type") == "text"]
        content = content[parts[-1]]["text"] if parts else ""
    if content:
        marked = [*last["content"]] if parts else FINAL_MARKER
        if parts:
            marked[parts[-1]] = {"type": "text", "text": FINAL_MARKER}
        rendered = render([*messages[:-1], {**last, "content": marked}])
        at = rendered.find(FINAL_MARKER)
        for final in (content, content.strip()):
            if at >= 0 and rendered[:at] == prompt[:at] and final and prompt.startswith(final, at):
                return prompt[:at + len(final)]
    for final in (content, content.strip()):
        if final and (at := prompt.rfind(final)) >= 0:
            return prompt[:at + len(final)]
    raise InvalidRequestError("continue_final_message is set, but the last message's text is not in the prompt the "
                              "chat template made (the template rewrites or drops it).",
                              fix="give the last message a text the template keeps, or leave continue_final_message "
                                  "out.", param="continue_final_message")


_TOOL_CALL_SHAPE = '{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{\\"a\\": 1}"}}'


def _normalize_tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """OpenAI tool calls, checked; a call's JSON ``arguments`` string becomes a dict, since templates
    render it with ``tojson``."""
    if isinstance(calls, (str, bytes, Mapping)) or not isinstance(calls, Sequence):
        raise InvalidRequestError(f"{where} must be a list of tool calls, got {show_value(calls)}.",
                                  fix=f"send a list of {_TOOL_CALL_SHAPE}.", param=where)
    return [_normalize_tool_call(call, f"{where}.{j}") for j, call in enumerate(calls)]


def _normalize_tool_call(call: Any, where: str) -> dict[str, Any]:
    def refuse(field: str, what: str) -> InvalidRequestError:
        return InvalidRequestError(f"{where}{field} {what}.", fix=f"send each tool call as {_TOOL_CALL_SHAPE}.",
                                   param=where + field)

    if not isinstance(call, Mapping):
        raise refuse("", f"must be an object, got {show_value(call)}")
    for key in ("id", "type"):
        if key in call and not isinstance(call[key], str):
            raise refuse(f".{key}", "must be a string")
    function = call.get("function")
    if not isinstance(function, Mapping):
        raise refuse(".function", "must be an object with a name and arguments")
    if not isinstance(function.get("name"), str):
        raise refuse(".function.name", "must be a string")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except (ValueError, RecursionError):
            raise refuse(".function.arguments", "is not valid JSON") from None
    if not isinstance(arguments, Mapping):
        raise refuse(".function.arguments", "must be a JSON object (or its text)")
    return {**call, "function": {**function, "arguments": arguments}}


def check_dicts(items: Any, what: str) -> list[dict[str, Any]] | None:
    if items is None:
        return None
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence) or not all(
            isinstance(i, Mapping) for i in items):
        raise InvalidRequestError(f"{what} must be a list of objects.", fix=f"send {what} as a JSON list of objects.")
    return [dict(i) for i in items]
