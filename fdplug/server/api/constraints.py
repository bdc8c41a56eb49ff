"""A request's output constraint, from whichever field names it: OpenAI's ``response_format``
(``json_object``, ``json_schema``), vLLM's ``structured_outputs`` (``json``, ``regex``, ``choice``,
``grammar``) or its older ``guided_*`` fields; at most one. The engine compiles it (a 400 if it
does not compile) and holds the output to it (`fdplug.core.structured`).
"""

from __future__ import annotations

import json
from typing import Any

from fdplug.errors import InvalidRequestError


def structured_outputs(req: Any) -> dict[str, Any] | None:
    """The request's ``SamplingParams.structured_outputs`` value; None for free text."""
    found: list[tuple[str, dict[str, Any]]] = []
    if req.structured_outputs is not None:
        found.append(("structured_outputs", req.structured_outputs))
    for kind in ("json", "regex", "choice", "grammar"):
        value = getattr(req, f"guided_{kind}")
        if value is not None:
            found.append((f"guided_{kind}", {kind: _schema(value) if kind == "json" else value}))
    response_format = getattr(req, "response_format", None)
    if response_format and response_format.get("type", "text") != "text":
        found.append(("response_format", _from_response_format(response_format)))
    if len(found) > 1:
        raise InvalidRequestError(f"{' and '.join(name for name, _ in found)} both constrain the output.",
                                  fix="send one of them.", param=found[1][0])
    return found[0][1] if found else None


def _schema(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise InvalidRequestError(f"guided_json is a string that is not JSON ({exc}).",
                                  fix="send the JSON schema as an object.", param="guided_json") from None


def _from_response_format(response_format: dict[str, Any]) -> dict[str, Any]:
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    spec = response_format.get("json_schema") if kind == "json_schema" else None
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise InvalidRequestError(
            f"response_format {kind!r:.40} is not text, json_object, or json_schema with a schema object.",
            fix='send {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}} '
                'or {"type": "json_object"}.', param="response_format")
    return {"json": schema}
