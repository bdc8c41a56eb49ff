"""A throwaway plugin: a third party's KV connector, ``slow_tcp``, that sends a layer per poll.

Installed by the tests as the distribution ``fdplug-slowkv`` (entry point ``slowkv`` -> this
module), selected with ``--kv-connector slow_tcp`` like any vendor's. Its sender is the built-in TCP
one, except that a pull's layers leave one at a time, ``SLOW_KV_LAYER_S`` seconds apart (from the
environment): a transfer stays in flight long enough to kill the prefill instance in the middle.
"""

from __future__ import annotations

import os
import time

from fdplug import hookimpl
from fdplug.core.kv_transfer.tcp import TCPSender
from fdplug.core.kv_transfer.tcp_receiver import TCPReceiver
from fdplug.plugin_api.specs import ANY_DEVICE, KVConnectorSpec

FDPLUG_API_VERSION = "4.0"
LAYER_S = float(os.environ.get("SLOW_KV_LAYER_S", "0.5"))


class SlowSender(TCPSender):
    name = "slow_tcp"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.queue: list[tuple[bytes, str, list[int], int, float]] = []   # (peer, transfer, blocks, next layer, when)

    def _send(self, identity: bytes, transfer_id: str, blocks: list[int], request: dict) -> str | None:
        self.queue.append((identity, transfer_id, blocks, 0, time.monotonic()))
        return None                       # not done yet: its blocks stay held

    def poll(self) -> set[str]:
        sent = super().poll()
        now, still = time.monotonic(), []
        for identity, transfer_id, blocks, layer, when in self.queue:
            last = layer == len(self.caches) - 1
            if when > now:
                still.append((identity, transfer_id, blocks, layer, when))
            elif self._send_layer(identity, transfer_id, blocks, layer, last):
                if last:
                    sent.add(transfer_id)
                else:
                    still.append((identity, transfer_id, blocks, layer + 1, now + LAYER_S))
        self.queue = still
        return sent

    def _send_layer(self, identity: bytes, transfer_id: str, blocks: list[int], layer: int, last: bool) -> bool:
        import zmq

        from fdplug.core.kv_transfer.wire import header
        from fdplug.core.portable.kv_blocks import take_blocks

        caches = self.caches
        key, shape = caches[layer][0], self.wire_shape(len(blocks))
        frames = [header({"op": "layer", "transfer_id": transfer_id, "layer": layer, "dtype": str(key.dtype),
                          "layout": self.layout, "shape": shape})]
        frames += [take_blocks(cache, self.layout, blocks) for cache in caches[layer]]
        try:
            self.socket.send_multipart([identity, *frames])
            if last:
                self.socket.send_multipart([identity, header({"op": "done", "transfer_id": transfer_id,
                                                              "layers": len(caches)})])
        except zmq.ZMQError:
            return False
        return True


class SlowReceiver(TCPReceiver):
    name = "slow_tcp"


def _factory(config, role, caches):
    from fdplug.core.kv_transfer.peers import sender_address

    if role == "prefill":           # at --kv-port when it is set, as the built-in connectors
        address, span = sender_address(caches.host, caches.port)
        return SlowSender(caches.layers, caches.layout, address, port_span=span)
    return SlowReceiver(caches.layers, caches.layout, caches.stall_timeout, peers=caches.peers)   # --kv-peers


@hookimpl
def fdplug_register_kv_connectors(register):
    register(KVConnectorSpec(name="slow_tcp", devices=(ANY_DEVICE,), factory=_factory, priority=-1,
                             description="tests: the tcp connector, a layer per SLOW_KV_LAYER_S seconds"))
