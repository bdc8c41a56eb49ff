"""FP8 block-quantized checkpoints through the portable path: weights stay e4m3, dequantized per use.

The reference is fdplug's own float run of the *dequantized* weights: the same numbers reached
another way, so greedy tokens must be equal and logprobs agree to float rounding. Against the
original float model the FP8 model may differ (e4m3 keeps 3 mantissa bits); the agreement is
measured and bounded below. The quantizer is the core's (`fdplug.plugin_api.fp8`, tested on its own
against numpy in `test_fp8_quant.py`).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fdplug.core.frontend.llm import LLM  # noqa: E402
from fdplug.core.model.checkpoint.config import ModelConfig  # noqa: E402
from fdplug.core.model.layers.fp8_linear import Fp8Linear  # noqa: E402
from fdplug.core.model.layers.linear import Linear  # noqa: E402
from fdplug.core.model.text.tokenizer import Tokenizer  # noqa: E402
from fdplug.core.quant.checkpoint import quantize_checkpoint  # noqa: E402
from fdplug.errors import ModelLoadError, UnsupportedModelError, WeightMismatchError  # noqa: E402
from fdplug.plugin_api.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import write_test_model  # noqa: E402
from tests.serverkit import Server  # noqa: E402
from tests.test_moe_golden import servable  # noqa: E402
from tests.test_moe_models import QWEN3_MOE, write_fused_experts  # noqa: E402

BLOCK = [32, 32]     # several tiles per weight and edge tiles (k rows 32, expert width 24) at this size
QWEN2_MOE = {"architectures": ["Qwen2MoeForCausalLM"], "num_hidden_layers": 3, "num_experts": 8,
             "num_experts_per_tok": 2, "moe_intermediate_size": 24, "shared_expert_intermediate_size": 48,
             "mlp_only_layers": [0]}
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)


def make_fp8(src: Path, fp8_dir: Path, dequant_dir: Path, kept: tuple[str, ...] = (), block: list[int] = BLOCK) -> None:
    """``src`` quantized into ``fp8_dir``, and the quantized weights back in float32 into ``dequant_dir``."""
    assert quantize_checkpoint(src, fp8_dir, block=tuple(block), keep=kept, dequantized=dequant_dir) > 0


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = write_test_model(root / "float", **QWEN2_MOE)
    make_fp8(src, root / "fp8", root / "dequant")
    make_fp8(src, root / "fp8_kept", root / "dequant_kept", kept=("model.layers.0.self_attn", "shared_expert."))
    qwen3 = write_test_model(root / "float_qwen3", **QWEN3_MOE)
    make_fp8(qwen3, root / "fp8_qwen3", root / "dequant_qwen3")
    for name in ("ernie4_5_moe", "glm4_moe"):      # interleaved / partial RoPE: q/k rows and their scales permuted
        # 8-row tiles: the RoPE permutation moves rows across tiles of a 16-dim head
        make_fp8(Path(servable(name, root)), root / f"fp8_{name}", root / f"dequant_{name}", block=[8, 8])
    return {p.name: p for p in root.iterdir()}


def _prompts() -> list[list[int]]:
    rng = np.random.default_rng(5)      # ids below the golden fixtures' vocabulary of 256
    return [rng.integers(0, 256, size=n).tolist() for n in (29, 3, 17, 40)]


def _run(path: Path, **engine_args):
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=64, **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    return llm, [o.outputs[0] for o in outs]


@pytest.mark.parametrize("backend", ["cpu_native", "reference"])
@pytest.mark.parametrize("pair", [("fp8", "dequant"), ("fp8_kept", "dequant_kept"), ("fp8_qwen3", "dequant_qwen3"),
                                  ("fp8_ernie4_5_moe", "dequant_ernie4_5_moe"), ("fp8_glm4_moe", "dequant_glm4_moe")])
def test_fp8_generates_what_its_dequantized_weights_generate(models, pair, backend):
    """Both MoE backends on FP8 experts: cpu_native reads them in place (compiled FP8 linears, and the
    dense FP8 linears too), reference dequantizes one expert at a time. The fixtures' bf16 embedding
    and lm_head stay bf16 in the FP8 model (float32 in the dequantized one): float32 math for them,
    so the two compute the same numbers (bf16 math is tests/test_bf16_math.py's)."""
    llm, got = _run(models[pair[0]], max_num_batched_tokens=16, max_num_seqs=3,    # chunked and batched too
                    moe_backend=backend, op_kernels={"linear": "cpu_native_linear"})
    _, want = _run(models[pair[1]])
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for step_g, step_w in zip(g.logprobs, w.logprobs):
            assert step_g.keys() == step_w.keys()
            np.testing.assert_allclose([step_g[t].logprob for t in step_g], [step_w[t].logprob for t in step_g],
                                       atol=2e-4)
    assert llm.engine.selection.moe.name == backend


def test_fp8_stays_close_to_the_float_model(tmp_path):
    """On a trained model (the demo: random weights have margins too thin for any quantization), FP8
    with 128x128 blocks answers like the float model: measured 4 x 48 greedy tokens all equal, the
    chosen tokens' logprobs within 0.17 nats (0.27 with 32x32 blocks). Bounds: 95% of the tokens,
    0.5 nats, and the first reply word for word."""
    from fdplug.demo import demo_model_dir

    make_fp8(demo_model_dir(), tmp_path / "fp8", tmp_path / "dequant", block=[128, 128])
    prompts = [[{"role": "user", "content": p}] for p in
               ("Hello", "What does the for statement do?", "Tell me about class", "How do I open a file?")]
    params = SamplingParams(temperature=0, max_tokens=48, logprobs=1)
    fp8 = [o.outputs[0] for o in LLM(str(tmp_path / "fp8")).chat(prompts, params, use_tqdm=False)]
    want = [o.outputs[0] for o in LLM(str(demo_model_dir())).chat(prompts, params, use_tqdm=False)]
    assert fp8[0].text == want[0].text
    same = sum(x == y for a, b in zip(fp8, want) for x, y in zip(a.token_ids, b.token_ids))
    assert same >= 0.95 * sum(len(b.token_ids) for b in want)
    for a, b in zip(fp8, want):
        for step_a, step_b, ta, tb in zip(a.logprobs, b.logprobs, a.token_ids, b.token_ids):
            if ta == tb:
                assert abs(step_a[ta].logprob - step_b[tb].logprob) < 0.5


def test_weights_stay_fp8_and_modules_to_not_convert_stay_float(models):
    llm = LLM(str(models["fp8_kept"]), max_model_len=128, num_kv_blocks=64)
    layers = llm.engine.runner.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, Linear) and isinstance(layers[1].self_attn.qkv_proj, Fp8Linear)
    assert isinstance(layers[1].mlp.shared_expert.down_proj, Linear)
    assert isinstance(layers[0].mlp.down_proj, Fp8Linear)
    assert layers[1].self_attn.qkv_proj.weight.dtype == paddle.float8_e4m3fn
    float_bytes = LLM(str(models["float"]), max_model_len=128, num_kv_blocks=64).engine.runner.model_bytes
    fp8_bytes = LLM(str(models["fp8"]), max_model_len=128, num_kv_blocks=64).engine.runner.model_bytes
    cfg = ModelConfig.from_dir(models["float"])
    embeddings = cfg.vocab_size * cfg.hidden_size * 4 * (1 if cfg.tie_word_embeddings else 2)
    # the linears go from 4 bytes a weight to 1 plus 4 / 32 of scales; norms, router and embeddings stay
    assert fp8_bytes - embeddings < 0.4 * (float_bytes - embeddings), (fp8_bytes, float_bytes, embeddings)


