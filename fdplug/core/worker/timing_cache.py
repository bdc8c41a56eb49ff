"""What selection that measures shares: the interleaved timer, the tie rule, and the figures' cache.

Three plans time a kernel against the portable op once per machine: the linear kernels (float, FP8,
GGUF) per layer shape (`op_timing`), the row ops' kernels (norms, RoPE, SwiGLU, argmax) per op
(`row_op_timing`), and a fused decoder stack on the loaded model's decode steps (`stack_timing`).
All time the two calls alternately (ABBA...: neither always goes first, so a
machine's drift hits both), take medians, call a difference within `NOISE` a tie, and cache the
figures in ``$FDPLUG_CACHE_DIR/op_timings/`` under a key that changes whenever they could (the
kernel's ``measure_key``: the CPU model and level, the kernel build, the threads), measured under a
file lock: every process of a machine (DP ranks, a PD pair) uses the same figures, so the same
kernels. An unusable cache directory means timing without it; another process holding the lock past
`LOCK_TIMEOUT_S`, no timing (the caller keeps the kernel chosen by priority).
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fdplug.core.portable.file_lock import lock_within
from fdplug.plugin_api.settings import cache_dir

logger = logging.getLogger(__name__)

PAIRS = 5                  # interleaved (kernel, portable) timings per row count
DECISIVE = 3.0             # a kernel this much faster in the first pair is decided: no later pair could turn it
CALL_SECONDS = 0.01        # a timing repeats the call for about this long (a 1-row call can take ~10 us)
MIN_CALLS = 3              # ... and at least this often
LONG_WINDOW_S = 0.1        # ... unless the window is this long already: so long a call is its own evidence
NOISE = 0.05               # slower by less than this is a tie (this machine drifts; medians of 5 pairs differ ~2-4%)
LOCK_TIMEOUT_S = 300.0     # another process measuring the same kernel: wait for its figures this long

Figures = dict[str, list]
"""One item's entry: ``rows``, and the ``kernel``'s and the ``portable`` op's figure at each."""
NO_FIGURES: Figures = {"rows": [], "kernel": [], "portable": []}   # an item whose timing failed


def cache_key(*parts: str) -> str:
    """The key figures are cached under: ``parts`` (the kernel, the dtype, its ``measure_key``, the row
    counts) and this module's timing constants, joined."""
    return "|".join([*parts, f"{PAIRS} pairs of {CALL_SECONDS} s, {MIN_CALLS} calls at least or {LONG_WINDOW_S} s, "
                             "a round untimed, "
                             f"one pair where the kernel is {DECISIVE}x faster, "
                             "twice where the kernel looks slower"])


def cache_path(key: str) -> Path:
    """The cache file of the figures measured under ``key``."""
    return cache_dir() / "op_timings" / f"{hashlib.sha256(key.encode()).hexdigest()[:20]}.json"


@dataclass(frozen=True, slots=True)
class Timing:
    """One item's figures (a layer shape, a row op's shape): the kernel's and the portable op's at
    each row count, in ``unit``: ``GFLOP/s`` (higher is faster) or ``us`` a call (lower is)."""

    subject: Any
    rows: tuple[int, ...]
    kernel: tuple[float, ...]
    portable: tuple[float, ...]
    unit: str = "GFLOP/s"

    @classmethod
    def of(cls, subject: Any, figures: Figures, unit: str = "GFLOP/s") -> Timing:
        """From one item's entry of the cache file (`Figures`)."""
        return cls(subject, *(tuple(figures[field]) for field in ("rows", "kernel", "portable")), unit)

    @property
    def slower_at(self) -> tuple[int, ...]:
        """The row counts where the kernel was slower than the portable op by more than `NOISE` (two
        kernels at the machine's peak tie: a 1,024-row GEMM is not a reason to lose decode's 1.6x)."""
        if self.unit == "us":     # seconds: compared as calls a second
            return tuple(r for r, k, p in zip(self.rows, self.kernel, self.portable) if p < k * (1 - NOISE))
        return tuple(r for r, k, p in zip(self.rows, self.kernel, self.portable) if k < p * (1 - NOISE))

    @property
    def kernel_wins(self) -> bool:
        """Not slower anywhere (an item whose timing failed has no figures: it does not win)."""
        return bool(self.rows) and not self.slower_at

    def figures(self, kernel: str, portable: str) -> str:
        """``kernel a/b/c vs portable d/e/f UNIT at 1/32/256 rows`` (or that the timing failed)."""
        def values(v: tuple[float, ...]) -> str:
            return "/".join(f"{x:.1f}" for x in v)

        if not self.rows:
            return "timing failed (see the log)"
        return (f"{kernel} {values(self.kernel)} vs {portable} {values(self.portable)} {self.unit} at "
                f"{'/'.join(map(str, self.rows))} rows")


def on_device(place: str) -> Callable[[], Any]:
    """Paddle set to ``place`` (a device's paddle place name); -> the wait for its queued work (a
    no-op on the CPU, whose ops return done)."""
    import paddle

    paddle.set_device(place)
    return (lambda: None) if place == "cpu" else paddle.device.synchronize


