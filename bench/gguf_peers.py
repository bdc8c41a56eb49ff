"""fdplug against llama.cpp on the same GGUF file, same machine, same prompts, same run.

    python bench/gguf_peers.py --llama-python /work/llamavenv/bin/python        # the cached SmolLM2 Q4_1
    python bench/gguf_peers.py --gguf /path/SmolLM2-135M-Instruct.Q4_K_M.gguf --llama-python ...
    python bench/gguf_peers.py --quick ...        # 1 round, short serving run: a smoke run
    python bench/gguf_peers.py --isa avx2 ...     # fdplug's kernels capped at x86-64-v3 (FDPLUG_CPU_ISA)

Run it with fdplug's interpreter (the driver, fdplug's worker and bench/serve.py run there);
llama.cpp's worker runs in ``--llama-python``, a venv with llama-cpp-python, and the serving peer is
``--llama-server`` (a llama-server binary built from the same llama.cpp). Both engines get the
machine's cores (fdplug: its default; llama.cpp: ``n_threads=2``/``-t 2``, or ``--threads``).

Offline, each engine in its own interpreter (bench/gguf_peer_worker.py), built and warmed up, then
timed on: TTFT of fresh 1,024-token prompts of random token ids (median of 3); single-stream greedy
decode of 256 tokens after a 64-token prompt, prefill excluded (median of 2). fdplug:
``fdplug.LLM(path, max_model_len=2048, kv_cache_dtype="float16")`` (``--kv-cache-dtype``: float16 by
default, llama.cpp's default cache type); llama.cpp: ``llama_cpp.Llama(path, n_ctx=2048,
n_threads=2, n_batch=512)``, ``eval`` of the prompt then greedy ``llama_sampler_sample`` / ``eval`` one
token at a time, KV cleared before each prompt.

Serving: ``llama-server -m PATH --parallel 64 -c 64*2048 --cont-batching -t 2`` and ``fdplug serve
--model PATH --max-num-seqs 64 --max-model-len 2048 --kv-cache-dtype float16``, one at a time, each loaded with
bench/serve.py ``--url`` (64 streamed requests of random token-id prompts at once, input 128 /
output 128 tokens +-50%, ``ignore_eos``, one warm-up pass of the whole workload on other prompts),
output tokens/s at saturation. llama-server takes token-id prompts in ``/v1/completions`` and
``ignore_eos``; its streamed completions carry the usage in the final chunk (``"choices"`` first,
with an empty text) rather than in a separate ``"choices":[]`` chunk, which serve.py reads too.

Rounds alternate the engine order (ABBA); figures are medians over rounds. Each round's line ends
with the load average and the CPU stolen by the hypervisor over the round: llama.cpp's OpenMP
threads spin at barriers, and another busy process on the 2 cores cost it up to 5x in TTFT and
serving (measured), so compare only rounds with a load near the core count and no steal.
Every child (workers, servers, serve.py) runs in a temporary directory, so a checkout's ``fdplug/``
in the working directory cannot shadow the installed fdplug (fdplug's engine process puts its
working directory on the import path). Every figure is printed with the CPU and the instruction-set
level: fdplug's is what its kernels were built for (`fdplug.plugins.cpu.isa`), llama.cpp's the ggml
CPU features it was compiled with (GGML_NATIVE).
Targets (issue 34): decode >= 1.2x llama.cpp, TTFT <= 0.8x llama.cpp's, 64 streams >= 3x llama-server.

The peer, llama-cpp-python and llama-server from the same vendored llama.cpp, built for this CPU:

    python3 -m venv llamavenv && CMAKE_ARGS="-DGGML_NATIVE=ON" llamavenv/bin/pip install llama-cpp-python
    pip download --no-binary :all: --no-deps llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cd llama_cpp_python-*/vendor/llama.cpp && cmake -B build -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF && cmake --build build -j2 --target llama-server llama-quantize

A K-quant file from the Q4_1 one: ``llama-quantize --allow-requantize Q4_1.gguf Q4_K_M.gguf Q4_K_M``
(SmolLM2's rows of 576 are not multiples of 256: most tensors fall back to Q5_0/Q8_0).
"""  # noqa: E501 (printed verbatim by --help: RawDescriptionHelpFormatter)

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

