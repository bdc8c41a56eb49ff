"""The KV connectors' wire: a msgpack header frame (versioned, size-capped) and reused send buffers."""

from __future__ import annotations

import msgpack
import numpy as np

WIRE_VERSION = 1
MAX_HEADER_BYTES = 4096


class Staging:
    """Reused send buffers. ZMQ sends from them (no copy) on its I/O thread, so one is reused only
    when its frames' trackers say they left; reusing beats allocating: a fresh buffer costs a page
    fault per 4 KiB, more than the copy into it."""

    def __init__(self, keep: int = 2) -> None:
        self.keep, self.idle, self.busy = keep, [], []

    def take(self, nbytes: int) -> np.ndarray:
        self.recycle()
        for i, buffer in enumerate(self.idle):
            if buffer.nbytes >= nbytes:
                return self.idle.pop(i)[:nbytes]
        return np.empty(nbytes, np.uint8)

    def give_back(self, buffer: np.ndarray, trackers: list) -> None:
        self.busy.append((buffer.base if buffer.base is not None else buffer, trackers))

    def recycle(self) -> None:
        still = []
        for buffer, trackers in self.busy:
            if all(t.done for t in trackers):
                self.idle.append(buffer)
            else:
                still.append((buffer, trackers))
        self.busy = still
        self.idle = sorted(self.idle, key=lambda b: b.nbytes)[-self.keep:]


def header(message: dict) -> bytes:
    return msgpack.packb({"v": WIRE_VERSION, **message})


def read_header(frame: bytes) -> dict:
    if len(frame) > MAX_HEADER_BYTES:
        raise ValueError(f"a header of {len(frame)} bytes")
    header = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    if not isinstance(header, dict) or header.get("v") != WIRE_VERSION or not isinstance(header.get("op"), str):
        raise ValueError("not a KV transfer header of this version")
    return header
