"""A JSON schema's mistakes, named by their path (``/properties/age/type``), before it is compiled.

The grammar compiler says what is wrong but not where; this walk catches the common mistakes of a
hand-written schema (a misspelt type, ``properties`` or ``required`` of the wrong shape, a
non-local ``$ref``) and names the JSON pointer of the first, so a 400 points at the line to fix.
"""

from __future__ import annotations

from typing import Any

from fdplug.errors import InvalidRequestError

TYPES = frozenset({"object", "array", "string", "integer", "number", "boolean", "null"})
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMAS = ("items", "additionalProperties", "not", "contains", "if", "then", "else")
MAX_DEPTH = 64


def check_schema(schema: Any, path: str = "", depth: int = 0) -> None:
    """Raise InvalidRequestError (param ``structured_outputs``) naming the first mistake's path."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        _bad(path, f"is {type(schema).__name__}, not a schema object")
    if depth > MAX_DEPTH:
        _bad(path, f"nests deeper than {MAX_DEPTH} levels")
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    for k in kinds:
        if k not in TYPES:
            _bad(f"{path}/type", f"is {k!r}, not one of {', '.join(sorted(TYPES))}")
    if "required" in schema and not (isinstance(schema["required"], list)
                                     and all(isinstance(r, str) for r in schema["required"])):
        _bad(f"{path}/required", "must be a list of property names")
    if "enum" in schema and not isinstance(schema["enum"], list):
        _bad(f"{path}/enum", "must be a list")
    ref = schema.get("$ref")
    if ref is not None and not (isinstance(ref, str) and ref.startswith("#")):
        _bad(f"{path}/$ref", "must point inside the schema (#/...)")
    for key in _SUBSCHEMA_MAPS:
        if key in schema:
            if not isinstance(schema[key], dict):
                _bad(f"{path}/{key}", "must be an object of schemas")
            for name, sub in schema[key].items():
                check_schema(sub, f"{path}/{key}/{name}", depth + 1)
    for key in _SUBSCHEMA_LISTS:
        if key in schema:
            if not isinstance(schema[key], list):
                _bad(f"{path}/{key}", "must be a list of schemas")
            for i, sub in enumerate(schema[key]):
                check_schema(sub, f"{path}/{key}/{i}", depth + 1)
    for key in _SUBSCHEMAS:
        if key in schema:
            check_schema(schema[key], f"{path}/{key}", depth + 1)


def _bad(path: str, why: str) -> None:
    raise InvalidRequestError(f"the JSON schema at {path or '/'} {why}.",
                              fix="correct the schema there (JSON Schema: json-schema.org).",
                              param="structured_outputs")
