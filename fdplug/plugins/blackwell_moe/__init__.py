"""Built-in ``blackwell_moe`` plugin: FP8 block MoE on NVIDIA Blackwell through DeepGEMM.

Registers the ``blackwell_fp8`` MoE backend for the ``cuda`` device (``backend.py``): routed
experts of an ``fp8_block`` model as two grouped FP8 GEMMs with UE8M0 scales; and, with
``FD_USE_BLACKWELL_GEMM=1``, the ``blackwell_fp8_linear`` kernel of the ``fp8_linear`` op for the
dense FP8 linears (``linear.py``). Each is selected only where it can run (`requirements`:
capability >= 10.0, DeepGEMM's kernels importable, shapes they take); everywhere else selection
says which of those is missing.
"""

from __future__ import annotations

from fdplug.plugin_api.hookspecs import API_VERSION, hookimpl
from fdplug.plugin_api.specs import MoEBackendSpec, OpSpec
from fdplug.plugins.blackwell_moe import requirements, settings

FDPLUG_API_VERSION = API_VERSION


def _factory(config):
    from fdplug.errors import ConfigError
    from fdplug.plugins.blackwell_moe.backend import BlackwellFp8MoE
    from fdplug.plugins.blackwell_moe.kernels import (
        find_kernels,
        missing_kernels_reason,
    )

    kernels, reasons = find_kernels()
    if kernels is None:   # supports() checked, but an explicit --moe-backend in another process may not have
        raise ConfigError(f"blackwell_fp8 {missing_kernels_reason(reasons)}.", fix="install the kernels or select "
                          "another MoE backend (`fdplug explain --moe ...`).")
    return BlackwellFp8MoE(kernels, requirements.dispatch_tokens(config))


@hookimpl
def fdplug_register_moe_backends(register):
    register(MoEBackendSpec(name="blackwell_fp8", devices=("cuda",), factory=_factory, priority=50,
                            weight_formats=("fp8_block",), supports=requirements.unmet,
                            description="FP8 block experts as DeepGEMM grouped GEMMs with UE8M0 scales; needs an "
                                        "NVIDIA Blackwell GPU (compute capability >= 10.0), paddlepaddle-gpu and "
                                        "DeepGEMM's m_grouped_fp8_gemm_nt_contiguous/_masked"))


def _linear_factory(config):
    from fdplug.errors import ConfigError
    from fdplug.plugins.blackwell_moe.kernels import (
        find_kernels,
        missing_kernels_reason,
    )
    from fdplug.plugins.blackwell_moe.linear import BlackwellFp8Linear

    kernels, reasons = find_kernels()
    if kernels is None or not kernels.has_dense:
        raise ConfigError(f"blackwell_fp8_linear {missing_kernels_reason(reasons)}.", fix="install the kernels or "
                          "select another fp8_linear kernel (`--op-kernel fp8_linear=paddle_fp8_linear`).")
    return BlackwellFp8Linear(kernels)


@hookimpl
def fdplug_register_ops(register):
    register(OpSpec(name="blackwell_fp8_linear", op="fp8_linear", devices=("cuda",), factory=_linear_factory,
                    priority=50, supports=requirements.linear_unmet,
                    description="dense FP8 linears as DeepGEMM fp8_gemm_nt (1x128 UE8M0 activations); "
                                "FD_USE_BLACKWELL_GEMM=1 on NVIDIA Blackwell (compute capability >= 10.0)"))


@hookimpl
def fdplug_register_settings(register):
    for setting in settings.SETTINGS:
        register(setting)


@hookimpl
def fdplug_configure(config, selection):
    """num_max_dispatch_tokens_per_rank must hold a decode step's tokens; FD_USE_BLACKWELL_GEMM needs
    FD_USE_DEEP_GEMM."""
    if selection.device.name == "cuda":
        requirements.check_gemm_settings()
    if selection.moe.name == "blackwell_fp8":
        requirements.check_dispatch(config)
