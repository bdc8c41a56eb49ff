"""Step extensions: features that act around the step loop, each behind one small interface.

A feature that holds requests before the scheduler may take them (multimodal features being
fetched, KV being pulled from a prefill instance), keeps their blocks after they finish (KV offered
to a decode instance), or annotates a step's outputs, is a `StepExtension`. The engine
(`fdplug.core.engine.engine_core`) calls every extension at the same points, in the order it
registered them, and the step loop, the scheduler and the KV cache manager name none of them
(vLLM's KV connector has the same shape):

- ``check(request)`` when a request is validated: a typed error if this feature cannot take it,
  with nothing changed;
- ``admit(request)`` before the scheduler queues a request: it may hold it (a waiting status the
  scheduler skips) and make it schedulable later; False: the request already ended here (its
  output comes from ``poll``), so it is not queued;
- ``poll()`` before each schedule: outputs of held requests that failed or ended, and held
  requests made schedulable;
- ``preempted(requests)`` after a schedule, with the requests it preempted;
- ``finished(outputs)`` after each step, with its outputs (it may annotate them: a PD prefill's
  last output carries its ``kv_transfer_params``);
- ``on_free(request, blocks)`` when a request leaves the scheduler (finished or aborted), before its
  blocks go back to the pool (it may take a reference on them);
- ``busy``: work the scheduler cannot see (a download, a transfer in flight).

`StepExtension` implements each as "nothing to do", so an extension overrides only its own points.
"""

from __future__ import annotations

from typing import Any

from fdplug.core.request import Request
from fdplug.core.scheduler.output import EngineCoreOutput


class StepExtension:
    """A feature around the step loop; every hook does nothing unless overridden."""

    name = "extension"

    def check(self, request: Request) -> None:
        return None

    def admit(self, request: Request) -> bool:
        return True

    def poll(self) -> list[EngineCoreOutput]:
        return []

    def preempted(self, requests: list[Request]) -> None:
        return None

    def finished(self, outputs: list[EngineCoreOutput]) -> None:
        return None

    def on_free(self, request: Request, blocks: list[Any]) -> None:
        return None

    @property
    def busy(self) -> bool:
        return False
