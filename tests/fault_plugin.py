"""A throwaway plugin: the core model runner, with a fault injected into the steps of chosen requests.

Installed by the tests as the distribution ``fdplug-faulty`` (entry point ``faulty`` -> this module),
so selection, the engine process and the server use it like any vendor runner. A request is
poisoned when its first prompt token is ``FAULT["marker"]``; once it has generated ``after`` tokens,
every step that runs it fails in the way ``FAULT["mode"]`` names:

- ``raise``: a RuntimeError after the batch was updated (nobody is blamed: the engine must find it);
- ``blame``: a ``RequestStepError`` naming it (the runner knows whose fault it is);
- ``add``: its slot values do not fit the batch when it is (re)added (a ``top_k`` past int64);
- ``oov``: the sampler returns a token outside the vocabulary for it (the engine's check);
- ``corrupt``: a RuntimeError, after also losing another request's slot mapping (the engine's
  consistency check must notice and rebuild every running request from the scheduler);
- ``broken``: every step fails, whoever is in it (a runner broken as a whole);
- ``broken_until_rebuilt``: the same, until the engine rebuilds the runner's requests.

``times`` > 0 limits how many steps fail (a transient fault). ``step_s`` > 0 makes every step take
that many seconds longer, whoever is in it (a slow device: a stream's tokens arrive that far apart).
``FAULT`` starts from the ``FAULTY_RUNNER`` environment variable (JSON), so a server's engine process
can be given one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

from fdplug import hookimpl
from fdplug.core.worker.model_runner import ModelRunner
from fdplug.errors import RequestStepError
from fdplug.plugin_api.specs import ANY_DEVICE, ModelRunnerSpec

FDPLUG_API_VERSION = "4.0"
FAULT: dict = {"mode": None, "marker": 77, "after": 0, "times": 0, "fired": 0, "step_s": 0.0,
               **json.loads(os.environ.get("FAULTY_RUNNER", "{}"))}


def inject(mode: str | None, *, marker: int = 77, after: int = 0, times: int = 0) -> None:
    """Set the fault for the steps to come (``mode=None``: none), its count of fired faults at 0."""
    FAULT.update(mode=mode, marker=marker, after=after, times=times, fired=0)


def _spent() -> bool:
    return FAULT["mode"] is None or bool(FAULT["times"]) and FAULT["fired"] >= FAULT["times"]


class FaultyRunner(ModelRunner):
    def __init__(self, config, backend) -> None:
        super().__init__(config, backend)
        self.poisoned: set[str] = set()
        self._oov: list[str] = []
        self._sampling_ids: list[str] = []

    def _armed(self, req_ids) -> list[str]:
        if _spent():
            return []
        if FAULT["mode"] in ("broken", "broken_until_rebuilt"):
            return list(req_ids)
        hit = []
        for rid in req_ids:
            if rid in self.poisoned and rid in self.batch.req_id_to_slot:
                slot = self.batch.slot_of(rid)
                if self.batch.num_tokens[slot] - self.batch.num_prompt_tokens[slot] >= FAULT["after"]:
                    hit.append(rid)
        return hit

    def _add_request(self, new) -> None:
        if new.prompt_token_ids[0] == FAULT["marker"]:
            self.poisoned.add(new.req_id)
            generated = len(new.output_token_ids)
            if FAULT["mode"] == "add" and generated >= FAULT["after"] and not _spent():
                FAULT["fired"] += 1
                new = dataclasses.replace(new, sampling_params=dataclasses.replace(new.sampling_params, top_k=2**70))
        super()._add_request(new)

    def execute_model(self, so):
        if FAULT["step_s"] > 0:
            time.sleep(FAULT["step_s"])
        return super().execute_model(so)

    def _prepare_inputs(self, so):
        inputs = super()._prepare_inputs(so)
        hit = self._armed(so.num_scheduled_tokens)
        if hit and FAULT["mode"] in ("raise", "blame", "corrupt", "broken", "broken_until_rebuilt"):
            FAULT["fired"] += 1
            if FAULT["mode"] == "blame":
                raise RequestStepError(hit, "injected: blamed")
            if FAULT["mode"] == "corrupt":
                others = [r for r in self.batch.req_id_to_slot if r not in hit]
                if others:
                    self.batch.req_id_to_slot.pop(others[0])
            raise RuntimeError("injected fault")
        self._oov = hit if FAULT["mode"] == "oov" else []
        self._sampling_ids = inputs.sampling_req_ids
        return inputs

    def drop_all_requests(self) -> None:
        if FAULT["mode"] == "broken_until_rebuilt":
            FAULT["mode"] = None
        super().drop_all_requests()

    def initialize_kv_cache(self):
        plan = super().initialize_kv_cache()
        sample = self.sampler

        def sampler(logits, meta):
            out = sample(logits, meta)
            rows = [i for i, rid in enumerate(self._sampling_ids) if rid in self._oov]
            if rows:
                FAULT["fired"] += 1
                out.sampled_token_ids = np.array(out.sampled_token_ids)
                out.sampled_token_ids[rows] = logits.shape[1] + 5
            return out

        self.sampler = sampler
        return plan


@hookimpl
def fdplug_register_model_runners(register):
    register(ModelRunnerSpec(name="faulty", devices=(ANY_DEVICE,), factory=FaultyRunner, priority=-100,
                             description="the core runner with injected faults (tests only)"))
