"""Multimodal over HTTP: feature parts in chat messages, their errors as OpenAI error objects."""

from __future__ import annotations

import io

import numpy as np
import openai
import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.testing.bos_server import LoopbackBos
from tests.serverkit import SMALL, Server

HIDDEN = 64


def npy(seed: int, rows: int) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(seed).standard_normal((rows, HIDDEN)).astype(np.float32))
    return buf.getvalue()


@pytest.fixture(scope="module")
def bos():
    with LoopbackBos(access_key="AKmm") as server:
        server.put("feats", "img/cat.npy", npy(1, 4))
        server.put("feats", "img/slow.npy", npy(2, 4), latency=3.0)
        server.fail("feats", "img/flaky.npy", status=503, code="SlowDown", times=100)
        yield server


@pytest.fixture(scope="module")
def server(test_model_dir, tmp_path_factory, bos):
    features = tmp_path_factory.mktemp("features")
    (features / "dog.npy").write_bytes(npy(3, 6))
    srv = Server([*SMALL, "--model", str(test_model_dir), "--served-model-name", "mm",
                  "--allowed-feature-path", str(features)],
                 tmp_path_factory.mktemp("serve") / "mm.log", api_key="secret-key-123",
                 FDPLUG_BOS_ENDPOINT=bos.endpoint, FDPLUG_BOS_AK="AKmm", FDPLUG_BOS_SK="SKmm",
                 FDPLUG_BOS_MAX_RETRIES="0", FDPLUG_FETCH_TIMEOUT="1").wait_ready()
    srv.features = features
    yield srv
    assert srv.stop() == 0, srv.log()


def image(url: str, grid=(1, 4, 4), **extra) -> dict:
    return {"type": "image_feature", "image_feature": {"url": url, "grid_thw": list(grid), **extra}}


def ask(server, parts: list[dict], text: str = "describe") -> openai.types.chat.ChatCompletion:
    return server.openai().chat.completions.create(
        model="mm", temperature=0, max_tokens=8, extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": [*parts, {"type": "text", "text": text}]}])


def test_features_from_bos_and_files_match_offline(server, bos, test_model_dir, monkeypatch):
    cat, dog = "bos://feats/img/cat.npy", (server.features / "dog.npy").as_uri()
    parts = [image(cat, uuid="cat-1"), image(dog, (1, 4, 6))]
    got = ask(server, parts).choices[0].message.content
    for name, value in {"FDPLUG_BOS_ENDPOINT": bos.endpoint, "FDPLUG_BOS_AK": "AKmm", "FDPLUG_BOS_SK": "SKmm"}.items():
        monkeypatch.setenv(name, value)
    llm = LLM(str(test_model_dir), max_model_len=512, num_kv_blocks=64,
              allowed_feature_paths=(str(server.features),))
    prompt = llm.chat_prompt([{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}])
    want = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    assert got == want
    before = bos.request_count("feats", "img/cat.npy")
    ask(server, [image(cat, uuid="cat-1")], "again")
    assert bos.request_count("feats", "img/cat.npy") == before  # the uuid hit the encoder cache


@pytest.mark.parametrize("part, status, words", [
    (image("bos://feats/img/missing.npy"), 400, "missing.npy"),
    (image("file:///etc/passwd"), 400, "/etc/passwd"),
    (image("bos://feats/img/cat.npy", (1, 4, 8)), 400, "rows"),
    (image("bos://feats/img/flaky.npy"), 502, "flaky.npy"),
    (image("bos://feats/img/slow.npy"), 504, "slow.npy"),
    ({"type": "image_url", "image_url": {"url": "http://x/y.png"}}, 400, "image_url"),
    (image("bos://feats/img/cat.npy", (1, 3, 4)), 400, "merge size"),
])
def test_feature_failures_are_error_objects(server, part, status, words):
    with pytest.raises(openai.APIStatusError) as err:
        ask(server, [part])
    assert err.value.status_code == status
    body = err.value.body
    assert words in body["message"] and "secret-key-123" not in str(body) and "SKmm" not in str(body)
    assert ask(server, [], "still serving").choices[0].finish_reason == "length"
