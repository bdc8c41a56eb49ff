"""The engine's reference: greedy outputs equal a naive full-recompute forward, token for token.

Batching, chunked prefill with a tiny budget, prefix-cache hits and forced preemption all change
how the KV cache is filled and read; none of them may change a single token.
"""

from __future__ import annotations

import numpy as np
import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.core.frontend.processor import ProcessedPrompt
from fdplug.plugin_api.sampling_params import SamplingParams
from tests.reference import naive_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


def prompts_for(tokenizer) -> list[list[int]]:
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 500, size=40).tolist()
    return [tokenizer.encode("Hello world"), rng.integers(0, 500, size=61).tolist(), [7],
            shared + [1, 2, 3], shared + [4, 5], rng.integers(0, 500, size=17).tolist(),
            rng.integers(0, 500, size=33).tolist(), shared[:16]]


@pytest.fixture(scope="module")
def reference(test_model_dir):
    llm = LLM(str(test_model_dir), num_kv_blocks=64, max_model_len=256)
    prompts = prompts_for(llm.tokenizer)
    return prompts, [naive_greedy(llm, p, GREEDY.max_tokens) for p in prompts]


def run(test_model_dir, prompts, max_model_len=256, **engine_args):
    llm = LLM(str(test_model_dir), max_model_len=max_model_len, **engine_args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outputs]


def test_batched(test_model_dir, reference):
    prompts, expected = reference
    _, got = run(test_model_dir, prompts, num_kv_blocks=64)
    assert got == expected


def test_chunked_prefill_with_a_tiny_budget(test_model_dir, reference):
    prompts, expected = reference
    llm, got = run(test_model_dir, prompts, num_kv_blocks=64, max_num_seqs=4, max_num_batched_tokens=8)
    assert got == expected


def test_prefix_cache_hits(test_model_dir, reference):
    prompts, expected = reference
    llm = LLM(str(test_model_dir), max_model_len=256, num_kv_blocks=64)
    first = llm.generate([{"prompt_token_ids": prompts[3]}], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    assert second[4].num_cached_tokens == 32 and second[3].num_cached_tokens == 32
    assert [o.outputs[0].token_ids for o in second] == expected
    assert llm.engine.stats().prefix_cache_hits > 0


def test_forced_preemption(test_model_dir, reference):
    prompts, expected = reference
    llm, got = run(test_model_dir, prompts, max_model_len=128, num_kv_blocks=10, max_num_seqs=8,
                   enable_prefix_caching=False)
    assert llm.engine.stats().num_preemptions > 0
    assert got == expected


def test_prefix_caching_off_and_chunking_off(test_model_dir, reference):
    prompts, expected = reference
    _, got = run(test_model_dir, prompts, num_kv_blocks=64, enable_prefix_caching=False,
                 enable_chunked_prefill=False, max_num_batched_tokens=256)
    assert got == expected


def test_requests_aborted_while_idle_free_their_runner_slots(test_model_dir):
    """An abort followed by an empty step must still reach the runner, or its slots leak."""
    llm = LLM(str(test_model_dir), max_model_len=128, num_kv_blocks=64, max_num_seqs=2)
    rid = llm._submit(ProcessedPrompt(None, [1, 2, 3]), SamplingParams(max_tokens=50))
    llm._step()
    llm.engine.abort_requests(llm.output_processor.child_ids(rid))
    llm._step()
    assert llm.engine.runner.batch.num_reqs == 0
    outs = llm.generate([{"prompt_token_ids": [4, 5]}] * 2, GREEDY, use_tqdm=False)
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
