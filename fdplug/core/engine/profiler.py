"""Where a step's time goes, summed over steps: read by ``bench/`` and logs, never by control flow."""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

PHASES = ("schedule", "prepare", "forward", "sample", "update")


@dataclass(slots=True)
class StepProfiler:
    """Seconds per phase: ``schedule`` and ``update`` timed by the engine, the runner's own phases
    (``prepare``, ``forward``, ``sample``) taken from ``ModelRunnerOutput.timings``."""

    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    steps: int = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def add(self, timings: Mapping[str, float]) -> None:
        """A runner's phase timings for one step (unknown phases are kept too)."""
        for name, seconds in timings.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def snapshot(self) -> dict[str, float]:
        return dict(self.seconds)
