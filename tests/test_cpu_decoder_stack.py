"""The cpu plugin's ``decoder_stack`` op (`fdplug.plugins.cpu.native_stack`): a decode step's layers in
one compiled call give what the layers one by one give, bit for bit (logprobs, tokens and the KV
cache), on GGUF models of every architecture it runs (Qwen2's biases, Qwen3's q/k norm, projections
mixing block types) and on float models packed for cpu_native_linear; other steps and other models
run layer by layer, with the reason."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("paddle")

from fdplug import LLM, SamplingParams
from fdplug.core.model.layers.fused_stack import describe
from fdplug.plugins.cpu import isa, kernels
from fdplug.testing.gguf_kit import write_pair

if kernels.unavailable_reason() is not None:
    pytest.skip(f"cpu kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)
if isa.level_reason("cpu_native_gguf_linear", 3) is not None:   # (below x86-64-v3: the scalar level's run)
    pytest.skip("the GGUF kernel the stack runs is chosen from x86-64-v3; below, the layers run one by one",
                allow_module_level=True)

LAYER_BY_LAYER = {"decoder_stack": "paddle_layer_by_layer"}
CASES = {   # every type the stack decodes, fused projections of two or three types; embeddings it reads
    # itself (Q8_0, Q6_K, F16) and one the model embeds for it (F32)
    "llama": {"model.layers.*.self_attn.v_proj": "Q6_K", "model.layers.*.mlp.up_proj": "Q4_K",
              "model.layers.*.mlp.down_proj": "Q5_K", "model.layers.1.self_attn.q_proj": "Q4_1",
              "model.layers.0.self_attn.o_proj": "BF16", "model.embed_tokens": "F16"},
    "qwen2": {"model.layers.*.mlp.gate_proj": "Q5_0", "model.layers.*.self_attn.o_proj": "Q5_1",
              "model.embed_tokens": "F32", "model.layers.1.mlp.up_proj": "F16"},
    "qwen3": {"model.layers.*.self_attn.q_proj": "Q4_0", "model.layers.*.self_attn.k_proj": "Q4_1",
              "model.embed_tokens": "Q6_K"},
}
PROMPTS = [[5, 17, 200, 3, 99], [7], [123, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 9], [42, 43]]


class Counting:
    """The model's fused stack, counting the steps it ran (not declined)."""

    def __init__(self, run) -> None:
        self.run, self.ran, self.declined, self.embeds = run, 0, 0, run.embeds

    def __call__(self, *args):
        out = self.run(*args)
        self.ran, self.declined = self.ran + (out is not None), self.declined + (out is None)
        return out


def _run(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], [params] * len(PROMPTS), use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize(("arch", "linear", "kv"), [(arch, None, "auto") for arch in sorted(CASES)]
                         + [("llama", "cpu_native_gguf_linear", "auto"), ("llama", "cpu_native_gguf_q8_linear", "auto"),
                            ("qwen3", None, "float16"),
                            ("llama", None, "bfloat16")])
def test_decode_steps_through_the_stack_are_the_layers_bit_for_bit(tmp_path, arch, linear, kv):
    """With the GGUF linear kernel selected here (bf16 math where the CPU has AVX512-BF16), and with
    the float32 and the q8 ones named; with a float32 KV cache, and 2-byte ones (--kv-cache-dtype)."""
    gguf, _ = write_pair(tmp_path, arch, types=CASES[arch], tokenizer=True)
    chosen = {"gguf_linear": linear} if linear else {}
    fused = LLM(str(gguf), max_model_len=64, num_kv_blocks=32, max_num_seqs=4, op_kernels=chosen, kv_cache_dtype=kv)
    layered = LLM(str(gguf), max_model_len=64, num_kv_blocks=32, max_num_seqs=4,
                  op_kernels={**LAYER_BY_LAYER, **chosen}, kv_cache_dtype=kv)
    assert layered.engine.runner.model.fused_stack is None
    counting = fused.engine.runner.model.fused_stack = Counting(fused.engine.runner.model.fused_stack)
    assert counting.embeds == (CASES[arch].get("model.embed_tokens") != "F32")
    assert _run(fused) == _run(layered)          # tokens and every logprob value, exactly
    assert counting.ran >= 8 and counting.declined >= 1     # the decode steps; the prefill ran layer by layer
    for (k1, v1), (k2, v2) in zip(fused.engine.runner.kv_caches, layered.engine.runner.kv_caches, strict=True):
        assert np.array_equal(k1.numpy(), k2.numpy()) and np.array_equal(v1.numpy(), v2.numpy())


def _decline(llm: LLM, **changes: str) -> str | None:
    """Why the stack declines ``llm``'s model, with the selection's ``changes`` (op or ``attention``)."""
    from fdplug.plugins.cpu.native_stack import decline_reason

    runner = llm.engine.runner
    ops = {op: spec.name for op, spec in runner.selection.ops.items()} | changes
    stack = describe(runner.model, ops, ops.pop("attention", runner.selection.attention.name))
    return stack if isinstance(stack, str) else decline_reason(stack)    # the core's reason, or the kernel's


