"""Fault injection: a runner that fails on chosen requests, and the engine containing it.

The runner is a throwaway plugin (``tests/fault_plugin.py``), installed as a distribution and
selected by name like a vendor's. Every scenario runs a batch of bystanders (greedy, and seeded
random) with one or two poisoned requests, and checks: each poisoned request ends with finish
reason "error" (after the tokens it made before the fault), every bystander's tokens equal a clean
run's, the runner agrees with the scheduler, every KV block is free at the end, and the engine
serves the next request.
"""

from __future__ import annotations

import json

import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.plugin_api.sampling_params import SamplingParams
from tests import fault_plugin
from tests.conftest import REPO, write_dist
from tests.serverkit import Server

MARKER = 77
MAX_TOKENS = 24
AFTER = 5       # a poisoned request fails once it has generated this many tokens: mid-decode

BYSTANDERS = [[10 + i, 20 + 3 * i, 30, 40 - i, 5 * i + 1, 9] for i in range(6)]
PARAMS = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)] * 4 + \
    [SamplingParams(temperature=0.8, top_p=0.9, seed=11 + i, max_tokens=MAX_TOKENS, ignore_eos=True) for i in range(2)]
CULPRIT = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def install(site) -> None:
    write_dist(site, "fdplug-faulty", "0.1", {"faulty": "tests.fault_plugin"})


def faulty_runner_env(site, **fault) -> dict[str, str]:
    """Installs the plugin in ``site``; the environment a server takes to run it (``--runner faulty``)
    with ``fault`` (`fault_plugin.FAULT`'s keys) in its engine process."""
    install(site)
    return {"FAULTY_RUNNER": json.dumps(fault), "PYTHONPATH": f"{site}:{REPO}"}


@pytest.fixture(scope="module")
def llm(test_model_dir, tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    install(site)
    import sys

    sys.path.insert(0, str(site))
    try:
        from fdplug.core.plugin_loading import loader as plugins

        plugins._cache.clear()
        yield LLM(str(test_model_dir), runner="faulty", max_model_len=128, num_kv_blocks=200, max_num_seqs=16)
    finally:
        sys.path.remove(str(site))


@pytest.fixture(scope="module")
def clean(llm) -> list[list[int]]:
    fault_plugin.inject(None)
    return [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in BYSTANDERS], PARAMS, use_tqdm=False)]


def run(llm, culprits: int) -> tuple[list, list]:
    """The bystanders with ``culprits`` poisoned requests among them (no prefix hits from earlier runs)."""
    llm.engine.scheduler.reset_prefix_cache()
    poisoned = [[MARKER, 3 + i, 8, 1] for i in range(culprits)]
    prompts = BYSTANDERS[:3] + poisoned + BYSTANDERS[3:]
    params = PARAMS[:3] + [CULPRIT] * culprits + PARAMS[3:]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return outs[:3] + outs[3 + culprits:], outs[3:3 + culprits]


def run_with(llm, mode: str, culprits: int = 1, **fault) -> tuple[list, list]:
    """``run`` with a fault injected for its duration; how many times it fired is in FAULT["fired"]."""
    fault_plugin.inject(mode, **{"marker": MARKER, "after": AFTER, **fault})
    try:
        return run(llm, culprits)
    finally:
        fault_plugin.FAULT["mode"] = None


def assert_contained(llm, clean, bystanders, culprits, after: int = AFTER) -> None:
    assert [o.outputs[0].token_ids for o in bystanders] == clean
    assert all(o.outputs[0].finish_reason == "length" for o in bystanders)
    for out in culprits:
        assert out.outputs[0].finish_reason == "error"
        assert len(out.outputs[0].token_ids) == after      # what it made before the fault stays
        assert type(out.error).__name__ == "EngineRequestError" and out.error.http_status == 500, out.error
    engine = llm.engine
    assert engine.consistency_problems() == []
    assert not engine.scheduler.requests and not engine.scheduler.running
    pool = engine.scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == engine.kv_plan.num_blocks - 1      # every block back (null excluded)


