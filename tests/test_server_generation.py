"""What `fdplug serve` generates, through the official openai client, on a model whose greedy output
depends on its whole context (``write_test_model``): stops, lengths, seeds, logprobs, n, and 32
concurrent streams that must each match the same prompt's non-streamed greedy result.
"""

from __future__ import annotations

import asyncio

import pytest

from tests.serverkit import SMALL, Server, wait_until
from tests.test_step_recovery import faulty_runner_env

PROMPTS = [f"Request {i}: the {w} of the day is" for i, w in enumerate(
    ["weather", "news", "story", "plan", "song", "word", "joke", "task"] * 4)]


@pytest.fixture(scope="module")
def server(test_model_dir, tmp_path_factory):
    srv = Server([*SMALL, "--model", str(test_model_dir), "--served-model-name", "sharp"],
                 tmp_path_factory.mktemp("serve") / "sharp.log").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


@pytest.fixture(scope="module")
def client(server):
    return server.openai()


def complete(client, prompt, **kw):
    kw.setdefault("temperature", 0)
    extra = {"ignore_eos": kw.pop("ignore_eos")} if "ignore_eos" in kw else None
    return client.completions.create(model="sharp", prompt=prompt, extra_body=extra, **kw)


def test_greedy_is_deterministic(client):
    a = complete(client, PROMPTS[0], max_tokens=16)
    b = complete(client, PROMPTS[0], max_tokens=16)
    assert a.choices[0].text == b.choices[0].text and a.choices[0].text


def test_max_tokens_and_finish_reason(client):
    r = complete(client, PROMPTS[1], max_tokens=7, ignore_eos=True)
    assert r.usage.completion_tokens == 7 and r.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model="sharp", messages=[{"role": "user", "content": "hi"}],
                                          max_completion_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    assert chat.usage.completion_tokens == 5 and chat.choices[0].finish_reason == "length"


def _stop_candidate(text: str) -> str:
    """A stop string from the middle of ``text``: printable, and not found earlier."""
    for start in range(4, len(text) - 3):
        cand = text[start:start + 3]
        if cand.isprintable() and "\ufffd" not in cand and text.index(cand) == start:
            return cand
    pytest.skip(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string(client, stream):
    full = complete(client, PROMPTS[2], max_tokens=40, ignore_eos=True).choices[0].text
    stop = _stop_candidate(full)
    kw = dict(max_tokens=40, ignore_eos=True, stop=[stop, "never-appears"])
    if stream:
        chunks = list(complete(client, PROMPTS[2], stream=True, **kw))
        text = "".join(c.choices[0].text for c in chunks)
        finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason][-1]
    else:
        r = complete(client, PROMPTS[2], **kw)
        text, finish = r.choices[0].text, r.choices[0].finish_reason
    assert text == full[:full.index(stop)]
    assert finish == "stop"


def test_n_choices(client):
    r = complete(client, PROMPTS[3], max_tokens=6, n=3, ignore_eos=True)
    assert [c.index for c in sorted(r.choices, key=lambda c: c.index)] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1          # greedy: all the same
    assert r.usage.completion_tokens == 18


def test_streaming_n(client):
    chunks = list(complete(client, PROMPTS[3], max_tokens=6, n=2, stream=True, ignore_eos=True))
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c.choices:
            texts[choice.index] += choice.text
    assert texts[0] == texts[1] == complete(client, PROMPTS[3], max_tokens=6, ignore_eos=True).choices[0].text


# -- need the full sampler (fdplug/core/model/sampling/sampler.py) ----------------------------------------------


def test_seeded_sampling_is_reproducible(client):
    kw = dict(max_tokens=16, temperature=1.0, ignore_eos=True)
    a = complete(client, PROMPTS[4], seed=1234, **kw).choices[0].text
    b = complete(client, PROMPTS[4], seed=1234, **kw).choices[0].text
    others = {complete(client, PROMPTS[4], seed=s, **kw).choices[0].text for s in (1, 2, 3)}
    assert a == b
    assert len(others | {a}) > 1, "different seeds gave the same text: is sampling still greedy-only?"


