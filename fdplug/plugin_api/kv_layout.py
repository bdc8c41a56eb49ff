"""Where a KV block lives in an attention backend's cache: what moving KV between instances needs.

Prefill/decode disaggregation copies a request's KV blocks out of one instance's caches and into
another's, whose attention backend may lay its caches out differently. A backend says how with
``kv_cache_layout``: its cache's axes as a permutation of ``B`` (block), ``T`` (token within the
block), ``H`` (KV head) and ``D`` (head dim): the portable and cpu backends' ``(H, B, T, D)`` is
``"HBTD"``, a flash-attention style ``(B, T, H, D)`` cache ``"BTHD"``. ``None`` means the cache is
opaque (tiled or packed): only the vendor's own connector can move it. A backend that says nothing
is read from its ``kv_cache_shape`` when the axes' sizes tell them apart (`layout_of`).

Blocks travel in the canonical ``[n, T, H, D]`` order (`AXES`, blocks first), so two layouts
interoperate; `fdplug.core.portable.kv_blocks` moves them (``gather_blocks``, ``scatter_blocks``),
and the conformance kit checks that a backend's declared layout is where its ``forward`` writes.
"""

from __future__ import annotations

from typing import Any

AXES = "BTHD"          # the canonical order blocks travel in
_MISSING = object()
_PROBE = {"B": 7919, "T": 16, "H": 3, "D": 5}   # distinct sizes: each axis recognisable in a shape


def check_layout(layout: Any) -> str | None:
    """``layout`` if it is a permutation of ``BTHD`` (or None); a ValueError naming it otherwise."""
    if layout is None or (isinstance(layout, str) and sorted(layout) == sorted(AXES)):
        return layout
    raise ValueError(f"kv_cache_layout {layout!r} must be a permutation of {AXES!r} (B block, T token in the block, "
                     "H KV head, D head dim), or None for an opaque cache")


def layout_of(backend: Any) -> str | None:
    """The backend's declared ``kv_cache_layout``, else the one its ``kv_cache_shape`` shows (a
    4-d shape of the probe's sizes in some order), else None (opaque)."""
    declared = getattr(backend, "kv_cache_layout", _MISSING)
    if declared is not _MISSING:
        return check_layout(declared)
    shape = tuple(backend.kv_cache_shape(_PROBE["B"], _PROBE["T"], _PROBE["H"], _PROBE["D"]))
    by_size = {size: axis for axis, size in _PROBE.items()}
    if len(shape) != 4 or sorted(shape) != sorted(_PROBE.values()):
        return None
    return "".join(by_size[size] for size in shape)
