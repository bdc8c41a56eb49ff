"""``fdplug explain``: what would be selected for each role, and why every other candidate was not."""

from __future__ import annotations

import json

import click

from fdplug.cli.user_errors import user_errors
from fdplug.core.plugin_loading.loader import load_plugins
from fdplug.core.plugin_loading.selection import select_components


@click.command("explain")
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
        from fdplug.core.model.checkpoint.footprint import model_summary
        from fdplug.core.worker.backend_timing import plan_backends
        from fdplug.core.worker.op_timing import LINEAR_OPS, plan_linear
        from fdplug.core.worker.row_op_timing import plan_row_ops
        from fdplug.core.worker.stack_timing import cached_plan

        model_config.keep_weights(config.dtype, config.weight_dtype)
        click.echo(model_summary(model_config, config.dtype, selection.moe.name, selection.ops))
        if selection.measured_ops and selection.device.setup is not None:
            selection.device.setup()    # threads and math library as the engine runs them: the same figures
        for linear_plan in (plan_linear(selection, config, model_config, op) for op in LINEAR_OPS):
            if linear_plan is not None:
                click.echo(linear_plan.describe())
                hint = _stack_hint(linear_plan, selection)
                if hint:
                    click.echo(hint)
        row_plan = plan_row_ops(selection, config, model_config)
        if row_plan is not None:
            click.echo(row_plan.describe(in_stack=None))   # whether a fused stack runs decode: known after load
        stack_plan = cached_plan(selection, config, model_config)    # timed on the loaded model: an earlier start's
        if stack_plan is not None:
            click.echo(stack_plan.describe())
        elif "decoder_stack" in selection.measured_ops:
            click.echo(f"op:decoder_stack: {selection.ops['decoder_stack'].name} is timed against the layers one "
                       "by one once the model is loaded, where it takes the model (no figures of an earlier start "
                       "here yet; the startup log says)")
        for backend_plan in plan_backends(selection, config, model_config):
            click.echo(backend_plan.describe())
    elif selection.measured_ops:
        click.echo(f"measured: {', '.join(sorted(selection.measured_ops))}: each kernel is timed against the "
                   "portable op on the model's shapes at startup and runs where it is not slower (the linears: per "
                   "layer shape; the row ops: per op; a decoder stack: on the loaded model's decode steps), each "
                   "backend (attention, moe) against the reference; --model DIR shows the figures")
    untimed = _untimed(selection)
    if untimed:
        click.echo(untimed)
    backends = [f"{role}={spec.name}" for role, spec in (("attention", selection.attention), ("moe", selection.moe))
                if spec.name != "reference" and role not in selection.measured_ops]
    if backends:   # said, so that no one reads the figures as covering them
        click.echo("not timed against the reference (the backend has no measure_key, or was named, or "
                   f"FDPLUG_OP_TIMING=0): {', '.join(backends)}")
    click.echo(f"selected: {selection.summary()}")


def _untimed(selection) -> str | None:
    """The ops whose kernel is not the portable one and is not timed against it: which, and why not."""
    from fdplug.core.portable.op_specs import PORTABLE_OPS

    left = [f"{op}={spec.name}" for op, spec in selection.ops.items()
            if op not in selection.measured_ops and spec.name != PORTABLE_OPS[op].name]
    return None if not left else ("not timed against the portable op (the kernel has no measure_key, or was named "
                                  "with --op-kernel, or FDPLUG_OP_TIMING=0): " + ", ".join(left))


def _stack_hint(linear_plan, selection) -> str | None:
    """Where the plan put a decoder layer's shape on the portable op and a fused decoder stack is
    selected: that the stack then stays off (it runs the kernel's packed layers), and the fix."""
    from fdplug.core.portable.op_specs import PORTABLE_OPS

    stack = selection.ops["decoder_stack"].name
    if stack == PORTABLE_OPS["decoder_stack"].name or all(t.kernel_wins for t in linear_plan.timings
                                                          if not t.subject.logits):
        return None
    return (f"  (the layers on {linear_plan.portable} keep {stack} off: it runs the kernels' own layers; "
            f"--op-kernel {linear_plan.op}={linear_plan.kernel} keeps the kernel, and so the stack, on every shape)")
