"""The cpu device's instruction-set level: detected from the CPU's flags, capped by FDPLUG_CPU_ISA,
compiled for, named in the startup plan, and every level this machine has tested.

The linear kernels have AVX-512 and AVX2 tiles that give the same bits (checked here between the two
builds); below x86-64-v3 they fall back to a scalar loop ~40x below paddle's matmul, so selection
refuses them there with that reason. The kernel test files
run again at every level below the CPU's (the cap compiles them for it: ``-march=x86-64-v3``...),
so an AVX-512 CI machine still runs and checks the AVX2 and SSE4 code, numerics and engine tokens.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from fdplug.plugins.cpu import isa
from tests.conftest import REPO, subprocess_env
from tests.serverkit import FDPLUG

V3 = frozenset("sse4_2 popcnt ssse3 cx16 avx avx2 fma f16c bmi1 bmi2 movbe avx_vnni".split())   # a Zen 3-like CPU
V4 = V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"}
KERNEL_TESTS = ["tests/test_cpu_kernels.py", "tests/test_cpu_fused_ops.py", "tests/test_cpu_moe_kernel.py",
                "tests/test_cpu_argmax.py", "tests/test_cpu_linear_kernel.py", "tests/test_cpu_packed_linear.py",
                "tests/test_cpu_fp8_kernel.py", "tests/test_cpu_bf16_linear_kernel.py", "tests/test_op_timing.py",
                "tests/test_cpu_gguf_kernel.py", "tests/test_cpu_gguf_q8_kernel.py", "tests/test_cpu_decoder_stack.py"]


def test_levels_from_flags(monkeypatch):
    monkeypatch.delenv("FDPLUG_CPU_ISA", raising=False)
    assert isa.detected_level(V3, x86=True) == 3
    assert isa.detected_level(V4, x86=True) == 4
    assert isa.detected_level(V3 - {"fma"}, x86=True) == 2            # AVX2 without FMA is not v3
    assert isa.detected_level(V4 - {"avx512vl"}, x86=True) == 3       # AVX-512F alone (Knights Landing) is not v4
    assert isa.detected_level(frozenset(), x86=True) == 1
    assert isa.detected_level(V4, x86=False) == 0                      # aarch64: no x86-64 level
    assert isa.extensions(V4, x86=True) == ["AVX512-BF16", "AVX512-VNNI", "AVX-VNNI"]
    assert isa.extensions(V3, x86=True) == ["AVX-VNNI"]


def test_the_cap_lowers_the_level_and_what_it_claims(monkeypatch):
    monkeypatch.setenv("FDPLUG_CPU_ISA", "avx2")
    assert isa.level(V4, x86=True) == 3
    assert isa.extensions(V4, x86=True) == []      # built -march=x86-64-v3: no extension, AVX-VNNI neither
    assert isa.extensions(V3, x86=True) == ["AVX-VNNI"]                # not capped below the CPU: -march=native
    assert isa.level(V3, x86=True) == 3
    monkeypatch.setenv("FDPLUG_CPU_ISA", "avx512")
    assert isa.level(V3, x86=True) == 3                                # a cap never raises the level
    monkeypatch.setenv("FDPLUG_CPU_ISA", "sse4")
    assert isa.level(V4, x86=True) == 2


def test_the_compiler_targets_the_capped_level(monkeypatch):
    monkeypatch.delenv("FDPLUG_CPU_ISA", raising=False)
    assert isa.march() == ["-march=native"]
    if not isa.is_x86() or isa.detected_level() < 3:
        pytest.skip("this CPU has no x86-64 level above v2 to cap")
    monkeypatch.setenv("FDPLUG_CPU_ISA", "sse4")
    assert isa.march() == ["-march=x86-64-v2", "-mtune=native"]
    assert "FDPLUG_CPU_ISA=sse4" in isa.describe()


def _capped_levels() -> list[str]:
    """The caps below this CPU's level, and ``no-amx`` where it has AMX (the native build without it:
    the packed bf16 math's AVX512-BF16 tiles, which AMX replaces in the native build)."""
    detected = isa.detected_level() if isa.is_x86() else 0
    amx = ["no-amx"] if "AMX-BF16" in isa.extensions() else []
    return [name for name, level in isa.CAPS.items() if 2 <= level < detected] + amx


def test_the_linear_kernels_need_x86_64_v3_and_say_so_below():
    """AVX2 tiles at x86-64-v3 (chosen, then timed against paddle's matmul per layer shape); below,
    the scalar loop is refused with the reason, and paddle's matmul runs."""
    if not isa.is_x86() or isa.detected_level() < 3:
        pytest.skip("this CPU has no x86-64-v3 to run the AVX2 tiles")
    out = subprocess.run([FDPLUG, "explain"], capture_output=True, text=True, timeout=300, check=True,
                         env=subprocess_env(FDPLUG_CPU_ISA="avx2", FDPLUG_OP_TIMING="1")).stdout
    assert "x86-64-v3 (AVX2, FMA, F16C)" in out
    linear = out.split("op:linear:")[1].split("op:")[0]
    assert "chosen   cpu_native_linear" in linear
    assert "no AVX512-BF16" in linear                                   # bf16 math needs AVX-512 still
    assert "chosen   cpu_native_fp8_linear" in out.split("op:fp8_linear:")[1].split("op:")[0]
    gguf = out.split("op:gguf_linear:")[1].split("op:")[0]
    assert "chosen   cpu_native_gguf_packed_linear" in gguf                  # packed q8 math first there
    assert "rejected cpu_native_gguf_q8_linear" in gguf
    assert "measured: add_rms_norm, argmax, attention, decoder_stack, fp8_linear, gguf_linear, linear, moe, " \
           "rms_norm, rope, swiglu: each kernel is timed against the portable op on the model's shapes at startup" \
        in out
    out = subprocess.run([FDPLUG, "explain"], capture_output=True, text=True, env=subprocess_env(FDPLUG_CPU_ISA="sse4"),
                         timeout=300, check=True).stdout
    linear = out.split("op:linear:")[1].split("op:")[0]
    assert "chosen   paddle_linear" in linear
    assert linear.count("has tiles for x86-64-v3 (AVX2, FMA, F16C) and above") == 2   # and its bf16 sibling
    assert "chosen   paddle_fp8_linear" in out.split("op:fp8_linear:")[1].split("op:")[0]
    assert "chosen   paddle_gguf_linear" in out.split("op:gguf_linear:")[1].split("op:")[0]


