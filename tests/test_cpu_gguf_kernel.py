"""The cpu plugin's GGUF linear kernel (``cpu_native_gguf_linear``) against the portable op.

Blocks of every type it decodes, made two ways: ``gguf.quants.quantize`` where the gguf package
quantizes the type (well-formed blocks: the values a real file holds), and random bytes with the
float16 scale fields overwritten by finite values (every bit pattern of the packed integers,
negative scales and mins; the only way to get K-quant blocks, which gguf does not quantize). The
decoders must give `gguf_blocks.dequantize`'s bits; the products the portable op's matmul to
float32 rounding. ``tests/test_cpu_isa.py`` runs this file again at the AVX2 cap (and the scalar
fallback's level).
"""

from __future__ import annotations

import gguf
import numpy as np
import paddle
import pytest

from fdplug.core.portable.ops import gguf_linear as portable
from fdplug.core.quant.gguf_blocks import dequantize, sample_blocks
from fdplug.plugins.cpu import isa, kernels, native_gguf

if kernels.unavailable_reason() is not None:
    pytest.skip(f"the cpu kernels do not build here: {kernels.unavailable_reason()}", allow_module_level=True)

TYPES = native_gguf.SUPPORTED
ROWS = (1, 3, 8, 9, 64, 300)   # one tile and its tails, two row tiles, the panel route


def depths(qtype: str) -> tuple[int, ...]:
    return (256, 512) if qtype.endswith("_K") else (576, 1536)


def random_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray:
    """``[n, row_bytes]`` random bytes whose float16 fields are finite (either sign, 1e-4 to 1e-1);
    F16/BF16: random bit patterns of values below 2 in magnitude (subnormals, both zeros included)."""
    if qtype in ("F16", "BF16"):
        bits = rng.integers(0, 1 << 16, (n, k), dtype=np.uint16)
        top = 0x3F80 if qtype == "BF16" else 0x3C00          # exponents up to 1.x: products stay finite
        exponent = bits & (0x7F80 if qtype == "BF16" else 0x7C00)
        bits = np.where(exponent > top, bits & np.uint16(0x8000 | (top - 1)), bits).astype(np.uint16)
        return bits.view(np.uint8).reshape(n, -1)
    return sample_blocks(qtype, n, k, rng)


def quantized_blocks(qtype: str, n: int, k: int, rng: np.random.Generator) -> np.ndarray | None:
    """gguf's own blocks for weights of about 0.05, or None where it does not quantize the type."""
    try:
        made = gguf.quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05,
                                    gguf.GGMLQuantizationType[qtype])
        return np.ascontiguousarray(made).view(np.uint8).reshape(n, -1)   # (F16/BF16 come as halves)
    except NotImplementedError:
        return None


def weights(qtype: str, n: int, k: int, seed: int) -> list[paddle.Tensor]:
    rng = np.random.default_rng(seed)
    made = [random_blocks(qtype, n, k, rng), quantized_blocks(qtype, n, k, rng)]
    return [paddle.to_tensor(np.ascontiguousarray(w)) for w in made if w is not None]


def row_cases(qtype: str, n: int, seed: int, rng: np.random.Generator):
    """``(k, w, x)`` for each depth of `depths`, each kind of `weights` blocks and each row count of
    `ROWS`: ``x [rows, k]`` float32 drawn from ``rng`` (the math tests' loop)."""
    for k in depths(qtype):
        for w in weights(qtype, n, k, seed=seed):
            for rows in ROWS:
                yield k, w, rng.standard_normal((rows, k)).astype(np.float32)


@pytest.mark.parametrize("qtype", TYPES)
def test_the_decoders_give_the_portable_bits(qtype):
    """Every weight decoded to the float32 the portable dequantization (ggml's arithmetic) gives."""
    for k in depths(qtype):
        for w in weights(qtype, 70, k, seed=k):
            got = native_gguf.dequantize(w, qtype, k, threads=2).numpy()
            np.testing.assert_array_equal(got, dequantize(w, qtype, k).numpy(), err_msg=f"{qtype} K={k}")


@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_matches_the_portable_op(qtype):
    """N = 70 (no multiple of any tile), two depths each, 1 to 300 rows (both routes, tile tails)."""
    for k in depths(qtype):
        for w in weights(qtype, 70, k, seed=k + 1):
            rng = np.random.default_rng(k)
            for rows in ROWS:
                x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
                expected = portable(x, w, qtype, k).numpy()
                got = native_gguf.gguf_linear(x, w, qtype, k, threads=2).numpy()
                np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max(),
                                           err_msg=f"{qtype} 70x{k}, {rows} rows")


