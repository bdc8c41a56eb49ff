"""EngineCore: the step loop every device shares.

    def step(self):
        outputs = self._poll_features()                                   # arrived or failed
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.is_empty: return outputs, False
        executed = self.executor.execute(scheduler_output)                # runner, recovery
        return outputs + self._update(scheduler_output, executed), True

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

from fdplug.core.config import EngineConfig
from fdplug.core.engine.admission import ModelLimits, check_request
from fdplug.core.engine.executor import ExecutedStep, StepExecutor
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
        self.kv_plan = self.runner.initialize_kv_cache()
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config, self.kv_plan.num_blocks))
        self.kv_transfer = make_side(config, selection, self.runner, self.scheduler, model.vocab_size)   # PD
        self.limits = ModelLimits(model.vocab_size, config.max_model_len)
        self.profiler = StepProfiler()
        self.encoder_cache = EncoderCache(config.encoder_cache_rows)
        self.executor = StepExecutor(self.runner, self.scheduler, self.encoder_cache, model.vocab_size)
        self.feature_loader = FeatureLoader(FeatureFetcher(selection.storages, config), self.encoder_cache,
                                            model.hidden_size, workers=config.feature_fetch_workers,
                                            timeout=config.fetch_timeout)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Check a request against the model and queue it, or raise a typed error with nothing
        changed. One with multimodal items waits (in its own state) for its features."""
        self.validate(request)
        if self.kv_transfer is not None and not self.kv_transfer.admit(request):
            return   # PD decode: its first token (from the prefill instance) already ended it
        fetch = bool(request.mm_inputs) and request.status != RequestStatus.WAITING_FOR_REMOTE_KV   # PD decode: KV
        if fetch:
            request.status = RequestStatus.WAITING_FOR_FEATURES
        self.scheduler.add_request(request)
        if fetch and self.feature_loader.submit(request):
            request.status = RequestStatus.WAITING

    def validate(self, request: Request, also_waiting: int = 0) -> None:
        """The admission check alone: the typed error ``add_request`` would refuse it with, if any
        (``also_waiting``: requests held before the scheduler that count against its queue)."""
        self.scheduler.check_room(also_waiting)
        check_request(request, self.limits)
        if request.mm_inputs:
            self.feature_loader.check_cached(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        ids = [rid for rid in request_ids if rid in self.scheduler.requests]
        for rid in ids:
            self._release(self.scheduler.requests[rid])
            if self.kv_transfer is not None:
                self.kv_transfer.cancel(rid)
        self.scheduler.finish_requests(ids, status)

    def _release(self, request: Request) -> None:
        """A request is done: stop its fetch, unpin its features (they stay cached for others)."""
        if request.mm_inputs:
            self.feature_loader.cancel(request.request_id)
            self.encoder_cache.release(request.request_id, self.feature_loader.hashes(request))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or (self.kv_transfer is not None and self.kv_transfer.busy)

    def has_pending_features(self) -> bool:
        return self.feature_loader.has_pending()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> tuple[list[EngineCoreOutput], bool]:
        """One step: the outputs it produced and whether it ran anything (False: nothing could be
        scheduled, e.g. only feature downloads are in flight)."""
        outputs = self._poll_features()
        if self.kv_transfer is not None:
            outputs += self.kv_transfer.poll()
        with self.profiler.phase("schedule"):
            scheduler_output = self.scheduler.schedule()
        self._refetch(scheduler_output.preempted_req_ids)
        if scheduler_output.is_empty:
            drop(self.runner, [*scheduler_output.finished_req_ids, *scheduler_output.preempted_req_ids])
            return outputs, False
        try:
            executed = self.executor.execute(scheduler_output)
            outputs += self._update(scheduler_output, executed)
            if self.kv_transfer is not None:
                self.kv_transfer.finished(outputs)
            return outputs, True
        except ParallelGroupError:   # a peer rank of the expert-parallel group is gone: the engine stops
            raise
        except Exception:   # a bug past the runner, in the engine's own bookkeeping: contain it too
            logger.exception("the engine failed to finish a step; failing its %d requests",
                             len(scheduler_output.num_scheduled_tokens))
            return outputs + self._fail_step(scheduler_output), True

    def _update(self, so: SchedulerOutput, executed: ExecutedStep) -> list[EngineCoreOutput]:
        """The scheduler records the step; failed requests end with their error; finished ones
        release their features."""
        self.profiler.steps += 1
        self.profiler.add(executed.model_output.timings)
        with self.profiler.phase("update"):
            with_features = {rid: request for rid in so.num_scheduled_tokens
                             if (request := self.scheduler.requests.get(rid)) is not None and request.mm_inputs}
            outputs = self._fail(executed.failed)
            outputs += self.scheduler.update_from_output(so, executed.model_output)
            for out in outputs:   # the scheduler forgets a finished request: release its features now
                if out.finished and out.request_id in with_features:
                    self._release(with_features[out.request_id])
            if executed.step_failed or executed.failed:
                self.executor.after_failure()
        return outputs

    def _refetch(self, preempted: list[str]) -> None:
        """A multimodal request whose prompt KV was pulled (PD decode) has no features here: once
        preempted, it recomputes its prompt, so it waits for them like a new request."""
        for rid in preempted:
            request = self.scheduler.requests.get(rid)
            if request is not None and request.mm_inputs and request.kv_transfer_params is not None \
                    and not self.feature_loader.holds(request):
                request.status = RequestStatus.WAITING_FOR_FEATURES
                if self.feature_loader.submit(request):
                    request.status = RequestStatus.PREEMPTED

    def _poll_features(self) -> list[EngineCoreOutput]:
        """Requests whose features arrived become schedulable; a failed fetch fails its request alone."""
        failures = []
        for request, error in self.feature_loader.poll():
            if request.request_id not in self.scheduler.requests:
                self.encoder_cache.release(request.request_id, self.feature_loader.hashes(request))
                continue  # aborted while fetching
            if error is None:       # (a preempted PD request resumes; any other starts)
                request.status = RequestStatus.PREEMPTED if request.output_token_ids else RequestStatus.WAITING
                continue
            self.abort_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            failures.append(EngineCoreOutput(request.request_id, [], finished=True, finish_reason="error",
                                             error=error_to_dict(error)))
        return failures

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
