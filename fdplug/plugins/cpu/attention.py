"""Reference attention: plain Paddle ops over a paged KV cache, correct on every device.

Layout: one layer's key (and value) cache is ``[num_blocks, block_size, num_kv_heads, head_dim]``.
Each step, ``prepare`` groups the sequences so one SDPA call serves many: all single-token queries
(decode) go in one padded batch, each longer query (prefill chunk) on its own, which avoids padding a
decode row to a prefill's length. The mask spec becomes a dense boolean mask per group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from fdplug.core.attention import AttentionMetadata


@dataclass(slots=True)
class _Group:
    batch: int
    max_query: int
    max_keys: int
    query_rows: Any | None     # [batch*max_query] rows of q, None when the group is q itself
    key_slots: Any             # [batch*max_keys] flat cache slots (padding: slot 0, masked out)
    mask: Any                  # [batch, 1, max_query, max_keys] bool
    valid_rows: Any | None     # rows of the padded output that are real tokens, None if all are


@dataclass(slots=True)
class _Prepared:
    slot_mapping: Any
    groups: list[_Group]
    token_order: Any | None    # permutation from concatenated group outputs back to token order


class ReferenceAttention:
    """Paddle SDPA with an explicit mask built from the core's mask spec (GQA native)."""

    name = "reference"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_dim)

    def prepare(self, meta: AttentionMetadata) -> _Prepared:
        query_lens = meta.query_lens()
        decode = np.flatnonzero(query_lens == 1)
        groups_of_seqs = ([decode] if len(decode) else []) + [np.array([i]) for i in np.flatnonzero(query_lens > 1)]
        groups, row_order = [], []
        for seqs in groups_of_seqs:
            group, rows = _build_group(meta, seqs)
            groups.append(group)
            row_order.append(rows)
        order = np.concatenate(row_order)
        identity = np.array_equal(order, np.arange(meta.num_tokens))
        token_order = None if identity else paddle.to_tensor(np.argsort(order, kind="stable"))
        return _Prepared(paddle.to_tensor(meta.slot_mapping.astype(np.int64)), groups, token_order)

    def forward(self, q: Any, k: Any, v: Any, key_cache: Any, value_cache: Any, prepared: _Prepared,
                scale: float) -> Any:
        num_heads, head_dim = q.shape[1], q.shape[2]
        num_kv_heads = k.shape[1]
        flat_k = key_cache.reshape([-1, num_kv_heads, head_dim])
        flat_v = value_cache.reshape([-1, num_kv_heads, head_dim])
        paddle.scatter_(flat_k, prepared.slot_mapping, k.astype(flat_k.dtype))
        paddle.scatter_(flat_v, prepared.slot_mapping, v.astype(flat_v.dtype))
        outputs = []
        for g in prepared.groups:
            queries = q if g.query_rows is None else paddle.gather(q, g.query_rows)
            queries = queries.reshape([g.batch, g.max_query, num_heads, head_dim])
            keys = paddle.gather(flat_k, g.key_slots).reshape([g.batch, g.max_keys, num_kv_heads, head_dim])
            values = paddle.gather(flat_v, g.key_slots).reshape([g.batch, g.max_keys, num_kv_heads, head_dim])
            out = F.scaled_dot_product_attention(queries, keys.astype(q.dtype), values.astype(q.dtype),
                                                 attn_mask=g.mask, scale=scale, training=False)
            out = out.reshape([g.batch * g.max_query, num_heads, head_dim])
            outputs.append(out if g.valid_rows is None else paddle.gather(out, g.valid_rows))
        out = outputs[0] if len(outputs) == 1 else paddle.concat(outputs)
        return out if prepared.token_order is None else paddle.gather(out, prepared.token_order)


def _build_group(meta: AttentionMetadata, seqs: np.ndarray) -> tuple[_Group, np.ndarray]:
    """Padded query rows, key slots and mask for a set of sequences; also the token rows it covers."""
    qsl, bs = meta.query_start_loc, meta.block_size
    starts, lens = qsl[seqs], qsl[seqs + 1] - qsl[seqs]
    batch, max_query = len(seqs), int(lens.max())
    max_keys = int(meta.seq_lens[seqs].max())
    query_pos = np.arange(max_query)
    real = query_pos[None, :] < lens[:, None]                                   # [batch, max_query]
    rows = np.where(real, starts[:, None] + query_pos[None, :], starts[:, None])  # padding repeats row 0
    key_pos = np.arange(max_keys)
    blocks = meta.block_tables[seqs][:, np.minimum(key_pos // bs, meta.block_tables.shape[1] - 1)]
    key_in_seq = key_pos[None, :] < meta.seq_lens[seqs][:, None]
    slots = np.where(key_in_seq, blocks * bs + key_pos % bs, 0)
    key_end = np.where(real, meta.key_end[rows], 1)                             # padding rows see one key
    mask = key_pos[None, None, :] < key_end[:, :, None]
    flat_rows = rows.reshape(-1)
    contiguous = batch * max_query == meta.num_tokens and np.array_equal(flat_rows, np.arange(meta.num_tokens))
    valid = real.reshape(-1)
    group = _Group(
        batch=batch, max_query=max_query, max_keys=max_keys,
        query_rows=None if contiguous else paddle.to_tensor(flat_rows.astype(np.int64)),
        key_slots=paddle.to_tensor(slots.reshape(-1).astype(np.int64)),
        mask=paddle.to_tensor(mask[:, None, :, :]),
        valid_rows=None if valid.all() else paddle.to_tensor(np.flatnonzero(valid).astype(np.int64)),
    )
    return group, flat_rows[valid]
