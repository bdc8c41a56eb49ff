"""The work budget of one chat-template render, and the size checks made before a value is built.

A template is code; Jinja's sandbox keeps it away from Python internals but does not bound its
work. ``chat_template`` charges every loop iteration, call and lookup to the render's
``RenderBudget``, and every value built to its length; the checks here refuse, from the arguments
alone, what would be too large to build at all (``'x' * 10**10``, ``ljust(10**9)``, ``%0999999999d``,
a ``replace`` or ``join`` past ``MAX_VALUE``).
"""

from __future__ import annotations

import contextvars
import re
import string
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_OPERATIONS = 1_000_000      # loop iterations, calls, lookups (a model template spends ~20 per message)
MAX_VALUE = 32 << 20            # characters in any one string, and in the output
MAX_ITEMS = 1 << 20             # items in any one list, tuple or dict (each may print as many characters)
MAX_BUILT = 4 * MAX_VALUE       # characters and items built in all, over the render
MAX_WIDTH = 1 << 20             # a width, count or padding argument
TIMEOUT_S = 2.0
SIZED = (str, bytes, bytearray, list, tuple)   # what ``*`` and ``+`` build by length
_CHECK_TIME_EVERY = 1024        # operations between clock reads


class TemplateBudgetExceeded(Exception):
    """A render went over its ``RenderBudget``."""


@dataclass(slots=True)
class RenderBudget:
    """What one render may still spend; ``charge`` raises once any of it runs out."""

    operations: int
    built: int
    deadline: float

    @classmethod
    def fresh(cls) -> RenderBudget:
        return cls(MAX_OPERATIONS, MAX_BUILT, time.monotonic() + TIMEOUT_S)

    def charge(self, operations: int = 1, built: int = 0) -> None:
        self.operations -= operations
        self.built -= built
        if self.operations < 0:
            raise TemplateBudgetExceeded(f"more than {MAX_OPERATIONS} operations (loop iterations, calls, lookups)")
        if self.built < 0:
            raise TemplateBudgetExceeded(f"more than {MAX_BUILT} characters of strings and lists built")
        if self.operations % _CHECK_TIME_EVERY == 0 and time.monotonic() > self.deadline:
            raise TemplateBudgetExceeded(f"more than {TIMEOUT_S:g} s")

    def built_value(self, value: Any) -> Any:
        """Charge a value just built (strings and containers cost their length), and return it."""
        if isinstance(value, (str, bytes, bytearray, list, tuple, dict)):
            size, limit = len(value), MAX_VALUE if isinstance(value, (str, bytes, bytearray)) else MAX_ITEMS
            if size > limit:
                raise TemplateBudgetExceeded(f"a value of {size} characters or items (the limit is {limit})")
            self.charge(0, size)
            if size > _CHECK_TIME_EVERY and time.monotonic() > self.deadline:   # a large value took a while
                raise TemplateBudgetExceeded(f"more than {TIMEOUT_S:g} s")
        return value


budget_var: contextvars.ContextVar[RenderBudget] = contextvars.ContextVar("fdplug_renderbudget_var")


def current() -> RenderBudget:
    try:
        return budget_var.get()
    except LookupError:   # rendering outside render_template (a test, a caller of compile_template)
        budget = RenderBudget.fresh()
        budget_var.set(budget)
        return budget


# ---------------------------------------------------------------------------------------------------
# size checks before building
# ---------------------------------------------------------------------------------------------------


def check_width(value: Any, what: str) -> None:
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_WIDTH:
        raise TemplateBudgetExceeded(f"{what} of {value} (the limit is {MAX_WIDTH})")


_PERCENT_SPEC = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]?")


def _spec_size(numbers: list[str], largest: int) -> int:
    """What one conversion prints at most: its width or precision, or the largest argument."""
    size = largest
    for number in numbers:
        if number == "*":
            raise TemplateBudgetExceeded("a '*' width in a format string")
        if number:
            check_width(int(number), "a format width")
            size = max(size, int(number))
    return size


def _largest_printed(values: Any) -> int:
    return max((printed_size(v) for v in values), default=0)


def percent_format_size(fmt: str, args: Any) -> None:
    """``fmt % args`` (and the ``format`` filter), sized before it is built: its literal text plus,
    per conversion, its width or the largest argument printed."""
    values = list(args.values()) if isinstance(args, dict) else list(args) if isinstance(args, tuple) else [args]
    largest = _largest_printed(values)
    total = len(fmt)
    for width, precision in _PERCENT_SPEC.findall(fmt):
        total += _spec_size([width, precision], largest)
        if total > MAX_VALUE:
            raise TemplateBudgetExceeded(f"a formatted string of more than {MAX_VALUE} characters")


