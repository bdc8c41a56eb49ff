"""Hostile and clumsy clients against every HTTP surface fdplug serves.

One fleet of real servers on the sharp test model: a plain instance, a data-parallel one (two
engines), a PD prefill/decode pair sharing ``FDPLUG_PD_SECRET``, and ``fdplug router`` over the
pair. Each gets the same probes: malformed JSON, wrong types, non-finite and huge numbers, 50,000
nested brackets, unknown paths and methods, random bodies (hypothesis), bad ``X-Data-Parallel-Rank``
headers; every answer must be an OpenAI error object with a 4xx (or a 200 for a body that happens to
be valid), never a 500. Then clients that never read their stream, that leave before their answer,
that open connections and send nothing or half a request, or a 32 MiB header. Afterwards every
instance runs nothing and holds no KV block, and no API process kept descriptors or grew.

The SIGTERM drain (new requests and ``/health`` get 503 while streams in flight finish; with a short
``--shutdown-timeout`` the rest end with an error event; exit 0) for the server and the router.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.serverkit import Server, free_port, start_router, status, wait_until

ARGS = ["--max-model-len", "2048", "--num-kv-blocks", "600", "--served-model-name", "m"]
SECRET = {"FDPLUG_PD_SECRET": "shared by the PD pair"}
FAST = ["--idle-timeout", "1", "--request-timeout", "2"]   # the write timeout stays long: the backlog bound acts


@pytest.fixture(scope="module")
def fleet(test_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("hostile")
    model = str(test_model_dir)
    kv_port = free_port()
    servers = {"plain": Server(["--model", model, *ARGS, *FAST], logs / "plain.log"),
               "dp": Server(["--model", model, *ARGS, "--data-parallel-size", "2"], logs / "dp.log"),
               "prefill": Server(["--model", model, *ARGS, "--role", "prefill", "--kv-port", str(kv_port)],
                                 logs / "prefill.log", **SECRET),
               "decode": Server(["--model", model, *ARGS, "--role", "decode"], logs / "decode.log", **SECRET),
               # no secret: it pulls from the prefill instance it names, and nothing else
               "unsigned": Server(["--model", model, *ARGS, "--role", "decode", "--kv-peers", f"127.0.0.1:{kv_port}"],
                                  logs / "unsigned.log")}
    router = None
    try:
        for server in servers.values():
            server.wait_ready()
        router = start_router(servers["prefill"].url, servers["decode"].url, logs / "router.log")
        for url in [s.url for s in servers.values() if s is not servers["prefill"]] + [router.url]:   # warm up
            reply = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                               timeout=60)
            assert reply.status_code == 200, reply.text
        for process in [*servers.values(), router]:
            process.baseline = (fds(process.proc.pid), rss_mb(process.proc.pid))
        yield servers, router
    finally:
        if router is not None:
            assert router.stop() == 0
        for server in servers.values():
            assert server.stop() == 0, server.log()


def targets(fleet) -> dict[str, str]:
    servers, router = fleet
    return {**{name: s.url for name, s in servers.items()}, "router": router.url}


# -- the error contract -----------------------------------------------------------------------------

NESTED = b"[" * 50_000
COMPLETION_PROBES = [
    b'{"model": "m", "prompt": "hi", "min_tokens": "abc"}',
    b'{"model": "m", "prompt": "hi", "min_tokens": [1]}',
    b'{"model": "m", "prompt": "hi", "min_tokens": 1e400}',
    b'{"model": "m", "prompt": "hi", "min_tokens": NaN}',
    b'{"model": "m", "prompt": "hi", "temperature": NaN}',
    b'{"model": "m", "prompt": "hi", "temperature": Infinity}',
    b'{"model": "m", "prompt": "hi", "max_tokens": 1e400}',
    b'{"model": "m", "prompt": "hi", "max_tokens": 123456789012345678901234567890}',
    b'{"model": "m", "prompt": [123456789012345678901234567890]}',
    b'{"model": "m", "prompt": "hi", "stop": [null]}',
    b'{"model": "m", "prompt": "hi", "seed": "1"}',
    b'{"model": "m", "prompt": "hi", "n": 0}',
    b'{"model": "m", "prompt": "hi", "logprobs": 21}',
    b'{"model": "m", "prompt": "hi", "max_token": 5}',
    b'{"model": "m", "prompt": "hi", "kv_transfer_params": {"conn": {"addr": "tcp://127.0.0.1:22"}}}',
    b'{"model": "m", "prompt": ""}',
    b'{"model": "m"}',
    b'{"model": "m", "prompt": "\\ud800"}',
    NESTED,
    b'{"model": "m", "prompt": ' + NESTED,
    b"not json",
    b"",
    b"[]",
    b'"a string"',
    b"\xff\xfe\x00",
]
CHAT_PROBES = [
    b'{"model": "m", "messages": [{"role": "user", "content": NaN}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
    b'{"model": "m", "messages": "hi"}',
    b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "image_feature", "image_feature": '
    b'{"url": "file:///x.npy", "grid_thw": [1, ' + b"9" * 4000 + b', 4]}}]}]}',
    b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [{}]}',
    NESTED,
]


def assert_error_object(reply: httpx.Response, where: str, statuses=range(400, 500)) -> dict:
    assert reply.status_code in statuses, f"{where}: {reply.status_code} {reply.text[:300]}"
    assert reply.headers["content-type"].startswith("application/json"), f"{where}: {reply.headers}"
    error = reply.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and isinstance(error["type"], str), where
    assert {"param", "code"} <= set(error), where
    return error


def test_malformed_bodies_are_4xx_error_objects_on_every_surface(fleet):
    with httpx.Client(timeout=30) as http:
        for name, url in targets(fleet).items():
            for path, probes in (("/v1/completions", COMPLETION_PROBES), ("/v1/chat/completions", CHAT_PROBES)):
                for body in probes:
                    reply = http.post(url + path, content=body, headers={"content-type": "application/json"})
                    assert_error_object(reply, f"{name} {path} {body[:60]!r}")


def test_malformed_http_is_a_400_error_object_on_every_surface(fleet):
    bad = [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\n\r\n",
           b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
           b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\x00b\r\n\r\n"]
    for name, url in targets(fleet).items():
        port = int(url.rpartition(":")[2])
        for raw in bad:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(raw)
                reply = b""
                while chunk := sock.recv(65536):
                    reply += chunk
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, (name, raw, reply[:300])
            assert json.loads(body)["error"]["code"] == 400, (name, raw)


def test_unknown_paths_and_wrong_methods_are_error_objects(fleet):
    with httpx.Client(timeout=10) as http:
        for name, url in targets(fleet).items():
            assert assert_error_object(http.get(url + "/v1/nope"), name, {404})["type"] == "not_found_error"
            assert_error_object(http.get(url + "/v1/completions"), name, {405})
            assert_error_object(http.delete(url + "/health"), name, {405})
            assert_error_object(http.post(url + "/../../etc/passwd", content=b"{}"), name, {404})


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
FIELDS = ["model", "prompt", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed",
          "logprobs", "stream", "stream_options", "stop_token_ids", "ignore_eos", "cache_salt", "user", "echo"]


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fields=st.dictionaries(st.sampled_from(FIELDS), JSON, max_size=6), target=st.sampled_from(
    ["plain", "dp", "decode", "unsigned", "router"]))
def test_random_bodies_never_get_a_5xx(fleet, fields, target):
    body = {"model": "m", "prompt": "hi", "max_tokens": 4, **fields}
    raw = json.dumps(body, allow_nan=True).encode()   # NaN and Infinity as Python writes them: a client may
    reply = httpx.post(targets(fleet)[target] + "/v1/completions", content=raw, timeout=60,
                       headers={"content-type": "application/json"})
    if reply.status_code != 200:
        assert_error_object(reply, f"{target} {raw[:200]!r}")


def test_data_parallel_rank_headers(fleet):
    servers, _ = fleet
    dp = servers["dp"]
    body = {"model": "m", "prompt": "hi", "max_tokens": 2}
    for rank in ["²", "9" * 5000, "-1", "1.0", "", "0x1", "7", "１"]:
        reply = httpx.post(dp.url + "/v1/completions", json=body, timeout=30,
                           headers={"X-Data-Parallel-Rank": rank.encode("utf-8")})
        assert assert_error_object(reply, f"rank {rank[:10]!r}", {400})["param"] == "X-Data-Parallel-Rank"
    for rank in ("0", "1"):
        assert httpx.post(dp.url + "/v1/completions", json=body, timeout=30,
                          headers={"X-Data-Parallel-Rank": rank}).status_code == 200


def test_forged_kv_transfer_params_never_make_a_decode_instance_connect(fleet):
    """Params a prefill instance really returned, their conn aimed at a listener of ours: the signed
    decode instance refuses them (signature), the unsigned one too (not a peer it named); neither
    connects, 30 times over, and neither engine keeps a descriptor. The real params work."""
    servers, _ = fleet
    prompt = {"model": "m", "prompt": [5, 9, 2], "max_tokens": 4}
    first = httpx.post(servers["prefill"].url + "/v1/completions", timeout=30,
                       json={**prompt, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
    params = first.json()["kv_transfer_params"]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.2)
    forged = {**params, "conn": {**params["conn"], "addr": f"tcp://127.0.0.1:{listener.getsockname()[1]}"}}
    forged.pop("sig", None)
    try:
        for name in ("decode", "unsigned"):
            server = servers[name]
            engine = server.engine_pid()
            before = fds(engine)
            for _ in range(30):
                reply = httpx.post(server.url + "/v1/completions", json={**prompt, "kv_transfer_params": forged},
                                   timeout=30)
                assert assert_error_object(reply, name, {400})["param"] == "kv_transfer_params"
            with pytest.raises(socket.timeout):
                listener.accept()
            assert fds(engine) <= before, name
    finally:
        listener.close()
    # the real params, from the peer it named: served (and the prefill instance lets go of its blocks)
    reply = httpx.post(servers["unsigned"].url + "/v1/completions", json={**prompt, "kv_transfer_params": params},
                       timeout=30)
    assert reply.status_code == 200, reply.text


# -- clients that leave, stall or never read ----------------------------------------------------------


def metric(url: str, name: str, **labels: str) -> float:
    """A metric's value (summed over the label sets that have ``labels``)."""
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        match = re.match(r"([^{ ]+)(\{[^}]*\})? (\S+)$", line)
        if match and match[1] == name and all(f'{k}="{v}"' in (match[2] or "") for k, v in labels.items()):
            total += float(match[3])
    return total


