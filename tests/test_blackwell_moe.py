"""The blackwell_moe plugin without a Blackwell GPU: everything but the kernels, and its selection.

The grouped GEMMs are DeepGEMM's and run only on SM100; here `EmulatedDeepGemm` stands in for them
(a numpy loop, clearly not the kernel): it reads its inputs exactly as the kernel is documented to,
decoding the packed UE8M0, MN-major scale words with numpy written here, not with the core's
packer. So the backend's layouts, requantization, dispatch and combine are checked end to end
against the portable path (`ReferenceMoE` on the same FP8 experts); what the kernel itself does
on the GPU is not, and the note says so.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

paddle = pytest.importorskip("paddle")

from fdplug.core.config import EngineConfig  # noqa: E402
from fdplug.core.plugin_loading.loader import load_plugins  # noqa: E402
from fdplug.core.plugin_loading.selection import select_components  # noqa: E402
from fdplug.core.portable.moe import ReferenceMoE  # noqa: E402
from fdplug.core.quant.fp8_rows import dequant_rows  # noqa: E402
from fdplug.errors import ConfigError, SelectionError  # noqa: E402
from fdplug.plugin_api.engine_config import ModelTraits  # noqa: E402
from fdplug.plugin_api.fp8 import block_quant  # noqa: E402
from fdplug.plugin_api.moe import ExpertWeights  # noqa: E402
from fdplug.plugin_api.specs import Probe  # noqa: E402
from fdplug.plugins.blackwell_moe import requirements  # noqa: E402
from fdplug.plugins.blackwell_moe.backend import BlackwellFp8MoE, pack_experts  # noqa: E402

E, H, INTER, K = 8, 256, 128, 2


def decode_scales(words, n: int, groups: int) -> np.ndarray:
    """DeepGEMM's SM100 scale words ``[..., ceil(groups/4), align(n, 4)]`` int32 -> ``[..., n, groups]``
    float: byte ``i`` of word ``j`` is the biased exponent of K group ``4j + i``, MN-major."""
    w = words.numpy().astype(np.int64) & 0xFFFFFFFF
    b = np.stack([(w >> (8 * i)) & 0xFF for i in range(4)], axis=-2)          # [..., words, 4, n']
    b = b.reshape(w.shape[:-2] + (w.shape[-2] * 4, w.shape[-1]))[..., :groups, :n]
    return np.ldexp(1.0, b - 127).swapaxes(-1, -2)


def dequant(q, words) -> np.ndarray:
    x = q.astype("float32").numpy()
    rows, k = x.shape[-2:]
    scales = decode_scales(words, rows, -(-k // 128))
    return x * np.repeat(scales, 128, axis=-1)[..., :k]


def _bf16(x: np.ndarray):
    return paddle.to_tensor(x.astype(np.float32)).astype("bfloat16")


class EmulatedDeepGemm:
    """numpy stand-in for DeepGEMM's grouped FP8 GEMMs (``D = A @ B^T`` per expert, bf16 out); it
    writes only the rows the kernel writes, so garbage in padding rows stays garbage."""

    name = "numpy-emulation"

    def __init__(self) -> None:
        self.calls: list[str] = []

    def contiguous(self, a, b, out, m_indices) -> None:
        self.calls.append("contiguous")
        x, w, experts = dequant(*a), dequant(*b), m_indices.numpy()
        result = out.astype("float32").numpy()
        for row in np.nonzero(experts >= 0)[0]:
            result[row] = x[row] @ w[experts[row]].T
        paddle.assign(_bf16(result), out)

    def dense(self, a, b, out) -> None:
        self.calls.append("dense")
        paddle.assign(_bf16(dequant(*a) @ dequant(*b).T), out)

    def masked(self, a, b, out, masked_m, expected_m) -> None:
        self.calls.append("masked")
        x, w, used = dequant(*a), dequant(*b), masked_m.numpy()
        assert expected_m >= 1
        result = out.astype("float32").numpy()
        for e, m in enumerate(used):
            result[e, :m] = x[e, :m] @ w[e].T
        paddle.assign(_bf16(result), out)


def fp8_experts(seed: int = 0, block=(128, 128), ue8m0: bool = False) -> ExpertWeights:
    """Random experts quantized as an FP8 block checkpoint, scales per row as the loader keeps them."""
    rng = np.random.default_rng(seed)

    def quant(rows, cols):
        w = paddle.to_tensor(rng.normal(0, 0.05, size=(E, rows, cols)).astype(np.float32))
        q, grid = block_quant(w, block, ue8m0=ue8m0)
        return q, paddle.repeat_interleave(grid, block[0], axis=1)[:, :rows, :]

    (gate, gs), (up, us), (down, ds) = quant(INTER, H), quant(INTER, H), quant(H, INTER)
    return ExpertWeights(gate, up, down, format="fp8_block", scales={"gate": gs, "up": us, "down": ds}, block=block)


def routed(tokens: int, seed: int = 1):
    rng = np.random.default_rng(seed)
    hidden = paddle.to_tensor(rng.normal(0, 1, size=(tokens, H)).astype(np.float32))
    ids = np.array([rng.choice(E, size=K, replace=False) for _ in range(tokens)], np.int64).reshape(tokens, K)
    weights = rng.dirichlet(np.ones(K), size=tokens).astype(np.float32).reshape(tokens, K)
    return hidden, paddle.to_tensor(weights), paddle.to_tensor(ids)


def test_packed_weights_decode_to_the_checkpoint_weights():
    """The fused gate/up and down tensors and their SM100 scale words hold the checkpoint's weights:
    float scales re-quantized to powers of two (vLLM's requant) change each weight by at most one
    e4m3 rounding; UE8M0 checkpoints pass through bit for bit."""
    weights = fp8_experts()
    layer = pack_experts(weights)
    assert layer.w13.shape == [E, 2 * INTER, H] and layer.w13_scales.dtype == paddle.int32
    assert layer.w13_scales.shape == [E, 1, 2 * INTER] and layer.w2_scales.shape == [E, 1, H]
    want = {name: dequant_rows(getattr(weights, name), weights.scales[name], 128, "float32").numpy()
            for name in ("gate", "up", "down")}
    got_gate_up = dequant(layer.w13, layer.w13_scales)
    for got, name in ((got_gate_up[:, :INTER], "gate"), (got_gate_up[:, INTER:], "up"),
                      (dequant(layer.w2, layer.w2_scales), "down")):
        # one e4m3 rounding: relative 2^-4, or 2^-9 of the block's amax for values near zero
        assert np.all(np.abs(got - want[name]) <= 2 ** -4 * np.abs(want[name]) + 2 ** -9 * np.abs(want[name]).max())
        assert not np.array_equal(got, want[name])       # float scales did change
    exact = pack_experts(fp8_experts(ue8m0=True))
    same = fp8_experts(ue8m0=True)
    np.testing.assert_array_equal(exact.w2.astype("float32").numpy(), same.down.astype("float32").numpy())
    np.testing.assert_array_equal(decode_scales(exact.w2_scales, H, 1), same.scales["down"].numpy())


@pytest.mark.parametrize("tokens, dispatch", [(1, 64), (5, 64), (40, 64), (200, 64), (33, 8)])
def test_forward_matches_the_portable_path(tokens, dispatch):
    """Both layouts (masked when the step has at most num_max_dispatch_tokens_per_rank tokens,
    contiguous otherwise) against the reference backend on the same FP8 experts. The difference is
    the kernels' e4m3 activations (quantized twice: the input, then the SwiGLU output) and bf16
    outputs: measured relative error 5.7-6.7% (quantizing the input alone gives 3.7%), bounded at
    9%. A wrong scale layout or a misrouted row is off by 100% or more."""
    weights = fp8_experts()
    gemm = EmulatedDeepGemm()
    backend = BlackwellFp8MoE(gemm, dispatch_tokens=dispatch)
    hidden, topk_weights, topk_ids = routed(tokens)
    got = backend.forward(hidden, topk_weights, topk_ids, backend.load_weights(weights)).numpy()
    ref = ReferenceMoE()
    want = ref.forward(hidden, topk_weights, topk_ids, ref.load_weights(weights)).numpy()
    assert got.shape == (tokens, H) and np.isfinite(got).all()
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.09
    assert gemm.calls == ["masked" if tokens <= dispatch else "contiguous"] * 2


def test_both_layouts_compute_the_same_rows():
    weights = fp8_experts()
    hidden, topk_weights, topk_ids = routed(20)
    masked = BlackwellFp8MoE(EmulatedDeepGemm(), dispatch_tokens=64)
    contiguous = BlackwellFp8MoE(EmulatedDeepGemm(), dispatch_tokens=4)
    a = masked.forward(hidden, topk_weights, topk_ids, masked.load_weights(weights)).numpy()
    b = contiguous.forward(hidden, topk_weights, topk_ids, contiguous.load_weights(weights)).numpy()
    np.testing.assert_array_equal(a, b)


def test_a_step_with_no_tokens_returns_empty_without_a_kernel():
    gemm = EmulatedDeepGemm()
    backend = BlackwellFp8MoE(gemm, dispatch_tokens=8)
    layer = backend.load_weights(fp8_experts())
    out = backend.forward(paddle.zeros([0, H]), paddle.zeros([0, K]), paddle.zeros([0, K], dtype="int64"), layer)
    assert out.shape == [0, H] and gemm.calls == []


@pytest.mark.parametrize("weights, words", [
    (ExpertWeights(paddle.zeros([E, INTER, H]), paddle.zeros([E, INTER, H]), paddle.zeros([E, H, INTER])), "'none'"),
    (fp8_experts(block=(64, 64)), "128-wide K blocks"),
])
def test_formats_the_kernels_cannot_take_are_refused(weights, words):
    with pytest.raises(ConfigError, match=words):
        pack_experts(weights)


# -- selection -----------------------------------------------------------------------------------

FP8_MOE = ModelTraits(num_experts=E, experts_per_token=K, hidden_size=H, moe_intermediate_size=INTER,
                      moe_weight_format="fp8_block", linear_weight_format="fp8_block", weight_block=(128, 128))


@pytest.fixture
def gpu(monkeypatch):
    """A cuda device that probes available with the given capability (nothing here runs on it)."""
    from fdplug.plugins import cuda

    def fake(capability):
        monkeypatch.setattr(cuda, "probe", lambda: Probe(True, "1 CUDA device(s) visible (faked by the test)"))
        monkeypatch.setattr(requirements, "gpu_capability", lambda: capability)
        return load_plugins()
    return fake


@pytest.fixture
def deep_gemm(monkeypatch):
    """PaddleFleet's DeepGEMM ops with both grouped GEMMs (the emulation, taking paddle tensors), as
    an install would provide them."""
    package, module = types.ModuleType("paddlefleet_ops"), types.ModuleType("paddlefleet_ops.deep_gemm")
    emulated = EmulatedDeepGemm()
    module.m_grouped_fp8_gemm_nt_contiguous = lambda a, b, d, m: emulated.contiguous(a, b, d, m)
    module.m_grouped_fp8_gemm_nt_masked = lambda a, b, d, m, e: emulated.masked(a, b, d, m, e)
    module.fp8_gemm_nt = lambda a, b, d: emulated.dense(a, b, d)
    package.deep_gemm = module
    monkeypatch.setitem(sys.modules, "paddlefleet_ops", package)
    monkeypatch.setitem(sys.modules, "paddlefleet_ops.deep_gemm", module)
    return emulated


def _moe_reason(selection) -> str:
    return next(d.reason for d in selection.decisions if d.role == "moe" and d.name == "blackwell_fp8")


def test_hopper_is_refused_with_the_capability_and_the_missing_kernels(gpu):
    selection = select_components("cuda", config=EngineConfig(model=FP8_MOE), plugins=gpu((9, 0)))
    assert selection.moe.name == "reference"
    reason = _moe_reason(selection)
    assert "needs compute capability >= 10.0 (Blackwell), GPU 0 is 9.0" in reason
    assert "m_grouped_fp8_gemm_nt_contiguous" in reason and "deep_gemm: not importable" in reason


def test_blackwell_without_kernels_names_the_missing_kernel(gpu):
    with pytest.raises(SelectionError) as err:
        select_components("cuda", moe="blackwell_fp8", config=EngineConfig(model=FP8_MOE), plugins=gpu((10, 0)))
    message = str(err.value)
    assert "compute capability" not in message
    assert "needs DeepGEMM's grouped FP8 GEMMs m_grouped_fp8_gemm_nt_contiguous and m_grouped_fp8_gemm_nt_masked" \
        in message and "deep_gemm: not importable" in message


def test_blackwell_with_kernels_is_chosen_for_fp8_experts_only(gpu, deep_gemm, monkeypatch):
    plugins = gpu((10, 0))
    assert select_components("cuda", config=EngineConfig(model=FP8_MOE), plugins=plugins).moe.name == "blackwell_fp8"
    float_moe = ModelTraits(num_experts=E, experts_per_token=K, hidden_size=H, moe_intermediate_size=INTER)
    plain = select_components("cuda", config=EngineConfig(model=float_moe), plugins=plugins)
    assert plain.moe.name == "reference"
    assert _moe_reason(plain) == "executes weight formats fp8_block, not the model's 'none'"
    odd = ModelTraits(num_experts=E, experts_per_token=K, hidden_size=200, moe_intermediate_size=INTER,
                      moe_weight_format="fp8_block", weight_block=(128, 64))
    reason = _moe_reason(select_components("cuda", config=EngineConfig(model=odd), plugins=plugins))
    assert "weight_block_size [*, 128]" in reason and "hidden_size a multiple of 128, the model's is 200" in reason
    monkeypatch.setenv("FD_USE_DEEP_GEMM", "0")
    off = select_components("cuda", config=EngineConfig(model=FP8_MOE), plugins=plugins)
    assert "FD_USE_DEEP_GEMM=0" in _moe_reason(off)


def test_the_selected_backend_runs_on_the_installed_kernels(gpu, deep_gemm):
    from fdplug.plugins.blackwell_moe import _factory

    backend = _factory(EngineConfig(model=FP8_MOE, max_num_seqs=16))
    assert backend.dispatch_tokens == 16        # FastDeploy's rule: max_num_seqs x (0 speculative + 1)
    hidden, topk_weights, topk_ids = routed(3)
    backend.forward(hidden, topk_weights, topk_ids, backend.load_weights(fp8_experts()))
    assert deep_gemm.calls == ["masked", "masked"]


def test_dispatch_tokens_are_validated_in_configure(gpu, deep_gemm, monkeypatch):
    plugins = gpu((10, 0))
    config = EngineConfig(model=FP8_MOE, max_num_seqs=32)
    selection = select_components("cuda", config=config, plugins=plugins)
    plugins.configure(config, selection)          # the default follows max_num_seqs
    monkeypatch.setenv("FDPLUG_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "16")
    with pytest.raises(ConfigError, match="num_max_dispatch_tokens_per_rank=16 is below max_num_seqs=32"):
        plugins.configure(config, selection)
    monkeypatch.setenv("FDPLUG_NUM_MAX_DISPATCH_TOKENS_PER_RANK", "64")
    plugins.configure(config, selection)
    assert requirements.dispatch_tokens(config) == 64


def test_explain_here_says_there_is_no_cuda_and_what_it_needs():
    import subprocess
    from pathlib import Path

    out = subprocess.run([str(Path(sys.executable).parent / "fdplug"), "explain", "--moe", "blackwell_fp8"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "cuda: not available here: paddle" in out.stderr and "not compiled with CUDA support" in out.stderr
    assert "compute capability >= 10.0" in out.stderr and "m_grouped_fp8_gemm_nt_contiguous" in out.stderr


def test_explain_on_a_faked_blackwell_names_the_missing_kernel(gpu):
    from click.testing import CliRunner

    from fdplug.cli import main

    gpu((10, 0))
    result = CliRunner().invoke(main, ["explain", "--device", "cuda", "--moe", "blackwell_fp8"])
    assert result.exit_code == 1
    assert "needs DeepGEMM's grouped FP8 GEMMs" in result.output and "deep_gemm: not importable" in result.output


# -- the dense FP8 linear (fp8_linear op) --------------------------------------------------------


def test_dense_linear_matches_the_portable_op_and_packs_each_weight_once():
    """``x @ W^T`` through the emulated ``fp8_gemm_nt``: the activations' 1x128 e4m3 quantization is
    the difference (measured 3.1% relative, bounded at 6%); each weight is requantized and packed
    the first time only; no rows, no kernel."""
    from fdplug.core.portable.ops import fp8_linear
    from fdplug.plugins.blackwell_moe.linear import BlackwellFp8Linear

    weights = fp8_experts(seed=3)
    weight, scale = weights.gate[2], weights.scales["gate"][2]        # one [I, H] linear
    gemm = EmulatedDeepGemm()
    op = BlackwellFp8Linear(gemm)
    x = paddle.to_tensor(np.random.default_rng(4).normal(0, 1, size=(2, 5, H)).astype(np.float32))
    got = op(x, weight, scale, 128).numpy()
    want = fp8_linear(x, weight, scale, 128).numpy()
    assert got.shape == (2, 5, INTER)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.06
    op(x, weight, scale, 128)
    assert len(op._packed) == 1 and gemm.calls == ["dense", "dense"]
    assert op(x[:, :0], weight, scale, 128).shape == [2, 0, INTER] and gemm.calls == ["dense", "dense"]


def test_dense_linear_is_opt_in_like_fastdeploys(gpu, deep_gemm, monkeypatch):
    plugins = gpu((10, 0))
    config = EngineConfig(model=FP8_MOE)
    off = select_components("cuda", config=config, plugins=plugins)
    assert off.ops["fp8_linear"].name == "paddle_fp8_linear"
    reason = next(d.reason for d in off.decisions if d.name == "blackwell_fp8_linear")
    assert "FD_USE_BLACKWELL_GEMM=0" in reason
    monkeypatch.setenv("FD_USE_BLACKWELL_GEMM", "1")
    on = select_components("cuda", config=config, plugins=plugins)
    assert on.ops["fp8_linear"].name == "blackwell_fp8_linear"
    plugins.configure(config, on)
    monkeypatch.setenv("FD_USE_DEEP_GEMM", "0")
    with pytest.raises(ConfigError, match="FD_USE_BLACKWELL_GEMM=1 needs FD_USE_DEEP_GEMM=1"):
        plugins.configure(config, on)
