"""The built-in KV connectors, registered by the core for every device whose caches have a layout.

``shm`` (priority 10, the default): a decode instance on the same machine reads the blocks from
the prefill instance's shared-memory arena (`fdplug.core.kv_transfer.shm`); one on another machine
gets them over TCP. ``tcp``: TCP only (`fdplug.core.kv_transfer.tcp`), layer by layer. Both listen
on ``FDPLUG_KV_HOST`` (the address decode instances reach) and send no pickle.
"""

from __future__ import annotations

from typing import Any

from fdplug.core.kv_transfer.shm import ShmReceiver, ShmSender
from fdplug.core.kv_transfer.tcp import TCPReceiver, TCPSender
from fdplug.plugin_api.kv_connector import KVCaches


def tcp_connector(config: Any, role: str, caches: KVCaches) -> TCPSender | TCPReceiver:
    if role == "prefill":
        return TCPSender(caches.layers, caches.layout, f"tcp://{caches.host}:0")
    return TCPReceiver(caches.layers, caches.layout, caches.stall_timeout)


def shm_connector(config: Any, role: str, caches: KVCaches) -> ShmSender | ShmReceiver:
    from fdplug.core.settings import env

    if role == "prefill":
        return ShmSender(caches, env("FDPLUG_KV_STAGING_MIB") << 20)
    return ShmReceiver(caches)
