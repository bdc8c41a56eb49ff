"""Built-in ``cpu`` plugin: the host CPU as a device, and its compiled kernels.

It registers the cpu device (threads, MKL dispatch, malloc tuning in ``device.py``) and, where the
kernels in ``csrc/`` build with the system C compiler (``kernel_build.py``; loaded by ``kernels.py``),
faster components for it: ``cpu_native`` attention (decode reads the paged cache in place), ``cpu_native`` MoE (the
routed experts in one compiled call) and the ``cpu_native`` SwiGLU, RMSNorm, FP8-linear, GGUF-linear and
linear op kernels. Everything else on the cpu device is the core's portable code.
"""

from __future__ import annotations

from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl
from fdplug.plugin_api.specs import (
    AttentionBackendSpec,
    DeviceSpec,
    MoEBackendSpec,
    OpSpec,
)
from fdplug.plugins.cpu import device, settings

FDPLUG_API_VERSION = API_VERSION


def _native_attention_factory(config):
    from fdplug.plugins.cpu.native_attention import NativeCpuAttention

    return NativeCpuAttention(threads=device.cpu_threads())


def _native_moe_factory(config):
    from fdplug.plugins.cpu.native_moe import NativeCpuMoE

    return NativeCpuMoE(threads=device.cpu_threads())


def _op_factory(module: str, function: str, **bound):
    """The factory of op kernel ``fdplug.plugins.cpu.<module>.<function>`` on this device's threads
    (plus ``bound`` arguments); it builds the kernels first, to fail at startup, not at the first step."""
    def factory(config):
        import functools
        import importlib

        from fdplug.plugins.cpu import kernels

        kernels.load()
        kernel = getattr(importlib.import_module(f"fdplug.plugins.cpu.{module}"), function)
        return functools.partial(kernel, threads=device.cpu_threads(), **bound)
    return factory


def _linear_prepare_factory(config):
    """`OpSpec.prepare` of the linear kernels: weights packed once at load (native_linear.prepare),
    unless FDPLUG_CPU_PACK_WEIGHTS=0."""
    from fdplug.plugins.cpu import native_linear

    return native_linear.prepare if settings.PACK_WEIGHTS.value() else lambda weight: None


def _fp8_prepare_factory(config):
    """`OpSpec.prepare` of the FP8 linear kernel: e4m3 weights packed once at load (native_fp8.prepare),
    unless FDPLUG_CPU_PACK_WEIGHTS=0."""
    from fdplug.plugins.cpu import native_fp8

    return native_fp8.prepare if settings.PACK_WEIGHTS.value() else lambda weight: None


def _native_kernels_supports(config) -> str | None:
    """The kernels are float32, as is the cpu device (``DeviceSpec.dtypes``): only the build can fail."""
    from fdplug.plugins.cpu import kernels

    return kernels.unavailable_reason()


def _tiles_supports(name: str):
    """The linear kernels have tiles for x86-64-v4 (AVX-512) and v3 (AVX2, FMA, F16C): below (the
    CPU, or FDPLUG_CPU_ISA) their scalar fallback is ~40x below paddle's matmul, so they are not
    chosen there."""
    def supports(config) -> str | None:
        from fdplug.plugins.cpu import isa

        return _native_kernels_supports(config) or isa.level_reason(name, 3)
    return supports


def _measure_key(config) -> str:
    """`OpSpec.measure_key` of the row-op kernels (norms, RoPE, SwiGLU, argmax), and the attention and
    MoE backends': what their speed against paddle's ops depends on."""
    import paddle

    from fdplug.plugins.cpu import isa, kernel_build

    return (f"{isa.model_name()} | {isa.describe()} | {kernel_build.library_path(kernel_build.compiler()).name} | "
            f"{device.cpu_threads()} threads | paddle {paddle.__version__}")


def _linear_measure_key(config) -> str:
    """`OpSpec.measure_key` of the linear kernels (float, FP8, GGUF): as the row ops', and whether
    weights are packed."""
    return f"{_measure_key(config)} | {'packed weights' if settings.PACK_WEIGHTS.value() else 'weights in place'}"


