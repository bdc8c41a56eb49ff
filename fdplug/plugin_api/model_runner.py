"""The model-runner contract: what the engine calls, once per step, on the runner it was given.

The core's portable runner (`fdplug.core.worker.model_runner.ModelRunner`) implements it for every
device; a plugin writes its own only for a different execution model (graphs, a vendor runtime).

Lifecycle: ``load_model()`` once (returns the `ModelInfo` the engine checks requests against),
``initialize_kv_cache()`` once (returns the `KVCachePlan` the scheduler allocates from), then
``execute_model(scheduler_output)`` per step. The scheduler owns the KV cache's block table and
every request's progress; the runner mirrors what it is told in ``SchedulerOutput`` (new requests,
new blocks, finished and preempted ids) and never decides on its own.

Fault containment: a failure a runner can pin on particular requests is raised as
`fdplug.errors.RequestStepError` naming them; anything else fails the step, and the engine isolates
the culprits by re-running subsets. After a failed step the engine compares ``held_requests()`` with
the scheduler and, if they disagree, calls ``drop_all_requests()`` and re-adds every request.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from fdplug.plugin_api.scheduled_work import SchedulerOutput

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What the engine needs to know about the loaded model."""

    vocab_size: int            # sampled ids must be below it
    hidden_size: int           # multimodal feature rows must be this wide
    num_bytes: int             # weights in device memory


@dataclass(frozen=True, slots=True)
class KVCachePlan:
    """The KV cache the runner allocated: ``num_blocks`` includes the null block 0."""

    num_blocks: int
    block_size: int
    bytes_per_block: int
    dtype: str = ""            # the element type (--kv-cache-dtype; "": not said, API 3.13)

    @property
    def num_tokens(self) -> int:
        return (self.num_blocks - 1) * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    def describe(self) -> str:
        return (f"{self.num_blocks - 1} blocks x {self.block_size} tokens = {self.num_tokens} tokens, "
                f"{format_bytes(self.total_bytes)}" + (f" of {self.dtype}" if self.dtype else ""))


def format_bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


@dataclass(slots=True)
class ModelRunnerOutput:
    """One step's result: sampled tokens per request (only requests that sampled), and their logprobs
    ``(token ids, logprobs, ranks)`` when asked for. ``timings`` are seconds per phase, for profiling."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, tuple[list[int], list[float], list[int]]] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class ModelRunner(Protocol):
    """What a `fdplug.plugin_api.specs.ModelRunnerSpec` factory returns."""

    def load_model(self) -> ModelInfo:
        """Build the model on the device and load its weights."""
        ...

    def initialize_kv_cache(self) -> KVCachePlan:
        """Size and allocate the paged KV cache (after the model, so its memory is known)."""
        ...

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Apply the scheduler's changes, run one forward over the scheduled tokens, sample."""
        ...

    def held_requests(self) -> dict[str, tuple[int, int]]:
        """Every request held, with (tokens whose KV is computed, tokens known); raises if the runner's
        own state is inconsistent."""
        ...

    def drop_all_requests(self) -> None:
        """Forget every request, whatever state they are in (the engine re-adds them)."""
        ...
