"""Rows read back from a packed GGUF weight (csrc/gguf_packed_rows.c, `PreparedWeight.rows`): a tied
lm_head's packed table is the model's only copy of its embedding table, so its rows must be the
file's values bit for bit, and a model loaded that way must give what the file's table gives."""

from __future__ import annotations

import logging

import numpy as np
import pytest

pytest.importorskip("paddle")
import paddle

from fdplug import LLM, SamplingParams
from fdplug.core.model.layers.gguf_linear import embedding_rows
from fdplug.plugins.cpu import kernels, native_gguf_packed
from fdplug.testing.gguf_kit import write_pair
from fdplug.testing.test_numerics import _random_gguf_blocks

if kernels.unavailable_reason() is not None:
    pytest.skip(f"cpu kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)
needs_tiles = pytest.mark.skipif(not native_gguf_packed.available(),
                                 reason="the packed layout needs x86-64-v3 (AVX2) or above")


@needs_tiles
@pytest.mark.parametrize("qtype", native_gguf_packed.TYPES)
def test_rows_are_the_files_values_bit_for_bit(qtype):
    """Every packed type (random bytes: every bit pattern of the integers, scales of either sign), rows
    from every column of three groups, ids in any order and repeated, against the portable op's
    dequantization of the file's rows."""
    rng = np.random.default_rng(5)
    k = 2 * (256 if qtype.endswith("_K") else 32) + (0 if qtype.endswith("_K") else 32)
    blocks = _random_gguf_blocks(qtype, 48, k, rng)
    w = paddle.to_tensor(blocks)
    prepared = native_gguf_packed.prepare(w, qtype)
    assert prepared is not None and prepared.rows is not None
    ids = np.array([*range(48), 47, 0, 7, 7, 31], dtype=np.int64)
    got = prepared.rows(paddle.to_tensor(ids)).numpy()
    want = embedding_rows(w, qtype, k, paddle.to_tensor(ids), "float32").numpy()
    assert got.shape == (len(ids), k) and np.isfinite(want).all()
    np.testing.assert_array_equal(got, want, err_msg=qtype)


@needs_tiles
def test_an_id_outside_the_table_is_refused():
    w = paddle.to_tensor(_random_gguf_blocks("Q8_0", 32, 64, np.random.default_rng(1)))
    prepared = native_gguf_packed.prepare(w, "Q8_0")
    for bad in ([32], [0, -1]):
        with pytest.raises(ValueError, match="outside the table's 32 rows"):
            prepared.rows(paddle.to_tensor(np.array(bad, dtype=np.int64)))
    assert prepared.rows(paddle.to_tensor(np.zeros(0, dtype=np.int64))).shape == [0, 64]


def _generate(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ([5, 17, 200, 3], [9], [42, 43, 44])],
                        [params] * 3, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@needs_tiles
@pytest.mark.parametrize("embed", ["Q8_0", "Q6_K"])
def test_a_tied_model_keeps_one_table_and_gives_what_the_files_table_gives(tmp_path, monkeypatch, caplog, embed):
    """The packed lm_head's copy (a vocabulary of whole groups of 16) replaces the file's table (one
    copy held, the log says so); tokens and every logprob equal a model that keeps the file's table
    (FDPLUG_CPU_PACK_WEIGHTS=0: the same tiles, each group packed per call), through the fused
    decoder stack and layer by layer."""
    gguf, _ = write_pair(tmp_path, "llama", types={"model.embed_tokens": embed}, tokenizer=True, vocab=320)
    with caplog.at_level(logging.INFO, logger="fdplug"):
        packed = LLM(str(gguf), max_model_len=64, num_kv_blocks=32, max_num_seqs=4)
    model = packed.engine.runner.model
    assert model.embed_tokens is None and model.head_weight.rows is not None
    assert model.fused_stack is not None and model.fused_stack.embeds   # (the stack reads the packed rows)
    assert "the tied embedding table" in caplog.text and "once, laid out for the lm_head's kernel" in caplog.text
    layered = LLM(str(gguf), max_model_len=64, num_kv_blocks=32, max_num_seqs=4,
                  op_kernels={"decoder_stack": "paddle_layer_by_layer"})
    monkeypatch.setenv("FDPLUG_CPU_PACK_WEIGHTS", "0")
    files = LLM(str(gguf), max_model_len=64, num_kv_blocks=32, max_num_seqs=4)
    assert files.engine.runner.model.embed_tokens is not None and files.engine.runner.model.head_weight is None
    ids = paddle.to_tensor(np.array([0, 3, 200, 3], dtype=np.int64))
    np.testing.assert_array_equal(model.embed(ids).numpy(), files.engine.runner.model.embed(ids).numpy())
    want = _generate(files)
    assert _generate(packed) == want and _generate(layered) == want