def test_seeded_n_children_differ(client):
    r = complete(client, PROMPTS[4], max_tokens=16, temperature=1.0, n=3, seed=7, ignore_eos=True)
    again = complete(client, PROMPTS[4], max_tokens=16, temperature=1.0, n=3, seed=7, ignore_eos=True)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == \
        [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len({c.text for c in r.choices}) > 1


def test_chat_logprobs(client):
    r = client.chat.completions.create(model="sharp", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
                                       temperature=0, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[-1].logprob
        assert entry.token == entry.top_logprobs[0].token          # greedy picks the most likely token
    assert "".join(e.token for e in content) == r.choices[0].message.content


def test_completion_logprobs(client):
    r = complete(client, PROMPTS[5], max_tokens=4, logprobs=2, ignore_eos=True)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(x <= 0 for x in lp.token_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2                      # two byte pieces that decode alike share one key
        assert max(top, key=top.get) == token          # greedy picks the most likely token
        assert top[token] == pytest.approx(logprob)
    assert lp.text_offset == sorted(lp.text_offset)


# -- concurrency ------------------------------------------------------------------------------------


def test_32_concurrent_streams_match_greedy(server, client):
    expected = complete(client, PROMPTS, max_tokens=24, ignore_eos=True)   # one batched, non-streamed request
    want = {c.index: c.text for c in expected.choices}

    async def one(aclient, i):
        text, finish = "", None
        stream = await aclient.completions.create(model="sharp", prompt=PROMPTS[i], max_tokens=24, temperature=0,
                                                  stream=True, extra_body={"ignore_eos": True})
        async for chunk in stream:
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def main():
        async with server.async_openai() as aclient:
            return await asyncio.wait_for(asyncio.gather(*(one(aclient, i) for i in range(32))), 120)

    results = asyncio.run(main())
    for i, (text, finish) in enumerate(results):
        assert finish == "length"
        assert text == want[i], f"stream {i} differs from its greedy result"
    wait_until(lambda: server.metrics()["fdplug:num_requests_running"] == 0, 10, what="all requests done")


def test_stream_interval_sends_the_first_token_alone_then_several_per_chunk(test_model_dir, client, tmp_path):
    """--stream-interval 4: fewer chunks, the same text as a chunk per step, the first token not delayed.

    The steps take 0.15 s each (``tests/fault_plugin.py``'s runner with ``step_s``: a slow device): the
    test model's own take a millisecond or two, so on a loaded machine several tokens could be queued
    before the response first reads them, and a response sends what is queued together (a run of the
    suite with one thread got 6 tokens in the first chunk); 0.45 s between the first token and the
    fourth leaves the API process the time."""
    srv = Server([*SMALL, "--model", str(test_model_dir), "--served-model-name", "sharp", "--stream-interval", "4",
                  "--runner", "faulty"], tmp_path / "interval.log",
                 **faulty_runner_env(tmp_path / "site", step_s=0.15)).wait_ready()
    try:
        batched = srv.openai()
        expected = complete(client, PROMPTS[9], max_tokens=11, ignore_eos=True).choices[0].text
        chunks = list(complete(batched, PROMPTS[9], max_tokens=11, ignore_eos=True, logprobs=1, stream=True))
        sizes = [len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs]
        assert sum(sizes) == 11 and 1 <= sizes[0] < 4 and len(sizes) <= 4, sizes   # a chunk per step: 11
        assert all(size >= 4 for size in sizes[1:-1]), sizes
        assert "".join(c.choices[0].text for c in chunks if c.choices) == expected
        assert chunks[-1].choices[0].finish_reason == "length"
        chat = batched.chat.completions.create(model="sharp", messages=[{"role": "user", "content": "hi"}],
                                               max_completion_tokens=9, temperature=0, stream=True,
                                               extra_body={"ignore_eos": True})
        parts = [c.choices[0].delta.content for c in chat if c.choices and c.choices[0].delta.content]
        assert 1 <= len(parts) <= 4 and "chunks of 4 tokens" in srv.log() and "chosen   faulty" in srv.log()
    finally:
        assert srv.stop() == 0, srv.log()