def test_fused_fp8_experts_load(models, tmp_path):
    """FP8 experts in the fused layout (``experts.gate_up_proj`` e4m3 ``[E, 2I, H]`` with
    ``experts.gate_up_proj_scale_inv [E, ceil(2I/bn), ceil(H/bk)]``, transformers' FP8 names): the
    32-row tiles straddle each expert's gate and up rows, and still generate what their dequantized
    weights generate; online quantization of the fused float checkpoint equals its FP8 checkpoint."""
    fused = write_fused_experts(models["float"], tmp_path / "fused")
    make_fp8(fused, tmp_path / "fp8", tmp_path / "dequant")
    _, got = _run(tmp_path / "fp8")
    _, want = _run(tmp_path / "dequant")
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    layer = LLM(str(tmp_path / "fp8"), max_model_len=128, num_kv_blocks=64,
                moe_backend="reference").engine.runner.model.layers[1]
    assert layer.mlp.experts.gate.dtype == paddle.float8_e4m3fn          # the reference backend keeps e4m3
    make_fp8(fused, tmp_path / "fp8_128", tmp_path / "dequant_128", block=[128, 128])
    online = LLM(str(fused), max_model_len=128, num_kv_blocks=64, quantization="fp8", moe_backend="reference")
    stored = LLM(str(tmp_path / "fp8_128"), max_model_len=128, num_kv_blocks=64, moe_backend="reference")
    a, b = (llm.engine.runner.model.layers[1].mlp.experts for llm in (online, stored))
    for name in ("gate", "up", "down"):
        np.testing.assert_array_equal(getattr(a, name).astype("float32").numpy(),
                                      getattr(b, name).astype("float32").numpy())
        np.testing.assert_array_equal(a.scales[name].numpy(), b.scales[name].numpy())


