"""When a model step raises: find the requests that caused it, fail only those, finish the others.

A runner that knows whose fault a failure is raises ``RequestStepError`` naming those requests (a
sampled token outside the vocabulary, a feature of the wrong size). Otherwise every request of the
step is a suspect. Either way the step's requests are first dropped from the runner, so whatever
half-updated state it held for them is gone; then the requests not yet blamed are run again, as
the runner's contract allows for any request it does not hold: rebuilt in full from the scheduler
(``NewRequestData``, as after a preemption), with the KV blocks and the tokens the scheduler
granted. A group that fails is dropped again and halved until the failing requests stand alone.

Nothing the scheduler owns has moved while this happens: ``num_computed_tokens`` advances only in
``update_from_output``, a block enters the prefix cache only once its KV is computed, and the KV a
failed run half-wrote sits in the suspects' own blocks at positions the re-run writes again. So the
groups that succeed produce exactly the step they were scheduled for: the same tokens, the same
seeded draws. Re-runs are bounded (``MAX_RERUNS``); past that, undecided requests fail.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable

from fdplug.core.scheduler.output import NewRequestData, SchedulerOutput
from fdplug.core.scheduler.scheduler import Scheduler
from fdplug.errors import EngineRequestError, FdplugError

logger = logging.getLogger("fdplug.engine")

MAX_RERUNS = 16   # a 64-request step with two culprits needs about 2 * log2(64) = 12


class RequestStepError(Exception):
    """A step failed because of ``request_ids``; ``error`` is what to tell their clients (a typed
    error, or None for a 500 that quotes ``message``)."""

    def __init__(self, request_ids: Iterable[str], message: str, error: FdplugError | None = None) -> None:
        super().__init__(message)
        self.request_ids = list(request_ids)
        self.error = error


@dataclass(slots=True)
class Recovered:
    """What is left of a failed step: the results of the requests whose re-run succeeded, and the
    error of every request that failed."""

    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, Any] = field(default_factory=dict)
    failed: dict[str, FdplugError] = field(default_factory=dict)
    reruns: int = 0


def recover_step(runner: Any, scheduler: Scheduler, so: SchedulerOutput, exc: Exception,
                 max_reruns: int | None = None) -> Recovered:
    """Blame the requests of the failed step ``so`` that caused ``exc``; re-run the others."""
    max_reruns = MAX_RERUNS if max_reruns is None else max_reruns
    step_ids = list(so.num_scheduled_tokens)
    out = Recovered()
    _blame(exc, step_ids, out.failed)
    drop(runner, [*step_ids, *so.finished_req_ids, *so.preempted_req_ids])
    groups = deque([[rid for rid in step_ids if rid not in out.failed]])
    last_error: Exception = exc
    while groups:
        group = groups.popleft()
        if not group:
            continue
        if out.reruns >= max_reruns:
            for rid in group:
                out.failed[rid] = _error_of(last_error)
            continue
        out.reruns += 1
        try:
            result = runner.execute_model(_rerun(scheduler, so, group))
        except Exception as err:   # noqa: BLE001 -- any failure of the re-run is this group's
            last_error = err
            drop(runner, group)
            if _blame(err, group, out.failed):
                groups.append([rid for rid in group if rid not in out.failed])
            elif len(group) == 1:
                out.failed[group[0]] = _error_of(err)
            else:
                groups.extend([group[:len(group) // 2], group[len(group) // 2:]])
            continue
        out.sampled_token_ids.update(result.sampled_token_ids)
        out.logprobs.update(result.logprobs)
    logger.warning("a failed step of %d requests: %d failed (%s), %d re-run in %d runs", len(step_ids),
                   len(out.failed), ", ".join(sorted(out.failed)[:5]), len(step_ids) - len(out.failed), out.reruns)
    return out


def drop(runner: Any, request_ids: Iterable[str]) -> None:
    """Make the runner forget requests, through its contract: ids to drop, nothing to run."""
    ids = list(dict.fromkeys(request_ids))
    if ids:
        runner.execute_model(SchedulerOutput([], [], {}, 0, ids, set()))


def _rerun(scheduler: Scheduler, so: SchedulerOutput, group: list[str]) -> SchedulerOutput:
    """The step's work for ``group`` only, each request given to the runner in full again."""
    new = [NewRequestData.from_request(scheduler.requests[rid], scheduler.kv_cache_manager.get_block_ids(rid), True)
           for rid in group]
    tokens = {rid: so.num_scheduled_tokens[rid] for rid in group}
    return SchedulerOutput(new, [], tokens, sum(tokens.values()), [], set(), so.mm_features)


def _blame(exc: Exception, candidates: list[str], failed: dict[str, FdplugError]) -> bool:
    """Record the requests ``exc`` names among ``candidates``; whether it named any."""
    if not isinstance(exc, RequestStepError):
        return False
    named = [rid for rid in exc.request_ids if rid in candidates]
    for rid in named:
        failed[rid] = _error_of(exc)
    return bool(named)


def _error_of(exc: Exception) -> FdplugError:
    if isinstance(exc, RequestStepError) and exc.error is not None:
        return exc.error
    if isinstance(exc, FdplugError):
        return exc
    return EngineRequestError(f"the model step running this request failed ({type(exc).__name__}: {str(exc)[:300]}).",
                              fix="retry; if it fails again, report it with the server log.")