def _bf16_math_supports(name: str, module: str, otherwise: str):
    """`OpSpec.supports` of a bf16-math kernel: the tiles' level, and AVX512-BF16 in the build
    (``module.bf16_math_available``); without it, ``otherwise`` runs (said in the reason)."""
    def supports(config) -> str | None:
        import importlib

        reason = _tiles_supports(name)(config)
        if reason is None and not importlib.import_module(f"fdplug.plugins.cpu.{module}").bf16_math_available():
            reason = f"the CPU (or the C compiler, or FDPLUG_CPU_ISA) has no AVX512-BF16: {otherwise}"
        return reason
    return supports


def _packed_supports(config) -> str | None:
    """`OpSpec.supports` of the packed q8-math GGUF kernel: the tiles' level, and its tiles in the build
    (where it comes first: `_packed_priority`)."""
    from fdplug.plugins.cpu import native_gguf_packed

    reason = _tiles_supports("cpu_native_gguf_packed_linear")(config)
    if reason is None and not native_gguf_packed.available():
        reason = "the build has no packed tiles (csrc/gguf_packed.c needs AVX2)"
    return reason


def _packed_priority() -> int:
    """Chosen first where the packed tiles have vpdpbusd (AVX512-VNNI, AVX-VNNI): on the AMD EPYC
    (avx512, 2 threads) 1.6-2.4x q8 math at one row, 0.98-1.4x bf16 math from 64 rows. And at
    x86-64-v3 without it (vpmaddubsw, its int16 sums): there, capped to AVX2 on the same AMD EPYC, it
    beat q8 math (the default before) on every engine figure measured against llama.cpp (SmolLM2 Q4_1:
    decode 1.55x q8 math's, TTFT 0.86x; Q4_K_M: decode 1.07x, TTFT 0.89x, 64 streams 1.06x, offline
    1.19x). At AVX-512 without VNNI the bf16 or float32 tiles stay first: by name there. From the CPU's
    flags and the cap (`isa.extensions`, `isa.level`), not the build: registration must not build the
    kernels (a plugin whose build failed, or FDPLUG_CPU_KERNELS=off, still registers its device)."""
    from fdplug.plugins.cpu import isa

    return 30 if {"AVX512-VNNI", "AVX-VNNI"} & set(isa.extensions()) or isa.level() == 3 else 4


def _gguf_packed_prepare_factory(config):
    """`OpSpec.prepare` of the packed GGUF kernel: each layer's blocks repacked once at load
    (native_gguf_packed.prepare); FDPLUG_CPU_PACK_WEIGHTS=0 leaves them as the file has them (each
    group then packed as a call reaches it: the same bits, slower)."""
    from fdplug.plugins.cpu import native_gguf_packed, settings

    return native_gguf_packed.prepare if settings.PACK_WEIGHTS.value() else lambda weight, qtype: None


def _q8_math_supports(config) -> str | None:
    """`OpSpec.supports` of the q8-math GGUF kernel: the tiles' level, and its tiles in the build."""
    from fdplug.plugins.cpu import native_gguf

    reason = _tiles_supports("cpu_native_gguf_q8_linear")(config)
    if reason is None and not native_gguf.q8_math_available():
        reason = "the build has no q8-math tiles (csrc/gguf_q8.c needs AVX2)"
    return reason


def _bf16_math_units() -> str:
    """What runs the packed bf16 math, from the CPU's flags and the settings (registration builds nothing)."""
    from fdplug.plugins.cpu import isa

    if "AMX-BF16" in isa.extensions():
        return "AMX tiles, every row count; FDPLUG_CPU_AMX=0: AVX512-BF16 dot products"
    return "AVX512-BF16 dot products"


def _q8_math_priority() -> int:
    """Second at x86-64-v3, where there is no bf16 math (after the packed q8 math, `_packed_priority`:
    first there when its tiles are missing): q8 math ran 1.4-1.6x the float32 tiles at one row and
    0.75-1.4x from 64 rows (AMD EPYC, avx512, capped to AVX2), with SmolLM2's perplexity +0.09%
    (packed q8 math's runs of 16: +0.65%; bf16 math +0.11%). Below the float32 tiles at AVX-512
    (0.5-0.8x them from 8 rows there): chosen by name."""
    from fdplug.plugins.cpu import isa

    return 15 if isa.level() == 3 else 5


