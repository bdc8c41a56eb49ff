"""The Paddle decoder against transformers, on the tiny golden models of tools/make_golden.py.

Parity with transformers is the correctness reference: each fixture dir holds a random model as
transformers saved it and transformers' float32 logits for two token sequences. Here fdplug loads
the same files and must reproduce those logits through the paged KV cache, whether a sequence is
prefilled at once, decoded token by token, or batched with another one in mixed steps.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")
pytest.importorskip("safetensors")

from fdplug.core.model.checkpoint.config import ModelConfig  # noqa: E402
from fdplug.core.model.checkpoint.rope import RopeConfig, cos_sin, inv_freq, parse_rope, rope_permutation  # noqa: E402
from fdplug.core.model.loader import load_model  # noqa: E402
from fdplug.core.portable.attention import ReferenceAttention  # noqa: E402
from fdplug.errors import ModelLoadError, UnsupportedModelError, WeightMismatchError  # noqa: E402
from fdplug.plugin_api.attention import AttentionMetadata, causal_key_end  # noqa: E402
from fdplug.plugin_api.engine_config import ModelTraits  # noqa: E402
from tests.conftest import GOLDEN, golden  # noqa: E402

MODELS = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.json").is_file())
TOL = 1e-4
BLOCK = 4


@functools.cache
def loaded(name: str):
    backend = ReferenceAttention()
    model, cfg = load_model(GOLDEN / name, backend, show_progress=False)
    return model, cfg, backend


class Steps:
    """Drives the model like the runner will: per step, some tokens of some sequences, paged KV cache.

    Sequence ``i``'s block ``j`` is block ``1 + j * num_seqs + i``: blocks of different sequences
    interleave, so a wrong block table or slot mapping cannot go unnoticed.
    """

    def __init__(self, name: str, num_seqs: int, max_len: int = 16, model_dir: Path | None = None,
                 moe_backend: object = None) -> None:
        """``model_dir``: load the model from there (a fresh load) instead of the golden fixture ``name``,
        its routed experts run by ``moe_backend`` (None: the reference)."""
        if model_dir is None:
            self.model, self.cfg, self.backend = loaded(name)
        else:
            self.backend = ReferenceAttention()
            self.model, self.cfg = load_model(model_dir, self.backend, show_progress=False, moe_backend=moe_backend)
        self.blocks_per_seq = -(-max_len // BLOCK)
        self.tables = np.array([[1 + j * num_seqs + i for j in range(self.blocks_per_seq)] for i in range(num_seqs)])
        num_blocks = 1 + num_seqs * self.blocks_per_seq
        shape = self.backend.kv_cache_shape(num_blocks, BLOCK, self.cfg.num_kv_heads, self.cfg.head_dim)
        self.caches = [(paddle.zeros(shape), paddle.zeros(shape)) for _ in range(self.cfg.num_layers)]
        self.computed = [0] * num_seqs

    def step(self, plan: dict[int, list[int]]) -> dict[int, np.ndarray]:
        """``{seq: new tokens}`` -> ``{seq: logits of those tokens}``."""
        seqs = list(plan)
        ids, positions, lens = [], [], []
        for s in seqs:
            start = self.computed[s]
            ids += plan[s]
            positions.append(np.arange(start, start + len(plan[s])))
            lens.append(start + len(plan[s]))
        pos = np.concatenate(positions)
        owner = np.repeat(seqs, [len(plan[s]) for s in seqs])
        tables = self.tables[seqs]
        slots = self.tables[owner, pos // BLOCK] * BLOCK + pos % BLOCK
        qsl = np.concatenate([[0], np.cumsum([len(plan[s]) for s in seqs])])
        meta = AttentionMetadata(qsl, np.array(lens), pos, causal_key_end(pos), slots, tables, BLOCK)
        meta.validate()
        hidden = self.model(paddle.to_tensor(np.array(ids, dtype=np.int64)), paddle.to_tensor(pos),
                            self.caches, self.backend.prepare(meta))
        logits = self.model.compute_logits(hidden).numpy()
        for s in seqs:
            self.computed[s] += len(plan[s])
        return {s: logits[qsl[k]:qsl[k + 1]] for k, s in enumerate(seqs)}


def max_diff(got: np.ndarray, want: np.ndarray) -> float:
    assert got.shape == want.shape and got.dtype == np.float32
    return float(np.abs(got - want).max())


# --------------------------------------------------------------------------------------------------
# parity
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", MODELS)
def test_prefill_matches_transformers(name):
    seqs, want = golden(name)
    for i, seq in enumerate(seqs):
        got = Steps(name, 1).step({0: seq})[0]
        assert max_diff(got, want[i]) <= TOL, f"{name} sequence {i}"


@pytest.mark.parametrize("name", MODELS)
def test_incremental_decode_equals_full_forward(name):
    seqs, want = golden(name)
    steps, seq, k = Steps(name, 1), seqs[0], 5
    rows = [steps.step({0: seq[:k]})[0]] + [steps.step({0: [tok]})[0] for tok in seq[k:]]
    assert max_diff(np.concatenate(rows), want[0]) <= TOL


@pytest.mark.parametrize("name", MODELS)
def test_batched_mixed_steps_give_each_sequence_its_logits(name):
    (a, b), (want_a, want_b) = golden(name)
    steps = Steps(name, 2)
    plan = [{0: a[:8], 1: b[:3]},        # two prefills in one step
            {1: b[3:4], 0: a[8:10]},     # a decode and a prefill chunk, sequences out of order
            {0: a[10:11], 1: b[4:7]},    # a decode and the last chunk
            {0: a[11:]}]                 # one sequence alone
    got: dict[int, list[np.ndarray]] = {0: [], 1: []}
    for step in plan:
        for s, rows in steps.step(step).items():
            got[s].append(rows)
    assert max_diff(np.concatenate(got[0]), want_a) <= TOL
    assert max_diff(np.concatenate(got[1]), want_b) <= TOL


def test_inputs_embeds_replace_the_embedding_lookup():
    model, cfg, backend = loaded("llama")
    seqs, want = golden("llama")
    ids = paddle.to_tensor(np.array(seqs[1], dtype=np.int64))
    steps = Steps("llama", 1)
    pos = np.arange(len(seqs[1]))
    meta = AttentionMetadata(np.array([0, len(pos)]), np.array([len(pos)]), pos, causal_key_end(pos),
                             steps.tables[0, pos // BLOCK] * BLOCK + pos % BLOCK, steps.tables, BLOCK)
    hidden = model(ids, paddle.to_tensor(pos), steps.caches, backend.prepare(meta), inputs_embeds=model.embed(ids))
    assert max_diff(model.compute_logits(hidden).numpy(), want[1]) <= TOL


def test_config_facts_and_traits():
    _, cfg, _ = loaded("ernie4_5")
    assert (cfg.architecture, cfg.head_dim, cfg.tie_word_embeddings, cfg.rope.interleaved) == \
        ("Ernie4_5ForCausalLM", 32, True, True)
    assert cfg.attention_bias and cfg.o_proj_bias and cfg.mlp_bias and not cfg.qk_norm
    assert cfg.traits() == ModelTraits(architecture="Ernie4_5ForCausalLM", dtype="float32", num_attention_heads=4,
                                       num_kv_heads=2, head_dim=32, hidden_size=64)
    qwen2 = ModelConfig.from_dir(GOLDEN / "qwen2_linear_bf16")
    assert qwen2.dtype == "bfloat16" and qwen2.traits("float32").dtype == "float32"
    assert qwen2.eos_token_ids == (3, 2) and qwen2.bos_token_id == 1
    assert qwen2.attention_bias and not qwen2.o_proj_bias and qwen2.rope_type == "linear"
    assert ModelConfig.from_dir(GOLDEN / "qwen3_yarn").qk_norm


# --------------------------------------------------------------------------------------------------
# config.json dialects and RoPE
# --------------------------------------------------------------------------------------------------


def _raw(name: str) -> dict:
    return json.loads((GOLDEN / name / "config.json").read_text())


def test_transformers_4_and_5_config_keys_mean_the_same():
    v4 = _raw("qwen2_linear_bf16")
    v5 = {k: v for k, v in v4.items() if k not in ("rope_theta", "rope_scaling", "torch_dtype")}
    v5 |= {"dtype": "bfloat16", "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}
    assert ModelConfig.from_dict(v4) == ModelConfig.from_dict(v5)


def test_architecture_defaults_follow_transformers():
    raw = {k: v for k, v in _raw("ernie4_5").items() if k != "head_dim"}
    assert ModelConfig.from_dict(raw).head_dim == 128          # ERNIE-4.5's default, not hidden // heads
    assert ModelConfig.from_dict(raw | {"head_dim": None}).head_dim == 16
    llama = {k: v for k, v in _raw("llama").items() if k not in ("tie_word_embeddings", "rope_theta")}
    cfg = ModelConfig.from_dict(llama)
    assert cfg.head_dim == 16 and not cfg.tie_word_embeddings and cfg.rope_theta == 10000.0


def test_remote_code_ernie_name_is_an_alias():
    assert ModelConfig.from_dict(_raw("ernie4_5") | {"architectures": ["Ernie4_5_ForCausalLM"]}).architecture == \
        "Ernie4_5ForCausalLM"


@pytest.mark.parametrize("change, words", [
    ({"architectures": ["GPT2LMHeadModel"]}, ["GPT2LMHeadModel", "LlamaForCausalLM", "Ernie4_5ForCausalLM"]),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, ["dynamic", "yarn"]),
    ({"hidden_act": "gelu"}, ["gelu"]),
    ({"use_sliding_window": True, "max_window_layers": 1}, ["sliding"]),
])
def test_unsupported_models_are_refused_by_name(change, words):
    with pytest.raises(UnsupportedModelError) as err:
        ModelConfig.from_dict(_raw("qwen2_linear_bf16") | change)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize("partial", [1.5, 0.0, "half", 0.1])
def test_impossible_partial_rotary_is_refused(partial):
    with pytest.raises(ModelLoadError, match="partial_rotary_factor"):   # 0.1 of head_dim 16 rotates 1 dim
        ModelConfig.from_dict(_raw("qwen2_linear_bf16") | {"partial_rotary_factor": partial})


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("partial", [1.0, 0.5, 0.25])
def test_rope_permutation_rotates_as_the_checkpoint_did(partial, interleaved):
    """The decoder's NeoX RoPE over permuted q/k gives the checkpoint's q.k for every position pair.

    Reference, from the formulas: the first ``r`` dims rotate (pairs ``(i, i + r/2)``, or ``(2i, 2i+1)``
    interleaved) by angle ``pos * theta^(-2i/r)``; the rest pass unchanged.
    """
    head_dim, positions = 16, np.array([0, 1, 5, 40])
    rope = RopeConfig(theta=100.0, partial=partial, interleaved=interleaved)
    r = rope.rotary_dim(head_dim)
    rng = np.random.default_rng(0)
    q, k = rng.standard_normal((2, len(positions), head_dim))

    def reference(x):
        out = x.copy()
        for t, pos in enumerate(positions):
            for i in range(r // 2):
                a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + r // 2)
                angle = pos * 100.0 ** (-2 * i / r)
                out[t, a] = x[t, a] * np.cos(angle) - x[t, b] * np.sin(angle)
                out[t, b] = x[t, b] * np.cos(angle) + x[t, a] * np.sin(angle)
        return out

    perm = rope_permutation(rope, head_dim)
    assert (perm is None) == (partial == 1.0 and not interleaved)
    perm = np.arange(head_dim) if perm is None else perm
    assert sorted(perm) == list(range(head_dim))
    cos, sin = (table[positions] for table in cos_sin(rope, head_dim, 64))

    def decoder(x):
        x = x[:, perm]
        return x * cos + np.concatenate([-x[:, head_dim // 2:], x[:, :head_dim // 2]], axis=-1) * sin

    np.testing.assert_allclose(decoder(q) @ decoder(k).T, reference(q) @ reference(k).T, rtol=1e-5, atol=1e-5)


def test_yarn_attention_factor():
    rope = parse_rope(_raw("qwen3_yarn"), default_theta=1e4, max_position_embeddings=128)
    assert rope == RopeConfig(theta=1e4, type="yarn", factor=4.0, original_max_position_embeddings=32)
    assert inv_freq(rope, 16)[1] == pytest.approx(0.1 * np.log(4.0) + 1.0)
    mscaled = dataclasses.replace(rope, mscale=1.0, mscale_all_dim=0.5)
    assert inv_freq(mscaled, 16)[1] == pytest.approx((0.1 * np.log(4) + 1) / (0.05 * np.log(4) + 1))


# --------------------------------------------------------------------------------------------------
# broken model directories
# --------------------------------------------------------------------------------------------------


@pytest.fixture
def llama_dir(tmp_path):
    shutil.copytree(GOLDEN / "llama", tmp_path / "llama")
    return tmp_path / "llama"


def _rewrite_weights(model_dir: Path, edit) -> None:
    from safetensors.numpy import load_file, save_file

    tensors = load_file(model_dir / "model.safetensors")
    edit(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def test_missing_config_json_names_the_file(llama_dir):
    (llama_dir / "config.json").unlink()
    with pytest.raises(ModelLoadError, match="config.json") as err:
        load_model(llama_dir, ReferenceAttention(), show_progress=False)
    assert err.value.fix


def test_missing_weights_name_the_expected_files(llama_dir):
    (llama_dir / "model.safetensors").unlink()
    (llama_dir / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelLoadError, match="model.safetensors.*pytorch_model.bin"):
        load_model(llama_dir, ReferenceAttention(), show_progress=False)


def test_missing_tensor_is_named(llama_dir):
    _rewrite_weights(llama_dir, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(WeightMismatchError, match="model.layers.1.mlp.up_proj.weight") as err:
        load_model(llama_dir, ReferenceAttention(), show_progress=False)
    assert err.value.tensor == "model.layers.1.mlp.up_proj.weight"


def test_shape_mismatch_names_tensor_and_both_shapes(llama_dir):
    _rewrite_weights(llama_dir, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight":
                                                    np.zeros((16, 64), np.float32)}))
    with pytest.raises(WeightMismatchError, match=r"k_proj.weight.*\[16, 64\].*\[32, 64\]"):
        load_model(llama_dir, ReferenceAttention(), show_progress=False)


def test_unexpected_tensor_is_named(llama_dir):
    _rewrite_weights(llama_dir, lambda t: t.update({"model.layers.0.mlp.extra.weight": np.zeros(4, np.float32)}))
    with pytest.raises(WeightMismatchError, match="model.layers.0.mlp.extra.weight"):
        load_model(llama_dir, ReferenceAttention(), show_progress=False)


def test_ignorable_extra_tensors_are_skipped(llama_dir):
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(8, np.float32),
             "model.mtp_block.0.weight": np.zeros(4, np.float32)}
    _rewrite_weights(llama_dir, lambda t: t.update(extra))
    seqs, want = golden("llama")
    steps = Steps("llama", 2, model_dir=llama_dir)     # a fresh load: the extras change nothing it computes
    for i, seq in enumerate(seqs):
        assert max_diff(steps.step({i: seq})[i], want[i]) <= TOL, f"sequence {i}"


def test_missing_shard_is_named(tmp_path):
    model_dir = tmp_path / "m"
    shutil.copytree(GOLDEN / "llama3_rope", model_dir)
    (model_dir / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model-00002-of-00003.safetensors"):
        load_model(model_dir, ReferenceAttention(), show_progress=False)


# --------------------------------------------------------------------------------------------------
# RoPE against transformers itself (dev machines only: CI has no torch)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512, "beta_fast": 16, "beta_slow": 2,
     "mscale": 1.0, "mscale_all_dim": 0.8, "truncate": False},
    {"rope_type": "yarn", "factor": 2.0, "attention_factor": 1.3},
])
def test_rope_parameters_match_transformers(scaling):
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    raw = {"hidden_size": 1024, "num_attention_heads": 8, "max_position_embeddings": 4096,
           "rope_theta": 10000.0, "rope_scaling": dict(scaling)}
    want, want_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](transformers.LlamaConfig(**raw), "cpu")
    got, scale = inv_freq(parse_rope(raw, default_theta=1e4, max_position_embeddings=4096), 128)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)
    assert scale == pytest.approx(want_scale)
