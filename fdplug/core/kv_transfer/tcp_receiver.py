"""The ``tcp`` KV connector's receiver (the decode side): it pulls an offer's layers over its own
connection and checks every byte a peer sends before it touches a cache.

A file apart from the sender (`fdplug.core.kv_transfer.tcp`, whose docstring describes the wire)
because it is the side that trusts nothing: the ``conn`` it connects to comes from the client, and
whatever arrives on that connection is checked against the blocks it asked for before it lands.

Where the receiver connects is the client's choice unless checked: ``conn`` travels in the request.
``check`` (called at admission) and ``pull`` take only a conn of the sender's form whose address is
one of ``peers`` (``--kv-peers``; None: an instance that takes only signed params), and the address
a socket connects to is rebuilt from the parsed, checked parts. Each pull has its own connection,
closed (linger 0) the moment the pull lands, fails or is cancelled, and a socket never reconnects on
its own (``RECONNECT_IVL`` -1): a dead or silent peer costs one connection attempt per pull, and no
descriptor outlives the pull (a connect is a fraction of a millisecond against the milliseconds a
prompt's KV takes to move).
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import zmq

from fdplug.core.kv_transfer.params import is_count
from fdplug.core.kv_transfer.peers import split_tcp_address, tcp_address
from fdplug.core.kv_transfer.wire import header as _header
from fdplug.core.kv_transfer.wire import read_header as _read_header
from fdplug.core.portable.kv_blocks import put_blocks, word_dtype
from fdplug.plugin_api.kv_layout import check_layout

TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
"""What a sender's transfer ids look like (``secrets.token_hex(16)``): a conn's is checked against it."""
RELEASE_LINGER_MS = 1000
"""How long a socket closed right after a release keeps trying to deliver it (bounded: then it is gone)."""


@dataclass(slots=True)
class Pull:
    block_ids: list[int]
    last_heard: float
    conn: dict
    socket: zmq.Socket                        # this pull's own connection, closed when it ends
    layers_done: set[int] = field(default_factory=set)


class TCPReceiver:
    """The decode side: pulls offered blocks into blocks of its own ``caches`` (in ``layout``), from
    the senders at ``peers`` (``(host, port)``; None: any address, for an instance whose params are
    all signed).

    Each pull has its own DEALER socket, closed (linger 0) the moment the pull lands, fails or is
    cancelled: a connection never outlives its pull, and one that died cannot poison the pulls
    after it (a socket never reconnects: a sender restarted on the same port is reached by the
    next pull's new socket)."""

    name = "tcp"
    CONN_KEYS = frozenset({"addr", "transfer_id", "num_blocks"})
    """The fields of the sender's conn: a conn with any other is not one it made."""

    def __init__(self, caches: Sequence[tuple[Any, Any]], layout: str, stall_timeout: float = 5.0,
                 context: zmq.Context | None = None, peers: frozenset[tuple[str, int]] | None = None) -> None:
        self.caches, self.layout, self.stall_timeout, self.peers = caches, layout, stall_timeout, peers
        self.context = context or zmq.Context.instance()
        self.pulls: dict[str, Pull] = {}
        self.refused: dict[str, str] = {}   # pulls whose sender was gone before they were sent: the next poll's
        key = caches[0][0]
        self.sizes = {axis: int(key.shape[i]) for i, axis in enumerate(layout)}
        self.dtype, self.word = key.dtype, word_dtype(key)

    def check(self, conn: dict) -> None:
        """A ValueError unless ``conn`` is of this connector's sender's form and its address one of
        ``peers``: called as the request is admitted (a 400), and again by ``pull``; no I/O."""
        if not isinstance(conn, dict):
            raise TypeError("conn is not an object")
        extra = set(conn) - self.CONN_KEYS
        if extra:
            raise ValueError(f"conn has fields the {self.name} connector does not make: "
                             f"{', '.join(sorted(str(k)[:40] for k in extra))}")
        transfer_id = conn.get("transfer_id")
        if not isinstance(transfer_id, str) or not TRANSFER_ID.fullmatch(transfer_id):
            raise ValueError("conn's transfer_id is not one a sender makes (32 hex digits)")
        num_blocks = conn.get("num_blocks")
        if num_blocks is not None and not is_count(num_blocks, 1, 1 << 31):
            raise ValueError("conn's num_blocks is not a count of blocks")
        self._address(conn)

    def _address(self, conn: dict) -> str:
        """The sender's TCP address, rebuilt from its checked parts; a ValueError for anything else,
        and for an address that is not one of ``peers``."""
        host, port = split_tcp_address(conn.get("addr"))
        if self.peers is not None and (host, port) not in self.peers:
            raise ValueError(f"conn's addr {tcp_address(host, port)} is not one of this decode instance's --kv-peers")
        return tcp_address(host, port)

    def pull(self, conn: dict, block_ids: list[int], first_block: int = 0) -> None:
        """Start pulling the offer ``conn`` (its blocks from ``first_block`` on) into ``block_ids``."""
        self.check(conn)
        transfer_id = conn["transfer_id"]
        if transfer_id in self.pulls or transfer_id in self.refused:
            raise ValueError(f"transfer {transfer_id[:8]}... is already being pulled")
        address = self._address(conn)
        message = _header({"op": "pull", "transfer_id": transfer_id, "first_block": first_block,
                           "count": len(block_ids), **self._pull_options(conn)})
        socket = self._connect(address)
        try:
            socket.send(message, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            # the one connection attempt already failed (a sender gone: loopback refuses at once, and
            # whether that is before this send is a race): the pull fails as a dead sender's does later
            socket.close(0)
            self.refused[transfer_id] = f"the sender at {address} could not be reached ({exc})"
            return
        self.pulls[transfer_id] = Pull(list(block_ids), time.monotonic(), conn, socket)

    def _pull_options(self, conn: dict) -> dict:
        """More fields of a pull (a subclass's way of asking for another data path)."""
        return {}

    def release(self, conn: dict) -> None:
        """Tell the sender its offer is not needed (this side has the blocks): it frees them now."""
        self.check(conn)
        self._send_release(self._connect(self._address(conn)), conn["transfer_id"])

    @staticmethod
    def _send_release(socket: zmq.Socket, transfer_id: str) -> None:
        """Send a release and close ``socket``: it goes within `RELEASE_LINGER_MS` or not at all (an
        unreachable sender lets go of the offer at its pickup timeout instead)."""
        try:
            socket.send(_header({"op": "release", "transfer_id": transfer_id}), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
        socket.close(RELEASE_LINGER_MS)

    def cancel(self, transfer_id: str) -> None:
        """Stop a pull (its request ended): nothing more of it is written, and its socket is closed."""
        self.refused.pop(transfer_id, None)
        if transfer_id in self.pulls:
            self._end(transfer_id)

    def _connect(self, address: str) -> zmq.Socket:
        """A DEALER connected to ``address`` (a checked one) that tries once and never reconnects."""
        socket = self.context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, -1)             # one attempt: a dead peer fails the pull
        socket.setsockopt(zmq.CONNECT_TIMEOUT, max(1, int(self.stall_timeout * 1000)))
        if address.startswith("tcp://["):
            socket.setsockopt(zmq.IPV6, 1)
        try:
            socket.connect(address)
        except zmq.ZMQError:
            socket.close(0)
            raise
        return socket

    def _end(self, transfer_id: str) -> Pull:
        """A pull is over: out of ``pulls``, its socket closed at once (whatever is in flight is dropped)."""
        pull = self.pulls.pop(transfer_id)
        pull.socket.close(0)
        return pull

    def poll(self) -> tuple[set[str], dict[str, str]]:
        """Land what arrived; ``(done, failed: {transfer id: why})``."""
        done: set[str] = set()
        failed, self.refused = self.refused, {}
        for tid, pull in list(self.pulls.items()):
            while self.pulls.get(tid) is pull:
                try:
                    frames = pull.socket.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._land(frames, pull, done, failed)
        now = time.monotonic()
        for tid, pull in list(self.pulls.items()):
            if now - pull.last_heard > self.stall_timeout:
                failed[tid] = f"no data for {self.stall_timeout:g} s"
                self._end(tid)
        return done, failed

    @staticmethod
    def _parse(frames: list) -> dict | None:
        try:
            return _read_header(frames[0].bytes)
        except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError):
            return None

    def _land(self, frames: list, pull: Pull, done: set[str], failed: dict[str, str]) -> None:
        """One message on ``pull``'s socket: only ``pull``'s own transfer counts (a sender answers a
        pull on its connection; anything else there is dropped)."""
        header = self._parse(frames)
        tid = pull.conn["transfer_id"]
        if header is None or header.get("transfer_id") != tid:
            return
        pull.last_heard = time.monotonic()
        problem = self._check(header, frames, pull)
        if problem is None and header["op"] == "layer":
            self._write(header, frames, pull)
            return
        if problem is None and header["op"] == "done":
            done.add(tid)
        else:
            failed[tid] = problem or f"the sender said {header.get('code', header['op'])!r}"
        self._end(tid)

    def _check(self, header: dict, frames: list, pull: Pull) -> str | None:
        op = header["op"]
        if op == "done":
            return None if len(pull.layers_done) == len(self.caches) == header.get("layers") else "layers missing"
        if op != "layer":
            return f"the sender said {header.get('code', op)!r}"
        layer = header.get("layer")
        if not isinstance(layer, int) or not 0 <= layer < len(self.caches) or layer in pull.layers_done:
            return f"layer {layer!r} is not one this transfer expects"
        shape = self._shape(header, pull)
        if isinstance(shape, str) or len(frames) != 3:
            return f"layer {layer}: {shape if isinstance(shape, str) else 'not two arrays'}"
        if any(len(frame.buffer) != self.word.itemsize * int(np.prod(shape)) for frame in frames[1:]):
            return f"layer {layer}: the data does not match its header"
        return None

    def _shape(self, header: dict, pull: Pull) -> list[int] | str:
        """The shape the header's keys (and values) must have for this pull, or why they cannot."""
        try:
            layout = check_layout(header.get("layout"))
            shape = [len(pull.block_ids) if axis == "B" else self.sizes[axis] for axis in layout]
        except (ValueError, TypeError):
            return f"layout {header.get('layout')!r} is not one of B, T, H, D"
        if header.get("shape") != shape or header.get("dtype") != str(self.dtype):
            return f"{header.get('dtype')} {header.get('shape')}, expected {self.dtype} {shape}"
        return shape

    def _write(self, header: dict, frames: list, pull: Pull) -> None:
        """Put one checked layer's keys and values into the pull's blocks."""
        key_cache, value_cache = self.caches[header["layer"]]
        for cache, frame in ((key_cache, frames[1]), (value_cache, frames[2])):
            data = np.frombuffer(frame.buffer, dtype=self.word).reshape(header["shape"])
            put_blocks(cache, self.layout, pull.block_ids, data, header["layout"])
        pull.layers_done.add(header["layer"])

    def close(self) -> None:
        for tid in list(self.pulls):
            self._end(tid)
