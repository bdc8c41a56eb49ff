"""Prefill/decode disaggregation between two engines (`fdplug.core.kv_transfer`), driven by hand.

A prefill engine runs each prompt with ``max_tokens=1`` and offers its full prompt blocks; a decode
engine takes the request with the prefill's ``kv_transfer_params``, pulls the blocks over a real
ZMQ socket, and continues: every request gets one engine's greedy tokens (prompts shorter than a
block, exactly two blocks, and longer; one seen before, whose blocks the decode side already
holds, and which it tells the prefill engine to let go of). Both engines end with no request and no
block in use. A pull of a transfer the prefill
does not know fails its request alone with a typed error, and a request whose first token already
ends it finishes at once.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.core.request import Request
from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.sampling_params import SamplingParams
from tests.conftest import write_test_model

PROMPTS = [[5, 9, 2], [11, 3, 8, 21, 34, 55, 89, 14, 23, 37, 60, 97, 57, 54, 11, 65, 76, 41, 17, 58, 75, 33, 8, 41,
                       49, 90, 39, 29, 68, 97, 65, 62],
           [7] * 37, [5, 9, 2, 6, 1, 4, 8, 3, 2, 7, 7, 7, 1, 2, 3, 4, 5, 6, 7]]
TOKENS = 10
ARGS = {"num_kv_blocks": 64, "max_model_len": 128, "block_size": 16}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_test_model(tmp_path_factory.mktemp("pd") / "m"))


def request(rid: str, prompt: list[int], max_tokens: int, eos, params: dict) -> Request:
    r = Request(rid, prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True), tuple(eos))
    r.kv_transfer_params = params
    return r


def drive(engines, until, timeout: float = 60.0) -> dict[str, list]:
    """Step every engine that has work until ``until(outputs)``; outputs by request id."""
    got: dict[str, list] = {}
    deadline = time.monotonic() + timeout
    while not until(got):
        assert time.monotonic() < deadline, f"not done in {timeout} s: {got}"
        for engine in engines:
            if engine.has_unfinished_requests():
                for out in engine.step()[0]:
                    got.setdefault(out.request_id, []).append(out)
    return got


def finished(ids):
    return lambda got: all(any(o.finished for o in got.get(i, [])) for i in ids)


def peer_of(prefill: LLM) -> dict:
    """A decode side without FDPLUG_PD_SECRET pulls only from prefill instances it names
    (``--kv-peers``): ``prefill``'s KV endpoint (a free port of this machine)."""
    return {"kv_peers": (prefill.engine.kv_transfer.sender.address.removeprefix("tcp://"),)}


