"""Multimodal serving: encoder cache + prefix caching on against off, and parallel video download;
with ``--pictures``, the vision tower: image encode time and an image prompt's TTFT.

    python bench/multimodal.py                    # 200 requests over 20 images, 30 ms per object
    python bench/multimodal.py --requests 60      # a quicker run
    python bench/multimodal.py --pictures         # Qwen2.5-VL's tower (3B's widths, --vision-depth deep)

Features live in a loopback BOS server (real bce-python-sdk) that answers every object after
``--latency`` seconds. Requests (a chat turn with one image, identified by a uuid) arrive in a
closed loop of ``--concurrency``; TTFT is submission to first token. Both configurations run the
same workload in this process. Then one 16-frame video, stored as one object per frame, is timed
with FD_BOS_DOWNLOAD_PARALLEL=8 against =1.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np

from fdplug.core.frontend.llm import LLM
from fdplug.demo.random_model import write_random_model
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.testing.bos_server import LoopbackBos

AK, SK = "AKbench", "SKbench"
HIDDEN = 256
IMAGE_GRID = [1, 16, 16]          # 64 placeholder tokens
VIDEO_GRID = [8, 8, 8]            # 16 frames = 8 rows of 2 frames, 128 tokens, 8 per frame


def npy(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array)
    return buf.getvalue()


def image_part(url: str, uuid: str) -> dict:
    return {"type": "image_feature", "image_feature": {"url": url, "grid_thw": IMAGE_GRID, "uuid": uuid}}


def run(llm: LLM, prompts: list[dict], concurrency: int, max_tokens: int) -> tuple[list[float], float, int]:
    """Closed loop: keep ``concurrency`` requests in flight; returns TTFTs, wall time, output tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    queue = list(prompts)
    submitted: dict[str, float] = {}
    ttft: dict[str, float] = {}
    done, tokens = 0, 0
    start = time.perf_counter()
    while done < len(prompts):
        while queue and len(submitted) - done < concurrency:
            rid = llm._submit(llm.input_processor.process(queue.pop(0)), params)
            submitted[rid] = time.perf_counter()
        deltas, scheduled = llm._step()
        if not scheduled and not deltas:
            time.sleep(0.001)   # only feature downloads are in flight
        for delta in deltas:
            if delta.token_ids and delta.request_id not in ttft:
                ttft[delta.request_id] = time.perf_counter() - submitted[delta.request_id]
            tokens += len(delta.token_ids)
            if delta.finish_reason is not None:
                if delta.finish_reason != "length":
                    raise RuntimeError(f"request {delta.request_id} ended with {delta.finish_reason}")
                llm.output_processor.pop(delta.request_id)
                done += 1
    return list(ttft.values()), time.perf_counter() - start, tokens


def video_ttft(model_dir: Path, bos: LoopbackBos, urls: list[str], parallel: int) -> float:
    os.environ["FD_BOS_DOWNLOAD_PARALLEL"] = str(parallel)
    llm = LLM(str(model_dir), max_model_len=1024, kv_cache_memory=0.25)
    part = {"type": "video_feature", "video_feature": {"urls": urls, "grid_thw": VIDEO_GRID}}
    prompt = llm.chat_prompt([{"role": "user", "content": [part, {"type": "text", "text": "what happens?"}]}])
    ttfts, _, _ = run(llm, [prompt], 1, 1)
    return ttfts[0]


