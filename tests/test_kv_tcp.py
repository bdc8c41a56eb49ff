"""The built-in ``tcp`` and ``shm`` connectors' wire (`fdplug.core.kv_transfer.tcp`), beyond the
conformance kit's transfer tests (``fdplug/testing/test_kv_connector.py``, run on both).

Blocks offered from an ``HBTD`` cache land bit for bit in a ``BTHD`` cache (float32 and bf16): a
layer travels in the sender's layout and the receiver transposes it. ``shm`` reads the prefill
side's shared-memory arena when it is on this machine and pulls over TCP when it is not (or the
arena is full); stale arenas are removed. A peer that sends a layer of the wrong shape fails its transfer without
writing.
"""

from __future__ import annotations

import time
from pathlib import Path

import msgpack
import numpy as np
import paddle
import pytest
import zmq

from fdplug.core.kv_transfer.shm import ShmReceiver, ShmSender, remove_stale_arenas
from fdplug.core.kv_transfer.tcp import TCPSender
from fdplug.core.kv_transfer.tcp_receiver import TCPReceiver
from fdplug.core.portable.kv_blocks import gather_blocks
from fdplug.plugin_api.kv_connector import KVCaches

LAYERS, BLOCKS, TOKENS, HEADS, DIM = 3, 10, 4, 2, 8


def caches(layout: str, dtype: str, seed: int | None) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
    shape = [{"B": BLOCKS, "T": TOKENS, "H": HEADS, "D": DIM}[a] for a in layout]
    rng = np.random.default_rng(seed)
    make = (lambda: paddle.zeros(shape, dtype)) if seed is None else \
        (lambda: paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype(dtype))
    return [(make(), make()) for _ in range(LAYERS)]


def run(sender, receiver, timeout: float = 10.0):
    """Poll both sides until the receiver reports something (bounded)."""
    deadline, sent = time.monotonic() + timeout, set()
    while time.monotonic() < deadline:
        if sender is not None:
            sent |= sender.poll()
        done, failed = receiver.poll()
        if done or failed:
            return done, failed, sent | (sender.poll() if sender else set())
        time.sleep(0.001)
    raise TimeoutError("the transfer neither finished nor failed")


def same(source, target, source_ids, target_ids, source_layout="HBTD", target_layout="BTHD") -> None:
    for (sk, sv), (tk, tv) in zip(source, target):
        for s, t in ((sk, tk), (sv, tv)):
            want = gather_blocks(s, source_layout, source_ids).astype("float32").numpy()
            np.testing.assert_array_equal(gather_blocks(t, target_layout, target_ids).astype("float32").numpy(), want)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_land_bit_for_bit_across_layouts(dtype):
    source, target = caches("HBTD", dtype, seed=0), caches("BTHD", dtype, seed=None)
    sender, receiver = TCPSender(source, "HBTD"), TCPReceiver(target, "BTHD")
    try:
        conn = sender.offer([7, 2, 5, 9])
        receiver.pull(conn, [0, 3, 1], first_block=1)           # the first block: a prefix hit here
        done, failed, sent = run(sender, receiver)
        assert done == {conn["transfer_id"]} and not failed and sent == {conn["transfer_id"]}
        same(source, target, [2, 5, 9], [0, 3, 1])
        assert not sender.offers                                # held until pulled, then released
    finally:
        sender.close(), receiver.close()


