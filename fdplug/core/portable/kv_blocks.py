"""Moving whole KV blocks between a cache of any layout (`fdplug.plugin_api.kv_layout`) and the wire.

The portable implementation every KV connector uses (the core's ``shm`` and ``tcp``, and a
plugin's own): `gather_blocks` / `scatter_blocks` between a cache and the canonical ``[n, T, H, D]``
(paddle tensors), `take_blocks` / `put_blocks` between a host cache and numpy buffers.
"""

from __future__ import annotations

from typing import Any

from fdplug.plugin_api.kv_layout import AXES


def gather_blocks(cache: Any, layout: str, block_ids: Any) -> Any:
    """Blocks ``block_ids`` of one layer's ``cache`` as ``[n, T, H, D]`` (a copy)."""
    import paddle

    ids = paddle.to_tensor(block_ids, dtype="int64") if not isinstance(block_ids, paddle.Tensor) else block_ids
    picked = paddle.index_select(cache, ids, axis=layout.index("B"))
    return picked.transpose([layout.index(axis) for axis in AXES])


def scatter_blocks(cache: Any, layout: str, block_ids: Any, blocks: Any) -> None:
    """Write ``blocks [n, T, H, D]`` into ``cache``'s blocks ``block_ids``, in place: one row scatter
    along the block axis per index of the axes before it (views of the cache), ~15x paddle's
    advanced-index assignment on a (H, B, T, D) cache."""
    import itertools

    import paddle

    ids = paddle.to_tensor(block_ids, dtype="int64") if not isinstance(block_ids, paddle.Tensor) else block_ids
    if int(ids.shape[0]) != int(blocks.shape[0]):
        raise ValueError(f"{int(blocks.shape[0])} blocks for {int(ids.shape[0])} block ids")
    lead = layout[:layout.index("B")]        # axes before the block axis
    values = blocks.transpose([AXES.index(axis) for axis in lead + layout[len(lead):]]).astype(cache.dtype)
    target = cache
    if cache.dtype not in (paddle.float32, paddle.float64, paddle.int32, paddle.int64):
        if int(cache.shape[-1]) * cache.element_size() % 4:    # no 32-bit words to move: paddle's indexing
            index: list[Any] = [slice(None)] * 4
            index[layout.index("B")] = ids
            cache[tuple(index)] = values        # (already in the cache's axis order)
            return
        target, values = cache.view(paddle.int32), values.contiguous().view(paddle.int32)   # bf16, fp16, fp8
    for index in itertools.product(*(range(int(cache.shape[i])) for i in range(len(lead)))):
        view, rows = target, values
        for i in index:
            view, rows = view[i], rows[i]
        paddle.scatter_(view, ids, rows.contiguous())


# -- raw blocks: what a connector puts on the wire ----------------------------------------------------

_WORDS = {1: "uint8", 2: "uint16", 4: "int32", 8: "int64"}   # an unsigned/int type of each element size


def word_dtype(cache: Any) -> Any:
    """The numpy integer type of the cache's element size: how its elements travel (bf16 and fp8
    included: numpy has neither)."""
    import numpy as np

    return np.dtype(_WORDS[cache.element_size()])


def host_array(cache: Any) -> Any:
    """A zero-copy numpy view of a cache in host memory, its elements as integers of their size
    (bf16 and fp8 included: numpy has neither); None for a cache in device memory."""
    import numpy as np
    import paddle

    if not cache.place.is_cpu_place():
        return None
    return np.from_dlpack(cache.view(getattr(paddle, _WORDS[cache.element_size()])))


def take_blocks(cache: Any, layout: str, block_ids: Any, out: Any = None) -> Any:
    """Blocks ``block_ids`` of ``cache`` as a numpy array in the cache's own axis order (the block
    axis holding just them), elements as integers of their size; into ``out`` when given (a reused
    buffer: a fresh one costs a page fault per 4 KiB, more than the copy)."""
    import numpy as np
    import paddle

    view = host_array(cache)
    if view is not None:
        ids, axis = np.asarray(block_ids, dtype=np.int64), layout.index("B")
        runs = _runs(ids)
        if runs is None:
            return np.take(view, ids, axis=axis, out=out)
        if out is None:
            out = np.empty([len(ids) if i == axis else n for i, n in enumerate(view.shape)], view.dtype)
        for at, first, count in runs:
            out[_along(axis, at, count)] = view[_along(axis, first, count)]
        return out
    ids = paddle.to_tensor(block_ids, dtype="int64")
    picked = paddle.index_select(cache, ids, axis=layout.index("B"))
    data = picked.view(getattr(paddle, _WORDS[cache.element_size()])).numpy()
    if out is None:
        return data
    np.copyto(out, data)
    return out


def put_blocks(cache: Any, layout: str, block_ids: Any, data: Any, data_layout: str) -> None:
    """Write ``data`` (from `take_blocks` of a cache in ``data_layout``: same dtype, block shape)
    into ``cache``'s blocks ``block_ids``, in place."""
    import numpy as np
    import paddle

    data = data.transpose([data_layout.index(axis) for axis in layout])     # to this cache's axis order
    view = host_array(cache)
    ids = np.asarray(block_ids, dtype=np.int64)
    if view is not None:
        axis, runs = layout.index("B"), _runs(ids)
        if runs is None:
            index: list[Any] = [slice(None)] * 4
            index[axis] = ids
            view[tuple(index)] = data
            return
        for at, first, count in runs:
            view[_along(axis, first, count)] = data[_along(axis, at, count)]
        return
    canonical = np.ascontiguousarray(data.transpose([layout.index(axis) for axis in AXES]))
    scatter_blocks(cache, layout, ids.tolist(), paddle.to_tensor(canonical).view(cache.dtype))


def _runs(ids: Any) -> list[tuple[int, int, int]] | None:
    """``ids`` as runs of consecutive blocks ``(position in ids, first block, count)``, when there
    are few enough (a quarter of the ids at most) that slice copies beat a gather (~2x here); else None."""
    import itertools

    import numpy as np

    if len(ids) == 0:
        return None
    starts = np.flatnonzero(np.diff(ids) != 1) + 1
    if (len(starts) + 1) * 4 > len(ids):
        return None
    bounds = [0, *starts.tolist(), len(ids)]
    return [(a, int(ids[a]), b - a) for a, b in itertools.pairwise(bounds)]


def _along(axis: int, start: int, count: int) -> tuple:
    index: list[Any] = [slice(None)] * 4
    index[axis] = slice(start, start + count)
    return tuple(index)
