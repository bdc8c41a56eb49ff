"""Building the cpu device's kernel library: the compiler, its flags, the cached library's name, the build.

``csrc/cpu_kernels.c`` (which includes the other files of ``csrc/``) is compiled the first time a
process needs it, with ``-march=native`` (or for the level ``FDPLUG_CPU_ISA`` caps it to: `isa`),
into ``$FDPLUG_CACHE_DIR/kernels/`` under a name that hashes the sources, the flags, the compiler
and the CPU's feature flags: a changed source or a different CPU gets its own build, and a build
from another machine sharing the directory is never loaded. The build goes to a temporary file
renamed into place, so no process loads a half-written library, and under a file lock
(`fdplug.core.portable.file_lock`), so processes starting together (an API process and its engines,
DP ranks, a test suite's servers) wait for one build instead of each compiling at once.

Why the build is parallel: on AMD EPYC, avx2-or-less (Zen 3, 2026-11-29) one plain build took
~123 s, ~95% of it GCC's code generation (``-ftime-report``), past the 120 s the build was allowed
then: the first ``fdplug serve`` there lost its kernels, and on 2 cores concurrent builds pushed
every one past it. GCC 10+ now builds with ``-flto=auto``, which splits that code generation into
partitions compiled on every core (60-74 s on 2 cores, the same arithmetic); a failing parallel
build is followed by one plain build.

Why GCC builds without its RTL GCSE passes (`gcc_flags`): the packed GGUF tiles' worker (``gp_worker``,
~430 KB of code, 8 row counts x 8 weight types inlined) is one function, which no LTO partition can
split; its code generation ran on one core for most of the build (101-119 s on 2 cores, 2026-12-01,
AMD EPYC, avx2-or-less), and ``-ftime-report`` put a quarter of the whole compile in RTL ``PRE``
(-fgcse) and a tenth in ``load CSE after reload`` (-fgcse-after-reload). Without them: 51 s, the same
bits, and the kernels' speed unchanged within the machine's noise (the packed tiles of every type at
1-1,024 rows, decode attention, the float32 packed linear, each A/B in one process both ways round).
Splitting the worker instead made its tiles 8-25% slower (docs/cpu-kernels.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from fdplug.core.portable.file_lock import lock_within
from fdplug.plugin_api.settings import cache_dir
from fdplug.plugins.cpu import isa, settings

logger = logging.getLogger("fdplug")

CSRC = Path(__file__).parent / "csrc"
SOURCE = CSRC / "cpu_kernels.c"    # it #includes the other files of CSRC
FLAGS = ("-O3", "-fno-math-errno", "-fPIC", "-shared", "-pthread", "-std=c99")   # + the target (`isa.march`)
BUILD_TIMEOUT_S = 900.0   # a build (both tries): ~2 min on a Zen 3 core (measured), more on a loaded machine


class KernelsUnavailable(RuntimeError):
    """The compiled kernels cannot be used here; the message says why."""


def compiler() -> list[str] | None:
    """``$CC`` (split like a shell would), else the first of cc, gcc, clang on PATH."""
    configured = settings.CC.value()
    if configured:
        return shlex.split(configured)
    found = next((shutil.which(name) for name in ("cc", "gcc", "clang") if shutil.which(name)), None)
    return [found] if found else None


def _cpu_fingerprint() -> str:
    """The CPU model and feature flags: -march=native code is only valid where these match."""
    lines = [line for line in isa.cpuinfo_lines() if line.startswith(("model name", "flags", "Features"))][:2]
    return "\n".join(lines) or platform.processor() or platform.machine()


def _flags(cc: list[str]) -> tuple[str, ...]:
    """The compiler's flags in every try of a build: the target first, so that a flag added to FLAGS (a
    test's -march) overrides it, then GCC's own (`gcc_flags`)."""
    return (*isa.march(), *FLAGS, *gcc_flags(tuple(cc)))


@functools.lru_cache(maxsize=8)
def _gcc_major(cc: tuple[str, ...]) -> int | None:
    """GCC's major version where ``cc`` is GCC (its ``--version`` names the Free Software Foundation),
    else None (clang, another compiler, one that does not answer)."""
    try:
        about = subprocess.run([*cc, "--version"], capture_output=True, text=True, timeout=30, check=False).stdout
        version = subprocess.run([*cc, "-dumpfullversion"], capture_output=True, text=True, timeout=30,
                                 check=False).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    major = version.split(".")[0]
    return int(major) if "Free Software Foundation" in about and major.isdigit() else None


def parallel_flags(cc: tuple[str, ...]) -> tuple[str, ...]:
    """``("-flto=auto",)`` where ``cc`` is GCC 10 or later and ``make`` is there (GCC's LTO runs its
    partitions through ``make -jN``), else nothing. With it GCC splits the one translation unit's code
    generation into partitions compiled on every core; the same source and flags, so the same
    arithmetic (the tiles are inlined within each partition)."""
    if shutil.which(os.environ.get("MAKE") or "make") is None:
        return ()
    major = _gcc_major(cc)
    return ("-flto=auto",) if major is not None and major >= 10 else ()


GCC_FLAGS = ("-fno-gcse", "-fno-gcse-after-reload")


def gcc_flags(cc: tuple[str, ...]) -> tuple[str, ...]:
    """`GCC_FLAGS` where ``cc`` is GCC (the module's docstring says why), in every try of a build; other
    compilers get none (clang would only warn of flags it ignores)."""
    return GCC_FLAGS if _gcc_major(cc) is not None else ()


def library_path(cc: list[str]) -> Path:
    key = hashlib.sha256()
    included = (f.read_bytes() for f in sorted(CSRC.glob("*.c")) if f != SOURCE)
    flags = " ".join((*_flags(cc), *parallel_flags(tuple(cc))))
    for part in (SOURCE.read_bytes(), *included, flags.encode(), " ".join(cc).encode(), _cpu_fingerprint().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "kernels" / f"cpu_kernels-{platform.machine()}-{key.hexdigest()[:16]}.so"


def _compile(cc: list[str], extra: tuple[str, ...], tmp: str, deadline: float) -> tuple[int, str]:
    """(exit status, output) of one compile, ended with all its processes (the driver's cc1, lto1 and
    make children too: a session of their own) if it is still running at ``deadline``."""
    command = [*cc, *_flags(cc), *extra, "-I", str(CSRC), "-o", tmp, str(SOURCE), "-lm"]
    try:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
    except OSError as exc:
        raise KernelsUnavailable(f"the C compiler {cc[0]!r} could not run: {exc}") from None
    try:
        output, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        return proc.returncode, output
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise KernelsUnavailable(f"the C compiler {cc[0]!r} did not finish within {BUILD_TIMEOUT_S:.0f} s") from None
    finally:
        if proc.poll() is None:   # interrupted (KeyboardInterrupt, a signal): no compiler left behind
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)


def _last_lines(output: str, n: int = 5) -> str:
    return " | ".join(output.strip().splitlines()[-n:])


def build(cc: list[str], target: Path) -> None:
    """Compile the source into ``target`` (atomically) within `BUILD_TIMEOUT_S`, in parallel where the
    compiler can (`parallel_flags`; if that build fails, once more without, in the time left). Raises
    KernelsUnavailable with the compiler's words."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        parallel = parallel_flags(tuple(cc))
        status, output = _compile(cc, parallel, tmp, deadline)
        if status != 0 and parallel:
            logger.warning("the parallel build of the cpu kernels failed (%s); building them again without %s",
                           _last_lines(output, 3), " ".join(parallel))
            status, output = _compile(cc, (), tmp, deadline)
        if status != 0:
            raise KernelsUnavailable(f"{cc[0]} failed (exit {status}): " + _last_lines(output))
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_once(cc: list[str], path: Path) -> None:
    """``path`` built unless it exists, by one process of the machine at a time: the others wait for
    its build (at most `BUILD_TIMEOUT_S`, then a minute), then find it there. Raises
    KernelsUnavailable (an unwritable cache directory too)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path.with_suffix(".lock"), "a+") as lock:
            if lock_within(lock, BUILD_TIMEOUT_S + 60) is False and not path.exists():
                raise KernelsUnavailable(f"another process has been building {path.name} for over "
                                         f"{BUILD_TIMEOUT_S + 60:.0f} s")
            if path.exists():   # built by the process that held the lock
                return
            logger.info("building the cpu kernels with %s into %s (once for this CPU and source: a minute or two)",
                        cc[0], path)
            start = time.monotonic()
            build(cc, path)
            logger.info("built the cpu kernels in %.0f s", time.monotonic() - start)
    except OSError as exc:
        raise KernelsUnavailable(f"cannot build into {path.parent}: {exc} (set FDPLUG_CACHE_DIR to a writable "
                                 "directory)") from None
