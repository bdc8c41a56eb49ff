"""Sizing and allocating the paged KV cache, with the numbers in the error when it cannot fit."""

from __future__ import annotations

from typing import Any

from fdplug.core.config import EngineConfig
from fdplug.core.model.checkpoint.footprint import DTYPE_BYTES
from fdplug.errors import ConfigError
from fdplug.plugin_api.attention import cdiv
from fdplug.plugin_api.model_runner import GIB, KVCachePlan, format_bytes


def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: str) -> int:
    """Keys and values of every layer for one block."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * DTYPE_BYTES[dtype]


def plan_kv_cache(config: EngineConfig, per_block: int, max_model_len: int, free_bytes: int | None,
                  model_bytes: int) -> KVCachePlan:
    """How many blocks to allocate.

    ``num_kv_blocks`` wins if given; otherwise ``kv_cache_memory`` GiB (default 2), capped at what
    ``max_num_seqs`` requests of ``max_model_len`` tokens can use at once (more could never be used).
    """
    blocks_per_seq = cdiv(max_model_len, config.block_size)
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    else:
        budget = (config.kv_cache_memory or config.DEFAULT_KV_CACHE_GIB) * GIB
        blocks = min(int(budget // per_block), config.max_num_seqs * blocks_per_seq + 1)
    plan = KVCachePlan(blocks, config.block_size, per_block, config.kv_dtype())
    if blocks < blocks_per_seq + 1:
        raise ConfigError(
            f"a KV cache of {plan.describe()} cannot hold one request of max_model_len={max_model_len} "
            f"({blocks_per_seq} blocks plus the null block).",
            fix=f"give the KV cache at least {format_bytes((blocks_per_seq + 1) * per_block)} "
                f"(--kv-cache-memory) or {blocks_per_seq + 1} blocks, or lower --max-model-len.")
    if free_bytes is not None and plan.total_bytes > free_bytes:
        raise ConfigError(
            f"the model's weights take {format_bytes(model_bytes)} and the KV cache would take "
            f"{format_bytes(plan.total_bytes)} ({plan.describe()}), but only {format_bytes(free_bytes)} "
            f"are free on the device after loading the model.",
            fix=f"lower --kv-cache-memory below {format_bytes(free_bytes)} (or --num-kv-blocks below "
                f"{free_bytes // per_block}), or use a device with more memory.")
    return plan


def allocate_kv_caches(attn_backend: Any, plan: KVCachePlan, num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: str) -> list[tuple[Any, Any]]:
    """One (key, value) cache pair per layer, in the attention backend's own layout."""
    import paddle

    shape = list(attn_backend.kv_cache_shape(plan.num_blocks, plan.block_size, num_kv_heads, head_dim))
    return [(paddle.zeros(shape, dtype=dtype), paddle.zeros(shape, dtype=dtype)) for _ in range(num_layers)]
