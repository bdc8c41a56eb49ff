"""``tool_choice: "required"`` or a named function: the answer is held to a JSON schema of the calls
(structured outputs), so every call is valid, and read back as calls.

A named function's schema is its ``parameters`` (the answer is the arguments, streamed as they are
generated); ``required`` is a list of one or more ``{"name", "parameters"}`` of the offered tools
(read whole at the end). An answer cut off by ``max_tokens`` is returned as it is.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from fdplug.core.parsers.tool_calls import CallCollector, call_id, call_of
from fdplug.plugin_api.parsers import ToolCallDelta, ToolDelta


def forced_schema(tools: list[Mapping[str, Any]], name: str | None, one_call: bool = False) -> dict:
    """The constraint of a forced choice: a named function's arguments, or (``required``) a list
    of one or more calls ``[{"name": ..., "parameters": {...}}]`` of the offered tools (exactly one
    with ``one_call``: ``parallel_tool_calls`` false).

    For ``required`` each tool's ``parameters`` moves under the root's ``$defs`` and its local
    references (``#/$defs/X``, as Pydantic writes them) are rewritten to follow it there."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"} for t in tools}
    if name is not None:
        return params[name]
    defs = {f"tool{i}": _rebased(schema, f"#/$defs/tool{i}") for i, schema in enumerate(params.values())}
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "parameters"],
              "properties": {"name": {"const": n}, "parameters": {"$ref": f"#/$defs/tool{i}"}}}
             for i, n in enumerate(params)]
    return {"$defs": defs, "type": "array", "minItems": 1, **({"maxItems": 1} if one_call else {}),
            "items": {"anyOf": calls}}


def _rebased(schema: Any, base: str) -> Any:
    """``schema`` with every local ``$ref`` (``#...``) made relative to ``base`` instead of the root."""
    if isinstance(schema, dict):
        return {k: (base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base))
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [_rebased(v, base) for v in schema]
    return schema


class NamedCallParser:
    """A named ``tool_choice``: the whole answer is the function's arguments, streamed as they come."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.started = False

    def feed(self, text: str) -> ToolDelta:
        if not text:
            return ToolDelta()
        call = ToolCallDelta(0, arguments=text)
        if not self.started:
            call.id, call.name, self.started = call_id(), self.name, True
        return ToolDelta(calls=[call])

    def end(self) -> ToolDelta:
        return ToolDelta() if self.started else ToolDelta(calls=[ToolCallDelta(0, call_id(), self.name, "{}")])


class RequiredCallsParser:
    """``tool_choice: "required"``: the answer is a JSON list of calls, read whole at its end."""

    def __init__(self) -> None:
        self.calls = CallCollector()
        self.buffer = ""

    def feed(self, text: str) -> ToolDelta:
        self.buffer += text
        return ToolDelta()

    def end(self) -> ToolDelta:
        out = ToolDelta()
        try:
            listed = json.loads(self.buffer)
        except (ValueError, RecursionError):
            listed = None
        parsed = [call_of(item, "parameters") for item in listed] if isinstance(listed, list) else [None]
        if not parsed or None in parsed:
            self.calls.text(out, self.buffer)     # cut off by max_tokens: the text as it is
        else:
            for name, arguments in parsed:
                self.calls.call(out, name, arguments)
        return out