def median_seconds(calls: Mapping[str, Callable[[], Any]], sync: Callable[[], Any]) -> dict[str, float]:
    """Median seconds a call of ``kernel`` and ``portable`` (the two of ``calls``), timed in `PAIRS`
    alternated rounds after an untimed round of each: first calls allocate, convert and fault pages
    in, and the allocator takes a few calls to settle on reusing a large output's memory (a [256,
    3072] float32 output: ~15 page faults a call for the first ~100 calls, none after, AMD EPYC,
    avx2-or-less; the engine runs in that steady state). Where the kernel then looks slower by more
    than `NOISE`, where the verdict hinges, `PAIRS` more rounds are timed and the medians taken over
    all. The 256-row GEMMs of SmolLM2's float32 layers, a tie at the FMA peak called in a steady loop,
    had sent one and three of its four layer shapes to paddle's matmul in two runs; with both, 0-2 in
    four (AMD EPYC, avx2-or-less: on that VM such a tie stays a coin toss at the 5% line). Where the
    first pair has the kernel `DECISIVE` times faster, that pair decides: the portable GGUF and FP8 ops
    dequantize a layer per call (~100x slower at one row), and timing them five times over took most
    of a first start (SmolLM2's Q4_1 file: 21 s against 9 with cached figures)."""
    for call in calls.values():
        _seconds(call, sync)
    names = list(calls)
    timed: dict[str, list[float]] = {name: [] for name in names}
    def medians() -> dict[str, float]:
        return {name: statistics.median(seconds) for name, seconds in timed.items()}

    for i in range(2 * PAIRS):
        for name in (names if i % 2 == 0 else names[::-1]):
            timed[name].append(_seconds(calls[name], sync))
        if i == 0 and timed["portable"][0] >= DECISIVE * timed["kernel"][0]:
            break   # far beyond the drift; a wrong call here would need a 3x spike, and keeps the priority's choice
        if i == PAIRS - 1:
            first = medians()
            if first["portable"] >= first["kernel"] * (1 - NOISE):
                break
    return medians()


def _seconds(call: Callable[[], Any], sync: Callable[[], Any]) -> float:
    """Seconds a call: repeated for about CALL_SECONDS, and at least `MIN_CALLS` times (a 256-row GEMM
    takes 2-7 ms: one or two calls a window were at the mercy of a single slow one), or until the
    window has run `LONG_WINDOW_S` (a call that long is not at the mercy of a hiccup, and three of
    them add up: the reference MoE over a 30B model's GGUF experts takes 0.35-4 s a call, AMD EPYC,
    avx2-or-less)."""
    calls, start = 0, time.perf_counter()
    while True:
        call()
        calls += 1
        sync()
        elapsed = time.perf_counter() - start
        if elapsed >= CALL_SECONDS and (calls >= MIN_CALLS or elapsed >= LONG_WINDOW_S):
            return elapsed / calls


def measured(path: Path, key: str, items: list[Any], name: Callable[[Any], str],
             time_item: Callable[[Any], Figures | None]) -> tuple[dict[str, Figures], bool] | None:
    """The figures of every item (a failed one left out), by ``name(item)``: from the cache file where
    it has them, else timed now and added to it, item by item; under the file's lock, so that
    processes starting together time each item once. -> (figures, whether all came from the cache);
    None: another process kept the lock past LOCK_TIMEOUT_S."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "a+")   # noqa: SIM115 - held below, closed by the with
    except OSError as exc:
        logger.warning("cannot use %s (%s): timing the kernels without a cache", path.parent, exc)
        figures = {name(item): time_item(item) for item in items}
        return {n: entry for n, entry in figures.items() if entry is not None}, False
    with lock:
        if not _locked(lock, path):
            return None
        figures = read_figures(path, key)
        missing = [item for item in items if name(item) not in figures]
        for item in missing:
            entry = time_item(item)
            if entry is not None:
                figures[name(item)] = entry
                _write(path, key, figures)    # after each item: what was timed stays if a later one fails
    return figures, not missing


def _locked(lock: Any, path: Path) -> bool:
    """Take the lock within LOCK_TIMEOUT_S (False: still held elsewhere); where the file system has
    no locks, go on without."""
    taken = lock_within(lock, LOCK_TIMEOUT_S)
    if taken is False:
        logger.warning("%s stayed locked for %.0f s: the kernel chosen by priority runs, untimed",
                       path.with_suffix(".lock"), LOCK_TIMEOUT_S)
    elif taken is None:
        logger.warning("cannot lock %s (the file system has no locks): timing without the lock",
                       path.with_suffix(".lock"))
    return taken is not False


def read_figures(path: Path, key: str) -> dict[str, Figures]:
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


def _write(path: Path, key: str, figures: dict[str, Figures]) -> None:
    """The cache file replaced at once (a reader sees the old one or the new one); a failure is logged."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(suffix=".json", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"key": key, "shapes": figures}, f, indent=1)
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        logger.warning("cannot write %s (%s): the kernels will be timed again next start", path, exc)
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
