"""MoE checkpoints as transformers made them: greedy tokens equal transformers' ``generate()``.

The fixtures (``tools/make_golden.py``) are tiny random Qwen2-MoE, Qwen3-MoE (per-expert and fused
expert layouts), ERNIE-4.5-MoE (selection bias, shared experts) and GLM-4.5-MoE (grouped sigmoid
routing) models with transformers' greedy continuations of their sequences. Logits parity
(prefill, decode, mixed batches) runs for them in `test_model_parity.py` like for the dense models;
here the whole engine, every MoE backend, and `fdplug serve` through the official client must
reproduce transformers' tokens. The fixtures record their routing and logit margins, so float
noise cannot flip a choice.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.core.model.text.tokenizer import Tokenizer
from fdplug.demo.random_model import ensure_random_model
from fdplug.plugin_api.sampling_params import SamplingParams
from tests.conftest import GOLDEN
from tests.serverkit import Server

MOE = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.json").is_file()
             and "greedy" in json.loads((p / "golden.json").read_text()))


def greedy(name: str) -> list[dict]:
    return json.loads((GOLDEN / name / "golden.json").read_text())["greedy"]


def servable(name: str, where) -> str:
    """The fixture has weights only: copy it with the random model's tokenizer beside them."""
    model = where / name
    shutil.copytree(GOLDEN / name, model)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ensure_random_model() / f, model / f)
    return str(model)


def test_every_moe_architecture_has_a_fixture():
    archs = {json.loads((GOLDEN / name / "config.json").read_text())["architectures"][0] for name in MOE}
    assert {"Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM", "Ernie4_5_MoeForCausalLM"} <= archs


@pytest.mark.parametrize("backend", ["reference", "cpu_native"])
@pytest.mark.parametrize("name", MOE)
def test_llm_generates_transformers_greedy_tokens(name, backend, tmp_path):
    runs = greedy(name)
    llm = LLM(servable(name, tmp_path), moe_backend=backend, num_kv_blocks=32, max_model_len=64)
    assert llm.model_config.moe is not None
    outs = llm.generate([{"prompt_token_ids": r["prompt"]} for r in runs],
                        SamplingParams(temperature=0, max_tokens=len(runs[0]["tokens"]), ignore_eos=True),
                        use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r["tokens"] for r in runs]


@pytest.fixture(scope="module", params=MOE)
def served(request, tmp_path_factory):
    name = request.param
    model = servable(name, tmp_path_factory.mktemp("golden"))
    srv = Server(["--model", str(model), "--served-model-name", name, "--max-model-len", "64",
                  "--num-kv-blocks", "32"], tmp_path_factory.mktemp("serve") / f"{name}.log").wait_ready()
    yield name, model, srv
    assert srv.stop() == 0, srv.log()


def test_serve_generates_transformers_greedy_tokens(served):
    name, model, server = served
    runs = greedy(name)
    tokenizer = Tokenizer.from_dir(model)
    client = server.openai()

    def ask(run):
        return client.completions.create(model=name, prompt=run["prompt"], max_tokens=len(run["tokens"]),
                                         temperature=0, logprobs=1, extra_body={"ignore_eos": True})

    with ThreadPoolExecutor(len(runs)) as pool:      # at once: batched in the same steps
        replies = list(pool.map(ask, runs))
    for run, reply in zip(runs, replies):
        pieces = reply.choices[0].logprobs.tokens
        assert pieces == [tokenizer.decode([t]) for t in run["tokens"]]
        assert reply.usage.completion_tokens == len(run["tokens"])
