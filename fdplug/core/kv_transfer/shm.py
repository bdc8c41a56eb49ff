"""The ``shm`` KV connector: a decode instance on the same machine reads the blocks from shared memory.

The prefill side keeps one arena, a file in ``/dev/shm`` (created ``O_EXCL``, mode 0600: only its
user maps it) of ``FDPLUG_KV_STAGING_MIB``, its pages touched once at startup. A pull that asks
for it (the decode side found the arena's path on its own machine) is served by copying the
blocks into an extent of the arena and answering with where they are; the decode side, which maps
the arena read-only, copies them into its cache and releases the extent. That is two copies and
no socket for the bytes (`bench/pd.py` measures it against a memcpy and against ``tcp``). Control
messages travel as the ``tcp`` connector's do, and a pull from another machine, or one that finds
the arena full, gets the ``tcp`` connector's layers instead.

An extent starts with a header (magic, transfer id, a generation) that the decode side checks
before and after its copy, so an extent the prefill side reclaimed in the meantime (released
late, or past ``4 x FDPLUG_KV_STALL_TIMEOUT``) fails the transfer instead of landing another's
bytes. A prefill instance that was killed leaves its arena behind: the next one on the machine
removes arenas whose process is gone.

The arena's path comes in the client's ``conn``, so the decode side opens it only when all of
these hold: it is an arena's name in ``/dev/shm`` (``fdplug-kv-PID-HEX``, nothing else: no other
directory, no ``..``); the sender at the (checked) address confirmed it as its own arena (a pull
names the arena it would read, and the sender stages into it only if it is its own, else it
answers over TCP); and the file, opened without following a link, is a regular file of this user,
readable by no one else, as a prefill instance creates it.
"""

from __future__ import annotations

import logging
import mmap
import os
import re
import secrets
import stat
import time
import weakref
from pathlib import Path

import numpy as np
import zmq

from fdplug.core.kv_transfer.peers import sender_address
from fdplug.core.kv_transfer.tcp import TCPSender
from fdplug.core.kv_transfer.tcp_receiver import Pull, TCPReceiver
from fdplug.core.kv_transfer.wire import header as _header
from fdplug.core.portable.kv_blocks import put_blocks, take_blocks
from fdplug.plugin_api.kv_connector import KVCaches

logger = logging.getLogger("fdplug.kv_transfer")

DIRECTORY = Path("/dev/shm")
MIN_ARENA_BYTES = 16 << 20
MAX_MAPS = 8
HEADER_BYTES = 64
MAGIC = b"FDPLUGKV"
_ARENA = re.compile(r"/dev/shm/fdplug-kv-([0-9]{1,10})-[0-9a-f]{32}")


def remove_stale_arenas(directory: Path = DIRECTORY) -> None:
    """Remove the arenas of prefill processes that are gone (killed before they could)."""
    for path in directory.glob("fdplug-kv-*-*"):
        match = _ARENA.fullmatch(str(DIRECTORY / path.name))
        if match is None:
            continue
        try:
            os.kill(int(match.group(1)), 0)
        except ProcessLookupError:
            path.unlink(missing_ok=True)
        except PermissionError:        # another user's live process
            pass


def _extent_header(transfer_id: str, generation: int) -> bytes:
    return (MAGIC + bytes.fromhex(transfer_id)[:16].ljust(16, b"\0") + generation.to_bytes(8, "little")).ljust(
        HEADER_BYTES, b"\0")


