"""Vision-language models end to end, against transformers: the language sides of Qwen2.5-VL and
ERNIE-4.5-VL (3-D RoPE positions; ERNIE's text and vision experts), their Paddle vision towers and
the image preprocessing, pictures in through ``LLM``.

The fixtures (tests/fixtures/vision/<model>, `tools/make_vl_golden.py`) are tiny random models with
transformers' pixel values, image features, 3-D positions, logits and greedy runs for three
prompts: one image, two images, text only.
"""

from __future__ import annotations

import base64
import itertools
import json
import struct
import zlib
from functools import cache

import numpy as np
import pytest
from PIL import Image

from fdplug.core.frontend.llm import LLM
from fdplug.core.vision.image_processing import PIXEL_ARCHITECTURES, decode, patchify
from fdplug.core.vision.tower import TOWERS
from fdplug.errors import InvalidRequestError
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.plugin_api.scheduled_work import MMPlaceholder
from tests.conftest import REPO
from tests.reference import full_logits

FIXTURES = REPO / "tests" / "fixtures" / "vision"
MODELS = ["qwen2_5_vl", "ernie4_5_vl"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


class Fixture:
    """One model's fixture: its directory, transformers' records, and prompts made from them."""

    def __init__(self, name: str) -> None:
        self.name, self.dir = name, FIXTURES / name
        self.gold = json.loads((self.dir / "golden.json").read_text())
        self.cases = self.gold["cases"]
        self.pad = self.gold["token_ids"]["image_pad"]

    def picture_bytes(self, image: str) -> bytes:
        return (self.dir / self.gold["images"][image]["file"]).read_bytes()

    def collapse(self, ids: list[int]) -> list[int]:
        """The prompt as a client sends it: one pad token per image (the engine widens it)."""
        return [t for key, run in itertools.groupby(ids) for t in ([key] if key == self.pad else list(run))]

    def prompt(self, case: dict, images: list | None = None) -> dict:
        out = {"prompt_token_ids": self.collapse(case["prompt"])}
        images = [Image.open(self.dir / self.gold["images"][n]["file"]) for n in case["images"]] \
            if images is None else images
        if images:
            out["multi_modal_data"] = {"image": images}
        return out

    def make_llm(self, **kw) -> LLM:
        return LLM(str(self.dir), **{"max_model_len": 256, "num_kv_blocks": 64, **kw})


QWEN = Fixture("qwen2_5_vl")
# (the Qwen fixture's, for the tests of what both models share; the server test imports them)
CASES, PAD, VL = QWEN.cases, QWEN.pad, QWEN.dir
picture_bytes, collapse, prompt, make_llm = QWEN.picture_bytes, QWEN.collapse, QWEN.prompt, QWEN.make_llm


def data_url(data: bytes, kind: str = "png") -> dict:
    return {"type": "image_url", "image_url": {"url": f"data:image/{kind};base64," + base64.b64encode(data).decode()}}


class CountingEncoder:
    """The runner's own encoder, counted: how many pictures actually ran through the tower."""

    def __init__(self, llm: LLM) -> None:
        self.inner, self.calls = llm.engine.runner.image_encoder, 0
        llm.engine.feature_loader.encoder = self

    def __call__(self, data: bytes, name: str) -> np.ndarray:
        self.calls += 1
        return self.inner(data, name)


@cache
def loaded(name: str) -> tuple[Fixture, LLM]:
    fixture = Fixture(name)
    return fixture, fixture.make_llm()


@pytest.fixture(params=MODELS)
def model(request) -> tuple[Fixture, LLM]:
    return loaded(request.param)


@pytest.fixture
def llm() -> LLM:
    return loaded("qwen2_5_vl")[1]


def tokens(llm: LLM, prompts: list[dict]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


# -- the parts, each against transformers ---------------------------------------------------------------


def test_every_architecture_with_pixels_has_its_tower():
    assert set(PIXEL_ARCHITECTURES) == set(TOWERS)


def test_preprocessing_is_transformers_value_for_value(model):
    fx, llm = model
    spec = llm.model_config.multimodal.image_spec
    patches, grid = patchify(decode(fx.picture_bytes("image_a"), "a"), spec)
    assert list(grid) == fx.gold["images"]["image_a"]["image_grid_thw"]
    np.testing.assert_allclose(patches, np.load(fx.dir / "pixel_values_a.npy"), rtol=0, atol=1e-6)
    patches, grid = patchify(decode(fx.picture_bytes("image_b"), "b"), spec)
    summary = fx.gold["pixel_values_b"]
    assert list(patches.shape) == summary["shape"] and list(grid) == fx.gold["images"]["image_b"]["image_grid_thw"]
    np.testing.assert_allclose(patches.ravel()[summary["sample_index"]], summary["sample_value"], atol=1e-6)
    assert abs(float(np.abs(patches).sum(dtype=np.float64)) - summary["abs_sum"]) < 1e-6 * summary["abs_sum"]


def test_the_vision_tower_gives_transformers_features(model):
    fx, llm = model
    for name, path in (("image_a", "features_a.npy"), ("image_b", "features_b.npy")):
        want = np.load(fx.dir / path)
        got = llm.engine.runner.image_encoder(fx.picture_bytes(name), name)
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * float(np.abs(want).max()))


def test_portable_vision_attention_is_softmax_within_each_segment():
    import paddle

    from fdplug.core.portable.vision_attention import vision_attention

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((41, 2, 8)).astype(np.float32) for _ in range(3))
    bounds = np.array([0, 16, 32, 40, 41])
    got = vision_attention(*(paddle.to_tensor(t) for t in (q, k, v)), bounds, 0.3).numpy()
    for a, b in zip(bounds[:-1], bounds[1:]):
        scores = np.einsum("qhd,khd->hqk", q[a:b], k[a:b]) * 0.3
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        want = np.einsum("hqk,khd->qhd", weights / weights.sum(-1, keepdims=True), v[a:b])
        np.testing.assert_allclose(got[a:b], want, rtol=1e-5, atol=1e-6)


