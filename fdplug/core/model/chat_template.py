"""Rendering chat templates: transformers' Jinja environment, sandboxed and on a budget.

The environment is transformers' (``trim_blocks``/``lstrip_blocks``, ``raise_exception``,
``tojson``, ``strftime_now``, the ``{% generation %}`` tag), in Jinja's immutable sandbox, which
keeps a template away from Python internals. The sandbox does not bound work: a template is code,
and two nested ``range(100000)`` loops, ``'x' * 10**10`` or a string doubled in a loop would freeze
or exhaust the API process. So every render runs on a ``RenderBudget``:

- every loop iteration and every call (function, method, macro, filter) costs one operation;
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

import contextvars
import functools
import json
import re
import string
import time
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from typing import Any, Callable, Mapping

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.visitor import NodeTransformer

from fdplug.errors import InvalidRequestError

MAX_OPERATIONS = 5_000_000      # loop iterations + calls
MAX_VALUE = 32 << 20            # characters (or items) in any one value, and in the output
MAX_BUILT = 4 * MAX_VALUE       # characters (or items) built in all, over the render
MAX_WIDTH = 1 << 20             # a width, count or padding argument
TIMEOUT_S = 5.0
_CHECK_TIME_EVERY = 1024        # operations between clock reads


class TemplateBudgetExceeded(Exception):
    """A render went over its ``RenderBudget``."""


@dataclass(slots=True)
class RenderBudget:
    """What one render may still spend; ``charge`` raises once any of it runs out."""

    operations: int = MAX_OPERATIONS
    built: int = MAX_BUILT
    deadline: float = 0.0

    def charge(self, operations: int = 1, built: int = 0) -> None:
        self.operations -= operations
        self.built -= built
        if self.operations < 0:
            raise TemplateBudgetExceeded(f"more than {MAX_OPERATIONS} loop iterations and calls")
        if self.built < 0:
            raise TemplateBudgetExceeded(f"built more than {MAX_BUILT} characters of strings and lists")
        if self.operations % _CHECK_TIME_EVERY == 0 and time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded(f"ran longer than {TIMEOUT_S:g} s")

    def built_value(self, value: Any) -> Any:
        """Charge a value just built (strings and containers cost their length), and return it."""
        if isinstance(value, (str, list, tuple, dict)):
            size = len(value)
            if size > MAX_VALUE:
                raise TemplateBudgetExceeded(f"built a value of {size} characters or items (the limit is {MAX_VALUE})")
            self.charge(0, size)
        return value


_budget: contextvars.ContextVar[RenderBudget] = contextvars.ContextVar("fdplug_render_budget")


def _current() -> RenderBudget:
    try:
        return _budget.get()
    except LookupError:   # rendering outside render_template (a test, a caller of compile_template)
        budget = RenderBudget(deadline=time.monotonic() + TIMEOUT_S)
        _budget.set(budget)
        return budget


# ---------------------------------------------------------------------------------------------------
# size checks before building
# ---------------------------------------------------------------------------------------------------


def _check_width(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_WIDTH:
        raise TemplateBudgetExceeded(f"{what} of {value} (the limit is {MAX_WIDTH})")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")


def _check_format_string(fmt: str) -> None:
    """Widths and precisions in a ``%`` or ``str.format`` string: numbers within MAX_WIDTH, no ``*``
    or nested fields (whose width would come from an argument)."""
    for width, precision in _PERCENT_SPEC.findall(fmt):
        for number in (width, precision):
            if number == "*":
                raise TemplateBudgetExceeded("a '*' width in a format string")
            if number:
                _check_width(int(number), "a format width")
    if "{" in fmt:
        try:
            fields = list(string.Formatter().parse(fmt))
        except ValueError:
            return      # malformed: str.format itself will raise
        for _, _, spec, _ in fields:
            if spec and "{" in spec:
                raise TemplateBudgetExceeded("a nested field in a format spec")
            for number in re.findall(r"\d+", spec or ""):
                _check_width(int(number), "a format width")


def _product_size(left: Any, right: Any) -> None:
    """``left * right``: a repeated sequence, or two integers whose product is huge."""
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, list, tuple)) and isinstance(times, int):
            if len(seq) * max(times, 0) > MAX_VALUE:
                raise TemplateBudgetExceeded(f"a value of {len(seq)} x {times} items")
            return
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 64 * 1024:
        raise TemplateBudgetExceeded("an integer product of more than 65536 bits")


def _power_size(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and max(base.bit_length(), 1) * exponent > 64 * 1024:
        raise TemplateBudgetExceeded("an integer power of more than 65536 bits")


def _join_size(pieces: Any, separator: str = "") -> list:
    items = list(pieces)
    _current().built_value(items)
    size = sum(len(p) if isinstance(p, str) else 8 for p in items) + len(separator) * max(len(items) - 1, 0)
    if size > MAX_VALUE:
        raise TemplateBudgetExceeded(f"a joined string of {size} characters (the limit is {MAX_VALUE})")
    return items


def _replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        hits = text.count(old) if old else len(text) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        if len(text) + hits * (len(new) - len(old)) > MAX_VALUE:
            raise TemplateBudgetExceeded(f"a replace() result over {MAX_VALUE} characters")


# ---------------------------------------------------------------------------------------------------
# the environment
# ---------------------------------------------------------------------------------------------------


class _TemplateRaised(Exception):
    """What ``raise_exception(...)`` in a template raises: the template's own verdict on the input."""


