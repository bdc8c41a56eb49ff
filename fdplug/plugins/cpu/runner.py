"""``cpu_native`` model runner: the core runner, with the compiled SwiGLU in every MLP.

Paddle's CPU ``swiglu`` runs one scalar thread: measured on the 2-core CI machine it was 8% of a
prefill and 7% of a 64-request decode step on a 50M model; the compiled one (``kernels.swiglu``:
AVX2, every core) is 4-5x faster and agrees to 3e-7 relative. Everything else is the core's.
"""

from __future__ import annotations

import functools

from fdplug.core.model.layers import SwiGLU
from fdplug.core.worker.model_runner import ModelRunner
from fdplug.plugins.cpu import kernels


class NativeCpuModelRunner(ModelRunner):
    """The core runner; after loading, each SwiGLU layer computes its activation with the C kernel."""

    def __init__(self, config, backend, threads: int) -> None:
        super().__init__(config, backend)
        kernels.load()  # fail at construction, not at the first step
        self.threads = threads

    def load_model(self) -> None:
        super().load_model()
        activation = functools.partial(kernels.swiglu, threads=self.threads)
        for layer in self.model.sublayers():
            if isinstance(layer, SwiGLU):
                layer.activation = activation
