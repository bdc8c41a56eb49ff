"""Built-in ``xpu`` plugin: Kunlun XPUs through paddle's XPU build.

Only the device for now; on an XPU the portable reference components run through paddle's XPU
kernels, and the multimodal prefix cache is the core's, so it is on here as on every device.
"""

from __future__ import annotations

from fdplug.core.portable.device_probe import probe_accelerator
from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl
from fdplug.plugin_api.specs import DeviceSpec, Probe

FDPLUG_API_VERSION = API_VERSION

INSTALL_FIX = ("install paddle's XPU build (the paddlepaddle-xpu wheel from https://www.paddlepaddle.org.cn/install "
               "matching your XPU runtime) and uninstall the CPU build.")
VISIBILITY_FIX = "check `xpu-smi`, the XPU driver and XPU_VISIBLE_DEVICES."


def _describe(paddle, count: int) -> dict[str, str]:
    version = getattr(paddle.version, "xpu", None)
    return {"name": "Kunlun XPU", "xpu_runtime": str(version()) if callable(version) else "unknown"}


def free_memory(index: int = 0) -> int | None:
    import paddle

    return int(paddle.device.xpu.memory_total(index) - paddle.device.xpu.memory_used(index))


def probe() -> Probe:
    return probe_accelerator("XPU", compiled=lambda p: p.is_compiled_with_xpu(),
                             count=lambda p: p.device.xpu.device_count(), describe=_describe,
                             install_fix=INSTALL_FIX, visibility_fix=VISIBILITY_FIX,
                             build_fact="xpu_xre_version")


@hookimpl
def fdplug_register_devices(register):
    register(DeviceSpec(name="xpu", probe=probe, paddle_device="xpu", priority=90, free_memory=free_memory,
                        description="Kunlun XPUs through paddle's XPU build"))
