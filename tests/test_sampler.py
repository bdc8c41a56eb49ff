"""Sampler semantics against numpy references (vLLM's order and formulas), seeded reproducibility
across batch compositions, and raw-distribution logprobs."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from fdplug.core.model.sampling import filters as sampling_filters  # noqa: E402
from fdplug.core.model.sampling.metadata import SamplingMetadata  # noqa: E402
from fdplug.core.model.sampling.penalties import apply_penalties, penalty_tokens, record_tokens  # noqa: E402
from fdplug.core.model.sampling.sampler import Sampler, seeded_uniforms  # noqa: E402

paddle.set_device("cpu")


def T(x) -> paddle.Tensor:
    return paddle.to_tensor(np.asarray(x, dtype=np.float32))


def kept(sampler: Sampler, logits, **params) -> list[set[int]]:
    """The token set each row may be drawn from, per ``process_logits``."""
    arr = np.asarray(logits, np.float32)
    out = sampler.process_logits(T(arr), SamplingMetadata.make(arr.shape[0], **params)).numpy()
    return [set(np.nonzero(np.isfinite(row))[0].tolist()) for row in out]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# ------------------------------------------------------------------------------------------------
# greedy
# ------------------------------------------------------------------------------------------------


def test_greedy_is_argmax_with_ties_to_lowest_id():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((16, 500)).astype(np.float32)
    logits[3, [7, 100, 400]] = 50.0
    meta = SamplingMetadata.make(16, temperature=np.where(np.arange(16) % 2, 0.0, 1e-6), top_k=3, top_p=0.1,
                                 min_p=0.5)
    assert meta.all_greedy
    out = Sampler(0)(T(logits), meta)
    assert out.sampled_token_ids.dtype == np.int64
    np.testing.assert_array_equal(out.sampled_token_ids, logits.argmax(axis=1))
    assert out.sampled_token_ids[3] == 7 and out.sampled_logprobs is None


def test_mixed_batch_keeps_greedy_rows_greedy():
    rng = np.random.default_rng(1)
    logits = rng.standard_normal((10, 300)).astype(np.float32)
    temps = np.array([0, 1, 0, 1, 0, 1, 0, 1, 0, 1], np.float32)
    seeds = np.arange(10) * 31 + 5
    meta = SamplingMetadata.make(10, temperature=temps, seeded=True, seeds=seeds)
    tokens = Sampler(0)(T(logits), meta).sampled_token_ids
    np.testing.assert_array_equal(tokens[temps == 0], logits[temps == 0].argmax(axis=1))
    rand = temps == 1   # and the random rows get the draws they get without the greedy rows
    alone = Sampler(1)(T(logits[rand]), SamplingMetadata.make(5, seeded=True, seeds=seeds[rand])).sampled_token_ids
    np.testing.assert_array_equal(tokens[rand], alone)


# ------------------------------------------------------------------------------------------------
# distributions
# ------------------------------------------------------------------------------------------------

LOGITS8 = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)
CHI2_DF7_P001 = 24.32


@pytest.mark.parametrize("seeded", [False, True])
def test_temperature_matches_softmax(seeded):
    n, temp = 4000, 0.7
    meta = SamplingMetadata.make(n, temperature=temp, seeded=seeded, seeds=np.arange(n) * 7919 + 3)
    tokens = Sampler(123)(T(np.tile(LOGITS8, (n, 1))), meta).sampled_token_ids
    counts = np.bincount(tokens, minlength=8)
    assert chi2(counts, softmax(LOGITS8 / temp)) < CHI2_DF7_P001


def test_window_draw_matches_renormalised_top_k():
    """Rows bounded by top_k are drawn on the host from the topk window: same law, renormalised."""
    n, temp = 4000, 1.3
    meta = SamplingMetadata.make(n, temperature=temp, top_k=5)
    tokens = Sampler(7)(T(np.tile(LOGITS8, (n, 1))), meta).sampled_token_ids
    assert set(tokens.tolist()) <= {0, 1, 2, 3, 4}
    chi = chi2(np.bincount(tokens, minlength=5)[:5], softmax(LOGITS8[:5] / temp))
    assert chi < 18.47   # df 4, p = 0.001


def test_seeded_uniforms_are_uniform_and_keyed_on_seed_and_step():
    u = seeded_uniforms(np.arange(20000), np.zeros(20000, np.int64))
    assert ((u > 0) & (u <= 1)).all()
    counts = np.histogram(u, bins=10, range=(0, 1))[0]
    assert chi2(counts, np.full(10, 0.1)) < 27.88   # df 9, p = 0.001
    a = seeded_uniforms(np.array([5, 5, 6, -1]), np.array([0, 1, 0, 0]))
    assert len(set(a.tolist())) == 4
    # pinned: every seeded request's tokens hang on these, so a change to the hash must be deliberate
    np.testing.assert_array_equal(a, [0.5037724649123898, 0.40756624255114315, 0.9969967249977721,
                                      0.09868686802663162])


# ------------------------------------------------------------------------------------------------
# filters
# ------------------------------------------------------------------------------------------------


def test_top_k_membership_and_off_values():
    rng = np.random.default_rng(2)
    logits = rng.standard_normal((6, 50)).astype(np.float32)
    sets = kept(Sampler(), logits, top_k=np.array([1, 3, 10, 0, 50, 99]), temperature=0.9)
    for row, k in zip(range(6), [1, 3, 10, 50, 50, 50]):
        assert sets[row] == set(np.argsort(-logits[row])[:k].tolist())
    meta = SamplingMetadata.make(200, top_k=3)
    tokens = Sampler(1)(T(np.tile(logits[0], (200, 1))), meta).sampled_token_ids
    assert set(tokens.tolist()) <= set(np.argsort(-logits[0])[:3].tolist())


def test_top_k_keeps_ties_at_the_boundary():
    assert kept(Sampler(), [[3.0, 2.0, 2.0, 2.0, 1.0]], top_k=2) == [{0, 1, 2, 3}]


@pytest.mark.parametrize(("probs", "top_p", "expected"), [
    ([0.4, 0.3, 0.2, 0.1], 0.6, {0, 1}),
    ([0.4, 0.3, 0.2, 0.1], 0.75, {0, 1, 2}),
    ([0.4, 0.3, 0.2, 0.1], 0.35, {0}),
    ([0.1, 0.2, 0.4, 0.3], 0.6, {2, 3}),          # order in the vocabulary does not matter
    ([0.4, 0.2, 0.2, 0.2], 0.5, {0, 1, 2, 3}),    # a tie straddling the cut: all kept
    ([0.4, 0.2, 0.2, 0.2], 0.3, {0}),
    ([0.4, 0.3, 0.2, 0.1], 1.0, {0, 1, 2, 3}),
])
def test_top_p_keeps_the_minimal_nucleus(probs, top_p, expected):
    assert kept(Sampler(), [np.log(probs)], top_p=top_p) == [expected]


def test_top_p_applies_to_the_top_k_renormalised_distribution():
    logits = np.log([[0.3, 0.25, 0.2, 0.15, 0.1]])
    # top-2 renormalised: 0.545, 0.455 -> 0.545 alone reaches 0.5 (the raw 0.3 would not)
    assert kept(Sampler(), logits, top_k=2, top_p=0.5) == [{0}]
    assert kept(Sampler(), logits, top_p=0.5) == [{0, 1}]


def test_min_p_scales_with_the_top_probability_after_temperature():
    logits = np.log([[0.5, 0.3, 0.15, 0.05]])
    assert kept(Sampler(), logits, min_p=0.5) == [{0, 1}]        # 0.3 >= 0.25
    assert kept(Sampler(), logits, min_p=0.2) == [{0, 1, 2}]     # 0.15 >= 0.1
    assert kept(Sampler(), logits, min_p=1.0) == [{0}]
    # temperature 0.5 squares the odds: p ~ [.5^2, .3^2, ...] -> 0.09/0.25 = 0.36 >= 0.3
    assert kept(Sampler(), logits, min_p=0.3, temperature=0.5) == [{0, 1}]
    assert kept(Sampler(), logits, min_p=0.4, temperature=0.5) == [{0}]


def reference_kept(logits: np.ndarray, temp: float, top_k: int, top_p: float, min_p: float, eps: float):
    """vLLM's filters in float64, with top_p moved by ``eps``; returns the kept mask."""
    x = logits.astype(np.float64) / temp
    keep = np.ones(x.shape, bool)
    if min_p > 0:
        p = softmax(x)
        keep &= p >= min_p * p.max()
    if 0 < top_k < x.size:
        keep &= x >= np.sort(x)[::-1][top_k - 1]
    if top_p < 1:
        p = np.where(keep, np.exp(x - x.max()), 0)
        p /= p.sum()
        srt = np.sort(p)[::-1]
        j = np.searchsorted(np.cumsum(srt), top_p + eps)
        keep &= p >= srt[min(j, len(srt) - 1)]
    return keep


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**31), temp=st.floats(0.3, 2.0), top_k=st.sampled_from([0, 1, 5, 40, 300]),
       top_p=st.sampled_from([1.0, 0.3, 0.8, 0.95, 0.999]), min_p=st.sampled_from([0.0, 0.01, 0.2]),
       scale=st.sampled_from([0.2, 1.0, 4.0]))