def _meter_iter(iterable: Any) -> Any:
    """A loop's iterable, charging one operation per iteration."""
    budget = _current()
    for item in iterable:
        budget.charge()
        yield item


def _meter_concat(*pieces: Any) -> str:
    """``a ~ b ~ c``, sized before it is built."""
    items = [p if isinstance(p, str) else jinja2.runtime.str_join((p,)) for p in pieces]
    return _current().built_value("".join(_join_size(items)))


class _Meter(NodeTransformer):
    """Rewrites a parsed template so loops and ``~`` go through the budget."""

    def visit_For(self, node: nodes.For) -> nodes.For:
        node = self.generic_visit(node)
        node.iter = nodes.Call(nodes.Name("__fdplug_iter", "load"), [node.iter], [], None, None)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Call:
        node = self.generic_visit(node)
        return nodes.Call(nodes.Name("__fdplug_concat", "load"), list(node.nodes), [], None, None)


_SIZE_CHECKS: dict[str, Callable[..., None]] = {
    "replace": _replace_size,
    "ljust": lambda s, width, *a: _check_width(width, "a width"),
    "rjust": lambda s, width, *a: _check_width(width, "a width"),
    "center": lambda s, width=80, *a, **k: _check_width(width, "a width"),
    "zfill": lambda s, width: _check_width(width, "a width"),
    "expandtabs": lambda s, tabsize=8: _check_width(tabsize * max(s.count("\t"), 1) if isinstance(s, str) else 0,
                                                    "expanded tabs"),
    "indent": lambda s, width=4, *a, **k: _check_width(width if isinstance(width, int) else len(str(width)),
                                                       "an indent"),
    "wordwrap": lambda s, width=79, *a, **k: _check_width(width, "a width"),
    "truncate": lambda s, length=255, *a, **k: _check_width(length, "a length"),
    "batch": lambda s, count, *a, **k: _check_width(count, "a batch size"),
    "slice": lambda s, count, *a, **k: _check_width(count, "a slice count"),
    "format": lambda s, *a, **k: _check_format_string(s) if isinstance(s, str) else None,
}


def _metered_filter(name: str, filter_: Callable) -> Callable:
    """A filter that costs one operation plus what it builds, its sizes checked first where known."""
    check = _SIZE_CHECKS.get(name)
    at = 1 if getattr(filter_, "jinja_pass_arg", None) is not None else 0   # where the filtered value is

    @functools.wraps(filter_)
    def metered(*args: Any, **kwargs: Any) -> Any:
        budget = _current()
        budget.charge()
        if name == "join" and len(args) > at:
            separator = args[at + 1] if len(args) > at + 1 else kwargs.get("d", "")
            args = (*args[:at], _join_size(args[at], separator if isinstance(separator, str) else ""),
                    *args[at + 1:])
        elif check is not None:
            _lenient(check, args[at:], kwargs)
        return budget.built_value(filter_(*args, **kwargs))

    return metered


