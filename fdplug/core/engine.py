"""EngineCore: the step loop every device shares.

    schedule -> execute -> update, once per step.

A failing step fails the requests it carried (finish reason "error") and the engine goes on: one
bad request or a kernel error never takes the others down.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable

from fdplug.core.config import EngineConfig
from fdplug.core.multimodal.encoder_cache import EncoderCache
from fdplug.core.multimodal.fetch import FeatureFetcher
from fdplug.core.multimodal.loader import FeatureLoader
from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.output import EngineCoreOutput, SchedulerOutput
from fdplug.core.scheduler.scheduler import Scheduler, SchedulerConfig
from fdplug.core.selection import Backend
from fdplug.errors import EngineRequestError, error_to_dict

logger = logging.getLogger("fdplug.engine")


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
    """Owns the scheduler and the model runner of one backend."""

    def __init__(self, config: EngineConfig, backend: Backend) -> None:
        self.config = config
        self.backend = backend
        if backend.device.setup is not None:
            backend.device.setup()
        self.runner = backend.runner.factory(config, backend)
        self.runner.load_model()
        self.kv_plan = self.runner.initialize_kv_cache()
        self.scheduler = Scheduler(SchedulerConfig(
            max_model_len=config.max_model_len, num_kv_blocks=self.kv_plan.num_blocks,
            max_num_seqs=config.max_num_seqs, max_num_batched_tokens=config.max_num_batched_tokens,
            block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
            enable_chunked_prefill=config.enable_chunked_prefill,
            max_waiting_requests=config.max_waiting_requests))
        self.timings = StepTimings()
        self.encoder_cache = EncoderCache(config.encoder_cache_rows)
        self.feature_loader = FeatureLoader(FeatureFetcher(backend.storages, config), self.encoder_cache,
                                            self.runner.model_config.hidden_size,
                                            workers=config.feature_fetch_workers, timeout=config.fetch_timeout)

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request; one with multimodal items waits (in its own state) for its features."""
        if request.mm_inputs:
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
        failures = self._poll_features()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.timings.schedule += t1 - t0
        if scheduler_output.is_empty:
            if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
                self.runner.execute_model(scheduler_output)  # let the runner drop them: frees its slots
            return failures
        scheduled = {rid: self.scheduler.requests[rid] for rid in scheduler_output.num_scheduled_tokens}
        self._attach_features(scheduler_output)
        try:
            result = self.runner.execute_model(scheduler_output)
        except Exception as exc:  # fail this step's requests, keep serving the others
            logger.exception("model step failed; failing the %d requests it carried",
                             len(scheduler_output.num_scheduled_tokens))
            return failures + self._fail_step(scheduler_output, f"{type(exc).__name__}: {exc}")
        t2 = time.perf_counter()
        outputs = failures + self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids)
        for out in outputs:
            if out.request_id in result.logprobs:
                out.new_logprobs = [result.logprobs[out.request_id]] if out.new_token_ids else None
            if out.finished and out.request_id in scheduled:
                self._release(scheduled[out.request_id])
        t3 = time.perf_counter()
        timings = self.timings
        timings.steps += 1
        timings.prepare += result.timings.get("prepare", 0.0)
        timings.forward += result.timings.get("forward", 0.0)
        timings.sample += result.timings.get("sample", 0.0)
        timings.update += t3 - t2
        return outputs

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
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens
            for item in request.mm_positions:
                if item.offset < start + num_tokens and item.end > start:
                    so.mm_features[item.mm_hash] = self.encoder_cache.get(item.mm_hash)

    def _fail_step(self, scheduler_output: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        ids = [rid for rid in scheduler_output.num_scheduled_tokens if rid in self.scheduler.requests]
        self.abort_requests(ids, RequestStatus.FINISHED_ERROR)
        error = error_to_dict(EngineRequestError(f"the model step running this request failed ({message}).",
                                                 fix="retry; if it fails again, report it with the server log."))
        return [EngineCoreOutput(rid, [], finished=True, finish_reason="error", error=error) for rid in ids]

    def stats(self):
        return self.scheduler.make_stats()
