"""A decode instance connects only where a prefill instance it trusts listens, and a pull leaves nothing open.

``kv_transfer_params`` come from the client, ``conn`` with them: without ``FDPLUG_PD_SECRET`` (no
signature proves a prefill instance wrote them) a decode instance must name the prefill instances'
KV endpoints (``--kv-peers``), or it does not start. A conn naming another address, a path that is
not a prefill instance's shared-memory arena, or fields its connector does not make is a 400
naming ``kv_transfer_params`` before any socket exists (a listening socket counts the connections
it gets: none). A named peer, by address or by host name, fixed with ``--kv-port`` on the prefill
side (data-parallel engines: the next free port), serves the same tokens as one engine. Pulls that
fail (nothing listening, a peer that never answers, one that hangs up, an abort) close their
sockets: the process's descriptors come back to where they were, and no connection is attempted
after a failure. Real engines, connectors and sockets throughout.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fdplug.core.frontend.llm import LLM
from fdplug.core.kv_endpoints import parse_endpoints
from fdplug.core.kv_transfer.peers import PORT_SPAN, resolve_peers
from fdplug.core.kv_transfer.shm import MIN_ARENA_BYTES, ShmReceiver
from fdplug.errors import ConfigError, InvalidRequestError
from fdplug.plugin_api.kv_connector import KVCaches
from fdplug.plugin_api.sampling_params import SamplingParams
from tests.conftest import subprocess_env, write_test_model
from tests.serverkit import free_port
from tests.test_pd_engine import drive, finished, request

PROMPT = [5, 9, 2, 6, 1, 4, 8, 3, 2, 7, 7, 7, 1, 2, 3, 4, 5, 6, 7]
ARGS = {"num_kv_blocks": 96, "max_model_len": 128, "block_size": 16}
TOKENS = 6
FDPLUG = str(Path(sys.executable).parent / "fdplug")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(write_test_model(tmp_path_factory.mktemp("peers") / "m"))


@pytest.fixture(autouse=True)
def _no_secret(monkeypatch):
    for name in ("FDPLUG_PD_SECRET", "FDPLUG_KV_PEERS", "FDPLUG_KV_PORT"):
        monkeypatch.delenv(name, raising=False)


def endpoint(llm: LLM) -> str:
    return llm.engine.kv_transfer.sender.address.removeprefix("tcp://")


def prefill_params(prefill: LLM, rid: str = "p") -> dict:
    eos = prefill.model_config.eos_token_ids
    prefill.engine.add_request(request(rid, PROMPT, 1, eos, {"do_remote_decode": True}))
    return next(o for o in drive([prefill.engine], finished([rid]))[rid] if o.finished).kv_transfer_params


class Listener:
    """A plain TCP socket that counts the connections it accepts; ``mode``: ``hold`` (keep them
    open, say nothing: a peer that never answers) or ``hangup`` (close each at once)."""

    def __init__(self, mode: str = "hold") -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.port, self.mode = self.sock.getsockname()[1], mode
        self.accepted = 0
        self.held: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            if self.mode == "hold":
                self.held.append(conn)
            else:
                conn.close()

    def drop_held(self) -> None:
        for conn in self.held:
            conn.close()
        self.held.clear()

    def close(self) -> None:
        self.drop_held()
        self.sock.close()


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def settle(target: int, timeout: float = 5.0) -> int:
    """The descriptor count once ZMQ's reaper has closed what was closed (it does so off-thread)."""
    deadline = time.monotonic() + timeout
    count = open_fds()
    while count > target and time.monotonic() < deadline:
        time.sleep(0.05)
        count = open_fds()
    return count


# --- startup ---------------------------------------------------------------------------------------


