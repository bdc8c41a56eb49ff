"""Conformance of the selected ``vision_attention`` kernel (`fdplug.plugin_api.ops`): a vision tower's
attention within windows and frames, against the portable op."""

from __future__ import annotations

import numpy as np

from fdplug.core.config import EngineConfig


def test_vision_attention_kernel_matches_the_portable_one(fdplug_selection, fdplug_place):
    """The selected ``vision_attention`` against the portable op: one segment, windows of equal and
    unequal lengths (a tower's edge windows), one-token segments; its inputs untouched."""
    import paddle

    from fdplug.core.portable import ops as portable

    kernel = fdplug_selection.ops["vision_attention"].factory(EngineConfig())
    rng = np.random.default_rng(9)
    paddle.set_device(fdplug_place)
    for bounds in ([0, 64], [0, 16, 32, 48, 64], [0, 16, 24, 40, 41, 64], [0, 1, 2, 64]):
        q, k, v = (paddle.to_tensor(rng.standard_normal((64, 4, 16), dtype=np.float32)) for _ in range(3))
        before = q.numpy().copy()
        got = kernel(q, k, v, np.asarray(bounds), 0.25)
        np.testing.assert_allclose(got.numpy(), portable.vision_attention(q, k, v, np.asarray(bounds), 0.25).numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=f"segments {bounds}")
        np.testing.assert_array_equal(q.numpy(), before)
