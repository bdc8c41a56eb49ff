"""fdplug plugin ``fakechip``: a device, and nothing else, to show what the core gives a vendor.

``fakechip`` is mapped onto paddle's CPU place, so it runs anywhere; a real chip names its own
paddle device type (``gpu``, ``xpu``, a custom device) and asks its SDK in ``probe``. Registering the
device is enough for a working engine: the core's portable runner, attention, MoE and op kernels run
on every device through Paddle. Faster parts come later, one at a time, each registered for this
device with a priority above the portable one (see fdplug's docs/plugins.md, "Writing a plugin").
"""

from __future__ import annotations

import importlib.util

from fdplug.plugin_api import DeviceSpec, Probe, hookimpl

FDPLUG_API_VERSION = "4.0"


def probe() -> Probe:
    """Cheap and honest: available only if a kernel launch would work (here: paddle is installed)."""
    if importlib.util.find_spec("paddle") is None:
        return Probe(False, "PaddlePaddle is not installed", fix="pip install 'fdplug[cpu]'")
    return Probe(True, "fakechip runs on the host CPU through paddle's CPU place")


@hookimpl
def fdplug_register_devices(register):
    # Priority below cpu's 0: a demo device must never win `--device auto` over a real one.
    register(DeviceSpec(name="fakechip", probe=probe, paddle_device="cpu", priority=-10, dtypes=("float32",),
                        description="an example device mapped onto paddle's CPU place"))
