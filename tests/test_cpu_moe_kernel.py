"""The cpu device's compiled MoE experts (`native_moe.pack_experts` / `native_moe.moe_experts`).

Against a float64 numpy reference written from the formula, on shapes that reach every path of the
C code (narrow last panels when H or I is no multiple of 8 or 16, tiles of every row count, groups
of one expert's rows cut in several, experts with no token, the final sum over k); then the
determinism contract: a token's row is bit for bit the same alone or in a batch, on 1 or more
threads; and with scratch so small that every few tokens make a chunk. The AVX2 build (6-row
tiles) and the portable C build run this file in tests/test_cpu_isa.py's capped levels.
"""

from __future__ import annotations

import numpy as np
import paddle
import pytest

from fdplug.plugins.cpu import kernels, native_moe

if kernels.compiler() is None:  # the reference still serves; say so rather than fail on a compiler-less box
    pytest.skip("no C compiler on PATH: the compiled cpu kernels cannot be built here", allow_module_level=True)


def _experts(rng, num_experts, hidden, inter):
    gate = rng.standard_normal((num_experts, inter, hidden)) / np.sqrt(hidden)
    up = rng.standard_normal((num_experts, inter, hidden)) / np.sqrt(hidden)
    down = rng.standard_normal((num_experts, hidden, inter)) / np.sqrt(inter)
    return [w.astype(np.float32) for w in (gate, up, down)]


def _routing(rng, tokens, top_k, num_experts, allowed=None):
    pool = np.arange(num_experts) if allowed is None else np.asarray(allowed)
    ids = np.stack([rng.choice(pool, top_k, replace=False) for _ in range(tokens)]) if tokens else \
        np.zeros((0, top_k))
    weights = rng.random((tokens, top_k))
    return ids.astype(np.int32).reshape(tokens, top_k), weights.astype(np.float32).reshape(tokens, top_k)


def _reference(x, gate, up, down, ids, weights):
    """out[t] = sum_k w[t,k] * down_e(silu(gate_e x_t) * up_e x_t), in float64."""
    x, gate, up, down = (a.astype(np.float64) for a in (x, gate, up, down))
    out = np.zeros_like(x)
    for k in range(ids.shape[1]):
        e = ids[:, k]
        g = np.einsum("tih,th->ti", gate[e], x)
        u = np.einsum("tih,th->ti", up[e], x)
        out += weights[:, k:k + 1] * np.einsum("thi,ti->th", down[e], g / (1 + np.exp(-g)) * u)
    return out


def _run(packed, x, ids, weights, threads):
    return native_moe.moe_experts(paddle.to_tensor(x), packed, ids, weights, threads).numpy()


def _pack(gate, up, down):
    return native_moe.pack_experts(paddle.to_tensor(gate), paddle.to_tensor(up), paddle.to_tensor(down))


def _assert_matches(got, want):
    assert got.dtype == np.float32 and got.shape == want.shape
    scale = max(float(np.abs(want).max()), 1e-30) if want.size else 1.0
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * scale)


# tokens, top_k, experts, hidden, inter: odd H and I (narrow last panels, H < 8, H < 16), E = 1,
# K = E, one expert's 600 rows cut in groups, a batch of 300 over 7 experts.
SHAPES = [(1, 1, 1, 8, 8), (1, 4, 4, 37, 50), (5, 2, 4, 37, 50), (64, 8, 8, 33, 17), (20, 4, 4, 16, 24),
          (300, 3, 7, 64, 40), (600, 1, 1, 5, 3), (77, 2, 3, 130, 9), (13, 16, 16, 24, 16)]


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "T{}-K{}-E{}-H{}-I{}".format(*s))
def test_moe_experts_match_the_definition(shape, threads):
    tokens, top_k, num_experts, hidden, inter = shape
    rng = np.random.default_rng(sum(shape))
    gate, up, down = _experts(rng, num_experts, hidden, inter)
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    ids, weights = _routing(rng, tokens, top_k, num_experts)
    got = _run(_pack(gate, up, down), x, ids, weights, threads)
    _assert_matches(got, _reference(x, gate, up, down, ids, weights))


def test_experts_without_tokens_and_repeated_ids():
    rng = np.random.default_rng(5)
    gate, up, down = _experts(rng, 16, 40, 24)
    x = rng.standard_normal((30, 40)).astype(np.float32)
    ids, weights = _routing(rng, 30, 2, 16, allowed=[3, 15])  # 14 experts get nothing, the last one some
    packed = _pack(gate, up, down)
    _assert_matches(_run(packed, x, ids, weights, 2), _reference(x, gate, up, down, ids, weights))
    same = np.full((30, 3), 7, dtype=np.int32)  # one expert chosen three times by every token
    _assert_matches(_run(packed, x, same, weights[:, :1].repeat(3, 1), 2),
                    _reference(x, gate, up, down, same, weights[:, :1].repeat(3, 1)))


def test_no_tokens():
    rng = np.random.default_rng(6)
    packed = _pack(*_experts(rng, 4, 24, 16))
    out = native_moe.moe_experts(paddle.zeros([0, 24]), packed, np.zeros((0, 2), np.int32),
                                 np.zeros((0, 2), np.float32),
                              2)
    assert out.shape == [0, 24] and str(out.dtype) == "paddle.float32"


def test_packing_keeps_exactly_the_inputs_floats():
    rng = np.random.default_rng(7)
    gate, up, down = _experts(rng, 3, 37, 50)
    packed = _pack(gate, up, down)
    assert (packed.num_experts, packed.hidden, packed.inter) == (3, 37, 50)
    assert packed.gate_up.numel() + packed.down.numel() == gate.size + up.size + down.size
    packed_floats = np.concatenate([packed.gate_up.numpy().ravel(), packed.down.numpy().ravel()])
    np.testing.assert_array_equal(np.sort(packed_floats), np.sort(np.concatenate([gate.ravel(), up.ravel(),
                                                                                  down.ravel()])))  # a permutation