# The environment as the user gave it, before anything imports paddle (which sets OMP_NUM_THREADS=1
# when it is unset, and every worker would inherit that as an order).
WORKER_ENV = dict(os.environ)

import numpy as np

HERE = Path(__file__).parent
WORKER_TIMEOUT_S = 1800
TARGETS = {"decode": 1.2, "ttft": 0.8, "serve": 3.0}


# -- the file ----------------------------------------------------------------------------------------


def describe_gguf(path: str) -> tuple[str, int, str]:
    """(file type, e.g. "Q4_K_M", vocab size, tensor type mix "Q4_K x 120, ...") of a GGUF file."""
    import gguf

    reader = gguf.GGUFReader(path)
    mix = Counter(gguf.GGMLQuantizationType(int(t.tensor_type)).name for t in reader.tensors)
    ftype = "?"
    field = reader.fields.get("general.file_type")
    if field is not None:
        value = int(field.parts[field.data[0]][0])
        try:
            ftype = gguf.LlamaFileType(value).name.removeprefix("MOSTLY_")
        except ValueError:
            ftype = f"file_type {value}"
    vocab = None
    for key in ("tokenizer.ggml.tokens",):
        field = reader.fields.get(key)
        if field is not None:
            vocab = len(field.data)
    if vocab is None:    # the output (or tied embedding) matrix's rows
        embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
        vocab = int(embed.shape[-1])
    return ftype, vocab, ", ".join(f"{name} x {n}" for name, n in mix.most_common())


def cpu_line() -> str:
    """The CPU model (with family/model: this machine's name alone is 'AMD EPYC') and fdplug's level."""
    from fdplug.plugins.cpu import isa

    fields = {}
    for line in isa.cpuinfo_lines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
        if not line:
            break
    ident = (f" (family {fields.get('cpu family', '?')} model {fields.get('model', '?')})"
             if "cpu family" in fields else "")
    return f"CPU: {isa.model_name()}{ident}, {os.cpu_count()} cores; fdplug kernels built for {isa.describe()}"


def cpu_times() -> list[int]:
    """/proc/stat's aggregate cpu line (user nice system idle iowait irq softirq steal ...), or []."""
    try:
        with open("/proc/stat") as f:
            return [int(x) for x in f.readline().split()[1:9]]
    except (OSError, ValueError):
        return []


def load(since: list[int]) -> str:
    """The 1-minute load average and, since ``since``, the CPU stolen by the hypervisor: a load above
    the core count means other processes here shared the cores; steal, other machines on the host.
    (llama.cpp's OpenMP threads spin at barriers and lose most of their speed when a core is taken.)"""
    now = cpu_times()
    text = f"load {os.getloadavg()[0]:.1f}/{os.cpu_count()}"
    if now and since and sum(now) > sum(since):
        text += f", steal {100 * (now[7] - since[7]) / (sum(now) - sum(since)):.0f}%"
    return text


# -- offline: TTFT and single-stream decode ----------------------------------------------------------


def job(model: str, vocab: int, quick: bool, kv_cache_dtype: str = "auto", op_kernels: dict | None = None) -> dict:
    rng = np.random.default_rng(1)

    def fresh(n: int) -> list[int]:
        return rng.integers(0, vocab, size=n).tolist()

    return {"model": model, "kv_cache_dtype": kv_cache_dtype, "op_kernels": op_kernels or {},
            "warmup": [fresh(1024), fresh(64)] if quick else [fresh(1024), fresh(1024), fresh(64)],
            "ttft_prompts": [fresh(1024) for _ in range(3)],
            "decode_prompts": [(fresh(64), fresh(64)) for _ in range(2)], "decode_tokens": 64 if quick else 256,
            "agreement_prompts": [fresh(32) for _ in range(4)], "agreement_tokens": 16}


