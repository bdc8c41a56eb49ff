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
from fdplug.cli_options import engine_kwargs, engine_options
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
    from fdplug.cli_options import parse_op_kernels
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

        model_config.keep_weights(config.dtype, config.weight_dtype)
        click.echo(model_summary(model_config, config.dtype, selection.moe.name, selection.ops))
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
    """Generate text offline: one prompt streams to the terminal, several show a progress bar."""
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
    if len(inputs) == 1:
        for delta in llm.stream(inputs[0], params):
            click.echo(delta.text, nl=False)
        click.echo()
        return
    for prompt, output in zip(prompts, llm.generate(inputs, params)):
        click.echo(f"--- {prompt!r} -> {output.outputs[0].finish_reason}\n{output.outputs[0].text}")


# ---------------------------------------------------------------------------------------------------
# serve
# ---------------------------------------------------------------------------------------------------


@main.command("serve")
@engine_options
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (0.0.0.0: all).")
@click.option("--port", type=int, default=8000, show_default=True, help="Port to listen on (0: any free port).")
@click.option("--api-key", default=None, help="Require `Authorization: Bearer KEY` on /v1 (or set FDPLUG_API_KEY).")
@click.option("--served-model-name", default=None, help="The model's name in the API (default: --model, or demo).")
@click.option("--max-body-bytes", type=click.IntRange(min=1), default=8 << 20, show_default=True,
              help="Largest request body; larger ones get 413.")
@click.option("--stream-interval", type=click.IntRange(min=1), default=1, show_default=True,
              help="Tokens per streamed chunk after the first (fewer socket writes under load; 1: every step).")
@click.option("--max-waiting-requests", type=click.IntRange(min=1), default=1024, show_default=True,
              help="Requests queued beyond the running batch; more get 503.")
@click.option("--trust-request-chat-template", is_flag=True,
              help="Run chat templates sent in requests (chat_template): a template is code; trusted clients only.")
@click.option("--data-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="Engine processes, each with its own KV cache, behind this one API (cpu: the cores split "
                   "between them; other devices: device i for engine i). Requests go to the least loaded, "
                   "preferring one that has their prefix cached.")
@click.option("--data-parallel-backend", type=click.Choice(["mp", "ray"]), default="mp", show_default=True,
              help="mp: engine processes on this machine; ray: engines placed by Ray (across its machines), "
                   "restarted when they die.")
@click.option("--ray-address", default=None,
              help="With --data-parallel-backend ray: the cluster to join (ray start --head's address); "
                   "default: a local Ray.")
@click.option("--role", type=click.Choice(["prefill", "decode"]), default=None,
              help="Prefill/decode disaggregation: this instance prefills requests (max_tokens=1) and holds their KV "
                   "for a decode instance to pull, or decodes requests whose KV it pulls (kv_transfer_params).")
@click.option("--kv-connector", default=None,
              help="With --role: how KV moves between prefill and decode instances (default: by priority; "
                   "`fdplug explain --role decode` lists them).")
@click.option("--expert-parallel-size", type=click.IntRange(min=1), default=1, show_default=True,
              help="MoE models: shard the routed experts over this many engines (the data-parallel engines; "
                   "each keeps its own KV cache and requests) that run every forward pass together, tokens "
                   "exchanged through paddle.distributed (gloo on cpu).")
@user_errors
def serve_command(host: str, port: int, api_key: str | None, served_model_name: str | None, max_body_bytes: int,
                  stream_interval: int, max_waiting_requests: int, trust_request_chat_template: bool,
                  data_parallel_size: int, data_parallel_backend: str, ray_address: str | None,
                  expert_parallel_size: int, role: str | None, kv_connector: str | None, **kw: Any) -> None:
    """Serve the OpenAI API (chat, completions, streaming) with the engine in its own process."""
    from fdplug.server.launcher import ServerSettings, serve

    logging.getLogger("fdplug").setLevel(min(logging.INFO, logging.getLogger().getEffectiveLevel()))
    args = engine_kwargs(kw)
    args["max_waiting_requests"] = max_waiting_requests
    if role is not None:
        args["kv_role"] = role
    if kv_connector is not None:
        args["kv_connector"] = kv_connector
    settings = ServerSettings(host=host, port=port, api_key=api_key, served_model_name=served_model_name,
                              max_body_bytes=max_body_bytes, stream_interval=stream_interval,
                              trust_request_chat_template=trust_request_chat_template,
                              data_parallel_size=data_parallel_size, data_parallel_backend=data_parallel_backend,
                              ray_address=ray_address, expert_parallel_size=expert_parallel_size)
    sys.exit(serve(settings, args))


def _register_fetch_features() -> None:
    from fdplug.cli_fetch import fetch_features
    from fdplug.cli_router import router_command

    main.add_command(fetch_features, "fetch-features")
    main.add_command(router_command, "router")


_register_fetch_features()

if __name__ == "__main__":
    main()
