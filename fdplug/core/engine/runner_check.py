"""What the engine checks of a model runner it cannot take at its word, and how it starts it over.

Tokens a runner returns are checked before anything reads them. After a failed step, the runner's
requests (and their progress) are compared with the scheduler's; when they disagree, the runner
forgets every request and the scheduler hands them all back in full, to be recomputed.
"""

from __future__ import annotations

import operator
from typing import Any

from fdplug.core.engine.step_recovery import drop
from fdplug.core.scheduler.scheduler import Scheduler
from fdplug.errors import EngineRequestError, FdplugError


def checked_tokens(sampled: dict[str, Any], vocab_size: int, failed: dict[str, FdplugError]) -> dict[str, list[int]]:
    """The runner's tokens as Python ints in the vocabulary; a request given anything else goes to
    ``failed`` (whatever a runner returns never reaches the scheduler, the block hashes or the API)."""
    checked = {}
    for rid, tokens in sampled.items():
        try:
            ids = [operator.index(t) for t in tokens]
        except Exception:  # noqa: BLE001 -- not a list of integers
            ids = None
        if ids is not None and all(0 <= t < vocab_size for t in ids):
            checked[rid] = ids
        else:
            failed.setdefault(rid, EngineRequestError(
                f"the model runner produced tokens outside the vocabulary for this request ({str(tokens)[:80]}).",
                fix="retry; if it fails again, report it with the server log."))
    return checked


def disagreements(runner: Any, scheduler: Scheduler) -> list[str]:
    """Where the runner's requests and the scheduler's running set disagree (empty: they agree).

    Between steps the runner holds exactly the running requests, each with the scheduler's computed
    and known token counts, plus the finished ones the next step tells it to drop. A runner without
    ``held_requests`` is taken at its word.
    """
    held_requests = getattr(runner, "held_requests", None)
    if held_requests is None:
        return []
    try:
        held = held_requests()
    except Exception as exc:  # noqa: BLE001 -- an inconsistent batch is a finding, not a crash
        return [str(exc)]
    problems = []
    for request in scheduler.running:
        state = held.get(request.request_id)
        if state is None:
            problems.append(f"running request {request.request_id!r} is not in the runner")
        elif tuple(state) != (request.num_computed_tokens, request.num_tokens):
            problems.append(f"request {request.request_id!r} is at {tuple(state)} (computed, known tokens) in "
                            f"the runner, at {(request.num_computed_tokens, request.num_tokens)} in the scheduler")
    running = {r.request_id for r in scheduler.running}
    stale = set(held) - running - scheduler.finished_req_ids
    return problems + [f"the runner holds {rid!r}, which is not running" for rid in sorted(stale)]


def start_over(runner: Any, scheduler: Scheduler) -> None:
    """The runner forgets every request; every running request is preempted and comes back in full,
    recomputed with the same tokens. The prefix cache is emptied, so no KV this runner wrote is reused."""
    drop_all = getattr(runner, "drop_all_requests", None)
    if drop_all is not None:
        drop_all()
    else:
        drop(runner, [*_held_or_empty(runner), *(r.request_id for r in scheduler.running)])
    scheduler.preempt_all_running()
    scheduler.reset_prefix_cache()


def _held_or_empty(runner: Any) -> set[str]:
    try:
        return set(runner.held_requests())
    except Exception:  # noqa: BLE001 -- the runner cannot say: drop what the scheduler knows
        return set()
