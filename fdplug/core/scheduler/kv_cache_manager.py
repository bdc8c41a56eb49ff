"""Per-request KV blocks on top of the block pool: prefix hits, slot allocation, freeing.

vLLM v1's ``KVCacheManager`` for one attention group. The scheduler asks
``get_computed_blocks`` for a new request's prefix hit, then ``allocate_slots`` for the tokens it
grants; ``None`` from ``allocate_slots`` is the only failure signal (the scheduler then waits or
preempts). A block enters the prefix cache only once its KV has been computed (its tokens are
below ``request.num_computed_tokens``), so a failed or aborted step never leaves a cached block
with unwritten KV, and no request can hit a block another request writes in the same step.

Block hashes are sha256 over a fixed byte encoding, chained through the parent hash, so they are
the same in every process (Python's ``hash()`` is salted per process and is never used).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from fdplug.core.multimodal.chunking import cut_back_hit
from fdplug.core.request import Request
from fdplug.core.scheduler.block_pool import (
    BlockHash,
    BlockPool,
    KVCacheBlock,
    PrefixCacheStats,
)
from fdplug.plugin_api.attention import cdiv

HASH_VERSION = b"fdplug-kv-block-v1"
ROOT_PARENT_HASH: BlockHash = hashlib.sha256(HASH_VERSION + b"/root").digest()


# ---------------------------------------------------------------------------------------------------
# block hashing
# ---------------------------------------------------------------------------------------------------


def encode_key(value: object) -> bytes:
    """Type-tagged, length-prefixed bytes of None/bool/int/str/bytes/tuples: unambiguous and stable."""
    if value is None:
        return b"N"
    if isinstance(value, bool):
        return b"B1" if value else b"B0"
    if isinstance(value, int):
        text = str(value).encode()
        return b"I" + struct.pack("<I", len(text)) + text
    if isinstance(value, str):
        data = value.encode("utf-8")
        return b"S" + struct.pack("<I", len(data)) + data
    if isinstance(value, bytes):
        return b"Y" + struct.pack("<I", len(value)) + value
    if isinstance(value, (tuple, list)):
        return b"T" + struct.pack("<I", len(value)) + b"".join(encode_key(v) for v in value)
    raise TypeError(f"cannot hash a block extra key of type {type(value).__name__}")


def hash_block_tokens(parent_block_hash: BlockHash | None, token_ids: Sequence[int],
                      extra_keys: tuple = ()) -> BlockHash:
    """sha256(version, parent hash, token count, tokens as little-endian int64, encoded extra keys)."""
    h = hashlib.sha256(HASH_VERSION)
    h.update(ROOT_PARENT_HASH if parent_block_hash is None else parent_block_hash)
    h.update(struct.pack(f"<I{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(encode_key(tuple(extra_keys)))
    return h.digest()


def block_extra_keys(request: Request, start: int, end: int) -> tuple:
    """Extra keys of the block covering tokens ``[start, end)``.

    The cache salt on the first block (so a salt isolates the whole chain), then for each
    multimodal item overlapping the block ``(mm_hash, item offset - block start)``.
    """
    keys: list = []
    if start == 0 and request.cache_salt is not None:
        keys.append(request.cache_salt)
    for item in request.mm_positions:
        if item.offset >= end:
            break  # sorted by offset
        if item.offset + item.length > start:
            keys.append((item.mm_hash, item.offset - start))
    return tuple(keys)


def update_block_hashes(request: Request, block_size: int) -> list[BlockHash]:
    """Extend ``request.block_hashes`` to cover every full block of ``request.all_token_ids``."""
    hashes = request.block_hashes
    tokens = request.all_token_ids
    for i in range(len(hashes), len(tokens) // block_size):
        start, end = i * block_size, (i + 1) * block_size
        parent = hashes[i - 1] if i else None
        hashes.append(hash_block_tokens(parent, tokens[start:end], block_extra_keys(request, start, end)))
    return hashes


# ---------------------------------------------------------------------------------------------------
# manager
# ---------------------------------------------------------------------------------------------------




class KVCacheManager:
    """Which blocks each request holds, and the prefix cache in front of them."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # leading blocks of a request already in the cache

    # -- prefix hits ------------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of a request that holds no blocks: (blocks, num_tokens).

        The hit is capped below ``request.num_tokens``: at least the last token is recomputed,
        because the model must run on something to produce the next token's logits.
        Does not take references; pass the blocks to ``allocate_slots`` in the same step. A request
        that already holds the blocks of what it computed (a step extension filled them: a PD
        decode's pulled prompt) hits nothing more: ``([], its computed tokens)``.
        """
        if self.req_to_blocks.get(request.request_id):
            return [], request.num_computed_tokens
        if not self.enable_caching:
            return [], 0
        hashes = update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        if request.mm_spans:  # a hit may not end inside a bidirectional span: cut back to its start
            blocks = blocks[:cut_back_hit(request.mm_spans, len(blocks) * self.block_size) // self.block_size]
        return blocks, len(blocks) * self.block_size

    # -- allocation -------------------------------------------------------------------------------

    def num_blocks_to_allocate(self, request: Request, num_new_tokens: int,
                               new_computed_blocks: Sequence[KVCacheBlock] = ()) -> int:
        """Blocks that ``allocate_slots`` would take from the free list (evictable hits included)."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_new = max(0, cdiv(num_computed + num_new_tokens, self.block_size) - held - len(new_computed_blocks))
        num_evictable_hits = sum(1 for block in new_computed_blocks if block.ref_cnt == 0)
        return num_new + num_evictable_hits

    def can_allocate(self, request: Request, num_new_tokens: int,
                     new_computed_blocks: Sequence[KVCacheBlock] = ()) -> bool:
        need = self.num_blocks_to_allocate(request, num_new_tokens, new_computed_blocks)
        return need <= self.block_pool.get_num_free_blocks()

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = ()) -> list[KVCacheBlock] | None:
        """Give ``request`` room for ``num_new_tokens`` more tokens; the new blocks, or None.

        ``new_computed_blocks`` is a prefix hit from ``get_computed_blocks`` (only for a request
        that holds no blocks); their tokens come on top of ``request.num_computed_tokens``.
        On None nothing changed. An empty list means the request's last block had room.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be > 0, got {num_new_tokens}")
        rid = request.request_id
        blocks = self.req_to_blocks.setdefault(rid, [])
        if new_computed_blocks and blocks:
            raise ValueError(f"request {rid} already holds blocks; a prefix hit only applies to a fresh one")
        if not self.can_allocate(request, num_new_tokens, new_computed_blocks):
            if not blocks:
                del self.req_to_blocks[rid]
            return None
        is_admission = not blocks
        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            blocks.extend(new_computed_blocks)
            self.num_cached_blocks[rid] = len(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_new = cdiv(num_computed + num_new_tokens, self.block_size) - len(blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new) if num_new > 0 else []
        blocks.extend(new_blocks)
        if self.enable_caching:
            if is_admission:
                self.block_pool.prefix_cache_stats.record(request.num_tokens, num_computed)
            self._cache_computed_blocks(request, num_computed)
        return new_blocks

    def _cache_computed_blocks(self, request: Request, num_computed_tokens: int) -> None:
        rid = request.request_id
        num_full = num_computed_tokens // self.block_size
        start = self.num_cached_blocks.get(rid, 0)
        if num_full <= start:
            return
        hashes = update_block_hashes(request, self.block_size)
        self.block_pool.cache_full_blocks(self.req_to_blocks[rid], hashes, start, num_full)
        self.num_cached_blocks[rid] = num_full

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Enter the request's first ``num_tokens`` (full blocks) into the prefix cache: their KV
        was written from elsewhere (a pull from a prefill instance)."""
        self._cache_computed_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release a request's blocks (finished, aborted or preempted), tail blocks first.

        Its computed full blocks are cached first, so a preempted request can re-hit its own KV.
        """
        rid = request.request_id
        blocks = self.req_to_blocks.get(rid)
        if blocks is None:
            return
        if self.enable_caching:
            self._cache_computed_blocks(request, request.num_computed_tokens)
        del self.req_to_blocks[rid]
        self.num_cached_blocks.pop(rid, None)
        self.block_pool.free_blocks(reversed(blocks))

    # -- queries ----------------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self.block_pool.prefix_cache_stats

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