@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K"])
def test_the_same_bits_whatever_the_batch_the_route_or_the_threads(qtype):
    """A row alone on one thread (the register route) gives its bits in a batch of 300 on two (the
    panel route): a token's logits do not depend on what it is batched with."""
    k = depths(qtype)[1]
    w = weights(qtype, 37, k, seed=5)[0]
    x = paddle.to_tensor(np.random.default_rng(6).standard_normal((300, k)).astype(np.float32))
    batch = native_gguf.gguf_linear(x, w, qtype, k, threads=2).numpy()
    for r in (0, 7, 8, 299):
        alone = native_gguf.gguf_linear(x[r:r + 1], w, qtype, k, threads=1).numpy()
        np.testing.assert_array_equal(alone[0], batch[r], err_msg=f"row {r}")
    np.testing.assert_array_equal(native_gguf.gguf_linear(x[:9], w, qtype, k, threads=1).numpy(), batch[:9])
    # a last row tile of 2 and of 1 (the AVX2 panel tiles take 3 rows x 4 columns)
    for rows in (299, 298):
        np.testing.assert_array_equal(native_gguf.gguf_linear(x[:rows], w, qtype, k, threads=2).numpy(), batch[:rows])


def test_calls_from_two_threads_at_once():
    """A call made while another holds the thread pool runs on fresh threads, each with its own panel
    buffer (freed when it exits): the same bits either way."""
    from concurrent.futures import ThreadPoolExecutor

    k, w = 576, weights("Q4_0", 64, 576, seed=15)[0]
    x = paddle.to_tensor(np.random.default_rng(16).standard_normal((40, k)).astype(np.float32))
    want = native_gguf.gguf_linear(x, w, "Q4_0", k, threads=2).numpy()
    with ThreadPoolExecutor(2) as pool:
        runs = list(pool.map(lambda _: [native_gguf.gguf_linear(x, w, "Q4_0", k, threads=2).numpy()
                                        for _ in range(20)], range(2)))
    for got in (g for run in runs for g in run):
        np.testing.assert_array_equal(got, want)


def test_the_op_wrapper_reshapes_falls_back_and_checks_shapes():
    k, w = 576, weights("Q8_0", 24, 576, seed=7)[0]
    x = paddle.to_tensor(np.random.default_rng(8).standard_normal((2, 5, k)).astype(np.float32))
    got = native_gguf.gguf_linear_or_portable(x, w, "Q8_0", k, threads=2)
    assert got.shape == [2, 5, 24]
    expected = portable(x, w, "Q8_0", k).numpy()
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    assert native_gguf.gguf_linear(x[:, :0], w, "Q8_0", k, threads=2).shape == [2, 0, 24]
    f32 = paddle.to_tensor(np.random.default_rng(9).standard_normal((24, k)).astype(np.float32)).view(paddle.uint8)
    np.testing.assert_array_equal(native_gguf.gguf_linear_or_portable(x, f32, "F32", k, threads=2).numpy(),
                                  portable(x, f32, "F32", k).numpy())          # a type it lacks: the portable op
    with pytest.raises(ValueError, match="decodes Q8_0"):
        native_gguf.gguf_linear(x, f32, "F32", k, threads=2)
    odd = paddle.to_tensor(np.random.default_rng(9).standard_normal((24, 40)).astype(np.float16)).view(paddle.uint8)
    assert not native_gguf.takes("F16", 40)                  # F16 rows of 40: not in runs of 32, the portable op
    np.testing.assert_array_equal(native_gguf.gguf_linear_or_portable(x[..., :40], odd, "F16", 40, threads=2).numpy(),
                                  portable(x[..., :40], odd, "F16", 40).numpy())
    with pytest.raises(ValueError, match=r"uint8 \[N, 646\]"):
        native_gguf.gguf_linear(x, w, "Q8_0", 608, threads=2)
    with pytest.raises(ValueError, match="multiple of 256"):
        native_gguf.gguf_linear(x, w, "Q4_K", k, threads=2)


def test_the_op_runs_the_tiles_at_every_row_count_so_a_row_does_not_depend_on_its_batch():
    """At every level (AVX2 included, where widening the layer for paddle's matmul would be faster
    from ~16 rows) the op's rows are the kernel's, the same bits alone as in a batch of 40."""
    k, w = 512, weights("Q5_K", 40, 512, seed=13)[0]
    x = paddle.to_tensor(np.random.default_rng(14).standard_normal((40, k)).astype(np.float32))
    batched = native_gguf.gguf_linear_or_portable(x, w, "Q5_K", k, threads=2).numpy()
    np.testing.assert_array_equal(batched, native_gguf.gguf_linear(x, w, "Q5_K", k, threads=2).numpy())
    for row in (0, 17, 39):
        alone = native_gguf.gguf_linear_or_portable(x[row:row + 1], w, "Q5_K", k, threads=2).numpy()
        np.testing.assert_array_equal(alone[0], batched[row])


