"""Selection that measures: a ``linear``, ``fp8_linear`` or ``gguf_linear`` kernel runs only the
layer shapes where it is not slower than the portable op, on this machine, as timed once.

Why: a kernel's speed against the library's depends on the machine, not on its priority. The cpu
plugin's AVX-512 tiles fell back to a scalar loop on AVX2-only CPUs (~40x below paddle's matmul)
and were still chosen ("highest priority"); a tile tuned for one cache size can lose on another
CPU's, a GPU kernel on another generation. So a kernel that names an `OpSpec.measure_key`, chosen
by priority, is timed against the portable op on each of the model's layer shapes
(`fdplug.core.model.layers.linear_shapes`) at the row counts the engine gives it (one decode row, a batch
of decodes, a prefill chunk; the lm_head sees only the sampled rows): interleaved pairs, medians
compared. It keeps a shape only if it is not slower at any row count (by more than the timing's
noise, `timing_cache.NOISE`), so the choice is per shape, never per row count, and a row's result
does not depend on its batch. The FP8 and GGUF linears the same, on random weights in the layer's
format (a GGUF projection per block-type group: each group is one call; `LinearShape.weight_dtype`
names the format). The figures are cached per machine and kernel build, under a file
lock (`timing_cache`). `fdplug explain --model DIR` prints each shape's figures. The other ops a
plugin times (norms, RoPE, SwiGLU, argmax) are chosen per op: `row_op_timing`.

Where it is not wanted: the bits of a shape then depend on the machine that timed it (two machines
with the same kernels can split a near tie differently), so ``--op-kernel linear=NAME`` (that
kernel on every shape) or ``FDPLUG_OP_TIMING=off`` (the kernel chosen by priority on every shape)
give a fleet the same bits. A shape whose timing fails runs the portable op (logged, not cached);
another process holding the cache's lock too long, no timing (the kernel on every shape). bf16
weights: a losing shape's portable op widens the layer per call (what ``dtype=auto`` keeps bf16
weights to avoid); the cpu kernels beat it by 1.4-17x on every shape measured, so it stays a
fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fdplug.core.model.layers.linear_shapes import LinearShape, fp8_block_k, linear_shapes
from fdplug.core.worker.timing_cache import (
    NO_FIGURES,
    Figures,
    Timing,
    cache_key,
    cache_path,
    measured,
    median_seconds,
    on_device,
)

logger = logging.getLogger(__name__)

ROWS = (1, 32, 256)        # a decode row, a batch of decodes, a slice of a prefill chunk
LOGITS_ROWS = (1, 32)      # the lm_head runs on the sampled rows only


LINEAR_OPS = ("linear", "fp8_linear", "gguf_linear")   # float, FP8 and GGUF weights: timed per layer shape


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """Which layer shapes the measured kernel of ``op`` runs; the portable op runs the others."""

    kernel: str
    portable: str
    timings: tuple[Timing, ...]     # subject: a `LinearShape`
    cached: bool
    op: str = "linear"

    def uses_kernel(self, shape: LinearShape) -> bool:
        """Whether layers of ``shape`` run the kernel (a shape never measured: yes, as selected,
        with a warning: `linear_shapes` missed a layer the decoder builds)."""
        for timing in self.timings:
            if timing.subject.key == shape.key:
                return timing.kernel_wins
        logger.warning("%s layer %s was not measured: it runs %s as selected", self.op, shape.describe(), self.kernel)
        return True

    def describe(self) -> str:
        wins = sum(t.kernel_wins for t in self.timings)
        head = (f"op:{self.op} per layer shape ({'cached figures' if self.cached else 'measured now'}): "
                f"{self.kernel} on {wins} of {len(self.timings)} shapes"
                + (f", {self.portable} on the others (the kernel slower there)" if wins < len(self.timings) else ""))
        return "\n".join([head, *(self._line(t) for t in self.timings)])

    def _line(self, timing: Timing) -> str:
        verdict = (self.kernel if timing.kernel_wins else self.portable if not timing.rows
                   else f"{self.portable} ({self.kernel} slower at {'/'.join(map(str, timing.slower_at))} rows)")
        return f"  {timing.subject.describe()}: {timing.figures(self.kernel, self.portable)} -> {verdict}"


def plan_linear(selection: Any, config: Any, model_config: Any, op: str = "linear") -> LinearPlan | None:
    """The plan for the selected kernel of ``op`` (one of `LINEAR_OPS`) on ``model_config``'s layers
    (after `ModelConfig.keep_weights`), or None where it is not measured (named explicitly, or no
    ``measure_key``: then it runs every shape; or the model has no layer in that op's format)."""
    spec = selection.ops[op]
    if op not in selection.measured_ops or spec.measure_key is None:
        return None
    from fdplug.core.portable import ops as portable_ops
    from fdplug.core.portable.op_specs import PORTABLE_OPS

    shapes = linear_shapes(model_config, config.dtype, op)
    if not shapes:    # every linear in another op's format (float, FP8 blocks, a GGUF file's): nothing to time
        return None
    key = cache_key(spec.name, config.dtype, spec.measure_key(config), f"rows {ROWS}, lm_head {LOGITS_ROWS}")
    path = cache_path(key)
    kernel, portable, portable_name = spec.factory(config), getattr(portable_ops, op), PORTABLE_OPS[op].name
    prepare = spec.prepare(config) if spec.prepare is not None else None
    place = selection.device.paddle_place_name(config.device_index)

    def time_shape(shape: LinearShape) -> Figures | None:
        try:
            return _time_shape(shape, kernel, prepare, portable, config.dtype, place, op)
        except Exception as exc:   # noqa: BLE001 - any failure: this shape runs the portable op
            logger.warning("timing %s on %s layers %s failed (%r): they run %s", spec.name, op, shape.describe(),
                           exc, portable_name)
            return None

    found = measured(path, key, shapes, _name, time_shape)
    if found is None:
        return None
    figures, cached = found
    timings = tuple(Timing.of(shape, figures.get(_name(shape), NO_FIGURES)) for shape in shapes)
    return LinearPlan(spec.name, portable_name, timings, cached, op)


def _name(shape: LinearShape) -> str:
    n, k, dtype, prepared, logits = shape.key
    return f"{n}x{k}:{dtype}:{'prepared' if prepared else 'in place'}:{'logits' if logits else 'layer'}"


def _time_shape(shape: LinearShape, kernel: Callable, prepare: Callable | None, portable: Callable, dtype: str,
                place: str, op: str = "linear") -> Figures:
    """GFLOP/s of the kernel and of the portable op on random weights of ``shape``, per row count."""
    import numpy as np
    import paddle

    sync = on_device(place)
    n, k = shape.out_features, shape.in_features
    rng = np.random.default_rng(n * 65537 + k)
    kernel_args, portable_args = _weights(op, shape, prepare, rng)
    rows = LOGITS_ROWS if shape.logits else ROWS
    got: Figures = {"rows": list(rows), "kernel": [], "portable": []}
    for r in rows:
        x = paddle.to_tensor(rng.standard_normal((r, k), dtype=np.float32)).astype(dtype)
        seconds = median_seconds({"kernel": lambda x=x: kernel(x, *kernel_args),
                                  "portable": lambda x=x: portable(x, *portable_args)}, sync)
        for name, s in seconds.items():
            got[name].append(2.0 * r * n * k / s / 1e9)
    return got


def _weights(op: str, shape: LinearShape, prepare: Callable | None, rng: Any) -> tuple[tuple, tuple]:
    """The kernel's and the portable op's arguments after ``x``, for random weights of ``shape`` in
    ``op``'s format: the kernel's laid out by its ``prepare`` where the layers are (`LinearShape.prepared`)."""
    import numpy as np
    import paddle

    n, k, fmt = shape.out_features, shape.in_features, shape.weight_dtype
    if op == "gguf_linear":
        from fdplug.core.quant.gguf_blocks import sample_blocks

        raw = paddle.to_tensor(sample_blocks(fmt, n, k, rng))
        laid_out = prepare(raw, fmt) if prepare is not None else None
        return (raw if laid_out is None else laid_out, fmt, k), (raw, fmt, k)
    values = rng.standard_normal((n, k), dtype=np.float32)
    values *= 0.05
    if op == "fp8_linear":
        from fdplug.core.quant.fp8_rows import expand_scale_rows
        from fdplug.plugin_api.fp8 import block_quant

        block_k = fp8_block_k(fmt)
        weight, grid = block_quant(paddle.to_tensor(values), (block_k, block_k))
        scales = expand_scale_rows(grid, n, block_k)
        laid_out = prepare(weight) if prepare is not None else None
        return (weight if laid_out is None else laid_out, scales, block_k), (weight, scales, block_k)
    weight = paddle.to_tensor(values).astype(fmt)
    laid_out = prepare(weight) if prepare is not None and shape.prepared else None
    return (weight if laid_out is None else laid_out,), (weight,)
