"""Prefill/decode disaggregation on this machine: what pulling KV costs, and a PD pair against one instance.

    python bench/pd.py                 # bench/throughput.py's 54M Qwen2 (12 layers, 4 KV heads of 64)
    python bench/pd.py --quick         # fewer repeats and requests
    python bench/pd.py --transfer-only --ray   # the transfer, and the same bytes through Ray's object store

1. Transfer (in one process): the KV of 1,000 tokens of the model (every layer's keys and values,
   float32) pulled from one cache into another by the built-in connectors (`fdplug.core.kv_transfer`):
   ``tcp`` on loopback and ``shm`` (the shared-memory arena), against a numpy copy of the same bytes (memcpy)
   and the same bytes through a bare ZMQ PUSH/PULL pair on loopback (the link's bandwidth).
   Interleaved, medians; the first pull of each (page faults of fresh buffers) is left out.
2. End to end: `fdplug router` + a prefill and a decode `fdplug serve` against one `fdplug serve`,
   the same requests at the same Poisson rate (bench/serve.py's client), alternating; TTFT and ITL
   medians. On this 2-core machine the pair's three processes share the cores with the client: the
   figures say what the relay costs here, not what separate machines would give.
"""

from __future__ import annotations

import argparse
import secrets
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import paddle
import zmq
from serve import launch, run_client, run_rate, stop, summarize
from throughput import MODEL, make_model

from fdplug.core.kv_transfer.connectors import shm_connector, tcp_connector
from fdplug.plugin_api.kv_connector import KVCaches

BLOCK = 16


