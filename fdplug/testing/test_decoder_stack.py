"""Conformance of the selected ``decoder_stack`` kernel (`fdplug.plugin_api.ops`): where it takes a
model's layers, its decode steps give what the layers one by one give with the selected ops and
attention backend: the final hidden states and every KV cache, to the ops' tolerance. The model is
a tiny GGUF file (`fdplug.testing.gguf_kit`: Qwen3's q/k norm, projections mixing block types), two
sequences prefilled layer by layer, then decode steps run both ways on caches of their own."""

from __future__ import annotations

import numpy as np
import pytest

from fdplug.core.config import EngineConfig
from fdplug.testing.gguf_kit import write_pair

BLOCK = 16
TYPES = {"model.layers.*.self_attn.v_proj": "Q6_K", "model.layers.*.mlp.up_proj": "Q4_K",
         "model.layers.*.self_attn.q_proj": "Q4_1"}


def _step(model, backend, caches, ids: list[int], positions: list[int], seqs: list[int], tables: np.ndarray):
    """One step: token ``i`` of sequence ``seqs[i]`` at ``positions[i]`` (one token a sequence, or a
    whole prompt when ``seqs`` repeats one sequence) -> final hidden states."""
    import paddle

    from fdplug.plugin_api.attention import AttentionMetadata

    pos = np.array(positions)
    order = sorted(set(seqs), key=seqs.index)
    counts = [seqs.count(s) for s in order]
    lens = np.array([max(p for p, s in zip(positions, seqs, strict=True) if s == seq) + 1 for seq in order])
    owner = np.array(seqs)
    slots = tables[owner, pos // BLOCK] * BLOCK + pos % BLOCK
    meta = AttentionMetadata(np.concatenate([[0], np.cumsum(counts)]), lens, pos, pos + 1, slots, tables[order],
                             BLOCK)
    meta.validate()
    return model(paddle.to_tensor(np.array(ids, dtype=np.int64)), paddle.to_tensor(pos), caches,
                 backend.prepare(meta)).numpy()


def test_a_fused_stack_gives_the_layers_results(fdplug_selection, fdplug_place, tmp_path):
    import paddle

    from fdplug.core.model.layers.fused_stack import attach
    from fdplug.core.model.loader import load_model
    from fdplug.plugin_api.ops import PREPARED_OPS, Kernels

    if fdplug_selection.ops["decoder_stack"].name == "paddle_layer_by_layer":
        pytest.skip("no decoder_stack kernel selected for this device: the layers run one by one")
    paddle.set_device(fdplug_place)
    gguf, _ = write_pair(tmp_path, "qwen3", types=TYPES)
    config, ops = EngineConfig(), fdplug_selection.ops
    kernels = Kernels(**{op: spec.factory(config) for op, spec in ops.items()},
                      **{f"prepare_{op}": ops[op].prepare(config) for op in PREPARED_OPS if ops[op].prepare})
    backend = fdplug_selection.attention.factory(config)
    model, cfg = load_model(gguf, backend, kernels=kernels, show_progress=False)
    line = attach(model, kernels, fdplug_selection)
    if model.fused_stack is None:
        pytest.skip(f"the selected stack declines this model: {line}")
    stack, ran = model.fused_stack, []

    def counted(*args):
        out = stack(*args)
        ran.append(out is not None)
        return out
    counted.embeds = stack.embeds
    shape = backend.kv_cache_shape(9, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    caches = {way: [(paddle.zeros(shape), paddle.zeros(shape)) for _ in range(cfg.num_layers)]
              for way in ("fused", "layers")}
    tables = np.array([[1, 3, 5, 7], [2, 4, 6, 8]])
    prompts = [[5, 17, 200, 3, 99, 250, 1, 42, 7, 7, 9, 11, 13, 15, 17, 19, 21], [123, 4, 4, 8]]
    model.fused_stack = None
    for cache in caches.values():           # prefills, layer by layer on both
        for seq, prompt in enumerate(prompts):
            _step(model, backend, cache, prompt, list(range(len(prompt))), [seq] * len(prompt), tables)
    lengths, token = [len(p) for p in prompts], 31
    for _ in range(6):                      # decode steps of both sequences, each way
        got = {}
        for way, cache in caches.items():
            model.fused_stack = counted if way == "fused" else None
            got[way] = _step(model, backend, cache, [token, token + 1], lengths, [0, 1], tables)
        scale = np.abs(got["layers"]).max()
        np.testing.assert_allclose(got["fused"], got["layers"], rtol=1e-5, atol=1e-5 * scale)
        lengths, token = [n + 1 for n in lengths], token + 2
    assert ran == [True] * 6, "the stack declined a decode-only step"
    for (fk, fv), (lk, lv) in zip(caches["fused"], caches["layers"], strict=True):
        np.testing.assert_allclose(fk.numpy(), lk.numpy(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(fv.numpy(), lv.numpy(), rtol=1e-5, atol=1e-6)