@pytest.mark.parametrize("mode, culprits, after", [
    ("raise", 1, AFTER),     # nobody blamed: found by re-running halves
    ("raise", 2, AFTER),     # two culprits in different halves
    ("blame", 1, AFTER),     # the runner names it
    ("add", 1, 0),           # its slot cannot be written when it arrives: InputBatch.add leaves no trace
    ("oov", 1, AFTER),       # a token outside the vocabulary: the engine checks what every runner returns
    ("corrupt", 1, AFTER),   # the runner also lost a bystander's slot: rebuilt from the scheduler
])
def test_a_failing_request_fails_alone_and_bystanders_match_a_clean_run(llm, clean, mode, culprits, after):
    failed_before, rebuilds_before = llm.engine.num_failed_steps, llm.engine.num_rebuilds
    bystanders, poisoned = run_with(llm, mode, culprits, after=after)
    assert fault_plugin.FAULT["fired"] >= culprits
    assert llm.engine.num_failed_steps > failed_before
    assert (llm.engine.num_rebuilds > rebuilds_before) == (mode == "corrupt")
    assert_contained(llm, clean, bystanders, poisoned, after)
    again = llm.generate({"prompt_token_ids": BYSTANDERS[0]}, PARAMS[0], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == clean[0]


def test_the_error_names_the_cause(llm, clean):
    _, (culprit,) = run_with(llm, "oov")
    assert "outside the vocabulary" in culprit.error.message and culprit.error.http_status == 500


def test_a_transient_fault_fails_nobody(llm, clean):
    bystanders, (poisoned,) = run_with(llm, "raise", times=1)
    assert fault_plugin.FAULT["fired"] == 1
    assert [o.outputs[0].token_ids for o in bystanders] == clean
    assert poisoned.outputs[0].finish_reason == "length" and len(poisoned.outputs[0].token_ids) == MAX_TOKENS
    assert llm.engine.consistency_problems() == []


def test_requests_left_undecided_by_the_budget_are_requeued_not_failed(llm, clean, monkeypatch):
    """With no re-runs allowed, a failed step decides nothing: its requests go back to the queue and
    are recomputed; a transient fault then fails nobody, and nothing is left half-done."""
    from fdplug.core.engine import step_recovery

    monkeypatch.setattr(step_recovery, "rerun_budget", lambda n: 0)
    bystanders, (poisoned,) = run_with(llm, "raise", times=1)
    assert [o.outputs[0].token_ids for o in bystanders] == clean
    assert poisoned.outputs[0].finish_reason == "length"
    assert llm.engine.consistency_problems() == [] and not llm.engine.scheduler.requests


def test_a_tiny_budget_still_finds_the_culprit_over_several_steps(llm, clean, monkeypatch):
    from fdplug.core.engine import step_recovery

    monkeypatch.setattr(step_recovery, "rerun_budget", lambda n: 2)
    failed_before = llm.engine.num_failed_steps
    bystanders, poisoned = run_with(llm, "raise")
    assert llm.engine.num_failed_steps - failed_before >= 2     # it took more than one failed step
    assert_contained(llm, clean, bystanders, poisoned)


def test_a_runner_broken_as_a_whole_is_rebuilt_once_and_then_fails_the_step(llm, clean):
    """Every request of a step failing even alone points at the runner: its requests are rebuilt
    from the scheduler (nobody fails). If that cures it, everyone finishes as in a clean run; if the
    very next steps fail the same way, those requests fail rather than loop."""
    engine = llm.engine
    rebuilds = engine.num_rebuilds
    bystanders, (poisoned,) = run_with(llm, "broken_until_rebuilt")
    assert engine.num_rebuilds == rebuilds + 1
    assert [o.outputs[0].token_ids for o in bystanders] == clean and poisoned.outputs[0].finish_reason == "length"

    engine._last_rebuild_step = -1000      # as if the last rebuild were long ago
    bystanders, (poisoned,) = run_with(llm, "broken")
    assert engine.num_rebuilds == rebuilds + 2
    assert {o.outputs[0].finish_reason for o in [*bystanders, poisoned]} == {"error"}
    assert engine.consistency_problems() == [] and not engine.scheduler.requests
    again = llm.generate({"prompt_token_ids": BYSTANDERS[0]}, PARAMS[0], use_tqdm=False)[0]
    assert again.outputs[0].token_ids == clean[0]


# -- over HTTP ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def faulty_server(test_model_dir, tmp_path_factory):
    env = faulty_runner_env(tmp_path_factory.mktemp("site"), mode="raise", marker=MARKER, after=AFTER)
    srv = Server(["--model", str(test_model_dir), "--served-model-name", "m", "--runner", "faulty",
                  "--max-model-len", "128", "--num-kv-blocks", "200"],
                 tmp_path_factory.mktemp("serve") / "faulty.log", **env).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def test_over_http_the_culprit_gets_a_500_and_the_streams_beside_it_finish(faulty_server):
    import asyncio

    import openai

    async def stream(client, prompt, params: SamplingParams) -> tuple[str, str]:
        extra = {"ignore_eos": True, "top_p": params.top_p,
                 **({"seed": params.seed} if params.seed is not None else {})}
        text, finish = [], None
        async for chunk in await client.completions.create(model="m", prompt=prompt, max_tokens=params.max_tokens,
                                                           temperature=params.temperature, stream=True,
                                                           extra_body=extra):
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        return "".join(text), finish

    async def bystanders(with_culprit: bool):
        client = faulty_server.async_openai()
        tasks = [stream(client, p, params) for p, params in zip(BYSTANDERS, PARAMS)]
        if with_culprit:
            tasks.append(client.completions.create(model="m", prompt=[MARKER, 3, 8, 1], max_tokens=MAX_TOKENS,
                                                   temperature=0, extra_body={"ignore_eos": True}))
        return await asyncio.gather(*tasks, return_exceptions=True)

    alone = asyncio.run(bystanders(False))
    *together, culprit = asyncio.run(bystanders(True))
    assert isinstance(culprit, openai.InternalServerError), culprit
    assert "the model step running this request failed" in culprit.body["message"]
    assert together == alone and all(finish == "length" for _, finish in alone)
    assert faulty_server.proc.poll() is None
