"""``fdplug doctor``: this machine as fdplug sees it (paddle, every device's probe, threads, settings)."""

from __future__ import annotations

import platform

import click

from fdplug.cli.user_errors import user_errors
from fdplug.core.plugin_loading.loader import load_plugins
from fdplug.core.plugin_loading.selection import run_probe
from fdplug.plugin_api.hookspecs import API_VERSION
from fdplug.plugin_api.settings import SETTINGS
from fdplug.version import __version__


@click.command("doctor")
@user_errors
def doctor_command() -> None:
    """Check this machine: paddle build, every device's probe, threads, settings."""
    from fdplug.plugin_api.paddle import INSTALL_FIX, import_paddle, paddle_installed
    from fdplug.plugins.cpu.device import cpu_threads, is_amd_cpu, usable_cores

    click.echo(f"fdplug {__version__} (plugin API {API_VERSION}), "
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
    from fdplug.server import settings as _server_settings  # noqa: F401  (declares the server's)

    settings = [setting for _, setting in sorted(SETTINGS.items()) if setting.is_set()]
    click.echo("settings from the environment:" if settings else "settings from the environment: none")
    for setting in settings:
        click.echo(f"  {setting.name}={'<hidden>' if setting.secret else repr(setting.value())}")
