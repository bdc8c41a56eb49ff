"""The built-in KV connectors, registered by the core for every device whose caches have a layout.

``shm`` (priority 10, the default): a decode instance on the same machine reads the blocks from
the prefill instance's shared-memory arena (`fdplug.core.kv_transfer.shm`); one on another machine
gets them over TCP. ``tcp``: TCP only (`fdplug.core.kv_transfer.tcp`), layer by layer. Both listen
on ``FDPLUG_KV_HOST`` (the address decode instances reach), at ``--kv-port`` when it is set (the
first free port of ``PORT_SPAN`` from it: one per data-parallel engine), and send no pickle; their
receivers connect only to ``KVCaches.peers`` when those are given (`fdplug.core.kv_transfer.peers`).
"""

from __future__ import annotations

from typing import Any

from fdplug.core.kv_transfer.peers import sender_address
from fdplug.core.kv_transfer.shm import ShmReceiver, ShmSender
from fdplug.core.kv_transfer.tcp import TCPSender
from fdplug.core.kv_transfer.tcp_receiver import TCPReceiver
from fdplug.plugin_api.kv_connector import KVCaches


def tcp_connector(config: Any, role: str, caches: KVCaches) -> TCPSender | TCPReceiver:
    if role == "prefill":
        address, span = sender_address(caches.host, caches.port)
        return TCPSender(caches.layers, caches.layout, address, port_span=span)
    return TCPReceiver(caches.layers, caches.layout, caches.stall_timeout, peers=caches.peers)


def shm_connector(config: Any, role: str, caches: KVCaches) -> ShmSender | ShmReceiver:
    from fdplug.core.settings import env

    if role == "prefill":
        return ShmSender(caches, env("FDPLUG_KV_STAGING_MIB") << 20)
    return ShmReceiver(caches)