def test_the_stack_declines_what_it_does_not_run_and_says_why(tmp_path, caplog):
    """An F32 group in a projection, another op's kernel chosen by the user, another attention backend."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    gguf, _ = write_pair(tmp_path / "a", "llama", types={"model.layers.1.self_attn.v_proj": "F32"}, tokenizer=True)
    with caplog.at_level("INFO", logger="fdplug"):
        f32 = LLM(str(gguf), max_model_len=64, num_kv_blocks=16)
    assert f32.engine.runner.model.fused_stack is None
    reason = "layer 1: F32 rows of 256 weights (it decodes Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, F16, BF16)"
    assert _decline(f32) == reason and f"decoder stack: layer by layer ({reason})" in caplog.text
    gguf, _ = write_pair(tmp_path / "b", "llama", types={}, tokenizer=True)
    other = LLM(str(gguf), max_model_len=64, num_kv_blocks=16, op_kernels={"rms_norm": "paddle_rms_norm"})
    assert other.engine.runner.model.fused_stack is None
    assert _decline(other) == "ops chosen that it does not run: rms_norm=paddle_rms_norm"
    assert _decline(other, rms_norm="cpu_native_rms_norm") is None
    from dataclasses import replace

    from fdplug.plugins.cpu.native_stack import decline_reason

    ops = ({op: spec.name for op, spec in other.engine.runner.selection.ops.items()}
           | {"rms_norm": "cpu_native_rms_norm"})
    stack = describe(other.engine.runner.model, ops, "cpu_native")
    assert "projection where the shapes make" in decline_reason(replace(stack, intermediate_size=544))
    assert _decline(other, rms_norm="cpu_native_rms_norm", attention="reference") == \
        "attention backend 'reference' (it runs cpu_native's)"


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
def test_a_float_models_decode_steps_through_the_stack_are_the_layers_bit_for_bit(test_model_dir, dtype, caplog):
    """Float32 and bf16 weights packed for cpu_native_linear (the test model's q/k/v biases added
    inside the packed kernel, as layer by layer), the embedding rows looked up by the model."""
    with caplog.at_level("INFO", logger="fdplug"):
        fused = LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=32, max_num_seqs=4, dtype=dtype)
    assert "decoder stack: cpu_native_decoder_stack (every layer of a decode step in one call)" in caplog.text
    assert fused.engine.runner.model.layers[0].self_attn.qkv_proj.prepared.bias is not None
    layered = LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=32, max_num_seqs=4, dtype=dtype,
                  op_kernels=LAYER_BY_LAYER)
    counting = fused.engine.runner.model.fused_stack = Counting(fused.engine.runner.model.fused_stack)
    assert not counting.embeds
    assert _run(fused) == _run(layered)          # tokens and every logprob value, exactly
    assert counting.ran >= 8 and counting.declined >= 1
    for (k1, v1), (k2, v2) in zip(fused.engine.runner.kv_caches, layered.engine.runner.kv_caches, strict=True):
        assert np.array_equal(k1.numpy(), k2.numpy()) and np.array_equal(v1.numpy(), v2.numpy())


def test_a_float_model_whose_layers_are_not_packed_runs_layer_by_layer(test_model_dir, tmp_path, monkeypatch):
    """paddle's matmul chosen for the linears (as the startup timing may for a layer shape), or the
    weights left [N, K]; a GGUF model ignores the linear op's choice, a float model the GGUF one's."""
    portable = LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=16, op_kernels={"linear": "paddle_linear"})
    assert portable.engine.runner.model.fused_stack is None
    assert _decline(portable) == "ops chosen that it does not run: linear=paddle_linear"
    assert _decline(portable, linear="cpu_native_linear", gguf_linear="paddle_gguf_linear").startswith(
        "a decoder layer's projection runs the portable op (measured faster")   # as the startup timing may
    monkeypatch.setenv("FDPLUG_CPU_PACK_WEIGHTS", "0")
    unpacked = LLM(str(test_model_dir), max_model_len=64, num_kv_blocks=16)
    assert unpacked.engine.runner.model.fused_stack is None
    assert _decline(unpacked).startswith("layer 0: float linear layers left [N, K] (the startup timing put")
    monkeypatch.delenv("FDPLUG_CPU_PACK_WEIGHTS")
    gguf, _ = write_pair(tmp_path, "llama", types={}, tokenizer=True)
    assert _decline(LLM(str(gguf), max_model_len=64, num_kv_blocks=16), linear="paddle_linear") is None


def test_token_ids_outside_the_vocabulary_never_reach_the_kernel(tmp_path):
    """The stack reads embedding rows by id: an id outside the table is a ValueError before any write."""
    import paddle

    from fdplug.plugin_api.attention import AttentionMetadata

    gguf, _ = write_pair(tmp_path, "llama", types={}, tokenizer=True)
    llm = LLM(str(gguf), max_model_len=64, num_kv_blocks=16)
    runner = llm.engine.runner
    stack, vocab = runner.model.fused_stack, runner.model.config.vocab_size
    one = np.array([0, 1])
    meta = AttentionMetadata(one, np.array([1]), np.array([0]), np.array([1]), np.array([16]), np.array([[1]]), 16)
    prepared = runner.attn_backend.prepare(meta)
    cos, sin = runner.model.rotary.lookup(paddle.to_tensor(np.array([0])))
    before = runner.kv_caches[0][0].numpy().copy()
    for bad in (vocab, -1):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            stack(paddle.to_tensor(np.array([bad])), None, cos, sin, runner.kv_caches, prepared)
    assert np.array_equal(runner.kv_caches[0][0].numpy(), before)
    x, _ = stack(paddle.to_tensor(np.array([vocab - 1])), None, cos, sin, runner.kv_caches, prepared)
    assert list(x.shape) == [1, runner.model.config.hidden_size] and np.isfinite(x.numpy()).all()
