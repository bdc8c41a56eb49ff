"""The Blackwell MoE dispatch plans against an independent numpy reference (a loop over assignments).

Cases cover T = 1 and T = 0, experts that get no tokens, E that divides nothing, DeepGEMM's alignment
of 128 and an alignment of 4 (so experts span several blocks), and a full round trip through a
per-expert linear map in both layouts.
"""

from __future__ import annotations

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fdplug.plugins.blackwell_moe.dispatch import (
    ALIGNMENT,
    ContiguousPlan,
    MaskedPlan,
    combine,
    gather_rows,
    plan_contiguous,
    plan_masked,
)

CASES = [  # (T, K, E, alignment); E = 13 with K = 2 and T = 3 leaves most experts empty
    (1, 1, 1, ALIGNMENT), (1, 4, 7, ALIGNMENT), (0, 2, 5, ALIGNMENT), (3, 2, 13, 4),
    (37, 3, 11, 4), (50, 8, 9, ALIGNMENT), (200, 2, 3, ALIGNMENT), (64, 6, 17, 4),
]


def _topk(t: int, k: int, e: int, seed: int) -> np.ndarray:
    """Distinct experts per token, like real top-k; skewed so some experts are busier."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(e, 0.5))
    ids = [rng.choice(e, size=k, replace=False, p=p) for _ in range(t)]
    return np.array(ids, np.int64).reshape(t, k)


def ref_contiguous(ids: np.ndarray, e: int, align: int):
    flat = ids.reshape(-1)
    counts = np.bincount(flat, minlength=e)
    padded = -(-counts // align) * align
    start = np.concatenate([[0], np.cumsum(padded)[:-1]])
    m = int(padded.sum())
    rows, token, m_idx = np.zeros(flat.size, np.int64), np.zeros(m, np.int64), np.full(m, -1, np.int32)
    used = np.zeros(e, np.int64)
    for a, ex in enumerate(flat):  # increasing flat assignment order
        r = start[ex] + used[ex]
        used[ex] += 1
        rows[a], token[r], m_idx[r] = r, a // ids.shape[1], ex
    return rows, token, m_idx, counts, m


def ref_masked(ids: np.ndarray, e: int, cap: int):
    flat = ids.reshape(-1)
    rows, token, used = np.zeros(flat.size, np.int64), np.zeros(e * cap, np.int64), np.zeros(e, np.int32)
    for a, ex in enumerate(flat):
        r = ex * cap + used[ex]
        used[ex] += 1
        rows[a], token[r] = r, a // ids.shape[1]
    return rows, token, used


def ref_combine(y: np.ndarray, rows: np.ndarray, w: np.ndarray) -> np.ndarray:
    t, k = w.shape
    out = np.zeros((t, y.shape[1]), np.float32)
    for i in range(t):
        for j in range(k):
            out[i] += w[i, j] * y[rows[i * k + j]]
    return out


def _eq(tensor, expected, dtype) -> None:
    got = tensor.numpy()
    assert got.dtype == dtype and got.shape == expected.shape
    np.testing.assert_array_equal(got, expected)


def _plans(t, k, e, align, seed):
    ids = _topk(t, k, e, seed)
    cap = max(t, 1) + 3
    return ids, cap, plan_contiguous(paddle.to_tensor(ids), e, align), plan_masked(paddle.to_tensor(ids), e, cap)


@pytest.mark.parametrize("case", CASES)
def test_plans_match_reference(case):
    t, k, e, align = case
    ids, cap, cp, mp = _plans(t, k, e, align, seed=t * 31 + e)
    rows, token, m_idx, counts, m = ref_contiguous(ids, e, align)
    assert isinstance(cp, ContiguousPlan) and cp.num_rows == m and m % align == 0
    _eq(cp.rows, rows, np.int64)
    _eq(cp.token_of_row, token, np.int64)
    _eq(cp.m_indices, m_idx, np.int32)
    _eq(cp.counts, counts, np.int64)
    mrows, mtoken, used = ref_masked(ids, e, cap)
    assert isinstance(mp, MaskedPlan) and mp.capacity == cap
    _eq(mp.rows, mrows, np.int64)
    _eq(mp.token_of_row, mtoken, np.int64)
    _eq(mp.masked_m, used, np.int32)


def test_int32_ids_and_multiple_blocks():
    ids = np.array([[0, 2], [2, 0], [2, 1], [0, 2], [2, 0], [1, 2]], np.int32)
    plan = plan_contiguous(paddle.to_tensor(ids), 4, alignment=4)
    rows, _, m_idx, counts, m = ref_contiguous(ids.astype(np.int64), 4, 4)
    assert plan.num_rows == m == 16  # expert 2 (6 rows) spans two blocks, expert 3 takes none
    _eq(plan.rows, rows, np.int64)
    _eq(plan.m_indices, m_idx, np.int32)
    _eq(plan.counts, counts, np.int64)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", ["float32", "int32", "uint8"])
def test_gather_rows_zeroes_padding(case, dtype):
    t, k, e, align = case
    ids, cap, cp, mp = _plans(t, k, e, align, seed=t + 7)
    rng = np.random.default_rng(t + 1)
    x = (rng.integers(1, 250, size=(t, 3, 2)) if dtype != "float32" else rng.standard_normal((t, 3, 2)) + 5)
    x = x.astype(dtype)
    for plan, ref in ((cp, ref_contiguous(ids, e, align)), (mp, ref_masked(ids, e, cap))):
        rows, token = ref[0], ref[1]
        expected = np.zeros((token.size, 3, 2), dtype)  # padding / unused rows stay exactly zero
        expected[rows] = x[np.arange(rows.size) // k]
        _eq(gather_rows(paddle.to_tensor(x), plan), expected, np.dtype(dtype))


@pytest.mark.parametrize("case", CASES)
def test_combine_matches_reference(case):
    t, k, e, align = case
    _, cap, cp, mp = _plans(t, k, e, align, seed=t + 99)
    rng = np.random.default_rng(t + 2)
    w = rng.random((t, k)).astype(np.float32)
    for plan, size in ((cp, cp.num_rows), (mp, e * cap)):
        y = rng.standard_normal((size, 16)).astype(np.float32)
        out = combine(paddle.to_tensor(y), plan, paddle.to_tensor(w))
        assert out.shape == [t, 16] and out.dtype == paddle.float32
        np.testing.assert_allclose(out.numpy(), ref_combine(y, plan.rows.numpy(), w), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_round_trip_through_expert_linear_maps(case):
    t, k, e, align = case
    ids, cap, cp, mp = _plans(t, k, e, align, seed=t + 5)
    rng = np.random.default_rng(t + 3)
    x = rng.standard_normal((t, 8)).astype(np.float32)
    experts = rng.standard_normal((e, 6, 8)).astype(np.float32)
    w = rng.random((t, k)).astype(np.float32)
    direct = np.zeros((t, 6), np.float32)
    for i in range(t):
        for j in range(k):
            direct[i] += w[i, j] * (x[i] @ experts[ids[i, j]].T)

    a = gather_rows(paddle.to_tensor(x), cp).numpy()
    m_idx = cp.m_indices.numpy()
    y = np.einsum("rh,roh->ro", a, experts[np.maximum(m_idx, 0)]) * (m_idx >= 0)[:, None]  # row r: its expert
    got = combine(paddle.to_tensor(y), cp, paddle.to_tensor(w)).numpy()
    np.testing.assert_allclose(got, direct, rtol=1e-5, atol=1e-5)

    grid = gather_rows(paddle.to_tensor(x), mp).numpy().reshape(e, cap, 8)
    y = np.einsum("ech,eoh->eco", grid, experts).reshape(e * cap, 6)
    assert not np.any(y.reshape(e, cap, 6)[np.arange(cap)[None] >= mp.masked_m.numpy()[:, None]])
    got = combine(paddle.to_tensor(y.astype(np.float32)), mp, paddle.to_tensor(w)).numpy()
    np.testing.assert_allclose(got, direct, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad", [-1, 6, 40])
def test_out_of_range_id_names_it(bad):
    ids = paddle.to_tensor(np.array([[0, 1], [bad, 2]], np.int64))
    for plan in (lambda: plan_contiguous(ids, 6), lambda: plan_masked(ids, 6, 8)):
        with pytest.raises(ValueError, match=rf"expert id {bad}\b"):
            plan()


def test_capacity_overflow_says_how_many():
    ids = paddle.to_tensor(np.array([[3, 0], [3, 1], [3, 2], [1, 3], [3, 0]], np.int64))
    with pytest.raises(ValueError, match=r"expert 3 got 5 assignments.*capacity of 4.*num_max_dispatch_tokens"):
        plan_masked(ids, 4, capacity=4)
    assert plan_masked(ids, 4, capacity=5).masked_m.numpy().tolist() == [2, 2, 1, 5]
