"""Pulling a request's KV blocks from one instance into another over ZMQ (TCP or IPC), no pickle.

The data path of prefill/decode disaggregation (issue "Scale-out II"; the scheduler and the
connector protocol come next). The prefill side ``offer``s a finished request's blocks under a
random 128-bit transfer id (a capability: knowing it is the right to read them); the decode side
``pull``s them into blocks it allocated. One message per layer: a msgpack header and the layer's
keys and values as raw bytes in the canonical ``[n, T, H, D]`` order (`fdplug.plugin_api.kv_layout`),
so the two sides' cache layouts may differ. Everything a peer sends is checked before it touches a
cache: the transfer is one this side asked for, the layer in range, dtype and byte counts exactly
what its blocks hold. A layer lands in the cache as it arrives; the transfer is done at ``done``.

Nothing blocks: both sides are polled from the engine thread (``poll``), ZMQ's I/O threads move
the bytes. Every wait is bounded: an offer not pulled within ``pickup_timeout`` expires (its blocks
may be freed; a late pull gets ``expired``); a pull with no message for ``stall_timeout`` fails.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from fdplug.plugin_api.kv_layout import gather_blocks, scatter_blocks

WIRE_VERSION = 1
MAX_HEADER_BYTES = 4096


@dataclass(slots=True)
class _Offer:
    block_ids: list[int]
    deadline: float


@dataclass(slots=True)
class _Pull:
    block_ids: list[int]
    last_heard: float
    layers_done: set[int] = field(default_factory=set)


def _bytes(tensor: Any) -> np.ndarray:
    """A tensor's bytes, whatever its dtype (bf16 included: numpy has none)."""
    import paddle

    return np.ascontiguousarray(tensor.contiguous().view(paddle.uint8).numpy())


def _header(message: dict) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, **message})


def _read_header(frame: bytes) -> dict:
    if len(frame) > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {len(frame)} bytes")
    header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    if not isinstance(header, dict) or header.get("v") != WIRE_VERSION or not isinstance(header.get("op"), str):
        raise ValueError("not a KV transfer header of this version")
    return header


