"""EngineCore: the step loop every device shares.

    def step(self):
        outputs = self._poll()                                  # step extensions: ready, failed, pulled
        scheduler_output = self._schedule()                     # (extensions hear of the preempted)
        if scheduler_output.is_empty: return outputs + self._idle(scheduler_output), False
        return outputs + self._run(scheduler_output), True      # runner, recovery, update

Features that act around a step are step extensions (`fdplug.core.scheduler.step_extension`),
registered from the configuration (`_extensions`): multimodal feature fetching (`features`) and a
PD instance's side of the KV transfer (`fdplug.core.kv_transfer`); the loop names none of them.

Requests are checked against the running model when they are admitted (``admission``), so a value
the model cannot take is refused before it can reach a step. When a step raises anyway (a kernel
error, a bug, a runner that blames a request), the executor finds the requests that caused it: they
finish with finish reason "error" and a typed error, and the others finish the step as if nothing
had happened (``executor``, ``step_recovery``). Time is measured by one ``StepProfiler``, which
nothing reads to decide anything.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from functools import partial
from typing import Any

from fdplug.core.config import EngineConfig
from fdplug.core.engine.admission import ModelLimits, check_request
from fdplug.core.engine.executor import ExecutedStep, StepExecutor
from fdplug.core.engine.features import FeatureFetching
from fdplug.core.engine.profiler import StepProfiler
from fdplug.core.engine.runner_check import disagreements
from fdplug.core.engine.step_recovery import drop
from fdplug.core.kv_transfer.engine_side import make_side
from fdplug.core.multimodal.encoder_cache import EncoderCache
from fdplug.core.multimodal.fetch import FeatureFetcher
from fdplug.core.multimodal.loader import FeatureLoader
from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.config import SchedulerConfig
from fdplug.core.scheduler.output import EngineCoreOutput
from fdplug.core.scheduler.scheduler import Scheduler
from fdplug.core.scheduler.step_extension import StepExtension
from fdplug.core.structured.grammars import compiler_for
from fdplug.errors import (
    EngineRequestError,
    FdplugError,
    ParallelGroupError,
    error_to_dict,
)
from fdplug.plugin_api.scheduled_work import SchedulerOutput
from fdplug.plugin_api.selection import Selection

logger = logging.getLogger("fdplug.engine")


class EngineCore:
    """Owns the scheduler and the model runner of one selection."""

    def __init__(self, config: EngineConfig, selection: Selection) -> None:
        self.config = config
        self.selection = selection
        if selection.device.setup is not None:
            selection.device.setup()
        self.runner = selection.runner.factory(config, selection)
        model = self.runner.load_model()
        # as the runner settled it at load (a row op's kernel slower than the portable op gives way to it)
        self.selection = selection = getattr(self.runner, "selection", selection)
        self.kv_plan = self.runner.initialize_kv_cache()
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config, self.kv_plan.num_blocks))
        self.kv_transfer = make_side(config, selection, self.runner, self.scheduler, model.vocab_size)   # PD
        grammars = partial(compiler_for, config.model_dir, model.vocab_size) \
            if getattr(selection.runner, "structured_outputs", False) else None
        self.limits = ModelLimits(model.vocab_size, config.max_model_len, grammars, selection.runner.name)
        self.profiler = StepProfiler()
        self.encoder_cache = EncoderCache(config.encoder_cache_rows)
        self.executor = StepExecutor(self.runner, self.scheduler, self.encoder_cache, model.vocab_size)
        self.feature_loader = FeatureLoader(FeatureFetcher(selection.storages, config), self.encoder_cache,
                                            model.hidden_size, workers=config.feature_fetch_workers,
                                            timeout=config.fetch_timeout,
                                            encoder=getattr(self.runner, "image_encoder", None),
                                            thread_setup=selection.device.setup)
        self.extensions = self._extensions()
        self.scheduler.on_free = self._on_free

    def _extensions(self) -> list[StepExtension]:
        """The step extensions this configuration needs, in the order they are asked: a PD decode
        side holds a request (pulling its KV) before feature fetching would."""
        features = FeatureFetching(self.feature_loader, self.encoder_cache, self.scheduler.requests,
                                   self.abort_requests)
        return [side for side in (self.kv_transfer, features) if side is not None]

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Check a request against the model and queue it, or raise a typed error with nothing
        changed. A step extension may hold it first (features to fetch, KV to pull), or end it."""
        self.validate(request)
        if not all(extension.admit(request) for extension in self.extensions):
            return   # an extension ended it already (a PD decode's first token was its last)
        try:
            self.scheduler.add_request(request)
        except FdplugError:
            self._on_free(request, [])   # what the extensions started for it stops
            raise

    def validate(self, request: Request, also_waiting: int = 0) -> None:
        """The admission check alone: the typed error ``add_request`` would refuse it with, if any
        (``also_waiting``: requests held before the scheduler that count against its queue)."""
        self.scheduler.check_new(request, also_waiting)
        check_request(request, self.limits)
        for extension in self.extensions:
            extension.check(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(list(request_ids), status)   # (unknown ids are ignored there)

    def _on_free(self, request: Request, blocks: list[Any]) -> None:
        """A request leaves the scheduler (finished or aborted): every extension hears of it."""
        for extension in self.extensions:
            extension.on_free(request, blocks)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or any(extension.busy for extension in self.extensions)

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """One step: the outputs it produced and whether it ran anything (False: nothing could be
        scheduled, e.g. only feature downloads are in flight)."""
        outputs = self._poll()
        scheduler_output = self._schedule()
        if scheduler_output.is_empty:
            return outputs + self._idle(scheduler_output), False
        return outputs + self._run(scheduler_output), True

    def _poll(self) -> list[EngineCoreOutput]:
        return log_failures([output for extension in self.extensions for output in extension.poll()])

    def _schedule(self) -> SchedulerOutput:
        with self.profiler.phase("schedule"):
            scheduler_output = self.scheduler.schedule()
        preempted = [request for rid in scheduler_output.preempted_req_ids
                     if (request := self.scheduler.requests.get(rid)) is not None]
        for extension in self.extensions:
            extension.preempted(preempted)
        return scheduler_output

    def _idle(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        """Nothing to run: the runner still forgets what finished or was preempted."""
        drop(self.runner, [*so.finished_req_ids, *so.preempted_req_ids])
        return []

    def _run(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        """Run the step (the executor contains a runner's failure), record it, let the extensions
        see its outputs; a failure in the engine's own bookkeeping fails the step's requests alone."""
        try:
            outputs = self._update(so, self.executor.execute(so))
            for extension in self.extensions:
                extension.finished(outputs)
            return log_failures(outputs)
        except ParallelGroupError:   # a peer rank of the expert-parallel group is gone: the engine stops
            raise
        except Exception:   # a bug past the runner, in the engine's own bookkeeping: contain it too
            logger.exception("the engine failed to finish a step; failing its %d requests",
                             len(so.num_scheduled_tokens))
            return log_failures(self._fail_step(so))

    def _update(self, so: SchedulerOutput, executed: ExecutedStep) -> list[EngineCoreOutput]:
        """The scheduler records the step (a finished request leaves it: `_on_free`); failed
        requests end with their error."""
        self.profiler.steps += 1
        self.profiler.add(executed.model_output.timings)
        with self.profiler.phase("update"):
            outputs = self._fail(executed.failed)
            outputs += self.scheduler.update_from_output(so, executed.model_output)
            if executed.step_failed or executed.failed:
                self.executor.after_failure()
        return outputs

    def _fail(self, errors: dict[str, FdplugError]) -> list[EngineCoreOutput]:
        """End requests with finish reason "error" and their typed error (an output for each, also
        for one the scheduler no longer holds: its client must not wait forever)."""
        self.abort_requests(errors, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(rid, [], finished=True, finish_reason="error", error=error_to_dict(error))
                for rid, error in errors.items()]

    def _fail_step(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        """The last resort: end every request of the step with an error (those the failed update
        had already finished too), then check the runner."""
        error = EngineRequestError("the engine failed while finishing the step that ran this request.",
                                   fix="retry; if it fails again, report it with the server log.")
        outputs = self._fail(dict.fromkeys(so.num_scheduled_tokens, error))
        self.executor.after_failure()
        return outputs

    # -- invariants and counters ------------------------------------------------------------------

    def consistency_problems(self) -> list[str]:
        """Where the runner and the scheduler disagree (``runner_check.disagreements``)."""
        return disagreements(self.runner, self.scheduler)

    @property
    def num_failed_steps(self) -> int:
        return self.executor.num_failed_steps

    @property
    def num_rebuilds(self) -> int:
        return self.executor.num_rebuilds

    def stats(self):
        return self.scheduler.make_stats()


def log_failures(outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
    """Each request that ends with an error is logged once, with its typed error (the operator's
    record of why; the client gets the same error in its response)."""
    for output in outputs:
        if output.error is not None:
            logger.warning("request %s failed: %s: %s", output.request_id, output.error.get("type"),
                           output.error.get("message"))
    return outputs
