"""An attention or MoE backend that names a ``measure_key`` (plugin API 4.7) is timed against the
core's reference at startup (`fdplug.core.worker.backend_timing`): its key must be a string, and the
timing's synthetic inputs must run on it, or the reference would be selected for a failed timing."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from fdplug.core.config import EngineConfig

MODEL = SimpleNamespace(num_heads=4, num_kv_heads=2, head_dim=64, max_position_embeddings=128, hidden_size=256,
                        moe=SimpleNamespace(num_experts=8, intermediate_size=256, routing=SimpleNamespace(top_k=2)))
"""The `ModelConfig` fields the timing's cases read: a small model's."""


def _measured(registry, role: str, name: str | None):
    spec = registry.get(role, name).spec if name else None
    if spec is None or spec.measure_key is None:
        pytest.skip(f"{role} backend {name} names no measure_key: it is not timed")
    return spec


def _runs_every_case(spec, cases, config, place: str) -> None:
    from fdplug.core.worker.timing_cache import on_device

    sync = on_device(place)     # on the device under test, as the engine times it
    key = spec.measure_key(config)
    assert isinstance(key, str) and key, f"measure_key of {spec.name!r} returned {key!r}, not a non-empty str"
    backend = spec.factory(config)
    for case in cases:
        call = case.build(backend, np.random.default_rng(0))
        for size in case.rows:
            call(size)()
            sync()


def test_a_timed_attention_backend_runs_the_timings_inputs(attention_backend_name, fdplug_plugin_set,
                                                           fdplug_selection, fdplug_place):
    from fdplug.core.worker.backend_timing import attention_cases

    spec = _measured(fdplug_plugin_set.registry, "attention", attention_backend_name)
    config = EngineConfig(dtype="float32", max_model_len=128)
    _runs_every_case(spec, attention_cases(MODEL, config), config, fdplug_place)


@pytest.mark.parametrize("fmt", ["none", "fp8_block", "gguf"])
def test_a_timed_moe_backend_runs_the_timings_inputs(moe_backend_name, fdplug_plugin_set, fdplug_selection,
                                                     fdplug_place, fmt):
    from fdplug.core.worker import backend_timing
    from fdplug.core.worker.expert_samples import ExpertFormat

    spec = _measured(fdplug_plugin_set.registry, "moe", moe_backend_name)
    if fmt not in spec.weight_formats:
        pytest.skip(f"{spec.name} does not list the {fmt} expert format")
    formats = {"none": ExpertFormat(), "fp8_block": ExpertFormat("fp8_block", (128, 128)),
               "gguf": ExpertFormat("gguf", qtypes=(("down", "Q6_K"), ("gate", "Q4_K"), ("up", "Q4_K")))}
    build = backend_timing.moe_case(MODEL, formats[fmt], "float32")
    _runs_every_case(spec, [build], EngineConfig(dtype="float32"), fdplug_place)
