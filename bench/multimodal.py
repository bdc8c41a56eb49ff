"""Multimodal serving: encoder cache + prefix caching on against off, and parallel video download.

    python bench/multimodal.py                    # 200 requests over 20 images, 30 ms per object
    python bench/multimodal.py --requests 60      # a quicker run

Features live in a loopback BOS server (real bce-python-sdk) that answers every object after
``--latency`` seconds. Requests (a chat turn with one image, identified by a uuid) arrive in a
closed loop of ``--concurrency``; TTFT is submission to first token. Both configurations run the
same workload in this process. Then one 16-frame video, stored as one object per frame, is timed
with FD_BOS_DOWNLOAD_PARALLEL=8 against =1.
"""

from __future__ import annotations

import argparse
import io
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--images", type=int, default=20)
    parser.add_argument("--latency", type=float, default=0.03)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    logging.disable(logging.INFO)
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