def test_decode_continues_what_prefill_started_with_one_engines_tokens(model, monkeypatch):
    monkeypatch.setenv("FDPLUG_PD_SECRET", "shared by both sides")
    want = [o.outputs[0].token_ids for o in LLM(model, **ARGS).generate(
        [{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True),
        use_tqdm=False)]
    prefill, decode = LLM(model, kv_role="prefill", **ARGS), LLM(model, kv_role="decode", **ARGS)
    eos = prefill.model_config.eos_token_ids
    for round_ in range(2):      # the second time, the decode side holds the prompts' blocks already
        ids = [f"r{round_}-{i}" for i in range(len(PROMPTS))]
        for rid, prompt in zip(ids, PROMPTS):
            prefill.engine.add_request(request(rid, prompt, 1, eos, {"do_remote_decode": True}))
        first = drive([prefill.engine], finished(ids))
        params = {rid: next(o for o in outs if o.finished).kv_transfer_params for rid, outs in first.items()}
        assert all(p["first_token"] == first[rid][-1].new_token_ids[-1] for rid, p in params.items())
        assert all(p["connector"] == "shm" and p["mm_hashes"] == [] and len(p["sig"]) == 64 for p in params.values())
        for rid, prompt in zip(ids, PROMPTS):
            decode.engine.add_request(request(rid, prompt, TOKENS, eos, params[rid]))
        got = drive([prefill.engine, decode.engine], finished(ids))
        for rid, expected in zip(ids, want):
            tokens = [t for o in got[rid] for t in o.new_token_ids]
            assert tokens == expected and got[rid][-1].finish_reason == "length", rid
        if round_ == 0:        # every offer pulled: the prefill side holds no block any more
            assert not prefill.engine.kv_transfer.held and prefill.engine.scheduler.kv_cache_manager.usage == 0.0
    drive([prefill.engine], lambda _: not prefill.engine.kv_transfer.held, timeout=10)   # released by decode
    if decode.engine.scheduler.kv_cache_manager.block_pool.prefix_cache_stats.hits == 0:
        pytest.fail("the decode side never hit the pulled blocks in its prefix cache")
    for llm in (decode, prefill):
        assert not llm.engine.scheduler.requests
    assert decode.engine.scheduler.kv_cache_manager.usage == 0.0


def test_a_pull_that_cannot_be_served_fails_its_request_alone(model):
    prefill = LLM(model, kv_role="prefill", **ARGS)
    decode = LLM(model, kv_role="decode", **peer_of(prefill), **ARGS)
    eos = prefill.model_config.eos_token_ids
    prefill.engine.add_request(request("p", PROMPTS[2], 1, eos, {"do_remote_decode": True}))
    params = next(o for o in drive([prefill.engine], finished(["p"]))["p"] if o.finished).kv_transfer_params
    forged = {**params, "conn": {**params["conn"], "transfer_id": "0" * 32}}
    decode.engine.add_request(request("bad", PROMPTS[2], TOKENS, eos, forged))
    decode.engine.add_request(request("good", PROMPTS[2], TOKENS, eos, params))
    decode.engine.add_request(request("short", PROMPTS[2], 1, eos, params))
    for wrong in ({**params, "prompt_digest": "0" * 64}, {**params, "connector": "tcp"}, {**params, "block_size": 8},
                  {**params, "first_token": 10 ** 6}, {**params, "num_cached_tokens": 99}):
        with pytest.raises(InvalidRequestError, match="kv_transfer_params"):
            decode.engine.add_request(request("wrong", PROMPTS[2], TOKENS, eos, wrong))
    asks = request("wrong", PROMPTS[2], TOKENS, eos, params)
    asks.sampling_params.logprobs = 1
    with pytest.raises(InvalidRequestError, match="no first_logprobs"):     # prefill ran without logprobs
        decode.engine.add_request(asks)
    got = drive([prefill.engine, decode.engine], finished(["bad", "good", "short"]))
    assert got["bad"][-1].finish_reason == "error" and got["bad"][-1].error["type"] == "KVTransferError"
    assert "unknown_transfer" in got["bad"][-1].error["message"]
    assert (got["good"][-1].finish_reason == "length"
            and len([t for o in got["good"] for t in o.new_token_ids]) == TOKENS)
    assert [t for o in got["short"] for t in o.new_token_ids] == [params["first_token"]]   # max_tokens 1: done
    assert not decode.engine.scheduler.requests and decode.engine.scheduler.kv_cache_manager.usage == 0.0


def test_params_a_decode_instance_cannot_verify_never_reach_another_request(model, monkeypatch):
    """Signed with another secret: refused. Unsigned, on a decode instance without the secret that
    names the prefill instance in its --kv-peers: served (the same tokens), but its blocks are its
    own: the same prompt later hits none of them."""
    monkeypatch.setenv("FDPLUG_PD_SECRET", "the prefill side's")
    prefill = LLM(model, kv_role="prefill", **ARGS)
    monkeypatch.setenv("FDPLUG_PD_SECRET", "another")
    strict = LLM(model, kv_role="decode", **ARGS)
    monkeypatch.delenv("FDPLUG_PD_SECRET")
    open_ = LLM(model, kv_role="decode", **peer_of(prefill), **ARGS)      # unsigned: from its named peer only
    eos = prefill.model_config.eos_token_ids
    prefill.engine.add_request(request("p", PROMPTS[1], 1, eos, {"do_remote_decode": True}))
    params = next(o for o in drive([prefill.engine], finished(["p"]))["p"] if o.finished).kv_transfer_params
    with pytest.raises(InvalidRequestError, match="FDPLUG_PD_SECRET"):
        strict.engine.add_request(request("d", PROMPTS[1], TOKENS, eos, params))
    open_.engine.add_request(request("d", PROMPTS[1], TOKENS, eos, params))
    got = drive([prefill.engine, open_.engine], finished(["d"]))
    assert got["d"][-1].finish_reason == "length"
    kv = open_.engine.scheduler.kv_cache_manager
    assert kv.get_computed_blocks(Request("again", PROMPTS[1], SamplingParams(max_tokens=1), tuple(eos))) == ([], 0)


def test_a_decode_side_with_no_free_blocks_fails_the_request_in_time_and_holds_nothing(model, monkeypatch):
    """Every block of the decode side taken (as by other requests): the request waits for blocks
    no longer than FDPLUG_KV_TRANSFER_TIMEOUT, then fails alone with a typed 504; the prefill side
    lets go at its pickup timeout."""
    monkeypatch.setenv("FDPLUG_KV_TRANSFER_TIMEOUT", "0.5")
    monkeypatch.setenv("FDPLUG_KV_PICKUP_TIMEOUT", "1")
    prefill = LLM(model, kv_role="prefill", **ARGS)
    decode = LLM(model, kv_role="decode", **peer_of(prefill), **ARGS)
    eos = prefill.model_config.eos_token_ids
    prefill.engine.add_request(request("p", PROMPTS[2], 1, eos, {"do_remote_decode": True}))
    params = next(o for o in drive([prefill.engine], finished(["p"]))["p"] if o.finished).kv_transfer_params
    pool = decode.engine.scheduler.kv_cache_manager.block_pool
    taken = pool.get_new_blocks(pool.get_num_free_blocks())
    began = time.monotonic()
    decode.engine.add_request(request("d", PROMPTS[2], TOKENS, eos, params))
    got = drive([decode.engine], finished(["d"]), timeout=10)
    assert got["d"][-1].error["type"] == "KVTransferTimeoutError" and time.monotonic() - began < 5
    assert [t for o in got["d"] for t in o.new_token_ids] == [params["first_token"]]
    pool.free_blocks(taken)
    assert not decode.engine.scheduler.requests and decode.engine.scheduler.kv_cache_manager.usage == 0.0
    drive([prefill.engine], lambda _: not prefill.engine.kv_transfer.held, timeout=10)
    assert prefill.engine.scheduler.kv_cache_manager.usage == 0.0


def test_a_connector_that_breaks_fails_its_transfers_not_the_engine(model, monkeypatch):
    """The receiver's poll raises (a vendor connector's bug): the request being pulled fails with a
    typed error, and the engine goes on serving a request of its own."""
    prefill = LLM(model, kv_role="prefill", **ARGS)
    decode = LLM(model, kv_role="decode", **peer_of(prefill), **ARGS)
    eos = prefill.model_config.eos_token_ids
    prefill.engine.add_request(request("p", PROMPTS[2], 1, eos, {"do_remote_decode": True}))
    params = next(o for o in drive([prefill.engine], finished(["p"]))["p"] if o.finished).kv_transfer_params

    def broken():
        raise RuntimeError("the DMA engine fell over")

    monkeypatch.setattr(decode.engine.kv_transfer.receiver, "poll", broken)
    decode.engine.add_request(request("d", PROMPTS[2], TOKENS, eos, params))
    decode.engine.add_request(request("own", PROMPTS[1], TOKENS, eos, None))
    got = drive([decode.engine], finished(["d", "own"]))
    assert got["d"][-1].error["type"] == "KVTransferError" and "RuntimeError" in got["d"][-1].error["message"]
    assert got["own"][-1].finish_reason == "length"
    assert not decode.engine.scheduler.requests and decode.engine.scheduler.kv_cache_manager.usage == 0.0


def test_multimodal_prompts_continue_on_a_decode_side_that_never_fetches_unless_it_preempts(test_model_dir, tmp_path):
    """Images, a video and plain text prefilled on one engine (which fetches the features) and
    decoded on another: one engine's tokens (the naive reference's). The decode side fetches
    nothing while it holds the pulled KV; with few blocks it preempts, and a preempted request
    fetches its features where it must recompute their rows, as any preempted request would."""
    from tests.test_multimodal import (
        GREEDY,
        chat,
        feature,
        image,
        make_llm,
        naive_mm_greedy,
        video,
    )

    root = tmp_path / "features"
    root.mkdir()
    for name, seed, rows in [("cat", 1, 4), ("dog", 2, 6), ("video", 3, 8)]:
        np.save(root / f"{name}.npy", feature(seed, rows))
    prefill = make_llm(test_model_dir, root, kv_role="prefill")
    prompts = [(chat(prefill, [], "plain text only"), []),       # the newest runs are multimodal: preempted first
               (chat(prefill, [image(root, "cat")]), [feature(1, 4)]),
               (chat(prefill, [image(root, "dog", (1, 4, 6)), image(root, "cat", uuid="cat-1")], "compare"),
                [feature(2, 6), feature(1, 4)]),
               (chat(prefill, [video(root, "video")], "what happens"), [feature(3, 8)])]
    want = [naive_mm_greedy(prefill, p, f, GREEDY.max_tokens) for p, f in prompts]
    for decode_args, preempts in (({}, False), ({"num_kv_blocks": 9, "max_num_seqs": 4}, True)):
        decode = make_llm(test_model_dir, root, kv_role="decode", **peer_of(prefill), **decode_args)
        ids = [f"{preempts}-{i}" for i in range(len(prompts))]
        processed = [prefill.input_processor.process(p) for p, _ in prompts]
        for rid, prompt in zip(ids, processed):
            (req,) = prefill.input_processor.make_requests(rid, prompt, SamplingParams(temperature=0, max_tokens=1))
            req.kv_transfer_params = {"do_remote_decode": True}
            prefill.engine.add_request(req)
        first = drive([prefill.engine], finished(ids))
        for rid, prompt in zip(ids, processed):
            (req,) = decode.input_processor.make_requests(rid, prompt, GREEDY)
            req.kv_transfer_params = next(o for o in first[rid] if o.finished).kv_transfer_params
            decode.engine.add_request(req)
        got = drive([prefill.engine, decode.engine], finished(ids))
        assert [[t for o in got[rid] for t in o.new_token_ids] for rid in ids] == want
        assert (decode.engine.stats().num_preemptions > 0) is preempts
        # no feature fetched unless preempted; a preempted one fetches only if its items' blocks left the
        # prefix cache meanwhile (which requests are preempted, and what stays cached, depends on the
        # order the pulls land in)
        assert preempts or len(decode.engine.encoder_cache) == 0
        assert not decode.engine.scheduler.requests and decode.engine.scheduler.kv_cache_manager.usage == 0.0
