"""fdplug plugin ``example``: a device that delegates to fdplug's CPU kernels.

Everything a real backend needs is here in small: the API version it was written for, a probe
that says why the device is (not) usable and how to fix it, and components registered for the
device with a priority above the portable reference ones.
"""

from __future__ import annotations

import importlib.util

from fdplug import hookimpl
from fdplug.plugin_api.specs import (
    AttentionBackendSpec,
    DeviceSpec,
    MoEBackendSpec,
    Probe,
)

FDPLUG_API_VERSION = "2.0"


def probe() -> Probe:
    if importlib.util.find_spec("paddle") is None:
        return Probe(False, "PaddlePaddle is not installed", fix="pip install 'fdplug[cpu]'")
    return Probe(True, "the example device runs on the host CPU")


class ExampleAttention:
    """Delegates to the CPU reference; a real plugin calls its own kernel here."""

    name = "example_attention"

    def __init__(self) -> None:
        from fdplug.core.portable.attention import ReferenceAttention

        self._impl = ReferenceAttention()

    def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
        return self._impl.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, meta):
        return self._impl.prepare(meta)

    def forward(self, q, k, v, key_cache, value_cache, prepared, scale):
        return self._impl.forward(q, k, v, key_cache, value_cache, prepared, scale)


class ExampleMoE:
    name = "example_moe"

    def __init__(self) -> None:
        from fdplug.core.portable.moe import ReferenceMoE

        self._impl = ReferenceMoE()

    def load_weights(self, weights):
        return self._impl.load_weights(weights)

    def forward(self, hidden, router_logits, layer, top_k, renormalize):
        return self._impl.forward(hidden, router_logits, layer, top_k, renormalize)


@hookimpl
def fdplug_register_devices(register):
    # Priority below cpu's 0: an example must never win `--device auto` over the real CPU device.
    register(DeviceSpec(name="example", probe=probe, paddle_device="cpu", priority=-10,
                        description="example third-party device (runs on the CPU)"))


@hookimpl
def fdplug_register_attention_backends(register):
    register(AttentionBackendSpec(name="example_attention", devices=("example",),
                                  factory=lambda config: ExampleAttention(), priority=10))


@hookimpl
def fdplug_register_moe_backends(register):
    register(MoEBackendSpec(name="example_moe", devices=("example",), factory=lambda config: ExampleMoE(),
                            priority=10, weight_formats=("none",)))
