"""``cpu_native`` attention: the reference's grouping, with decode, prefill and the cache write compiled.

Decode (one query token per sequence) is most of a busy server's steps and, on CPU, is bound by
memory traffic: the reference gathers each sequence's blocks into a dense copy every layer. Here
decode rows go to ``fdplug_paged_attention``, which reads every key and value once from its block.
Prefill pieces (one sequence's query rows, `ReferenceAttention.prepare`) go to
``fdplug_prefill_attention`` (csrc/prefill_attention.c: blocked, online softmax, AVX-512 or AVX2 +
FMA) where the CPU has AVX2 and FMA (x86-64-v3) and the head dim is a multiple of 16 up to 256;
elsewhere to the reference's matmuls. Same cache layout as the reference, so the two are
interchangeable on one cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fdplug.core.portable.attention import ReferenceAttention, _Prepared, slot_range
from fdplug.plugin_api.attention import AttentionMetadata, cdiv
from fdplug.plugins.cpu import kernels


def prefill_attention(q: Any, key_cache: Any, value_cache: Any, q_rows: np.ndarray, key_end: np.ndarray,
                      table: np.ndarray, scale: float, threads: int) -> Any:
    """``[len(q_rows), heads, dim]``: row ``i`` attends keys ``[0, key_end[i])`` of the sequence with
    block table ``table`` (int32 arrays, checked by the caller like `paged_attention`'s)."""

    q = kernels._contiguous(q)
    kernels._check_float32(q)
    kt = kernels.kv_type(key_cache, value_cache)
    heads, dim, (kv_heads, num_blocks, block_size, _) = q.shape[1], q.shape[2], key_cache.shape
    out = kernels.empty_f32([len(q_rows), heads, dim])
    status = kernels.load().fdplug_prefill_attention(
        q.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), q_rows.ctypes.data, key_end.ctypes.data,
        table.ctypes.data, out.data_ptr(), len(q_rows), heads, kv_heads, dim, num_blocks, block_size,
        int(key_end.max()), scale, threads, kt)
    if status != 0:
        raise MemoryError(f"cpu prefill attention failed ({status}): no scratch memory, or built without AVX2 and FMA")
    return out


@dataclass(slots=True)
class _KernelGroup:
    """Decode rows for the kernel; every array int32 and C-contiguous, checked once per step."""

    q_rows: np.ndarray         # [n] rows of q
    seq_of_token: np.ndarray   # [n] row of block_tables for each query row (0..n-1 here)
    block_tables: np.ndarray   # [n, blocks] cache block ids
    key_end: np.ndarray        # [n] visible keys [0, key_end)
    max_block: int             # largest block id used, to check against the cache
    max_key_end: int           # key_end.max(), once a step instead of once a layer


@dataclass(slots=True)
class _PrefillGroup:
    """Query rows of one sequence for the prefill kernel; int32 and C-contiguous, checked once per step."""

    q_rows: np.ndarray         # [n] rows of q (and of the output, in this order)
    key_end: np.ndarray        # [n] visible keys [0, key_end)
    table: np.ndarray          # [blocks] the sequence's cache block ids, as far as any row sees
    max_block: int
    reference: tuple[Any, ...]  # build_group's arguments, for a head dim the kernel does not take
    reference_group: Any = None


