"""Starting and stopping `fdplug serve`: startup errors, a full queue, SIGTERM, and either process dying."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import httpx
import pytest

from fdplug.server.engine.os_timeslice import current_slice_ns
from tests.conftest import subprocess_env
from tests.serverkit import (
    FDPLUG,
    SMALL,
    Server,
    alive,
    free_port,
    kernel_honours_custom_slices,
    wait_until,
)


def run_cli(*args, timeout=60):
    return subprocess.run([FDPLUG, "serve", *args], capture_output=True, text=True, timeout=timeout,
                          env=subprocess_env(), stdin=subprocess.DEVNULL)


def test_strict_device_fails_before_loading():
    r = run_cli("--device", "xpu", "--port", str(free_port()))
    assert r.returncode == 1
    assert "error: device 'xpu' was asked for explicitly" in r.stderr and "fix:" in r.stderr
    assert "Traceback" not in r.stderr


def test_engine_startup_error_is_typed_and_fixable():
    """The KV cache check runs in the engine process; its error crosses the handshake with its fix."""
    r = run_cli("--num-kv-blocks", "2", "--max-model-len", "1024", "--port", str(free_port()))
    assert r.returncode == 1, r.stderr
    assert "error: a KV cache of" in r.stderr and "fix:" in r.stderr
    assert "Traceback" not in r.stderr


def test_port_in_use():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = run_cli("--port", str(s.getsockname()[1]))
    assert r.returncode == 1 and "cannot listen on" in r.stderr and "--port" in r.stderr


def _stream_lines(server, body, out: list, started: threading.Event):
    try:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
            out.append(r.status_code)
            for line in r.iter_lines():
                if line:
                    out.append(line)
                    started.set()
    except httpx.HTTPError as exc:
        out.append(exc)
    finally:
        started.set()


@pytest.mark.parametrize("event_loop", ["uvloop", "asyncio"])
def test_queue_full_then_sigterm(tmp_path, event_loop):
    """One running, one waiting: the next gets 503. Then SIGTERM with --shutdown-timeout 0 (no drain)
    ends the streams with an error event and exits 0 (either loop); `test_hostile_clients` drains."""
    # 4,000-token streams (~3 s each on the demo model): the first still runs while a loaded machine's
    # client makes its checks
    server = Server(["--max-model-len", "4096", "--num-kv-blocks", "600", "--max-num-seqs", "1",
                     "--max-waiting-requests", "1", "--shutdown-timeout", "0"], tmp_path / "q.log",
                    FDPLUG_EVENT_LOOP=event_loop).wait_ready()
    assert f"API process event loop: {event_loop}" in server.log()
    engine = server.engine_pid()
    long = {"prompt": "Hello", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    results = [[], []]
    events = [threading.Event(), threading.Event()]
    threads = [threading.Thread(target=_stream_lines, args=(server, long, results[i], events[i])) for i in range(2)]
    threads[0].start()
    assert events[0].wait(20)                                            # first one is running
    threads[1].start()
    wait_until(lambda: server.metrics()["fdplug:num_requests_waiting"] == 1, 10, what="one waiting")
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
    assert r.status_code == 503 and "max_waiting_requests" in r.json()["error"]["message"]
    s = httpx.post(server.url + "/v1/completions", json={**long, "stream": True}, timeout=30)
    assert s.status_code == 503                                        # streaming too: before the 200

    t0 = time.monotonic()
    assert server.stop(signal.SIGTERM) == 0, server.log()
    assert time.monotonic() - t0 < 10
    for t in threads:
        t.join(10)
    running = results[0]
    assert running[0] == 200 and running[-1] == "data: [DONE]"
    assert "shutting down" in running[-2], running[-3:]
    assert not alive(engine), "the engine process outlived the server"
    assert "SIGTERM: stopping" in server.log()


def test_engine_death_fails_requests_and_exits_nonzero(tmp_path):
    server = Server(SMALL, tmp_path / "dead.log").wait_ready()
    engine = server.engine_pid()
    result: list = []

    def inflight():
        try:
            result.append(httpx.post(server.url + "/v1/completions", timeout=30,
                                     json={"prompt": "Hi", "max_tokens": 480, "ignore_eos": True}))
        except httpx.HTTPError as exc:
            result.append(exc)

    thread = threading.Thread(target=inflight)
    thread.start()
    wait_until(lambda: server.metrics()["fdplug:num_requests_running"] == 1, 10, what="request running")
    os.kill(engine, signal.SIGKILL)

    def health_503():
        try:
            return httpx.get(server.url + "/health", timeout=2).status_code == 503
        except httpx.HTTPError:
            return False

    wait_until(health_503, 5, 0.02, what="/health 503")
    thread.join(10)
    response = result[0]
    assert isinstance(response, httpx.Response) and response.status_code == 500
    assert "engine process" in response.json()["error"]["message"]
    code = server.proc.wait(15)
    assert code != 0
    assert "exited with status -9" in server.log()


def test_engine_exits_when_the_api_process_is_killed(tmp_path):
    server = Server(SMALL, tmp_path / "orphan.log").wait_ready()
    engine = server.engine_pid()
    frozen = re.search(r"; (\d+) startup objects frozen out of GC passes", server.log())
    assert frozen and int(frozen.group(1)) > 10_000     # FastAPI, paddle, the tokenizer: never garbage
    if kernel_honours_custom_slices():   # every engine thread (paddle's workers too) preempts the API process
        assert "engine process scheduler slice: 0.1 ms, set so" in server.log()
        slices = {t: current_slice_ns(f"/proc/{engine}/task/{t}/sched") for t in os.listdir(f"/proc/{engine}/task")}
        assert len(slices) > 1 and set(slices.values()) == {100_000}, slices
        assert current_slice_ns(f"/proc/{server.proc.pid}/sched") != 100_000    # the API process keeps the kernel's
    server.stop(signal.SIGKILL)
    wait_until(lambda: not alive(engine), 10, what="engine process gone")