def caches(blocks: int, fill: bool) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
    shape = [MODEL["num_key_value_heads"], blocks, BLOCK, MODEL["hidden_size"] // MODEL["num_attention_heads"]]
    make = (lambda: paddle.randn(shape)) if fill else (lambda: paddle.zeros(shape))
    return [(make(), make()) for _ in range(MODEL["num_hidden_layers"])]


class Pair:
    """A connector's two ends over two caches, kept across repeats (as in a server)."""

    def __init__(self, factory, source, target) -> None:
        self.sender = factory(None, "prefill", KVCaches(source, "HBTD", BLOCK))
        self.receiver = factory(None, "decode", KVCaches(target, "HBTD", BLOCK))

    def pull(self, blocks: int) -> float:
        conn = self.sender.offer(list(range(blocks)))
        start = time.perf_counter()
        self.receiver.pull(conn, list(range(blocks)))
        while True:
            self.sender.poll()
            done, failed = self.receiver.poll()
            if done or failed:
                assert not failed, failed
                return time.perf_counter() - start

    def close(self) -> None:
        self.sender.close(), self.receiver.close()


def ray_store(payload: np.ndarray, repeats: int) -> None:
    """The same bytes from another process through Ray's object store (what the tcp connector's
    docstring compares it with): an actor returns them (a put into plasma), the driver gets them
    (mapped, no copy), against the bare ZMQ link, interleaved."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        @ray.remote
        class Holder:
            def __init__(self, payload):
                self.payload = np.array(payload)

            def get(self):
                return self.payload

        holder = Holder.remote(payload)
        ray.get(holder.get.remote())                            # warm: the actor up, plasma touched
        runs: dict[str, list[float]] = {"Ray object store": [], "TCP link": []}
        for i in range(repeats):
            for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                start = time.perf_counter()
                if name == "TCP link":
                    link_once(payload, 2 * MODEL["num_hidden_layers"])
                else:
                    got = ray.get(holder.get.remote())
                    assert got.nbytes == payload.nbytes
                    del got
                runs[name].append(time.perf_counter() - start)
        for name, seconds in runs.items():
            s = statistics.median(seconds)
            print(f"  {name:16s} {s * 1e3:7.2f} ms  {payload.nbytes / s / 2**30:6.2f} GiB/s (bytes only)")
    finally:
        ray.shutdown()


def link_once(payload: np.ndarray, frames: int) -> float:
    ctx = zmq.Context.instance()
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    push.connect(f"tcp://127.0.0.1:{port}")
    try:
        chunk = np.array_split(payload, frames)
        start = time.perf_counter()
        for part in chunk:
            push.send(part, copy=False)
        for _ in chunk:
            pull.recv(copy=False)
        return time.perf_counter() - start
    finally:
        push.close(0), pull.close(0)


def transfer(repeats: int) -> None:
    blocks = -(-1000 // BLOCK)
    source, target = caches(blocks, True), caches(blocks, False)
    nbytes = sum(int(k.numel()) * 4 * 2 for k, _ in source)
    payload = np.concatenate([np.asarray(t.numpy()).ravel() for pair in source for t in pair])
    pairs = {"tcp connector": Pair(tcp_connector, source, target), "shm connector": Pair(shm_connector, source, target)}
    runs: dict[str, list[float]] = {"tcp connector": [], "shm connector": [], "memcpy": [], "TCP link": []}
    try:
        for pair in pairs.values():
            pair.pull(blocks)                                   # warm: fresh buffers fault their pages in
        for i in range(repeats):
            for name in (list(runs) if i % 2 == 0 else list(runs)[::-1]):
                if name in pairs:
                    runs[name].append(pairs[name].pull(blocks))
                elif name == "memcpy":
                    start = time.perf_counter()
                    np.copyto(np.empty_like(payload), payload)
                    runs[name].append(time.perf_counter() - start)
                else:
                    runs[name].append(link_once(payload, 2 * MODEL["num_hidden_layers"]))
    finally:
        for pair in pairs.values():
            pair.close()
    print(f"KV of 1,000 tokens ({blocks} blocks x {MODEL['num_hidden_layers']} layers, keys and values, float32): "
          f"{nbytes / 2**20:.1f} MiB; medians of {repeats}:")
    memcpy = statistics.median(runs["memcpy"])
    for name, seconds in runs.items():
        s = statistics.median(seconds)
        print(f"  {name:14s} {s * 1e3:7.2f} ms  {nbytes / s / 2**30:6.2f} GiB/s  ({s / memcpy:5.1f}x memcpy)")


def end_to_end(args, tmp: Path) -> None:
    model = str(make_model(tmp))
    common = ["--model", model, "--served-model-name", "bench", "--max-model-len", "1024"]
    procs = {}
    procs["single"] = launch(common, tmp / "single.log")
    secret = {"FDPLUG_PD_SECRET": secrets.token_hex(16)}    # signed params: the decode side trusts the prefill's
    procs["prefill"] = launch([*common, "--role", "prefill"], tmp / "prefill.log", env=secret)
    procs["decode"] = launch([*common, "--role", "decode"], tmp / "decode.log", env=secret)
    procs["router"] = launch(["--prefill", procs["prefill"][1], "--decode", procs["decode"][1]], tmp / "router.log",
                             command="router")
    targets = {"one instance": procs["single"][1], "PD pair": procs["router"][1]}
    rng = np.random.default_rng(0)
    try:
        got: dict[str, list[dict]] = {name: [] for name in targets}
        for i in range(args.pairs):
            prompts = [rng.integers(0, MODEL["vocab_size"], int(n)).tolist() for n in rng.integers(64, 512, args.n)]
            outputs = [int(o) for o in rng.integers(16, 64, args.n)]
            for name in (list(targets) if i % 2 == 0 else list(targets)[::-1]):
                results, duration = run_client(run_rate(targets[name], "bench", prompts, outputs, args.rate, i))
                got[name].append(summarize(str(args.rate), results, duration))
        print(f"{args.n} requests at {args.rate}/s (~64-512 in, 16-64 out), {args.pairs} runs each, medians:")
        for name, rows in got.items():
            print(f"  {name:13s} TTFT p50 {statistics.median(r['ttft_p50'] for r in rows):7.1f} ms, ITL p50 "
                  f"{statistics.median(r['itl_p50'] for r in rows):6.1f} ms, "
                  f"{statistics.median(r['out_tok_per_s'] for r in rows):6.1f} output tok/s")
    finally:
        stop(procs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 transfer repeats, 2 runs of 12 requests")
    ap.add_argument("--repeats", type=int, default=11)
    ap.add_argument("--n", type=int, default=24, help="requests a run")
    ap.add_argument("--rate", type=float, default=2.0, help="requests a second (Poisson)")
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--ray", action="store_true", help="also: the same bytes through Ray's object store")
    ap.add_argument("--transfer-only", action="store_true", help="skip the end-to-end servers")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.n, args.pairs = 5, 12, 2
    transfer(args.repeats)
    if args.ray:
        blocks = -(-1000 // BLOCK)
        ray_store(np.concatenate([t.numpy().ravel() for pair in caches(blocks, True) for t in pair]), args.repeats)
    if not args.transfer_only:
        with tempfile.TemporaryDirectory() as tmp:
            end_to_end(args, Path(tmp))


if __name__ == "__main__":
    sys.exit(main())
