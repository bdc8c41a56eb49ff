"""KV connectors (`fdplug.plugin_api.kv_connector`): the transfer tests every connector passes.

Two in-process ends of the same connector (a sender over one cache, a receiver over another, real
sockets or whatever transport it uses) on the device under test, in its attention backend's layout:

- blocks land bit for bit (float32 and bf16) from shuffled block ids into other shuffled ids,
  starting past a prefix the receiver already holds; the sender then reports the offer done;
- a release frees the offer on the sender's side without anything being written;
- a pull of an unknown or withdrawn offer fails, and so does one whose sender went away (within
  the stall timeout); none writes anything;
- after ``cancel`` nothing of that pull is written or reported;
- no call waits for the peer (each returns within a second, however the peer behaves).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from fdplug.core.config import EngineConfig
from fdplug.core.portable.kv_blocks import gather_blocks
from fdplug.plugin_api.kv_connector import KVCaches, KVReceiver, KVSender
from fdplug.plugin_api.kv_layout import layout_of

LAYERS, BLOCKS, TOKENS, HEADS, DIM = 3, 12, 4, 2, 8
STALL = 0.5


def _caches(layout: str, dtype: str, seed: int | None) -> list:
    import paddle

    shape = [{"B": BLOCKS, "T": TOKENS, "H": HEADS, "D": DIM}[a] for a in layout]
    rng = np.random.default_rng(seed)
    make = (lambda: paddle.zeros(shape, dtype)) if seed is None else \
        (lambda: paddle.to_tensor(rng.standard_normal(shape).astype(np.float32)).astype(dtype))
    return [(make(), make()) for _ in range(LAYERS)]


@pytest.fixture
def ends(kv_connector_name, fdplug_plugin_set, fdplug_selection, fdplug_place, request):
    """``make(dtype) -> (sender, receiver, source caches, target caches, layout)``; closed after."""
    import paddle

    if kv_connector_name is None:
        pytest.skip("no KV connector runs on this device")
    spec = fdplug_plugin_set.registry.get("kv_connector", kv_connector_name).spec
    backend = fdplug_selection.attention.factory(EngineConfig())
    layout = layout_of(backend)
    if layout is None:
        pytest.skip(f"{fdplug_selection.attention.name} keeps an opaque KV cache: only its vendor's connector moves it")
    opened: list = []

    def make(dtype: str = "float32"):
        previous = paddle.get_device()
        paddle.set_device(fdplug_place)
        try:
            source, target = _caches(layout, dtype, seed=0), _caches(layout, dtype, seed=None)
        finally:
            paddle.set_device(previous)
        sender = spec.factory(EngineConfig(kv_role="prefill"), "prefill", KVCaches(source, layout, TOKENS))
        receiver = spec.factory(EngineConfig(kv_role="decode"), "decode",
                                KVCaches(target, layout, TOKENS, stall_timeout=STALL))
        opened.extend((sender, receiver))
        assert isinstance(sender, KVSender) and isinstance(receiver, KVReceiver)
        assert sender.name == receiver.name == kv_connector_name
        return sender, receiver, source, target, layout

    yield make
    for end in opened:
        end.close()


def _quick(call, *args):
    began = time.monotonic()
    result = call(*args)
    assert time.monotonic() - began < 1.0, f"{call.__name__} waited for its peer"
    return result


def _run(sender, receiver, timeout: float = 10.0):
    """Poll both ends until the receiver reports something; ``(landed, failed, sent)``."""
    deadline, sent = time.monotonic() + timeout, set()
    while time.monotonic() < deadline:
        if sender is not None:
            sent |= _quick(sender.poll)
        landed, failed = _quick(receiver.poll)
        if landed or failed:
            for _ in range(50):           # the sender's side may learn a moment later
                if sender is None:
                    break
                sent |= _quick(sender.poll)
                time.sleep(0.002)
            return landed, failed, sent
        time.sleep(0.001)
    raise AssertionError("the transfer neither landed nor failed in time")


def _blocks(caches, layout, ids):
    return [gather_blocks(c, layout, ids).astype("float32").numpy() for pair in caches for c in pair]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_land_bit_for_bit(ends, dtype):
    sender, receiver, source, target, layout = ends(dtype)
    conn = _quick(sender.offer, [7, 2, 5, 9, 11])
    _quick(receiver.pull, conn, [0, 3, 1, 10], 1)           # the offer's first block: a prefix hit here
    landed, failed, sent = _run(sender, receiver)
    assert landed == {conn["transfer_id"]} and not failed and conn["transfer_id"] in sent
    for got, want in zip(_blocks(target, layout, [0, 3, 1, 10]), _blocks(source, layout, [2, 5, 9, 11])):
        np.testing.assert_array_equal(got, want)
    untouched = [b for b in range(BLOCKS) if b not in (0, 3, 1, 10)]
    assert not any(np.any(b) for b in _blocks(target, layout, untouched))


def test_a_release_frees_the_offer_and_writes_nothing(ends):
    sender, receiver, _, target, layout = ends()
    conn = sender.offer([1, 2])
    _quick(receiver.release, conn)
    deadline, sent = time.monotonic() + 10, set()
    while conn["transfer_id"] not in sent:
        assert time.monotonic() < deadline, "the release never reached the sender"
        sent |= _quick(sender.poll)
        time.sleep(0.002)
    assert not any(np.any(b) for b in _blocks(target, layout, list(range(BLOCKS))))


def test_unknown_withdrawn_and_orphaned_pulls_fail_and_write_nothing(ends):
    sender, receiver, _, target, layout = ends()
    conn = sender.offer([1, 2])
    _quick(sender.withdraw, conn["transfer_id"])
    _quick(receiver.pull, conn, [0, 1], 0)
    landed, failed, _ = _run(sender, receiver)
    assert not landed and conn["transfer_id"] in failed
    unknown = {**conn, "transfer_id": "f" * 32}
    _quick(receiver.pull, unknown, [0, 1], 0)
    landed, failed, _ = _run(sender, receiver)
    assert not landed and "f" * 32 in failed
    orphan = sender.offer([3, 4])
    sender.close()                                           # the prefill instance went away
    began = time.monotonic()
    _quick(receiver.pull, orphan, [2, 3], 0)
    landed, failed, _ = _run(None, receiver, timeout=STALL + 10)
    assert not landed and orphan["transfer_id"] in failed and time.monotonic() - began < STALL + 5
    assert not any(np.any(b) for b in _blocks(target, layout, list(range(BLOCKS))))


def test_nothing_is_written_after_cancel(ends):
    sender, receiver, _, target, layout = ends()
    conn = sender.offer([4, 5, 6])
    _quick(receiver.pull, conn, [7, 8, 9], 0)
    _quick(receiver.cancel, conn["transfer_id"])
    deadline = time.monotonic() + 1.0
    while time.monotonic() < deadline:                       # the sender serves it; the receiver must drop it
        sender.poll()
        landed, failed = _quick(receiver.poll)
        assert conn["transfer_id"] not in landed | set(failed)
        time.sleep(0.005)
    assert not any(np.any(b) for b in _blocks(target, layout, list(range(BLOCKS))))
