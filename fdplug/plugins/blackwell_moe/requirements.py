"""What ``blackwell_fp8`` needs, checked at selection, each unmet need said with what to do.

A GPU of compute capability >= 10.0 (Blackwell: B200, GB200, B300), DeepGEMM's grouped FP8 GEMMs
(`kernels.find_kernels`), ``FD_USE_DEEP_GEMM`` on, and a model whose experts fit the kernels:
``fp8_block`` weights (selection checks the format from ``weight_formats``) with 128-wide K blocks,
hidden and expert widths multiples of 128. Nothing is reported available on the strength of a
package name: the capability is the device's own answer, the kernels must import and be callable.

``num_max_dispatch_tokens_per_rank`` (FastDeploy's name) is the masked layout's rows per expert:
FastDeploy's rule ``max_num_seqs x (num_speculative_tokens + 1)`` (fdplug has no speculative
decoding: ``max_num_seqs``), overriding a model's own non-zero default; the setting wins if given.
"""

from __future__ import annotations

from typing import Any

from fdplug.errors import ConfigError
from fdplug.plugins.blackwell_moe import settings
from fdplug.plugins.blackwell_moe.kernels import find_kernels, missing_kernels_reason

MIN_CAPABILITY = (10, 0)
WIDTH = 128          # DeepGEMM's K granularity: activation groups and weight blocks


def gpu_capability() -> tuple[int, int] | None:
    """GPU 0's compute capability from paddle, None without a CUDA build or a visible GPU."""
    from fdplug.plugin_api.paddle import import_paddle, paddle_installed

    if not paddle_installed():
        return None
    paddle = import_paddle()
    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return None
    major, minor = paddle.device.cuda.get_device_capability(0)
    return int(major), int(minor)


def unmet(config: Any) -> str | None:
    """Why blackwell_fp8 cannot serve ``config`` here (every reason, joined), or None."""
    capability = gpu_capability()
    if capability is None:
        return "needs an NVIDIA GPU through paddlepaddle-gpu, and none is usable here"
    problems = []
    if capability < MIN_CAPABILITY:
        problems.append(f"needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Blackwell), "
                        f"GPU 0 is {capability[0]}.{capability[1]}")
    if not settings.USE_DEEP_GEMM.value():
        problems.append("FD_USE_DEEP_GEMM=0 turns DeepGEMM, which it runs on, off")
    else:
        kernels, reasons = find_kernels()
        if kernels is None:
            problems.append(missing_kernels_reason(reasons))
    problems += model_problems(config.model)
    return "; ".join(problems) or None


def linear_unmet(config: Any) -> str | None:
    """Why blackwell_fp8_linear cannot run the model's FP8 linears here, or None."""
    if not settings.USE_BLACKWELL_GEMM.value():
        return "FD_USE_BLACKWELL_GEMM=0 (the default, as in FastDeploy): set it to 1 for Blackwell FP8 GEMMs"
    capability = gpu_capability()
    if capability is None:
        return "needs an NVIDIA GPU through paddlepaddle-gpu, and none is usable here"
    problems = []
    if capability < MIN_CAPABILITY:
        problems.append(f"needs compute capability >= {MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (Blackwell), "
                        f"GPU 0 is {capability[0]}.{capability[1]}")
    kernels, reasons = find_kernels()
    if kernels is None:
        problems.append(missing_kernels_reason(reasons))
    elif not kernels.has_dense:
        problems.append(f"needs DeepGEMM's fp8_gemm_nt, which {kernels.name} does not have")
    model = config.model
    if model is not None and model.weight_block and model.weight_block[1] != WIDTH:
        problems.append(f"needs weight_block_size [*, {WIDTH}], the model's is {list(model.weight_block)}")
    return "; ".join(problems) or None


def check_gemm_settings() -> None:
    """FastDeploy's rule: the Blackwell GEMM path runs on DeepGEMM."""
    if settings.USE_BLACKWELL_GEMM.value() and not settings.USE_DEEP_GEMM.value():
        raise ConfigError("FD_USE_BLACKWELL_GEMM=1 needs FD_USE_DEEP_GEMM=1.",
                          fix="set FD_USE_DEEP_GEMM=1, or unset FD_USE_BLACKWELL_GEMM.")


def model_problems(model: Any) -> list[str]:
    """Shapes the kernels cannot take (the format itself is checked by selection)."""
    if model is None or not model.num_experts:
        return []
    problems = []
    if model.weight_block and model.weight_block[1] != WIDTH:
        problems.append(f"needs weight_block_size [*, {WIDTH}], the model's is {list(model.weight_block)}")
    for name, size in (("hidden_size", model.hidden_size), ("moe_intermediate_size", model.moe_intermediate_size)):
        if size % WIDTH:
            problems.append(f"needs {name} a multiple of {WIDTH}, the model's is {size}")
    return problems


def dispatch_tokens(config: Any) -> int:
    """``num_max_dispatch_tokens_per_rank`` for ``config``: the setting if given, else FastDeploy's rule."""
    explicit = settings.DISPATCH_TOKENS.value()
    return explicit if explicit is not None else config.max_num_seqs * (0 + 1)   # no speculative tokens


def check_dispatch(config: Any) -> None:
    """The configure hook's check: a masked layout of ``E x tokens`` rows must fit a step's tokens."""
    tokens = dispatch_tokens(config)
    if tokens < config.max_num_seqs:
        raise ConfigError(f"num_max_dispatch_tokens_per_rank={tokens} is below max_num_seqs={config.max_num_seqs}: "
                          "a decode step of every running request would not fit the masked layout.",
                          fix=f"unset {settings.DISPATCH_TOKENS.name} (it then follows max_num_seqs) or set it "
                              f">= {config.max_num_seqs}.")
