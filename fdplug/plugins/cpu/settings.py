"""The cpu plugin's environment variables, registered through ``fdplug_register_settings``.

``OMP_NUM_THREADS`` is everyone's (`fdplug.plugin_api.settings`); the cpu device honours it.
"""

from __future__ import annotations

from fdplug.plugin_api.settings import (
                      Setting,
                      parse_bool,
                      parse_choice,
                      parse_positive_int,
)

CPU_THREADS = Setting("FDPLUG_CPU_THREADS", None, parse_positive_int,
                      "Threads for CPU compute (default: the number of usable cores).")
CPU_MALLOC_TUNING = Setting("FDPLUG_CPU_MALLOC_TUNING", True, parse_bool,
                            "1 (default): the cpu device makes glibc keep freed memory (no mmap per large tensor); "
                            "0: leave malloc alone.")
CPU_KERNELS = Setting("FDPLUG_CPU_KERNELS", "auto", parse_choice("auto", "on", "off"),
                      "The cpu device's compiled kernels (paged attention read in place, SwiGLU; built once with the "
                      "system C compiler into FDPLUG_CACHE_DIR): auto (default) uses them if they build, on requires "
                      "them, off keeps plain Paddle.")
PACK_WEIGHTS = Setting("FDPLUG_CPU_PACK_WEIGHTS", True, parse_bool,
                       "1 (default): the cpu_native linear kernels pack each linear layer's weights once at load "
                       "(panels of 64 columns, 16 for the AVX2 tiles: ~2x the in-place tiles at 64+ rows), and the "
                       "packed GGUF kernel its blocks (groups of 16 columns); 0: weights stay in the checkpoint's "
                       "[out, in] layout (the in-place tiles; other bits, same accuracy; GGUF: each group packed "
                       "per call, the same bits, slower).")
CPU_ISA = Setting("FDPLUG_CPU_ISA", "auto", parse_choice("auto", "avx512", "avx2", "sse4"),
                  "Caps the x86 instruction-set level the cpu kernels are compiled for and claim: auto (default) "
                  "what the CPU has; avx512 (x86-64-v4), avx2 (x86-64-v3), sse4 (x86-64-v2). To test a lower "
                  "level's code on a higher CPU, or give a fleet of mixed CPUs the same bits.")
CPU_AMX = Setting("FDPLUG_CPU_AMX", True, parse_bool,
                  "1 (default): where the CPU has AMX and the kernels are built for it (-march=native), bf16 math "
                  "runs the packed linears on AMX tiles (other bits than AVX512-BF16's, ~2-4x from 32 rows); 0: the "
                  "kernels are built without AMX (AVX512-BF16's bits, or a fleet's without AMX).")
CC = Setting("CC", None, str, "C compiler for the cpu device's kernels (default: cc, then gcc, then clang on PATH).")
MKL_DEBUG_CPU_TYPE = Setting("MKL_DEBUG_CPU_TYPE", None, str,
                             "Honoured if set; otherwise the cpu device sets 5 on AMD CPUs (MKL's fast AVX2 path).",
                             as_set_by_user=True)
KMP_BLOCKTIME = Setting("KMP_BLOCKTIME", None, str,
                        "Honoured if set; otherwise the cpu device sets 0 so MKL's idle threads sleep instead of "
                        "spinning for 200 ms (they took the cores from the compiled attention kernel's threads).",
                        as_set_by_user=True)

SETTINGS = (CPU_THREADS, CPU_MALLOC_TUNING, CPU_KERNELS, PACK_WEIGHTS, CPU_ISA, CPU_AMX, CC, MKL_DEBUG_CPU_TYPE,
            KMP_BLOCKTIME)