def test_a_float_tensor_where_the_config_says_fp8_is_refused(models, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in models["dequant"].iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (bad / "config.json").write_text((models["fp8"] / "config.json").read_text())
    with pytest.raises(WeightMismatchError) as err:
        LLM(str(bad), max_model_len=128, num_kv_blocks=64)
    assert "quantization_config" in str(err.value)


@pytest.mark.parametrize("quant, error, words", [
    ({"quant_method": "awq"}, UnsupportedModelError, "awq"),
    ({"quant_method": "fp8", "weight_block_size": None}, UnsupportedModelError, "weight_block_size"),
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, UnsupportedModelError,
     "static"),
    ({"quant_method": "fp8", "weight_block_size": [128, 0]}, ModelLoadError, "two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "e8m0x"}, UnsupportedModelError, "e8m0x"),
])
def test_unsupported_quantization_is_refused_by_name(models, quant, error, words):
    raw = json.loads((models["float"] / "config.json").read_text())
    with pytest.raises(error, match=words):
        ModelConfig.from_dict(raw | {"quantization_config": quant})


def test_a_partly_quantized_fused_projection_is_refused():
    raw = {"architectures": ["Qwen2ForCausalLM"], "vocab_size": 32, "hidden_size": 16, "intermediate_size": 32,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 2,
           "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                                   "modules_to_not_convert": ["model.layers.0.self_attn.k_proj"]}}
    cfg = ModelConfig.from_dict(raw)
    from fdplug.core.model.weight_slots import weight_slots

    with pytest.raises(UnsupportedModelError, match="k_proj"):
        weight_slots(cfg)


def test_serve_generates_what_the_dequantized_weights_generate(models, tmp_path):
    """A tiny Qwen3-MoE in the FP8 block format through `fdplug serve` and the official client,
    requests at once (batched in the same steps)."""
    from concurrent.futures import ThreadPoolExecutor

    _, want = _run(models["dequant_qwen3"])
    server = Server(["--model", str(models["fp8_qwen3"]), "--served-model-name", "fp8", "--max-model-len", "128",
                     "--num-kv-blocks", "64"], tmp_path / "serve.log").wait_ready()
    try:
        client = server.openai()

        def ask(prompt):
            return client.completions.create(model="fp8", prompt=prompt, max_tokens=GREEDY.max_tokens, temperature=0,
                                             logprobs=1, extra_body={"ignore_eos": True})

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(ask, _prompts()))
    finally:
        assert server.stop() == 0, server.log()
    tokenizer = Tokenizer.from_dir(models["dequant_qwen3"])
    for reply, expected in zip(replies, want):
        assert reply.choices[0].logprobs.tokens == [tokenizer.decode([t], skip_special_tokens=False)
                                                    for t in expected.token_ids]
    # Against the original float model: this random-weight model's margins are thin, so agreement is
    # partial (measured 32 of 48 greedy tokens with these 32x32 blocks); stated bound: half.
    _, original = _run(models["float_qwen3"])
    same = sum(a == b for x, y in zip(want, original) for a, b in zip(x.token_ids, y.token_ids))
    assert same >= 0.5 * sum(len(y.token_ids) for y in original)


# -- online quantization: quantization="fp8" on a float checkpoint ----------------------------------


@pytest.fixture(scope="module")
def blocks128(models, tmp_path_factory):
    """The float Qwen2-MoE as an FP8 checkpoint of 128x128 blocks (online quantization's), and dequantized."""
    root = tmp_path_factory.mktemp("fp8_128")
    make_fp8(models["float"], root / "fp8", root / "dequant", block=[128, 128])
    return root


def test_online_fp8_is_the_fp8_checkpoint_of_the_same_weights(models, blocks128):
    """Quantizing while loading gives the model an FP8 checkpoint of 128x128 blocks gives: the same
    parameters bit for bit, so the same tokens and logprobs as its dequantized weights."""
    online = LLM(str(models["float"]), max_model_len=128, num_kv_blocks=64, quantization="fp8")
    stored = LLM(str(blocks128 / "fp8"), max_model_len=128, num_kv_blocks=64)
    got = dict(online.engine.runner.model.named_parameters())
    want = dict(stored.engine.runner.model.named_parameters())
    assert got.keys() == want.keys()
    assert any(p.dtype == paddle.float8_e4m3fn for p in got.values())
    for name, p in got.items():
        assert p.dtype == want[name].dtype, name
        np.testing.assert_array_equal(p.astype("float32").numpy(), want[name].astype("float32").numpy(), err_msg=name)
    assert online.engine.runner.model_bytes == stored.engine.runner.model_bytes
    out = online.generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY, use_tqdm=False)
    _, reference = _run(blocks128 / "dequant")
    assert [o.outputs[0].token_ids for o in out] == [o.token_ids for o in reference]


