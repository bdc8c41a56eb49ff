"""The token-budget scheduler: which requests run this step, and how many tokens each.

No prefill or decode phases (vLLM v1): each step grants each request some tokens within
``max_num_batched_tokens`` and ``max_num_seqs``; a prompt chunk and a decode token are the same
thing. Running requests go first (oldest first), then waiting ones (FCFS). When blocks run out the
newest running request is preempted by recompute: its blocks are freed (their computed part stays
in the prefix cache), and it goes back to the front of the waiting queue.

The engine's step is five lines::

    scheduler_output = scheduler.schedule()                    # {request_id: num_tokens} and changes
    model_output = runner.execute_model(scheduler_output)      # ModelRunnerOutput: sampled tokens
    outputs = scheduler.update_from_output(scheduler_output, model_output)
    ...stream outputs; scheduler.finish_requests(ids, FINISHED_STOPPED) when a stop string matched
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable

from fdplug.core.multimodal.chunking import check_admission
from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.config import SchedulerConfig
from fdplug.core.scheduler.kv_cache_manager import KVCacheManager
from fdplug.core.scheduler.output import EngineCoreOutput, SchedulerStats, new_request_data
from fdplug.core.scheduler.request_rules import check_stop, chunk_size, oversize_span
from fdplug.errors import EngineRequestError, InvalidRequestError, error_to_dict
from fdplug.plugin_api.model_runner import ModelRunnerOutput
from fdplug.plugin_api.scheduled_work import CachedRequestData, NewRequestData, SchedulerOutput


class Scheduler:
    """Owns the requests, the waiting queue, the running list and the KV cache manager."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache_manager = KVCacheManager(config.num_kv_blocks, config.block_size,
                                               config.enable_prefix_caching)
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_req_ids: set[str] = set()  # since the last schedule()
        self.num_preemptions = 0
        self.on_free: Callable[[Request, list], None] | None = None   # before a request's blocks are freed (the
        # engine's step extensions, `step_extension`: one may keep the blocks)

    # -- admission --------------------------------------------------------------------------------

    def check_room(self, also_waiting: int = 0) -> None:
        """A QueueFullError if the waiting queue (plus ``also_waiting`` held elsewhere) is full."""
        self.config.check_queue_room(len(self.waiting) + also_waiting)

    def add_request(self, request: Request) -> None:
        """Queue a request, or refuse it with a typed error before touching any state or counter."""
        self.check_new(request)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def check_new(self, request: Request, also_waiting: int = 0) -> None:
        """The typed error `add_request` would refuse ``request`` with, if any (``also_waiting``:
        requests held before the scheduler that count against its queue)."""
        self.check_room(also_waiting)
        if request.request_id in self.requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use.",
                                      fix="give every request a unique id.")
        if request.num_tokens >= (limit := self.config.max_model_len):
            raise InvalidRequestError(
                f"the prompt has {request.num_tokens} tokens; max_model_len is {limit}, which leaves "
                f"room for at most {limit - 1} prompt tokens.", fix="shorten the prompt.")
        if request.mm_spans:
            check_admission(request.num_prompt_tokens, request.mm_spans, self.config.max_num_batched_tokens, limit)
        if not request.status.is_unstarted:
            raise InvalidRequestError(f"request {request.request_id!r} is {request.status.name}.",
                                      fix="submit a fresh Request.")

    # -- scheduling -------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Grant tokens: running requests first (preempting the newest if blocks run out), then waiting."""
        budget = self.config.max_num_batched_tokens
        num_scheduled: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[str] = []
        oversize = self._oversize_request()
        if oversize is not None:  # an item larger than the budget runs alone, in a step of its own
            self._schedule_oversize(oversize, num_scheduled, new_reqs, cached_reqs)
        else:
            budget = self._schedule_running(budget, num_scheduled, cached_reqs, preempted)
            if not preempted:  # a step that had to preempt admits nobody new
                self._schedule_waiting(budget, num_scheduled, new_reqs)
        finished, self.finished_req_ids = self.finished_req_ids, set()
        return SchedulerOutput(new_reqs, cached_reqs, num_scheduled, sum(num_scheduled.values()),
                               preempted, finished)

    def _schedule_running(self, budget: int, num_scheduled: dict[str, int],
                          cached_reqs: list[CachedRequestData], preempted: list[str]) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = chunk_size(request, request.num_computed_tokens, budget, self.config.max_num_batched_tokens)
            if num_new <= 0:  # nothing to run (waits for update_from_output, or for a roomier step)
                i += 1
                continue
            new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            while new_blocks is None:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    return budget
                new_blocks = self.kv_cache_manager.allocate_slots(request, num_new)
            num_scheduled[request.request_id] = num_new
            cached_reqs.append(CachedRequestData(request.request_id, [b.block_id for b in new_blocks],
                                                 request.num_computed_tokens))
            budget -= num_new
            i += 1
        return budget

    def _schedule_waiting(self, budget: int, num_scheduled: dict[str, int],
                          new_reqs: list[NewRequestData]) -> None:
        skipped: list[Request] = []
        kv = self.kv_cache_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not request.status.is_schedulable_wait:     # features or remote KV still on their way
                skipped.append(self.waiting.popleft())
                continue
            hit_blocks, num_hit = kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget and not self.config.enable_chunked_prefill:
                break
            num_new = chunk_size(request, num_hit, budget, self.config.max_num_batched_tokens)
            if num_new <= 0 or kv.allocate_slots(request, num_new, hit_blocks) is None:
                break
            self._admit(request, num_hit, new_reqs)
            num_scheduled[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(skipped))  # they keep their place in line

    # -- an item larger than a step ---------------------------------------------------------------

    def _oversize_request(self) -> Request | None:
        for request in self.running:
            if request.mm_spans and oversize_span(request, request.num_computed_tokens,
                                                  self.config.max_num_batched_tokens):
                return request
        head = next((r for r in self.waiting if r.status.is_schedulable_wait), None)
        if (head is not None and head is self.waiting[0] and head.mm_spans
                and len(self.running) < self.config.max_num_seqs
                and oversize_span(head, self.kv_cache_manager.get_computed_blocks(head)[1],
                                  self.config.max_num_batched_tokens)):
            return head
        return None

    def _schedule_oversize(self, request: Request, num_scheduled: dict[str, int], new_reqs: list[NewRequestData],
                           cached_reqs: list[CachedRequestData]) -> None:
        kv = self.kv_cache_manager
        is_new = request.status != RequestStatus.RUNNING
        hit_blocks, start = kv.get_computed_blocks(request) if is_new else ([], request.num_computed_tokens)
        num_new = oversize_span(request, start, self.config.max_num_batched_tokens)
        new_blocks = kv.allocate_slots(request, num_new, hit_blocks)
        if new_blocks is None:
            return  # no room even for this: wait for running requests to finish
        if is_new:
            self._admit(request, start, new_reqs)
        else:
            cached_reqs.append(CachedRequestData(request.request_id, [b.block_id for b in new_blocks],
                                                 request.num_computed_tokens))
        num_scheduled[request.request_id] = num_new

    def _admit(self, request: Request, num_hit: int, new_reqs: list[NewRequestData]) -> None:
        """Move the head of the waiting queue to running; its slots are already allocated."""
        self.waiting.popleft()
        resumed = request.status == RequestStatus.PREEMPTED
        if not resumed and num_hit != request.num_computed_tokens:     # (equal: KV pulled, counted by PD)
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        self.running.append(request)
        new_reqs.append(new_request_data(
            request, self.kv_cache_manager.get_block_ids(request.request_id), resumed))

    def preempt_requests(self, request_ids: Iterable[str]) -> list[str]:
        """Send running requests back to the front of the waiting queue, in their order, to be
        recomputed (how the engine requeues what a failed step left undecided, or rebuilds a runner
        it cannot trust). Unknown or not running ids are ignored; the ids preempted."""
        wanted = set(request_ids)
        victims = [r for r in self.running if r.request_id in wanted]
        self.running = [r for r in self.running if r.request_id not in wanted]
        for request in reversed(victims):
            self._preempt(request)
        return [r.request_id for r in victims]

    def preempt_all_running(self) -> list[str]:
        return self.preempt_requests(r.request_id for r in self.running)

    def _preempt(self, request: Request) -> None:
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -- results ----------------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Record that the step ran: advance progress, append sampled tokens (with their logprobs
        when asked for), apply stop rules.

        A request still mid-prefill after this step gets nothing appended (whatever was sampled
        for it is ignored) and no output. Requests aborted since ``schedule()`` are skipped. A
        request that should have sampled and got no token from the runner fails alone.
        """
        sampled_token_ids, logprobs = model_output.sampled_token_ids, model_output.logprobs
        outputs: list[EngineCoreOutput] = []
        any_finished = False
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue
            if not sampled_token_ids.get(req_id):
                any_finished = True
                outputs.append(self._fail_unsampled(request))
                continue
            new_token_ids = self._append_tokens(request, sampled_token_ids[req_id])
            if request.is_finished():
                any_finished = True
                self._free_request(request)
            outputs.append(EngineCoreOutput(req_id, new_token_ids, request.is_finished(),
                                            request.finish_reason, request.stop_reason,
                                            request.num_cached_tokens,
                                            new_logprobs=[logprobs[req_id]] if req_id in logprobs else None))
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished()]
        return outputs

    def _fail_unsampled(self, request: Request) -> EngineCoreOutput:
        request.status = RequestStatus.FINISHED_ERROR
        self._free_request(request)
        error = EngineRequestError("the model runner produced no token for this request.",
                                   fix="retry; if it fails again, report it with the server log.")
        return EngineCoreOutput(request.request_id, [], True, "error", None, request.num_cached_tokens,
                                error=error_to_dict(error))

    def _append_tokens(self, request: Request, token_ids: list[int]) -> list[int]:
        appended = []
        for token_id in token_ids:
            request.append_output_token(token_id)
            appended.append(token_id)
            if check_stop(request, self.config.max_model_len):
                break
        return appended

    # -- finishing --------------------------------------------------------------------------------

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort, stop string, error): free blocks, leave the queues.

        Unknown or already finished ids are ignored: an abort may race with a normal finish.
        """
        if not finished_status.is_finished:
            raise ValueError(f"{finished_status.name} is not a finished status")
        ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
        targets = [self.requests[i] for i in ids if i in self.requests]
        if not targets:
            return
        for request in targets:
            request.status = finished_status
            self._free_request(request)
        self.running = [r for r in self.running if not r.is_finished()]
        self.waiting = deque(r for r in self.waiting if not r.is_finished())

    def _free_request(self, request: Request) -> None:
        if self.on_free is not None:
            self.on_free(request, self.kv_cache_manager.get_blocks(request.request_id))
        self.kv_cache_manager.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.add(request.request_id)

    # -- state ------------------------------------------------------------------------------------

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def reset_prefix_cache(self) -> bool:
        return self.kv_cache_manager.reset_prefix_cache()

    def make_stats(self) -> SchedulerStats:
        stats = self.kv_cache_manager.prefix_cache_stats
        num_feature_wait = sum(1 for r in self.waiting if r.status == RequestStatus.WAITING_FOR_FEATURES)
        return SchedulerStats(len(self.running), len(self.waiting), num_feature_wait,
                              self.kv_cache_manager.usage, stats.queries, stats.hits, stats.hit_rate,
                              self.num_preemptions)
