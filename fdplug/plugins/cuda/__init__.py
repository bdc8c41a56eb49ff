"""Built-in ``cuda`` plugin: NVIDIA GPUs through paddlepaddle-gpu.

Only the device for now: on a GPU the core's portable components run through
paddle's CUDA kernels; fused CUDA attention/MoE backends register here later with a higher priority.
"""

from __future__ import annotations

from fdplug.core.portable.device_probe import probe_accelerator
from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl
from fdplug.plugin_api.paddle import GPU_INSTALL_FIX
from fdplug.plugin_api.specs import DeviceSpec, Probe

FDPLUG_API_VERSION = API_VERSION

INSTALL_FIX = ("uninstall paddlepaddle (the CPU build of the same `paddle` module) and install the CUDA build: "
               f"{GPU_INSTALL_FIX}.")
VISIBILITY_FIX = "check `nvidia-smi`, the NVIDIA driver and CUDA_VISIBLE_DEVICES."


def _describe(paddle, count: int) -> dict[str, str]:
    major, minor = paddle.device.cuda.get_device_capability(0)
    return {"name": paddle.device.cuda.get_device_name(0), "capability": f"{major}.{minor}",
            "cuda": str(paddle.version.cuda()), "cudnn": str(paddle.version.cudnn())}


def free_memory(index: int = 0) -> int | None:
    """Total minus what paddle's allocator holds (paddle 3.3 has no cudaMemGetInfo wrapper, so other
    processes' use is not seen)."""
    import paddle

    total = paddle.device.cuda.get_device_properties(index).total_memory
    return int(total - paddle.device.cuda.memory_reserved(index))


def probe() -> Probe:
    return probe_accelerator("CUDA", compiled=lambda p: p.is_compiled_with_cuda(),
                             count=lambda p: p.device.cuda.device_count(), describe=_describe,
                             install_fix=INSTALL_FIX, visibility_fix=VISIBILITY_FIX,
                             build_fact="cuda_version")


@hookimpl
def fdplug_register_devices(register):
    register(DeviceSpec(name="cuda", probe=probe, paddle_device="gpu", priority=100, free_memory=free_memory,
                        description="NVIDIA GPUs through paddlepaddle-gpu"))