class Arena:
    """The shared file and a first-fit allocator of its extents (engine thread only)."""

    def __init__(self, path: Path, nbytes: int) -> None:
        self.path = path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)     # reserved now: a full /dev/shm is an error here, not a SIGBUS later
            self.map = mmap.mmap(fd, nbytes)
        except OSError:
            path.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        self.bytes = np.frombuffer(self.map, np.uint8)
        self.free: list[tuple[int, int]] = [(0, nbytes)]   # (offset, size), by offset
        self._unlink = weakref.finalize(self, path.unlink, missing_ok=True)   # at close, collection or exit

    @classmethod
    def create(cls, nbytes: int) -> Arena | None:
        """An arena of ``nbytes`` (at most a quarter of what /dev/shm has free), or None (no
        /dev/shm, or too little of it: every pull then goes over TCP)."""
        remove_stale_arenas()
        try:
            stat = os.statvfs(DIRECTORY)
            nbytes = min(nbytes, stat.f_bavail * stat.f_frsize // 4) // 4096 * 4096
            if nbytes < MIN_ARENA_BYTES:
                raise OSError(f"{DIRECTORY} has too little free space")
            return cls(DIRECTORY / f"fdplug-kv-{os.getpid()}-{secrets.token_hex(16)}", nbytes)
        except OSError as exc:
            logger.warning("no shared-memory arena for KV transfers (%s): decode instances pull over TCP", exc)
            return None

    def allocate(self, nbytes: int) -> int | None:
        nbytes = -(-nbytes // 64) * 64
        for i, (offset, size) in enumerate(self.free):
            if size >= nbytes:
                self.free[i:i + 1] = [(offset + nbytes, size - nbytes)] if size > nbytes else []
                return offset
        return None

    def release(self, offset: int, nbytes: int) -> None:
        self.bytes[offset:offset + HEADER_BYTES] = 0       # a reader still copying sees it changed
        nbytes = -(-nbytes // 64) * 64
        spans = sorted([*self.free, (offset, nbytes)])
        merged = [spans[0]]
        for start, size in spans[1:]:
            last_start, last_size = merged[-1]
            if last_start + last_size == start:
                merged[-1] = (last_start, last_size + size)
            else:
                merged.append((start, size))
        self.free = merged

    def close(self) -> None:
        self.bytes = None
        self.map.close()
        self._unlink()


class ShmSender(TCPSender):
    name = "shm"

    def __init__(self, caches: KVCaches, arena_bytes: int) -> None:
        address, span = sender_address(caches.host, caches.port)
        super().__init__(caches.layers, caches.layout, address, port_span=span)
        self.arena = Arena.create(arena_bytes)
        self.hold = 4 * caches.stall_timeout
        self.staged: dict[str, tuple[int, int, float]] = {}    # transfer id -> (offset, bytes, deadline)
        self.generation = 0

    def offer(self, block_ids: list[int]) -> dict:
        conn = super().offer(block_ids)
        return conn if self.arena is None else {**conn, "shm": str(self.arena.path)}

    def poll(self) -> set[str]:
        sent = super().poll()
        now = time.monotonic()
        for transfer_id, (_offset, _nbytes, deadline) in list(self.staged.items()):
            if deadline <= now:                     # never released: the reader is gone
                self._released(transfer_id)
        return sent

    def _send(self, identity: bytes, transfer_id: str, blocks: list[int], request: dict) -> str | None:
        if request.get("via") != "shm" or self.arena is None or request.get("arena") != str(self.arena.path):
            return super()._send(identity, transfer_id, blocks, request)     # not our arena it would read: TCP
        key, shape = self.caches[0][0], self.wire_shape(len(blocks))
        per = int(np.prod(shape)) * self.word.itemsize
        nbytes = HEADER_BYTES + 2 * len(self.caches) * per
        offset = self.arena.allocate(nbytes)
        if offset is None:                          # the arena is full: these go over the socket
            return super()._send(identity, transfer_id, blocks, request)
        self.generation += 1
        self.arena.bytes[offset:offset + HEADER_BYTES] = np.frombuffer(
            _extent_header(transfer_id, self.generation), np.uint8)
        data = offset + HEADER_BYTES
        for layer_caches in self.caches:
            for cache in layer_caches:
                take_blocks(cache, self.layout, blocks, out=self.arena.bytes[data:data + per].view(self.word)
                            .reshape(shape))
                data += per
        self.staged[transfer_id] = (offset, nbytes, time.monotonic() + self.hold)
        try:
            self.socket.send_multipart([identity, _header({
                "op": "staged", "transfer_id": transfer_id, "offset": offset, "generation": self.generation,
                "layers": len(self.caches), "dtype": str(key.dtype), "layout": self.layout, "shape": shape})])
        except zmq.ZMQError:                         # the puller is gone: it fails by its stall timeout
            self._released(transfer_id)
            return None
        return transfer_id

    def _released(self, transfer_id: str) -> None:
        staged = self.staged.pop(transfer_id, None)
        if staged is not None:
            self.arena.release(staged[0], staged[1])

    def close(self) -> None:
        super().close()
        if self.arena is not None:
            self.arena.close()


class ShmReceiver(TCPReceiver):
    name = "shm"
    CONN_KEYS = TCPReceiver.CONN_KEYS | {"shm"}

    def __init__(self, caches: KVCaches) -> None:
        super().__init__(caches.layers, caches.layout, caches.stall_timeout, peers=caches.peers)
        self.maps: dict[str, np.ndarray] = {}      # arena path -> its read-only bytes

    def check(self, conn: dict) -> None:
        """The tcp conn's checks, and ``shm`` (when present) only an arena's name in /dev/shm."""
        super().check(conn)
        path = conn.get("shm")
        if path is not None and not (isinstance(path, str) and _ARENA.fullmatch(path)):
            raise ValueError(f"conn's shm {str(path)[:80]!r} is not a prefill instance's arena "
                             f"({DIRECTORY}/fdplug-kv-PID-HEX)")

    def _pull_options(self, conn: dict) -> dict:
        path = conn.get("shm")
        if isinstance(path, str) and _ARENA.fullmatch(path) and os.access(path, os.R_OK):
            return {"via": "shm", "arena": path}       # the sender stages there only if it is its own
        return {}

    def _land(self, frames: list, pull: Pull, done: set[str], failed: dict[str, str]) -> None:
        header = self._parse(frames)
        if header is None or header["op"] != "staged":
            return super()._land(frames, pull, done, failed)
        tid = pull.conn["transfer_id"]
        if header.get("transfer_id") != tid:
            return
        problem = self._copy_staged(header, pull)
        if problem is None:
            done.add(tid)
        else:
            failed[tid] = problem
        del self.pulls[tid]
        self._send_release(pull.socket, tid)       # the extent back to the sender; the socket goes with it

    def _copy_staged(self, header: dict, pull: Pull) -> str | None:
        shape = self._shape(header, pull)
        offset, generation = header.get("offset"), header.get("generation")
        if isinstance(shape, str) or header.get("layers") != len(self.caches) \
                or not (isinstance(generation, int) and 0 <= generation < 1 << 64) \
                or not (isinstance(offset, int) and 0 <= offset < 1 << 62):
            return shape if isinstance(shape, str) else "the staged extent is not one this transfer expects"
        arena = self._arena(pull.conn.get("shm"))
        if arena is None:
            return "the arena the sender staged into cannot be read here"
        per = int(np.prod(shape)) * self.word.itemsize
        end = offset + HEADER_BYTES + 2 * len(self.caches) * per
        if end > len(arena):
            return "the staged extent lies outside the arena"
        expected = np.frombuffer(_extent_header(header["transfer_id"], generation), np.uint8)
        if not np.array_equal(arena[offset:offset + HEADER_BYTES], expected):
            return "the staged extent was reclaimed before it was read"
        data = offset + HEADER_BYTES
        for layer_caches in self.caches:
            for cache in layer_caches:
                put_blocks(cache, self.layout, pull.block_ids, arena[data:data + per].view(self.word).reshape(shape),
                           header["layout"])
                data += per
        if not np.array_equal(arena[offset:offset + HEADER_BYTES], expected):
            return "the staged extent was reclaimed while it was read"
        return None

    def _arena(self, path: object) -> np.ndarray | None:
        """The arena at ``path`` mapped read-only, or None: only an arena's name in /dev/shm, opened
        without following a link, a regular file of this user that no one else may read."""
        if not isinstance(path, str) or not _ARENA.fullmatch(path):
            return None
        if path not in self.maps:
            if len(self.maps) >= MAX_MAPS:          # the oldest prefill instance's: likely gone
                del self.maps[next(iter(self.maps))]
            try:
                fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                return None
            try:
                info = os.fstat(fd)
                if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid() or info.st_mode & 0o077 \
                        or info.st_size < MIN_ARENA_BYTES:
                    return None
                self.maps[path] = np.frombuffer(mmap.mmap(fd, 0, prot=mmap.PROT_READ), np.uint8)
            except OSError:
                return None
            finally:
                os.close(fd)
        return self.maps[path]
