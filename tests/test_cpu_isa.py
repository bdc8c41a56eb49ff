"""The cpu device's instruction-set level: detected from the CPU's flags, capped by FDPLUG_CPU_ISA,
compiled for, named in the startup plan, and every level this machine has tested.

The linear kernels' tiles are AVX-512 only (below x86-64-v4 they fall back to a scalar loop ~40x
below paddle's matmul), so below v4 selection refuses them with that reason. The kernel test files
run again at every level below the CPU's (the cap compiles them for it: ``-march=x86-64-v3``...),
so an AVX-512 CI machine still runs and checks the AVX2 and SSE4 code, numerics and engine tokens.
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from fdplug.plugins.cpu import isa
from tests.conftest import REPO, subprocess_env
from tests.serverkit import FDPLUG

V3 = frozenset("sse4_2 popcnt ssse3 cx16 avx avx2 fma f16c bmi1 bmi2 movbe avx_vnni".split())   # a Zen 3-like CPU
V4 = V3 | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd", "avx512_bf16", "avx512_vnni"}
KERNEL_TESTS = ["tests/test_cpu_kernels.py", "tests/test_cpu_fused_ops.py", "tests/test_cpu_moe_kernel.py",
                "tests/test_cpu_argmax.py", "tests/test_cpu_linear_kernel.py", "tests/test_cpu_packed_linear.py",
                "tests/test_cpu_fp8_kernel.py"]


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
    assert isa.extensions(V4, x86=True) == ["AVX-VNNI"]                # no AVX-512 extension below v4
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
    detected = isa.detected_level() if isa.is_x86() else 0
    return [name for name, level in isa.CAPS.items() if 2 <= level < detected]


def test_below_x86_64_v4_the_linear_kernels_are_refused_with_the_reason():
    env = subprocess_env(FDPLUG_CPU_ISA="avx2")
    out = subprocess.run([FDPLUG, "explain"], capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    assert "x86-64-v3 (AVX2, FMA, F16C)" in out
    linear = out.split("op:linear:")[1].split("op:")[0]
    assert "chosen   paddle_linear" in linear
    assert linear.count("has AVX-512 tiles only") == 2                 # cpu_native_linear and its bf16 sibling
    assert "chosen   paddle_fp8_linear" in out.split("op:fp8_linear:")[1].split("op:")[0]
    if isa.level() >= 4:                                               # uncapped here: the native tiles stay
        out = subprocess.run([FDPLUG, "explain"], capture_output=True, text=True, env=subprocess_env(),
                             timeout=300, check=True).stdout
        assert "chosen   paddle_linear" not in out.split("op:linear:")[1].split("op:")[0]


@pytest.mark.parametrize("level", _capped_levels() or ["none below this CPU's"])
def test_the_kernel_tests_pass_at_every_level_this_machine_has(level):
    """The cpu kernel test files (numerics against numpy and paddle, and the engine's tokens) at each
    level below the CPU's own: each is a build of its own (``-march=x86-64-vN``)."""
    if level not in isa.CAPS:
        pytest.skip("this CPU has no x86-64 level above v2 to cap")
    env = subprocess_env(FDPLUG_CPU_ISA=level)
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert " passed" in result.stdout.splitlines()[-1], result.stdout[-500:]