def run_worker(python: str, engine: str, spec: dict, tmp: Path, env: dict) -> dict | None:
    (tmp / "job.json").write_text(json.dumps(spec))
    out = tmp / f"{engine}.json"
    out.unlink(missing_ok=True)
    done = subprocess.run([python, str(HERE / "gguf_peer_worker.py"), engine, str(tmp / "job.json"), str(out)],
                          capture_output=True, text=True, timeout=WORKER_TIMEOUT_S, check=False, env=env, cwd=tmp)
    if done.returncode != 0:
        print(f"  {engine} failed (exit {done.returncode}): {(done.stderr or done.stdout).strip().splitlines()[-6:]}",
              flush=True)
        return None
    return json.loads(out.read_text())


# -- serving: 64 streams -----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"server not ready in {timeout:.0f} s; see {log}")


def server_command(engine: str, args, port: int) -> list[str]:
    """llama-server with parallel slots and continuous batching, or fdplug serve, on ``port``."""
    if engine == "llama.cpp":
        return [args.llama_server, "-m", args.gguf, "--parallel", str(args.streams), "-c", str(args.streams * args.ctx),
                "--cont-batching", "-t", str(args.threads), "--host", "127.0.0.1", "--port", str(port),
                "--alias", "bench"]
    return [str(Path(args.fdplug_python).parent / "fdplug"), "serve", "--model", args.gguf, "--port", str(port),
            "--served-model-name", "bench", "--max-num-seqs", str(args.streams), "--max-model-len", str(args.ctx),
            "--kv-cache-dtype", args.kv_cache_dtype, *(f"--op-kernel={pair}" for pair in args.op_kernel)]


