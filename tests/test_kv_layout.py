"""`fdplug.plugin_api.kv_layout`: KV blocks between caches of different layouts.

Blocks gathered from an ``HBTD`` cache (the portable and cpu backends') and scattered into a
``BTHD`` cache (flash-attention style) hold the same keys per (block, token, head); a backend that
does not declare its layout is read from its shape when the sizes tell the axes apart, and one
whose shape does not is opaque; nonsense layouts are refused by name.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.core.portable.attention import ReferenceAttention
from fdplug.core.portable.kv_blocks import gather_blocks, put_blocks, scatter_blocks, take_blocks
from fdplug.plugin_api.kv_layout import check_layout, layout_of


def test_blocks_move_between_two_layouts_bit_for_bit():
    rng = np.random.default_rng(0)
    blocks, tokens, heads, dim = 6, 4, 2, 3
    canonical = rng.standard_normal((blocks, tokens, heads, dim)).astype(np.float32)
    hbtd = paddle.to_tensor(canonical.transpose(2, 0, 1, 3).copy())       # (H, B, T, D)
    bthd = paddle.zeros([blocks, tokens, heads, dim])
    scatter_blocks(bthd, "BTHD", [5, 0, 2], gather_blocks(hbtd, "HBTD", [1, 3, 4]))
    moved = bthd.numpy()
    np.testing.assert_array_equal(moved[[5, 0, 2]], canonical[[1, 3, 4]])
    assert not moved[[1, 3, 4]].any()          # nothing else written


@pytest.mark.parametrize("dtype, dim", [("bfloat16", 4), ("bfloat16", 3), ("bfloat16", 8)])
def test_16_bit_caches_move_as_words_or_by_index(dtype, dim):
    """bf16 rows move as 32-bit words (paddle's CPU scatter has no 16-bit kernel); a row of an
    odd number of 16-bit values falls back to indexing. Either way: the same bits."""
    rng = np.random.default_rng(1)
    canonical = paddle.to_tensor(rng.standard_normal((5, 4, 2, dim)).astype(np.float32)).astype(dtype)
    hbtd = paddle.zeros([2, 7, 4, dim], dtype)
    scatter_blocks(hbtd, "HBTD", [6, 1, 3, 0, 2], canonical)
    back = gather_blocks(hbtd, "HBTD", [6, 1, 3, 0, 2])
    assert np.array_equal(back.astype("float32").numpy(), canonical.astype("float32").numpy())
    assert not gather_blocks(hbtd, "HBTD", [4, 5]).astype("float32").numpy().any()


def test_a_layout_is_declared_read_from_the_shape_or_opaque():
    assert layout_of(ReferenceAttention()) == "HBTD"

    class FlashLike:
        def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
            return (num_blocks, block_size, num_kv_heads, head_dim)

    class Tiled:
        def kv_cache_shape(self, num_blocks, block_size, num_kv_heads, head_dim):
            return (num_blocks, num_kv_heads, head_dim // 8 if head_dim >= 8 else 1, block_size, 8)

    class Opaque(FlashLike):
        kv_cache_layout = None

    assert layout_of(FlashLike()) == "BTHD" and layout_of(Tiled()) is None and layout_of(Opaque()) is None
    for bad in ("BTH", "BTHX", 7):
        with pytest.raises(ValueError, match="must be a permutation of 'BTHD'"):
            check_layout(bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("ids", [[9, 2, 7, 3], list(range(3, 11)) + [0, 1, 2, 13, 14, 15, 16, 17]],
                         ids=["scattered", "runs"])
def test_raw_blocks_taken_and_put_match_the_gather_whatever_the_runs(dtype, ids):
    """`take_blocks`/`put_blocks` (what connectors move: the cache's own axis order, elements as
    integers) copy consecutive ids as slices and the rest as a gather: both give `gather_blocks`'
    blocks, and a put into another layout lands where a gather reads them."""
    rng = np.random.default_rng(1)
    source = paddle.to_tensor(rng.standard_normal((2, 20, 4, 3)).astype(np.float32)).astype(dtype)   # HBTD
    target = paddle.zeros([20, 4, 2, 3], dtype)                                                    # BTHD
    raw = take_blocks(source, "HBTD", ids)
    assert raw.shape == (2, len(ids), 4, 3) and raw.dtype == (np.int32 if dtype == "float32" else np.uint16)
    reordered = [i + 2 for i in ids]           # runs stay runs: both paths of put_blocks too
    put_blocks(target, "BTHD", reordered, raw, "HBTD")
    want = gather_blocks(source, "HBTD", ids).astype("float32").numpy()
    np.testing.assert_array_equal(gather_blocks(target, "BTHD", reordered).astype("float32").numpy(), want)
    untouched = [b for b in range(20) if b not in reordered]
    assert not gather_blocks(target, "BTHD", untouched).astype("float32").numpy().any()
