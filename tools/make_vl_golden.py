"""Build a tiny random Qwen2.5-VL and transformers' outputs on text + image prompts: fdplug's VL parity fixture.

Needs torch, transformers and pillow (dev only, never a runtime or CI dependency)::

    pip install torch transformers pillow
    python tools/make_vl_golden.py          # writes tests/fixtures/vision/qwen2_5_vl/

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
"""

from __future__ import annotations

import argparse
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
from transformers import GenerationConfig, Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "fixtures" / "vision" / "qwen2_5_vl"
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


def load(path: Path) -> torch.nn.Module:
    """``from_pretrained`` in float32, eager attention everywhere, tensors copied off the mmap (see make_golden)."""
    model, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), f"{path}: {info}"
    assert model.config.text_config._attn_implementation == "eager", model.config.text_config._attn_implementation
    assert model.config.vision_config._attn_implementation == "eager", model.config.vision_config._attn_implementation
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    return model.eval()


def inputs(case: dict, image_token: int, pixels: dict[str, torch.Tensor]) -> dict:
    """``generate``/``forward`` kwargs as the processor returns them (``mm_token_type_ids``: 1 on image pads)."""
    ids = torch.tensor([case["prompt"]])
    kw = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "mm_token_type_ids": (ids == image_token).long()}
    if case["images"]:
        kw["pixel_values"] = torch.cat([pixels[n] for n in case["images"]])
        kw["image_grid_thw"] = torch.tensor(case["image_grid_thw"])
    return kw


def run(model: torch.nn.Module, cases: list[dict], image_token: int, pixels: dict[str, torch.Tensor]) -> list[dict]:
    """Per case: logits at every prompt position, 3-D positions, the greedy run and its margins."""
    results = []
    model.generation_config.eos_token_id = None           # (None in the call means "the model's")
    with torch.no_grad():
        for case in cases:
            kw = inputs(case, image_token, pixels)
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
            full = inputs({**case, "prompt": case["prompt"] + tokens[:-1]}, image_token, pixels)
            model.model.rope_deltas = None
            again = model(**full, use_cache=False).logits[0, len(case["prompt"]) - 1:]
            assert again.argmax(-1).tolist() == tokens, "greedy run not reproduced by one forward"
            top2 = torch.cat([logits[-1:], steps]).topk(2, dim=-1).values
            res |= {"greedy": tokens, "min_logit_gap": (top2[:, 0] - top2[:, 1]).min().item()}
            results.append(res)
    return results


