"""The ``fdplug`` command line: ``main`` (the console script ``fdplug``) and its commands.

User errors (`fdplug.errors.FdplugError`) print the message and the fix and exit 1; they never
show a traceback (`user_errors`). Commands exist only when they work.

    plugins.py      fdplug plugins: what is installed and what each registered
    doctor.py       fdplug doctor: this machine, its devices' probes, the settings in effect
    explain.py      fdplug explain: the selection for each role, and why not the others
    generate.py     fdplug generate: offline generation
    serve.py        fdplug serve: the OpenAI-compatible server (`fdplug.server.api.launcher`)
    router.py       fdplug router: the PD router (`fdplug.server.router`)
    fetch.py        fdplug fetch-features: pre-encoded multimodal features fetched and checked
    options.py      the engine flags (serve, generate) and their parsing
    http.py         the flags every HTTP front takes (serve, router): draining, connection limits
    user_errors.py  a user error as a message and a fix, exit status 1
"""

from __future__ import annotations

import logging

import click

from fdplug.cli.doctor import doctor_command
from fdplug.cli.explain import explain_command
from fdplug.cli.fetch import fetch_features
from fdplug.cli.generate import generate_command
from fdplug.cli.plugins import plugins_command
from fdplug.cli.router import router_command
from fdplug.cli.serve import serve_command
from fdplug.version import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="fdplug")
@click.option("-v", "--verbose", is_flag=True, help="Debug logging.")
def main(verbose: bool) -> None:
    """fdplug: an LLM inference server whose hardware support is a set of plugins."""
    logging.basicConfig(level=logging.DEBUG if verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")


main.add_command(plugins_command)
main.add_command(doctor_command)
main.add_command(explain_command)
main.add_command(generate_command)
main.add_command(serve_command)
main.add_command(fetch_features)
main.add_command(router_command)