def idle(server: Server) -> bool:
    return (metric(server.url, "fdplug:num_requests_running") == 0
            and metric(server.url, "fdplug:num_requests_waiting") == 0
            and metric(server.url, "fdplug:kv_cache_usage_perc") == 0)


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def raw_request(port: int, path: str, body: dict, rcvbuf: int | None = None) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(10)
    sock.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return sock


def closed_by_peer(sock: socket.socket, timeout: float = 20) -> bool:
    """Read (and drop) what is buffered until the server's FIN or reset; False if it stays open."""
    deadline = time.monotonic() + timeout
    sock.settimeout(1)
    while time.monotonic() < deadline:
        try:
            if not sock.recv(1 << 20):
                return True
        except TimeoutError:
            continue
        except OSError:
            return True
    return False


def test_a_client_that_stops_reading_is_cut_off_and_its_request_aborted(fleet):
    servers, _ = fleet
    plain = servers["plain"]
    pid = plain.proc.pid
    wait_until(lambda: idle(plain), 60, 0.2, what="the plain instance idle before")   # (earlier tests' requests)
    before_fds, before_rss = fds(pid), rss_mb(pid)
    aborted = metric(plain.url, "fdplug:request_success_total", finished_reason="abort")
    body = {"model": "m", "prompt": "hello", "n": 32, "logprobs": 20, "max_tokens": 1900, "ignore_eos": True,
            "stream": True}
    socks = [raw_request(plain.port, "/v1/completions", body, rcvbuf=4096) for _ in range(2)]
    try:
        try:
            wait_until(lambda: metric(plain.url, "fdplug:request_success_total", finished_reason="abort")
                       >= aborted + 64, 120, 0.2, what="both unread streams aborted")
        except TimeoutError as exc:     # (what the server did, for whoever reads a failed run)
            raise AssertionError(f"{exc}; the server's log ends:\n{plain.log()[-4000:]}") from None
        peak = rss_mb(pid)
        wait_until(lambda: idle(plain), 30, 0.2, what="the plain instance idle")
        assert all(closed_by_peer(s) for s in socks), "the server kept a connection nobody reads"
    finally:
        for s in socks:
            s.close()
    # Bounded, not small: what piles up before the writes pause scales with how fast the engine makes
    # events (68-152 MB measured on the 2-core machine, run to run); unbounded it was 700+ MB in 40 s.
    assert peak - before_rss < 250, (before_rss, peak)
    wait_until(lambda: fds(pid) <= before_fds + 2, 10, what=f"descriptors back to {before_fds}")
    assert "the client stopped reading" in plain.log()


