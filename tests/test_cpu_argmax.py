"""The cpu plugin's ``argmax`` kernel (csrc/argmax.c) against numpy's definition with NaN left out."""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.plugins.cpu import kernels, native_argmax

pytestmark = pytest.mark.skipif(kernels.unavailable_reason() is not None, reason="the cpu kernels do not build here")


def _definition(x: np.ndarray) -> np.ndarray:
    """The lowest index of each row's largest non-NaN value; 0 for a row with none."""
    filled = np.where(np.isnan(x), -np.inf, x)
    return filled.argmax(axis=1).astype(np.int64)


@pytest.mark.parametrize("rows, cols", [(1, 1), (2, 15), (5, 16), (7, 17), (64, 32000), (3, 151_936)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_argmax_is_the_first_largest_value(rows, cols, threads):
    rng = np.random.default_rng(rows * cols)
    x = rng.integers(-2, 3, (rows, cols)).astype(np.float32)      # ties everywhere
    x[0, rng.integers(0, cols, 3)] = np.nan
    got = native_argmax.argmax(paddle.to_tensor(x), threads)
    np.testing.assert_array_equal(got, _definition(x))


def test_argmax_at_every_short_length():
    """Lengths 1..40: the vector lanes (16 a step, as two sets of 8 with AVX2), the scalar tail, and
    ties, NaN and all-NaN rows on either side of where the tail starts."""
    rng = np.random.default_rng(40)
    for cols in range(1, 41):
        x = rng.integers(-3, 4, (12, cols)).astype(np.float32)          # ties in most rows
        x[1] = np.nan
        x[2, rng.integers(0, cols, 1 + cols // 3)] = np.nan
        x[3, :] = -np.inf
        x[3, -1] = -1.0                                                 # the only finite value is the last
        x[4, :] = np.where(np.arange(cols) % 2 == 0, np.nan, 2.0)        # equal maxima between NaNs
        x[5, :] = 0.0
        x[5, cols // 2:] = 5.0                                          # the first of equal maxima is mid-row
        x[6, rng.integers(0, cols)] = np.inf
        x[7, :] = np.nan
        x[7, -1] = -np.inf                                              # NaN then -inf: the -inf
        for threads in (1, 2):
            got = native_argmax.argmax(paddle.to_tensor(x), threads)
            np.testing.assert_array_equal(got, _definition(x), err_msg=f"{cols} columns, {threads} threads")


def test_argmax_at_the_ends_of_the_float_range():
    x = np.array([[np.nan, 1.0, np.nan, 9.0] + [0.0] * 30,
                  [-np.inf] * 34,
                  [np.nan] * 34,
                  [np.inf, np.inf] + [0.0] * 32,
                  [0.0] * 33 + [np.inf],
                  [-0.0, 0.0] + [-1.0] * 32], dtype=np.float32)
    got = native_argmax.argmax(paddle.to_tensor(x), 2)
    np.testing.assert_array_equal(got, [3, 0, 0, 0, 33, 0])
    np.testing.assert_array_equal(got, paddle.to_tensor(x).argmax(axis=1).numpy())   # paddle's own rule


def test_argmax_takes_the_portable_path_for_other_inputs():
    x = paddle.to_tensor(np.array([[1.0, 3.0, 2.0]]), dtype="float64")
    np.testing.assert_array_equal(native_argmax.argmax(x, 2), [1])