def test_selection_picks_the_kernel_where_the_tiles_are():
    """Chosen for gguf_linear at x86-64-v3 and above (packed q8 math where the build has AVX512-VNNI
    and at x86-64-v3: tests/test_cpu_gguf_packed_kernel.py; else bf16 math where it has AVX512-BF16:
    tests/test_cpu_gguf_bf16_kernel.py);
    below, the portable op (its scalar loop, as the linears' is refused there)."""
    from fdplug.core.plugin_loading.selection import select_components

    chosen = select_components("cpu").ops["gguf_linear"].name
    assert chosen == selected_native() if isa.level() >= 3 else chosen == "paddle_gguf_linear"


def selected_native() -> str:
    """The GGUF kernel chosen at x86-64-v3 and above: packed q8 math with VNNI and at x86-64-v3,
    else bf16 math with AVX512-BF16, else q8 math at x86-64-v3 (no packed tiles) and float32 math at
    AVX-512."""
    from fdplug.plugins.cpu import native_gguf_packed

    if native_gguf_packed.available() and (native_gguf_packed.vnni() or isa.level() == 3):
        return "cpu_native_gguf_packed_linear"
    if native_gguf.bf16_math_available():
        return "cpu_native_gguf_bf16_linear"
    return "cpu_native_gguf_q8_linear" if isa.level() == 3 else "cpu_native_gguf_linear"


_BITS_SCRIPT = r"""
import sys
import numpy as np
import paddle
from fdplug.plugins.cpu import isa, native_gguf
from tests.test_cpu_gguf_kernel import TYPES, depths, weights

print(isa.level())
out = {}
# each type at its first depth, and the 32-weight ones at 608 too: an odd number of pieces (the last in
# the first chain); 1 row, a tile's tail (5) and, from 40, the panel routes
for qtype, k in [(t, depths(t)[0]) for t in TYPES] + [(t, 608) for t in TYPES if not t.endswith("_K")]:
    w = weights(qtype, 19, k, seed=11)[0]
    x = paddle.to_tensor(np.random.default_rng(12).standard_normal((40, k)).astype(np.float32))
    for rows in (1, 5, 40):
        out[f"{qtype}-{k}-{rows}"] = native_gguf.gguf_linear(x[:rows], w, qtype, k, threads=2).numpy()
        if native_gguf.q8_math_available():
            out[f"q8-{qtype}-{k}-{rows}"] = native_gguf.gguf_linear(x[:rows], w, qtype, k, threads=2,
                                                                    q8_math=True).numpy()
np.savez(sys.argv[1], **out)
"""


def test_every_level_gives_the_same_bits(tmp_path):
    """The AVX-512 tiles, the AVX2 ones (each 16-lane chain as two ymm) and the scalar loop (32
    fmaf chains a row, the same lane sum) give the same bits: a fleet of mixed CPUs gives the same
    logits. So do the q8 tiles at AVX-512 (vpdpbusd), AVX2 (vpmaddubsw) and, where the CPU has it,
    AVX2 + AVX-VNNI (vpdpbusd again); the scalar level has none. Run once, uncapped, on an AVX-512
    machine (each level is a build of its own)."""
    import subprocess
    import sys

    from tests.conftest import REPO, subprocess_env

    if not isa.is_x86() or isa.detected_level() < 4 or isa.cap() is not None:
        pytest.skip("needs an AVX-512 CPU, uncapped, to compare the levels below with it")
    builds = {"avx512": {}, "avx2": {}, "sse4": {}}
    if "avx_vnni" in isa.cpu_flags():     # x86-64-v3 with AVX-VNNI (Alder Lake, Zen 4 without AVX-512): q8's vpdpbusd
        builds["avx2+vnni"] = {"CC": " ".join([*kernels.compiler(), "-mavxvnni"])}
    saved = {}
    for build, extra in builds.items():
        level = build.split("+")[0]
        path = tmp_path / f"{build}.npz"
        result = subprocess.run([sys.executable, "-c", _BITS_SCRIPT, str(path)], capture_output=True, text=True,
                                env=subprocess_env(FDPLUG_CPU_ISA=level, **extra), cwd=REPO, timeout=600, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.split()[0] == str(isa.CAPS[level])
        saved[build] = np.load(path)
    assert "q8-Q4_1-608-1" in saved["avx512"].files and "q8-Q4_1-608-1" in saved["avx2"].files
    assert not any(name.startswith("q8-") for name in saved["sse4"].files)
    for name in saved["avx512"].files:
        for build in saved:
            if build != "avx512" and not (build == "sse4" and name.startswith("q8-")):
                np.testing.assert_array_equal(saved[build][name], saved["avx512"][name], err_msg=f"{name} at {build}")