@hookimpl
def fdplug_register_devices(register):
    register(DeviceSpec(name="cpu", probe=device.probe, paddle_device="cpu", priority=0, setup=device.setup,
                        free_memory=device.free_memory, dtypes=("float32",),
                        description="the host CPU through paddle's CPU kernels (fp32 compute: paddle's CPU build "
                                    "has no bf16/fp16 matmul or softmax kernels; such weights are cast at load)"))


@hookimpl
def fdplug_register_attention_backends(register):
    register(AttentionBackendSpec(name="cpu_native", devices=("cpu",), factory=_native_attention_factory, priority=10,
                                  supports=_native_kernels_supports, measure_key=_measure_key,
                                  description="decode reads the paged cache in place (compiled C); prefill as "
                                              "the reference (FDPLUG_CPU_KERNELS)"))


@hookimpl
def fdplug_register_moe_backends(register):
    register(MoEBackendSpec(name="cpu_native", devices=("cpu",), factory=_native_moe_factory, priority=10,
                            weight_formats=("none", "fp8_block", "gguf"), supports=_native_kernels_supports,
                            measure_key=_measure_key,
                            description="float experts: every expert of a layer in one compiled call (grouped "
                                        "GEMMs, SwiGLU fused, all cores); fp8_block: two compiled FP8 linears per "
                                        "expert, weights read in place; gguf: the compiled GGUF linear on each "
                                        "expert's blocks in place, expert by expert; FDPLUG_CPU_KERNELS"))


