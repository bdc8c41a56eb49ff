"""Clients that open wide streams and never read them: how much the API process grows.

Starts ``fdplug serve`` (the demo model), opens ``--clients`` streams of ``n=32, logprobs=20`` whose
sockets are never read, and samples the API process's RSS for ``--seconds``; then reports the
growth, whether the server closed the connections, and whether the requests were aborted. Before
the stream backlog bound (``--max-stream-backlog``) the API process held every unsent token.

    python bench/slow_clients.py [--clients 2] [--seconds 40] [--fdplug PATH]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.serverkit import free_port, wait_until  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def unread_stream(port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": "demo", "prompt": "hello", "n": 32, "logprobs": 20, "max_tokens": 4000,
                       "ignore_eos": True, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    return sock


def closed(sock: socket.socket) -> bool:
    sock.settimeout(2)
    try:
        while sock.recv(1 << 20):
            pass
        return True
    except TimeoutError:
        return False
    except OSError:
        return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=40.0)
    parser.add_argument("--fdplug", default=str(Path(sys.executable).parent / "fdplug"))
    args = parser.parse_args()
    port = free_port()
    proc = subprocess.Popen([args.fdplug, "serve", "--port", str(port), "--max-model-len", "4096",
                             "--num-kv-blocks", "2048"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_until(lambda: _up(port), 120, 0.2, what="the server")
        before = rss_mb(proc.pid)
        socks = [unread_stream(port) for _ in range(args.clients)]
        start, peak = time.monotonic(), before
        while time.monotonic() - start < args.seconds:
            peak = max(peak, rss_mb(proc.pid))
            time.sleep(0.5)
        after = rss_mb(proc.pid)
        running = _metric(port, "fdplug:num_requests_running")
        print(f"API process RSS: {before:.0f} MB before, peak {peak:.0f} MB, {after:.0f} MB after {args.seconds:g} s "
              f"({args.clients} unread n=32 logprobs=20 streams); requests still running: {running:.0f}; "
              f"connections closed by the server: {sum(closed(s) for s in socks)} of {len(socks)}")
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def _up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


def _metric(port: int, name: str) -> float:
    total = 0.0
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
        if line.startswith((name + " ", name + "{")):
            total += float(line.split()[-1])
    return total


if __name__ == "__main__":
    main()