@pytest.mark.parametrize("level", _capped_levels() or ["none below this CPU's"])
def test_the_kernel_tests_pass_at_every_level_this_machine_has(level):
    """The cpu kernel test files (numerics against numpy and paddle, and the engine's tokens) at each
    level below the CPU's own, and without AMX where it has it: each is a build of its own
    (``-march=x86-64-vN``, ``-mno-amx-*``). Tests marked ``own_build`` (the build cache's bookkeeping,
    builds with flags of their own: the same at every cap) run once, in the main run."""
    if level not in (*isa.CAPS, "no-amx"):
        pytest.skip("this CPU has no x86-64 level above v2 to cap")
    env = subprocess_env(FDPLUG_CPU_AMX="0") if level == "no-amx" else subprocess_env(FDPLUG_CPU_ISA=level)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not own_build",
                             *KERNEL_TESTS],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-500:]


# Each level's build runs this and saves every output; the AVX2 tiles must give the AVX-512 tiles' bits.
_BITS_SCRIPT = r"""
import sys
import numpy as np
import paddle
from fdplug.plugins.cpu import isa, native_fp8, native_linear

print(isa.level())
out = {}
rng = np.random.default_rng(0)
# In place ([N, K] as stored: the tied lm_head): k tails (577 = 36 * 16 + 1, 1000 = 62 * 16 + 8), the
# 4-wide column blocks' tail (7) and whole ones (96), decode's column at a time (1, 3 rows), the 4-row
# tiles' tails (5, 6) and 33 rows.
for dtype in ("float32", "bfloat16"):
    for k in (577, 1000):
        for n in (7, 96):
            w = paddle.to_tensor(rng.standard_normal((n, k)).astype(np.float32)).astype(dtype)
            for rows in (1, 3, 5, 6, 33):
                x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
                out[f"inplace-{dtype}-{n}x{k}-{rows}"] = native_linear.linear(x, w, 2).numpy()
# Packed at load: narrow last panels (16, 48 columns), bias or none, the k blocking (K above 1,024).
for n, k in ((16, 2), (48, 66), (96, 577), (208, 1100), (64, 2050)):
    rng = np.random.default_rng(n * 7919 + k)
    w = paddle.to_tensor((rng.standard_normal((n, k)) * np.exp(rng.uniform(-4, 2, (n, k)))).astype(np.float32))
    bias = paddle.to_tensor(rng.standard_normal(n).astype(np.float32))
    scale = paddle.to_tensor(rng.uniform(0.5, 2, (n, -(-k // 128))).astype(np.float32))
    fp8 = paddle.clip(w, -400, 400).astype(paddle.float8_e4m3fn)
    for rows in (1, 5, 13, 64):
        x = paddle.to_tensor(rng.standard_normal((rows, k)).astype(np.float32))
        for dtype in ("float32", "bfloat16"):
            if dtype == "bfloat16" and k % 2:
                continue
            packed = native_linear.prepare(w.astype(dtype))
            packed.bias = bias if rows % 2 else None
            out[f"packed-{dtype}-{n}x{k}-{rows}"] = native_linear.linear(x, packed, 2).numpy()
        prepared = native_fp8.prepare(fp8)
        out[f"fp8-{n}x{k}-{rows}"] = native_fp8.fp8_linear(x, prepared, scale, 128, 2).numpy()
np.savez(sys.argv[1], **out)
"""


def test_the_avx2_tiles_give_the_avx512_tiles_bits(tmp_path):
    """Every linear kernel's output is one FMA chain (packed) or 16 (in place, summed in a fixed
    pairing) over k in order, whatever the tile: the build for x86-64-v3 (8 lanes) must give the
    x86-64-v4 build's bits (16 lanes), float32, bf16 and FP8 weights: a fleet of AVX2 and AVX-512
    machines gives the same logits."""
    if not isa.is_x86() or isa.detected_level() < 4:
        pytest.skip("this CPU has no AVX-512 to compare the AVX2 tiles with")
    saved = {}
    for level in ("avx512", "avx2"):
        path = tmp_path / f"{level}.npz"
        result = subprocess.run([sys.executable, "-c", _BITS_SCRIPT, str(path)], capture_output=True, text=True,
                                env=subprocess_env(FDPLUG_CPU_ISA=level), cwd=REPO, timeout=600, check=False)
        assert result.returncode == 0, result.stderr[-3000:]
        assert result.stdout.split()[0] == str(isa.CAPS[level])        # the level it was built for
        saved[level] = np.load(path)
    assert len(saved["avx512"].files) == len(saved["avx2"].files) == 40 + 56
    for name in saved["avx512"].files:
        assert np.array_equal(saved["avx512"][name], saved["avx2"][name]), name