def test_unread_streams_are_cut_off_even_after_the_api_process_stalled(fleet):
    """The API process kept off its core while the engine runs on (stopped here for 4 s; on a busy
    2-core machine the engine's threads preempt it) finds the engine's outputs queued on its socket.
    Drained in one go, the unread streams' sequences finished before the backlog bound could act
    (0-32 of the 64 aborted; a CI run failed the test above on it); taken a message at a time, all are."""
    servers, _ = fleet
    plain = servers["plain"]
    wait_until(lambda: idle(plain), 60, 0.2, what="the plain instance idle before")
    reasons = {r: plain.finished(r) for r in ("abort", "length")}
    body = {"model": "m", "prompt": "hello", "n": 32, "logprobs": 20, "max_tokens": 400, "ignore_eos": True,
            "stream": True}
    socks = [raw_request(plain.port, "/v1/completions", body, rcvbuf=4096) for _ in range(2)]
    try:
        wait_until(lambda: metric(plain.url, "fdplug:num_requests_running") >= 2, 30, 0.01, what="both running")
        os.kill(plain.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(4)
        finally:
            os.kill(plain.proc.pid, signal.SIGCONT)
        wait_until(lambda: sum(map(plain.finished, reasons)) >= sum(reasons.values()) + 64, 60, 0.2,
                   what="every sequence ended")
        assert plain.finished("abort") == reasons["abort"] + 64
        wait_until(lambda: idle(plain), 30, 0.2, what="the plain instance idle")
    finally:
        for s in socks:
            s.close()


def test_a_client_that_leaves_the_router_aborts_its_request_on_the_decode_instance(fleet):
    servers, router = fleet
    decode = servers["decode"]
    aborted = metric(decode.url, "fdplug:request_success_total", finished_reason="abort")
    for stream in (False, True):
        body = {"model": "m", "prompt": "hello", "max_tokens": 1900, "ignore_eos": True, "stream": stream}
        sock = raw_request(router.port, "/v1/completions", body)
        wait_until(lambda: metric(decode.url, "fdplug:num_requests_running") == 1, 30, 0.05,
                   what="the request decoding")
        sock.close()
        wait_until(lambda a=aborted: metric(decode.url, "fdplug:request_success_total", finished_reason="abort") > a,
                   10, 0.05, what=f"the decode instance aborting it (stream={stream})")
        aborted = metric(decode.url, "fdplug:request_success_total", finished_reason="abort")
        wait_until(lambda: idle(decode), 10, 0.1, what="the decode instance idle")


def test_slowloris_and_huge_headers(fleet):
    servers, _ = fleet
    plain = servers["plain"]
    pid = plain.proc.pid
    before = fds(pid)
    idle_socks = [socket.create_connection(("127.0.0.1", plain.port), timeout=10) for _ in range(300)]
    partial = socket.create_connection(("127.0.0.1", plain.port), timeout=10)
    partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Le")
    short_body = socket.create_connection(("127.0.0.1", plain.port), timeout=10)
    short_body.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nabc")
    try:
        assert all(closed_by_peer(s, 15) for s in idle_socks + [partial, short_body])
    finally:
        for s in idle_socks + [partial, short_body]:
            s.close()
    wait_until(lambda: fds(pid) <= before + 2, 10, what=f"descriptors back to {before}")

    big = socket.create_connection(("127.0.0.1", plain.port), timeout=10)
    sent, started = 0, time.monotonic()
    health_times: list[float] = []

    def probe_health() -> None:
        t = time.monotonic()
        assert httpx.get(plain.url + "/health", timeout=10).status_code == 200
        health_times.append(time.monotonic() - t)

    try:
        big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk = b"a" * (1 << 20)
        while sent < 32 << 20:
            big.sendall(chunk)
            sent += len(chunk)
            if sent == 4 << 20:
                threading.Thread(target=probe_health).start()
    except OSError:
        pass            # the server answered and closed early: what we want
    reply = b""
    try:
        big.settimeout(5)
        while chunk := big.recv(65536):
            reply += chunk
    except OSError:
        pass
    finally:
        big.close()
    assert reply.startswith(b"HTTP/1.1 431") or reply == b"", reply[:200]
    if reply:
        assert json.loads(reply.split(b"\r\n\r\n", 1)[1])["error"]["code"] == 431
    wait_until(lambda: health_times, 10, what="/health answered while the header came")
    assert health_times[0] < 5, health_times
    assert time.monotonic() - started < 30


def test_every_surface_closes_idle_connections_and_refuses_huge_heads(fleet):
    """The same per-connection bounds on every surface (default idle timeout 5 s, except the plain
    instance's 1 s): idle connections closed, a 128 KiB header a 431 error object."""
    sockets = {name: [socket.create_connection(("127.0.0.1", int(url.rpartition(":")[2])), timeout=10)
                      for _ in range(20)] for name, url in targets(fleet).items()}
    try:
        for name, url in targets(fleet).items():
            with socket.create_connection(("127.0.0.1", int(url.rpartition(":")[2])), timeout=10) as big:
                try:
                    big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * (128 << 10) + b"\r\n\r\n")
                except OSError:
                    pass        # refused before the whole head was sent
                reply = b""
                try:
                    while chunk := big.recv(65536):
                        reply += chunk
                except ConnectionResetError:
                    pass
            head, _, body = reply.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 431"), (name, reply[:200])
            assert json.loads(body)["error"]["code"] == 431, name
        for name, socks in sockets.items():
            assert all(closed_by_peer(s, 15) for s in socks), f"{name} kept an idle connection"
    finally:
        for socks in sockets.values():
            for s in socks:
                s.close()


