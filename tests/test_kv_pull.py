"""Pulling KV blocks between two instances' caches over real ZMQ sockets (`fdplug.core.kv_transfer.pull`).

Blocks offered from an ``HBTD`` cache land bit for bit in other blocks of a ``BTHD`` cache (float32
and bf16), a layer at a time; the sender reports them sent (its blocks free to reuse). Each bound
holds: an offer nobody pulls expires, and a late pull is told so; a pull of an unknown transfer
fails at once; a pull nobody answers fails after the stall timeout; a peer that sends a layer of
the wrong shape fails its transfer without writing anything.
"""

from __future__ import annotations

import time

import msgpack
import numpy as np
import paddle
import pytest
import zmq

from fdplug.core.kv_transfer.pull import KVReceiver, KVSender
from fdplug.plugin_api.kv_layout import gather_blocks

LAYERS, BLOCKS, TOKENS, HEADS, DIM = 3, 10, 4, 2, 8


def caches(layout: str, dtype: str, seed: int | None) -> list[tuple[paddle.Tensor, paddle.Tensor]]:
    shape = [{"B": BLOCKS, "T": TOKENS, "H": HEADS, "D": DIM}[a] for a in layout]
    rng = np.random.default_rng(seed)
    make = (lambda: paddle.zeros(shape, dtype)) if seed is None else \
        (lambda: paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype(dtype))
    return [(make(), make()) for _ in range(LAYERS)]


def run(sender: KVSender | None, receiver: KVReceiver, timeout: float = 10.0):
    """Poll both sides until the receiver reports something (bounded)."""
    deadline, sent = time.monotonic() + timeout, set()
    while time.monotonic() < deadline:
        if sender is not None:
            sent |= sender.poll()[0]
        done, failed = receiver.poll()
        if done or failed:
            return done, failed, sent | (sender.poll()[0] if sender else set())
        time.sleep(0.001)
    raise TimeoutError("the transfer neither finished nor failed")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_land_bit_for_bit_across_layouts(dtype):
    source, target = caches("HBTD", dtype, seed=0), caches("BTHD", dtype, seed=None)
    sender, receiver = KVSender(source, "HBTD"), KVReceiver(target, "BTHD")
    try:
        conn = sender.offer([7, 2, 5, 9])
        receiver.pull(conn, [0, 3, 1], first_block=1)           # the first block: a prefix hit here
        done, failed, sent = run(sender, receiver)
        assert done == {conn["transfer_id"]} and not failed and sent == {conn["transfer_id"]}
        for (sk, sv), (tk, tv) in zip(source, target):
            for s, t in ((sk, tk), (sv, tv)):
                want = gather_blocks(s, "HBTD", [2, 5, 9]).astype("float32").numpy()
                np.testing.assert_array_equal(gather_blocks(t, "BTHD", [0, 3, 1]).astype("float32").numpy(), want)
        assert not sender.offers                                # held until pulled, then released
    finally:
        sender.close(), receiver.close()


def test_every_wait_is_bounded():
    source, target = caches("HBTD", "float32", seed=1), caches("HBTD", "float32", seed=None)
    sender = KVSender(source, "HBTD", pickup_timeout=0.05)
    receiver = KVReceiver(target, "HBTD", stall_timeout=0.3)
    silent = zmq.Context.instance().socket(zmq.ROUTER)          # a prefill instance that never answers
    try:
        conn = sender.offer([1, 2])
        time.sleep(0.1)
        assert sender.poll() == (set(), {conn["transfer_id"]})  # expired: its blocks may be freed
        receiver.pull(conn, [0, 1])
        _, failed, _ = run(sender, receiver)
        assert "unknown_transfer" in failed[conn["transfer_id"]]
        receiver.pull({**conn, "transfer_id": "f" * 32}, [0, 1])
        _, failed, _ = run(sender, receiver)
        assert "unknown_transfer" in failed["f" * 32]
        port = silent.bind_to_random_port("tcp://127.0.0.1")
        began = time.monotonic()
        receiver.pull({"addr": f"tcp://127.0.0.1:{port}", "transfer_id": "a" * 32, "num_blocks": 2}, [0, 1])
        _, failed, _ = run(None, receiver)
        assert "no data for 0.3 s" in failed["a" * 32] and 0.25 < time.monotonic() - began < 5
        assert not target[0][0].numpy().any()                   # nothing was written by any of them
    finally:
        silent.close(0), sender.close(), receiver.close()


def test_a_layer_that_does_not_fit_fails_its_transfer_and_writes_nothing():
    target = caches("HBTD", "float32", seed=None)
    receiver = KVReceiver(target, "HBTD")
    rogue = zmq.Context.instance().socket(zmq.ROUTER)
    port = rogue.bind_to_random_port("tcp://127.0.0.1")
    try:
        tid = receiver.pull({"addr": f"tcp://127.0.0.1:{port}", "transfer_id": "b" * 32, "num_blocks": 2}, [4, 5])
        identity, _ = rogue.recv_multipart()
        big = np.ones((3, TOKENS, HEADS, DIM), np.float32)      # three blocks for a two-block pull
        header = msgpack.packb({"v": 1, "op": "layer", "transfer_id": tid, "layer": 0, "dtype": "paddle.float32",
                                "shape": [3, TOKENS, HEADS, DIM]})
        rogue.send_multipart([identity, header, big, big])
        _, failed, _ = run(None, receiver)
        assert "expected paddle.float32 [2, 4, 2, 8]" in failed[tid]
        assert not any(cache.numpy().any() for pair in target for cache in pair)
    finally:
        rogue.close(0), receiver.close()
