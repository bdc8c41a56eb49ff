"""Rendering chat templates: transformers' Jinja environment, sandboxed and on a budget.

The environment is transformers' (``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``tojson``, ``strftime_now``, the ``{% generation %}`` tag), in Jinja's immutable sandbox, which
keeps a template away from Python internals. The sandbox does not bound work: a template is code,
and two nested ``range(100000)`` loops, ``'x' * 10**10`` or a string doubled in a loop would freeze
or exhaust the API process. So every render runs on a ``RenderBudget`` (``template_budget``):

- every loop iteration, call (function, method, macro, filter) and attribute or item lookup costs
  one operation;
- every string or list a call, filter, operator or ``~`` builds costs its length, and no single
  one may be built larger than ``MAX_VALUE`` (checked *before* building where the size is known
  from the arguments: ``*``, ``**``, widths such as ``center(n)``, ``ljust(n)``, ``%10000d``,
  ``replace``, ``join``);
- the output may not exceed ``MAX_VALUE`` characters, and a render may not run past ``TIMEOUT_S``.

Over budget, the render stops with a 400 that names the limit. The model's own template with
client data stays far inside it (work linear in the conversation); a client-supplied template is
refused unless the server was started with ``--trust-request-chat-template`` (as vLLM does since
CVE-2025-61620), and then runs on the same budget.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.runtime import LoopContext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from fdplug.core.model.text.template_budget import (
    MAX_ITEMS,
    MAX_VALUE,
    SIZE_CHECKS,
    SIZED,
    RenderBudget,
    TemplateBudgetExceeded,
    brace_format_size,
    budget_var,
    check_printable,
    check_width,
    current,
    join_size,
    lenient,
    percent_format_size,
    power_size,
    product_size,
)
from fdplug.errors import InvalidRequestError

# ---------------------------------------------------------------------------------------------------
# the environment
# ---------------------------------------------------------------------------------------------------


class _TemplateRaised(Exception):
    """What ``raise_exception(...)`` in a template raises: the template's own verdict on the input."""


def _meter_iter(iterable: Any) -> Any:
    """A loop's iterable, charging one operation per iteration."""
    budget = current()
    for item in iterable:
        budget.charge()
        yield item


def _meter_concat(*pieces: Any) -> str:
    """``a ~ b ~ c``, sized before it is built."""
    items = join_size(pieces)
    return current().built_value(jinja2.runtime.str_join(items))


def _metered_join(pieces: Any) -> str:
    """What Jinja joins a block's output with (macro and call bodies, ``{% set %}`` blocks, filter
    blocks): sized before it is joined."""
    return current().built_value("".join(join_size(pieces)))


def _finalize(value: Any) -> Any:
    """Every ``{{ value }}`` before it is printed: a container must print within the budget."""
    check_printable(value)
    return value