def test_afterwards_every_instance_is_idle_and_kept_no_descriptor_or_memory(fleet):
    servers, router = fleet
    for name, server in servers.items():
        wait_until(lambda s=server: idle(s), 30, 0.2, what=f"{name} idle")
    assert metric(router.url, "fdplug_router:in_flight") == 0
    assert metric(router.url, "fdplug_router:requests_in_flight") == 0
    for name, process in [*servers.items(), ("router", router)]:
        before_fds, before_rss = process.baseline
        pid = process.proc.pid
        wait_until(lambda p=pid, b=before_fds: fds(p) <= b + 4, 10, what=f"{name}'s descriptors back to {before_fds}")
        # The plain instance's growth over this file's traffic, measured: 56-101 MB run alone (and 72-94 MB
        # on b6584b3, before the decoder stack: the same), 152 and 176 MB in two full-suite runs: glibc
        # keeps the freed output buffers of the clients that stopped reading. A leak of the requests
        # themselves (hundreds in this file, with their outputs) would pass 250.
        assert rss_mb(pid) - before_rss < 250, (name, before_rss, rss_mb(pid))


def test_a_dead_data_parallel_engine_named_by_the_header_is_a_503(fleet):
    servers, _ = fleet
    dp = servers["dp"]
    children = []
    for task in Path(f"/proc/{dp.proc.pid}/task").iterdir():
        children += (task / "children").read_text().split()
    ranks = {e["pid"]: e["rank"] for e in httpx.get(dp.url + "/health", timeout=5).json()["engines"]}
    victim = next(int(pid) for pid in children if ranks.get(int(pid)) == 1)
    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: httpx.get(dp.url + "/health", timeout=5).json().get("status") == "degraded", 30,
               what="the server noticing the dead engine")
    reply = httpx.post(dp.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2}, timeout=30,
                       headers={"X-Data-Parallel-Rank": "1"})
    assert_error_object(reply, "dead rank", {503})
    assert httpx.post(dp.url + "/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2},
                      timeout=30).status_code == 200


