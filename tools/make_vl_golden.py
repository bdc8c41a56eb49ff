"""Tiny random Qwen2.5-VL and ERNIE-4.5-VL models and transformers' outputs on text + image prompts: VL fixtures.

Needs torch, transformers and pillow (dev only, never a runtime or CI dependency)::

    pip install torch transformers pillow
    python tools/make_vl_golden.py                     # writes both directories below
    python tools/make_vl_golden.py --only qwen2_5_vl   # tests/fixtures/vision/qwen2_5_vl/
    python tools/make_vl_golden.py --only ernie4_5_vl  # tests/fixtures/vision/ernie4_5_vl/ (copies qwen2_5_vl's PNGs)

The directory holds what a real checkpoint holds (config.json as ``save_pretrained`` writes it, with
transformers-5 ``text_config``/``vision_config`` nesting, generation_config.json, sharded float32
safetensors, the random demo models' 512-token tokenizer from `fdplug.demo`) plus two PNG test images and
transformers' outputs, all computed by reloading the written directory with ``from_pretrained`` (eager
attention in the text and vision parts):

    logits_<i>.npy        float32 logits at every prompt position of case ``i`` ([T, vocab])
    position_ids_<i>.npy  int64 [3, T] M-RoPE positions of ``get_rope_index`` (the cases with images)
    features_{a,b}.npy    the vision tower's merged features of each image alone ([t*h*w/4, 64])
    pixel_values_a.npy    the image processor's patches of image_a (image_b's only summarised in golden.json)
    golden.json           versions, seed, and per case: prompt ids, images, grids, rope delta, greedy run, margins

Prompts are ChatML with each image as ``<|vision_start|>`` + ``<|image_pad|>`` * (t*h*w/4) + ``<|vision_end|>``,
tokenized in one piece, which is what the Qwen2.5-VL processor makes of them. Greedy runs are
``generate`` with 12 new tokens and no eos. The weight seed is advanced until the top-1/top-2 logit gap
at every last prompt position and greedy step clears ``MIN_LOGIT_GAP`` and no greedy run repeats one token,
so float noise cannot flip a token. Deterministic: same seeds, same files (given the torch, transformers
and tokenizers versions golden.json records, and the same CPU kernels; see tools/make_golden.py).

The ERNIE-4.5-VL fixture (``Ernie4_5_VLMoeForConditionalGeneration``) has the same files, made the same way, from
the same tokenizer, images (copied from the Qwen fixture) and prompt texts, with the ERNIE image processor
(``Ernie4_5_VLMoeImageProcessorPil``, defaults) and eager experts. Its config maps ``image_token_id``,
``image_start_token_id`` and ``image_end_token_id`` to ``<|image_pad|>``, ``<|vision_start|>`` and ``<|vision_end|>``
(the video ids to ``<|video_pad|>`` and the same start/end). ``save_pretrained`` writes the weights in the original
Baidu checkpoint layout (``model.vision_model``, ``mlp.experts.{0..2E-1}``: text experts then vision experts,
``mlp.gate.weight`` / ``mlp.gate.weight_1`` as [hidden, experts], ``mlp.moe_statics.e_score_correction_bias`` as
[2, experts]). Layer 1 is the modality MoE: the processor's ``moe_mm_token_type_ids`` (image pads *and* their
start/end tokens; the model does not derive it) send those tokens to the vision experts; the extra file
``moe_token_types_<i>.npy`` (int64 [T], the cases with images) holds it. Seeds are also advanced until the text
and vision routers pick different experts for some image token and the correction bias changes some token's pick
in each modality.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import tokenizers
import torch
import transformers
from PIL import Image
from transformers import (
    Ernie4_5_VLMoeConfig,
    Ernie4_5_VLMoeForConditionalGeneration,
    GenerationConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
)
from transformers.models.ernie4_5_vl_moe.image_processing_pil_ernie4_5_vl_moe import Ernie4_5_VLMoeImageProcessorPil
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "vision" / "qwen2_5_vl"
ERNIE_OUT = ROOT / "tests" / "fixtures" / "vision" / "ernie4_5_vl"
VOCAB = 512             # fdplug.demo.random_model's tokenizer: 256 bytes + merges + added tokens
SEED = 3000
MAX_SEEDS = 50
MIN_LOGIT_GAP = 1e-3    # top-1 minus top-2 logit at the last prompt position and every greedy step
GREEDY_TOKENS = 12
SHARD = "250KB"         # every file of the fixture stays under 300 KB

VISION = {"depth": 3, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
          "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 56,
          "fullatt_block_indexes": [1], "tokens_per_second": 2, "in_channels": 3, "hidden_act": "silu"}
TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "silu", "max_position_embeddings": 1024,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
        "rms_norm_eps": 1e-6, "use_sliding_window": False, "tie_word_embeddings": False}
# (height, width): the default processor resizes them to multiples of 28, grids [1, 4, 6] and [1, 10, 14]
IMAGES = {"image_a": ((60, 90), [1, 4, 6]), "image_b": ((130, 200), [1, 10, 14])}
# each case: text pieces with the images between them, in order
CASES = [
    # as fdplug's chat renders [image part, text part]: parts joined by a newline (vLLM's string format)
    ["<|im_start|>user\n", "image_a", "\nDescribe the picture.<|im_end|>\n<|im_start|>assistant\n"],
    ["<|im_start|>user\nCompare this:", "image_b", "\nwith this one:", "image_a",
     "\nWhat changed?<|im_end|>\n<|im_start|>assistant\n"],
    ["<|im_start|>user\nWrite one line about colours.<|im_end|>\n<|im_start|>assistant\n"],
]

# ERNIE-4.5-VL (MoE): layer 0 dense, layer 1 the modality-isolated MoE (4 text + 4 vision experts, top-2, one shared
# expert of moe_intermediate_size[0]); no biases in the text part (use_bias false, as the real checkpoints);
# mrope_section is [h, w, t] (h == w) over head_dim / 2 = 8 rotary pairs
ERNIE_SEED = 3000
ERNIE_VISION = {"depth": 2, "hidden_size": 32, "intermediate_size": 128, "num_heads": 2, "patch_size": 14,
                "spatial_merge_size": 2, "temporal_merge_size": 2, "in_channels": 3, "hidden_act": "quick_gelu",
                "rms_norm_eps": 1e-6}
ERNIE_TEXT = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "hidden_act": "silu",
              "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "use_bias": False,
              "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]},
              "mlp_layer_types": ["dense", "sparse"], "moe_num_experts": 4, "moe_k": 2,
              "moe_intermediate_size": [32, 24], "moe_num_shared_experts": 1, "moe_norm_min": 1e-12,
              "tie_word_embeddings": False}
ERNIE_MOE_LAYER = 1


def demo_tokenizer() -> tuple[tokenizers.Tokenizer, dict]:
    """The tokenizer (and tokenizer_config) of `fdplug.demo.random_model`: fixed seeds, no download."""
    sys.path.insert(0, str(ROOT))
    try:
        import fdplug  # noqa: F401
    except ImportError:   # fdplug's own dependencies (pluggy, ...) absent here; fdplug.demo's needs are not
        stub = types.ModuleType("fdplug")
        stub.__path__ = [str(ROOT / "fdplug")]
        sys.modules["fdplug"] = stub
    from fdplug.demo.bpe import build_tokenizer
    from fdplug.demo.chatml import tokenizer_config
    from fdplug.demo.corpus import BPE_CORPUS

    tok = build_tokenizer(BPE_CORPUS, VOCAB)
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    return tok, tokenizer_config(tok)


def make_image(name: str) -> np.ndarray:
    """Smooth colour gradients, seeded noise and a filled ellipse: uint8 RGB."""
    (h, w), _ = IMAGES[name]
    rng = np.random.default_rng(100 + list(IMAGES).index(name))
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    img = np.stack([255 * x / w, 255 * y / h, 127 + 100 * np.sin(x / 9 + y / 13)], axis=-1)
    cy, cx, ry, rx = h * rng.uniform(0.3, 0.7), w * rng.uniform(0.3, 0.7), h / 4, w / 5
    inside = ((y - cy) / ry) ** 2 + ((x - cx) / rx) ** 2 <= 1
    img[inside] = rng.uniform(0, 255, 3)
    img += rng.normal(0, 6, img.shape)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8)


def prompt(pieces: list[str], tok: tokenizers.Tokenizer, grids: dict[str, list[int]], ids: dict[str, int]) -> dict:
    """The case's token ids (the text tokenized in one piece, as the processor does), images and offsets."""
    text, images = "", []
    for piece in pieces:
        if piece in IMAGES:
            images.append(piece)
            t, h, w = grids[piece]
            text += "<|vision_start|>" + "<|image_pad|>" * (t * h * w // 4) + "<|vision_end|>"
        else:
            text += piece
    tokens = tok.encode(text).ids
    pads = [i for i, t in enumerate(tokens) if t == ids["<|image_pad|>"]]
    offsets, at = [], 0
    for name in images:
        offsets.append(pads[at])
        n = int(np.prod(grids[name])) // 4
        assert pads[at:at + n] == list(range(pads[at], pads[at] + n)), "image pads not contiguous"
        assert tokens[pads[at] - 1] == ids["<|vision_start|>"] and tokens[pads[at] + n] == ids["<|vision_end|>"]
        at += n
    assert at == len(pads)
    return {"prompt": tokens, "images": images, "image_grid_thw": [grids[n] for n in images],
            "image_offsets": offsets}


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Weights with O(1) activations (HF's 0.02-std init makes logits near-uniform, a weak test)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln_q.weight")):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.dim() >= 2 and "embed_tokens" not in name:   # linear [out, in], patch conv [out, c, t, h, w]
                p.copy_(noise / p[0].numel() ** 0.5)
            else:
                p.copy_(noise)


def load_eager(model_class: type, path: Path, **kwargs) -> torch.nn.Module:
    """``from_pretrained`` in float32, eager attention everywhere (text and vision), every key used,
    tensors copied off the mmap (see make_golden)."""
    model, info = model_class.from_pretrained(path, dtype=torch.float32, attn_implementation="eager",
                                              output_loading_info=True, **kwargs)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), f"{path}: {info}"
    for cfg in (model.config.text_config, model.config.vision_config):
        assert cfg._attn_implementation == "eager", (cfg.model_type, cfg._attn_implementation)
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    return model.eval()


def load(path: Path) -> torch.nn.Module:
    return load_eager(Qwen2_5_VLForConditionalGeneration, path)


def inputs(case: dict, image_token: int, pixels: dict[str, torch.Tensor]) -> dict:
    """``generate``/``forward`` kwargs as the processor returns them (``mm_token_type_ids``: 1 on image pads)."""
    ids = torch.tensor([case["prompt"]])
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == image_token).long()}
    if case["images"]:
        kw["pixel_values"] = torch.cat([pixels[n] for n in case["images"]])
        kw["image_grid_thw"] = torch.tensor(case["image_grid_thw"])
    return kw


