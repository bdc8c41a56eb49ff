"""A ``gguf_linear`` kernel's prepared weights that give their rows back (`PreparedWeight.rows`, plugin
API 4.8): a tied lm_head's table prepared so is the model's only copy, the embedding reading its
token rows there, so those rows must be the file's values bit for bit."""

from __future__ import annotations

import numpy as np
import pytest

from fdplug.core.config import EngineConfig
from fdplug.testing.test_numerics import _random_gguf_blocks


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"])
def test_gguf_prepared_rows_are_the_files_values(fdplug_selection, fdplug_place, qtype):
    """A ``gguf_linear`` kernel whose ``prepare`` gives rows back (`PreparedWeight.rows`, API 4.8: a
    tied lm_head's table is then the model's only copy, the embedding reading it) gives the
    portable dequantization of the file's rows bit for bit: 64 rows (whole groups of 16 and 32),
    every row in another order and some twice, 2 blocks deep. Skipped where it gives none."""
    import paddle

    from fdplug.core.model.layers.gguf_linear import embedding_rows

    spec = fdplug_selection.ops["gguf_linear"]
    prepare = spec.prepare(EngineConfig()) if spec.prepare is not None else None
    paddle.set_device(fdplug_place)
    k = 2 * (256 if qtype.endswith("_K") else 32)
    weight = paddle.to_tensor(_random_gguf_blocks(qtype, 64, k, np.random.default_rng(12)))
    prepared = prepare(weight, qtype) if prepare is not None else None
    if prepared is None or prepared.rows is None:
        pytest.skip(f"{spec.name} keeps no {qtype} weight it reads rows back from")
    ids = paddle.to_tensor(np.array([*range(63, -1, -1), 5, 5, 40], dtype=np.int64))
    expected = embedding_rows(weight, qtype, k, ids, "float32").numpy()
    np.testing.assert_array_equal(prepared.rows(ids).numpy(), expected, err_msg=f"{spec.name} {qtype}")
