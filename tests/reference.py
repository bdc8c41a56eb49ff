"""The engine's correctness reference: greedy decoding by full recompute, one token at a time.

No KV reuse, no batching, no chunking: every token re-runs the whole sequence through the model
with a fresh cache, so whatever the engine does to be fast must reproduce these tokens exactly.
Multimodal: ``features`` are ``(offset, rows)`` placed into the embeddings by hand, ``spans`` the
bidirectional ranges of the dense mask.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import paddle

from fdplug.plugin_api.attention import AttentionMetadata
from fdplug.testing.cases import key_end_with_spans

BLOCK = 16


def naive_greedy(llm, prompt: Sequence[int], max_tokens: int, spans: Sequence[tuple[int, int]] = (),
                 features: Sequence[tuple[int, np.ndarray]] = ()) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        hidden = _full_forward(llm, tokens, spans, features)
        with paddle.no_grad():
            tokens.append(int(llm.engine.runner.model.compute_logits(hidden[-1:]).argmax(axis=-1).item()))
    return tokens[len(prompt):]


def full_logits(llm, tokens: Sequence[int], features: Sequence[tuple[int, np.ndarray]] = (),
                rope_positions: np.ndarray | None = None, modality_rows: tuple | None = None) -> np.ndarray:
    """float32 logits ``[len(tokens), vocab]`` of every position, in one forward pass
    (``rope_positions [3, T]``: multimodal RoPE's, else the token indices; ``modality_rows``: the
    text and vision rows of a model with modality experts)."""
    hidden = _full_forward(llm, list(tokens), (), features, rope_positions, modality_rows)
    with paddle.no_grad():
        return llm.engine.runner.model.compute_logits(hidden).numpy()


def mean_nll(llm, tokens: Sequence[int]) -> float:
    """Mean negative log-likelihood (nats) of tokens[1:], each predicted from the ones before it, in
    one forward pass (full_logits, summed in float64): exp of it is the text's perplexity."""
    logits = full_logits(llm, tokens).astype(np.float64)[:-1]
    logz = np.log(np.exp(logits - logits.max(axis=1, keepdims=True)).sum(axis=1)) + logits.max(axis=1)
    return float(np.mean(logz - logits[np.arange(len(logits)), list(tokens)[1:]]))


def _full_forward(llm, tokens: list[int], spans: Sequence[tuple[int, int]],
                  features: Sequence[tuple[int, np.ndarray]], rope_positions: np.ndarray | None = None,
                  modality_rows: tuple | None = None):
    """The final hidden states of ``tokens`` from a fresh cache, in one pass."""
    runner = llm.engine.runner
    cfg = runner.model_config
    n = len(tokens)
    blocks = -(-n // BLOCK)
    shape = runner.attn_backend.kv_cache_shape(blocks + 1, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = [(paddle.zeros(shape), paddle.zeros(shape)) for _ in range(cfg.num_layers)]
    positions = np.arange(n, dtype=np.int64)
    meta = AttentionMetadata(np.array([0, n]), np.array([n]), positions, key_end_with_spans(positions, list(spans)),
                             positions + BLOCK, np.arange(1, blocks + 1)[None, :], BLOCK)
    ids = paddle.to_tensor(tokens)
    embeds = None
    if features:
        rows = runner.model.embed(ids).numpy()
        for offset, values in features:
            rows[offset:offset + len(values)] = values
        embeds = paddle.to_tensor(rows)
    with paddle.no_grad():
        rope = positions if rope_positions is None else rope_positions
        modality = None if modality_rows is None else tuple(paddle.to_tensor(r) for r in modality_rows)
        return runner.model(ids, paddle.to_tensor(rope), caches, runner.attn_backend.prepare(meta),
                            inputs_embeds=embeds, modality_rows=modality)