def run(model: torch.nn.Module, cases: list[dict], make_inputs) -> list[dict]:
    """Per case: logits at every prompt position, 3-D positions, the greedy run and its margins.

    ``make_inputs(case)``: the case's ``forward``/``generate`` kwargs (see `inputs`, `ernie_inputs`)."""
    results = []
    model.generation_config.eos_token_id = None           # (None in the call means "the model's")
    with torch.no_grad():
        for case in cases:
            kw = make_inputs(case)
            model.model.rope_deltas = None
            logits = model(**kw, use_cache=False).logits[0].float()
            res = {"logits": logits.numpy().astype(np.float32)}
            if case["images"]:
                pos, delta = model.model.get_rope_index(kw["input_ids"], kw["mm_token_type_ids"],
                                                        image_grid_thw=kw["image_grid_thw"])
                res["position_ids"], res["rope_delta"] = pos[:, 0].numpy().astype(np.int64), int(delta.item())
            model.model.rope_deltas = None
            gen = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=GREEDY_TOKENS, pad_token_id=0,
                                   output_logits=True, return_dict_in_generate=True)
            out = model.generate(**kw, generation_config=gen)
            tokens = out.sequences[0, len(case["prompt"]):].tolist()
            steps = torch.cat(out.logits).float()
            assert len(tokens) == GREEDY_TOKENS and steps.argmax(-1).tolist() == tokens, "not plain greedy"
            assert torch.allclose(steps[0], logits[-1], atol=1e-4), "generate's first step differs from forward"
            # the same tokens in one forward (decode positions = prompt's + rope delta) pick the same tokens
            full = make_inputs({**case, "prompt": case["prompt"] + tokens[:-1]})
            model.model.rope_deltas = None
            again = model(**full, use_cache=False).logits[0, len(case["prompt"]) - 1:]
            assert again.argmax(-1).tolist() == tokens, "greedy run not reproduced by one forward"
            top2 = torch.cat([logits[-1:], steps]).topk(2, dim=-1).values
            res |= {"greedy": tokens, "min_logit_gap": (top2[:, 0] - top2[:, 1]).min().item()}
            results.append(res)
    return results