def _alone_equals_in_batch(packed, hidden, num_experts, seed):
    """64 tokens on 4 of the experts (16 to 48 rows each: 6-row tiles, more than one pass) against each token
    alone (a 1-row tile), and thread counts against each other: all bitwise equal."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((64, hidden)).astype(np.float32)
    ids, weights = _routing(rng, 64, 3, num_experts, allowed=range(min(4, num_experts)))
    batch = _run(packed, x, ids, weights, 2)
    for t in (0, 1, 13, 31, 62, 63):
        np.testing.assert_array_equal(_run(packed, x[t:t + 1], ids[t:t + 1], weights[t:t + 1], 1), batch[t:t + 1])
    for t0, t1 in ((0, 7), (5, 29), (40, 64)):  # and inside other batches
        np.testing.assert_array_equal(_run(packed, x[t0:t1], ids[t0:t1], weights[t0:t1], 2), batch[t0:t1])
    for threads in (1, 3, 8):
        np.testing.assert_array_equal(_run(packed, x, ids, weights, threads), batch)
    return x, ids, weights, batch


@pytest.mark.parametrize("hidden,inter", [(64, 48), (37, 50)])
def test_a_tokens_row_does_not_depend_on_the_batch_or_the_threads(hidden, inter):
    rng = np.random.default_rng(hidden)
    gate, up, down = _experts(rng, 6, hidden, inter)
    x, ids, weights, batch = _alone_equals_in_batch(_pack(gate, up, down), hidden, 6, seed=inter)
    _assert_matches(batch, _reference(x, gate, up, down, ids, weights))


def test_thread_counts_agree_bitwise_on_a_prefill_batch():
    rng = np.random.default_rng(8)
    gate, up, down = _experts(rng, 8, 96, 72)
    x = rng.standard_normal((300, 96)).astype(np.float32)
    ids, weights = _routing(rng, 300, 4, 8)
    packed = _pack(gate, up, down)
    one = _run(packed, x, ids, weights, 1)
    np.testing.assert_array_equal(_run(packed, x, ids, weights, 2), one)
    np.testing.assert_array_equal(_run(packed, x, ids, weights, 5), one)
    _assert_matches(one, _reference(x, gate, up, down, ids, weights))


def test_refuses_what_it_cannot_take():
    rng = np.random.default_rng(9)
    packed = _pack(*_experts(rng, 4, 16, 8))
    x = paddle.to_tensor(rng.standard_normal((3, 16)).astype(np.float32))
    weights = np.ones((3, 2), np.float32)
    for bad in (4, -1, 2**31 - 1, -2**31):
        ids = np.array([[0, 1], [2, 3], [1, bad]], dtype=np.int32)
        with pytest.raises(ValueError, match=f"expert id {bad} is outside"):
            native_moe.moe_experts(x, packed, ids, weights, 2)
    with pytest.raises(TypeError, match="int32"):
        native_moe.moe_experts(x, packed, np.zeros((3, 2), np.int64), weights, 2)
    with pytest.raises(ValueError, match="topk_ids and topk_weights"):
        native_moe.moe_experts(x, packed, np.zeros((2, 2), np.int32), weights[:2], 2)
    with pytest.raises(ValueError, match=r"x must be \[T, 16\]"):
        native_moe.moe_experts(paddle.zeros([3, 8]), packed, np.zeros((3, 2), np.int32), weights, 2)
    with pytest.raises(TypeError, match="float32"):
        native_moe.moe_experts(paddle.zeros([3, 16], dtype="float64"), packed, np.zeros((3, 2), np.int32), weights, 2)
    with pytest.raises(ValueError, match=r"down must be \[E, H, I\]"):
        native_moe.pack_experts(paddle.zeros([2, 8, 16]), paddle.zeros([2, 8, 16]), paddle.zeros([2, 8, 16]))
    # non-contiguous ids and float64 weights are converted, not misread
    ids = np.asfortranarray(np.array([[0, 1], [2, 3], [3, 0]], dtype=np.int32))
    want = native_moe.moe_experts(x, packed, np.ascontiguousarray(ids), weights, 1).numpy()
    np.testing.assert_array_equal(native_moe.moe_experts(x, packed, ids, weights.astype(np.float64), 1).numpy(), want)


def test_chunks_of_a_few_tokens_give_the_same_results():
    """Scratch so small (``fdplug_moe_scratch_bytes``) that every few tokens make a chunk of their own.
    (The kernel's AVX2 tiles and portable C are the builds tests/test_cpu_isa.py runs this file at.)"""
    library = kernels.load()
    before = library.fdplug_moe_scratch_bytes(20000)
    try:
        rng = np.random.default_rng(10)
        for tokens, top_k, num_experts, hidden, inter in ((40, 3, 5, 37, 50), (200, 2, 2, 24, 16)):
            gate, up, down = _experts(rng, num_experts, hidden, inter)
            x = rng.standard_normal((tokens, hidden)).astype(np.float32)
            ids, weights = _routing(rng, tokens, top_k, num_experts)
            _assert_matches(_run(_pack(gate, up, down), x, ids, weights, 2),
                            _reference(x, gate, up, down, ids, weights))
        _alone_equals_in_batch(_pack(*_experts(rng, 5, 37, 50)), 37, 5, seed=11)
        assert library.fdplug_moe_scratch_bytes(0) == 20000   # the cap these calls ran under
    finally:
        library.fdplug_moe_scratch_bytes(before)
