"""Importing Paddle with a useful error, without making it a hard dependency of ``import fdplug``."""

from __future__ import annotations

import ast
import functools
import importlib.util
import warnings
from pathlib import Path
from typing import Any

from fdplug.errors import PaddleNotInstalledError

# paddlepaddle-gpu 3.x is not on PyPI (whose last one is 2.6), so no pip extra can install it: Paddle
# publishes it on its own index, one per CUDA version (cu118, cu126, cu129).
GPU_INSTALL = "python -m pip install paddlepaddle-gpu==3.3.1 -i https://www.paddlepaddle.org.cn/packages/stable/cu126/"
GPU_INSTALL_FIX = (f"`{GPU_INSTALL}` (Paddle's own index: paddlepaddle-gpu 3.x is not on PyPI; pick the index for "
                   "your CUDA version: cu118, cu126 or cu129)")
INSTALL_FIX = (f"install a PaddlePaddle build: `pip install 'fdplug[cpu]'` (CPU); for NVIDIA GPUs {GPU_INSTALL_FIX}; "
               "for Kunlun XPUs, Paddle's XPU wheel.")


def paddle_installed() -> bool:
    """Whether some build of paddle is importable, without importing it."""
    return importlib.util.find_spec("paddle") is not None


@functools.cache
def paddle_build_facts() -> dict[str, Any] | None:
    """What paddle's build wrote into ``paddle/version/__init__.py`` (``full_version``, ``cuda_version``,
    ``xpu_xre_version``: the string ``'False'`` where the build had no such device), read as text, without
    importing paddle; None where the file is not there or not as paddle's setup.py writes it.

    Why: ``import paddle`` costs ~1.5 s of CPU, and the device probes are all that would import it in
    `fdplug serve`'s API process (its engine processes import paddle anyway). A probe answers "not
    compiled for it" from these facts and imports paddle only where the build may have the device."""
    spec = importlib.util.find_spec("paddle")
    if spec is None or not spec.submodule_search_locations:
        return None
    try:
        tree = ast.parse((Path(list(spec.submodule_search_locations)[0]) / "version" / "__init__.py").read_text())
    except (OSError, SyntaxError, ValueError):
        return None
    return {target.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) for target in node.targets if isinstance(target, ast.Name)}


def import_paddle() -> Any:
    """``import paddle``, or a PaddleNotInstalledError that says which package to install."""
    try:
        with warnings.catch_warnings():  # paddle warns about a missing compiler cache on every import
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle
    except ImportError as exc:
        raise PaddleNotInstalledError(f"PaddlePaddle is needed for this but cannot be imported ({exc}).",
                                      fix=INSTALL_FIX) from None
    return paddle