def begin(out: Path) -> tuple[tokenizers.Tokenizer, dict[str, int]]:
    """An empty fixture directory holding the demo tokenizer; the tokenizer and its special token ids."""
    tok, tok_config = demo_tokenizer()
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                           "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    return tok, ids


def preprocess(out: Path, processor, place) -> tuple[dict[str, torch.Tensor], dict[str, list[int]]]:
    """Each image's pixel values and grid from the PNG ``place(name)`` puts in ``out`` (what the file
    holds, as a server would read it)."""
    pixels, grids = {}, {}
    for name, (_, want_grid) in IMAGES.items():
        place(name)
        with Image.open(out / f"{name}.png") as im:
            assert np.array_equal(np.asarray(im.convert("RGB")), make_image(name)), f"{name}.png is not make_image's"
            proc = processor(images=[im.convert("RGB")], return_tensors="pt")
        pixels[name], grids[name] = proc["pixel_values"], proc["image_grid_thw"][0].tolist()
        print(f"{name}: {IMAGES[name][0]} -> grid {grids[name]}, pixel_values {tuple(pixels[name].shape)}")
        assert grids[name] == want_grid, (name, grids[name])
    return pixels, grids


def generation_config(ids: dict[str, int]) -> dict[str, int]:
    return {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}


def weights(path: Path) -> bool:
    """What save_pretrained writes that the fixture keeps."""
    return path.name == "config.json" or path.name.endswith((".safetensors", ".safetensors.index.json"))


