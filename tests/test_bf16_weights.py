"""bf16 weights on the float32 cpu device: half the bytes, float32 or bf16 math.

A bf16 checkpoint (or ``dtype="bfloat16"``) keeps its linears, embedding and lm_head in bf16
(`layers.Linear` with bf16 weights, the ``linear`` op). With ``cpu_native_linear`` (float32 math:
widening bf16 to float32 is exact) the model must compute what the float32 model computes on the
same (bf16-rounded) values: the same greedy tokens, logprobs to float32 summation order, and
transformers' logits on the bf16 golden fixture. The bf16-math kernel (selected where the CPU has
AVX512-BF16) is checked in tests/test_cpu_bf16_linear_kernel.py and tests/test_bf16_math.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import paddle
import pytest
from click.testing import CliRunner
from safetensors.paddle import save_file

from fdplug.cli import main
from fdplug.core.frontend.llm import LLM
from fdplug.plugin_api.sampling_params import SamplingParams
from fdplug.plugins.cpu import kernels
from tests.conftest import GOLDEN, golden, write_test_model
from tests.test_model_parity import TOL, Steps, max_diff

if kernels.unavailable_reason() is not None:
    pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}", allow_module_level=True)

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
PORTABLE_OP = {"linear": "paddle_linear"}
FLOAT32_MATH = {"linear": "cpu_native_linear"}


def rewrite(src: Path, dst: Path, dtype: str, matrices_only: bool = False) -> Path:
    """``src`` with every tensor (``matrices_only``: every 2-D one) rounded to bf16 and stored as
    ``dtype``, config.json saying so."""
    from safetensors import safe_open

    def rounded(t):
        return t.astype("bfloat16").astype(dtype) if t.ndim == 2 or not matrices_only else t.astype(dtype)

    with safe_open(str(src / "model.safetensors"), framework="paddle") as f:
        tensors = {name: rounded(f.get_tensor(name)) for name in f.keys()}  # noqa: SIM118
    dst.mkdir()
    for path in src.iterdir():
        if path.name not in ("model.safetensors", "config.json"):
            (dst / path.name).write_bytes(path.read_bytes())
    config = json.loads((src / "config.json").read_text()) | {"torch_dtype": dtype}
    (dst / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=["tied", "untied"])
def models(request, tmp_path_factory):
    """The float32 original, its bf16 checkpoint, the same bf16 values stored as float32, and the
    original with only its matrices rounded (``dtype="bfloat16"`` keeps norms and biases float32)."""
    root = tmp_path_factory.mktemp(request.param)
    src = write_test_model(root / "float", tie_word_embeddings=request.param == "tied")
    return (src, rewrite(src, root / "bf16", "bfloat16"), rewrite(src, root / "rounded", "float32"),
            rewrite(src, root / "matrices", "float32", matrices_only=True))


def prompts() -> list[dict]:
    rng = np.random.default_rng(4)
    return [{"prompt_token_ids": rng.integers(0, 256, size=n).tolist()} for n in (33, 5, 20)]


def run(path: Path, **engine_args):
    llm = LLM(str(path), max_model_len=128, num_kv_blocks=64, **engine_args)
    return llm, [o.outputs[0] for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def assert_same_generation(got, want):
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for g_step, w_step in zip(g.logprobs, w.logprobs):
            assert g_step.keys() == w_step.keys()
            np.testing.assert_allclose([g_step[t].logprob for t in g_step], [w_step[t].logprob for t in g_step],
                                       atol=1e-4)


def test_a_bf16_checkpoint_stays_bf16_and_generates_what_float32_does_on_its_values(models):
    _, bf16, rounded, _ = models
    llm, got = run(bf16, max_num_batched_tokens=16, max_num_seqs=2,
                   op_kernels=FLOAT32_MATH)  # chunked, batched, preempting
    assert (llm.config.dtype, llm.config.weight_dtype) == ("float32", "bfloat16")
    model = llm.engine.runner.model
    assert model.layers[0].self_attn.qkv_proj.weight.dtype == paddle.bfloat16
    assert model.layers[0].mlp.down_proj.weight.dtype == paddle.bfloat16
    assert (model.embed_tokens.dtype == paddle.bfloat16
            and model.layers[0].input_layernorm.weight.dtype == paddle.float32)
    float_llm, want = run(rounded)
    assert float_llm.engine.runner.model.layers[0].self_attn.qkv_proj.weight.dtype == paddle.float32
    assert llm.engine.runner.model_bytes < 0.52 * float_llm.engine.runner.model_bytes
    assert_same_generation(got, want)


def test_dtype_bfloat16_keeps_a_float32_checkpoint_in_bf16(models):
    src, _, _, matrices = models
    llm, got = run(src, dtype="bfloat16", op_kernels=FLOAT32_MATH)
    assert (llm.config.dtype, llm.config.weight_dtype) == ("float32", "bfloat16")
    assert_same_generation(got, run(matrices)[1])


def test_auto_keeps_float32_weights_where_only_the_portable_op_would_read_bf16(models):
    """The portable op widens a whole layer per call (slower than float32 weights): ``auto`` does not
    pick bf16 weights for it, an explicit ``dtype="bfloat16"`` does, and computes the same."""
    _, bf16, _, _ = models
    llm, want = run(bf16, op_kernels=PORTABLE_OP)
    assert (llm.config.dtype, llm.config.weight_dtype) == ("float32", "float32")
    llm, got = run(bf16, op_kernels=PORTABLE_OP, dtype="bfloat16")
    assert llm.config.weight_dtype == "bfloat16" and llm.engine.selection.ops["linear"].name == "paddle_linear"
    assert_same_generation(got, want)


def test_explain_says_the_weights_are_bf16_and_which_kernel_reads_them(models):
    _, bf16, _, _ = models
    out = CliRunner().invoke(main, ["explain", "--model", str(bf16), "--op-kernel", "linear=cpu_native_linear"])
    assert out.exit_code == 0, out.output
    assert "weights: bf16, computed in float32 (linear layers and lm_head: cpu_native_linear;" in out.output
    out = CliRunner().invoke(main, ["explain", "--model", str(bf16), "--dtype", "float32"])
    assert out.exit_code == 0 and "weights: bf16" not in out.output
    assert CliRunner().invoke(main, ["explain", "--dtype", "bfloat16"]).exit_code != 0     # needs --model


def test_bf16_golden_fixture_matches_transformers_with_bf16_weights():
    """transformers computed these logits in float32 from the fixture's bf16 weights: keeping them
    bf16 and widening in the kernel must land within the same tolerance as the float32 path."""
    from fdplug.core.engine.startup import resolve_engine
    from fdplug.core.model.loader import load_model
    from fdplug.plugin_api.ops import Kernels

    name = "qwen2_linear_bf16"
    config, _, selection = resolve_engine(str(GOLDEN / name), ops=FLOAT32_MATH)
    assert config.weight_dtype == "bfloat16"
    steps = Steps(name, num_seqs=1, max_len=32)
    ops = Kernels(**{op: spec.factory(config) for op, spec in selection.ops.items()})
    steps.model, _ = load_model(GOLDEN / name, steps.backend, kernels=ops, weight_dtype="bfloat16", show_progress=False)
    assert steps.model.layers[0].self_attn.o_proj.weight.dtype == paddle.bfloat16
    seqs, logits = golden(name)
    got = steps.step({0: seqs[0]})[0]
    assert max_diff(got, logits[0]) < TOL
    assert (got.argmax(-1) == logits[0].argmax(-1)).all()
