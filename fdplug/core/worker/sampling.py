"""From the InputBatch's per-slot sampling fields to the sampler's per-row metadata, and back.

The sampler sees one row per request that samples this step, in ``slots`` order; nothing per-slot
lives here (the InputBatch registry holds it all), so this is pure gathering.
"""

from __future__ import annotations

import numpy as np

from fdplug.core.model.sampling.metadata import SamplingMetadata
from fdplug.core.model.sampling.sampler import SamplerOutput
from fdplug.core.worker.input_batch import InputBatch


def plain_greedy(batch: InputBatch, slots: np.ndarray) -> bool:
    """Whether every row samples greedily with no penalty and no logprobs (the slots' ``plain_greedy``,
    set when the request joined): then the sampler would only take each row's argmax, and the caller
    can too, without building the metadata (one gather instead of a dozen: in a single-stream step
    every numpy call costs 10-30 us, its caches cold from the weights the model just read)."""
    return bool(batch.plain_greedy[slots].all())


def sampling_metadata(batch: InputBatch, slots: np.ndarray) -> SamplingMetadata:
    ids = counts = None
    if batch.penalised[slots].any():  # only then pay for the token tables
        width = max(int(batch.num_penalty_ids[slots].max()), 1)
        ids, counts = batch.penalty_ids[slots, :width], batch.penalty_counts[slots, :width]
    return SamplingMetadata(
        temperature=batch.temperature[slots], top_k=batch.top_k[slots], top_p=batch.top_p[slots],
        min_p=batch.min_p[slots], presence_penalty=batch.presence_penalty[slots],
        frequency_penalty=batch.frequency_penalty[slots], repetition_penalty=batch.repetition_penalty[slots],
        seeds=batch.seed[slots], seeded=batch.seeded[slots],
        steps=batch.num_tokens[slots] - batch.num_prompt_tokens[slots], num_logprobs=batch.num_logprobs[slots],
        penalty_token_ids=ids, penalty_token_counts=counts)


MIN_LOGPROB = -9999.0    # vLLM's floor for a logprob the response must carry as a JSON number


def sampled_logprobs(result: SamplerOutput, meta: SamplingMetadata,
                     req_ids: list[str]) -> dict[str, tuple[list[int], list[float], list[int]]]:
    """Per request that asked: (ids, logprobs, ranks), the sampled token first, then its top N."""
    if result.sampled_logprobs is None:
        return {}
    out = {}
    for row, req_id in enumerate(req_ids):
        n = int(meta.num_logprobs[row])
        if n < 0:
            continue
        top_ids = result.top_token_ids[row, :n].tolist()
        ids = [int(result.sampled_token_ids[row]), *top_ids]
        logprobs = [max(float(v), MIN_LOGPROB)   # a token a constraint masked is -inf: JSON has no such number
                    for v in (result.sampled_logprobs[row], *result.top_logprobs[row, :n].tolist())]
        out[req_id] = (ids, logprobs, [int(result.sampled_ranks[row]), *range(1, len(top_ids) + 1)])
    return out