def save_and_reload(model: torch.nn.Module, out: Path, generation: dict, load) -> torch.nn.Module:
    """``model`` written into ``out`` (replacing an earlier seed's weights) and read back with ``load``,
    every tensor checked unchanged."""
    for path in out.iterdir():
        if weights(path):
            path.unlink()
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp, max_shard_size=SHARD)
        for path in sorted(Path(tmp).iterdir()):
            if weights(path):
                shutil.copy(path, out / path.name)
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    reloaded = load(out)
    for (n, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), f"{n} changed on save/reload"
    return reloaded


def write_outputs(out: Path, model: torch.nn.Module, pixels: dict, grids: dict, cases: list[dict],
                  results: list[dict], seed: int, sample_seed: int, gap: float, ids: dict[str, int],
                  extra_meta: dict, readme: str) -> None:
    """Features, pixel values, logits, positions, golden.json and README.md of a chosen seed's model."""
    out_dim = model.config.text_config.hidden_size
    with torch.no_grad():
        for name in IMAGES:
            grid = torch.tensor([grids[name]])
            feats = model.model.get_image_features(pixels[name], grid).pooler_output[0]
            assert feats.shape == (int(np.prod(grids[name])) // 4, out_dim), feats.shape
            np.save(out / f"features_{name[-1]}.npy", feats.numpy().astype(np.float32))
    np.save(out / "pixel_values_a.npy", pixels["image_a"].numpy().astype(np.float32))
    flat = pixels["image_b"].numpy().astype(np.float64).ravel()
    sample = np.sort(np.random.default_rng(sample_seed).choice(flat.size, 16, replace=False))
    pixel_b = {"shape": list(pixels["image_b"].shape), "sum": float(flat.sum()), "abs_sum": float(np.abs(flat).sum()),
               "sample_index": sample.tolist(), "sample_value": [float(np.float32(v)) for v in flat[sample]]}
    for i, r in enumerate(results):
        np.save(out / f"logits_{i}.npy", r["logits"])
        if "position_ids" in r:
            np.save(out / f"position_ids_{i}.npy", r["position_ids"])
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "seed": seed, "min_logit_gap": gap,
            "token_ids": {k.strip("<|>"): v for k, v in ids.items()}, **extra_meta,
            "images": {n: {"file": f"{n}.png", "size_hw": list(IMAGES[n][0]), "image_grid_thw": grids[n]}
                       for n in IMAGES},
            "pixel_values_b": pixel_b,
            "cases": [{**c, "rope_delta": r.get("rope_delta"), "greedy": r["greedy"],
                       "min_logit_gap": r["min_logit_gap"], **({"routing": r["routing"]} if "routing" in r else {})}
                      for c, r in zip(cases, results)]}
    (out / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "README.md").write_text(readme)
    for path in sorted(out.iterdir()):
        assert path.stat().st_size < 300_000, f"{path.name}: {path.stat().st_size} bytes"
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out.name} {size / 1024:.1f} KiB  {sorted(p.name for p in out.iterdir())}")


