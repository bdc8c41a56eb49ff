"""Selection that measures, for the ``decoder_stack`` op: a fused stack keeps a model's decode steps
only where it is not slower than running the layers one by one, on this machine.

Why: as for the other ops (`op_timing`, `row_op_timing`), a kernel's priority says nothing of its
speed on a given machine. A stack runs the selected ops' kernels in one call, bit for bit what the
layers give one by one, so the choice is speed alone. Its gain is the Python, allocation and call
cost of a decode step's ~10 ops a layer, which is most of a small model's step and little of a large
one's. A stack kernel that names an `OpSpec.measure_key`, chosen by priority, is timed once the model
is loaded and the stack has taken it (`fused_stack.attach`): a decode step of `SEQUENCES` sequences,
each `CONTEXT` tokens into a KV cache of the timing's own (zeros: the speed does not depend on the
values; freed after), the stack against the layers one by one, interleaved pairs, medians
(`timing_cache`; microseconds a step). Slower at either (beyond the timing's noise) or a failed
timing: the stack is let go, and the op is reported as the portable one. The figures are cached per
machine, kernel build and model shape (`_model_key`: from the config, so `fdplug explain --model
DIR`, which loads no weights, prints the figures of an earlier start).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fdplug.core.worker import timing_cache as tc
from fdplug.core.worker.timing_cache import Figures, Timing

logger = logging.getLogger(__name__)

OP = "decoder_stack"
SEQUENCES = (1, 32)   # a decode step of one sequence, and of a batch
SUBJECT = "decode step"
CONTEXT_NOTE = "each sequence a KV block of context"


@dataclass(frozen=True, slots=True)
class StackPlan:
    """The stack's figures against the layers one by one, and whether it keeps the decode steps."""

    kernel: str
    portable: str
    timing: Timing
    cached: bool

    @property
    def keeps(self) -> bool:
        return self.timing.kernel_wins

    def describe(self) -> str:
        figures = self.timing.figures(self.kernel, self.portable).replace(" rows", " sequences")
        slower = "/".join(map(str, self.timing.slower_at))
        verdict = (self.kernel if self.keeps else self.portable if not self.timing.rows
                   else f"{self.portable} ({self.kernel} slower at {slower} sequences)")
        return (f"op:{OP} ({'cached figures' if self.cached else 'measured now'}; a decode step, "
                f"{CONTEXT_NOTE}): {figures} -> {verdict}")

    def settle(self, model: Any, selection: Any) -> Any:
        """Where the stack lost: the layers one by one, and the selection saying so. -> the selection."""
        if self.keeps:
            return selection
        from fdplug.core.portable.op_specs import PORTABLE_OPS

        model.fused_stack = None
        return dataclasses.replace(selection, ops=MappingProxyType({**selection.ops, OP: PORTABLE_OPS[OP]}))


def plan_stack(model: Any, backend: Any, selection: Any, config: Any) -> StackPlan | None:
    """The stack's plan on the loaded ``model`` (its stack attached), or None where it is not measured:
    no stack took the model, the kernel named (``--op-kernel``) or without a ``measure_key``,
    ``FDPLUG_OP_TIMING=0``, or another process held the figures' lock too long."""
    spec = _measured_spec(selection)
    if model.fused_stack is None or spec is None:
        return None
    key, place = _key(selection, config, model.config), selection.device.paddle_place_name(config.device_index)

    def time_steps(_: str) -> Figures | None:
        try:
            return _time_steps(model, backend, config, place)
        except Exception as exc:   # noqa: BLE001 - any failure: the layers run one by one
            logger.warning("timing %s failed (%r): the layers run one by one", spec.name, exc)
            return None

    found = tc.measured(tc.cache_path(key), key, [SUBJECT], str, time_steps)
    if found is None:
        return None
    figures, cached = found
    return _plan(spec.name, figures, cached)


