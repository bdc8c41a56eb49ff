"""The cpu plugin's ``rope`` and ``add_rms_norm`` kernels (csrc/rms_norm.c) against their definitions."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.core.model.checkpoint.rope import RopeConfig
from fdplug.core.model.layers.basic import RotaryEmbedding
from fdplug.core.portable import ops as portable
from fdplug.plugins.cpu import kernels, native_norms

pytestmark = pytest.mark.skipif(kernels.unavailable_reason() is not None, reason="the cpu kernels do not build here")


@pytest.mark.parametrize("tokens", [1, 3, 700])      # 700 x 4 heads: above ROPE_MIN_PARALLEL_ROWS, two threads
def test_rope_is_paddles_four_ops_bit_for_bit(tokens):
    rng = np.random.default_rng(tokens)
    rotary = RotaryEmbedding(RopeConfig(theta=1e6), 32, 8192, "float32", heads=4)
    cos, sin = rotary.lookup(paddle.to_tensor(rng.integers(0, 8192, tokens)))
    x = paddle.to_tensor(rng.standard_normal((tokens, 4, 32), dtype=np.float32) * 30)
    expected = (x * cos + paddle.roll(x, 16, axis=-1) * sin).numpy()
    for threads in (1, 2):
        np.testing.assert_array_equal(native_norms.rope(x, cos, sin, threads).numpy(), expected)


def test_rope_takes_the_portable_path_where_the_kernel_does_not_apply():
    x = paddle.ones([2, 3, 6], dtype="float64")
    cos, sin = paddle.ones([2, 3, 6], dtype="float64"), paddle.zeros([2, 3, 6], dtype="float64")
    out = native_norms.rope(x, cos, sin, 2)
    assert out.dtype == paddle.float64 and np.array_equal(out.numpy(), x.numpy())
    odd = paddle.to_tensor(np.arange(10, dtype=np.float32).reshape(2, 1, 5))   # odd D: paddle's roll, as defined
    np.testing.assert_array_equal(native_norms.rope(odd, odd, odd, 2).numpy(), portable.rope(odd, odd, odd).numpy())


@pytest.mark.parametrize("rows", [1, 5, 200])          # 200 rows: above RMS_NORM_MIN_PARALLEL_ROWS
def test_add_rms_norm_is_the_sum_and_the_rms_norm_kernel_on_it(rows):
    rng = np.random.default_rng(rows)
    x, residual = (paddle.to_tensor(rng.standard_normal((rows, 72), dtype=np.float32)) for _ in range(2))
    weight = paddle.to_tensor(rng.standard_normal(72, dtype=np.float32))
    for threads in (1, 2):
        out, total = native_norms.add_rms_norm(x, residual, weight, 1e-5, threads)
        np.testing.assert_array_equal(total.numpy(), x.numpy() + residual.numpy())
        np.testing.assert_array_equal(out.numpy(), native_norms.rms_norm(total, weight, 1e-5, threads).numpy())


def test_add_rms_norm_takes_the_portable_path_for_other_shapes():
    x = paddle.ones([3, 8])
    out, total = native_norms.add_rms_norm(x, paddle.ones([1, 8]), paddle.ones([8]), 1e-6, 2)   # broadcast residual
    np.testing.assert_array_equal(total.numpy(), np.full((3, 8), 2, np.float32))
    np.testing.assert_allclose(out.numpy(), np.ones((3, 8)), rtol=1e-6)
