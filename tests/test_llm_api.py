"""The offline API as a user meets it: vLLM-shaped calls, typed errors, and an engine that keeps going."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import fdplug
from fdplug.core.frontend.llm import LLM
from fdplug.errors import (
    ConfigError,
    DeviceUnavailableError,
    InvalidRequestError,
    ModelLoadError,
    UnsupportedModelError,
)
from fdplug.plugin_api.sampling_params import SamplingParams
from tests.conftest import subprocess_env

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(test_model_dir):
    return LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=64, max_num_seqs=8)


def test_generate_returns_vllm_shaped_outputs_in_order(llm):
    outs = llm.generate(["hello", {"prompt_token_ids": [5, 6, 7]}], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outs] == ["hello", None]
    assert outs[1].prompt_token_ids == [5, 6, 7]
    for o in outs:
        assert o.finished and len(o.outputs) == 1
        out = o.outputs[0]
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
        assert out.text == llm.tokenizer.decode(out.token_ids)


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt.startswith("<|im_start|>") and out.prompt.endswith("<|im_start|>assistant\n")
    assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt, add_special_tokens=False)


def test_max_tokens_and_eos(llm, monkeypatch):
    """The random model never picks its real EOS, so the 4th greedy token is made the EOS."""
    prompt = {"prompt_token_ids": [9, 8, 7]}
    base = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(base.token_ids) == GREEDY.max_tokens and base.finish_reason == "length"
    eos = base.token_ids[3]
    assert eos not in base.token_ids[:3]    # so generation must run exactly 4 tokens to reach it
    monkeypatch.setattr(llm.input_processor, "eos_token_ids", (eos,))
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:4]
    assert out.finish_reason == "stop" and out.stop_reason is None      # an EOS, not a stop token
    ignored = llm.generate(prompt, GREEDY, use_tqdm=False)[0].outputs[0]
    assert ignored.token_ids == base.token_ids and ignored.finish_reason == "length"


def test_stop_token_ids_and_stop_strings(llm):
    base = llm.generate({"prompt_token_ids": [9, 8, 7]}, GREEDY, use_tqdm=False)[0].outputs[0]
    stop_token = base.token_ids[3]
    first = base.token_ids.index(stop_token)
    out = llm.generate({"prompt_token_ids": [9, 8, 7]}, SamplingParams(temperature=0, max_tokens=8,
                       stop_token_ids=[stop_token]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base.token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_token
    text = base.text
    needle = text[len(text) // 2:len(text) // 2 + 2]
    if needle.strip():
        out = llm.generate({"prompt_token_ids": [9, 8, 7]}, SamplingParams(temperature=0, max_tokens=8, stop=[needle]),
                           use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop" and out.stop_reason == needle
        assert out.text == text[:text.index(needle)]


def test_n_returns_n_sequences(llm):
    out = llm.generate("abc", SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy: identical


@pytest.mark.parametrize("prompt, message", [
    ("", "empty"),
    ({"prompt_token_ids": []}, "empty"),
    ({"prompt_token_ids": list(range(64))}, "the prompt has 64 tokens, but max_model_len is 64"),
    ({"prompt_token_ids": [1, 99999]}, "outside the vocabulary"),
    (3.14, "a prompt must be"),
])
def test_bad_prompts_are_typed_errors_and_the_engine_keeps_serving(llm, prompt, message):
    with pytest.raises(InvalidRequestError, match=message) as err:
        llm.generate(["fine", prompt], GREEDY, use_tqdm=False)
    assert err.value.fix
    assert not llm.engine.has_unfinished_requests()  # nothing of the batch was queued
    assert llm.generate("still works", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"


@pytest.mark.parametrize("params, field", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(n=0), "n"),
    (dict(logprobs=50), "logprobs"), (dict(max_tokens=0), "max_tokens"), (dict(top_k=-5), "top_k"),
    (dict(stop_token_ids=[10 ** 6]), "stop_token_ids"), (dict(presence_penalty=3), "presence_penalty"),
])
def test_invalid_sampling_parameters_name_the_field(llm, params, field):
    with pytest.raises(InvalidRequestError, match=field):
        llm.generate("x", SamplingParams(**params), use_tqdm=False)


def test_a_transient_step_failure_fails_nobody(llm, monkeypatch):
    """A step that raises once (and runs when retried) costs a re-run, not a request: both requests
    finish with the tokens of a clean run. Persistent faults: tests/test_step_recovery.py."""
    prompts = ["survivor", "also fine"]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    runner = llm.engine.runner
    real = runner.execute_model
    calls = {"n": 0}

    def flaky(so):
        if so.total_num_scheduled_tokens:
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("kernel exploded")
        return real(so)

    monkeypatch.setattr(runner, "execute_model", flaky)
    llm.engine.scheduler.reset_prefix_cache()
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert calls["n"] > 3 and llm.engine.num_failed_steps == 1
    assert [o.outputs[0].finish_reason for o in outputs] == ["length", "length"]
    assert [o.outputs[0].token_ids for o in outputs] == clean
    assert llm.engine.consistency_problems() == []


def test_model_dir_errors(tmp_path, test_model_dir):
    with pytest.raises(ModelLoadError, match="config.json"):
        LLM(str(tmp_path))
    broken = tmp_path / "weird"
    shutil.copytree(test_model_dir, broken)
    config = json.loads((broken / "config.json").read_text())
    config["architectures"] = ["MambaForCausalLM"]
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="MambaForCausalLM") as err:
        LLM(str(broken))
    assert "Qwen2ForCausalLM" in str(err.value)
    (test_model_dir / "model.safetensors").rename(tmp_path / "moved")
    try:
        with pytest.raises(ModelLoadError, match="safetensors"):
            LLM(str(test_model_dir))
    finally:
        (tmp_path / "moved").rename(test_model_dir / "model.safetensors")


def test_engine_argument_errors(test_model_dir):
    with pytest.raises(ConfigError, match="unknown engine argument"):
        LLM(str(test_model_dir), max_batch_size=3)
    with pytest.raises(ConfigError, match="computes in float32"):
        LLM(str(test_model_dir), dtype="float16")
    with pytest.raises(DeviceUnavailableError, match="xpu"):
        LLM(str(test_model_dir), device="xpu")
    with pytest.raises(ConfigError, match="cannot hold one request"):
        LLM(str(test_model_dir), max_model_len=256, num_kv_blocks=4)


def test_public_api():
    assert fdplug.LLM is LLM and fdplug.SamplingParams is SamplingParams


def test_generate_cli_streams_text(test_model_dir):
    out = subprocess.run([str(Path(sys.executable).parent / "fdplug"), "generate", "--model", str(test_model_dir),
                          "--prompt", "hello", "--max-tokens", "5", "--max-model-len", "64"],
                         capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert out.returncode == 0, out.stderr
    llm = LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=16)
    expected = llm.generate("hello", SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0].text
    assert out.stdout.rstrip("\n") == expected
    assert "device=cpu" in out.stderr


def test_seeded_sampling_is_reproducible_across_batch_compositions(llm):
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("tell me", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=5, ignore_eos=True), GREEDY,
              SamplingParams(temperature=1.2, seed=7, max_tokens=20, ignore_eos=True)]
    mixed = llm.generate(["noise", "tell me", "more noise", "x"], [others[0], seeded, others[1], others[2]],
                         use_tqdm=False)
    assert mixed[1].outputs[0].token_ids == alone
    unseeded = [llm.generate("tell me", SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),
                             use_tqdm=False)[0].outputs[0].token_ids for _ in range(3)]
    assert len({tuple(u) for u in unseeded}) > 1  # without a seed, draws differ


def test_n_with_a_seed_gives_distinct_reproducible_sequences(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True)
    first = [o.token_ids for o in llm.generate("abc", params, use_tqdm=False)[0].outputs]
    again = [o.token_ids for o in llm.generate("abc", params, use_tqdm=False)[0].outputs]
    assert first == again and len({tuple(f) for f in first}) == 3


def test_logprobs_of_the_raw_distribution(llm):
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True),
                       use_tqdm=False)[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the most likely token
        ranked = sorted(entry.values(), key=lambda lp: lp.rank)
        assert [lp.rank for lp in ranked] == [1, 2, 3]  # the sampled token is one of the top 3
        assert all(lp.logprob <= 0 for lp in entry.values())
        assert ranked[0].logprob >= ranked[1].logprob >= ranked[2].logprob
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_repetition_penalty_changes_greedy_output(llm):
    base = llm.generate("aaaa", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    penalised = llm.generate("aaaa", SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                                                    repetition_penalty=5.0, frequency_penalty=2.0),
                             use_tqdm=False)[0].outputs[0].token_ids
    assert penalised != base
    assert len(set(penalised)) >= len(set(base))


def test_penalised_request_is_the_same_next_to_unpenalised_ones(llm):
    """Only penalised rows keep their token counts up to date; a penalised request batched with
    unpenalised ones (before and after it in the slots) decodes as it does alone."""
    penalised = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.5,
                               frequency_penalty=0.7, presence_penalty=0.3)
    plain = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = llm.generate("abab abab", penalised, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(["zz top", "abab abab", "hello there"], [plain, penalised, plain], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == alone
    assert outs[0].outputs[0].token_ids == llm.generate("zz top", plain, use_tqdm=False)[0].outputs[0].token_ids


def test_generate_queues_any_number_of_prompts(llm):
    """Offline, a generate() call queues all of its prompts at once: more than the server's default
    waiting limit (1024) is not a "retry later"."""
    prompts = [{"prompt_token_ids": [1 + i % 500, 7]} for i in range(1100)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
    assert len(outs) == 1100 and all(o.outputs[0].finish_reason == "length" for o in outs)


def test_a_refused_generate_leaves_nothing_queued(test_model_dir):
    """With a waiting limit, a batch that does not fit is refused whole: nothing of it stays queued
    to run (and be lost) with the next call."""
    from fdplug.errors import QueueFullError

    small = LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=64, max_num_seqs=8, max_waiting_requests=3)
    with pytest.raises(QueueFullError):
        small.generate(["a", "b", {"prompt_token_ids": [5]}, "d"], GREEDY, use_tqdm=False)
    assert not small.engine.has_unfinished_requests()
    with pytest.raises(QueueFullError):
        small.generate("x", SamplingParams(temperature=0, max_tokens=8, n=4), use_tqdm=False)
    assert not small.engine.has_unfinished_requests()
    assert small.generate("a", GREEDY, use_tqdm=False)[0].outputs[0].finish_reason == "length"
