"""Selection that measures, for the row ops: a kernel for ``rms_norm``, ``add_rms_norm``, ``rope``,
``swiglu`` or ``argmax`` runs only where it is not slower than the portable op, on this machine.

Why: as for the linears (`op_timing`), a kernel's priority says nothing of its speed on a given
CPU. These ops are cheap and memory-bound, so a compiled kernel's gain is the Python and allocation
cost of paddle's several ops, and at one decode row a call's fixed cost decides (at x86-64-v2, the
cpu plugin's SwiGLU at one token lost to paddle's, 0.82x). A kernel of these ops that names an
`OpSpec.measure_key`, chosen by priority, is timed against the portable op on each shape the model
gives the op (`row_cases`: the hidden rows, Qwen3's q/k heads, each MLP's gate and up, the
vocabulary) at the row counts the engine gives it (`op_timing.ROWS`; argmax the sampled rows,
`op_timing.LOGITS_ROWS`): a call's microseconds, interleaved pairs, medians (`timing_cache`). The
choice is per op, not per shape: where the kernel is slower (beyond the timing's noise) on any
shape at any row count, or its timing failed, the whole op runs the portable one, so a row's result
depends neither on its batch nor on which layer calls the op; the fused decoder stack, which runs
the plugin's own kernels, then declines (`fdplug.plugins.cpu.native_stack`). The plan is settled
after load (`RowOpsPlan.settle`): where a stack runs the decode steps, the ops inside it
(`fused_stack.OPS_INSIDE`) are never called at one row, so that figure does not count for them
(the cpu plugin's SwiGLU at one row ties paddle's single C++ op, and losing the stack over it would
cost decode ~2x); if a swap then makes the stack decline, the one-row figures count again. A vision
tower's calls of these ops (other widths) are not timed: they follow the op's choice.

Figures are cached with the linears' (`timing_cache`), one file per kernel and measure key;
`fdplug explain --model DIR` prints them. ``--op-kernel OP=NAME`` or ``FDPLUG_OP_TIMING=0`` keep a
kernel without timing it (a fleet's same bits).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fdplug.core.model.layers import fused_stack
from fdplug.core.model.layers.basic import use_row_kernels
from fdplug.core.worker import timing_cache as tc
from fdplug.core.worker.op_timing import LOGITS_ROWS, ROWS
from fdplug.core.worker.timing_cache import Figures, Timing

logger = logging.getLogger(__name__)

ROW_OPS = ("rms_norm", "add_rms_norm", "rope", "swiglu", "argmax")   # of MEASURED_OPS, timed per op
DECODE_ROWS = ROWS[0]    # one decode row: with a fused decoder stack, the ops inside it are not called there
EPS = 1e-6


@dataclass(frozen=True, slots=True)
class RowCase:
    """One shape the model gives a row op: ``width`` is one row's (the op's trailing dimensions)."""

    op: str
    width: tuple[int, ...]
    what: str

    @property
    def name(self) -> str:
        """Its entry in the cache file."""
        return f"{self.op}:{'x'.join(map(str, self.width))}"

    @property
    def rows(self) -> tuple[int, ...]:
        return LOGITS_ROWS if self.op == "argmax" else ROWS

    def describe(self) -> str:
        return f"[{', '.join(map(str, self.width))}] ({self.what})"

    def arguments(self, rows: int, rng: Any, dtype: str = "float32") -> tuple:
        """The op's arguments for ``rows`` rows, in the compute ``dtype`` as the engine passes them
        (argmax's logits: float32 always, `DecoderForCausalLM.compute_logits`)."""
        import paddle

        dtype = "float32" if self.op == "argmax" else dtype

        def tensor(*shape: int) -> Any:
            return paddle.to_tensor(rng.standard_normal(shape, dtype="float32")).astype(dtype)

        x = tensor(rows, *self.width)
        if self.op == "rms_norm":
            return x, tensor(*self.width), EPS
        if self.op == "add_rms_norm":
            return x, tensor(rows, *self.width), tensor(*self.width), EPS
        if self.op == "rope":
            return x, tensor(rows, *self.width), tensor(rows, *self.width)
        return (x,)    # swiglu's gate and up, argmax's logits


def row_cases(cfg: Any, ops: tuple[str, ...] = ROW_OPS) -> list[RowCase]:
    """The shapes ``cfg``'s decoder gives each of ``ops`` (`ModelConfig`), in `ROW_OPS` order."""
    hidden, heads = (cfg.hidden_size,), (cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
    moe_layers = set(cfg.moe.layers) if cfg.moe is not None else set()
    mlps = ([cfg.intermediate_size] if len(moe_layers) < cfg.num_layers else []) + \
        ([cfg.moe.shared_intermediate_size] if moe_layers and cfg.moe.shared_intermediate_size else [])
    widths = {"rms_norm": [(hidden, "hidden"), *([(heads, "q and k heads")] if cfg.qk_norm else [])],
              "add_rms_norm": [(hidden, "hidden")],
              "rope": [(heads, "q and k heads")],
              "swiglu": [((2 * w,), f"gate and up of an MLP of width {w}") for w in dict.fromkeys(mlps)],
              "argmax": [((cfg.vocab_size,), "vocabulary")]}
    return [RowCase(op, width, what) for op in ROW_OPS if op in ops for width, what in widths[op]]


@dataclass(frozen=True, slots=True)
class RowOpsPlan:
    """Which measured row ops keep their kernel; the others run the portable op."""

    kernels: Mapping[str, str]       # op -> the kernel selected by priority
    portables: Mapping[str, Any]     # op -> the portable op's `OpSpec`
    timings: tuple[Timing, ...]      # subject: a `RowCase`
    cached: bool

    def slower(self, op: str, in_stack: Collection[str] = ()) -> list[str]:
        """Where ``op``'s kernel was slower (each as 'SHAPE at ROWS rows' or 'SHAPE: timing failed');
        empty: it keeps the kernel. For an op in ``in_stack`` (a fused decoder stack runs decode steps
        and this op inside them, `fused_stack.OPS_INSIDE`), the decode row's figure does not count:
        the engine does not call the op there."""
        lost = []
        for timing in (t for t in self.timings if t.subject.op == op):
            rows = [r for r in timing.slower_at if op not in in_stack or r != DECODE_ROWS]
            if not timing.rows:
                lost.append(f"{timing.subject.describe()}: timing failed")
            elif rows:
                lost.append(f"{timing.subject.describe()} at {'/'.join(map(str, rows))} rows")
        return lost

    def losing(self, in_stack: Collection[str] = ()) -> list[str]:
        """The ops that run the portable op (`slower`)."""
        return [op for op in self.kernels if self.slower(op, in_stack)]

    def describe(self, in_stack: Collection[str] | None = ()) -> str:
        """The figures and each op's verdict (``in_stack`` None: not known whether a fused stack runs
        decode steps, so where that changes a verdict both are said)."""
        known = () if in_stack is None else in_stack
        kept = len(self.kernels) - len(self.losing(known))
        lines = [f"row ops per op ({'cached figures' if self.cached else 'measured now'}): the kernel on "
                 f"{kept} of {len(self.kernels)}, where not slower than the portable op on any of the "
                 "model's shapes"]
        for op, kernel in self.kernels.items():
            verdict = self._verdict(op, known)
            if in_stack is None and self.slower(op) and not self.slower(op, fused_stack.OPS_INSIDE):
                verdict += f"; where a fused decoder stack runs the decode steps (the log says): -> {kernel}"
            lines.append(f"  op:{op} {verdict}")
            lines.extend(f"    {t.subject.describe()}: {t.figures(kernel, self.portables[op].name)}"
                         for t in self.timings if t.subject.op == op)
        return "\n".join(lines)

    def _verdict(self, op: str, in_stack: Collection[str]) -> str:
        lost, anywhere = self.slower(op, in_stack), self.slower(op)
        if lost:
            return f"-> {self.portables[op].name} ({self.kernels[op]} slower on {'; '.join(lost)})"
        stack_only = f" (slower on {'; '.join(anywhere)}: one decode row, which the fused decoder stack runs)"
        return f"-> {self.kernels[op]}" + (stack_only if anywhere else "")

    def settle(self, model: Any, kernels: Any, selection: Any, config: Any) -> tuple[Any, Any, list[str]]:
        """After load and the fused stack's attach: the losing ops' portable kernels in ``kernels``, in
        ``selection`` and in the model's layers (`basic.use_row_kernels`). Where a stack runs decode
        steps, its ops are judged without their decode figure; if a swap then makes it decline, they
        are judged again with it. -> (selection, kernels, log lines)."""
        stacked = model.fused_stack is not None
        in_stack = fused_stack.OPS_INSIDE if stacked else ()
        losing, log = self.losing(in_stack), self.describe(in_stack).splitlines()
        if not losing:
            return selection, kernels, log
        selection, kernels = self._swap(losing, model, kernels, selection, config)
        if stacked:
            log.append(fused_stack.attach(model, kernels, selection))
            if model.fused_stack is None and set(self.losing()) - set(losing):
                losing = self.losing()
                log.append("the decoder stack declined: the decode row's figures count again: the portable op for "
                           + ", ".join(losing))
                selection, kernels = self._swap(losing, model, kernels, selection, config)
        return selection, kernels, log

    def _swap(self, losing: list[str], model: Any, kernels: Any, selection: Any, config: Any) -> tuple[Any, Any]:
        portable = {op: self.portables[op] for op in losing}
        kernels = dataclasses.replace(kernels, **{op: spec.factory(config) for op, spec in portable.items()})
        use_row_kernels(model, kernels)
        return dataclasses.replace(selection, ops=MappingProxyType({**selection.ops, **portable})), kernels


def plan_row_ops(selection: Any, config: Any, model_config: Any) -> RowOpsPlan | None:
    """The plan for the measured row ops' kernels on ``model_config``'s shapes, or None where none
    is measured (named explicitly, no ``measure_key``, FDPLUG_OP_TIMING=0) or another process held
    the figures' lock too long (then every kernel runs as selected)."""
    from fdplug.core.portable import ops as portable
    from fdplug.core.portable.op_specs import PORTABLE_OPS

    ops = tuple(op for op in ROW_OPS if op in selection.measured_ops and selection.ops[op].measure_key is not None)
    if not ops:
        return None
    place = selection.device.paddle_place_name(config.device_index)
    kernels = {op: selection.ops[op].factory(config) for op in ops}
    cases = row_cases(model_config, ops)
    figures: dict[str, Figures] = {}
    cached = True
    for op in ops:      # one cache file per kernel: its key is the kernel's
        spec = selection.ops[op]
        key = tc.cache_key(spec.name, config.dtype, spec.measure_key(config),
                           f"rows {ROWS}, sampled {LOGITS_ROWS}, us a call")

        def time_case(case: RowCase, spec: Any = spec) -> Figures | None:
            try:
                return _time_case(case, kernels[case.op], getattr(portable, case.op), place, config.dtype)
            except Exception as exc:   # noqa: BLE001 - any failure: the op runs the portable one
                logger.warning("timing %s on %s failed (%r): op %s runs %s", spec.name, case.describe(), exc,
                               case.op, PORTABLE_OPS[case.op].name)
                return None

        found = tc.measured(tc.cache_path(key), key, [c for c in cases if c.op == op], lambda c: c.name, time_case)
        if found is None:
            return None
        figures.update(found[0])
        cached = cached and found[1]
    timings = tuple(Timing.of(case, figures.get(case.name, tc.NO_FIGURES), "us") for case in cases)
    return RowOpsPlan({op: selection.ops[op].name for op in ops}, {op: PORTABLE_OPS[op] for op in ops}, timings,
                      cached)


def _time_case(case: RowCase, kernel: Any, portable: Any, place: str, dtype: str) -> Figures:
    """Microseconds a call of the kernel and of the portable op on random values of ``case``, per row count."""
    import numpy as np

    sync = tc.on_device(place)
    rng = np.random.default_rng(sum(case.width) * 65537 + len(case.op))
    got: Figures = {"rows": list(case.rows), "kernel": [], "portable": []}
    for rows in case.rows:
        args = case.arguments(rows, rng, dtype)
        seconds = tc.median_seconds({"kernel": lambda args=args: kernel(*args),
                                     "portable": lambda args=args: portable(*args)}, sync)
        for name, s in seconds.items():
            got[name].append(s * 1e6)
    return got
