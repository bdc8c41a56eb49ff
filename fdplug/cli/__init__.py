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
from collections.abc import Callable
from typing import Any

import click

import fdplug
from fdplug.cli.options import engine_kwargs, engine_options
from fdplug.core.plugin_loading.loader import load_plugins
from fdplug.core.plugin_loading.selection import run_probe, select_components
from fdplug.errors import FdplugError
from fdplug.plugin_api.settings import SETTINGS


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
    from fdplug.plugin_api.paddle import INSTALL_FIX, import_paddle, paddle_installed
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
    from fdplug.server import settings as _server_settings  # noqa: F401  (declares the server's)

    settings = [setting for _, setting in sorted(SETTINGS.items()) if setting.is_set()]
    click.echo("settings from the environment:" if settings else "settings from the environment: none")
    for setting in settings:
        click.echo(f"  {setting.name}={'<hidden>' if setting.secret else repr(setting.value())}")


# ---------------------------------------------------------------------------------------------------
# explain
# ---------------------------------------------------------------------------------------------------


@main.command("explain")
@click.option("--device", default="auto", show_default=True, help="cpu, cuda, xpu, a plugin's device, or auto.")
@click.option("--runner", default=None, help="Model runner to use (default: by priority).")
@click.option("--attention", default=None, help="Attention backend to use (default: by priority).")
@click.option("--moe", default=None, help="MoE backend to use (default: FD_MOE_BACKEND, else by priority).")
@click.option("--model", default=None, help="Explain the selection for this model directory (its MoE, dtype...).")
@click.option("--quantization", default=None, type=click.Choice(["fp8"]),
              help="With --model: as if its float linears were quantized to FP8 at load.")
@click.option("--dtype", default="auto", show_default=True,
              type=click.Choice(["auto", "float32", "bfloat16", "float16"]),
              help="With --model: as if served with this --dtype (bfloat16 on cpu: bf16 weights).")
@click.option("--op-kernel", "op_kernels", multiple=True, metavar="OP=NAME",
              help="Kernel for one op, e.g. linear=cpu_native_linear (repeatable; default: by priority).")
@click.option("--role", type=click.Choice(["prefill", "decode"]), default=None,
              help="As for an instance of this PD role (adds its KV connector).")
@click.option("--kv-connector", default=None, help="With --role: the KV connector to use (default: by priority).")
@click.option("--json", "as_json", is_flag=True, help="Print the selection as names (what another process rebuilds).")
@user_errors
def explain_command(device: str, runner: str | None, attention: str | None, moe: str | None, model: str | None,
                    quantization: str | None, dtype: str, op_kernels: tuple[str, ...], role: str | None,
                    kv_connector: str | None, as_json: bool) -> None:
    """Show what would be selected for each role, and why every other candidate was not.

    Exits non-zero, with the reason and the fix, when no selection is possible.
    """
    from fdplug.cli.options import parse_op_kernels
    from fdplug.core.config import EngineConfig
    from fdplug.core.engine.startup import resolve_engine

    ops = parse_op_kernels(op_kernels)
    if model is not None:
        config, model_config, selection = resolve_engine(model, device, runner, attention, moe, ops=ops,
                                                         kv_connector=kv_connector, quantization=quantization,
                                                         dtype=dtype, kv_role=role)
    elif quantization is not None or dtype != "auto":
        raise click.UsageError("--quantization and --dtype need --model (they are about a model's weights).")
    else:
        config, model_config = EngineConfig(kv_role=role), None
        plugin_set = load_plugins()
        selection = select_components(device, runner, attention, moe, ops=ops, kv_connector=kv_connector,
                                      config=config, plugins=plugin_set)
        plugin_set.configure(config, selection)
    if as_json:
        click.echo(json.dumps(selection.to_names(), indent=2))
        return
    click.echo(selection.explain())
    if model_config is not None:
        from fdplug.core.model.footprint import model_summary
        from fdplug.core.plugin_loading.op_timing import plan_linear

        model_config.keep_weights(config.dtype, config.weight_dtype)
        click.echo(model_summary(model_config, config.dtype, selection.moe.name, selection.ops))
        if "linear" in selection.measured_ops and selection.device.setup is not None:
            selection.device.setup()    # threads and math library as the engine runs them: the same figures
        linear_plan = plan_linear(selection, config, model_config)
        if linear_plan is not None:
            click.echo(linear_plan.describe())
    elif "linear" in selection.measured_ops:
        click.echo(f"op:linear: {selection.ops['linear'].name} is timed against the portable op on the model's "
                   "layer shapes at startup and runs those where it is not slower (--model DIR shows the figures)")
    click.echo(f"selected: {selection.summary()}")


# ---------------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------------


@main.command("generate")
@engine_options
@click.option("--prompt", "prompts", multiple=True, required=True, help="Prompt text (repeat for several).")
@click.option("--chat", is_flag=True, help="Wrap each prompt as a user message in the model's chat template.")
@click.option("--max-tokens", type=int, default=64, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--seed", type=int, default=None)
@user_errors
def generate_command(prompts: tuple[str, ...], chat: bool, max_tokens: int, temperature: float, top_p: float,
                     top_k: int, seed: int | None, **kw: Any) -> None:
    """Generate text offline: one prompt streams to the terminal, several show a progress bar.

    stdout is only the text; stderr says why each output ended and how many tokens it has, because
    a chat model given a raw prompt often ends at once and an empty line alone explains nothing.
    """
    from fdplug.core.engine.request import SamplingParams
    from fdplug.core.frontend.llm import LLM

    llm = LLM(**engine_kwargs(kw))
    click.echo(f"[{llm.describe()}]", err=True)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
    if chat:
        texts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
        inputs: list[Any] = [{"prompt": t, "prompt_token_ids": llm.tokenizer.encode(t, add_special_tokens=False)}
                             for t in texts]
    else:
        inputs = list(prompts)
    ended: list[tuple[str | None, int, bool]] = []   # (finish_reason, tokens, blank) per prompt
    if len(inputs) == 1:
        tokens, finish, blank = 0, None, True
        for delta in llm.stream(inputs[0], params):
            click.echo(delta.text, nl=False)
            tokens, finish = tokens + len(delta.token_ids), delta.finish_reason or finish
            blank = blank and not delta.text.strip()
        click.echo()
        click.echo(f"[finish_reason={finish}, {_tokens(tokens)}]", err=True)
        ended.append((finish, tokens, blank))
    else:
        for prompt, output in zip(prompts, llm.generate(inputs, params)):
            out = output.outputs[0]
            click.echo(f"--- {prompt!r} -> {out.finish_reason}, {_tokens(len(out.token_ids))}\n{out.text}")
            ended.append((out.finish_reason, len(out.token_ids), not out.text.strip()))
    empty = next(((finish, tokens) for finish, tokens, blank in ended if blank), None)
    if empty is not None and not chat:
        click.echo(f"note: empty output (finish_reason={empty[0]} after {_tokens(empty[1])}): a chat model given a raw "
                   "prompt often ends at once; try --chat to wrap it in the model's chat template.", err=True)


def _tokens(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"


def _register_fetch_features() -> None:
    from fdplug.cli.fetch import fetch_features
    from fdplug.cli.router import router_command
    from fdplug.cli.serve import serve_command

    main.add_command(serve_command, "serve")
    main.add_command(fetch_features, "fetch-features")
    main.add_command(router_command, "router")


_register_fetch_features()
