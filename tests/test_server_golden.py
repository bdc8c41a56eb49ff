"""`fdplug serve` on a golden-fixture model: what the server returns is transformers' distribution.

The fixture (``tools/make_golden.py``) holds a tiny random Llama and transformers' float32 logits for
a token sequence. Every prefix of that sequence, sent as a token-id prompt through the official
client, must come back with transformers' argmax as its greedy token and transformers' log-softmax
as its logprobs: the whole path (HTTP, tokenization-free prompts, scheduler batching five requests
that share a prefix, prefix caching, sampler, logprob formatting) adds nothing to the numbers.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.demo.random_model import ensure_random_model
from tests.conftest import GOLDEN, golden
from tests.serverkit import Server

PREFIXES = (3, 5, 7, 9, 12)
TOP = 5
TOL = 1e-4     # as in test_model_parity: float32 Paddle vs float32 torch


@pytest.fixture(scope="module")
def golden_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("golden") / "llama"
    shutil.copytree(GOLDEN / "llama", model)
    for name in ("tokenizer.json", "tokenizer_config.json"):   # the fixture has weights only; the server
        shutil.copy(ensure_random_model() / name, model / name)   # needs a tokenizer to detokenize its output
    return model


@pytest.fixture(scope="module")
def server(golden_model, tmp_path_factory):
    srv = Server(["--model", str(golden_model), "--served-model-name", "golden", "--max-model-len", "64",
                  "--num-kv-blocks", "64"], tmp_path_factory.mktemp("serve") / "golden.log").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_every_prefix_gets_transformers_greedy_token_and_logprobs(server, golden_model):
    (sequence, _), (logits, _) = golden("llama")
    tokenizer = Tokenizer.from_dir(golden_model)
    client = server.openai()

    def ask(k: int):
        return client.completions.create(model="golden", prompt=sequence[:k], max_tokens=1, temperature=0,
                                         logprobs=TOP, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(PREFIXES)) as pool:      # at once: one batch, sharing the prefix cache
        replies = list(pool.map(ask, PREFIXES))
    for k, reply in zip(PREFIXES, replies):
        row = logits[k - 1].astype(np.float64)
        want = row - row.max() - np.log(np.exp(row - row.max()).sum())     # log-softmax
        best = int(np.argmax(want))
        choice = reply.choices[0]
        assert choice.text == tokenizer.decode([best]), f"prefix {k}"
        assert abs(choice.logprobs.token_logprobs[0] - want[best]) <= TOL, f"prefix {k}"
        top_ids = np.argsort(-want)[:TOP]
        expected = {}
        for tid in top_ids:     # byte-level pieces can decode alike: keep the likelier, as a dict would
            expected.setdefault(tokenizer.decode([int(tid)]), want[tid])
        got = choice.logprobs.top_logprobs[0]
        assert got.keys() == expected.keys(), f"prefix {k}"
        assert all(abs(got[t] - expected[t]) <= TOL for t in got), f"prefix {k}: {got} vs {expected}"
