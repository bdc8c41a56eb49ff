"""``fdplug plugins``: the plugins installed, what each registered, and why any failed."""

from __future__ import annotations

import json

import click

from fdplug.cli.user_errors import user_errors
from fdplug.core.plugin_loading.loader import load_plugins
from fdplug.plugin_api.hookspecs import API_VERSION
from fdplug.version import __version__


@click.command("plugins")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@user_errors
def plugins_command(as_json: bool) -> None:
    """List plugins: version, source, status, what each registered, and why any failed."""
    plugin_set = load_plugins()
    infos = plugin_set.plugins()
    if as_json:
        click.echo(json.dumps({"api_version": API_VERSION, "plugins": [i.to_dict() for i in infos],
                               "warnings": plugin_set.warnings}, indent=2))
        return
    click.echo(f"fdplug {__version__}, plugin API {API_VERSION}")
    rows = [("NAME", "VERSION", "SOURCE", "STATUS", "PROVIDES / ERROR")]
    for info in infos:
        provides = "; ".join(f"{role}: {', '.join(names)}" for role, names in info.registered.items())
        rows.append((info.name, info.version, info.source, info.status, info.error or provides or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths)) + "  " + row[4])
    for warning in plugin_set.warnings:
        click.echo(f"warning: {warning}")