# -- SIGTERM drains -----------------------------------------------------------------------------------


def run_streams(client: openai.OpenAI, count: int, tokens: int, started: threading.Semaphore) -> list:
    """``count`` streams of ``tokens`` tokens in threads; each result is its text's token count or the error."""
    def one(i: int):
        try:
            stream = client.completions.create(model="m", prompt=f"stream {i}", max_tokens=tokens, temperature=0,
                                               stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True})
            started.release()               # the 200 came: admitted
            finish, usage = None, None
            for chunk in stream:
                if chunk.choices:
                    finish = chunk.choices[0].finish_reason or finish
                usage = chunk.usage or usage
            return usage.completion_tokens, finish
        except openai.APIError as exc:
            return exc

    pool = ThreadPoolExecutor(count)
    return [pool.submit(one, i) for i in range(count)]


def check_refusing_while_draining(url: str) -> None:
    wait_until(lambda: status(url + "/health") == 503, 10, 0.02, what="/health 503 while draining")
    reply = httpx.post(url + "/v1/completions", json={"model": "m", "prompt": "late", "max_tokens": 2}, timeout=10)
    assert_error_object(reply, "a request while draining", {503})


def sigterm_during_streams(client: openai.OpenAI, proc, count: int, tokens: int, after_signal=None) -> list:
    """``count`` streams admitted (each answered 200: a server admits before it answers), then SIGTERM
    to ``proc``, then ``after_signal()``. Each stream's (tokens, finish_reason), or its error."""
    started = threading.Semaphore(0)
    futures = run_streams(client, count, tokens, started)
    for _ in range(count):
        assert started.acquire(timeout=60)
    proc.send_signal(signal.SIGTERM)
    if after_signal is not None:
        after_signal()
    return [f.result(timeout=120) for f in futures]