def items(case: dict) -> list[MMPlaceholder]:
    return [MMPlaceholder(offset, int(np.prod(grid)) // 4, "", 0, tuple(grid), "image")
            for offset, grid in zip(case["image_offsets"], case["image_grid_thw"])]


@pytest.mark.parametrize("index", [0, 1])
def test_3d_positions_are_transformers_and_any_chunk_gets_its_own(model, index):
    fx, llm = model
    case, rule = fx.cases[index], llm.model_config.multimodal.mrope_rule()
    want = np.load(fx.dir / f"position_ids_{index}.npy").reshape(3, -1)
    n = len(case["prompt"])
    assert np.array_equal(rule.positions(np.arange(n), items(case)), want)
    assert rule.position_delta(items(case)) == case["rope_delta"] == want.max() + 1 - n
    rng = np.random.default_rng(index)
    for _ in range(20):   # a chunk, a resumed request, a cache hit: any subset of indices, in any order
        subset = rng.permutation(n)[:rng.integers(1, n)]
        assert np.array_equal(rule.positions(subset, items(case)), want[:, subset])
    decode_index = np.arange(n, n + 5)
    assert np.array_equal(rule.positions(decode_index, items(case)), np.tile(decode_index + case["rope_delta"], (3, 1)))


def test_video_positions_follow_each_models_time_rule():
    """A pre-encoded video: Qwen2.5-VL spaces its temporal patches ``tokens_per_second`` apart (one
    second each) and ERNIE-4.5-VL merges two frames per token row; the text after a video continues
    from its largest position + 1 (the original Qwen2.5-VL code and vLLM)."""
    from fdplug.core.multimodal.positions import MRopeRule

    for rule, grid, rows in ((MRopeRule(2, 2.0), (3, 4, 6), 3), (MRopeRule(2, 1.0, temporal_merge=2), (6, 4, 6), 3)):
        item = MMPlaceholder(4, rows * 2 * 3, "", 0, grid, "video")
        index = np.arange(item.end + 2)
        got = rule.positions(index, [item])
        k = np.arange(item.length)
        t, h, w = (k // 6) * (2 if rule.temporal_merge == 1 else 1), (k // 3) % 2, k % 3
        assert np.array_equal(got[:, :4], np.tile(np.arange(4), (3, 1)))
        assert np.array_equal(got[:, 4:item.end], 4 + np.stack([t, h, w]))
        after = 4 + max(int(t.max()), 1, 2) + 1
        assert np.array_equal(got[:, item.end:], np.tile([after, after + 1], (3, 1)))
        assert rule.position_delta([item]) == after - item.end


@pytest.mark.parametrize("index", [0, 1, 2])
def test_logits_match_transformers(model, index):
    """Every prompt position; ERNIE's vision experts take the rows transformers' processor marks."""
    fx, llm = model
    case = fx.cases[index]
    encoder = llm.engine.runner.image_encoder
    features = [(offset, encoder(fx.picture_bytes(name), name)) for offset, name in zip(case["image_offsets"],
                                                                                           case["images"])]
    rope = llm.model_config.multimodal.mrope_rule().positions(np.arange(len(case["prompt"])), items(case))
    types = fx.dir / f"moe_token_types_{index}.npy"
    modality = None
    if types.is_file():
        kinds = np.load(types).ravel()
        modality = (np.flatnonzero(kinds == 0), np.flatnonzero(kinds != 0))
    got = full_logits(llm, case["prompt"], features, rope, modality)
    np.testing.assert_allclose(got, np.load(fx.dir / f"logits_{index}.npy"), rtol=0, atol=1e-4)


def test_greedy_tokens_match_transformers(model):
    fx, llm = model
    assert tokens(llm, [fx.prompt(case) for case in fx.cases]) == [case["greedy"] for case in fx.cases]


# -- the engine around them -----------------------------------------------------------------------------


@pytest.mark.parametrize("engine_args", [
    dict(max_num_batched_tokens=8, max_num_seqs=3),                      # chunks cut the images
    dict(max_model_len=128, num_kv_blocks=10, max_num_seqs=3, enable_prefix_caching=False),  # preempted
], ids=["chunked", "preempted"])
def test_same_tokens_when_prefill_cuts_an_image_or_is_preempted(model, engine_args):
    fx, llm = model
    longer = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in llm.generate([fx.prompt(c) for c in fx.cases], longer, use_tqdm=False)]
    assert [w[:12] for w in want] == [case["greedy"] for case in fx.cases]
    small = fx.make_llm(**engine_args)
    seen = []
    real = small.engine.runner.execute_model

    def spy(so):
        seen.extend(so.num_scheduled_tokens.values())
        return real(so)

    small.engine.runner.execute_model = spy
    for _ in range(2):   # the second time every picture is in the encoder cache: all admitted at once
        before = small.engine.scheduler.num_preemptions
        got = small.generate([fx.prompt(case) for case in fx.cases], longer, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == want
    if "num_kv_blocks" in engine_args:
        assert small.engine.scheduler.num_preemptions > before
    else:
        assert max(seen) <= 8


@pytest.mark.parametrize("name", MODELS)
def test_a_repeated_picture_is_encoded_once_and_hits_the_prefix_cache(name):
    fx = Fixture(name)
    llm = fx.make_llm()
    counter = CountingEncoder(llm)
    first = llm.generate(fx.prompt(fx.cases[1]), GREEDY, use_tqdm=False)[0]
    again = llm.generate(fx.prompt(fx.cases[1]), GREEDY, use_tqdm=False)[0]
    assert first.outputs[0].token_ids == again.outputs[0].token_ids == fx.cases[1]["greedy"]
    assert counter.calls == 2                         # image_b and image_a, each once
    assert again.num_cached_tokens >= 64              # past both images' blocks
    other = Image.fromarray(255 - np.asarray(Image.open(fx.dir / "image_a.png")))   # same size, other pixels
    changed = llm.generate(fx.prompt(fx.cases[0], [other]), GREEDY, use_tqdm=False)[0]
    assert counter.calls == 3
    assert changed.num_cached_tokens <= fx.cases[0]["image_offsets"][0]   # no block holding the image is shared
    assert changed.outputs[0].token_ids != fx.cases[0]["greedy"]


def test_pixels_and_their_features_give_the_same_tokens(model, tmp_path):
    fx, llm = model
    path = tmp_path / "a.npy"
    np.save(path, llm.engine.runner.image_encoder(fx.picture_bytes("image_a"), "a"))
    features = fx.make_llm(allowed_feature_paths=(str(tmp_path),))
    part = {"type": "image_feature", "image_feature": {"url": path.as_uri(), "grid_thw": [1, 4, 6]}}
    case = fx.cases[0]
    out = features.generate({"prompt_token_ids": fx.collapse(case["prompt"]), "mm_items": [part]}, GREEDY,
                            use_tqdm=False)
    assert out[0].outputs[0].token_ids == case["greedy"]


def test_chat_with_image_url_parts_equals_the_token_prompt(llm):
    messages = [{"role": "user", "content": [data_url(picture_bytes("image_a")),
                                             {"type": "text", "text": "Describe the picture."}]}]
    chat = llm.chat(messages, GREEDY, use_tqdm=False)[0]
    spelled = llm.chat_prompt(messages)
    assert spelled["prompt_token_ids"].count(PAD) == 1 and chat.prompt_token_ids.count(PAD) == 6
    assert chat.outputs[0].token_ids == tokens(llm, [prompt(CASES[0]) | {
        "prompt_token_ids": spelled["prompt_token_ids"]}])[0]


# The shape of Qwen2.5-VL's processor template (chat_template.json): it loops over a message's parts
# and writes each item's placeholder itself, the text right after it.
PARTS_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                  "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% set parts = m['content'] %}"
                  "{% for part in parts %}{% if part['type'] == 'image' %}"
                  "<|vision_start|><|image_pad|><|vision_end|>{% elif part['type'] == 'text' %}{{ part['text'] }}"
                  "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")


def test_a_template_that_renders_the_parts_gets_them_as_transformers_gives_them(llm):
    """No newline between a picture's placeholder and the text after it, none between text parts:
    what transformers' processor renders from the same messages (a joined string would add them)."""
    messages = [{"role": "user", "content": [data_url(picture_bytes("image_a")), {"type": "text", "text": "Describe"},
                                             {"type": "text", "text": " it."}]}]
    spelled = llm.chat_prompt(messages, chat_template=PARTS_TEMPLATE)
    body = "<|vision_start|><|image_pad|><|vision_end|>Describe it."
    assert spelled["prompt"] == f"<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant"
    assert len(spelled["mm_items"]) == 1
    string_template = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    joined = llm.chat_prompt(messages, chat_template=string_template)["prompt"]
    assert "<|vision_end|>\nDescribe\n it.<|im_end|>" in joined
    chat = llm.chat(messages, GREEDY, use_tqdm=False, chat_template=PARTS_TEMPLATE)[0]
    assert chat.outputs[0].token_ids == tokens(llm, [prompt(CASES[0]) | {
        "prompt_token_ids": spelled["prompt_token_ids"]}])[0]


# -- bad input: a 400 naming the item, before anything is encoded ---------------------------------------


def png_header(width: int, height: int) -> bytes:
    """A PNG whose header claims ``width x height`` and which holds ten bytes of pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(bytes(10))) + chunk(b"IEND", b""))


@pytest.mark.parametrize("part, words", [
    (data_url(b"certainly not a picture"), "image_url item 0 .*not a readable image"),
    (data_url(png_header(100_000, 100_000)), r"image_url item 0 .*header claims over"),
    (data_url(png_header(9000, 9000)), r"image_url item 0 .*is 9000 x 9000 pixels"),
    (data_url(png_header(0, 5)), r"image_url item 0 .*not a readable image"),
    (data_url(png_header(4000, 10)), "aspect ratio"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}, "base64 is malformed"),
    ({"type": "image_url", "image_url": {"url": "data:text/plain;base64,aGk="}}, "data:image/<format>"),
    ({"type": "image_url", "image_url": {"url": "ftp://host/cat.png"}}, "scheme 'ftp'"),
    ({"type": "image_url", "image_url": {"url": "https://host/cat.png"}}, "does not fetch image URLs"),
    ({"type": "image_url", "image_url": data_url(b"x")["image_url"],
      "image_feature": {"url": "file:///f.npy", "grid_thw": [1, 4, 6]}}, "gives image_feature and image_url"),
])
def test_bad_pictures_are_refused_by_item(llm, part, words):
    counter = CountingEncoder(llm)
    with pytest.raises(InvalidRequestError, match=words):
        llm.chat([{"role": "user", "content": [part, {"type": "text", "text": "hi"}]}], GREEDY, use_tqdm=False)
    assert counter.calls == 0


def test_too_many_pictures_for_max_model_len_are_counted_before_encoding():
    llm = make_llm(max_model_len=96)
    counter = CountingEncoder(llm)
    parts = [data_url(picture_bytes("image_b"))] * 3     # 3 x 35 placeholder tokens
    with pytest.raises(InvalidRequestError, match="would have .* tokens with its multimodal items"):
        llm.chat([{"role": "user", "content": [*parts, {"type": "text", "text": "hi"}]}], GREEDY, use_tqdm=False)
    assert counter.calls == 0


def test_a_model_without_a_tower_here_refuses_pictures(test_model_dir):
    demo = LLM(str(test_model_dir), max_model_len=128, num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="vision tower does not run here") as err:
        demo.chat([{"role": "user", "content": [data_url(picture_bytes("image_a"))]}], GREEDY, use_tqdm=False)
    assert "image_feature" in err.value.fix


def test_a_picture_that_fails_to_decode_fails_its_request_alone():
    llm = make_llm()
    truncated = {"prompt_token_ids": collapse(CASES[0]["prompt"]),
                 "mm_items": [data_url(picture_bytes("image_b")[:3000])]}   # a whole header, a cut body
    good, bad = llm.generate([prompt(CASES[1]), truncated], GREEDY, use_tqdm=False)
    assert good.outputs[0].token_ids == CASES[1]["greedy"]
    assert bad.outputs[0].finish_reason == "error" and "could not be decoded" in str(bad.error)


def test_ernie_modality_experts_run_on_the_reference_moe_backend_too():
    fx = Fixture("ernie4_5_vl")
    llm = fx.make_llm(moe_backend="reference")
    assert llm.engine.selection.moe.name == "reference"
    assert tokens(llm, [fx.prompt(case) for case in fx.cases]) == [case["greedy"] for case in fx.cases]
