"""The built-in KV connectors, registered by the core for every device whose caches have a layout.

``ipc`` (priority 10, the default): the prefill side listens on a Unix socket (in a fresh 0700
directory) and on TCP; a decode instance on the same machine pulls over the Unix socket, one on
another machine over TCP. ``tcp``: TCP only (``FDPLUG_KV_HOST`` is the address decode instances
reach). Both move the same messages (`fdplug.core.kv_transfer.tcp`): layer by layer, no pickle.
"""

from __future__ import annotations

import shutil
import tempfile
from typing import Any

from fdplug.core.kv_transfer.tcp import TCPReceiver, TCPSender
from fdplug.plugin_api.kv_connector import KVCaches


class IPCSender(TCPSender):
    name = "ipc"

    def __init__(self, caches: KVCaches) -> None:
        self.directory = tempfile.mkdtemp(prefix="fdplug-kv-")       # 0700: only this user reaches the socket
        super().__init__(caches.layers, caches.layout, (f"ipc://{self.directory}/kv", f"tcp://{caches.host}:0"))

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)


class IPCReceiver(TCPReceiver):
    name = "ipc"


def tcp_connector(config: Any, role: str, caches: KVCaches) -> TCPSender | TCPReceiver:
    if role == "prefill":
        return TCPSender(caches.layers, caches.layout, (f"tcp://{caches.host}:0",))
    return TCPReceiver(caches.layers, caches.layout, caches.stall_timeout)


def ipc_connector(config: Any, role: str, caches: KVCaches) -> TCPSender | TCPReceiver:
    if role == "prefill":
        return IPCSender(caches)
    return IPCReceiver(caches.layers, caches.layout, caches.stall_timeout, local_ipc=True)