def write_vl_model(out_dir: Path, depth: int) -> None:
    """A random Qwen2.5-VL: Qwen2.5-VL-3B's vision tower widths (``depth`` blocks deep) on a small
    language side (4 layers of 512), the demo tokenizer; the language and tower in two shards."""
    from safetensors.numpy import save_file

    from fdplug.core.vision.qwen2_5_vl import VisionConfig

    vision = {"depth": depth, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16,
              "out_hidden_size": 512, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "window_size": 112, "fullatt_block_indexes": list(range(depth // 4 - 1, depth, depth // 4 or 1)),
              "tokens_per_second": 2, "hidden_act": "silu"}
    write_random_model(out_dir, architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl",
                       hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
                       num_key_value_heads=2, rope_scaling={"type": "mrope", "mrope_section": [8, 12, 12]},
                       vision_config=vision, fdplug_mm_mask_policy="causal")
    rng = np.random.default_rng(0)
    tower = {"visual." + name: (np.ones(shape) if len(shape) == 1 and "norm" in name else
                                rng.standard_normal(shape) * 0.02).astype(np.float32)
             for name, shape in VisionConfig.from_hf({"vision_config": vision}).weight_shapes().items()}
    (out_dir / "model.safetensors").rename(out_dir / "model-00001-of-00002.safetensors")
    save_file(tower, str(out_dir / "model-00002-of-00002.safetensors"))
    from safetensors import safe_open

    with safe_open(str(out_dir / "model-00001-of-00002.safetensors"), "numpy") as f:
        names = {name: "model-00001-of-00002.safetensors" for name in f.keys()}
    names |= {name: "model-00002-of-00002.safetensors" for name in tower}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": names}))


def picture_bench(depth: int, repeat: int) -> None:
    """Encode time per picture size (preprocess + tower), then TTFT of a chat turn with one picture:
    new (encoded), repeated (encoder cache and prefix cache hit), and a text prompt of as many tokens."""
    from PIL import Image

    from fdplug.core.vision.image_processing import ImageSpec, decode, patchify

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "vl"
        model_dir.mkdir()
        write_vl_model(model_dir, depth)
        llm = LLM(str(model_dir), max_model_len=2048, kv_cache_memory=0.5)
        encoder = llm.engine.runner.image_encoder
        rng = np.random.default_rng(1)
        pictures = {}
        print(f"Qwen2.5-VL tower, 3B widths (hidden 1280, 16 heads, MLP 3420), {depth} blocks; float32, CPU")
        for width, height in ((224, 224), (448, 448), (672, 896)):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
            data = pictures[width, height] = buf.getvalue()
            prep, full = [], []
            for _ in range(repeat):
                t0 = time.perf_counter()
                patchify(decode(data, "bench"), ImageSpec())
                t1 = time.perf_counter()
                features = encoder(data, "bench")
                prep.append(t1 - t0)
                full.append(time.perf_counter() - t1)
            print(f"  {width}x{height}: {len(features)} tokens, preprocess {np.median(prep) * 1e3:7.1f} ms, "
                  f"preprocess + tower {np.median(full) * 1e3:8.1f} ms (median of {repeat})")
        greedy = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

        def ttft(prompt: dict) -> tuple[float, int]:
            t0 = time.perf_counter()
            out = llm.generate(prompt, greedy, use_tqdm=False)[0]
            return time.perf_counter() - t0, len(out.prompt_token_ids)

        def turn(data: bytes) -> dict:
            url = "data:image/png;base64," + base64.b64encode(data).decode()
            return llm.chat_prompt([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                                                 {"type": "text", "text": "Describe it."}]}])

        first, tokens = ttft(turn(pictures[448, 448]))   # the feature loader thread's first encode
        fresh = []
        for _ in range(repeat):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (448, 448, 3), dtype=np.uint8)).save(buf, format="PNG")
            fresh.append(ttft(turn(buf.getvalue()))[0])
        again, _ = ttft(turn(pictures[448, 448]))
        text, _ = ttft({"prompt_token_ids": rng.integers(0, 500, tokens).tolist()})
        print(f"  TTFT, a chat turn with one 448x448 picture ({tokens} tokens): new {np.median(fresh) * 1e3:.0f} ms "
              f"(median of {repeat}; the loader thread's first {first * 1e3:.0f} ms), repeated {again * 1e3:.0f} ms "
              f"(encoder + prefix cache); a text prompt of {tokens} tokens {text * 1e3:.0f} ms")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pictures", action="store_true", help="bench the vision tower instead")
    parser.add_argument("--vision-depth", type=int, default=8, help="tower blocks (Qwen2.5-VL-3B has 32)")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    logging.disable(logging.INFO)
    if args.pictures:
        picture_bench(args.vision_depth, args.repeat)
        return
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp, LoopbackBos(access_key=AK, latency=args.latency) as bos:
        os.environ.update({"FDPLUG_BOS_ENDPOINT": bos.endpoint, "FDPLUG_BOS_AK": AK, "FDPLUG_BOS_SK": SK})
        model_dir = Path(tmp) / "demo"
        model_dir.mkdir()
        write_random_model(model_dir)
        rows = IMAGE_GRID[0] * IMAGE_GRID[1] * IMAGE_GRID[2] // 4
        urls = [bos.put("feats", f"img/{i}.npy", npy(rng.standard_normal((rows, HIDDEN)).astype(np.float32)))
                for i in range(args.images)]
        picks = rng.integers(0, args.images, size=args.requests)
        results = {}
        for caches in (True, False):
            llm = LLM(str(model_dir), max_model_len=1024, kv_cache_memory=0.5, enable_prefix_caching=caches,
                      encoder_cache_rows=16384 if caches else 0)
            prompts = [llm.chat_prompt([{"role": "user", "content": [image_part(urls[i], f"img-{i}"),
                                                                     {"type": "text", "text": "Describe it."}]}])
                       for i in picks]
            before = bos.request_count()
            ttfts, wall, tokens = run(llm, prompts, args.concurrency, args.max_tokens)
            results[caches] = (np.percentile(ttfts, 50), np.percentile(ttfts, 99), tokens / wall,
                               bos.request_count() - before)
            del llm
        print(f"{args.requests} requests over {args.images} images ({rows} feature rows each), BOS latency "
              f"{args.latency * 1e3:.0f} ms, concurrency {args.concurrency}, {args.max_tokens} output tokens each")
        for caches, (p50, p99, tps, fetched) in results.items():
            print(f"  caches {'on ' if caches else 'off'}: TTFT p50 {p50 * 1e3:7.1f} ms, p99 {p99 * 1e3:7.1f} ms, "
                  f"{tps:6.1f} output tok/s, {fetched} downloads")
        print(f"  p50 TTFT with caches / without: {results[True][0] / results[False][0]:.2f} (target <= 0.5)")

        frame_rows = VIDEO_GRID[1] * VIDEO_GRID[2] // 4 // 2
        frames = [bos.put("feats", f"video/frame{f:02d}.npy",
                          npy(rng.standard_normal((frame_rows, HIDDEN)).astype(np.float32))) for f in range(16)]
        parallel, sequential = video_ttft(model_dir, bos, frames, 8), video_ttft(model_dir, bos, frames, 1)
        print(f"16-frame video (16 objects): TTFT {parallel * 1e3:.0f} ms with FD_BOS_DOWNLOAD_PARALLEL=8, "
              f"{sequential * 1e3:.0f} ms with =1; ratio {parallel / sequential:.2f} (target <= 0.4)")


if __name__ == "__main__":
    main()