@hookimpl
def fdplug_register_ops(register):
    def native(name: str, op: str, kernel: tuple[str, str], description: str, bound: dict | None = None,
               **spec) -> None:
        """Register ``kernel`` (module, function of this package) for ``op``: priority 10 and the
        build as the condition unless ``spec`` says otherwise."""
        spec = {"priority": 10, "supports": _native_kernels_supports, **spec}
        register(OpSpec(name=name, op=op, devices=("cpu",), factory=_op_factory(*kernel, **(bound or {})),
                        description=description, **spec))

    native("cpu_native_swiglu", "swiglu", ("kernels", "swiglu"),
           "AVX2 SwiGLU on every core (compiled C): 4-5x paddle's single-threaded one (FDPLUG_CPU_KERNELS); timed "
           "against it at startup on the model's widths, used where not slower", measure_key=_measure_key)
    native("cpu_native_fp8_linear", "fp8_linear", ("native_fp8", "fp8_linear_or_portable"),
           "FP8 weights kept one byte, packed at load in panels of 64 columns (16 for AVX2), widened in "
           "registers and scaled per block in outer-product tiles (compiled C); timed against the portable op on "
           "the model's shapes at startup, used where not slower", prepare=_fp8_prepare_factory,
           supports=_tiles_supports("cpu_native_fp8_linear"), measure_key=_linear_measure_key)
    native("cpu_native_gguf_linear", "gguf_linear", ("native_gguf", "gguf_linear_or_portable"),
           "a GGUF file's GGML blocks (Q8_0, Q4_0/1, Q5_0/1, Q4_K, Q5_K, Q6_K) widened in registers and fed to FMA "
           "tiles, read in place (compiled C; prefill: a panel widened once a thread); other types or "
           "non-float32 inputs: the portable op", supports=_tiles_supports("cpu_native_gguf_linear"),
           measure_key=_linear_measure_key)
    native("cpu_native_gguf_bf16_linear", "gguf_linear", ("native_gguf", "gguf_linear_or_portable"),
           "cpu_native_gguf_linear's tiles in bf16 math (AVX512-BF16 dot products: inputs and decoded weights "
           "rounded to bf16, float32 sums; 1.4-1.9x from 64 rows, ~0.92x at one). --op-kernel "
           "gguf_linear=cpu_native_gguf_linear keeps float32 math", bound={"bf16_math": True}, priority=20,
           supports=_bf16_math_supports("cpu_native_gguf_bf16_linear", "native_gguf",
                                        "GGUF linears run as cpu_native_gguf_linear's float32 math"), bf16_inputs=True,
           measure_key=_linear_measure_key)
    native("cpu_native_gguf_q8_linear", "gguf_linear", ("native_gguf", "gguf_linear_or_portable"),
           "cpu_native_gguf_linear in q8 math, as llama.cpp: inputs quantized to 8 bits per 4 values, each "
           "32 weights' products summed as integers (vpmaddubsw; 1.4-1.9x the float32 tiles at 1-8 rows, "
           "0.8-1.3x from 64, at AVX2; at AVX-512 1.2-1.5x the bf16 tiles at one row, 0.55-0.7x from 64). Chosen "
           "first at x86-64-v3 where the packed tiles are missing, by name elsewhere; SmolLM2-135M's "
           "perplexity +0.09% (bf16 math +0.11%). "
           "--op-kernel gguf_linear=cpu_native_gguf_linear keeps float32 math",
           bound={"q8_math": True}, priority=_q8_math_priority(), supports=_q8_math_supports, q8_inputs=True,
           measure_key=_linear_measure_key)
    native("cpu_native_gguf_packed_linear", "gguf_linear", ("native_gguf_packed", "gguf_linear_or_fallback"),
           "q8 math on GGUF blocks repacked at load into groups of 16 columns (the same bytes): inputs quantized "
           "to 8 bits per 16 values, each run's products summed as integers with the columns in the lanes "
           "(vpdpbusd; on SmolLM2's layers 1.6-2.4x q8 math at one row, 1.0-1.4x bf16 math from 64 rows, AMD "
           "EPYC, avx512). Chosen first where the CPU (as FDPLUG_CPU_ISA leaves it) has AVX512-VNNI or "
           "AVX-VNNI, and at x86-64-v3 without it (vpmaddubsw); by name at AVX-512 without VNNI. "
           "--op-kernel gguf_linear=cpu_native_gguf_bf16_linear keeps bf16 math",
           priority=_packed_priority(), supports=_packed_supports, prepare=_gguf_packed_prepare_factory, q8_inputs=16,
           measure_key=_linear_measure_key)
    native("cpu_native_rms_norm", "rms_norm", ("native_norms", "rms_norm"),
           "one compiled call instead of paddle's five ops (float32; the q/k norm's per-head weights too)",
           measure_key=_measure_key)
    native("cpu_native_add_rms_norm", "add_rms_norm", ("native_norms", "add_rms_norm"),
           "the residual add and the norm in one compiled pass over each row (float32)", measure_key=_measure_key)
    native("cpu_native_rope", "rope", ("native_norms", "rope"),
           "the NeoX rotation in one compiled call, bit-identical to paddle's four ops", measure_key=_measure_key)
    native("cpu_native_decoder_stack", "decoder_stack", ("native_stack", "decoder_stack"),
           "a decode step's layers in one compiled call of the kernels above (GGUF linears, cpu_native "
           "attention; bit-identical to running them layer by layer); other models and steps: layer by layer; "
           "timed against the layers one by one once loaded, kept where not slower", measure_key=_measure_key)
    native("cpu_native_argmax", "argmax", ("native_argmax", "argmax"),
           "greedy sampling's argmax, 16 lanes at a time, rows over the cores (compiled C)", measure_key=_measure_key)
    native("cpu_native_linear", "linear", ("native_linear", "linear_or_portable"),
           "FMA tiles (AVX-512 or AVX2) on float32 or bf16 weights packed at load in panels of 64 columns "
           "(16 for AVX2; compiled C; bf16 widened in registers: half the bytes, float32 math); timed against paddle's "
           "matmul on the model's shapes at startup, used where it is not slower",
           prepare=_linear_prepare_factory, supports=_tiles_supports("cpu_native_linear"),
           measure_key=_linear_measure_key)
    native("cpu_native_bf16_linear", "linear", ("native_linear", "linear_or_portable"),
           f"bf16 weights in bf16 math ({_bf16_math_units()}: inputs rounded to bf16, float32 sums; ~2x "
           "cpu_native_linear where compute-bound); float32 weights as cpu_native_linear. --op-kernel "
           "linear=cpu_native_linear keeps float32 math",
           bound={"bf16_math": True}, priority=20, bf16_inputs=True, prepare=_linear_prepare_factory,
           supports=_bf16_math_supports("cpu_native_bf16_linear", "native_linear",
                                        "bf16 weights run as cpu_native_linear's float32 math"),
           measure_key=_linear_measure_key)


@hookimpl
def fdplug_register_settings(register):
    for setting in settings.SETTINGS:
        register(setting)


@hookimpl
def fdplug_configure(config, selection):
    """FDPLUG_CPU_KERNELS=on: the cpu device refuses to start without its compiled kernels."""
    if selection.device.name != "cpu":
        return
    from fdplug.plugins.cpu import kernels

    kernels.require()
