"""KVCacheManager: prefix hits with exact block ids, caching rules, chained hashes and extra keys."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest

from fdplug.core.request import Request
from fdplug.core.scheduler.kv_cache_manager import (
    KVCacheManager,
    block_extra_keys,
    hash_block_tokens,
    update_block_hashes,
)
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.plugin_api.scheduled_work import MMPlaceholder

B = 4  # block size in these tests


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def free_ids(mgr: KVCacheManager) -> list[int]:
    return ids(mgr.block_pool.free_block_queue.get_all_free_blocks())


def req(rid: str, tokens, **kw) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=100), **kw)


def run(mgr: KVCacheManager, request: Request, n: int, hits=()) -> list[int]:
    """Allocate like the scheduler, then mark the tokens computed like update_from_output."""
    new = mgr.allocate_slots(request, n, hits)
    assert new is not None
    request.num_computed_tokens += len(hits) * B + n
    return ids(new)


# ---------------------------------------------------------------------------------------------------
# prefix hits
# ---------------------------------------------------------------------------------------------------


def test_prefix_hit_returns_exact_block_ids_and_touches_them():
    mgr = KVCacheManager(10, B)
    a = req("a", range(15))
    assert mgr.get_computed_blocks(a) == ([], 0)
    assert run(mgr, a, 15) == [1, 2, 3, 4]
    assert mgr.block_pool.cached_block_hash_to_block == {}  # nothing cached before it was computed
    mgr.free(a)
    assert free_ids(mgr) == [5, 6, 7, 8, 9, 4, 3, 2, 1]  # reverse order: a's tail evicted first
    assert len(mgr.block_pool.cached_block_hash_to_block) == 3  # the 3 full blocks

    b = req("b", [*range(12), 99, 98, 97])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert ids(hits) == [1, 2, 3] and num_hit == 12
    assert run(mgr, b, 3, hits) == [5]
    assert mgr.get_block_ids("b") == [1, 2, 3, 5]
    assert [blk.ref_cnt for blk in mgr.get_blocks("b")] == [1, 1, 1, 1]
    assert free_ids(mgr) == [6, 7, 8, 9, 4]  # 1, 2, 3 were unlinked from the tail
    stats = mgr.prefix_cache_stats
    assert (stats.requests, stats.queries, stats.hits) == (2, 30, 12)
    assert stats.hit_rate == pytest.approx(0.4)


def test_hit_on_blocks_of_a_running_request_shares_them():
    mgr = KVCacheManager(10, B)
    a = req("a", range(8))
    run(mgr, a, 8)
    a.append_output_token(100)
    run(mgr, a, 1)  # the decode step's allocation caches the computed prompt blocks
    b = req("b", [*range(8), 50])
    hits, num_hit = mgr.get_computed_blocks(b)
    assert ids(hits) == [1, 2] and num_hit == 8
    assert run(mgr, b, 1, hits) == [4]  # a holds 1, 2, 3
    assert [blk.ref_cnt for blk in mgr.get_blocks("a")] == [2, 2, 1]
    mgr.free(a)
    assert [blk.ref_cnt for blk in mgr.get_blocks("b")] == [1, 1, 1]
    assert free_ids(mgr) == [5, 6, 7, 8, 9, 3]


def test_blocks_are_cached_only_after_they_are_computed():
    mgr = KVCacheManager(10, B)
    a = req("a", range(9))
    assert mgr.allocate_slots(a, 9) is not None  # scheduled, KV not written yet
    b = req("b", range(9))
    assert mgr.get_computed_blocks(b) == ([], 0)
    a.num_computed_tokens = 9  # the step ran
    a.append_output_token(7)
    mgr.allocate_slots(a, 1)
    hits, num_hit = mgr.get_computed_blocks(b)
    assert ids(hits) == [1, 2] and num_hit == 8


def test_full_prompt_hit_recomputes_the_last_token():
    mgr = KVCacheManager(10, B)
    a = req("a", range(16))
    assert run(mgr, a, 16) == [1, 2, 3, 4]
    mgr.free(a)
    b = req("b", range(16))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert ids(hits) == [1, 2, 3] and num_hit == 12  # capped at (16 - 1) // 4 blocks
    assert run(mgr, b, 4, hits) == [5]
    c = req("c", range(17))  # one token longer: all four blocks hit
    hits, num_hit = mgr.get_computed_blocks(c)
    assert ids(hits) == [1, 2, 3, 4] and num_hit == 16


def test_preempted_request_rehits_its_own_output_blocks():
    mgr = KVCacheManager(10, B)
    a = req("a", range(6))
    run(mgr, a, 6)
    for tok in (100, 101):
        a.append_output_token(tok)
        run(mgr, a, 1)
    a.append_output_token(102)  # 9 tokens, 8 computed
    mgr.free(a)  # preemption: computed full blocks (one holds outputs) are cached first
    a.num_computed_tokens = 0
    hits, num_hit = mgr.get_computed_blocks(a)
    assert ids(hits) == [1, 2] and num_hit == 8


def test_decode_allocates_a_block_only_at_block_boundaries():
    mgr = KVCacheManager(10, B)
    a = req("a", range(7))
    assert run(mgr, a, 7) == [1, 2]
    a.append_output_token(1)
    assert run(mgr, a, 1) == []  # position 7 fits block 2
    a.append_output_token(2)
    assert run(mgr, a, 1) == [3]


def test_allocate_returns_none_and_changes_nothing():
    mgr = KVCacheManager(4, B)  # 3 usable blocks
    a = req("a", range(12))
    run(mgr, a, 12)
    b = req("b", range(50, 53))
    assert not mgr.can_allocate(b, 3)
    assert mgr.allocate_slots(b, 3) is None
    assert mgr.get_block_ids("b") == [] and "b" not in mgr.req_to_blocks
    assert mgr.block_pool.get_num_free_blocks() == 0


def test_evictable_hits_count_against_free_blocks():
    mgr = KVCacheManager(5, B)  # 4 usable blocks
    a = req("a", range(8))
    run(mgr, a, 8)
    mgr.free(a)  # 1, 2 cached and free
    c = req("c", range(50, 58))
    assert run(mgr, c, 8) == [3, 4]
    assert free_ids(mgr) == [2, 1]
    b = req("b", range(12))
    hits, num_hit = mgr.get_computed_blocks(b)
    assert ids(hits) == [1, 2] and num_hit == 8
    # 1 new block + touching 2 free cached blocks = 3 > 2 free: refused, and the hits stay cached
    assert mgr.num_blocks_to_allocate(b, 4, hits) == 3
    assert mgr.allocate_slots(b, 4, hits) is None
    assert free_ids(mgr) == [2, 1] and mgr.block_pool.get_cached_block(hits[0].block_hash) is hits[0]
    assert mgr.prefix_cache_stats.requests == 2  # a refused allocation is not counted
    mgr.free(c)
    assert run(mgr, b, 4, hits) == [4]
    assert mgr.get_block_ids("b") == [1, 2, 4]


def test_allocate_rejects_misuse():
    mgr = KVCacheManager(10, B)
    a = req("a", range(12))
    with pytest.raises(ValueError, match="> 0"):
        mgr.allocate_slots(a, 0)
    run(mgr, a, 12)
    other = req("o", range(12))
    mgr.free(a)
    hits, _ = mgr.get_computed_blocks(other)
    assert len(hits) == 2
    run(mgr, other, 1, hits[:1])
    with pytest.raises(ValueError, match="already holds blocks"):
        mgr.allocate_slots(other, 1, hits[1:])


def test_free_returns_every_block():
    mgr = KVCacheManager(10, B)
    reqs = [req(f"r{i}", range(i * 10, i * 10 + 5 + i)) for i in range(3)]
    for r in reqs:
        run(mgr, r, r.num_tokens)
    assert mgr.usage == pytest.approx(6 / 9)
    for r in reqs:
        mgr.free(r)
    mgr.free(reqs[0])  # freeing twice is a no-op
    assert mgr.usage == 0.0 and mgr.block_pool.get_num_free_blocks() == 9
    assert all(blk.ref_cnt == 0 for blk in mgr.block_pool.blocks)


def test_prefix_caching_can_be_turned_off():
    mgr = KVCacheManager(10, B, enable_caching=False)
    a = req("a", range(9))
    run(mgr, a, 9)
    mgr.free(a)
    assert mgr.get_computed_blocks(req("b", range(9))) == ([], 0)
    assert mgr.block_pool.cached_block_hash_to_block == {}
    assert mgr.prefix_cache_stats.queries == 0


# ---------------------------------------------------------------------------------------------------
# hashes
# ---------------------------------------------------------------------------------------------------


def test_cache_salt_isolates_the_whole_chain():
    plain, salted, other = (req(s or "none", range(12), cache_salt=s) for s in (None, "x", "y"))
    hashes = [update_block_hashes(r, B) for r in (plain, salted, other)]
    for i in range(3):
        assert len({hs[i] for hs in hashes}) == 3  # every block differs, not only the first
    assert block_extra_keys(salted, 0, 4) == ("x",) and block_extra_keys(salted, 4, 8) == ()

    mgr = KVCacheManager(10, B)
    run(mgr, salted, 12)
    mgr.free(salted)
    assert mgr.get_computed_blocks(req("y2", range(12), cache_salt="y")) == ([], 0)
    assert mgr.get_computed_blocks(req("n2", range(12))) == ([], 0)
    hits, num_hit = mgr.get_computed_blocks(req("x2", range(12), cache_salt="x"))
    assert ids(hits) == [1, 2] and num_hit == 8


def test_multimodal_items_enter_the_hash_of_every_block_they_overlap():
    tokens = [1, 2, 9, 9, 9, 9, 9, 3, 4, 5, 6, 7]  # 9 = image placeholder token
    img_a = req("a", tokens, mm_positions=[MMPlaceholder(2, 5, "imgA")])
    img_b = req("b", tokens, mm_positions=[MMPlaceholder(2, 5, "imgB")])
    assert block_extra_keys(img_a, 0, 4) == (("imgA", 2),)
    assert block_extra_keys(img_a, 4, 8) == (("imgA", -2),)
    assert block_extra_keys(img_a, 8, 12) == ()
    ha, hb = update_block_hashes(img_a, B), update_block_hashes(img_b, B)
    assert all(x != y for x, y in zip(ha, hb))
    no_image = update_block_hashes(req("c", tokens), B)
    assert no_image[0] != ha[0]

    mgr = KVCacheManager(10, B)
    run(mgr, img_a, 12)
    mgr.free(img_a)
    assert mgr.get_computed_blocks(req("b2", tokens, mm_positions=[MMPlaceholder(2, 5, "imgB")])) == ([], 0)
    hits, num_hit = mgr.get_computed_blocks(req("a2", tokens, mm_positions=[MMPlaceholder(2, 5, "imgA")]))
    assert ids(hits) == [1, 2] and num_hit == 8


def test_same_tokens_give_the_same_chain_and_a_changed_token_changes_the_rest():
    base = update_block_hashes(req("a", range(12)), B)
    assert base == update_block_hashes(req("b", range(12)), B)
    changed = update_block_hashes(req("c", [0, 1, 2, 3, 4, 99, 6, 7, 8, 9, 10, 11]), B)
    assert changed[0] == base[0] and changed[1] != base[1] and changed[2] != base[2]
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [1, 2], ("k",))


GOLDEN = [
    "d20a95ee9f878069f69e9f054c617860171b00faed0a946d2a53335212ae367a",
    "cc7f7e13a6a74adc714c8089c3effc4a2620d1f5a3163b4050782aa07948b072",
    "91410f4c560173c2799282480d92cd32bae5eb30c0845dec86a1639500e4a0a7",
]
_GOLDEN_SCRIPT = """
from fdplug.core.request import MMPlaceholder, Request
from fdplug.core.scheduler.kv_cache_manager import update_block_hashes
r = Request("a", list(range(100, 112)), cache_salt="tenant-1", mm_positions=[MMPlaceholder(2, 5, "img-abc")])
print(" ".join(x.hex() for x in update_block_hashes(r, 4)))
"""


def _golden_request() -> Request:
    return Request("a", list(range(100, 112)), cache_salt="tenant-1",
                   mm_positions=[MMPlaceholder(2, 5, "img-abc")])


def test_hash_chain_is_stable_across_processes():
    here = [x.hex() for x in update_block_hashes(_golden_request(), B)]
    assert here == GOLDEN
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _GOLDEN_SCRIPT], env=env, capture_output=True,
                             text=True, check=True, timeout=60)
        assert out.stdout.split() == GOLDEN


def test_hash_chain_matches_an_independent_recomputation():
    """The documented byte format, written out by hand."""

    def s(text: str) -> bytes:
        data = text.encode()
        return b"S" + struct.pack("<I", len(data)) + data

    def i(value: int) -> bytes:
        data = str(value).encode()
        return b"I" + struct.pack("<I", len(data)) + data

    def t(*items: bytes) -> bytes:
        return b"T" + struct.pack("<I", len(items)) + b"".join(items)

    version = b"fdplug-kv-block-v1"
    parent = hashlib.sha256(version + b"/root").digest()
    extra = [t(s("tenant-1"), t(s("img-abc"), i(2))), t(t(s("img-abc"), i(-2))), t()]
    tokens = list(range(100, 112))
    expected = []
    for k in range(3):
        block = tokens[4 * k:4 * k + 4]
        payload = version + parent + struct.pack("<I4q", 4, *block) + extra[k]
        parent = hashlib.sha256(payload).digest()
        expected.append(parent)
    assert update_block_hashes(_golden_request(), B) == expected


def test_a_hit_ending_inside_a_bidirectional_span_is_cut_back_to_its_start():
    """Blocks of 4; an image spans tokens [6, 14); a prompt that diverges at token 12 would hit 12
    tokens, ending inside the span: the hit is cut back to the span's start, then to a block (4)."""
    mgr = KVCacheManager(num_blocks=16, block_size=4)
    first = req("a", list(range(20)), mm_positions=[MMPlaceholder(6, 8, "img", span_length=8)])
    run(mgr, first, 20)
    mgr.free(first)
    diverging = list(range(12)) + [99] * 8
    second = req("b", diverging, mm_positions=[MMPlaceholder(6, 8, "img", span_length=8)])
    blocks, num_hit = mgr.get_computed_blocks(second)
    assert num_hit == 4 and len(blocks) == 1
    causal_first = req("c", list(range(20)), mm_positions=[MMPlaceholder(6, 8, "img2", span_length=0)])
    run(mgr, causal_first, 20)
    mgr.free(causal_first)
    causal = req("d", diverging, mm_positions=[MMPlaceholder(6, 8, "img2", span_length=0)])
    assert mgr.get_computed_blocks(causal)[1] == 12  # a causal item is no obstacle
