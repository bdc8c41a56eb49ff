"""A chat's ``tools`` and ``tool_choice`` (the server's requests and `LLM.chat` alike): the tools
checked, and a forced choice made a constraint.

``tool_choice`` ``"required"`` or a named function holds the answer to a JSON schema of the calls
(`fdplug.core.parsers.forced_calls`), so every call is valid, and reads it back as calls;
``parallel_tool_calls: false`` makes it exactly one.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from fdplug.core.parsers.chat_output import ChoiceParser
from fdplug.core.parsers.forced_calls import NamedCallParser, RequiredCallsParser, forced_schema
from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.sampling_params import SamplingParams

_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def check_tool_list(tools: list) -> None:
    """OpenAI's ``tools``: function definitions with a name and an optional JSON-schema ``parameters``."""
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequestError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}.",
                                      fix="describe each tool as an OpenAI function tool.", param=where)
        name = function.get("name")
        if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
            raise InvalidRequestError(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'.",
                                      fix="name the function, e.g. get_weather.", param=f"{where}.function.name")
        if not isinstance(function.get("parameters", {}), dict):
            raise InvalidRequestError(f"{where}.function.parameters must be a JSON schema object.",
                                      fix='give e.g. {"type": "object", "properties": {...}}.',
                                      param=f"{where}.function.parameters")


def forced_choice(choice: Any, tools: list[dict] | None) -> str | None:
    """``"required"``, the name a ``tool_choice`` object forces (one of the tools), or None."""
    if choice is None or choice in ("none", "auto"):
        return None
    if choice == "required":
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    names = [t["function"]["name"] for t in tools or ()]
    if not isinstance(choice, dict) or choice.get("type", "function") != "function" or name not in names:
        raise InvalidRequestError(f"tool_choice must name one of the tools ({', '.join(names)}), got {choice!r:.80}.",
                                  fix='send {"type": "function", "function": {"name": NAME}} for a tool you sent.',
                                  param="tool_choice")
    return name


def forced_parser(forced: str) -> ChoiceParser:
    """A fresh parser of one choice's forced calls."""
    return ChoiceParser(None, RequiredCallsParser() if forced == "required" else NamedCallParser(forced))


def forced_params(params: SamplingParams, tools: list[dict], forced: str, one_call: bool = False) -> SamplingParams:
    """``params`` held to the forced calls' schema (another constraint on the output is a 400)."""
    if params.structured_outputs is not None:
        raise InvalidRequestError("tool_choice forces a call, and the request also constrains its output "
                                  "(response_format, structured_outputs or guided_*).",
                                  fix="send one of them.", param="tool_choice")
    schema = forced_schema(tools, None if forced == "required" else forced, one_call)
    return dataclasses.replace(params, structured_outputs=("json", json.dumps(schema))).validate()