def build(out: Path) -> None:
    """The Qwen2.5-VL fixture."""
    tok, ids = begin(out)
    pixels, grids = preprocess(out, Qwen2VLImageProcessorPil(),
                               lambda name: Image.fromarray(make_image(name)).save(out / f"{name}.png"))
    cases = [prompt(pieces, tok, grids, ids) for pieces in CASES]
    text = {**TEXT, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=VISION, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    for attempt in range(MAX_SEEDS):
        seed = SEED + attempt
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).float()
        randomize(model, seed)
        reloaded = save_and_reload(model, out, generation_config(ids), load)
        results = run(reloaded, cases, lambda case: inputs(case, ids["<|image_pad|>"], pixels))
        gap = min(r["min_logit_gap"] for r in results)
        ok = gap >= MIN_LOGIT_GAP and all(len(set(r["greedy"])) > 1 for r in results)
        print(f"seed {seed}: min logit gap {gap:.2e}, greedy {[r['greedy'] for r in results]}"
              f"{'' if ok else '  -> next seed'}")
        if ok:
            break
    else:
        raise RuntimeError(f"no seed in {SEED}..{SEED + MAX_SEEDS - 1} gave the margins")
    write_outputs(out, reloaded, pixels, grids, cases, results, seed, SEED, gap, ids, {},
        "Generated by `tools/make_vl_golden.py` (torch + transformers + pillow; CI does not): do not edit, rerun it.\n"
        "A tiny random float32 Qwen2.5-VL (config, generation config, sharded safetensors, demo tokenizer), two\n"
        "test images (`image_{a,b}.png`), and transformers' outputs: `logits_<i>.npy` per prompt position,\n"
        "`position_ids_<i>.npy` (3-D M-RoPE), `features_{a,b}.npy`, `pixel_values_a.npy`; prompts, greedy runs in "
        "`golden.json`.\n")


# ------------------------------------------------------------------------------------------------ ERNIE-4.5-VL


