"""The ``fdplug`` command line.

User errors (`fdplug.errors.FdplugError`) print the message and the fix and exit 1; they never
show a traceback. Commands exist only when they work.
"""

from __future__ import annotations

import functools
import json
import logging
import platform
import sys
from typing import Any, Callable

import click

import fdplug
from fdplug.core.config import ENV_VARS, env, env_is_set
from fdplug.core.plugins import load_plugins
from fdplug.core.selection import run_probe, select_backend
from fdplug.errors import FdplugError, SelectionError


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


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(fdplug.__version__, prog_name="fdplug")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """fdplug: an LLM inference server whose hardware support is a set of plugins."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


# ---------------------------------------------------------------------------------------------------
# plugins
# ---------------------------------------------------------------------------------------------------


@main.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors
def plugins_command(as_json: bool) -> None:
    """List plugins: version, source, status, what each registered, and why any failed."""
    plugin_set = load_plugins()
    infos = plugin_set.plugins()
    if as_json:
        click.echo(json.dumps({"api_version": fdplug.API_VERSION, "plugins": [i.to_dict() for i in infos],
                               "warnings": plugin_set.warnings}, indent=2))
        return
    click.echo(f"fdplug {fdplug.__version__}, plugin API {fdplug.API_VERSION}")
    rows = [("NAME", "VERSION", "SOURCE", "STATUS", "PROVIDES / ERROR")]
    for info in infos:
        provides = "; ".join(f"{role}: {', '.join(names)}" for role, names in info.registered.items())
        rows.append((info.name, info.version, info.source, info.status, info.error or provides or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    for warning in plugin_set.warnings:
        click.echo(f"warning: {warning}")


# ---------------------------------------------------------------------------------------------------
# doctor
# ---------------------------------------------------------------------------------------------------


@main.command("doctor")
@user_errors
def doctor_command() -> None:
    """Check this machine: paddle build, every device's probe, threads, settings."""
    from fdplug.core.paddle_utils import INSTALL_FIX, import_paddle, paddle_installed
    from fdplug.plugins.cpu.device import cpu_threads, is_amd_cpu, usable_cores

    click.echo(f"fdplug {fdplug.__version__} (plugin API {fdplug.API_VERSION}), "
               f"python {platform.python_version()} on {platform.machine()}")
    if paddle_installed():
        paddle = import_paddle()
        click.echo(f"paddle {paddle.__version__}: cuda={paddle.is_compiled_with_cuda()} "
                   f"xpu={paddle.is_compiled_with_xpu()}")
    else:
        click.echo(f"paddle: NOT INSTALLED. Fix: {INSTALL_FIX}")
    click.echo(f"cpu: {usable_cores()} usable cores, {cpu_threads()} compute threads, "
               f"{'AMD' if is_amd_cpu() else 'non-AMD'}")
    plugin_set = load_plugins()
    click.echo("devices:")
    for entry in sorted(plugin_set.registry.entries("device"), key=lambda e: -e.spec.priority):
        probe = run_probe(entry.spec)
        state = "available" if probe.available else "unavailable"
        click.echo(f"  {entry.spec.name:<8} {state:<11} priority {entry.spec.priority:<4} "
                   f"(plugin {entry.plugin}): {probe.reason}")
        if probe.fix and not probe.available:
            click.echo(f"  {'':<8} fix: {probe.fix}")
    failed = plugin_set.failed()
    click.echo(f"plugins: {len(plugin_set.plugins())} seen, {len(failed)} failed"
               + (f" ({', '.join(p.name for p in failed)}; see `fdplug plugins`)" if failed else ""))
    settings = [(name, var) for name, var in ENV_VARS.items() if env_is_set(name)]
    click.echo("settings from the environment:" if settings else "settings from the environment: none")
    for name, var in settings:
        click.echo(f"  {name}={'<hidden>' if var.secret else env(name)!r}")


# ---------------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------------


@main.command("explain")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, xpu, a plugin's device, or auto.")
@click.option("--runner", default=None, help="Model runner to use (default: by priority).")
@click.option("--attention", default=None, help="Attention backend to use (default: by priority).")
@click.option("--moe", default=None, help="MoE backend to use (default: by priority).")
@click.option("--json", "as_json", is_flag=True, help="Print the selection as names (what another process rebuilds).")
@user_errors
def explain_command(device: str, runner: str | None, attention: str | None, moe: str | None, as_json: bool) -> None:
    """Show what would be selected for each role, and why every other candidate was not.

    Exits non-zero, with the reason and the fix, when no selection is possible.
    """
    from fdplug.core.config import EngineConfig

    config = EngineConfig()
    plugin_set = load_plugins()
    backend = select_backend(device, runner, attention, moe, config=config, plugins=plugin_set)
    plugin_set.configure(config, backend)
    if as_json:
        click.echo(json.dumps(backend.to_names(), indent=2))
        return
    click.echo(backend.explain())
    click.echo(f"selected: device={backend.device.name} runner={backend.runner.name} "
               f"attention={backend.attention.name} moe={backend.moe.name} "
               f"storages={','.join(f'{s}:{spec.name}' for s, spec in backend.storages.items()) or 'none'}")


if __name__ == "__main__":
    main()