def serve_decode(model: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    """``fdplug serve --role decode`` as a user runs it; it must stop before loading anything."""
    return subprocess.run([FDPLUG, "serve", "--model", model, "--role", "decode", "--port", "0"], check=False,
                          capture_output=True, text=True, timeout=120, env=env)


def test_a_decode_instance_without_the_secret_or_peers_does_not_start(model):
    with pytest.raises(ConfigError) as caught:
        LLM(model, kv_role="decode", **ARGS)
    assert "--kv-peers" in caught.value.fix and "FDPLUG_PD_SECRET" in caught.value.fix
    for bad in (["10.0.0.5"], ["10.0.0.5:0"], ["host:70000"], ["a b:1"], ["10.0.0.5:9-3"], ["[10.0.0.5]:1"],
                ["10.0.0.5:1;x"], ["10.0.0.5:1-9000"], [3]):
        with pytest.raises(ConfigError, match="kv_peers"):
            LLM(model, kv_role="decode", kv_peers=bad, **ARGS)
    with pytest.raises(ConfigError, match="kv_port"):
        LLM(model, kv_role="prefill", kv_port=70000, **ARGS)
    out = serve_decode(model, subprocess_env())
    assert out.returncode == 1, out.stderr
    assert "error: a decode instance without FDPLUG_PD_SECRET" in out.stderr
    assert ("fix: set the same FDPLUG_PD_SECRET on prefill and decode, or name the prefill instances' KV endpoints "
            "with --kv-peers") in out.stderr
    assert "Traceback" not in out.stderr
    out = serve_decode(model, subprocess_env(FDPLUG_KV_PEERS="10.0.0.5:5600,nonsense"))
    assert out.returncode == 1 and "FDPLUG_KV_PEERS" in out.stderr and "nonsense" in out.stderr, out.stderr


def test_peer_specs_name_endpoints_without_asking_a_client_address_anything():
    assert parse_endpoints("10.0.0.5:5600-5602") == [("10.0.0.5", 5600), ("10.0.0.5", 5601), ("10.0.0.5", 5602)]
    assert parse_endpoints("[::FFFF:1]:7") == [("::ffff:1", 7)] and parse_endpoints("Prefill-1.LAN:9") == [
        ("prefill-1.lan", 9)]
    assert ("127.0.0.1", 5600) in resolve_peers(["localhost:5600"])       # a name: resolved once, at startup
    assert ("localhost", 5600) in resolve_peers(["localhost:5600"])


# --- admission ---------------------------------------------------------------------------------------


def test_unsigned_params_aimed_at_another_address_are_a_400_and_nothing_connects(model):
    prefill = LLM(model, kv_role="prefill", **ARGS)
    decode = LLM(model, kv_role="decode", kv_peers=(endpoint(prefill),), **ARGS)
    eos = prefill.model_config.eos_token_ids
    params = prefill_params(prefill)
    listener = Listener()
    try:
        port, own = listener.port, endpoint(prefill).rpartition(":")[2]
        for addr in (f"tcp://127.0.0.1:{port}", f"tcp://localhost:{port}", f"tcp://[::1]:{port}",
                     f"tcp://localhost:{own}",                      # its peer's port, by a name: never looked up
                     f"tcp://127.0.0.1:{port}\n", f"tcp://0x7f.1:{port}", "tcp://10.0.0.1:22", "http://127.0.0.1/",
                     f"tcp://{endpoint(prefill)}/x", f"tcp://eth0;{endpoint(prefill)}", None, 7):
            forged = {**params, "conn": {**params["conn"], "addr": addr}}
            with pytest.raises(InvalidRequestError) as caught:
                decode.engine.add_request(request("forged", PROMPT, TOKENS, eos, forged))
            assert caught.value.param == "kv_transfer_params" and "conn" in caught.value.message, addr
        with pytest.raises(InvalidRequestError, match="--kv-peers"):
            decode.engine.add_request(request("forged", PROMPT, TOKENS, eos, {**params, "conn": {
                **params["conn"], "addr": f"tcp://127.0.0.1:{port}"}}))
        for _ in range(20):
            decode.engine.step()
        time.sleep(0.3)
        assert listener.accepted == 0 and not decode.engine.kv_transfer.receiver.pulls
        assert not decode.engine.scheduler.requests
        decode.engine.add_request(request("real", PROMPT, TOKENS, eos, params))        # its named peer: served
        got = drive([prefill.engine, decode.engine], finished(["real"]))
        assert got["real"][-1].finish_reason == "length" and listener.accepted == 0
    finally:
        listener.close()


def test_conn_fields_a_connector_does_not_make_are_refused_before_any_io(model):
    """The shm connector's arena path, the transfer id, the block count, extra fields: only what
    its sender makes; a path outside /dev/shm's fdplug arenas is never opened."""
    prefill = LLM(model, kv_role="prefill", **ARGS)
    decode = LLM(model, kv_role="decode", kv_peers=(endpoint(prefill),), **ARGS)
    eos = prefill.model_config.eos_token_ids
    params = prefill_params(prefill)
    assert params["connector"] == "shm" and params["conn"]["shm"].startswith("/dev/shm/fdplug-kv-")
    hexid = "0" * 32
    bad_conns = [{"shm": path} for path in (
        "/etc/passwd", "/dev/shm/../../etc/passwd", f"/dev/shm/fdplug-kv-1-{hexid}/../../../etc/passwd",
        f"/dev/shm/fdplug-kv-1-{hexid}\n", f"/dev/shm//fdplug-kv-1-{hexid}", f"/tmp/fdplug-kv-1-{hexid}",
        "/dev/shm/fdplug-kv-1-" + "g" * 32, "/proc/self/mem", 5, ["/dev/shm"])]
    bad_conns += [{"transfer_id": tid} for tid in ("../x", "0" * 31, "A" * 32, "0" * 32 + "\n")]
    bad_conns += [{"num_blocks": n} for n in (-1, 0, True, 1 << 40, "2")]
    bad_conns += [{"path": "/etc/passwd"}, {"via": "shm"}]
    for change in bad_conns:
        forged = {**params, "conn": {**params["conn"], **change}}
        with pytest.raises(InvalidRequestError) as caught:
            decode.engine.add_request(request("forged", PROMPT, TOKENS, eos, forged))
        assert caught.value.param == "kv_transfer_params", change
    assert not decode.engine.scheduler.requests and not decode.engine.kv_transfer.receiver.maps


def test_the_arena_a_conn_names_is_read_only_when_its_sender_owns_it_and_it_is_ours(model, tmp_path):
    """Another prefill instance's arena named in a conn to the first: the first answers over TCP,
    the named arena is never mapped. Where /dev/shm holds a link, or a file others may read, under
    an arena's name, the receiver does not map it."""
    prefill, other = LLM(model, kv_role="prefill", **ARGS), LLM(model, kv_role="prefill", **ARGS)
    decode = LLM(model, kv_role="decode", kv_peers=(endpoint(prefill), endpoint(other)), **ARGS)
    eos = prefill.model_config.eos_token_ids
    params = prefill_params(prefill)
    elsewhere = prefill_params(other, "o")["conn"]["shm"]
    forged = {**params, "conn": {**params["conn"], "shm": elsewhere}}
    decode.engine.add_request(request("d", PROMPT, TOKENS, eos, forged))
    got = drive([prefill.engine, decode.engine], finished(["d"]))
    assert got["d"][-1].finish_reason == "length"
    receiver = decode.engine.kv_transfer.receiver
    assert elsewhere not in receiver.maps and not receiver.maps         # served over TCP, nothing mapped
    target = tmp_path / "secret.bin"
    target.write_bytes(b"not an arena")
    link = Path(f"/dev/shm/fdplug-kv-{os.getpid()}-{'c' * 32}")
    loose = Path(f"/dev/shm/fdplug-kv-{os.getpid()}-{'d' * 32}")
    try:
        link.symlink_to(target)
        loose.write_bytes(b"\0" * MIN_ARENA_BYTES)
        loose.chmod(0o644)
        fresh = ShmReceiver(KVCaches(receiver.caches, receiver.layout, ARGS["block_size"]))
        assert fresh._arena(str(link)) is None and fresh._arena(str(loose)) is None and not fresh.maps
        fresh.close()
    finally:
        link.unlink(missing_ok=True)
        loose.unlink(missing_ok=True)


def test_signed_params_are_trusted_and_peers_narrow_them_further(model, monkeypatch):
    monkeypatch.setenv("FDPLUG_PD_SECRET", "shared")
    prefill = LLM(model, kv_role="prefill", **ARGS)
    trusting = LLM(model, kv_role="decode", **ARGS)                               # the secret alone
    narrow = LLM(model, kv_role="decode", kv_peers=(f"127.0.0.1:{free_port()}",), **ARGS)
    eos = prefill.model_config.eos_token_ids
    params = prefill_params(prefill)
    assert "sig" in params
    with pytest.raises(InvalidRequestError, match="--kv-peers"):
        narrow.engine.add_request(request("d", PROMPT, TOKENS, eos, params))
    trusting.engine.add_request(request("d", PROMPT, TOKENS, eos, params))
    assert drive([prefill.engine, trusting.engine], finished(["d"]))["d"][-1].finish_reason == "length"


# --- a named peer --------------------------------------------------------------------------------------


def two_free_ports() -> int:
    """A port that is free on 127.0.0.1 and whose next one is too."""
    for _ in range(50):
        port = free_port()
        if port % 8 != 7:   # (its next one in the same run of 8: this xdist worker's too, serverkit._own_ports)
            with socket.socket() as probe:
                try:
                    probe.bind(("127.0.0.1", port + 1))
                except OSError:
                    continue
            return port
    raise AssertionError("no two free ports in a row")


def test_a_prefill_instance_at_a_fixed_port_named_by_host_name_serves_as_one_engine(model, monkeypatch):
    want = LLM(model, **ARGS).generate([{"prompt_token_ids": PROMPT}], SamplingParams(
        temperature=0, max_tokens=TOKENS, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids
    port = two_free_ports()
    monkeypatch.setenv("FDPLUG_KV_PORT", str(port))
    prefill = LLM(model, kv_role="prefill", **ARGS)
    second = LLM(model, kv_role="prefill", **ARGS)      # a second engine of the host: the next free port
    assert endpoint(prefill) == f"127.0.0.1:{port}" and endpoint(second) == f"127.0.0.1:{port + 1}"
    assert PORT_SPAN >= 2
    monkeypatch.setenv("FDPLUG_KV_PEERS", f"localhost:{port}-{port + 1}")
    decode = LLM(model, kv_role="decode", **ARGS)
    eos = prefill.model_config.eos_token_ids
    for rid, source, at in (("a", prefill, port), ("b", second, port + 1)):
        params = prefill_params(source, rid)
        assert params["conn"]["addr"] == f"tcp://127.0.0.1:{at}"
        decode.engine.add_request(request(rid, PROMPT, TOKENS, eos, params))
        got = drive([source.engine, decode.engine], finished([rid]))
        assert [t for o in got[rid] for t in o.new_token_ids] == want
    assert not decode.engine.kv_transfer.receiver.pulls


# --- descriptors ---------------------------------------------------------------------------------------


def test_failed_and_aborted_pulls_close_every_socket_and_never_reconnect(model, monkeypatch):
    """30 pulls each against a port where nothing listens, a peer that accepts and never answers,
    and one that hangs up at once; then 30 aborted while they wait: every request fails (or is
    aborted) alone, the descriptors come back to the count before, and no connection is made after."""
    monkeypatch.setenv("FDPLUG_KV_STALL_TIMEOUT", "0.5")
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    dead = holder.getsockname()[1]
    holder.close()                                       # nothing listens there now
    silent, hangup = Listener("hold"), Listener("hangup")
    prefill = LLM(model, kv_role="prefill", **ARGS)
    decode = LLM(model, kv_role="decode", kv_peers=(f"127.0.0.1:{dead}", f"127.0.0.1:{silent.port}",
                                                    f"127.0.0.1:{hangup.port}"), **ARGS)
    eos = prefill.model_config.eos_token_ids
    params = prefill_params(prefill)
    receiver = decode.engine.kv_transfer.receiver
    counter = iter(range(1, 1 << 20))

    def pulls(port: int, n: int) -> list[str]:
        ids = []
        for _ in range(n):
            i = next(counter)
            ids.append(f"r{i}")
            conn = {**params["conn"], "addr": f"tcp://127.0.0.1:{port}", "transfer_id": f"{i:032x}"}
            decode.engine.add_request(request(ids[-1], PROMPT, TOKENS, eos, {**params, "conn": conn}))
        return ids

    try:
        ids = pulls(dead, 1) + pulls(silent.port, 1)       # warm-up: ZMQ's context and I/O threads exist now
        drive([decode.engine], finished(ids), timeout=10)
        silent.drop_held()
        before = settle(0, timeout=0.5)
        report = {}
        for name, target in (("nothing listening", dead), ("never answers", silent), ("hangs up", hangup)):
            port = target if isinstance(target, int) else target.port
            accepted = 0 if isinstance(target, int) else target.accepted
            ids = pulls(port, 30)
            got = drive([decode.engine], finished(ids), timeout=20)
            assert all(got[r][-1].error["type"] == "KVTransferError" for r in ids), name
            assert not receiver.pulls
            if not isinstance(target, int):
                made = target.accepted - accepted
                assert 0 < made <= 30, f"{name}: {made} connections for 30 pulls"
                target.drop_held()
                time.sleep(1.0)                           # ZMQ's default would have reconnected 10 times by now
                assert target.accepted - accepted == made, f"{name}: connections after the pulls failed"
            report[name] = settle(before)
            assert report[name] <= before, f"{name}: {report[name] - before} descriptors left open"
        accepted, ids = silent.accepted, pulls(silent.port, 30)
        deadline = time.monotonic() + 5
        while silent.accepted < accepted + 30:            # every pull connected, none answered yet
            assert time.monotonic() < deadline, f"{silent.accepted - accepted} of 30 pulls connected"
            decode.engine.step()
        assert len(receiver.pulls) == 30
        decode.engine.abort_requests(ids)                 # the clients went away mid-pull
        assert not receiver.pulls and not decode.engine.scheduler.requests
        silent.drop_held()
        report["aborted"] = settle(before)
        assert report["aborted"] <= before, f"aborted: {report['aborted'] - before} descriptors left open"
        print(f"open descriptors: {before} before; after 30 failed pulls each: {report}")
        assert decode.engine.scheduler.kv_cache_manager.usage == 0.0
    finally:
        silent.close(), hangup.close()