def _lenient(check: Callable[..., None], args: tuple, kwargs: dict) -> None:
    """A size check on arguments the call itself may reject: a wrong call is the call's error to report."""
    try:
        check(*args, **kwargs)
    except (TypeError, ValueError, AttributeError):
        pass


class _Sandbox(ImmutableSandboxedEnvironment):
    """transformers' environment in Jinja's immutable sandbox, with every call and operator metered.

    Touching an unsafe attribute fails loudly: the stock sandbox renders ``{{ ''.__class__ }}`` as
    an empty string and fails only one step later; a template that probes Python internals is
    never legitimate, so stop it at once.
    """

    intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is unsafe.")

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _current()
        budget.charge()
        name = getattr(__obj, "__name__", None)
        if isinstance(getattr(__obj, "__self__", None), str):
            if name in _SIZE_CHECKS:
                _lenient(_SIZE_CHECKS[name], (__obj.__self__, *args), kwargs)
            elif name == "join" and args:
                args = (_join_size(args[0], __obj.__self__), *args[1:])
        return budget.built_value(super().call(__context, __obj, *args, **kwargs))

    def call_binop(self, context: Any, operator_: str, left: Any, right: Any) -> Any:
        if operator_ == "*":
            _product_size(left, right)
        elif operator_ == "**":
            _power_size(left, right)
        elif operator_ == "%" and isinstance(left, str):
            _check_format_string(left)
        elif operator_ == "+" and isinstance(left, (str, list, tuple)) and isinstance(right, (str, list, tuple)):
            if len(left) + len(right) > MAX_VALUE:
                raise TemplateBudgetExceeded(f"a value of {len(left) + len(right)} characters or items")
        return _current().built_value(super().call_binop(context, operator_, left, right))

    def wrap_str_format(self, value: Any) -> Callable[..., str] | None:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        _check_format_string(value.__self__)

        @functools.wraps(wrapped)
        def metered(*args: Any, **kwargs: Any) -> str:
            return _current().built_value(wrapped(*args, **kwargs))
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
    """transformers' ``tojson``: no HTML escaping and key order kept, unlike Jinja's built-in."""
    _check_width(indent, "an indent")
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> _Sandbox:
    env = _Sandbox(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.filters = {name: _metered_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["__fdplug_iter"] = _meter_iter
    env.globals["__fdplug_concat"] = _meter_concat
    return env


_ENV = _environment()


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template once per distinct source, its loops and ``~`` metered."""
    try:
        tree = _Meter().visit(_ENV.parse(source))
        return _ENV.template_class.from_code(_ENV, _ENV.compile(tree), _ENV.make_globals(None), None)
    except TemplateSyntaxError as exc:
        raise InvalidRequestError(f"the chat template is not valid Jinja: {exc.message} (line {exc.lineno}).",
                                  fix="fix the template or pass a working one.", param="chat_template") from None


def render_template(source: str, context: Mapping[str, Any]) -> str:
    """Render a chat template on a fresh budget; every failure becomes an InvalidRequestError that
    says whose fault it is."""
    template = compile_template(source)
    budget = RenderBudget(deadline=time.monotonic() + TIMEOUT_S)
    token = _budget.set(budget)
    try:
        pieces, size = [], 0
        for piece in template.generate(**context):
            size += len(piece)
            if size > MAX_VALUE:
                raise TemplateBudgetExceeded(f"rendered more than {MAX_VALUE} characters")
            pieces.append(piece)
        return "".join(pieces)
    except _TemplateRaised as exc:
        raise InvalidRequestError(f"the model's chat template rejected the conversation: {exc}",
                                  fix="change the messages to what this model accepts "
                                      "(e.g. alternate user and assistant turns).") from None
    except TemplateBudgetExceeded as exc:
        raise InvalidRequestError(f"rendering the chat template went over its work budget: it {exc}.",
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
        _budget.reset(token)
