"""Multimodal features as a step extension: a request with items waits until they are fetched.

A request whose items' features are not all in the encoder cache waits (``WAITING_FOR_FEATURES``,
skipped by the scheduler) while `FeatureLoader` fetches them on its threads; ``poll`` makes it
schedulable when they arrived, or fails it alone (typed) when a fetch failed. A preempted request
that does not hold its features here (its prompt's KV was pulled from a prefill instance, which
had them) fetches them before it recomputes its prompt. A request that leaves the scheduler stops
its fetch and unpins its features (they stay cached for others).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fdplug.core.multimodal.encoder_cache import EncoderCache
from fdplug.core.multimodal.loader import FeatureLoader
from fdplug.core.request import Request, RequestStatus
from fdplug.core.scheduler.output import EngineCoreOutput
from fdplug.core.scheduler.step_extension import StepExtension
from fdplug.errors import error_to_dict


class FeatureFetching(StepExtension):
    """Holds multimodal requests until their features are in the encoder cache."""

    name = "features"

    def __init__(self, loader: FeatureLoader, encoder_cache: EncoderCache, requests: dict[str, Request],
                 fail: Callable[[Iterable[str], RequestStatus], None]) -> None:
        self.loader, self.encoder_cache = loader, encoder_cache
        self.requests = requests   # the scheduler's: a request no longer there was aborted
        self.fail = fail           # ends requests with a status (the engine's abort_requests)

    def check(self, request: Request) -> None:
        if request.mm_inputs:
            self.loader.check_cached(request)

    def admit(self, request: Request) -> bool:
        """Fetch what the cache lacks; a request another extension holds (a PD pull) is left alone."""
        if request.mm_inputs and request.status == RequestStatus.WAITING:
            request.status = RequestStatus.WAITING_FOR_FEATURES
            if self.loader.submit(request):   # every item was cached already
                request.status = RequestStatus.WAITING
        return True

    def poll(self) -> list[EngineCoreOutput]:
        """Requests whose features arrived become schedulable; a failed fetch fails its request alone."""
        failures = []
        for request, error in self.loader.poll():
            if request.request_id not in self.requests:
                self.encoder_cache.release(request.request_id, self.loader.hashes(request))
                continue  # aborted while fetching
            if error is None:       # (a preempted request resumes; any other starts)
                request.status = RequestStatus.PREEMPTED if request.output_token_ids else RequestStatus.WAITING
                continue
            self.fail([request.request_id], RequestStatus.FINISHED_ERROR)
            failures.append(EngineCoreOutput(request.request_id, [], finished=True, finish_reason="error",
                                             error=error_to_dict(error)))
        return failures

    def preempted(self, requests: list[Request]) -> None:
        """A preempted request recomputes its prompt: one that does not hold its features here
        (they were a prefill instance's) waits for them like a new request."""
        for request in requests:
            if request.mm_inputs and not self.loader.holds(request):
                request.status = RequestStatus.WAITING_FOR_FEATURES
                if self.loader.submit(request):
                    request.status = RequestStatus.PREEMPTED

    def on_free(self, request: Request, blocks: list[Any]) -> None:
        if request.mm_inputs:
            self.loader.cancel(request.request_id)
            self.encoder_cache.release(request.request_id, self.loader.hashes(request))

    @property
    def busy(self) -> bool:
        return self.loader.has_pending()