def test_filters_match_reference(seed, temp, top_k, top_p, min_p, scale):
    """Random distributions, flat (nucleus wider than the window: full-sort fallback) to peaked."""
    logits = (np.random.default_rng(seed).standard_normal(600) * scale).astype(np.float32)
    with mock.patch.object(sampling_filters, "TOP_P_WINDOW", 32):
        got = kept(Sampler(), [logits], temperature=temp, top_k=top_k, top_p=top_p, min_p=min_p)[0]
    loose = set(np.nonzero(reference_kept(logits, temp, top_k, top_p, min_p, 1e-4))[0].tolist())
    tight = set(np.nonzero(reference_kept(logits, temp, top_k, top_p, min_p, -1e-4))[0].tolist())
    assert tight <= got <= loose


# ------------------------------------------------------------------------------------------------
# penalties
# ------------------------------------------------------------------------------------------------


def reference_penalties(logits, prompt_mask, counts, rep, freq, pres):
    out = logits.astype(np.float32).copy()
    seen = prompt_mask | (counts > 0)
    factor = np.where(seen, rep[:, None], 1.0).astype(np.float32)
    out = np.where(out > 0, out / factor, out * factor)
    out = out - freq[:, None] * counts.astype(np.float32)
    return out - pres[:, None] * (counts > 0)


