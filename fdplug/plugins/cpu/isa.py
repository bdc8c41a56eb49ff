"""The CPU's instruction-set level, as the cpu kernels see it: what they are compiled for and what they may claim.

x86 CPUs differ where it matters: an AMD EPYC of the Zen 3 generation (the most common cloud x86)
has AVX2 and FMA but no AVX-512, so each kernel has AVX-512 tiles and AVX2 ones (the linears' give
the same bits), and below x86-64-v3 a scalar loop (~3 GFLOP/s, ~40x below paddle's matmul) that
selection refuses for the linears. The level comes from the flags the kernel reports
(``/proc/cpuinfo``), named as the x86-64 psABI levels:

- ``x86-64-v2``: SSE4.2, POPCNT (``FDPLUG_CPU_ISA=sse4``)
- ``x86-64-v3``: AVX2, FMA, F16C, BMI2 (``avx2``)
- ``x86-64-v4``: AVX-512 F, BW, VL, DQ, CD (``avx512``)

plus the extensions the kernels use or could (AVX512-BF16, AVX512-VNNI, AVX-VNNI, AMX).
``FDPLUG_CPU_AMX=0`` builds the native kernels without AMX (the packed bf16 linears then run
AVX512-BF16's tiles and bits). ``FDPLUG_CPU_ISA`` caps the level: the kernels are then compiled for it
(``-march=x86-64-v3`` instead of ``-march=native``) and claim only what it has, so an AVX-512 machine
runs and tests the AVX2 code, and a fleet of mixed CPUs can be given the same bits.
"""

from __future__ import annotations

import functools
import platform

from fdplug.plugins.cpu import settings

CAPS = {"sse4": 2, "avx2": 3, "avx512": 4}
NAMES = {0: "no x86-64 level (not x86)", 1: "x86-64 (baseline)", 2: "x86-64-v2 (SSE4.2)",
         3: "x86-64-v3 (AVX2, FMA, F16C)", 4: "x86-64-v4 (AVX-512 F/BW/VL/DQ)"}
REQUIRED = {2: {"sse4_2", "popcnt", "ssse3", "cx16"},
            3: {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"},
            4: {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}}
EXTENSIONS = {"avx512_bf16": ("AVX512-BF16", 4), "avx512_vnni": ("AVX512-VNNI", 4), "avx_vnni": ("AVX-VNNI", 3),
              "amx_tile": ("AMX", 4), "amx_bf16": ("AMX-BF16", 4), "amx_int8": ("AMX-INT8", 4)}


@functools.lru_cache(maxsize=1)
def cpuinfo_lines() -> tuple[str, ...]:
    """``/proc/cpuinfo``'s lines, stripped, read once (empty where there is none): the flags here,
    the vendor (`device.is_amd_cpu`) and the kernels' build key (`kernels`) all come from it."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return tuple(line.strip() for line in f)
    except OSError:
        return ()


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The feature flags of the first CPU in ``/proc/cpuinfo`` (empty where there is none)."""
    for line in cpuinfo_lines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def is_x86() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


def detected_level(flags: frozenset[str] | None = None, x86: bool | None = None) -> int:
    """The highest x86-64 level whose every flag (and every lower level's) the CPU has; 0 off x86."""
    if not (is_x86() if x86 is None else x86):
        return 0
    flags = cpu_flags() if flags is None else flags
    level = 1
    for candidate in (2, 3, 4):
        if not REQUIRED[candidate] <= flags:
            break
        level = candidate
    return level


def cap() -> int | None:
    """The level ``FDPLUG_CPU_ISA`` allows (None: ``auto``, no cap)."""
    value = settings.CPU_ISA.value()
    return None if value == "auto" else CAPS[value]


def level(flags: frozenset[str] | None = None, x86: bool | None = None) -> int:
    """The level the kernels are compiled for and may claim: what the CPU has, capped by FDPLUG_CPU_ISA."""
    detected = detected_level(flags, x86)
    limit = cap()
    return detected if limit is None or detected == 0 else min(detected, limit)


def extensions(flags: frozenset[str] | None = None, x86: bool | None = None) -> list[str]:
    """The extensions the kernels are built with, by name: the CPU's, where they are built for the CPU
    itself (``-march=native``); none under a cap below it (``-march=x86-64-vN`` enables none)."""
    flags = cpu_flags() if flags is None else flags
    allowed = level(flags, x86)
    if allowed != detected_level(flags, x86):
        return []
    return [name for flag, (name, needs) in EXTENSIONS.items()
            if flag in flags and allowed >= needs and (settings.CPU_AMX.value() or not flag.startswith("amx"))]


def march() -> list[str]:
    """The compiler's target flags: the CPU itself, or the capped level (tuned for this CPU)."""
    detected, allowed = detected_level(), level()
    if allowed == detected:   # FDPLUG_CPU_AMX=0: the CPU's own code without the tile instructions
        no_amx = is_x86() and not settings.CPU_AMX.value()
        return ["-march=native", *(["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"] if no_amx else [])]
    return [f"-march=x86-64-v{allowed}", "-mtune=native"]


def describe() -> str:
    """What the startup log and ``fdplug doctor`` say: the level, its extensions, and any cap."""
    allowed, detected = level(), detected_level()
    text = NAMES[allowed] if is_x86() else f"{platform.machine()} ({NAMES[0]})"
    ext = extensions()
    if ext:
        text += " + " + ", ".join(ext)
    if allowed != detected:
        text += f" (FDPLUG_CPU_ISA={settings.CPU_ISA.value()}; the CPU has {NAMES[detected]})"
    return text


def model_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), or the machine's architecture where it has none."""
    for line in cpuinfo_lines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return platform.machine()


def level_reason(what: str, needed: int) -> str | None:
    """None where ``what`` has tiles for the (capped) level; else why it is not chosen."""
    if level() >= needed:
        return None
    return (f"{what} has tiles for {NAMES[needed]} and above, and this CPU runs {describe()}: below, "
            "a scalar loop far slower than paddle's matmul, so paddle's is used")