class NativeCpuAttention(ReferenceAttention):
    name = "cpu_native"

    def __init__(self, threads: int) -> None:
        lib = kernels.load()  # fail at construction, not at the first step
        self.threads = threads
        self.prefill_kernel = bool(lib.fdplug_prefill_attention_available())   # built with AVX2 + FMA (or AVX-512)

    def prepare(self, meta: AttentionMetadata) -> _Prepared:
        """A step of decodes only (one token a sequence: every step of a steady single stream) skips
        the general grouping: one kernel group in token order, and no paddle copy of the slots (this
        backend writes the cache from the numpy ones). Measured: 46 -> ~20 us hot, and host work is
        what a single-stream step spends outside the model."""
        if meta.num_tokens != meta.num_seqs:
            return super().prepare(meta)
        seqs = np.arange(meta.num_seqs)
        group, _ = self._decode_group(meta, seqs, seqs)
        slots = np.asarray(meta.slot_mapping, dtype=np.int64)
        return _Prepared(None, slots, [group], None, slot_range(slots))

    def build_group(self, meta: AttentionMetadata, seqs: np.ndarray,
                    piece: tuple[int, int] | None = None) -> tuple[Any, np.ndarray]:
        if piece is not None and self.prefill_kernel:
            return self._prefill_group(meta, int(seqs[0]), piece)
        if piece is not None or not (meta.query_lens()[seqs] == 1).all():
            return super().build_group(meta, seqs, piece)
        return self._decode_group(meta, seqs, meta.query_start_loc[seqs])

    @staticmethod
    def _decode_group(meta: AttentionMetadata, seqs: np.ndarray, rows: np.ndarray) -> tuple[_KernelGroup, np.ndarray]:
        """Sequences ``seqs`` with one query token each, at token rows ``rows``."""
        key_end = meta.key_end[rows]
        blocks = cdiv(int(key_end.max()), meta.block_size)
        if key_end.min() < 1 or blocks > meta.block_tables.shape[1]:
            raise ValueError(f"attention metadata: key_end must be in [1, {meta.block_tables.shape[1]} blocks], "
                             f"got {int(key_end.min())}..{int(key_end.max())}")
        tables = np.ascontiguousarray(meta.block_tables[seqs, :blocks], dtype=np.int32)
        group = _KernelGroup(
            q_rows=rows.astype(np.int32), seq_of_token=np.arange(len(seqs), dtype=np.int32),
            block_tables=tables, key_end=key_end.astype(np.int32), max_block=int(tables.max(initial=0)),
            max_key_end=int(key_end.max()),
        )
        if tables.min(initial=0) < 0:
            raise ValueError("attention metadata: negative block id in a block table")
        return group, rows

    @staticmethod
    def _prefill_group(meta: AttentionMetadata, seq: int, piece: tuple[int, int]) -> tuple[_PrefillGroup, np.ndarray]:
        rows = meta.query_start_loc[seq] + piece[0] + np.arange(piece[1])
        key_end = meta.key_end[rows]
        blocks = cdiv(int(key_end.max()), meta.block_size)
        if key_end.min() < 1 or blocks > meta.block_tables.shape[1]:
            raise ValueError(f"attention metadata: key_end must be in [1, {meta.block_tables.shape[1]} blocks], "
                             f"got {int(key_end.min())}..{int(key_end.max())}")
        table = np.ascontiguousarray(meta.block_tables[seq, :blocks], dtype=np.int32)
        if table.min(initial=0) < 0:
            raise ValueError("attention metadata: negative block id in a block table")
        group = _PrefillGroup(rows.astype(np.int32), key_end.astype(np.int32), table, int(table.max(initial=0)),
                              (meta, np.array([seq]), piece))
        return group, rows

    def attend(self, g: Any, q: Any, key_cache: Any, value_cache: Any, scale: float) -> Any:
        if isinstance(g, _PrefillGroup) and not (16 <= q.shape[2] <= 256 and q.shape[2] % 16 == 0):
            if g.reference_group is None:      # built once a step, used by every layer
                g.reference_group = super().build_group(*g.reference)[0]
            g = g.reference_group
        if isinstance(g, _PrefillGroup):
            if g.max_block >= key_cache.shape[1]:
                raise ValueError(f"block id {g.max_block} is outside the KV cache ({key_cache.shape[1]} blocks)")
            return prefill_attention(q, key_cache, value_cache, g.q_rows, g.key_end, g.table, scale,
                                             self.threads)
        if not isinstance(g, _KernelGroup):
            return super().attend(g, q, key_cache, value_cache, scale)
        if g.max_block >= key_cache.shape[1]:
            raise ValueError(f"block id {g.max_block} is outside the KV cache ({key_cache.shape[1]} blocks)")
        return kernels.paged_attention(q, key_cache, value_cache, g.q_rows, g.block_tables, g.seq_of_token,
                                       g.key_end, g.max_key_end, scale, self.threads)

    def write_cache(self, k: Any, v: Any, key_cache: Any, value_cache: Any, prepared: _Prepared) -> None:
        low, high = prepared.slot_range
        capacity = key_cache.shape[1] * key_cache.shape[2]
        if low <= high and (low < 0 or high >= capacity):
            raise ValueError(f"slot mapping outside the KV cache: {low}..{high} for {capacity} slots")
        kernels.write_kv(k, v, key_cache, value_cache, prepared.slots)
