"""Selection that measures: a ``linear`` kernel runs only the layer shapes where it is not slower
than the portable op, on this machine, as timed once.

Why: a kernel's speed against the library's depends on the machine, not on its priority. The cpu
plugin's AVX-512 tiles fell back to a scalar loop on AVX2-only CPUs (~40x below paddle's matmul)
and were still chosen ("highest priority"); a tile tuned for one cache size can lose on another
CPU's, a GPU kernel on another generation. So a kernel that names an `OpSpec.measure_key`, chosen
by priority, is timed against the portable op on each of the model's layer shapes
(`fdplug.core.model.layers.linear_shapes`) at the row counts the engine gives it (one decode row, a batch
of decodes, a prefill chunk; the lm_head sees only the sampled rows): interleaved pairs, medians
compared. It keeps a shape only if it is not slower at any row count (by more than the timing's
noise, `NOISE`), so the choice is per shape, never per row count, and a row's result does not
depend on its batch. The figures are
cached under the kernel's ``measure_key`` (the CPU model and level, the kernel build, the threads)
in ``$FDPLUG_CACHE_DIR/op_timings/``, measured under a file lock: every process of a machine (DP
ranks, a PD pair) uses the same figures, so the same kernels. `fdplug explain --model DIR` prints
each shape's figures.

Where it is not wanted: the bits of a shape then depend on the machine that timed it (two machines
with the same kernels can split a near tie differently), so ``--op-kernel linear=NAME`` (that
kernel on every shape) or ``FDPLUG_OP_TIMING=off`` (the kernel chosen by priority on every shape)
give a fleet the same bits. A shape whose timing fails runs the portable op (logged, not cached);
an unusable cache directory means timing without it; another process holding the lock past
`LOCK_TIMEOUT_S`, no timing (the kernel on every shape). bf16 weights: a losing shape's portable op
widens the layer per call (what ``dtype=auto`` keeps bf16 weights to avoid); the cpu kernels beat
it by 1.4-17x on every shape measured, so it stays a fallback.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fdplug.core.model.layers.linear_shapes import LinearShape, linear_shapes
from fdplug.core.portable.file_lock import lock_within
from fdplug.plugin_api.settings import cache_dir

logger = logging.getLogger(__name__)

ROWS = (1, 32, 256)        # a decode row, a batch of decodes, a slice of a prefill chunk
LOGITS_ROWS = (1, 32)      # the lm_head runs on the sampled rows only
PAIRS = 5                  # interleaved (kernel, portable) timings per row count
CALL_SECONDS = 0.01        # a timing repeats the call for about this long (a 1-row call can take ~10 us)
NOISE = 0.05               # slower by less than this is a tie (this machine drifts; medians of 5 pairs differ ~2-4%)
LOCK_TIMEOUT_S = 300.0     # another process measuring the same kernel: wait for its figures this long


@dataclass(frozen=True, slots=True)
class ShapeTiming:
    """One shape's figures: GFLOP/s of the kernel and of the portable op at each row count."""

    shape: LinearShape
    rows: tuple[int, ...]
    kernel_gflops: tuple[float, ...]
    portable_gflops: tuple[float, ...]

    @classmethod
    def of(cls, shape: LinearShape, figures: dict[str, list]) -> ShapeTiming:
        """From one shape's entry of the cache file (``rows``, ``kernel``, ``portable``)."""
        return cls(shape, *(tuple(figures[field]) for field in ("rows", "kernel", "portable")))

    @property
    def slower_at(self) -> tuple[int, ...]:
        """The row counts where the kernel was slower than the portable op, by more than the noise
        (two kernels at the machine's peak tie: a 1,024-row GEMM is not a reason to lose decode's 1.6x)."""
        return tuple(r for r, k, p in zip(self.rows, self.kernel_gflops, self.portable_gflops) if k < p * (1 - NOISE))

    @property
    def kernel_wins(self) -> bool:
        """Not slower anywhere (a shape whose timing failed has no figures: it does not win)."""
        return bool(self.rows) and not self.slower_at

    def line(self, kernel: str, portable: str) -> str:
        def figures(values: tuple[float, ...]) -> str:
            return "/".join(f"{v:.1f}" for v in values)

        if not self.rows:
            return f"  {self.shape.describe()}: timing failed (see the log) -> {portable}"
        verdict = (kernel if self.kernel_wins
                   else f"{portable} ({kernel} slower at {'/'.join(map(str, self.slower_at))} rows)")
        return (f"  {self.shape.describe()}: {kernel} {figures(self.kernel_gflops)} vs {portable} "
                f"{figures(self.portable_gflops)} GFLOP/s at {'/'.join(map(str, self.rows))} rows -> {verdict}")


