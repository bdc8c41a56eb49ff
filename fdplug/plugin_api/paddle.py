"""Importing Paddle with a useful error, without making it a hard dependency of ``import fdplug``."""

from __future__ import annotations

import importlib.util
import warnings
from typing import Any

from fdplug.errors import PaddleNotInstalledError

INSTALL_FIX = ("install a PaddlePaddle build: `pip install 'fdplug[cpu]'` (CPU), `pip install 'fdplug[gpu]'` "
               "or the paddlepaddle-gpu wheel for your CUDA (NVIDIA), or Paddle's XPU wheel (Kunlun).")


def paddle_installed() -> bool:
    """Whether some build of paddle is importable, without importing it."""
    return importlib.util.find_spec("paddle") is not None


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
