"""The pool of KV cache blocks: allocation, ref counts, and the prefix cache (hash -> block).

Modelled on vLLM v1's ``BlockPool``. A freed block keeps its hash and stays findable until the
pool hands it out again (lazy eviction), so the free list doubles as the prefix cache's LRU list:
blocks are taken from its head, freed blocks go to its tail, and a prefix hit on a free block
"touches" it, unlinking it from the middle in O(1). Block 0 is the null block: never handed out,
free to use as padding in block tables. The pool knows nothing about requests.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

BlockHash = bytes  # sha256 digest of a full block, chained over its prefix (see kv_cache_manager)


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of KV cache. ``block_hash`` is set while the block is in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None
    is_null: bool = False

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, eviction order first.

    Python's deque cannot remove from the middle in O(1); a prefix hit on a free block must.
    Two sentinels make every operation branch-free.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = 0
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        return [self.popleft() for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head to tail (for tests and debugging; O(n))."""
        out, block = [], self._head.next_free
        while block is not self._tail:
            out.append(block)
            block = block.next_free
        return out


@dataclass(slots=True)
class PrefixCacheStats:
    """Prefix-cache effectiveness in tokens, counted once per admitted request."""

    requests: int = 0
    queries: int = 0
    hits: int = 0

    def record(self, num_tokens: int, num_hit_tokens: int) -> None:
        self.requests += 1
        self.queries += num_tokens
        self.hits += num_hit_tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class BlockPool:
    """``num_blocks`` blocks with ids 0..num_blocks-1; block 0 is the null block."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 2:
            raise ValueError(f"a block pool needs at least 2 blocks (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.prefix_cache_stats = PrefixCacheStats()

    # -- allocation -------------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Free blocks, cached ones included: they are evicted on demand."""
        return self.free_block_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take blocks from the head of the free list (LRU first), evicting their cached hash.

        Callers check ``get_num_free_blocks()`` first; asking for more is a bug, hence ValueError.
        """
        if num_blocks > self.get_num_free_blocks():
            raise ValueError(f"cannot get {num_blocks} blocks: only {self.get_num_free_blocks()} free")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt = 1
        return blocks

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the free tail in the given order.

        The first block given is evicted first. The KV cache manager passes a request's blocks in
        reverse, so its tail blocks (least likely to be shared) are evicted before its prefix.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.append(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference to blocks found in the prefix cache; a free one leaves the free list."""
        for block in blocks:
            if block.ref_cnt == 0 and not block.is_null:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    # -- prefix cache -----------------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Enter ``blocks[num_cached_blocks:num_full_blocks]`` into the prefix cache.

        Only call this for blocks whose KV has been computed. If another block already holds the
        same content (two requests computed it at once) the first one stays the cached copy and
        this one stays anonymous: it is freed like any uncached block.
        """
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None:
                if block.block_hash != block_hash:
                    raise RuntimeError(f"{block} is cached under another hash")
                continue
            if block_hash not in self.cached_block_hash_to_block:
                block.block_hash = block_hash
                self.cached_block_hash_to_block[block_hash] = block

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> bool:
        if block.block_hash is None:
            return False
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after new weights). Refused (False) while blocks are in use."""
        if self.get_num_free_blocks() != self.num_blocks - 1:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.prefix_cache_stats = PrefixCacheStats()
        return True

    # -- metrics ----------------------------------------------------------------------------------

    @property
    def usage(self) -> float:
        """Fraction of usable blocks (the null block excluded) held by requests."""
        usable = self.num_blocks - 1
        return (usable - self.get_num_free_blocks()) / usable