@dataclass(frozen=True, slots=True)
class LinearPlan:
    """Which layer shapes the measured kernel runs; the portable op runs the others."""

    kernel: str
    portable: str
    timings: tuple[ShapeTiming, ...]
    cached: bool

    def uses_kernel(self, shape: LinearShape) -> bool:
        """Whether layers of ``shape`` run the kernel (a shape never measured: yes, as selected,
        with a warning: `linear_shapes` missed a layer the decoder builds)."""
        for timing in self.timings:
            if timing.shape.key == shape.key:
                return timing.kernel_wins
        logger.warning("linear layer %s was not measured: it runs %s as selected", shape.describe(), self.kernel)
        return True

    def describe(self) -> str:
        wins = sum(t.kernel_wins for t in self.timings)
        head = (f"op:linear per layer shape ({'cached figures' if self.cached else 'measured now'}): "
                f"{self.kernel} on {wins} of {len(self.timings)} shapes"
                + (f", {self.portable} on the others (the kernel slower there)" if wins < len(self.timings) else ""))
        return "\n".join([head, *(t.line(self.kernel, self.portable) for t in self.timings)])


def plan_linear(selection: Any, config: Any, model_config: Any) -> LinearPlan | None:
    """The plan for the selected ``linear`` kernel on ``model_config``'s layers (after
    `ModelConfig.keep_weights`), or None where it is not measured (named explicitly, or no
    ``measure_key``: then it runs every shape; or the model has no float linear layer)."""
    spec = selection.ops["linear"]
    if "linear" not in selection.measured_ops or spec.measure_key is None:
        return None
    from fdplug.core.portable import PORTABLE_LINEAR
    from fdplug.core.portable.ops import linear as portable

    shapes = linear_shapes(model_config, config.dtype)
    if not shapes:    # every linear in another op's format (FP8 blocks, a GGUF file's): nothing to time
        return None
    key = (f"{spec.name}|{config.dtype}|{spec.measure_key(config)}|rows {ROWS}, lm_head {LOGITS_ROWS}, {PAIRS} "
           f"pairs of {CALL_SECONDS} s")
    path = cache_dir() / "op_timings" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"
    kernel = spec.factory(config)
    prepare = spec.prepare(config) if spec.prepare is not None else None
    place = selection.device.paddle_place_name(config.device_index)

    def time_shape(shape: LinearShape) -> dict[str, list] | None:
        try:
            return _time_shape(shape, kernel, prepare, portable, config.dtype, place)
        except Exception as exc:   # noqa: BLE001 - any failure: this shape runs the portable op
            logger.warning("timing %s on linear layers %s failed (%r): they run %s", spec.name, shape.describe(),
                           exc, PORTABLE_LINEAR)
            return None

    measured = _measured(path, key, shapes, time_shape)
    if measured is None:
        return None
    figures, cached = measured
    timings = tuple(ShapeTiming.of(shape, figures.get(_name(shape), _NONE)) for shape in shapes)
    return LinearPlan(spec.name, PORTABLE_LINEAR, timings, cached)


_NONE = {"rows": [], "kernel": [], "portable": []}   # a shape whose timing failed


def _name(shape: LinearShape) -> str:
    n, k, dtype, prepared, logits = shape.key
    return f"{n}x{k}:{dtype}:{'prepared' if prepared else 'in place'}:{'logits' if logits else 'layer'}"