def brace_format_size(fmt: str, args: tuple, kwargs: dict) -> None:
    """``fmt.format(*args, **kwargs)``, sized the same way; no nested fields (a width from an argument)."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return      # malformed: str.format itself will raise
    largest = _largest_printed([*args, *kwargs.values()])
    total = len(fmt)
    for _, name, spec, _ in fields:
        if name is None:
            continue
        if spec and "{" in spec:
            raise TemplateBudgetExceeded("a nested field in a format spec")
        total += _spec_size(re.findall(r"\d+", spec or ""), largest)
        if total > MAX_VALUE:
            raise TemplateBudgetExceeded(f"a formatted string of more than {MAX_VALUE} characters")


def product_size(left: Any, right: Any) -> None:
    """``left * right``: a repeated sequence, or two integers whose product is huge."""
    for seq, times in ((left, right), (right, left)):
        if isinstance(seq, (str, bytes, bytearray, list, tuple)) and isinstance(times, int):
            if len(seq) * max(times, 0) > (MAX_VALUE if isinstance(seq, (str, bytes, bytearray)) else MAX_ITEMS):
                raise TemplateBudgetExceeded(f"a value of {len(seq)} x {times} items")
            return
    if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > 64 * 1024:
        raise TemplateBudgetExceeded("an integer product of more than 65536 bits")


def power_size(base: Any, exponent: Any) -> None:
    if isinstance(base, int) and isinstance(exponent, int) and exponent > 0 \
            and max(base.bit_length(), 1) * exponent > 64 * 1024:
        raise TemplateBudgetExceeded("an integer power of more than 65536 bits")


def printed_size(value: Any, limit: int = MAX_VALUE) -> int:
    """About how many characters ``str(value)`` has, stopping past ``limit``. Shared references count
    each time they print, but are measured once: a list that holds itself twice, thirty levels deep,
    is measured in thirty steps and refused, rather than printed (2^30 times its leaves)."""
    memo: dict[int, int] = {}

    def size(v: Any) -> int:
        if isinstance(v, (str, bytes, bytearray)):
            return 4 * len(v) + 3 if not isinstance(v, str) else len(v) + 2
        if not isinstance(v, (list, tuple, dict, set, frozenset)):
            return 24
        key = id(v)
        if key not in memo:
            memo[key] = limit + 1            # a cycle prints as [...], but treat it as too large
            total = 2
            for item in (v.items() if isinstance(v, dict) else v):
                total += size(item) + 2
                if total > limit:
                    break
            memo[key] = total
        return memo[key]

    return size(value)


def check_printable(value: Any) -> None:
    """Refuse to turn a container into text when the text would be over MAX_VALUE characters."""
    if isinstance(value, (list, tuple, dict, set, frozenset)) and printed_size(value) > MAX_VALUE:
        raise TemplateBudgetExceeded(f"a value that would print as more than {MAX_VALUE} characters")


def join_size(pieces: Any, separator: str = "") -> list:
    items = list(pieces)
    current().built_value(items)
    size = len(separator) * max(len(items) - 1, 0)
    for piece in items:
        size += len(piece) if isinstance(piece, str) else printed_size(piece)
        if size > MAX_VALUE:
            raise TemplateBudgetExceeded(f"a joined string of more than {MAX_VALUE} characters")
    return items


def replace_size(text: Any, old: Any, new: Any, count: Any = -1) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str) and len(new) > len(old):
        hits = text.count(old) if old else len(text) + 1
        if isinstance(count, int) and count >= 0:
            hits = min(hits, count)
        if len(text) + hits * (len(new) - len(old)) > MAX_VALUE:
            raise TemplateBudgetExceeded(f"a replace() result over {MAX_VALUE} characters")


SIZE_CHECKS: dict[str, Callable[..., None]] = {
    "replace": replace_size,
    "ljust": lambda s, width, *a: check_width(width, "a width"),
    "rjust": lambda s, width, *a: check_width(width, "a width"),
    "center": lambda s, width=80, *a, **k: check_width(width, "a width"),
    "zfill": lambda s, width: check_width(width, "a width"),
    "expandtabs": lambda s, tabsize=8: check_width(tabsize * max(s.count("\t"), 1) if isinstance(s, str) else 0,
                                                    "expanded tabs"),
    "indent": lambda s, width=4, *a, **k: check_width(
        (width if isinstance(width, int) else len(str(width))) * (str(s).count("\n") + 1), "an indent of all lines"),
    "wordwrap": lambda s, width=79, *a, **k: check_width(width, "a width"),
    "truncate": lambda s, length=255, *a, **k: check_width(length, "a length"),
    "batch": lambda s, count, *a, **k: check_width(count, "a batch size"),
    "slice": lambda s, count, *a, **k: check_width(count, "a slice count"),
    "format": lambda s, *a, **k: percent_format_size(s, k or a) if isinstance(s, str) else None,
    "translate": lambda s, table: check_width(len(s) * max((len(v) for v in table.values() if isinstance(v, str)),
                                                           default=1), "a translated string"),
    "split": lambda s, *a, **k: check_width(len(s) // 2, "a split") if len(s) > 2 * MAX_ITEMS else None,
    "list": lambda s, *a, **k: check_width(len(s), "a list of characters") if isinstance(s, str) else None,
}


def lenient(check: Callable[..., None], args: tuple, kwargs: dict) -> None:
    """A size check on arguments the call itself may reject: a wrong call is the call's error to report."""
    try:
        check(*args, **kwargs)
    except (TypeError, ValueError, AttributeError):
        pass