def test_shm_reads_the_arena_here_and_pulls_over_tcp_otherwise(tmp_path, monkeypatch):
    """On this machine the blocks come through the arena (one extent, released after the copy);
    a conn naming an arena that is not here, or a full arena, gives the tcp path; a killed prefill
    process's arena is removed by the next one; bad addresses are refused."""
    source, target = caches("HBTD", "float32", seed=1), caches("BTHD", "float32", seed=None)
    sender = ShmSender(KVCaches(source, "HBTD", TOKENS), 32 << 20)
    receiver = ShmReceiver(KVCaches(target, "BTHD", TOKENS))
    try:
        conn = sender.offer([1, 2])
        assert (conn["shm"].startswith("/dev/shm/fdplug-kv-")
                and receiver._pull_options(conn) == {"via": "shm", "arena": conn["shm"]})
        receiver.pull(conn, [3, 4])
        assert run(sender, receiver)[0] == {conn["transfer_id"]} and list(receiver.maps) == [conn["shm"]]
        wait = time.monotonic() + 5
        while sender.staged and time.monotonic() < wait:      # the extent comes back once read
            sender.poll()
        assert not sender.staged and sender.arena.free == [(0, sender.arena.map.size())]
        far = sender.offer([5, 6])                             # as if from another machine: no such arena here
        receiver.pull({**far, "shm": "/dev/shm/fdplug-kv-1-" + "0" * 32}, [7, 8])
        assert run(sender, receiver)[0] == {far["transfer_id"]} and not sender.staged
        monkeypatch.setattr(sender.arena, "allocate", lambda nbytes: None)    # full: the socket instead
        full = sender.offer([8, 9])
        receiver.pull(full, [0, 1])
        assert run(sender, receiver)[0] == {full["transfer_id"]} and not sender.staged
        same(source, target, [1, 2, 5, 6, 8, 9], [3, 4, 7, 8, 0, 1])
        for bad in ({"addr": "http://example.com/"}, {}):
            with pytest.raises(ValueError, match="not a tcp://host:port address"):
                receiver.pull({"transfer_id": "e" * 32, **bad}, [0])
    finally:
        sender.close(), receiver.close()
    assert not Path(conn["shm"]).exists()
    stale = Path(f"/dev/shm/fdplug-kv-{dead_pid()}-{'a' * 32}")
    stale.write_bytes(b"left by a killed prefill process")
    remove_stale_arenas()
    assert not stale.exists()


def dead_pid() -> int:
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_layer_that_does_not_fit_fails_its_transfer_and_writes_nothing():
    target = caches("HBTD", "float32", seed=None)
    receiver = TCPReceiver(target, "HBTD")
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    try:
        tid = "b" * 32
        receiver.pull({"addr": f"tcp://127.0.0.1:{port}", "transfer_id": tid, "num_blocks": 2}, [4, 5])
        identity, _ = rogue.recv_multipart()
        big = np.ones((HEADS, 3, TOKENS, DIM), np.float32)      # three blocks for a two-block pull
        header = msgpack.packb({"v": 1, "op": "layer", "transfer_id": tid, "layer": 0, "dtype": "paddle.float32",
                                "layout": "HBTD", "shape": [HEADS, 3, TOKENS, DIM]})
        rogue.send_multipart([identity, header, big, big])
        _, failed, _ = run(None, receiver)
        assert "expected paddle.float32 [2, 2, 4, 8]" in failed[tid]
        assert not receiver.pulls                                # its socket closed with it
        assert not any(cache.numpy().any() for pair in target for cache in pair)
    finally:
        rogue.close(0), receiver.close()


def test_a_pull_whose_sender_refused_before_the_send_fails_at_the_next_poll(monkeypatch):
    """The receiver's one connection attempt may be refused (the sender gone) before the pull is sent
    (ZMQ connects in its I/O thread): the send then has no pipe and fails at once. That pull fails
    through ``poll`` like one whose sender died later, nothing written; cancelling it forgets it."""
    target = caches("HBTD", "float32", None)
    receiver = TCPReceiver(target, "HBTD")
    real_connect = receiver._connect

    def refused_at_once(address):
        socket = real_connect(address)
        socket.close(0)                             # a socket whose send fails as a pipe-less one's does
        return socket

    monkeypatch.setattr(receiver, "_connect", refused_at_once)
    conn = {"addr": "tcp://127.0.0.1:9", "transfer_id": "c" * 32, "num_blocks": 2}
    receiver.pull(conn, [1, 2])
    with pytest.raises(ValueError, match="already being pulled"):
        receiver.pull(conn, [1, 2])
    done, failed = receiver.poll()
    assert not done and "could not be reached" in failed["c" * 32] and receiver.poll() == (set(), {})
    receiver.pull({**conn, "transfer_id": "d" * 32}, [1, 2])
    receiver.cancel("d" * 32)
    assert receiver.poll() == (set(), {})
    assert not any(np.any(c.numpy()) for pair in target for c in pair)
