"""Running a scheduled step on the model runner, and containing its failures.

``StepExecutor.execute`` hands the runner the step (with the features of the items it covers) and
returns its `ModelRunnerOutput` with tokens checked against the vocabulary, plus the requests found
to have broken it. When the runner raises, ``step_recovery`` re-runs subsets to find the culprits;
requests it cannot decide go back to the queue; a failure of every suspect even alone is taken as
the runner's own (it is rebuilt once, nobody fails). After a failed step the runner's requests are
compared with the scheduler's, and rebuilt from the scheduler if they disagree. A
`ParallelGroupError` (a peer of the expert-parallel group is gone) is not contained: the engine stops.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from fdplug.core.engine.runner_check import checked_tokens, disagreements, start_over
from fdplug.core.engine.step_recovery import Recovered, recover_step
from fdplug.core.multimodal.encoder_cache import EncoderCache
from fdplug.core.scheduler.scheduler import Scheduler
from fdplug.errors import FdplugError, ParallelGroupError, RequestStepError
from fdplug.plugin_api.model_runner import ModelRunner, ModelRunnerOutput
from fdplug.plugin_api.scheduled_work import SchedulerOutput

logger = logging.getLogger("fdplug.engine")

REBUILD_WINDOW_STEPS = 16   # a runner-wide failure within this many steps of a rebuild is not retried again


@dataclass(slots=True)
class ExecutedStep:
    """What a step produced: the runner's output (tokens checked) and the requests that broke it."""

    model_output: ModelRunnerOutput
    failed: dict[str, FdplugError] = field(default_factory=dict)
    step_failed: bool = False


class StepExecutor:
    """Runs steps on one runner; counts failed steps and rebuilds."""

    def __init__(self, runner: ModelRunner, scheduler: Scheduler, encoder_cache: EncoderCache,
                 vocab_size: int) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.encoder_cache = encoder_cache
        self.vocab_size = vocab_size
        self.num_steps = 0
        self.num_failed_steps = 0    # steps that raised (their culprits failed, the rest re-ran)
        self.num_rebuilds = 0        # times the runner's requests were rebuilt from the scheduler
        self._last_rebuild_step = -REBUILD_WINDOW_STEPS - 1

    def execute(self, so: SchedulerOutput) -> ExecutedStep:
        self.num_steps += 1
        try:
            self._attach_features(so)
            step = ExecutedStep(self.runner.execute_model(so))
        except ParallelGroupError:   # a peer rank is gone: nothing here can be retried
            raise
        except Exception as exc:
            logger.exception("a model step of %d requests failed; finding the requests that caused it",
                             len(so.num_scheduled_tokens))
            recovered = recover_step(self.runner, self.scheduler, so, exc)
            step = ExecutedStep(ModelRunnerOutput(recovered.sampled_token_ids, recovered.logprobs),
                                self._settle(recovered), step_failed=True)
        step.model_output.sampled_token_ids = checked_tokens(step.model_output.sampled_token_ids, self.vocab_size,
                                                             step.failed)
        return step

    def after_failure(self) -> None:
        """After a failed step: if the runner and the scheduler disagree, rebuild the runner's state."""
        self.num_failed_steps += 1
        problems = disagreements(self.runner, self.scheduler)
        if problems:
            self._rebuild("after a failed step the runner disagrees with the scheduler ("
                          + "; ".join(problems[:5]) + ")")

    def _settle(self, recovered: Recovered) -> dict[str, FdplugError]:
        """Requests the recovery could not decide go back to the queue (recomputed next time); when
        every suspect failed even alone, the runner itself is the likelier culprit, so it is rebuilt
        once (nobody fails) before such a verdict stands."""
        self.scheduler.preempt_requests(recovered.undecided)
        runner_wide = not recovered.passed and len(recovered.isolated) >= 2
        if runner_wide and self.num_steps - self._last_rebuild_step > REBUILD_WINDOW_STEPS:
            self._rebuild(f"all {len(recovered.isolated)} requests of a failed step failed even alone")
            return {rid: e for rid, e in recovered.failed.items() if rid not in recovered.isolated}
        return recovered.failed

    def _rebuild(self, why: str) -> None:
        logger.error("%s; rebuilding every running request from the scheduler", why)
        self.num_rebuilds += 1
        self._last_rebuild_step = self.num_steps
        start_over(self.runner, self.scheduler)

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