def ernie_randomize(model: torch.nn.Module, seed: int) -> None:
    """As `randomize`, the fan-in the last dim (Linear [out, in], experts [E, out, in], routers [E, hidden]), and the
    routers' score correction bias non-zero (0.1 std: the size of the top-2/top-3 score gaps, so it moves picks)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("e_score_correction_bias"):
                p.copy_(0.1 * noise)
            elif name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "ln.weight")):
                p.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.dim() >= 2 and "embed_tokens" not in name:
                p.copy_(noise / p.shape[-1] ** 0.5)
            else:
                p.copy_(noise)


def ernie_load(path: Path) -> torch.nn.Module:
    """`load` for ERNIE-4.5-VL, with eager (per-expert loop) experts too."""
    model = load_eager(Ernie4_5_VLMoeForConditionalGeneration, path, experts_implementation="eager")
    assert model.config.text_config._experts_implementation == "eager", model.config.text_config._experts_implementation
    return model


def ernie_inputs(case: dict, config: Ernie4_5_VLMoeConfig, pixels: dict[str, torch.Tensor]) -> dict:
    """``generate``/``forward`` kwargs as the ERNIE processor returns them: ``mm_token_type_ids`` 1 on image pads
    (3-D positions), ``moe_mm_token_type_ids`` 1 on image pads and their start/end tokens (the vision experts)."""
    ids = torch.tensor([case["prompt"]])
    mm = (ids == config.image_token_id).long() + 2 * (ids == config.video_token_id).long()
    moe = mm.clone()
    moe[torch.isin(ids, torch.tensor([config.image_start_token_id, config.image_end_token_id]))] = 1
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": mm,
          "moe_mm_token_type_ids": moe}
    if case["images"]:
        kw["pixel_values"] = torch.cat([pixels[n] for n in case["images"]])
        kw["image_grid_thw"] = torch.tensor(case["image_grid_thw"])
    return kw


def ernie_routing(model: torch.nn.Module, kw: dict) -> dict:
    """The MoE layer's expert picks on the prompt: on how many vision-routed tokens the vision router's top-k set
    differs from the text router's, and on how many tokens of each modality the correction bias changes it."""
    mlp = model.model.language_model.layers[ERNIE_MOE_LAYER].mlp
    seen = {}
    handle = mlp.register_forward_pre_hook(lambda module, args: seen.setdefault("hidden", args[0]))
    try:
        with torch.no_grad():
            model(**kw, use_cache=False)
    finally:
        handle.remove()
    hidden = seen["hidden"][0].float()
    vision = kw["moe_mm_token_type_ids"][0].bool()

    def picks(moe: torch.nn.Module, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
        scores = torch.softmax(x @ moe.gate.weight.float().T, dim=-1)
        if bias:
            scores = scores + moe.gate.moe_statics.e_score_correction_bias.float().squeeze(0)
        return scores.topk(moe.gate.top_k, dim=-1).indices.sort(dim=-1).values

    def differ(a: torch.Tensor, b: torch.Tensor) -> int:
        return int((a != b).any(-1).sum())

    text_x, vision_x = hidden[~vision], hidden[vision]
    return {"vision_tokens": int(vision.sum()),
            "vision_vs_text_router": differ(picks(mlp.vision_moe, vision_x), picks(mlp.text_moe, vision_x)),
            "text_bias_moves": differ(picks(mlp.text_moe, text_x), picks(mlp.text_moe, text_x, bias=False)),
            "vision_bias_moves": differ(picks(mlp.vision_moe, vision_x), picks(mlp.vision_moe, vision_x, bias=False))}


def build_ernie(out: Path) -> None:
    """The ERNIE-4.5-VL fixture: the Qwen fixture's tokenizer, images and prompt texts."""
    for name in IMAGES:
        assert (OUT / f"{name}.png").is_file(), f"{OUT / name}.png missing: build the qwen2_5_vl fixture first"
    tok, ids = begin(out)
    pixels, grids = preprocess(out, Ernie4_5_VLMoeImageProcessorPil(),
                               lambda name: shutil.copyfile(OUT / f"{name}.png", out / f"{name}.png"))
    # an image's placeholders: t*h*w / merge_size**2 (the temporal merge only applies to videos)
    cases = [prompt(pieces, tok, grids, ids) for pieces in CASES]
    text = {**ERNIE_TEXT, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}
    config = Ernie4_5_VLMoeConfig(
        text_config=text, vision_config=ERNIE_VISION, image_token_id=ids["<|image_pad|>"],
        image_start_token_id=ids["<|vision_start|>"], image_end_token_id=ids["<|vision_end|>"],
        video_token_id=ids["<|video_pad|>"], video_start_token_id=ids["<|vision_start|>"],
        video_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    config.architectures = ["Ernie4_5_VLMoeForConditionalGeneration"]
    specials = {ids[t] for t in ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}

    for attempt in range(MAX_SEEDS):
        seed = ERNIE_SEED + attempt
        torch.manual_seed(seed)
        model = Ernie4_5_VLMoeForConditionalGeneration(config).float()
        ernie_randomize(model, seed)
        reloaded = save_and_reload(model, out, generation_config(ids), ernie_load)
        make_inputs = functools.partial(ernie_inputs, config=reloaded.config, pixels=pixels)
        results = run(reloaded, cases, make_inputs)
        routing = [ernie_routing(reloaded, make_inputs(c)) if c["images"] else None for c in cases]
        for r, route in zip(results, routing):
            r["routing"] = route
        gap = min(r["min_logit_gap"] for r in results)
        moves = [sum(r[k] for r in routing if r) for k in ("vision_vs_text_router", "text_bias_moves",
                                                            "vision_bias_moves")]
        ok = (gap >= MIN_LOGIT_GAP and all(len(set(r["greedy"])) > 1 for r in results)
              and not any(specials & set(r["greedy"]) for r in results) and all(moves))
        print(f"seed {seed}: min logit gap {gap:.2e}, routing moves {moves}, greedy {[r['greedy'] for r in results]}"
              f"{'' if ok else '  -> next seed'}")
        if ok:
            break
    else:
        raise RuntimeError(f"no seed in {ERNIE_SEED}..{ERNIE_SEED + MAX_SEEDS - 1} gave the margins")

    for i, case in enumerate(cases):
        if case["images"]:
            moe = ernie_inputs(case, reloaded.config, pixels)["moe_mm_token_type_ids"][0]
            np.save(out / f"moe_token_types_{i}.npy", moe.numpy().astype(np.int64))
    token_ids = {k: getattr(config, k) for k in ("image_token_id", "image_start_token_id", "image_end_token_id",
                                                  "video_token_id", "video_start_token_id", "video_end_token_id")}
    write_outputs(out, reloaded, pixels, grids, cases, results, seed, ERNIE_SEED, gap, ids,
                  {"config_token_ids": token_ids},
        "Generated by `tools/make_vl_golden.py` (torch + transformers + pillow; CI does not): do not edit, rerun it.\n"
        "A tiny random float32 ERNIE-4.5-VL MoE (config, generation config, sharded safetensors in the original\n"
        "checkpoint layout, demo tokenizer), the Qwen2.5-VL fixture's test images (`image_{a,b}.png`), and\n"
        "transformers' outputs: `logits_<i>.npy` per prompt position, `position_ids_<i>.npy` (3-D M-RoPE),\n"
        "`moe_token_types_<i>.npy` (1: routed to the vision experts: image pads and their start/end tokens),\n"
        "`features_{a,b}.npy` (vision tower + resampler), `pixel_values_a.npy`; prompts, greedy runs in "
        "`golden.json`.\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", choices=["qwen2_5_vl", "ernie4_5_vl"], help="build one fixture (default: both)")
    only = parser.parse_args().only
    torch.use_deterministic_algorithms(True)
    if only in (None, "qwen2_5_vl"):
        build(OUT)
    if only in (None, "ernie4_5_vl"):
        build_ernie(ERNIE_OUT)


if __name__ == "__main__":
    main()