def test_online_fp8_of_an_fp8_checkpoint_changes_nothing(models):
    cfg = ModelConfig.from_dir(models["fp8"], "fp8")
    assert cfg.quant == ModelConfig.from_dir(models["fp8"]).quant and not cfg.quant.online
    online = ModelConfig.from_dir(models["float"], "fp8").quant
    assert online.online and online.block == (128, 128) and "quantized from float at load" in online.describe()


def test_unknown_quantization_and_non_finite_weights_are_refused(models, tmp_path):
    from safetensors.paddle import load_file, save_file

    from fdplug.errors import ConfigError

    with pytest.raises(ConfigError, match="int4"):
        LLM(str(models["float"]), quantization="int4")
    broken = tmp_path / "nan"
    broken.mkdir()
    for f in models["float"].iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight"
    w = tensors[name].numpy().copy()
    w[3, 5] = np.nan
    tensors[name] = paddle.to_tensor(w)
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightMismatchError, match="o_proj.*non-finite"):
        LLM(str(broken), max_model_len=128, num_kv_blocks=64, quantization="fp8")


def test_explain_shows_online_quantization(models):
    import subprocess
    import sys

    fdplug_cli = Path(sys.executable).parent / "fdplug"
    out = subprocess.run([str(fdplug_cli), "explain", "--model", str(models["float"]), "--quantization", "fp8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "quantization: fp8 e4m3 weights, 128x128 blocks" in out.stdout and "quantized from float" in out.stdout
    bad = subprocess.run([str(fdplug_cli), "explain", "--quantization", "fp8"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "--model" in bad.stderr