class KVSender:
    """The prefill side: serves pulls of offered blocks of ``caches`` (a ``(key, value)`` pair a
    layer, in ``layout``) on a ROUTER socket bound to ``address`` (``tcp://host:0``: a free port)."""

    def __init__(self, caches: list[tuple[Any, Any]], layout: str, address: str = "tcp://127.0.0.1:0",
                 pickup_timeout: float = 60.0, context: zmq.Context | None = None) -> None:
        self.caches, self.layout, self.pickup_timeout = caches, layout, pickup_timeout
        self.socket = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)    # a vanished puller is an error, not a silent drop
        self.socket.bind(address)
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.offers: dict[str, _Offer] = {}

    def offer(self, block_ids: list[int]) -> dict:
        """Hold ``block_ids`` for one pull; what the decode side needs to pull them (its ``conn``)."""
        transfer_id = secrets.token_hex(16)
        self.offers[transfer_id] = _Offer(list(block_ids), time.monotonic() + self.pickup_timeout)
        return {"addr": self.address, "transfer_id": transfer_id, "num_blocks": len(block_ids)}

    def poll(self) -> tuple[set[str], set[str]]:
        """Serve the pulls that arrived; ``(sent, expired)`` transfer ids: their blocks are free to reuse."""
        sent: set[str] = set()
        while True:
            try:
                identity, frame = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            except ValueError:                     # not two frames: a peer that is not ours
                continue
            transfer_id = self._serve(identity, frame)
            if transfer_id is not None:
                sent.add(transfer_id)
        now = time.monotonic()
        expired = {tid for tid, offer in self.offers.items() if offer.deadline <= now}
        for tid in expired:
            del self.offers[tid]
        return sent, expired

    def _serve(self, identity: bytes, frame: bytes) -> str | None:
        try:
            request = _read_header(frame)
            transfer_id = request["transfer_id"]
            if request["op"] not in ("pull", "release") or not isinstance(transfer_id, str):
                raise ValueError("not a pull")
        except (ValueError, KeyError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return None                           # garbage: no answer, nothing held
        offer = self.offers.pop(transfer_id, None)
        if request["op"] == "release":            # the puller holds these blocks already: done with them
            return transfer_id if offer is not None else None
        first, count = request.get("first_block", 0), request.get("count")
        if offer is None:
            return self._error(identity, transfer_id, "unknown_transfer")
        if not (isinstance(first, int) and isinstance(count, int) and 0 <= first and 0 < count
                and first + count <= len(offer.block_ids)):
            return self._error(identity, transfer_id, "bad_range")
        blocks = offer.block_ids[first:first + count]
        try:
            for layer, (key_cache, value_cache) in enumerate(self.caches):
                keys, values = (gather_blocks(cache, self.layout, blocks) for cache in (key_cache, value_cache))
                header = _header({"op": "layer", "transfer_id": transfer_id, "layer": layer,
                                  "dtype": str(keys.dtype), "shape": [int(d) for d in keys.shape]})
                self.socket.send_multipart([identity, header, _bytes(keys), _bytes(values)], copy=False)
            self.socket.send_multipart([identity, _header({"op": "done", "transfer_id": transfer_id,
                                                           "layers": len(self.caches)})])
        except zmq.ZMQError:                      # the puller is gone: it fails on its side, by its stall timeout
            return None
        return transfer_id

    def _error(self, identity: bytes, transfer_id: str, code: str) -> None:
        """Tell the puller why it gets nothing (the offer is not held: nothing to free)."""
        try:
            self.socket.send_multipart([identity, _header({"op": "error", "transfer_id": transfer_id, "code": code})])
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.socket.close(0)


class KVReceiver:
    """The decode side: pulls offered blocks into blocks of its own ``caches`` (in ``layout``)."""

    def __init__(self, caches: list[tuple[Any, Any]], layout: str, stall_timeout: float = 5.0,
                 context: zmq.Context | None = None) -> None:
        self.caches, self.layout, self.stall_timeout = caches, layout, stall_timeout
        self.context = context or zmq.Context.instance()
        self.sockets: dict[str, zmq.Socket] = {}      # one DEALER per prefill instance
        self.pulls: dict[str, _Pull] = {}
        key = caches[0][0]
        self.block_shape = [int(key.shape[layout.index(axis)]) for axis in "THD"]
        self.dtype, self.itemsize = key.dtype, key.element_size()

    def pull(self, conn: dict, block_ids: list[int], first_block: int = 0) -> str:
        """Start pulling the offer ``conn`` (its blocks from ``first_block`` on) into ``block_ids``."""
        transfer_id = conn["transfer_id"]
        if transfer_id in self.pulls:
            raise ValueError(f"transfer {transfer_id[:8]}... is already being pulled")
        socket = self._socket(conn["addr"])
        self.pulls[transfer_id] = _Pull(list(block_ids), time.monotonic())
        socket.send(_header({"op": "pull", "transfer_id": transfer_id, "first_block": first_block,
                             "count": len(block_ids)}))
        return transfer_id

    def release(self, conn: dict) -> None:
        """Tell the sender its offer is not needed (this side has the blocks): it frees them now."""
        self._socket(conn["addr"]).send(_header({"op": "release", "transfer_id": conn["transfer_id"]}))

    def cancel(self, transfer_id: str) -> None:
        """Stop waiting for a pull (its request ended); its blocks may be partly written."""
        self.pulls.pop(transfer_id, None)

    def _socket(self, address: str) -> zmq.Socket:
        socket = self.sockets.get(address)
        if socket is None:
            socket = self.sockets[address] = self.context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 1000)      # a release sent just before close still goes
            socket.connect(address)
        return socket

    def poll(self) -> tuple[set[str], dict[str, str]]:
        """Land what arrived; ``(done, failed: {transfer id: why})``."""
        done: set[str] = set()
        failed: dict[str, str] = {}
        for socket in self.sockets.values():
            while True:
                try:
                    frames = socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._land(frames, done, failed)
        now = time.monotonic()
        for tid, pull in list(self.pulls.items()):
            if now - pull.last_heard > self.stall_timeout:
                failed[tid] = f"no data for {self.stall_timeout:g} s"
                del self.pulls[tid]
        return done, failed

    def _land(self, frames: list, done: set[str], failed: dict[str, str]) -> None:
        try:
            header = _read_header(frames[0].bytes)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return
        tid = header.get("transfer_id")
        pull = self.pulls.get(tid) if isinstance(tid, str) else None
        if pull is None:
            return                                # not ours (cancelled, or a stray): dropped
        pull.last_heard = time.monotonic()
        problem = self._check(header, frames, pull)
        if problem is None and header["op"] == "layer":
            self._write(header["layer"], frames, pull)
            return
        if problem is None and header["op"] == "done":
            done.add(tid)
        else:
            failed[tid] = problem or f"the sender said {header.get('code', header['op'])!r}"
        del self.pulls[tid]

    def _check(self, header: dict, frames: list, pull: _Pull) -> str | None:
        op = header["op"]
        if op == "done":
            return None if len(pull.layers_done) == len(self.caches) == header.get("layers") else "layers missing"
        if op != "layer":
            return f"the sender said {header.get('code', op)!r}"
        layer, shape = header.get("layer"), [len(pull.block_ids), *self.block_shape]
        if not isinstance(layer, int) or not 0 <= layer < len(self.caches) or layer in pull.layers_done:
            return f"layer {layer!r} is not one this transfer expects"
        if header.get("shape") != shape or header.get("dtype") != str(self.dtype) or len(frames) != 3:
            return f"layer {layer}: {header.get('dtype')} {header.get('shape')}, expected {self.dtype} {shape}"
        if any(len(frame.buffer) != self.itemsize * int(np.prod(shape)) for frame in frames[1:]):
            return f"layer {layer}: the data does not match its header"
        return None

    def _write(self, layer: int, frames: list, pull: _Pull) -> None:
        import paddle

        n, tokens, heads, dim = len(pull.block_ids), *self.block_shape
        key_cache, value_cache = self.caches[layer]
        for cache, frame in ((key_cache, frames[1]), (value_cache, frames[2])):
            raw = np.frombuffer(frame.buffer, dtype=np.uint8).reshape(n, tokens, heads, dim * self.itemsize)
            scatter_blocks(cache, self.layout, pull.block_ids, paddle.to_tensor(raw).view(self.dtype))
        pull.layers_done.add(layer)

    def close(self) -> None:
        for socket in self.sockets.values():
            socket.close(0)
        self.sockets.clear()
