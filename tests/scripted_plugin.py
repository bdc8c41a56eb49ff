"""A throwaway plugin: the core model runner, made to say exactly what a test scripts.

Installed by the tests as the distribution ``fdplug-scripted`` (entry point ``scripted`` -> this
module) and chosen with ``--runner scripted``: the model runs as usual, then the sampled token of
every request is replaced by the next token of ``SCRIPTED_TOKENS`` (a JSON list from the
environment; the test ends it with an end-of-sequence token). It stands in for a model that writes
tool calls or reasoning in a family's format, so the server's parsers meet exact text, token by token.
"""

from __future__ import annotations

import json
import os

import numpy as np

from fdplug import hookimpl
from fdplug.core.worker.model_runner import ModelRunner
from fdplug.plugin_api.specs import ANY_DEVICE, ModelRunnerSpec

FDPLUG_API_VERSION = "4.1"
SCRIPT: list[int] = json.loads(os.environ.get("SCRIPTED_TOKENS", "[]"))


class ScriptedRunner(ModelRunner):
    def __init__(self, config, selection) -> None:
        super().__init__(config, selection)
        self._next: list[int] = []     # per sampled row: the index of its next scripted token

    def _prepare_inputs(self, so):
        inputs = super()._prepare_inputs(so)
        slots = [self.batch.slot_of(rid) for rid in inputs.sampling_req_ids]
        self._next = [int(self.batch.num_tokens[s] - self.batch.num_prompt_tokens[s]) for s in slots]
        return inputs

    def initialize_kv_cache(self):
        plan = super().initialize_kv_cache()
        sample = self.sampler

        def sampler(logits, meta):
            out = sample(logits, meta)
            out.sampled_token_ids = np.array([SCRIPT[min(k, len(SCRIPT) - 1)] for k in self._next], dtype=np.int64)
            return out

        self.sampler = sampler
        return plan


@hookimpl
def fdplug_register_model_runners(register):
    register(ModelRunnerSpec(name="scripted", devices=(ANY_DEVICE,), factory=ScriptedRunner, priority=-100,
                             description="the core runner, saying SCRIPTED_TOKENS (tests only)"))