def build(out: Path) -> None:
    tok, tok_config = demo_tokenizer()
    ids = {t: tok.token_to_id(t) for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>",
                                           "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")}
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")

    processor = Qwen2VLImageProcessorPil()
    pixels, grids = {}, {}
    for name, (_, want_grid) in IMAGES.items():
        Image.fromarray(make_image(name)).save(out / f"{name}.png")
        with Image.open(out / f"{name}.png") as im:          # what the file holds, as a server would read it
            proc = processor(images=[im.convert("RGB")], return_tensors="pt")
        pixels[name], grids[name] = proc["pixel_values"], proc["image_grid_thw"][0].tolist()
        print(f"{name}: {IMAGES[name][0]} -> grid {grids[name]}, pixel_values {tuple(pixels[name].shape)}")
        assert grids[name] == want_grid, (name, grids[name])
    cases = [prompt(pieces, tok, grids, ids) for pieces in CASES]

    text = {**TEXT, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"]}
    config = Qwen2_5_VLConfig(text_config=text, vision_config=VISION, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    config.architectures = ["Qwen2_5_VLForConditionalGeneration"]
    generation = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
                  "pad_token_id": ids["<|endoftext|>"]}

    def weights(path: Path) -> bool:   # what save_pretrained writes that the fixture keeps
        return path.name == "config.json" or path.name.endswith((".safetensors", ".safetensors.index.json"))

    for attempt in range(MAX_SEEDS):
        seed = SEED + attempt
        for path in out.iterdir():
            if weights(path):
                path.unlink()
        torch.manual_seed(seed)
        model = Qwen2_5_VLForConditionalGeneration(config).float()
        randomize(model, seed)
        with tempfile.TemporaryDirectory() as tmp:
            model.save_pretrained(tmp, max_shard_size=SHARD)
            for path in sorted(Path(tmp).iterdir()):
                if weights(path):
                    shutil.copy(path, out / path.name)
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        reloaded = load(out)
        for (n, a), b in zip(model.state_dict().items(), reloaded.state_dict().values()):
            assert torch.equal(a, b), f"{n} changed on save/reload"
        results = run(reloaded, cases, ids["<|image_pad|>"], pixels)
        gap = min(r["min_logit_gap"] for r in results)
        ok = gap >= MIN_LOGIT_GAP and all(len(set(r["greedy"])) > 1 for r in results)
        print(f"seed {seed}: min logit gap {gap:.2e}, greedy {[r['greedy'] for r in results]}"
              f"{'' if ok else '  -> next seed'}")
        if ok:
            break
    else:
        raise RuntimeError(f"no seed in {SEED}..{SEED + MAX_SEEDS - 1} gave the margins")

    with torch.no_grad():
        for name in IMAGES:
            grid = torch.tensor([grids[name]])
            feats = reloaded.model.get_image_features(pixels[name], grid).pooler_output[0]
            assert feats.shape == (int(np.prod(grids[name])) // 4, VISION["out_hidden_size"]), feats.shape
            np.save(out / f"features_{name[-1]}.npy", feats.numpy().astype(np.float32))
    np.save(out / "pixel_values_a.npy", pixels["image_a"].numpy().astype(np.float32))
    flat = pixels["image_b"].numpy().astype(np.float64).ravel()
    sample = np.sort(np.random.default_rng(SEED).choice(flat.size, 16, replace=False))
    pixel_b = {"shape": list(pixels["image_b"].shape), "sum": float(flat.sum()), "abs_sum": float(np.abs(flat).sum()),
               "sample_index": sample.tolist(), "sample_value": [float(np.float32(v)) for v in flat[sample]]}
    for i, r in enumerate(results):
        np.save(out / f"logits_{i}.npy", r["logits"])
        if "position_ids" in r:
            np.save(out / f"position_ids_{i}.npy", r["position_ids"])
    meta = {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "seed": seed, "min_logit_gap": gap,
            "token_ids": {k.strip("<|>"): v for k, v in ids.items()},
            "images": {n: {"file": f"{n}.png", "size_hw": list(IMAGES[n][0]), "image_grid_thw": grids[n]}
                       for n in IMAGES},
            "pixel_values_b": pixel_b,
            "cases": [{**c, "rope_delta": r.get("rope_delta"), "greedy": r["greedy"],
                       "min_logit_gap": r["min_logit_gap"]} for c, r in zip(cases, results)]}
    (out / "golden.json").write_text(json.dumps(meta, indent=1) + "\n")
    (out / "README.md").write_text(
        "Generated by `tools/make_vl_golden.py` (torch + transformers + pillow; CI does not): do not edit, rerun it.\n"
        "A tiny random float32 Qwen2.5-VL (config, generation config, sharded safetensors, demo tokenizer), two\n"
        "test images (`image_{a,b}.png`), and transformers' outputs: `logits_<i>.npy` per prompt position,\n"
        "`position_ids_<i>.npy` (3-D M-RoPE), `features_{a,b}.npy`, `pixel_values_a.npy`; prompts, greedy runs in "
        "`golden.json`.\n")
    for path in sorted(out.iterdir()):
        assert path.stat().st_size < 300_000, f"{path.name}: {path.stat().st_size} bytes"
    size = sum(p.stat().st_size for p in out.iterdir())
    print(f"{out.name} {size / 1024:.1f} KiB  {sorted(p.name for p in out.iterdir())}")


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n")[0]).parse_args()
    torch.use_deterministic_algorithms(True)
    build(OUT)


if __name__ == "__main__":
    main()
