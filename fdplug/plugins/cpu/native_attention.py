"""``cpu_native`` attention: the reference's grouping, with decode and the cache write in compiled code.

Decode (one query token per sequence) is most of a busy server's steps and, on CPU, is bound by
memory traffic: the reference gathers each sequence's blocks into a dense copy every layer. Here
decode rows go to ``fdplug_paged_attention``, which reads every key and value once from its block.
Prefill chunks stay on the reference's matmul path, where the work is compute-bound and MKL wins.
Same cache layout as the reference, so the two are interchangeable on one cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fdplug.core.portable.attention import ReferenceAttention, _Prepared
from fdplug.plugin_api.attention import AttentionMetadata, cdiv
from fdplug.plugins.cpu import kernels


@dataclass(slots=True)
class _KernelGroup:
    """Decode rows for the kernel; every array int32 and C-contiguous, checked once per step."""

    q_rows: np.ndarray         # [n] rows of q
    seq_of_token: np.ndarray   # [n] row of block_tables for each query row (0..n-1 here)
    block_tables: np.ndarray   # [n, blocks] cache block ids
    key_end: np.ndarray        # [n] visible keys [0, key_end)
    max_block: int             # largest block id used, to check against the cache


class NativeCpuAttention(ReferenceAttention):
    name = "cpu_native"

    def __init__(self, threads: int) -> None:
        kernels.load()  # fail at construction, not at the first step
        self.threads = threads

    def build_group(self, meta: AttentionMetadata, seqs: np.ndarray,
                    piece: tuple[int, int] | None = None) -> tuple[Any, np.ndarray]:
        if piece is not None or not (meta.query_lens()[seqs] == 1).all():
            return super().build_group(meta, seqs, piece)
        rows = meta.query_start_loc[seqs]
        key_end = meta.key_end[rows]
        blocks = cdiv(int(key_end.max()), meta.block_size)
        if key_end.min() < 1 or blocks > meta.block_tables.shape[1]:
            raise ValueError(f"attention metadata: key_end must be in [1, {meta.block_tables.shape[1]} blocks], "
                             f"got {int(key_end.min())}..{int(key_end.max())}")
        tables = np.ascontiguousarray(meta.block_tables[seqs, :blocks], dtype=np.int32)
        group = _KernelGroup(
            q_rows=rows.astype(np.int32), seq_of_token=np.arange(len(seqs), dtype=np.int32),
            block_tables=tables, key_end=key_end.astype(np.int32), max_block=int(tables.max(initial=0)),
        )
        if tables.min(initial=0) < 0:
            raise ValueError("attention metadata: negative block id in a block table")
        return group, rows

    def attend(self, g: Any, q: Any, key_cache: Any, value_cache: Any, scale: float) -> Any:
        if not isinstance(g, _KernelGroup):
            return super().attend(g, q, key_cache, value_cache, scale)
        if g.max_block >= key_cache.shape[1]:
            raise ValueError(f"block id {g.max_block} is outside the KV cache ({key_cache.shape[1]} blocks)")
        return kernels.paged_attention(q, key_cache, value_cache, g.q_rows, g.block_tables, g.seq_of_token,
                                       g.key_end, scale, self.threads)

    def write_cache(self, k: Any, v: Any, key_cache: Any, value_cache: Any, prepared: _Prepared) -> None:
        slots = prepared.slots
        capacity = key_cache.shape[1] * key_cache.shape[2]
        if len(slots) and (slots.min() < 0 or slots.max() >= capacity):
            raise ValueError(f"slot mapping outside the KV cache: {int(slots.min())}..{int(slots.max())} "
                             f"for {capacity} slots")
        kernels.write_kv(k, v, key_cache, value_cache, slots)
