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
from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.output import EngineCoreOutput, SchedulerOutput
from fdplug.core.scheduler.scheduler import Scheduler, SchedulerConfig
from fdplug.core.selection import Backend

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

    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.update


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

    # -- requests ---------------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: Iterable[str],
                       status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> None:
        self.scheduler.finish_requests(list(request_ids), status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the loop ---------------------------------------------------------------------------------

    def step(self) -> list[EngineCoreOutput]:
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        t1 = time.perf_counter()
        self.timings.schedule += t1 - t0
        if scheduler_output.is_empty:
            if scheduler_output.finished_req_ids or scheduler_output.preempted_req_ids:
                self.runner.execute_model(scheduler_output)  # let the runner drop them: frees its slots
            return []
        try:
            result = self.runner.execute_model(scheduler_output)
        except Exception as exc:  # fail this step's requests, keep serving the others
            logger.exception("model step failed; failing the %d requests it carried",
                             len(scheduler_output.num_scheduled_tokens))
            return self._fail_step(scheduler_output, f"{type(exc).__name__}: {exc}")
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, result.sampled_token_ids)
        for out in outputs:
            if out.request_id in result.logprobs:
                out.new_logprobs = [result.logprobs[out.request_id]][:len(out.new_token_ids)]
        t3 = time.perf_counter()
        timings = self.timings
        timings.steps += 1
        timings.prepare += result.timings.get("prepare", 0.0)
        timings.forward += result.timings.get("forward", 0.0)
        timings.sample += result.timings.get("sample", 0.0)
        timings.update += t3 - t2
        return outputs

    def _fail_step(self, scheduler_output: SchedulerOutput, message: str) -> list[EngineCoreOutput]:
        ids = [rid for rid in scheduler_output.num_scheduled_tokens if rid in self.scheduler.requests]
        self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ERROR)
        return [EngineCoreOutput(rid, [], finished=True, finish_reason="error", stop_reason=message) for rid in ids]

    def stats(self):
        return self.scheduler.make_stats()
