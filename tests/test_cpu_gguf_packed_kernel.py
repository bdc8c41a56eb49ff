"""``cpu_native_gguf_packed_linear`` (csrc/gguf_packed.c): GGUF blocks repacked at load into groups
of 16 columns, inputs quantized to 8 bits per 16 values, integer sums with the columns in the
lanes. Its math against numpy's definition, one result whatever the batch, route (packed at load or
packed per call) and threads, what it leaves to other maths, and its selection."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("paddle")
import paddle

from fdplug.core.portable.ops import gguf_linear as portable
from fdplug.plugin_api.gguf_formats import q8_inputs
from fdplug.plugins.cpu import isa, kernels, native_gguf, native_gguf_packed
from fdplug.testing.test_numerics import _random_gguf_blocks

if kernels.unavailable_reason() is not None:
    pytest.skip(f"cpu kernels unavailable: {kernels.unavailable_reason()}", allow_module_level=True)
PACKED = native_gguf_packed.available()
FIRST = PACKED and (native_gguf_packed.vnni() or isa.level() == 3)   # first with vpdpbusd, and at x86-64-v3
needs_tiles = pytest.mark.skipif(not PACKED, reason="the packed tiles need x86-64-v3 (AVX2) or above")
TYPES = native_gguf_packed.TYPES


def depth(qtype: str, blocks: int) -> int:
    return blocks * (256 if qtype.endswith("_K") else 32)


def definition(x: np.ndarray, w: paddle.Tensor, qtype: str, k: int) -> np.ndarray:
    """q8 math in runs of 16 on the decoded weights, in float64."""
    decoded = portable(paddle.eye(k, dtype="float32"), w, qtype, k).numpy().astype(np.float64)
    return q8_inputs(x, 16) @ decoded


@needs_tiles
@pytest.mark.parametrize("qtype", TYPES)
def test_kernel_is_q8_math_in_runs_of_16(qtype):
    """Every type, packed at load (N a multiple of 16) and per call (N = 70: a last group of 6), 1,
    5 and 300 rows, depths of 1 and 3 blocks (K-quants) or 3 and 18 (32-weight types)."""
    rng = np.random.default_rng(31)
    for n, k in ((64, depth(qtype, 1 if qtype.endswith("_K") else 18)), (70, depth(qtype, 3))):
        w = paddle.to_tensor(_random_gguf_blocks(qtype, n, k, rng))
        weights = [w] + ([native_gguf_packed.prepare(w, qtype)] if n % 16 == 0 else [])
        for rows in (1, 5, 300):
            x = rng.standard_normal((rows, k)).astype(np.float32)
            want = definition(x, w, qtype, k)
            for each in weights:
                got = native_gguf_packed.gguf_linear_or_fallback(paddle.to_tensor(x), each, qtype, k, threads=2)
                np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-6 * np.abs(want).max(),
                                           err_msg=f"{qtype} {n}x{k} {rows} rows {type(each).__name__}")


# Each type's quantized bytes in a block: [start, end) (after its scales; Q6_K's before them)
_INTEGERS = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q8_0": (2, 34),
             "Q4_K": (16, 144), "Q5_K": (16, 176), "Q6_K": (0, 192)}


@needs_tiles
@pytest.mark.parametrize("qtype", TYPES)
def test_extreme_integers_do_not_saturate(qtype):
    """Every weight at its type's extremes (bytes 0x00 and 0xFF: -8 and 7, -16 and 15, -32 and 31
    after the offset; 0 and 15 or 31 with a min; Q8_0 0x80 and 0x7F: -128 and 127) against inputs
    that all quantize to +-127: the int16 pair sums at their bound on every route (AVX2's decoded
    groups, above 32 rows or 8 for the K-quants, take the inputs as q + 128: up to 4 * 2 * 255 * 16 =
    32,640), the values of the definition, each row's bits as alone."""
    from fdplug.plugin_api.gguf_formats import BLOCK_FORMATS

    fmt = BLOCK_FORMATS[qtype]
    k = depth(qtype, 2 if qtype.endswith("_K") else 4)
    blocks = _random_gguf_blocks(qtype, 32, k, np.random.default_rng(34)).reshape(32, k // fmt.block, fmt.nbytes)
    start, end = _INTEGERS[qtype]
    x = np.where(np.arange(40)[:, None] % 2 == 0, 1.0, -1.0).astype(np.float32).repeat(k, axis=1)
    x[-1] = np.linspace(-1, 1, k, dtype=np.float32)
    for fill in (0x80, 0x7F) if qtype == "Q8_0" else (0x00, 0xFF):
        w = blocks.copy()
        w[..., start:end] = fill
        w = paddle.to_tensor(w.reshape(32, -1))
        want = definition(x, w, qtype, k)
        for weight in (w, native_gguf_packed.prepare(w, qtype)):
            batch = native_gguf_packed.gguf_linear(paddle.to_tensor(x), weight, qtype, k, threads=2).numpy()
            np.testing.assert_allclose(batch, want, rtol=1e-5, atol=1e-6 * np.abs(want).max(),
                                       err_msg=f"{qtype} bytes {fill:#x}")
            for r in (0, 1, 39):
                alone = native_gguf_packed.gguf_linear(paddle.to_tensor(x[r:r + 1]), weight, qtype, k, threads=1)
                np.testing.assert_array_equal(alone.numpy()[0], batch[r], err_msg=f"{qtype} bytes {fill:#x} row {r}")


@needs_tiles
@pytest.mark.parametrize("qtype", ["Q4_1", "Q5_0", "Q6_K", "Q8_0"])
def test_the_same_bits_whatever_the_batch_the_route_or_the_threads(qtype):
    """A row alone on one thread (registers) gives its bits in a batch of 300 on two (each group
    decoded once into a buffer), packed at load or per call, and so do batches of 9-33 rows (at AVX2
    the 32-weight types unpack each group in every tile up to 32): a token's logits do not depend on its
    batch, and the tied lm_head (packed per call where the loader keeps the file's table) agrees."""
    k = depth(qtype, 2 if qtype.endswith("_K") else 18)
    w = paddle.to_tensor(_random_gguf_blocks(qtype, 48, k, np.random.default_rng(32)))
    packed = native_gguf_packed.prepare(w, qtype)
    x = paddle.to_tensor(np.random.default_rng(33).standard_normal((300, k)).astype(np.float32))
    batch = native_gguf_packed.gguf_linear(x, packed, qtype, k, threads=2).numpy()
    np.testing.assert_array_equal(native_gguf_packed.gguf_linear(x, w, qtype, k, threads=2).numpy(), batch)
    for r in (0, 3, 4, 299):
        for weight in (packed, w):
            alone = native_gguf_packed.gguf_linear(x[r:r + 1], weight, qtype, k, threads=1).numpy()
            np.testing.assert_array_equal(alone[0], batch[r], err_msg=f"row {r}, {type(weight).__name__}")
    for rows in (9, 20, 32, 33):   # several tiles each unpacking the group (32-weight types), then decoded once
        for weight in (packed, w):
            np.testing.assert_array_equal(native_gguf_packed.gguf_linear(x[:rows], weight, qtype, k, threads=2).numpy(),
                                          batch[:rows], err_msg=f"the first {rows} rows, {type(weight).__name__}")


@needs_tiles
@pytest.mark.parametrize("qtype", ["Q5_0", "Q6_K", "Q8_0"])
def test_rows_past_a_block_give_the_bits_of_smaller_calls(qtype):
    """1,500 rows at K = 1,536: 4.4 MiB of quantized inputs, past the 2 MiB a work item's rows keep
    (gp_block_rows: three blocks, each group decoded, or packed per call from the file's rows, again
    for each), give each row the bits it has in calls of 300 rows (one block), on two threads and on
    one."""
    k = depth(qtype, 6 if qtype.endswith("_K") else 48)
    w = paddle.to_tensor(_random_gguf_blocks(qtype, 48, k, np.random.default_rng(35)))
    packed = native_gguf_packed.prepare(w, qtype)
    x = paddle.to_tensor(np.random.default_rng(36).standard_normal((1500, k)).astype(np.float32))
    parts = np.concatenate([native_gguf_packed.gguf_linear(x[i:i + 300], packed, qtype, k, threads=2).numpy()
                            for i in range(0, 1500, 300)])
    for weight, threads in ((packed, 2), (packed, 1), (w, 2)):
        np.testing.assert_array_equal(native_gguf_packed.gguf_linear(x, weight, qtype, k, threads=threads).numpy(),
                                      parts, err_msg=f"{type(weight).__name__}, {threads} threads")


@needs_tiles
def test_prepare_keeps_the_bytes_and_declines_what_it_cannot_pack():
    """The same uint8 size (a permutation within groups of 16 rows, Q8_0's bytes offset by 128), a
    layout name the kernel checks; None for row counts not a multiple of 16 and types without
    integers (F16, BF16), which run otherwise: per call, and in float32 math."""
    rng = np.random.default_rng(34)
    w = paddle.to_tensor(_random_gguf_blocks("Q4_K", 32, 512, rng))
    packed = native_gguf_packed.prepare(w, "Q4_K")
    assert packed.data.dtype == w.dtype and packed.data.shape == w.shape and packed.shape == (32, 512)
    assert packed.layout == native_gguf_packed.LAYOUT and not np.array_equal(packed.data.numpy(), w.numpy())
    assert native_gguf_packed.prepare(paddle.to_tensor(_random_gguf_blocks("Q4_K", 40, 512, rng)), "Q4_K") is None
    half = paddle.to_tensor(_random_gguf_blocks("F16", 32, 64, rng))
    assert native_gguf_packed.prepare(half, "F16") is None
    x = paddle.to_tensor(rng.standard_normal((3, 64)).astype(np.float32))
    np.testing.assert_array_equal(native_gguf_packed.gguf_linear_or_fallback(x, half, "F16", 64, threads=2).numpy(),
                                  native_gguf.gguf_linear(x, half, "F16", 64, threads=2).numpy())
    with pytest.raises(ValueError, match="reads gguf_groups16"):
        native_gguf_packed.gguf_linear(x, native_gguf_packed.PreparedWeight(half, (32, 64), "panels"), "F16", 64, 2)
    with pytest.raises(TypeError, match="float32 inputs"):
        native_gguf_packed.gguf_linear_or_fallback(x.astype("bfloat16"), packed, "Q4_K", 512, threads=2)


def test_selection_chooses_it_with_vnni_and_says_why_not(monkeypatch):
    """First where its tiles have vpdpbusd (AVX512-VNNI or AVX-VNNI) and at x86-64-v3 without it
    (docs/cpu-kernels.md has the figures), by name at AVX-512 without VNNI; where the build has no
    tiles, the reason says so."""
    from fdplug.core.plugin_loading.selection import select_components
    from fdplug.plugins.cpu import isa

    if isa.level() < 3:
        pytest.skip("below x86-64-v3 the portable op is chosen (tests/test_cpu_gguf_kernel.py)")
    chosen = select_components("cpu").ops["gguf_linear"]
    assert (chosen.name == "cpu_native_gguf_packed_linear") == FIRST
    if PACKED:
        named = select_components("cpu", ops={"gguf_linear": "cpu_native_gguf_packed_linear"}).ops["gguf_linear"]
        assert named.q8_run == 16 and named.prepare is not None and not named.bf16_inputs
    monkeypatch.setattr(native_gguf_packed, "available", lambda: False)
    selection = select_components("cpu")
    assert selection.ops["gguf_linear"].name != "cpu_native_gguf_packed_linear"
    decision = next(d for d in selection.decisions if d.name == "cpu_native_gguf_packed_linear")
    assert not decision.chosen and "no packed tiles" in decision.reason


@needs_tiles
@pytest.mark.parametrize("qtype", ["Q4_1", "Q6_K", "F16"])
def test_the_conformance_kit_checks_it_in_its_math(qtype):
    """The kit's gguf_linear check (fdplug.testing.test_numerics) compares it on inputs quantized in
    runs of `OpSpec.q8_run` (16), on the file's rows (N = 70) and the F16 rows in float32 math."""
    from fdplug.core.plugin_loading.selection import select_components
    from fdplug.testing.test_numerics import (
        test_gguf_linear_kernel_matches_the_portable_one as kit_check,
    )

    selection = select_components("cpu", ops={"gguf_linear": "cpu_native_gguf_packed_linear"})
    kit_check(selection, "cpu", qtype)


_LEVEL_SCRIPT = r"""
import sys
import numpy as np
import paddle
from fdplug.plugins.cpu import isa, native_gguf_packed
from fdplug.testing.test_numerics import _random_gguf_blocks

print(isa.level(), int(native_gguf_packed.vnni()))
out = {}
rng = np.random.default_rng(35)
for qtype in native_gguf_packed.TYPES:
    k = (2 if qtype.endswith("_K") else 19) * (256 if qtype.endswith("_K") else 32)
    x = paddle.to_tensor(rng.standard_normal((40, k)).astype(np.float32))
    for n in (48, 40):     # packed at load; per call, a last group of 8
        w = paddle.to_tensor(_random_gguf_blocks(qtype, n, k, rng))
        weight = native_gguf_packed.prepare(w, qtype) if n % 16 == 0 else w
        for rows in (1, 5, 20, 40):   # one tile; 3 tiles each unpacking (32-weight types); decoded once
            out[f"{qtype}-{n}-{rows}"] = native_gguf_packed.gguf_linear(x[:rows], weight, qtype, k, threads=2).numpy()
        if n % 16 == 0:   # its rows read back (each level's own bit planes)
            out[f"{qtype}-{n}-read back"] = weight.rows(paddle.to_tensor(np.arange(n - 1, -1, -1))).numpy()
np.savez(sys.argv[1], **out)
"""


def test_every_level_gives_the_same_bits(tmp_path):
    """AVX-512 with VNNI (vpdpbusd on 16 lanes), AVX-512 without it (vpmaddubsw + vpmaddwd, Q8_0 as
    signed bytes), AVX2 (two halves of 8 lanes) and, where the CPU has it, AVX2 + AVX-VNNI: the same
    integers and the same float steps per lane, so the same bits (each level a build of its own); and
    a packed weight's rows read back from each level's own layout (`PreparedWeight.rows`)."""
    import subprocess
    import sys

    from fdplug.plugins.cpu import isa
    from tests.conftest import REPO, subprocess_env

    if not isa.is_x86() or isa.detected_level() < 4 or isa.cap() is not None or "avx512_vnni" not in isa.cpu_flags():
        pytest.skip("needs an AVX-512 VNNI CPU, uncapped, to compare the levels below with it")
    compiler = " ".join(kernels.compiler())
    builds = {"native": {}, "avx512 without VNNI": {"CC": f"{compiler} -mno-avx512vnni"},
              "avx2": {"FDPLUG_CPU_ISA": "avx2"}}
    vpdpbusd = {"native"}   # the builds that multiply with it (`native_gguf_packed.vnni`)
    if "avx_vnni" in isa.cpu_flags():
        builds["avx2+vnni"] = {"FDPLUG_CPU_ISA": "avx2", "CC": f"{compiler} -mavxvnni"}
        vpdpbusd.add("avx2+vnni")   # AVX-VNNI: vpdpbusd on 8 lanes
    saved = {}
    for build, env in builds.items():
        path = tmp_path / f"{build}.npz"
        result = subprocess.run([sys.executable, "-c", _LEVEL_SCRIPT, str(path)], capture_output=True, text=True,
                                env=subprocess_env(**env), cwd=REPO, timeout=600, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.split()[1] == str(int(build in vpdpbusd)), f"{build}: vpdpbusd {result.stdout}"
        saved[build] = np.load(path)
    assert len(saved["native"].files) == (4 * 2 + 1) * len(TYPES)   # (4 row counts of 2 weights, the rows)
    for name in saved["native"].files:
        for build in saved:
            np.testing.assert_array_equal(saved[build][name], saved["native"][name], err_msg=f"{name} at {build}")
