"""EngineCore: the step loop every device shares.

    schedule -> execute -> update, once per step.

Requests are checked against the running model when they are admitted (``admission``), so a value
the model cannot take is refused before it can reach a step. When a step raises anyway (a kernel
error, a bug, a runner that blames a request), ``step_recovery`` finds the requests that caused it:
they finish with finish reason "error" and a typed error, and the others finish the step as if
nothing had happened. Afterwards the runner's requests are checked against the scheduler's; if
they disagree, every running request is rebuilt from the scheduler (preempted and recomputed).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

from fdplug.core.config import EngineConfig
from fdplug.core.engine.admission import ModelLimits, check_request
from fdplug.core.engine.request import Request, RequestStatus
from fdplug.core.engine.runner_check import checked_tokens, disagreements, start_over
from fdplug.core.engine.step_recovery import (
    Recovered,
    RequestStepError,
    drop,
    recover_step,
)
from fdplug.core.multimodal.encoder_cache import EncoderCache
from fdplug.core.multimodal.fetch import FeatureFetcher
from fdplug.core.multimodal.loader import FeatureLoader
from fdplug.core.plugin_loading.selection import Selection
from fdplug.core.scheduler.output import EngineCoreOutput, SchedulerOutput
from fdplug.core.scheduler.scheduler import Scheduler, SchedulerConfig
from fdplug.errors import EngineRequestError, FdplugError, error_to_dict

logger = logging.getLogger("fdplug.engine")

REBUILD_WINDOW_STEPS = 16   # a runner-wide failure within this many steps of a rebuild is not retried again


@dataclass(slots=True)
class StepTimings:
    """Seconds spent per phase, summed over steps (the bench prints the breakdown)."""

    steps: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0


class EngineCore:
    """Owns the scheduler and the model runner of one selection."""

    def __init__(self, config: EngineConfig, selection: Selection) -> None:
        self.config = config
        self.selection = selection
        if selection.device.setup is not None:
            selection.device.setup()
        self.runner = selection.runner.factory(config, selection)
        self.runner.load_model()
        self.kv_plan = self.runner.initialize_kv_cache()
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=config.max_model_len, num_kv_blocks=self.kv_plan.num_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_waiting_requests=config.max_waiting_requests))
        self.timings = StepTimings()
        self.limits = ModelLimits(self.runner.model_config.vocab_size, config.max_model_len)
        self.num_failed_steps = 0    # steps that raised (their culprits failed, the rest re-ran)
        self.num_rebuilds = 0        # times the runner's requests were rebuilt from the scheduler
        self._last_rebuild_step = -REBUILD_WINDOW_STEPS - 1
        self.encoder_cache = EncoderCache(config.encoder_cache_rows)
        self.feature_loader = FeatureLoader(FeatureFetcher(selection.storages, config), self.encoder_cache,
                                            self.runner.model_config.hidden_size,
                                            workers=config.feature_fetch_workers, timeout=config.fetch_timeout)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Check a request against the model and queue it, or raise a typed error with nothing
        changed. One with multimodal items waits (in its own state) for its features."""
        check_request(request, self.limits)
        if request.mm_inputs:
            self.feature_loader.check_cached(request)
            request.status = RequestStatus.WAITING_FOR_FEATURES
        self.scheduler.add_request(request)
        if request.mm_inputs and self.feature_loader.submit(request):
            request.status = RequestStatus.WAITING

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        ids = [rid for rid in request_ids if rid in self.scheduler.requests]
        for rid in ids:
            self._release(self.scheduler.requests[rid])
        self.scheduler.finish_requests(ids, status)

    def _release(self, request: Request) -> None:
        """A request is done: stop its fetch, unpin its features (they stay cached for others)."""
        if request.mm_inputs:
            self.feature_loader.cancel(request.request_id)
            self.encoder_cache.release(request.request_id, self.feature_loader.hashes(request))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------------

    def has_pending_features(self) -> bool:
        return self.feature_loader.has_pending()

    def has_schedulable_work(self) -> bool:
        """Whether a step could run something now (not only wait for feature downloads)."""
        return bool(self.scheduler.running) or any(
            r.status != RequestStatus.WAITING_FOR_FEATURES for r in self.scheduler.waiting)

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        outputs = self._poll_features()
        so = self.scheduler.schedule()
        self.timings.schedule += time.perf_counter() - t0
        if so.is_empty:
            drop(self.runner, [*so.finished_req_ids, *so.preempted_req_ids])  # frees the runner's slots
            return outputs
        try:
            return outputs + self._run(so)
        except Exception:   # a bug past the runner, in the engine's own bookkeeping: contain it too
            logger.exception("the engine failed to finish a step; failing its %d requests",
                             len(so.num_scheduled_tokens))
            return outputs + self._fail_step(so)

    def _run(self, so: SchedulerOutput) -> list[EngineCoreOutput]:
        """Execute a scheduled step, recovering from a failure; then update the scheduler."""
        scheduled = {rid: self.scheduler.requests[rid] for rid in so.num_scheduled_tokens}
        failed: dict[str, FdplugError] = {}
        try:
            self._attach_features(so)
            result = self.runner.execute_model(so)
            sampled, logprobs, timings = result.sampled_token_ids, result.logprobs, result.timings
            step_failed = False
        except Exception as exc:
            logger.exception("a model step of %d requests failed; finding the requests that caused it",
                             len(scheduled))
            recovered = recover_step(self.runner, self.scheduler, so, exc)
            sampled, logprobs, timings = recovered.sampled_token_ids, recovered.logprobs, {}
            failed, step_failed = self._settle(recovered), True
        sampled = checked_tokens(sampled, self.limits.vocab_size, failed)
        t2 = time.perf_counter()
        outputs = self._fail(failed)
        outputs += self.scheduler.update_from_output(so, sampled)
        for out in outputs:
            if out.request_id in logprobs:
                out.new_logprobs = [logprobs[out.request_id]] if out.new_token_ids else None
            if out.finished and out.request_id in scheduled:
                self._release(scheduled[out.request_id])
        if step_failed or failed:
            self.num_failed_steps += 1
            self._verify_or_rebuild()
        self._count(timings, time.perf_counter() - t2)
        return outputs

    def _settle(self, recovered: Recovered) -> dict[str, FdplugError]:
        """What a recovered step leaves to do: requests it could not decide go back to the queue
        (recomputed next time); when every suspect failed even alone, the runner itself is the more
        likely culprit, so it is rebuilt once (nobody fails) before such a verdict stands."""
        self.scheduler.preempt_requests(recovered.undecided)
        runner_wide = not recovered.passed and len(recovered.isolated) >= 2
        if runner_wide and self.timings.steps - self._last_rebuild_step > REBUILD_WINDOW_STEPS:
            self._rebuild(f"all {len(recovered.isolated)} requests of a failed step failed even alone")
            return {rid: e for rid, e in recovered.failed.items() if rid not in recovered.isolated}
        return recovered.failed

    def _count(self, timings: dict[str, float], update: float) -> None:
        t = self.timings
        t.steps += 1
        t.prepare += timings.get("prepare", 0.0)
        t.forward += timings.get("forward", 0.0)
        t.sample += timings.get("sample", 0.0)
        t.update += update

    def _poll_features(self) -> list[EngineCoreOutput]:
        """Requests whose features arrived become schedulable; a failed fetch fails its request alone."""
        failures = []
        for request, error in self.feature_loader.poll():
            if request.request_id not in self.scheduler.requests:
                self.encoder_cache.release(request.request_id, self.feature_loader.hashes(request))
                continue  # aborted while fetching
            if error is None:
                request.status = RequestStatus.WAITING
                continue
            self.abort_requests([request.request_id], RequestStatus.FINISHED_ERROR)
            failures.append(EngineCoreOutput(request.request_id, [], finished=True, finish_reason="error",
                                             error=error_to_dict(error)))
        return failures

    def _attach_features(self, so: SchedulerOutput) -> None:
        """Give the runner the features of every item that overlaps a token it runs this step."""
        missing = []
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens
            for item in request.mm_positions:
                if item.offset < start + num_tokens and item.end > start:
                    if item.mm_hash not in self.encoder_cache:
                        missing.append(req_id)
                        continue
                    so.mm_features[item.mm_hash] = self.encoder_cache.get(item.mm_hash)
        if missing:
            raise RequestStepError(missing, "features of a scheduled item are not in the encoder cache")

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
        self.num_failed_steps += 1
        self._verify_or_rebuild()
        return outputs

    # -- invariants -------------------------------------------------------------------------------

    def consistency_problems(self) -> list[str]:
        """Where the runner and the scheduler disagree (``runner_check.disagreements``)."""
        return disagreements(self.runner, self.scheduler)

    def _verify_or_rebuild(self) -> None:
        """After a failed step: if the runner and the scheduler disagree, rebuild the runner's state."""
        problems = self.consistency_problems()
        if problems:
            self._rebuild("after a failed step the runner disagrees with the scheduler (" + "; ".join(problems[:5]) + ")")

    def _rebuild(self, why: str) -> None:
        logger.error("%s; rebuilding every running request from the scheduler", why)
        self.num_rebuilds += 1
        self._last_rebuild_step = self.timings.steps
        start_over(self.runner, self.scheduler)

    def stats(self):
        return self.scheduler.make_stats()