def start_server(engine: str, args, log: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """The engine's server on a free loopback port, logging to ``log``, ready; ``(process, url)``."""
    port = free_port()
    with open(log, "wb") as out:
        proc = subprocess.Popen(server_command(engine, args, port), stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, env=env, cwd=log.parent)
    url = f"http://127.0.0.1:{port}"
    wait_ready(proc, url, log)
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


ROW = re.compile(r"^\s*inf\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def load_with_serve_py(args, url: str, env: dict, cwd: Path) -> dict | None:
    """bench/serve.py --url against a running server: its saturation rows' output tok/s (median)."""
    cmd = [args.fdplug_python, str(HERE / "serve.py"), "--url", url, "--model", args.gguf,
           "--served-model-name", "bench",
           "--num-prompts", str(args.streams), "--max-num-seqs", str(args.streams), "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--rates", "", "--repeat", str(args.serve_repeat),
           "--warmups", "1", "--no-offline"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, check=False, env=env, cwd=cwd)
    lines = done.stdout.splitlines()
    header = next((i for i, line in enumerate(lines) if line.strip().startswith("rate")), None)
    rows = [ROW.match(line) for line in (lines[header + 1:] if header is not None else [])]
    rows = [m for m in rows if m]
    if done.returncode != 0 or not rows:
        print(f"  serve.py failed (exit {done.returncode}): {(done.stderr or done.stdout).strip().splitlines()[-6:]}",
              flush=True)
        return None
    if done.stderr.strip():
        print("  serve.py: " + " | ".join(done.stderr.strip().splitlines()[-3:]), flush=True)
    tok_s = [float(m.group(3)) for m in rows]
    return {"tok_s": statistics.median(tok_s), "runs": tok_s, "ok": [int(m.group(1)) for m in rows],
            "ttft_p50_ms": statistics.median(float(m.group(4)) for m in rows)}


def serve_round(args, engine: str, env: dict, tmp: Path) -> dict | None:
    log = tmp / f"{engine}-server.log"
    try:
        proc, url = start_server(engine, args, log, WORKER_ENV if engine == "llama.cpp" else env)
    except RuntimeError as exc:
        tail = log.read_text(errors="replace").strip().splitlines()[-6:] if log.exists() else []
        print(f"  {engine} server failed: {exc}: {tail}", flush=True)
        return None
    try:
        return load_with_serve_py(args, url, env, tmp)
    finally:
        stop(proc)


# -- report ------------------------------------------------------------------------------------------


def median_of(results: list[dict], key: str) -> float | None:
    values = [statistics.median(r[key]) for r in results if r]
    return statistics.median(values) if values else None


def report(args, ftype: str, mix: str, offline: dict[str, list[dict]], serving: dict[str, list[dict]]) -> None:
    print(f"\n== {Path(args.gguf).name}: {ftype} ({mix}) ==")
    print(cpu_line())
    levels = {e: rs[0]["info"]["level"] for e, rs in offline.items() if rs}
    levels.setdefault("fdplug", "(see above)")
    levels.setdefault("llama.cpp", "llama-server: as it was built")
    fig: dict[str, dict] = {}
    for engine in ("fdplug", "llama.cpp"):
        ttft = median_of(offline.get(engine, []), "ttft")
        fig[engine] = {"ttft_ms": ttft * 1e3 if ttft else None,
                       "decode": median_of(offline.get(engine, []), "decode_tok_s"),
                       "serve": statistics.median(r["tok_s"] for r in serving[engine]) if serving.get(engine) else None}

    def cell(value, fmt):
        width = int(fmt.split(".")[0])
        return "-".rjust(width) if value is None else format(value, fmt)

    names = {"fdplug": "fdplug", "llama.cpp": "llama.cpp"}   # TTFT, decode: llama-cpp-python; streams: llama-server
    print(f"{'engine':26s} {'format':8s} {'TTFT 1024 ms':>12s} {'decode tok/s':>12s} "
          f"{f'{args.streams}-stream tok/s':>16s}  CPU/level")
    for engine in ("fdplug", "llama.cpp"):
        f = fig[engine]
        print(f"{names[engine]:26s} {ftype:8s} {cell(f['ttft_ms'], '12.0f')} {cell(f['decode'], '12.1f')} "
              f"{cell(f['serve'], '16.1f')}  {levels[engine]}")
    ours, peer = fig["fdplug"], fig["llama.cpp"]

    def ratio(name, a, b, target, higher):
        if a is None or b is None:
            print(f"{name}: -")
            return
        x = a / b
        holds = x >= target if higher else x <= target
        print(f"{name}: {x:.2f}x (target {'>=' if higher else '<='} {target}): {'holds' if holds else 'misses'}")

    ratio("fdplug/llama.cpp decode tok/s", ours["decode"], peer["decode"], TARGETS["decode"], True)
    ratio("fdplug/llama.cpp TTFT(1024)", ours["ttft_ms"], peer["ttft_ms"], TARGETS["ttft"], False)
    ratio(f"fdplug serve/llama-server {args.streams}-stream tok/s", ours["serve"], peer["serve"],
          TARGETS["serve"], True)
    for engine, rs in offline.items():
        if rs:
            info = rs[0]["info"]
            extra = info.get("kernels") or info.get("system_info", "")
            print(f"  {engine}: load {statistics.median(r['info']['load_s'] for r in rs):.1f} s; {extra}")
    if offline.get("fdplug") and offline.get("llama.cpp"):
        a, b = offline["fdplug"][0]["agreement_tokens"], offline["llama.cpp"][0]["agreement_tokens"]
        same = sum(x == y for p, q in zip(a, b) for x, y in zip(p, q))
        prefix = [next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), len(p)) for p, q in zip(a, b)]
        print(f"  greedy agreement on {len(a)} random 32-token prompts x {len(a[0])} tokens: {same}/{sum(map(len, a))} "
              f"positions equal, common prefixes {prefix} (random-id prompts: near-ties differ between kernels)")
    for engine, rs in serving.items():
        if rs:
            print(f"  {engine} serve runs (out tok/s): {[round(x, 1) for r in rs for x in r['runs']]}, "
                  f"TTFT p50 {statistics.median(r['ttft_p50_ms'] for r in rs):.0f} ms")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", default=None, help="GGUF file (default: the cached SmolLM2-135M-Instruct Q4_1, "
                                                     "fdplug.demo.pypi_models.resolve_model('smollm2'))")
    parser.add_argument("--isa", choices=("auto", "sse4", "avx2", "avx512"), default=None,
                        help="FDPLUG_CPU_ISA for fdplug (caps its kernels' level)")
    parser.add_argument("--llama-python", default="/work/llamavenv/bin/python",
                        help="interpreter with llama-cpp-python")
    parser.add_argument("--llama-server", default="/work/llamabin/llama-server")
    parser.add_argument("--fdplug-python", default=sys.executable, help="interpreter with fdplug (default: this one)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="llama.cpp's threads")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--parts", default="offline,serve", help="offline (TTFT, decode), serve (64 streams), or both")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--kv-cache-dtype", default="float16",
                        help="fdplug's KV cache (default float16: llama.cpp's default cache type, so both engines "
                             "read the same bytes a key)")
    parser.add_argument("--op-kernel", action="append", default=[], metavar="OP=NAME",
                        help="fdplug's --op-kernel (e.g. gguf_linear=cpu_native_gguf_q8_linear: q8 math, as llama.cpp)")
    parser.add_argument("--ctx", type=int, default=2048, help="context per sequence (llama-server: -c streams*ctx)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--serve-repeat", type=int, default=2, help="serve.py --repeat (saturation runs per round)")
    parser.add_argument("--quick", action="store_true", help="1 round, 64-token decode, serving output 32, 1 run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.serve_repeat, args.output_len = 1, 1, min(args.output_len, 32)
    fd_env = dict(WORKER_ENV)
    if args.isa:
        fd_env["FDPLUG_CPU_ISA"] = args.isa
        os.environ["FDPLUG_CPU_ISA"] = args.isa      # for this process's cpu_line()
    if args.gguf is None:
        from fdplug.demo.pypi_models import resolve_model

        args.gguf = resolve_model("smollm2")
    ftype, vocab, mix = describe_gguf(args.gguf)
    print(f"{args.gguf}: {ftype}, vocab {vocab}; tensors {mix}")
    print(cpu_line(), flush=True)
    print(f"KV cache: fdplug {args.kv_cache_dtype} (--kv-cache-dtype), llama.cpp f16 (its default)"
          + "".join(f"; fdplug --op-kernel {pair}" for pair in args.op_kernel), flush=True)
    pythons = {"fdplug": args.fdplug_python, "llama.cpp": args.llama_python}
    envs = {"fdplug": fd_env, "llama.cpp": WORKER_ENV}
    engines = ["fdplug", "llama.cpp"]
    parts = set(args.parts.split(","))
    offline: dict[str, list[dict]] = {e: [] for e in engines}
    serving: dict[str, list[dict]] = {e: [] for e in engines}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        spec = job(args.gguf, vocab, args.quick, args.kv_cache_dtype, dict(p.split("=", 1) for p in args.op_kernel))
        for r in range(args.rounds):
            order = engines if r % 2 == 0 else engines[::-1]
            if "offline" in parts:
                for engine in order:
                    t0, c0 = time.perf_counter(), cpu_times()
                    got = run_worker(pythons[engine], engine, spec, root, envs[engine])
                    if got:
                        offline[engine].append(got)
                        print(f"round {r} {engine}: TTFT {[round(x * 1e3) for x in got['ttft']]} ms, decode "
                              f"{[round(x, 1) for x in got['decode_tok_s']]} tok/s"
                              f" ({time.perf_counter() - t0:.0f} s, {load(c0)})",
                              flush=True)
            if "serve" in parts:
                for engine in order:
                    t0, c0 = time.perf_counter(), cpu_times()
                    got = serve_round(args, engine, envs[engine] if engine == "llama.cpp" else fd_env, root)
                    if got:
                        serving[engine].append(got)
                        print(f"round {r} {engine} serve: {[round(x, 1) for x in got['runs']]} out tok/s, "
                              f"ok {got['ok']} "
                              f"({time.perf_counter() - t0:.0f} s, {load(c0)})", flush=True)
    report(args, ftype, mix, offline, serving)
    return 0


if __name__ == "__main__":
    sys.exit(main())
