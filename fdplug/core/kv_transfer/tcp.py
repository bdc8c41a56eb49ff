"""The ``tcp`` KV connector: pulling a request's KV blocks from one instance into another over
ZMQ (TCP, any two machines), no pickle (`fdplug.plugin_api.kv_connector` is the contract).

The prefill side ``offer``s a finished request's blocks under a random 128-bit transfer id (a
capability: knowing it is the right to read them); the decode side ``pull``s them into blocks it
allocated. Layer by layer: the sender gathers a layer's blocks and hands them to ZMQ's I/O thread,
which sends them while the next layer is gathered; the receiver scatters each layer as it arrives.
A message is a msgpack header and the layer's keys and values as raw bytes in the canonical
``[n, T, H, D]`` order (`fdplug.plugin_api.kv_layout`), so the two sides' cache layouts may
differ. Everything a peer sends is checked before it touches a cache: the transfer is one this
side asked for, the layer in range, dtype and byte counts exactly what its blocks hold.

Nothing blocks: both sides are polled from the engine thread (``poll``). The core owns the offer's
deadline (``withdraw``: a later pull gets ``unknown_transfer``); a pull with no message for
``stall_timeout`` fails.

The receiver, with its checks of where a client's ``conn`` may send it, is
`fdplug.core.kv_transfer.tcp_receiver`.

Why TCP and not Ray's object store: the KV of 1,000 tokens of the bench model (23.6 MiB) took
16.2 ms from an actor through the object store against 7.1 ms over a bare ZMQ TCP link
(`bench/pd.py --ray`); and no Ray is needed on either side, and no object owned by a Ray worker
outlives the request.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np
import zmq

from fdplug.core.kv_transfer.wire import Staging
from fdplug.core.kv_transfer.wire import header as _header
from fdplug.core.kv_transfer.wire import read_header as _read_header
from fdplug.core.portable.kv_blocks import take_blocks, word_dtype
from fdplug.errors import ConfigError


class TCPSender:
    """The prefill side: serves pulls of offered blocks of ``caches`` (a ``(key, value)`` pair a
    layer, in ``layout``) on a ROUTER socket bound to ``address`` (``tcp://host:0``: a free port).
    With a fixed port and ``port_span`` > 1, the first free one of ``port_span`` ports from it on
    (the engines of one data-parallel instance share the host: each takes its own)."""

    name = "tcp"

    def __init__(self, caches: Sequence[tuple[Any, Any]], layout: str, address: str = "tcp://127.0.0.1:0",
                 context: zmq.Context | None = None, port_span: int = 1) -> None:
        self.caches, self.layout = caches, layout
        self.socket = (context or zmq.Context.instance()).socket(zmq.ROUTER)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.SNDHWM, 0)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)    # a vanished puller is an error, not a silent drop
        try:
            _bind(self.socket, address, port_span)
        except BaseException:
            self.socket.close(0)
            raise
        self.address = self.socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self.offers: dict[str, list[int]] = {}       # transfer id -> the offered blocks
        self.staging = Staging()
        key = caches[0][0]
        self.word = word_dtype(key)

    def offer(self, block_ids: list[int]) -> dict:
        """Serve ``block_ids`` to one pull; what the decode side needs to pull them (its ``conn``)."""
        transfer_id = secrets.token_hex(16)
        self.offers[transfer_id] = list(block_ids)
        return {"addr": self.address, "transfer_id": transfer_id, "num_blocks": len(block_ids)}

    def wire_shape(self, num_blocks: int) -> list[int]:
        """A layer's keys (or values) of ``num_blocks`` blocks as they travel: this cache's axis order."""
        key = self.caches[0][0]
        return [num_blocks if axis == "B" else int(key.shape[i]) for i, axis in enumerate(self.layout)]

    def withdraw(self, transfer_id: str) -> None:
        self.offers.pop(transfer_id, None)

    def poll(self) -> set[str]:
        """Serve the pulls that arrived; the transfer ids whose blocks are free to reuse."""
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
        return sent

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
            if offer is None:
                self._released(transfer_id)
            return transfer_id if offer is not None else None
        first, count = request.get("first_block", 0), request.get("count")
        if offer is None:
            return self._error(identity, transfer_id, "unknown_transfer")
        if not (isinstance(first, int) and isinstance(count, int) and 0 <= first and 0 < count
                and first + count <= len(offer)):
            return self._error(identity, transfer_id, "bad_range")
        return self._send(identity, transfer_id, offer[first:first + count], request)

    def _released(self, transfer_id: str) -> None:
        """A release of a transfer already served (a subclass frees what it staged for it)."""

    def _send(self, identity: bytes, transfer_id: str, blocks: list[int], request: dict) -> str | None:
        """Send the blocks layer by layer (keys and values in this cache's axis order), then
        ``done``; the transfer id (None: the puller is gone, and fails by its stall timeout)."""
        key, shape = self.caches[0][0], self.wire_shape(len(blocks))
        per = int(np.prod(shape))
        staging = self.staging.take(2 * len(self.caches) * per * self.word.itemsize)
        arrays = staging.view(self.word)
        trackers: list = []
        try:
            for layer, (key_cache, value_cache) in enumerate(self.caches):
                frames = [_header({"op": "layer", "transfer_id": transfer_id, "layer": layer, "dtype": str(key.dtype),
                                   "layout": self.layout, "shape": shape})]
                for j, cache in enumerate((key_cache, value_cache)):
                    out = arrays[(2 * layer + j) * per:(2 * layer + j + 1) * per].reshape(shape)
                    frames.append(zmq.Frame(take_blocks(cache, self.layout, blocks, out=out), copy=False, track=True))
                    trackers.append(frames[-1].tracker)
                self.socket.send_multipart([identity, *frames], copy=False)
            self.socket.send_multipart([identity, _header({"op": "done", "transfer_id": transfer_id,
                                                           "layers": len(self.caches)})])
        except zmq.ZMQError:
            return None
        finally:
            self.staging.give_back(staging, trackers)
        return transfer_id

    def _error(self, identity: bytes, transfer_id: str, code: str) -> None:
        """Tell the puller why it gets nothing (the offer is not held: nothing to free)."""
        try:
            self.socket.send_multipart([identity, _header({"op": "error", "transfer_id": transfer_id, "code": code})])
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self.socket.close(0)


def _bind(socket: zmq.Socket, address: str, port_span: int) -> None:
    """Bind ``address``; with a fixed port and ``port_span`` > 1, the first free port from it on."""
    host, _, port_text = address.rpartition(":")
    port = int(port_text) if port_text.isdigit() else 0
    if port == 0:
        socket.bind(address)
        return
    for candidate in range(port, min(port + port_span, 65536)):
        try:
            socket.bind(f"{host}:{candidate}")
            return
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EADDRINUSE:
                raise
    last = min(port + port_span, 65536) - 1
    raise ConfigError(f"cannot listen for KV pulls on {host.removeprefix('tcp://')}: "
                      f"ports {port}..{last} are all in use.",
                      fix="choose another --kv-port (FDPLUG_KV_PORT), or stop what holds those ports.")