def cached_plan(selection: Any, config: Any, model_config: Any) -> StackPlan | None:
    """The figures an earlier start measured for this model here (`fdplug explain`), or None."""
    spec = _measured_spec(selection)
    if spec is None:
        return None
    key = _key(selection, config, model_config)
    figures = tc.read_figures(tc.cache_path(key), key)
    return _plan(spec.name, figures, True) if SUBJECT in figures else None


def _measured_spec(selection: Any) -> Any:
    """The selected stack kernel's spec where it is to be timed (chosen by priority, a ``measure_key``)."""
    spec = selection.ops[OP]
    return spec if OP in selection.measured_ops and spec.measure_key is not None else None


def _plan(kernel: str, figures: dict[str, Figures], cached: bool) -> StackPlan:
    from fdplug.core.portable.op_specs import PORTABLE_OPS

    return StackPlan(kernel, PORTABLE_OPS[OP].name, Timing.of(SUBJECT, figures.get(SUBJECT, tc.NO_FIGURES), "us"),
                     cached)


def _key(selection: Any, config: Any, cfg: Any) -> str:
    spec = selection.ops[OP]
    ops = ", ".join(f"{op}={s.name}" for op, s in sorted(selection.ops.items()))   # the kernels the stack runs
    return tc.cache_key(spec.name, config.dtype, spec.measure_key(config), f"decode steps of {SEQUENCES} sequences, "
                        f"{CONTEXT_NOTE}, us a step", _model_key(cfg, config), f"{ops}, attention "
                        f"{selection.attention.name}")


def _model_key(cfg: Any, config: Any) -> str:
    """What a decode step's speed depends on besides the machine and the kernels (`_key`): the model's
    shapes and formats, the KV cache's element type."""
    quant = cfg.quant.describe() if cfg.quant is not None else "float"
    return (f"{cfg.architecture} {cfg.num_layers} layers, hidden {cfg.hidden_size}, mlp {cfg.intermediate_size}, "
            f"heads {cfg.num_heads}/{cfg.num_kv_heads}x{cfg.head_dim}, vocab {cfg.vocab_size}, qk norm {cfg.qk_norm}, "
            f"{quant}, bf16 weights {cfg.bf16_weights}, kv {config.kv_dtype()}")


def _time_steps(model: Any, backend: Any, config: Any, place: str) -> Figures:
    """Microseconds a decode step, with the stack and layer by layer, per number of sequences."""
    import numpy as np
    import paddle

    from fdplug.core.worker.backend_timing import step_metadata

    sync, cfg, stack = tc.on_device(place), model.config, model.fused_stack
    block = config.block_size
    # each sequence's keys fill its one block (within the positions the RoPE tables hold)
    context = min(block, config.max_model_len or block, cfg.max_position_embeddings) - 1
    shape = list(backend.kv_cache_shape(max(SEQUENCES) + 1, block, cfg.num_kv_heads, cfg.head_dim))
    caches = [(paddle.zeros(shape, config.kv_dtype()), paddle.zeros(shape, config.kv_dtype()))
              for _ in range(cfg.num_layers)]
    got: Figures = {"rows": list(SEQUENCES), "kernel": [], "portable": []}
    try:
        for n in SEQUENCES:
            meta, _ = step_metadata(n, 1, context + 1, block)   # one block each, after the null block
            positions, prepared = meta.positions, backend.prepare(meta)
            ids = paddle.to_tensor((np.arange(n) % cfg.vocab_size).astype(np.int64))
            rope = np.tile(positions, (3, 1)) if cfg.rope.mrope_section else positions   # text rows: t = h = w
            pos = paddle.to_tensor(rope)

            def step(fused: Any, pos: Any = pos, ids: Any = ids, prepared: Any = prepared) -> None:
                model.fused_stack = fused
                model(ids, pos, caches, prepared)

            seconds = tc.median_seconds({"kernel": lambda step=step: step(stack),
                                         "portable": lambda step=step: step(None)}, sync)
            for name, s in seconds.items():
                got[name].append(s * 1e6)
    finally:
        model.fused_stack = stack
    return got