def aborted_by_the_stop(results: list) -> list:
    errors = [r for r in results if isinstance(r, openai.APIError)]
    assert errors and all("shutting down" in str(e) for e in errors), results
    return errors


@pytest.mark.parametrize("engines", [1, 2])
def test_sigterm_lets_streams_in_flight_finish_then_exits_0(test_model_dir, tmp_path, engines):
    server = Server(["--model", str(test_model_dir), *ARGS, "--max-num-seqs", "2", "--data-parallel-size",
                     str(engines)], tmp_path / "drain.log")
    try:
        server.wait_ready()
        results = sigterm_during_streams(server.openai(), server.proc, 8, 200,
                                         lambda: check_refusing_while_draining(server.url))
        server.proc.wait(30)          # it exits by itself once drained
    finally:
        code = server.stop()
    assert results == [(200, "length")] * 8, results
    assert code == 0, server.log()
    assert "drained: no requests in flight" in server.log()


def test_sigterm_with_a_short_shutdown_timeout_aborts_the_rest_and_exits_0(test_model_dir, tmp_path):
    server = Server(["--model", str(test_model_dir), *ARGS, "--max-num-seqs", "1", "--shutdown-timeout", "1"],
                    tmp_path / "abort.log")
    try:
        server.wait_ready()
        aborted_by_the_stop(sigterm_during_streams(server.openai(), server.proc, 8, 1500))
    finally:
        code = server.stop()
    assert code == 0, server.log()


def test_a_request_still_uploading_at_sigterm_is_served(test_model_dir, tmp_path):
    """It arrived before the signal: in flight from its first byte, so the drain waits for it."""
    server = Server(["--model", str(test_model_dir), *ARGS], tmp_path / "upload.log")
    try:
        server.wait_ready()
        body = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 3}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(body) + body[:10])
            time.sleep(0.2)
            server.proc.send_signal(signal.SIGTERM)
            check_refusing_while_draining(server.url)
            sock.sendall(body[10:])
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:300]
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["usage"]["completion_tokens"] == 3
        server.proc.wait(30)
    finally:
        code = server.stop()
    assert code == 0, server.log()


def test_a_second_sigterm_stops_at_once(test_model_dir, tmp_path):
    """Four long streams on one slot (seconds of work), the default 25 s drain: the second signal
    aborts them and the server exits 0 without waiting out the drain."""
    server = Server(["--model", str(test_model_dir), *ARGS, "--max-num-seqs", "1"], tmp_path / "twice.log")
    try:
        server.wait_ready()
        aborted_by_the_stop(sigterm_during_streams(server.openai(), server.proc, 4, 1900,
                                                   lambda: (time.sleep(0.2), server.proc.send_signal(signal.SIGTERM))))
    finally:
        code = server.stop(timeout=15)
    assert code == 0, server.log()
    assert "again: stopping now" in server.log()


@pytest.mark.parametrize("timeout", [None, "0.2"])
def test_the_router_drains_too(fleet, tmp_path, timeout):
    """Default: both streams finish, new requests and /health 503 meanwhile. With a 0.2 s timeout the
    streams still running end with an error event (even a silent one: the abort races each chunk)."""
    servers, _ = fleet
    router = start_router(servers["prefill"].url, servers["decode"].url, tmp_path / "router.log",
                          *(["--shutdown-timeout", timeout] if timeout else []))
    try:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        results = sigterm_during_streams(client, router.proc, 2, 1900,
                                         None if timeout else lambda: check_refusing_while_draining(router.url))
        router.proc.wait(30)          # it exits by itself once drained
    finally:
        code = router.stop()
    if timeout:
        aborted_by_the_stop(results)
    else:
        assert results == [(1900, "length")] * 2, results
    assert code == 0