def test_penalties_match_the_dense_formula():
    rng = np.random.default_rng(3)
    n, vocab, width = 5, 400, 64
    logits = rng.standard_normal((n, vocab)).astype(np.float32) * 3
    prompt_mask = np.zeros((n, vocab), bool)
    counts = np.zeros((n, vocab), np.int32)
    ids, cnts = np.full((n, width), -1, np.int64), np.zeros((n, width), np.int32)
    for row in range(n):
        prompt = rng.integers(0, vocab, 20)
        output = rng.integers(0, vocab, 15)
        prompt_mask[row, prompt] = True
        np.add.at(counts[row], output, 1)
        i, c = penalty_tokens(prompt, output)
        ids[row, :len(i)], cnts[row, :len(c)] = i, c
    rep = np.array([1.0, 1.3, 0.8, 1.0, 1.2], np.float32)
    freq = np.array([0.0, 0.5, 0.0, -0.2, 0.1], np.float32)
    pres = np.array([0.0, 0.0, 1.0, 0.3, 0.4], np.float32)
    meta = SamplingMetadata.make(n, temperature=0.0, repetition_penalty=rep, frequency_penalty=freq,
                                 presence_penalty=pres, penalty_token_ids=ids, penalty_token_counts=cnts)
    want = reference_penalties(logits, prompt_mask, counts, rep, freq, pres)
    x = T(logits)
    np.testing.assert_allclose(apply_penalties(x, meta).numpy(), want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(x.numpy(), logits)                       # not in place by default
    np.testing.assert_allclose(Sampler().process_logits(x, meta).numpy(), want, rtol=1e-6, atol=1e-6)
    tokens = Sampler()(x, meta).sampled_token_ids                           # greedy on penalised logits
    np.testing.assert_array_equal(tokens, want.argmax(axis=1))


def test_record_tokens_keeps_distinct_ids_and_counts():
    rng = np.random.default_rng(4)
    slots, width = 4, 64
    ids, counts = np.full((slots, width), -1, np.int64), np.zeros((slots, width), np.int32)
    num = np.zeros(slots, np.int64)
    prompts = [rng.integers(0, 30, 5) for _ in range(slots)]
    for s, prompt in enumerate(prompts):
        i, c = penalty_tokens(prompt)
        ids[s, :len(i)], counts[s, :len(c)], num[s] = i, c, len(i)
    outputs = [[] for _ in range(slots)]
    for _ in range(20):
        active = np.array([0, 2, 3])
        tokens = rng.integers(0, 30, 3)
        record_tokens(ids, counts, num, active, tokens)
        for s, tok in zip(active, tokens):
            outputs[s].append(int(tok))
    for s in range(slots):
        i, c = penalty_tokens(prompts[s], outputs[s])
        order = np.argsort(ids[s, :num[s]])
        np.testing.assert_array_equal(ids[s, :num[s]][order], i)
        np.testing.assert_array_equal(counts[s, :num[s]][order], c)
        assert (ids[s, num[s]:] == -1).all()


# ------------------------------------------------------------------------------------------------
# seeds
# ------------------------------------------------------------------------------------------------

POOL = (np.random.default_rng(10).standard_normal((6, 300)) * 3).astype(np.float32)


def run_rows(rows: list[dict], sampler: Sampler) -> np.ndarray:
    """One batch: row i draws from ``POOL[row["src"]]`` with its own parameters, seed and step."""
    logits = T(np.stack([POOL[r["src"]] for r in rows]))
    meta = SamplingMetadata.make(
        len(rows), temperature=[r["temperature"] for r in rows], top_k=[r["top_k"] for r in rows],
        top_p=[r["top_p"] for r in rows], min_p=[r["min_p"] for r in rows],
        seeds=[r["seed"] or 0 for r in rows], seeded=[r["seed"] is not None for r in rows],
        steps=[r["step"] for r in rows])
    return sampler(logits, meta).sampled_token_ids


ROW = st.fixed_dictionaries({
    "src": st.integers(0, len(POOL) - 1), "temperature": st.sampled_from([0.0, 0.7, 1.0, 1.5]),
    "top_k": st.sampled_from([0, 1, 5, 50]), "top_p": st.sampled_from([1.0, 0.9, 0.5]),
    "min_p": st.sampled_from([0.0, 0.05]), "seed": st.one_of(st.none(), st.integers(0, 2**62)),
    "step": st.integers(0, 50)})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(rows=st.lists(ROW, min_size=1, max_size=6), others=st.lists(ROW, max_size=6), order_seed=st.integers(0, 1000))
def test_seeded_rows_ignore_batch_composition_and_order(rows, others, order_seed):
    alone = run_rows(rows, Sampler(1))
    batch = rows + others
    order = np.random.default_rng(order_seed).permutation(len(batch))
    mixed = run_rows([batch[i] for i in order], Sampler(2))
    back = np.empty(len(batch), np.int64)
    back[order] = mixed
    for i, row in enumerate(rows):
        if row["seed"] is not None or row["temperature"] == 0:
            assert back[i] == alone[i], row


def test_paddle_kernels_give_the_same_tokens_as_the_numpy_cpu_shortcuts():
    """The topk / sort path other devices take (different tie choices) draws the same tokens."""
    rng = np.random.default_rng(8)
    rows = [{"src": int(rng.integers(len(POOL))), "temperature": float(rng.choice([0.5, 1.0, 1.7])),
             "top_k": int(rng.choice([0, 1, 7, 60])), "top_p": float(rng.choice([1.0, 0.5, 0.9, 0.99])),
             "min_p": float(rng.choice([0.0, 0.05])), "seed": int(rng.integers(2**62)), "step": i} for i in range(60)]
    numpy_path = run_rows(rows, Sampler(0))
    with mock.patch.object(sampling_filters, "_on_cpu", lambda x: False):
        np.testing.assert_array_equal(run_rows(rows, Sampler(0)), numpy_path)


def test_seeded_draws_change_with_step_and_repeat_after_preemption():
    rows = [{"src": 0, "temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "seed": 42, "step": s}
            for s in range(40)]
    first = run_rows(rows, Sampler(0))
    assert len(set(first.tolist())) > 10
    np.testing.assert_array_equal(run_rows(rows[25:], Sampler(9)), first[25:])   # recomputed from step 25


# ------------------------------------------------------------------------------------------------
# logprobs
# ------------------------------------------------------------------------------------------------


def test_logprobs_come_from_the_raw_distribution():
    rng = np.random.default_rng(6)
    n, vocab = 6, 300
    logits = (rng.standard_normal((n, vocab)) * 2).astype(np.float32)
    logits[0, [10, 20]] = 9.0   # a tie in the top N
    ids, cnts = np.full((n, 4), -1, np.int64), np.zeros((n, 4), np.int32)
    ids[:, :2], cnts[:, :2] = [3, 10], [2, 0]
    meta = SamplingMetadata.make(n, temperature=np.array([0, 0.7, 1, 1.5, 0, 1], np.float32), top_k=20,
                                 repetition_penalty=1.5, frequency_penalty=0.3, penalty_token_ids=ids,
                                 penalty_token_counts=cnts, num_logprobs=np.array([5, 0, -1, 3, 20, 25]))
    x = T(logits)
    out = Sampler(3)(x, meta)
    np.testing.assert_array_equal(x.numpy(), logits)   # penalties not applied in place: raw is needed
    raw = logits.astype(np.float64) - np.log(np.exp(logits.astype(np.float64)).sum(axis=1, keepdims=True))
    tok = out.sampled_token_ids
    np.testing.assert_allclose(out.sampled_logprobs, raw[np.arange(n), tok], atol=2e-5)
    np.testing.assert_array_equal(out.sampled_ranks, (raw >= raw[np.arange(n), tok][:, None]).sum(axis=1))
    assert out.top_token_ids.shape == (n, 20) and out.top_logprobs.shape == (n, 20)
    for row in range(n):
        want = np.lexsort((np.arange(vocab), -logits[row]))[:20]
        np.testing.assert_array_equal(out.top_token_ids[row], want)
        np.testing.assert_allclose(out.top_logprobs[row], raw[row, want], atol=2e-5)
    assert list(out.top_token_ids[0, :2]) == [10, 20]


def test_penalties_apply_in_place_when_no_logprobs_are_asked():
    logits = np.array([[1.0, 2.0, -1.0]], np.float32)
    meta = SamplingMetadata.make(1, temperature=0.0, repetition_penalty=4.0,
                                 penalty_token_ids=np.array([[1, 2]]), penalty_token_counts=np.zeros((1, 2), np.int32))
    x = T(logits)
    assert Sampler()(x, meta).sampled_token_ids[0] == 0
    np.testing.assert_allclose(x.numpy(), [[1.0, 0.5, -4.0]])


def test_metadata_flags_and_rows():
    meta = SamplingMetadata.make(3, temperature=np.array([0, 1, 0.5], np.float32), num_logprobs=np.array([-1, 30, 2]))
    assert not meta.all_greedy and not meta.all_random and meta.no_penalties
    assert meta.max_num_logprobs == 20
    sub = meta.rows(np.array([2, 1]))
    assert sub.all_random and list(sub.temperature) == [0.5, 1.0]
    assert SamplingMetadata.make(2, repetition_penalty=1.1).no_penalties   # no tokens listed
