"""KV connectors: how a request's KV blocks move from a prefill instance to a decode instance.

Prefill/decode disaggregation (``fdplug serve --role prefill|decode``, ``fdplug router``) keeps the
*when* in the core and leaves the *how* to a connector. The core decides which blocks a request's
KV occupies on each side, holds them, and owns every deadline (``FDPLUG_KV_PICKUP_TIMEOUT`` on the
prefill side, ``FDPLUG_KV_TRANSFER_TIMEOUT`` on the decode side); a connector only moves bytes
between two instances' paged caches (`KVCaches`), with a vendor's transport if it has one (RDMA,
NVLink, its chip's DMA). vLLM's ``KVConnectorBase_V1`` splits the same work into a scheduler half
and a worker half; here the scheduler half is the core's, and what a connector implements is the
worker half, as two small objects:

- `KVSender` (prefill side): ``offer`` a finished request's blocks and return a ``conn`` (msgpack-able:
  it travels in the request's ``kv_transfer_params``, through the router, to the decode instance);
  ``poll`` says which offers are done with their blocks; ``withdraw`` is the core letting go of an
  offer nobody pulled in time.
- `KVReceiver` (decode side): ``pull`` an offer's blocks into blocks the core allocated; ``poll`` says
  which pulls landed and which failed (why); ``cancel`` stops one (its request ended); ``release``
  tells the sender its offer is not needed (the decode side had those blocks cached).
- `KVConnChecker` (decode side, optional but expected): ``check(conn)`` refuses a ``conn`` this
  receiver would not use, before any I/O. A ``conn`` arrives in the client's request: unless the
  instance verifies ``FDPLUG_PD_SECRET`` signatures, every field of it that leads to I/O (an
  address, a path, a size) is the client's choice, so ``check`` allows only what the connector's own
  sender makes, and addresses among ``KVCaches.peers`` (``--kv-peers``). A decode instance without
  the secret refuses to start with a receiver that has no ``check``.

Rules, checked by the conformance kit (``fdplug/testing/test_kv_connector.py``): every call is made
on the engine thread and returns at once (no call waits for the peer); a connector writes a
receiver's blocks only between ``pull`` and the ``poll`` that reports it, and never after ``cancel``;
a sender reads offered blocks only until ``poll`` reports the offer or ``withdraw`` returns; bytes
from the peer are checked before they touch a cache (the transfer is one this side asked for, dtype
and sizes exactly what its blocks hold); a receiver reports a pull that hears nothing for
``stall_timeout`` seconds as failed, and lets go of what a pull opened (sockets, connections) once
it lands, fails or is cancelled, without retrying on its own. The core refuses an offer's ``conn``
from another connector.

A connector is registered with ``fdplug_register_kv_connectors`` as a `KVConnectorSpec`;
``factory(config, role, caches)`` returns a `KVSender` for role ``"prefill"`` and a `KVReceiver` for
``"decode"``. It is selected like the other roles (``--kv-connector NAME``, else the highest
priority that runs on the device), and only when the instance has a ``--role``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class KVCaches:
    """One engine's paged KV caches and how to address a block in them.

    ``layers``: a ``(key cache, value cache)`` pair per layer, in ``layout``
    (`fdplug.plugin_api.kv_layout`: ``gather_blocks`` / ``scatter_blocks`` move whole blocks as
    ``[n, T, H, D]``); ``host``: the interface a sender listens on (``FDPLUG_KV_HOST``);
    ``stall_timeout``: the longest a receiver waits for the next sign of a pull's progress;
    ``port``: the port a sender listens on (``--kv-port``; 0: a free one), or, where several engines
    share the host, the first it tries (``fdplug.core.kv_transfer.peers.PORT_SPAN`` of them);
    ``peers``: the ``(host, port)`` endpoints a receiver may connect to (``--kv-peers``, host names
    resolved; IP addresses in their canonical spelling), or None for any well-formed address: the
    core passes None only to an instance that takes nothing but params signed with
    ``FDPLUG_PD_SECRET`` (and tests that drive a connector by hand).
    """

    layers: Sequence[tuple[Any, Any]]
    layout: str
    block_size: int
    host: str = "127.0.0.1"
    stall_timeout: float = 5.0
    port: int = 0
    peers: frozenset[tuple[str, int]] | None = None


@runtime_checkable
class KVSender(Protocol):
    """The prefill side's half of a connector."""

    name: str

    def offer(self, block_ids: list[int]) -> dict:
        """Serve ``block_ids`` to one puller; the ``conn`` it pulls by: a dict of str keys with
        msgpack-able values, holding at least ``transfer_id`` (a str that cannot be guessed:
        knowing it is the right to read those blocks)."""
        ...

    def poll(self) -> set[str]:
        """Serve what arrived; the transfer ids whose blocks this sender no longer reads (pulled,
        or released by the receiver). The core frees them."""
        ...

    def withdraw(self, transfer_id: str) -> None:
        """The core stops holding an offer (nobody pulled it in time): never read its blocks again;
        a later pull of it fails on the receiver's side."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class KVReceiver(Protocol):
    """The decode side's half of a connector."""

    name: str

    def pull(self, conn: dict, block_ids: list[int], first_block: int = 0) -> None:
        """Start pulling blocks ``first_block, first_block + 1, ...`` of the offer ``conn`` into this
        side's ``block_ids`` (as many); reported by ``poll`` under ``conn["transfer_id"]``."""
        ...

    def release(self, conn: dict) -> None:
        """Tell the sender its offer is not needed (nothing of it is pulled)."""
        ...

    def cancel(self, transfer_id: str) -> None:
        """Stop a pull: its blocks are never written again once this returns (they may be partly written)."""
        ...

    def poll(self) -> tuple[set[str], dict[str, str]]:
        """Land what arrived; ``(landed, failed)``: the transfer ids whose blocks now hold the
        offer's KV, and ``{transfer id: why}`` for those that will not."""
        ...

    def close(self) -> None:
        ...


@runtime_checkable
class KVConnChecker(Protocol):
    """What a receiver (`KVReceiver`) adds so that a decode instance without ``FDPLUG_PD_SECRET``
    may use it: the check of a client-supplied ``conn``, called as the request is admitted."""

    def check(self, conn: dict) -> None:
        """A ValueError saying why (a TypeError for a conn that is not a dict), unless ``conn`` is one this receiver's
        connector makes and may be
        pulled here: its keys exactly the sender's, each value of the sender's form (an id, a count),
        an address among ``KVCaches.peers`` (unless they are None), a path only where the connector
        keeps its own files. No I/O (no socket, no DNS, no file): the answer comes from ``conn``
        and what the receiver was configured with."""
        ...
