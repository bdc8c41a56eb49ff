"""The probe every accelerator plugin needs: paddle installed, compiled for the device, devices visible.

Written once so the CUDA, XPU and third-party probes give reasons of the same shape, and so none of
them can report a device available on the strength of the package name alone.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from fdplug.plugin_api.paddle import import_paddle, paddle_build_facts, paddle_installed
from fdplug.plugin_api.specs import Probe


def probe_accelerator(label: str, *, compiled: Callable[[Any], bool], count: Callable[[Any], int],
                      describe: Callable[[Any, int], dict[str, str]], install_fix: str,
                      visibility_fix: str, build_fact: str | None = None) -> Probe:
    """Ask paddle itself whether it was built for ``label`` devices and how many it can see.

    ``compiled(paddle)`` and ``count(paddle)`` wrap paddle's own APIs; ``describe(paddle, count)``
    returns facts for ``fdplug doctor`` (first device's name, runtime version). ``build_fact``: the
    name in paddle's version file that its build sets to ``'False'`` without this device
    (``cuda_version``, ``xpu_xre_version``): where it says so, the answer comes without importing
    paddle (`paddle_build_facts`); anything else is asked of paddle itself.
    """
    if not paddle_installed():
        return Probe(False, "PaddlePaddle is not installed", fix=install_fix)
    facts = paddle_build_facts() if build_fact is not None and "paddle" not in sys.modules else None
    if facts is not None and facts.get(build_fact) == "False":
        return Probe(False, f"paddle {facts.get('full_version', '')} is not compiled with {label} support",
                     fix=install_fix)
    paddle = import_paddle()
    if not compiled(paddle):
        return Probe(False, f"paddle {paddle.__version__} is not compiled with {label} support", fix=install_fix)
    try:
        n = int(count(paddle))
    except Exception as exc:  # a broken driver or runtime: report it, do not crash selection
        return Probe(False, f"paddle is compiled with {label} but querying devices failed: "
                            f"{type(exc).__name__}: {exc}", fix=visibility_fix)
    if n == 0:
        return Probe(False, f"paddle is compiled with {label} but 0 devices are visible", fix=visibility_fix)
    try:
        info = describe(paddle, n)
    except Exception as exc:
        info = {"describe_error": f"{type(exc).__name__}: {exc}"}
    name = info.get("name", label)
    return Probe(True, f"{n} {label} device(s) visible ({name})",
                 info=MappingProxyType({"count": str(n), **info}))
