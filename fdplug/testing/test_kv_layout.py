"""Where the device's attention backends keep a KV block (`fdplug.plugin_api.kv_layout`).

The declared (or shape-read) ``kv_cache_layout`` must be where ``forward`` writes: keys and values
written at known slots come back from `gather_blocks` at block ``slot // block_size``, row
``slot % block_size``; and blocks put back with `scatter_blocks` are what a later gather reads. A
backend with an opaque cache (``None``) is skipped: only its vendor's own connector can move it.
"""

from __future__ import annotations

import numpy as np
import pytest

from fdplug.core.config import EngineConfig
from fdplug.core.portable.kv_blocks import gather_blocks, scatter_blocks
from fdplug.plugin_api.kv_layout import layout_of
from fdplug.testing.cases import attention_cases, case_steps, case_tensors


def test_the_declared_layout_is_where_forward_writes(attention_backend_name, fdplug_plugin_set, fdplug_place):
    import paddle

    if attention_backend_name is None:
        pytest.fail("no attention backend runs on this device")
    backend = fdplug_plugin_set.registry.get("attention", attention_backend_name).spec.factory(EngineConfig())
    layout = layout_of(backend)
    if layout is None:
        pytest.skip(f"{attention_backend_name} keeps an opaque KV cache (kv_cache_layout None)")
    case = attention_cases(seed=11)[-1]
    num_blocks, steps = case_steps(case)
    shape = backend.kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    previous = paddle.get_device()
    paddle.set_device(fdplug_place)
    try:
        key_cache, value_cache = paddle.zeros(shape, "float32"), paddle.zeros(shape, "float32")
        written_k = np.zeros((num_blocks * case.block_size, case.num_kv_heads, case.head_dim), np.float32)
        written_v = np.zeros_like(written_k)
        for i, meta in enumerate(steps):
            q, k, v = case_tensors(case, meta.num_tokens, i)
            backend.forward(*(paddle.to_tensor(x) for x in (q, k, v)), key_cache, value_cache, backend.prepare(meta),
                            case.head_dim ** -0.5)
            written_k[meta.slot_mapping], written_v[meta.slot_mapping] = k, v
        blocks = list(range(num_blocks))[::-1]          # any order, out of place
        for cache, written in ((key_cache, written_k), (value_cache, written_v)):
            got = gather_blocks(cache, layout, blocks).numpy()
            want = written.reshape(num_blocks, case.block_size, case.num_kv_heads, case.head_dim)[blocks]
            np.testing.assert_array_equal(got, want)
        fresh = np.random.default_rng(3).standard_normal((2, case.block_size, case.num_kv_heads, case.head_dim))
        scatter_blocks(key_cache, layout, [1, 0], paddle.to_tensor(fresh.astype(np.float32)))
        np.testing.assert_array_equal(gather_blocks(key_cache, layout, [0, 1]).numpy(), fresh[::-1].astype(np.float32))
    finally:
        paddle.set_device(previous)
