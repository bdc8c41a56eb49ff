"""GGUF files as models: the same logits as the float model with their dequantized weights, and
refusals by name (`fdplug.core.model.checkpoint.gguf_file`, `gguf_loader`; files from `fdplug.testing.gguf_kit`)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.checkpoint.gguf_file import gguf_path, unpermute_rows
from fdplug.core.model.layers.gguf_linear import GgufLinear
from fdplug.errors import (
    ConfigError,
    ModelLoadError,
    UnsupportedModelError,
    WeightMismatchError,
)
from fdplug.testing.gguf_kit import permute_rows, write_pair
from tests.test_model_parity import Steps

# Every supported block type somewhere, fused projections mixing types (q/k one type, v another;
# gate/up two), F16 and BF16 tensors (kept 2 bytes a weight), a float (F32) projection among
# quantized ones, quantized, F16 and float embeddings, tied and untied lm_heads.
CASES = {
    "llama": (True, {"model.layers.*.self_attn.v_proj": "Q4_1", "model.layers.*.mlp.down_proj": "Q6_K",
                     "model.layers.*.mlp.up_proj": "Q4_K", "model.layers.1.self_attn.o_proj": "F16"}),
    "qwen2": (False, {"lm_head": "Q6_K", "model.embed_tokens": "F16", "model.layers.*.mlp.gate_proj": "Q5_K",
                      "model.layers.*.mlp.up_proj": "Q5_0", "model.layers.0.mlp.down_proj": "BF16"}),
    "qwen3": (True, {"model.layers.*.self_attn.q_proj": "Q5_1", "model.layers.*.self_attn.k_proj": "Q4_0",
                     "model.embed_tokens": "Q6_K", "model.layers.1.mlp.down_proj": "F32"}),
}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_a_gguf_model_computes_the_dequantized_float_model(tmp_path, arch):
    """Prefill then decode steps: logits equal (to float32 rounding) to the float checkpoint holding
    the same weights dequantized by ggml's reference, in transformers' row order."""
    tied, types = CASES[arch]
    gguf, floats = write_pair(tmp_path, arch, types=types, tied=tied)
    a, b = Steps("gguf", 1, max_len=32, model_dir=gguf), Steps("float", 1, max_len=32, model_dir=floats)
    for plan in ([5, 17, 200, 3, 99, 250, 1, 42], [7], [123]):
        got, want = a.step({0: plan})[0], b.step({0: plan})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=arch)
    held = {type(layer).__name__ for layer in a.model.sublayers()}
    assert "GgufLinear" in held and a.model.config.quant.format == "gguf"
    assert (a.model.embed_type is not None) == (types.get("model.embed_tokens", "Q8_0") != "F32")


def test_llama_3_1_rope_scaling_comes_from_the_rope_freqs_tensor(tmp_path):
    """The file has no llama3 parameters, only llama.cpp's per-frequency divisors: the logits are
    those of the float checkpoint with ``rope_scaling: llama3`` (and not of one without: the
    scaling is felt at these positions)."""
    import json

    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    gguf, floats = write_pair(tmp_path, "llama", types={}, llama3=llama3)
    assert len(ModelConfig.from_dir(gguf).rope.freq_factors) == 32
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "model.safetensors").write_bytes((floats / "model.safetensors").read_bytes())
    config = json.loads((floats / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "rope_scaling"}))
    ids = list(range(3, 150, 5))
    got, want, unscaled = (Steps(str(m), 1, max_len=32, model_dir=m).step({0: ids})[0] for m in (gguf, floats, plain))
    scale = np.abs(want).max()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * scale)
    assert np.abs(unscaled - want).max() > 1e-2 * scale


def test_projections_keep_one_weight_per_block_type_in_row_order(tmp_path):
    """q and k (Q8_0) share one weight, v (Q4_1) has its own; the layer's bytes are the file's."""
    gguf, _ = write_pair(tmp_path, "qwen2", types={"model.layers.*.self_attn.v_proj": "Q4_1"}, tied=True)
    model = Steps("gguf", 1, model_dir=gguf).model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GgufLinear)
    assert qkv.layout.groups == (("Q8_0", 384), ("Q4_1", 128))
    assert qkv.weight.shape == [384, 272] and qkv.weight_1.shape == [128, 160]
    assert str(qkv.weight.dtype) == "paddle.uint8"
    cfg = ModelConfig.from_dir(gguf)
    assert cfg.traits().linear_weight_format == "gguf" and set(cfg.traits().weight_types) == {"Q8_0", "Q4_1"}


@pytest.mark.parametrize("arch", sorted(CASES))
def test_the_float_linear_shapes_are_the_decoders(tmp_path, arch):
    """What selection times for the ``linear`` op (`linear_shapes`) is exactly the decoder's float
    `Linear` layers: the projections a file keeps in F16/BF16/F32, never one in blocks."""
    from fdplug.core.model.layers.decoder import DecoderForCausalLM
    from fdplug.core.model.layers.linear_shapes import linear_shapes
    from tests.test_op_timing import _built_shapes

    tied, types = CASES[arch]
    gguf, _ = write_pair(tmp_path, arch, types=types, tied=tied)
    cfg = ModelConfig.from_dir(gguf).keep_weights("float32", None)
    model = DecoderForCausalLM(cfg, attn_backend=None)
    built = _built_shapes(model)
    if model.embed_type is not None:   # _built_shapes counts a tied table; one in blocks is gguf_linear's
        built = {key for key in built if key[2] != "uint8"}
    assert {s.key for s in linear_shapes(cfg, "float32")} == built


def test_the_q_k_row_order_is_llama_cpps_undone():
    order = unpermute_rows(12, 2)
    np.testing.assert_array_equal(order, [0, 2, 4, 1, 3, 5, 6, 8, 10, 7, 9, 11])
    np.testing.assert_array_equal(permute_rows(12, 2)[order], np.arange(12))


def test_a_gguf_path_is_a_file_or_a_directory_with_one(tmp_path):
    gguf, floats = write_pair(tmp_path, "llama", types={})
    assert gguf_path(gguf) == gguf and gguf_path(tmp_path) == gguf and gguf_path(floats) is None
    (tmp_path / "second.gguf").write_bytes(gguf.read_bytes())
    with pytest.raises(ModelLoadError, match="holds 2 GGUF files"):
        gguf_path(tmp_path)
    with pytest.raises(ModelLoadError, match="does not exist"):
        gguf_path(tmp_path / "missing.gguf")


def _rewrite(src, dst, *, arch: str | None = None, drop: str = "", extra=None, metadata=None, drop_keys=(),
             new_keys=None):
    """A copy of GGUF ``src`` with another architecture name, a tensor dropped, one added, or
    metadata changed."""
    import gguf

    reader = gguf.GGUFReader(str(src))
    arch = arch or reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    old = reader.fields["general.architecture"].contents()
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in drop_keys:
            continue
        value = (metadata or {}).get(key, field.contents())
        name = key.replace(f"{old}.", f"{arch}.", 1)
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(name, value)
    for name, value in (new_keys or {}).items():
        writer.add_uint32(name, value)
    for t in reader.tensors:
        if t.name != drop:
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for name, (value, kind) in (extra or {}).items():
        writer.add_tensor(name, value, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_end_of_turn_ids_end_generation_as_eos_does(tmp_path):
    """Llama 3 files name ``<|end_of_text|>`` as eos and ``<|eot_id|>`` as eot: a chat turn ends
    with the latter, so both stop generation (as in llama.cpp); bos and pad come through too."""
    src, _ = write_pair(tmp_path, "llama", types={})
    ids = {"tokenizer.ggml.bos_token_id": 7, "tokenizer.ggml.eos_token_id": 9, "tokenizer.ggml.eot_token_id": 12,
           "tokenizer.ggml.padding_token_id": 9}
    cfg = ModelConfig.from_dir(_rewrite(src, tmp_path / "ids.gguf", new_keys=ids))
    assert cfg.eos_token_ids == (9, 12) and cfg.bos_token_id == 7 and cfg.pad_token_id == 9


def test_unsupported_files_are_refused_by_name(tmp_path):
    import gguf as g

    src, _ = write_pair(tmp_path, "llama", types={})
    with pytest.raises(UnsupportedModelError, match="'gemma'"):
        ModelConfig.from_dir(_rewrite(src, tmp_path / "gemma.gguf", arch="gemma"))
    freqs = {"rope_freqs.weight": (np.ones(30, np.float32), g.GGMLQuantizationType.F32)}
    with pytest.raises(ModelLoadError, match="30 RoPE frequency factors"):
        ModelConfig.from_dir(_rewrite(src, tmp_path / "l3.gguf", extra=freqs))
    lora = {"blk.0.attn_q_lora.weight": (np.ones(32, np.float32), g.GGMLQuantizationType.F32)}
    with pytest.raises(UnsupportedModelError, match="attn_q_lora"):
        ModelConfig.from_dir(_rewrite(src, tmp_path / "lora.gguf", extra=lora))
    iq = {"blk.0.ffn_gate.weight": (np.zeros((512, 84), np.uint8), g.GGMLQuantizationType.Q2_K)}
    with pytest.raises(UnsupportedModelError, match="Q2_K"):
        ModelConfig.from_dir(_rewrite(src, tmp_path / "q2k.gguf", drop="blk.0.ffn_gate.weight", extra=iq))
    with pytest.raises(UnsupportedModelError, match="split GGUF"):
        ModelConfig.from_dir(src.rename(tmp_path / "m-00001-of-00002.gguf"))


def test_damaged_files_and_wrong_options_fail_with_a_fix(tmp_path):
    src, _ = write_pair(tmp_path, "llama", types={})
    with pytest.raises(ConfigError, match="already quantized"):
        ModelConfig.from_dir(src, "fp8")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(src.read_bytes()[:5000])
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        ModelConfig.from_dir(cut)
    with pytest.raises(ModelLoadError, match="llama.block_count is None; a number was expected"):
        ModelConfig.from_dir(_rewrite(src, tmp_path / "text.gguf", drop_keys=("llama.block_count",)))
    wrong = _rewrite(src, tmp_path / "wrong.gguf", metadata={"llama.feed_forward_length": 384})
    with pytest.raises(WeightMismatchError, match="gate_proj"):
        Steps("wrong", 1, model_dir=wrong)
    missing = _rewrite(src, tmp_path / "missing.gguf", drop="blk.1.ffn_up.weight")
    with pytest.raises(WeightMismatchError, match="missing"):
        Steps("missing", 1, model_dir=missing)


def test_the_files_reader_gives_ggufs_values_from_a_view_of_the_map(tmp_path):
    """`gguf_file` opens a file with ``gguf.GGUFReader`` slicing a plain view of its map (the
    package's memmap slices made opening SmolLM2's vocabulary take seconds): every metadata value and
    tensor equals the package's own reader's, and a tensor's data is still a view of the file, not a
    copy read at open."""
    import gguf

    from fdplug.core.model.checkpoint.gguf_file import _reader_class

    path, _ = write_pair(tmp_path, "qwen2", types=CASES["qwen2"][1], tied=False, tokenizer=True)
    ours, theirs = _reader_class()(str(path)), gguf.GGUFReader(str(path))
    assert {k: f.contents() for k, f in ours.fields.items()} == {k: f.contents() for k, f in theirs.fields.items()}
    assert len(ours.fields["tokenizer.ggml.tokens"].contents()) > 0
    assert [(t.name, t.tensor_type, t.shape.tolist()) for t in ours.tensors] == \
        [(t.name, t.tensor_type, t.shape.tolist()) for t in theirs.tensors]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(ours.tensors, theirs.tensors))
    data = ours.tensors[0].data
    assert not data.flags.owndata and isinstance(ours.data.base, np.memmap)    # a view of the map
