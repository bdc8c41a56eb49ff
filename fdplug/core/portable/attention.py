"""Reference attention: plain Paddle matmuls over a paged KV cache, correct on every device.

Layout: one layer's key (and value) cache is ``[num_kv_heads, num_blocks, block_size, head_dim]``.
Head-major on purpose: gathering a sequence's blocks along axis 1 yields keys already shaped
``[kv_heads, seq, dim]`` for a batched matmul, so no large transpose is ever made (on CPU a
materialised transpose of the gathered keys cost more than the attention itself).

Each step, ``prepare`` groups the sequences: all single-token queries (decode) in one padded
batch, each longer query (a prefill chunk) on its own, so a decode row is never padded to a
prefill's length. The mask spec becomes an additive mask (0 or -inf) per group. Measured on the
2-core CI machine, decode of 64 sequences x 300 keys (GQA 8/4, dim 64): Paddle's SDPA 233 ms,
this path 10 ms.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F

from fdplug.plugin_api.attention import AttentionMetadata, cdiv


@dataclass(slots=True)
class _Group:
    batch: int
    queries: int               # query tokens per sequence (padded)
    keys: int                  # key positions per sequence (whole blocks)
    query_rows: Any | None     # [batch*queries] rows of q; None when the group is q itself, in order
    block_ids: Any             # [batch*blocks] cache blocks to gather (padding: the null block)
    # Additive float mask, [1, batch, 1, queries, keys] until the first layer expands it to the
    # scores' shape: on Paddle's CPU a broadcasting add was 5x slower than a same-shape one.
    mask: Any
    valid_rows: Any | None     # rows of the padded output that are real tokens; None if all are


@dataclass(slots=True)
class _Prepared:
    slot_mapping: Any          # paddle int64 [tokens]; None where the backend writes from `slots`
    slots: np.ndarray          # the same, as numpy int64
    groups: list[Any]
    token_order: Any | None    # permutation from concatenated group outputs back to token order
    slot_range: tuple[int, int] = (0, -1)   # smallest and largest slot (0, -1: no tokens), once a step


class ReferenceAttention:
    """Masked softmax attention with matmuls, GQA by grouping query heads per KV head.

    Subclasses (the cpu plugin's compiled backend) keep the grouping and replace how a group is
    built (``build_group``), attended (``attend``) or how the cache is written (``write_cache``).
    """

    name = "reference"
    kv_cache_layout = "HBTD"     # (kv heads, blocks, tokens in a block, head dim): `plugin_api.kv_layout`

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (num_kv_heads, num_blocks, block_size, head_dim)

    def prepare(self, meta: AttentionMetadata) -> _Prepared:
        query_lens = meta.query_lens()
        decode = np.flatnonzero(query_lens == 1)
        pieces = [(decode, None)] if len(decode) else []
        for i in np.flatnonzero(query_lens > 1):
            pieces += [(np.array([i]), (lo, min(PREFILL_PIECE, int(query_lens[i]) - lo)))
                       for lo in range(0, int(query_lens[i]), PREFILL_PIECE)]
        groups, row_order = [], []
        for seqs, piece in pieces:
            group, rows = self.build_group(meta, seqs, piece)
            groups.append(group)
            row_order.append(rows)
        order = np.concatenate(row_order)
        identity = np.array_equal(order, np.arange(meta.num_tokens))
        token_order = None if identity else paddle.to_tensor(np.argsort(order, kind="stable"))
        slots = meta.slot_mapping.astype(np.int64)
        return _Prepared(paddle.to_tensor(slots), slots, groups, token_order, slot_range(slots))

    def build_group(self, meta: AttentionMetadata, seqs: np.ndarray,
                    piece: tuple[int, int] | None = None) -> tuple[Any, np.ndarray]:
        """Everything ``attend`` needs for these sequences (or query rows ``[first, first+count)`` of
        one sequence: ``piece``), and the token rows it outputs, in order."""
        return _build_group(meta, seqs, piece)

    def forward(self, q: Any, k: Any, v: Any, key_cache: Any, value_cache: Any, prepared: _Prepared,
                scale: float) -> Any:
        self.write_cache(k, v, key_cache, value_cache, prepared)
        outputs = [self.attend(g, q, key_cache, value_cache, scale) for g in prepared.groups]
        out = outputs[0] if len(outputs) == 1 else paddle.concat(outputs)
        return out if prepared.token_order is None else paddle.gather(out, prepared.token_order)

    def write_cache(self, k: Any, v: Any, key_cache: Any, value_cache: Any, prepared: _Prepared) -> None:
        _write(key_cache, k, prepared.slot_mapping)
        _write(value_cache, v, prepared.slot_mapping)

    def attend(self, g: _Group, q: Any, key_cache: Any, value_cache: Any, scale: float) -> Any:
        """One group's output rows ``[batch*queries (valid only), heads, dim]``."""
        num_heads, head_dim = q.shape[1], q.shape[2]
        kv_heads = key_cache.shape[0]
        group_size = num_heads // kv_heads
        rows = q if g.query_rows is None else paddle.gather(q, g.query_rows)
        rows = rows * scale  # on the queries, not the scores: a pass over [T, heads, dim] instead of [T, keys]
        # [batch, queries, kv, group, dim] -> [kv, batch, group*queries, dim]
        queries = rows.reshape([g.batch, g.queries, kv_heads, group_size, head_dim]).transpose([2, 0, 3, 1, 4])
        queries = queries.reshape([kv_heads, g.batch, group_size * g.queries, head_dim])
        keys = _gather_blocks(key_cache, g.block_ids).reshape([kv_heads, g.batch, g.keys, head_dim])
        values = _gather_blocks(value_cache, g.block_ids).reshape([kv_heads, g.batch, g.keys, head_dim])
        scores = paddle.matmul(queries, _as(keys, q.dtype), transpose_y=True)
        scores = scores.reshape([kv_heads, g.batch, group_size, g.queries, g.keys])
        if g.mask.shape != scores.shape:  # expanded once per step, for every layer (see _Group.mask)
            g.mask = g.mask.expand(scores.shape).clone()
        probs = F.softmax(scores + g.mask, axis=-1).reshape([kv_heads, g.batch, group_size * g.queries, g.keys])
        out = paddle.matmul(probs, _as(values, q.dtype))
        out = out.reshape([kv_heads, g.batch, group_size, g.queries, head_dim]).transpose([1, 3, 0, 2, 4])
        out = out.reshape([g.batch * g.queries, num_heads, head_dim])
        return out if g.valid_rows is None else paddle.gather(out, g.valid_rows)


# Query rows per prefill group: a causal chunk of 512 fresh tokens in two pieces computes 3/4 of
# the full 512 x 512 scores (the second piece alone sees all keys), 2048 tokens in 8 pieces 9/16.
PREFILL_PIECE = 256


def slot_range(slots: np.ndarray) -> tuple[int, int]:
    """The smallest and largest slot of a step, ``(0, -1)`` for none: ``_Prepared.slot_range``."""
    return (int(slots.min()), int(slots.max())) if len(slots) else (0, -1)


def _write(cache: Any, new: Any, slot_mapping: Any) -> None:
    """Store this step's keys (or values) ``[tokens, kv_heads, dim]`` at their flat slots."""
    kv_heads, num_blocks, block_size, head_dim = cache.shape
    flat = cache.reshape([kv_heads, num_blocks * block_size, head_dim])
    heads = paddle.arange(kv_heads).unsqueeze(1)
    paddle.index_put_(flat, (heads, slot_mapping.unsqueeze(0)), _as(new.transpose([1, 0, 2]), cache.dtype))


def _gather_blocks(cache: Any, block_ids: Any) -> Any:
    """``cache``'s blocks ``block_ids`` (axis 1). A 2-byte cache (``--kv-cache-dtype float16`` or
    ``bfloat16``) is gathered as its int16 bits: paddle's CPU build has no float16 gather."""
    if cache.element_size() == 2 and cache.dtype != paddle.int16:
        return paddle.gather(cache.view(paddle.int16), block_ids, axis=1).view(cache.dtype)
    return paddle.gather(cache, block_ids, axis=1)


def _as(x: Any, dtype: Any) -> Any:
    """``astype`` only when needed: on paddle's CPU even a same-dtype astype costs ~1 ms on 30 MB."""
    return x if x.dtype == dtype else x.astype(dtype)


def _build_group(meta: AttentionMetadata, seqs: np.ndarray,
                 piece: tuple[int, int] | None = None) -> tuple[_Group, np.ndarray]:
    """Padded query rows, blocks and mask for a set of sequences; also the token rows it covers.

    Keys stop at the last block any of the rows can see: for a causal piece of a prefill, the
    blocks after its last row are never computed (no scores, no softmax over masked keys).
    """
    qsl, bs = meta.query_start_loc, meta.block_size
    starts, lens = qsl[seqs], qsl[seqs + 1] - qsl[seqs]
    if piece is not None:
        starts, lens = starts + piece[0], np.full_like(lens, piece[1])
    batch, queries = len(seqs), int(lens.max())
    query_pos = np.arange(queries)
    real = query_pos[None, :] < lens[:, None]                                   # [batch, queries]
    rows = np.where(real, starts[:, None] + query_pos[None, :], starts[:, None])  # padding repeats row 0
    key_end = np.where(real, meta.key_end[rows], 1)                             # padding rows see one key
    blocks = cdiv(int(key_end.max()), bs)
    visible = np.arange(blocks * bs)[None, None, :] < key_end[:, :, None]
    mask = np.where(visible, np.float32(0), np.float32(-np.inf))[None, :, None]
    flat_rows = rows.reshape(-1)
    contiguous = batch * queries == meta.num_tokens and np.array_equal(flat_rows, np.arange(meta.num_tokens))
    valid = real.reshape(-1)
    group = _Group(
        batch=batch, queries=queries, keys=blocks * bs,
        query_rows=None if contiguous else paddle.to_tensor(flat_rows.astype(np.int64)),
        block_ids=paddle.to_tensor(meta.block_tables[seqs, :blocks].reshape(-1).astype(np.int64)),
        mask=paddle.to_tensor(mask),
        valid_rows=None if valid.all() else paddle.to_tensor(np.flatnonzero(valid).astype(np.int64)),
    )
    return group, flat_rows[valid]