def _measured(path: Any, key: str, shapes: list[LinearShape],
              time_shape: Callable[[LinearShape], dict[str, list] | None]) -> tuple[dict[str, dict], bool] | None:
    """The figures of every shape (a failed one left out): from the cache file where it has them, else
    timed now and added to it, shape by shape; under the file's lock, so that processes starting
    together time each shape once. None: another process kept the lock past LOCK_TIMEOUT_S."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a+")   # noqa: SIM115 - held below, closed by the with
    except OSError as exc:
        logger.warning("cannot use %s (%s): timing the linear shapes without a cache", path.parent, exc)
        figures = {_name(shape): time_shape(shape) for shape in shapes}
        return {name: entry for name, entry in figures.items() if entry is not None}, False
    with lock:
        if not _locked(lock, path):
            return None
        figures = _read(path, key)
        missing = [shape for shape in shapes if _name(shape) not in figures]
        for shape in missing:
            entry = time_shape(shape)
            if entry is not None:
                figures[_name(shape)] = entry
                _write(path, key, figures)    # after each shape: what was timed stays if a later one fails
    return figures, not missing


def _locked(lock: Any, path: Any) -> bool:
    """Take the lock within LOCK_TIMEOUT_S (False: still held elsewhere); where the file system has
    no locks, go on without."""
    taken = lock_within(lock, LOCK_TIMEOUT_S)
    if taken is False:
        logger.warning("%s stayed locked for %.0f s: the linear kernel runs every shape, untimed",
                       path.with_suffix(".lock"), LOCK_TIMEOUT_S)
    elif taken is None:
        logger.warning("cannot lock %s (the file system has no locks): timing without the lock",
                       path.with_suffix(".lock"))
    return taken is not False


def _read(path: Any, key: str) -> dict[str, dict]:
    """The cached figures under ``key`` (empty where the file is missing, unreadable or another key's)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("key") != key or not isinstance(data.get("shapes"), dict):
        return {}
    return {name: entry for name, entry in data["shapes"].items() if _valid(entry)}


def _valid(entry: Any) -> bool:
    return (isinstance(entry, dict) and all(isinstance(entry.get(f), list) for f in ("rows", "kernel", "portable"))
            and len(entry["rows"]) == len(entry["kernel"]) == len(entry["portable"]) > 0
            and all(isinstance(v, (int, float)) and v > 0 for f in ("rows", "kernel", "portable") for v in entry[f]))


def _write(path: Any, key: str, figures: dict[str, dict]) -> None:
    """The cache file replaced at once (a reader sees the old one or the new one); a failure is logged."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"key": key, "shapes": figures}, f, indent=1)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        logger.warning("cannot write %s (%s): the linear shapes will be timed again next start", path, exc)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def _time_shape(shape: LinearShape, kernel: Callable, prepare: Callable | None, portable: Callable, dtype: str,
                place: str) -> dict[str, list]:
    """GFLOP/s of the kernel and of the portable op on random weights of ``shape``, per row count."""
    import numpy as np
    import paddle

    paddle.set_device(place)
    n, k = shape.out_features, shape.in_features
    rng = np.random.default_rng(n * 65537 + k)
    values = rng.standard_normal((n, k), dtype=np.float32)
    values *= 0.05
    weight = paddle.to_tensor(values).astype(shape.weight_dtype)
    del values
    laid_out = prepare(weight) if prepare is not None and shape.prepared else None
    kernel_weight = weight if laid_out is None else laid_out
    rows = LOGITS_ROWS if shape.logits else ROWS
    got: dict[str, list] = {"rows": list(rows), "kernel": [], "portable": []}
    sync = (lambda: None) if place == "cpu" else paddle.device.synchronize
    for r in rows:
        x = paddle.to_tensor(rng.standard_normal((r, k), dtype=np.float32)).astype(dtype)
        calls = {"kernel": lambda x=x: kernel(x, kernel_weight), "portable": lambda x=x: portable(x, weight)}
        for call in calls.values():   # first calls allocate, convert, fault pages in: not timed
            call()
        sync()
        timed: dict[str, list[float]] = {"kernel": [], "portable": []}
        for i in range(PAIRS):       # ABBA...: neither always goes first
            for name in (("kernel", "portable") if i % 2 == 0 else ("portable", "kernel")):
                timed[name].append(_seconds(calls[name], sync))
        for name, seconds in timed.items():
            got[name].append(2.0 * r * n * k / statistics.median(seconds) / 1e9)
    return got


def _seconds(call: Callable[[], Any], sync: Callable[[], Any]) -> float:
    """Seconds a call: repeated for about CALL_SECONDS (at least once)."""
    calls, start = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= CALL_SECONDS:
            return elapsed / calls
