"""When a model step raises: find the requests that caused it, fail only those, finish the others.

A runner that knows whose fault a failure is raises ``RequestStepError`` naming those requests (a
feature of the wrong size, a slot it cannot write). Otherwise every request of the
step is a suspect. Either way the step's requests are first dropped from the runner, so whatever
half-updated state it held for them is gone; then the requests not yet blamed are run again, as
the runner's contract allows for any request it does not hold: rebuilt in full from the scheduler
(``NewRequestData``, as after a preemption), with the KV blocks and the tokens the scheduler
granted. A group that fails is dropped again and halved until the failing requests stand alone; a
half whose sibling passed is known to hold a culprit and is halved without being run whole; a
single request is always run, so a transient failure blames nobody.

Nothing the scheduler owns has moved while this happens: ``num_computed_tokens`` advances only in
``update_from_output``, a block enters the prefix cache only once its KV is computed, and the KV a
failed run half-wrote sits in the suspects' own blocks at positions the re-run writes again. So the
groups that succeed produce exactly the step they were scheduled for: greedy and seeded requests get
the same tokens (unseeded ones draw afresh, as after any re-run). Re-runs are bounded
(``rerun_budget``); requests still undecided then are requeued by the engine, to be recomputed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fdplug.core.scheduler.output import new_request_data
from fdplug.core.scheduler.scheduler import Scheduler
from fdplug.errors import (
    EngineRequestError,
    FdplugError,
    ParallelGroupError,
    RequestStepError,
)
from fdplug.plugin_api.scheduled_work import SchedulerOutput

logger = logging.getLogger("fdplug.engine")


def rerun_budget(num_requests: int) -> int:
    """Re-runs one failed step may take: a culprit costs one or two per halving, so a few culprits
    are found in a step of any size; requests still undecided then are requeued, not failed."""
    return 8 + 4 * max(num_requests - 1, 1).bit_length()


@dataclass(slots=True)
class Recovered:
    """What is left of a failed step: the results of the requests whose re-run succeeded, the error
    of every request found to cause it, and the requests the budget left undecided (to requeue)."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, FdplugError] = field(default_factory=dict)
    isolated: set[str] = field(default_factory=set)     # failed alone, unnamed by the runner
    undecided: list[str] = field(default_factory=list)
    reruns: int = 0
    passed: int = 0       # re-runs that succeeded: none, with several suspects, hints at the runner itself


def recover_step(runner: Any, scheduler: Scheduler, so: SchedulerOutput, exc: Exception,
                 max_reruns: int | None = None) -> Recovered:
    """Blame the requests of the failed step ``so`` that caused ``exc``; re-run the others.

    Blame may also fall on a running request outside the step (the runner says whose state is bad).
    """
    step_ids = list(so.num_scheduled_tokens)
    held = [r.request_id for r in scheduler.running]
    recovery = _Recovery(runner, scheduler, so, Recovered(),
                         rerun_budget(len(step_ids)) if max_reruns is None else max_reruns, exc)
    recovery.blame(exc, held)
    drop(runner, [*step_ids, *so.finished_req_ids, *so.preempted_req_ids, *recovery.out.failed])
    recovery.settle([rid for rid in step_ids if rid not in recovery.out.failed], known_bad=not recovery.out.failed)
    out = recovery.out
    logger.warning("a failed step of %d requests: %d failed (%s), %d undecided, the rest re-run; %d runs",
                   len(step_ids), len(out.failed), ", ".join(sorted(out.failed)[:5]), len(out.undecided), out.reruns)
    return out


@dataclass(slots=True)
class _Recovery:
    runner: Any
    scheduler: Scheduler
    so: SchedulerOutput
    out: Recovered
    budget: int
    last_error: Exception

    def settle(self, group: list[str], known_bad: bool) -> bool:
        """Find the culprits in ``group`` by running halves; whether it held any. A group known to
        hold one (its sibling passed) is halved without being run whole; a single request is always
        run, so a transient failure blames nobody."""
        if not group:
            return False
        if len(group) > 1 and known_bad:
            half = len(group) // 2
            first_bad = self.settle(group[:half], known_bad=False)
            decided = not any(rid in self.out.undecided for rid in group[:half])
            self.settle(group[half:], known_bad=decided and not first_bad)
            return True
        if self.out.reruns >= self.budget:
            self.out.undecided.extend(group)
            return False
        error = self.run(group)
        if error is None:
            return False
        if self.blame(error, group):
            self.settle([rid for rid in group if rid not in self.out.failed], known_bad=False)
        elif len(group) == 1:
            self.out.failed[group[0]] = _error_of(error)
            self.out.isolated.add(group[0])
        else:
            self.settle(group, known_bad=True)
        return True

    def run(self, group: list[str]) -> Exception | None:
        self.out.reruns += 1
        try:
            result = self.runner.execute_model(_rerun(self.scheduler, self.so, group))
        except ParallelGroupError:   # the expert-parallel group is broken, not this group of requests
            raise
        except Exception as err:   # noqa: BLE001 -- any failure of the re-run is this group's
            self.last_error = err
            drop(self.runner, group)
            return err
        self.out.passed += 1
        self.out.sampled_token_ids.update(result.sampled_token_ids)
        self.out.logprobs.update(result.logprobs)
        return None

    def blame(self, exc: Exception, candidates: list[str]) -> bool:
        """Record the requests ``exc`` names among ``candidates``; whether it named any."""
        if not isinstance(exc, RequestStepError):
            return False
        named = [rid for rid in exc.request_ids if rid in candidates]
        for rid in named:
            self.out.failed[rid] = _error_of(exc)
        return bool(named)


def drop(runner: Any, request_ids: Iterable[str]) -> None:
    """Make the runner forget requests, through its contract: ids to drop, nothing to run."""
    ids = list(dict.fromkeys(request_ids))
    if ids:
        runner.execute_model(SchedulerOutput([], [], {}, 0, ids, set()))


def _rerun(scheduler: Scheduler, so: SchedulerOutput, group: list[str]) -> SchedulerOutput:
    """The step's work for ``group`` only, each request given to the runner in full again."""
    new = [new_request_data(scheduler.requests[rid], scheduler.kv_cache_manager.get_block_ids(rid), True)
           for rid in group]
    tokens = {rid: so.num_scheduled_tokens[rid] for rid in group}
    return SchedulerOutput(new, [], tokens, sum(tokens.values()), [], set(), so.mm_features)


def _error_of(exc: Exception) -> FdplugError:
    if isinstance(exc, RequestStepError) and exc.error is not None:
        return exc.error
    if isinstance(exc, FdplugError):
        return exc
    return EngineRequestError(f"the model step running this request failed ({type(exc).__name__}: {str(exc)[:300]}).",
                              fix="retry; if it fails again, report it with the server log.")
