"""The CPU reference attention and MoE against their definitions, written out naively in numpy."""

from __future__ import annotations

import numpy as np
import pytest

from fdplug.core.portable.attention import ReferenceAttention
from fdplug.core.portable.moe import ReferenceMoE
from fdplug.errors import ConfigError
from fdplug.plugin_api.moe import ExpertWeights
from fdplug.testing.cases import (
    AttentionCase,
    SeqCase,
    attention_cases,
    moe_cases,
    naive_attention,
    naive_moe,
    run_attention,
    run_moe,
)


@pytest.mark.parametrize("case", attention_cases(seed=1), ids=lambda c: c.describe())
def test_reference_attention_matches_the_definition(case):
    for got, want in zip(run_attention(ReferenceAttention(), case), naive_attention(case)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)


def test_bidirectional_span_changes_the_output_only_inside_the_span():
    causal = AttentionCase(4, 2, 16, 16, [SeqCase(0, 20)], seed=5)
    spans = AttentionCase(4, 2, 16, 16, [SeqCase(0, 20, [(4, 12)])], seed=5)
    a, b = run_attention(ReferenceAttention(), causal)[-1], run_attention(ReferenceAttention(), spans)[-1]
    changed = np.abs(a - b).max(axis=(1, 2)) > 1e-6
    assert not changed[:4].any() and not changed[12:].any()
    assert changed[4:11].all()  # the span's last token already saw the whole span causally


@pytest.mark.parametrize("case", moe_cases(seed=2), ids=lambda c: c.label)
def test_reference_moe_matches_the_definition(case):
    np.testing.assert_allclose(run_moe(ReferenceMoE(), case), naive_moe(case), atol=1e-5, rtol=1e-5)


def test_reference_moe_refuses_formats_it_cannot_run():
    with pytest.raises(ConfigError, match="int4_awq"):
        ReferenceMoE().load_weights(ExpertWeights(None, None, None, format="int4_awq"))


@pytest.mark.parametrize("backend", ["reference", "cpu_native"])
def test_long_prefills_split_into_pieces_match_the_definition(backend):
    """Prefill rows go in pieces of PREFILL_PIECE, each seeing only the keys it can: pieces must not
    change the result, also with a context before the chunk and a bidirectional span across a piece edge."""
    from fdplug.core.portable import attention

    seqs = [SeqCase(0, 2 * attention.PREFILL_PIECE + 45), SeqCase(37, attention.PREFILL_PIECE + 9, [(200, 300)]),
            SeqCase(20, 1)]
    case = AttentionCase(4, 2, 16, 16, seqs, seed=9)
    if backend == "reference":
        impl = ReferenceAttention()
    else:
        from fdplug.plugins.cpu import kernels
        from fdplug.plugins.cpu.native_attention import NativeCpuAttention

        if kernels.compiler() is None:
            pytest.skip("no C compiler: cpu_native cannot be built here")
        impl = NativeCpuAttention(2)
    for got, want in zip(run_attention(impl, case), naive_attention(case)):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-5)
