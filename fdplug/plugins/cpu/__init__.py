"""Built-in ``cpu`` plugin: the reference device, and the portable components every device can use.

It registers the cpu device, the core model runner (device-agnostic, so for every device), and the
reference attention and MoE backends (plain Paddle ops: correct anywhere, fast nowhere in particular;
device plugins register faster ones with a higher priority). For the cpu device itself it also
registers ``cpu_native`` attention and a ``cpu_native`` model runner, which run decode attention and
the MLP's SwiGLU in compiled C (see ``kernels.py``) and are chosen over the portable ones whenever
those kernels build here.
"""

from __future__ import annotations

from fdplug.core.hookspecs import hookimpl
from fdplug.errors import ConfigError
from fdplug.core.specs import ANY_DEVICE, AttentionBackendSpec, DeviceSpec, ModelRunnerSpec, MoEBackendSpec
from fdplug.plugins.cpu import device

FDPLUG_API_VERSION = "1.0"


def _runner_factory(config, backend):
    from fdplug.core.worker.model_runner import ModelRunner

    return ModelRunner(config, backend)


def _native_runner_factory(config, backend):
    from fdplug.plugins.cpu.runner import NativeCpuModelRunner

    return NativeCpuModelRunner(config, backend, threads=device.cpu_threads())


def _attention_factory(config):
    from fdplug.plugins.cpu.attention import ReferenceAttention

    return ReferenceAttention()


def _native_attention_factory(config):
    from fdplug.plugins.cpu.native_attention import NativeCpuAttention

    return NativeCpuAttention(threads=device.cpu_threads())


def _native_kernels_supports(config) -> str | None:
    from fdplug.plugins.cpu import kernels

    if config.dtype not in ("auto", "float32"):
        return f"computes in float32, not {config.dtype}"
    return kernels.unavailable_reason()


def _moe_factory(config):
    from fdplug.plugins.cpu.moe import ReferenceMoE

    return ReferenceMoE()


@hookimpl
def fdplug_register_devices(register):
    register(DeviceSpec(name="cpu", probe=device.probe, paddle_device="cpu", priority=0, setup=device.setup,
                        free_memory=device.free_memory,
                        description="the host CPU through paddle's CPU kernels (fp32 compute)"))


@hookimpl
def fdplug_register_model_runners(register):
    register(ModelRunnerSpec(name="default", devices=(ANY_DEVICE,), factory=_runner_factory, priority=0,
                             description="the core's device-agnostic Paddle model runner"))
    register(ModelRunnerSpec(name="cpu_native", devices=("cpu",), factory=_native_runner_factory, priority=10,
                             supports=_native_kernels_supports,
                             description="the core runner with the MLP's SwiGLU in compiled C (FDPLUG_CPU_KERNELS)"))


@hookimpl
def fdplug_register_attention_backends(register):
    register(AttentionBackendSpec(name="reference", devices=(ANY_DEVICE,), factory=_attention_factory, priority=0,
                                  description="plain Paddle matmuls over the paged cache, masks from the mask spec"))
    register(AttentionBackendSpec(name="cpu_native", devices=("cpu",), factory=_native_attention_factory, priority=10,
                                  supports=_native_kernels_supports,
                                  description="decode reads the paged cache in place (compiled C); prefill as "
                                              "the reference (FDPLUG_CPU_KERNELS)"))


@hookimpl
def fdplug_register_moe_backends(register):
    register(MoEBackendSpec(name="reference", devices=(ANY_DEVICE,), factory=_moe_factory, priority=0,
                            weight_formats=("none",), description="softmax top-k routing, a loop over experts"))


@hookimpl
def fdplug_configure(config, backend):
    """On the cpu device, compute is fp32: paddle's CPU build has no bf16/fp16 matmul or softmax kernels."""
    if backend.device.name != "cpu":
        return
    from fdplug.plugins.cpu import kernels

    kernels.require()
    if config.dtype == "auto":
        config.dtype = "float32"
    elif config.dtype != "float32":
        raise ConfigError(f"dtype {config.dtype!r} cannot run on the cpu device: paddle's CPU kernels compute in "
                          "float32 only (bf16/fp16 weights are cast to float32 at load time).",
                          fix="use dtype='auto' or 'float32' on cpu.")