class _Meter(NodeTransformer):
    """Rewrites a parsed template so loops and ``~`` go through the budget."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name("__fdplug_iter", "load"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return nodes.Call(nodes.Name("__fdplug_concat", "load"), list(node.nodes), [], None, None)


def _metered_filter(name: str, filter_: Callable) -> Callable:
    """A filter that costs one operation plus what it builds, its sizes checked first where known."""
    check = SIZE_CHECKS.get(name)
    at = 1 if getattr(filter_, "jinja_pass_arg", None) is not None else 0   # where the filtered value is

    @functools.wraps(filter_)
    def metered(*args: Any, **kwargs: Any) -> Any:
        budget = current()
        budget.charge()
        if name == "join" and len(args) > at:
            separator = args[at + 1] if len(args) > at + 1 else kwargs.get("d", "")
            args = (*args[:at], join_size(args[at], separator if isinstance(separator, str) else ""),
                    *args[at + 1:])
        else:
            if len(args) > at:
                check_printable(args[at])     # most filters start with str(value)
            if check is not None:
                lenient(check, args[at:], kwargs)
        return budget.built_value(filter_(*args, **kwargs))

    return metered


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment in Jinja's immutable sandbox, with every call and operator metered.

    Touching an unsafe attribute fails loudly: the stock sandbox renders ``{{ ''.__class__ }}`` as
    an empty string and fails only one step later; a template that probes Python internals is
    never legitimate, so stop it at once.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})
    concat = staticmethod(_metered_join)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe.")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = current()
        budget.charge()
        name = getattr(__obj, "__name__", None)
        if isinstance(__obj, LoopContext) and args:   # a recursive loop's next level: metered like the first
            args = (_meter_iter(args[0]), *args[1:])
        elif isinstance(getattr(__obj, "__self__", None), str):
            if name in SIZE_CHECKS:
                lenient(SIZE_CHECKS[name], (__obj.__self__, *args), kwargs)
            elif name == "join" and args:
                args = (join_size(args[0], __obj.__self__), *args[1:])
        return budget.built_value(super().call(__context, __obj, *args, **kwargs))

    def getattr(self, obj: Any, attribute: str) -> Any:
        current().charge()
        return super().getattr(obj, attribute)

    def getitem(self, obj: Any, argument: Any) -> Any:
        current().charge()
        return super().getitem(obj, argument)

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "*":
            product_size(left, right)
        elif operator_ == "**":
            power_size(left, right)
        elif operator_ == "%" and isinstance(left, str):
            percent_format_size(left, right)
        elif operator_ == "+" and isinstance(left, SIZED) and isinstance(right, SIZED):
            if len(left) + len(right) > (MAX_VALUE if isinstance(left, (str, bytes, bytearray)) else MAX_ITEMS):
                raise TemplateBudgetExceeded(f"a value of {len(left) + len(right)} characters or items")
        return current().built_value(super().call_binop(context, operator_, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt, is_format_map = value.__self__, value.__name__ == "format_map"

        @functools.wraps(wrapped)
        def metered(*args: Any, **kwargs: Any) -> str:
            if is_format_map and len(args) == 1 and isinstance(args[0], dict):
                brace_format_size(fmt, (), args[0])
            else:
                brace_format_size(fmt, args, kwargs)
            return current().built_value(wrapped(*args, **kwargs))
        return metered


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
    """transformers' ``tojson``: no HTML escaping and key order kept, unlike Jinja's built-in. Encoded
    in pieces, so a value whose JSON would be too large stops at the limit instead of being built."""
    check_width(indent, "an indent")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(value):
        size += len(piece)
        if size > MAX_VALUE:
            raise TemplateBudgetExceeded(f"a JSON text of more than {MAX_VALUE} characters")
        pieces.append(piece)
    return "".join(pieces)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols],
                   finalize=_finalize)
    env.filters["tojson"] = _tojson
    env.filters = {name: _metered_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["__fdplug_iter"] = _meter_iter
    env.globals["__fdplug_concat"] = _meter_concat
    return env


_ENV = _environment()
parse_template = _ENV.parse   # the syntax tree of a source (content_format reads it); raises TemplateSyntaxError


CACHED_SOURCE_CHARS = 256 << 10   # a model's template is a few KB; a larger one is compiled each time


def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template, its loops and ``~`` metered; sources up to CACHED_SOURCE_CHARS once."""
    return _compile_cached(source) if len(source) <= CACHED_SOURCE_CHARS else _compile(source)


def _compile(source: str) -> jinja2.Template:
    try:
        tree = _Meter().visit(_ENV.parse(source))
        return _ENV.template_class.from_code(_ENV, _ENV.compile(tree), _ENV.make_globals(None), None)
    except TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno}).",
                                  fix="fix the template or pass a working one.", param="chat_template") from None
    except (RecursionError, MemoryError) as exc:   # nested too deeply for the parser
        raise InvalidRequestError(f"the chat template could not be compiled ({type(exc).__name__}).",
                                  fix="use a template with less deeply nested blocks and expressions.",
                                  param="chat_template") from None


_compile_cached = lru_cache(maxsize=32)(_compile)


def render_template(source: str, context: Mapping[str, Any]) -> str:
    """Render a chat template on a fresh budget; every failure becomes an InvalidRequestError that
    says whose fault it is."""
    template = compile_template(source)
    token = budget_var.set(RenderBudget.fresh())
    try:
        pieces, size = [], 0
        for piece in template.generate(dict(context)):   # a dict: a variable named 'self' is fine
            size += len(piece)
            if size > MAX_VALUE:
                raise TemplateBudgetExceeded(f"more than {MAX_VALUE} characters of output")
            pieces.append(piece)
        return "".join(pieces)
    except _TemplateRaised as exc:
        raise InvalidRequestError(f"the model's chat template rejected the conversation: {exc}",
                                  fix="change the messages to what this model accepts "
                                      "(e.g. alternate user and assistant turns).") from None
    except TemplateBudgetExceeded as exc:
        raise InvalidRequestError(f"rendering the chat template went over its work budget: {exc}.",
                                  fix="send a shorter conversation, or use a template that does less work.",
                                  param="messages") from None
    except SecurityError as exc:
        raise InvalidRequestError(f"the chat template tried an operation the sandbox forbids: {exc}",
                                  fix="use a template that does not reach into Python internals.") from None
    except (MemoryError, RecursionError) as exc:
        raise InvalidRequestError(f"rendering the chat template failed: {type(exc).__name__}.",
                                  fix="send a smaller conversation, or use a template that does less work.") from None
    except Exception as exc:  # a template is code: any error in it is about this template and input
        raise InvalidRequestError(f"rendering the chat template failed: {type(exc).__name__}: {exc}",
                                  fix="check that the messages have the fields this model's template "
                                      "expects, or pass a working template.") from exc
    finally:
        budget_var.reset(token)
