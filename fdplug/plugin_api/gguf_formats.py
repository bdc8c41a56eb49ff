"""GGML's block formats, the tensor types of a GGUF file: their names, ids and sizes.

Part of the plugin contract: a ``gguf_linear`` kernel (`fdplug.plugin_api.ops`) is handed a layer's
bytes with one of these names, and the weight format ``gguf`` lists them in
``ModelTraits.weight_types``. The table only, without Paddle: the config and a file's index are read,
and an unsupported type refused by name, before a device is chosen; the core dequantizes them
(`fdplug.core.quant.gguf_blocks`, the numerics reference for kernels). ``ggml_type`` is the plain
integer ggml uses (equal to the ``gguf.GGMLQuantizationType`` member of that name, an ``IntEnum``);
the tests check the table against ``gguf.GGML_QUANT_SIZES``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fdplug.errors import UnsupportedModelError

QK_K = 256   # weights per K-quant super-block


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One GGML tensor type: ``block`` weights are stored in ``nbytes`` bytes."""

    name: str        # ggml's name, "Q4_1"
    ggml_type: int   # ggml's id, == gguf.GGMLQuantizationType[name]
    block: int       # weights per block
    nbytes: int      # bytes per block


_FORMATS = (
    BlockFormat("F32", 0, 1, 4),
    BlockFormat("F16", 1, 1, 2),
    BlockFormat("Q4_0", 2, 32, 2 + 16),                      # d, 32 x 4-bit
    BlockFormat("Q4_1", 3, 32, 2 + 2 + 16),                  # d, m, 32 x 4-bit
    BlockFormat("Q5_0", 6, 32, 2 + 4 + 16),                  # d, 32 high bits, 32 x 4-bit
    BlockFormat("Q5_1", 7, 32, 2 + 2 + 4 + 16),              # d, m, 32 high bits, 32 x 4-bit
    BlockFormat("Q8_0", 8, 32, 2 + 32),                      # d, 32 x int8
    BlockFormat("Q4_K", 12, QK_K, 2 + 2 + 12 + QK_K // 2),   # d, dmin, 8 x (6-bit sc, 6-bit m), 4-bit
    BlockFormat("Q5_K", 13, QK_K, 2 + 2 + 12 + QK_K // 8 + QK_K // 2),   # ... plus 256 high bits
    BlockFormat("Q6_K", 14, QK_K, QK_K // 2 + QK_K // 4 + QK_K // 16 + 2),  # ql, qh, 16 x int8 sc, d
    BlockFormat("BF16", 30, 1, 2),
)

BLOCK_FORMATS: dict[str, BlockFormat] = {f.name: f for f in _FORMATS}
_BY_TYPE: dict[int, BlockFormat] = {f.ggml_type: f for f in _FORMATS}


def format_of(name_or_type: str | int) -> BlockFormat:
    """The format named ``"Q4_K"`` (any case) or with ggml id ``12`` (a ``gguf.GGMLQuantizationType``
    works: it is an int). Anything else is a model fdplug cannot run: `UnsupportedModelError`."""
    if isinstance(name_or_type, str):
        fmt = BLOCK_FORMATS.get(name_or_type.upper())
        shown = repr(name_or_type)
    elif isinstance(name_or_type, (int, np.integer)) and not isinstance(name_or_type, bool):
        fmt = _BY_TYPE.get(int(name_or_type))
        # a gguf.GGMLQuantizationType knows its name; a bare int is only an id
        shown = getattr(name_or_type, "name", None) or f"type id {int(name_or_type)}"
    else:
        fmt, shown = None, repr(name_or_type)
    if fmt is None:
        supported = ", ".join(BLOCK_FORMATS)
        raise UnsupportedModelError(
            f"GGML tensor type {shown} is not supported; fdplug dequantizes {supported}.",
            fix="use a GGUF quantized to one of these (e.g. Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0 or F16; "
                "llama.cpp's llama-quantize makes one from a float GGUF), or the model's safetensors.")
    return fmt


def _resolve(fmt: BlockFormat | str | int) -> BlockFormat:
    return fmt if isinstance(fmt, BlockFormat) else format_of(fmt)


Q8_RUN = 4
"""``OpSpec(q8_inputs=True)``: the inputs of a ``gguf_linear`` are quantized in runs of this many values,
a scale each (llama.cpp's q8_0 takes 32). An integer dot product sums 4 byte products into a lane, so a
run of 4 costs the kernel no more than one of 32; on SmolLM2-135M it keeps the perplexity closer
to float32 math's."""


Q8_RUNS = (4, 8, 16, 32)
"""The run lengths ``OpSpec(q8_inputs=...)`` may name (API 4.4; ``True`` is `Q8_RUN`)."""


def q8_inputs(x: np.ndarray, run: int = Q8_RUN) -> np.ndarray:
    """``x [..., K]`` float32 (``K`` a multiple of ``run``) as a kernel with ``OpSpec(q8_inputs=run)``
    sees it, in float64: each run of ``run`` values ``d * q`` with ``d = amax / 127`` (float32) and ``q =
    round(x * (1 / d))`` to the nearest even (float32 product), so ``q`` in [-127, 127]; zeros where the
    run is all zeros. llama.cpp's q8 activations in shorter runs, exactly the C kernels' (csrc/gguf_q8.c
    with 4, csrc/gguf_packed.c with 16)."""
    runs = np.asarray(x, dtype=np.float32).reshape(*np.shape(x)[:-1], -1, run)
    d = np.max(np.abs(runs), axis=-1, keepdims=True) / np.float32(127)
    inverse = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    q = np.rint(runs * inverse)
    return (q.astype(np.float64) * d.astype(np.float64)).reshape(np.shape(x))


def row_bytes(fmt: BlockFormat | str, k: int) -> int:
    """Bytes of one row of ``k`` weights; ``k`` must be a positive multiple of the block."""
    f = _resolve(fmt)
    if k <= 0 or k % f.block:
        raise ValueError(f"a {f.name} row holds a positive multiple of {f.block} weights "
                         f"(blocks of {f.block}), not {k}")
    return k // f.block * f.nbytes
