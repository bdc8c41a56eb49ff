"""How every ``fdplug`` command answers a user error: the message and the fix, exit status 1, no traceback."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import click

from fdplug.errors import FdplugError


def user_errors(fn: Callable) -> Callable:
    """Turn FdplugError into a two-line message and exit status 1."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FdplugError as exc:
            decisions = getattr(exc, "decisions", ())
            if decisions:
                click.echo("decisions so far:", err=True)
                for d in decisions:
                    click.echo(f"  [{d.role}]{d.line()}", err=True)
            click.echo(f"error: {exc.message}", err=True)
            if exc.fix:
                click.echo(f"fix: {exc.fix}", err=True)
            sys.exit(1)

    return wrapper
