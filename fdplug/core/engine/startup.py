"""From arguments to a running engine: the config (validated once), the selection, the engine.

    config, model_config = build_engine_config(model, engine_args)    # model's limits applied
    config, model_config, selection = resolve_engine(model, device=..., **engine_args)
    engine = EngineCore(config, selection)

``fdplug serve`` resolves in the API process (to log the selection and fail fast) and again in the
engine process from ``Selection.to_names()``, which rebuilds the same selection there; ``fdplug.LLM``
does both in one process.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from fdplug.core.config import EngineConfig
from fdplug.errors import ConfigError
from fdplug.plugin_api.selection import Selection

ENGINE_ARGS = tuple(f.name for f in dataclasses.fields(EngineConfig)
                    if f.name not in ("model", "model_dir", "weight_dtype"))   # derived, not asked for


def build_engine_config(model: str | None, engine_args: Mapping[str, Any]) -> tuple[EngineConfig, Any]:
    """EngineConfig from vLLM-named engine args plus the model's own config; unknown args are errors.
    Without a model this is the built-in demo model (`fdplug.demo`)."""
    from fdplug.core.kv_transfer.peers import check_decode_trust
    from fdplug.core.model.checkpoint.config import ModelConfig
    from fdplug.core.settings import env
    from fdplug.demo import demo_model_dir
    from fdplug.demo.pypi_models import resolve_model

    unknown = sorted(set(engine_args) - set(ENGINE_ARGS))
    if unknown:
        raise ConfigError(f"unknown engine argument(s): {', '.join(unknown)}.",
                          fix=f"use only: {', '.join(ENGINE_ARGS)}.")
    model_dir = resolve_model(str(model)) if model else str(demo_model_dir())
    config = EngineConfig(model_dir=model_dir, **engine_args)
    check_decode_trust(config, env("FDPLUG_PD_SECRET"))   # before the model loads: fail in seconds
    model_config = ModelConfig.from_dir(model_dir, config.quantization)
    if config.max_model_len is None:
        config.max_model_len = min(model_config.max_position_embeddings, EngineConfig.DEFAULT_MAX_MODEL_LEN)
    elif config.max_model_len > model_config.max_position_embeddings:
        raise ConfigError(f"max_model_len {config.max_model_len} exceeds the model's max_position_embeddings "
                          f"({model_config.max_position_embeddings}).",
                          fix=f"set max_model_len <= {model_config.max_position_embeddings}.")
    if config.max_num_batched_tokens is None:
        config.max_num_batched_tokens = (max(2048, config.max_num_seqs) if config.enable_chunked_prefill
                                         else max(config.max_model_len, config.max_num_seqs))
    return config, model_config


def resolve_engine(model: str | None, device: str = "auto", runner: str | None = None, attention: str | None = None,
                   moe: str | None = None, storages: Mapping[str, str] | None = None,
                   ops: Mapping[str, str] | None = None, kv_connector: str | None = None,
                   measured_ops: list[str] | None = None, **engine_args: Any) -> tuple[EngineConfig, Any, Selection]:
    """Config, model config and selection, without building the engine: select once, settle the
    dtype on the device, let plugins configure. ``measured_ops``: as `select_components` (None
    here; another process rebuilding a selection passes its list)."""
    from fdplug.core.plugin_loading.loader import load_plugins
    from fdplug.core.plugin_loading.selection import select_components

    config, model_config = build_engine_config(model, engine_args)
    plugin_set = load_plugins()
    config.model = model_config.traits(None if config.dtype == "auto" else config.dtype)
    selection = select_components(device, runner, attention, moe, storages, ops, kv_connector, measured_ops,
                                  config=config, plugins=plugin_set)
    config.dtype, config.weight_dtype = compute_dtype(config.dtype, model_config.dtype, selection)
    plugin_set.configure(config, selection)
    return config, model_config, selection


def compute_dtype(asked: str, model_dtype: str, selection: Selection) -> tuple[str, str]:
    """``(compute dtype, weight dtype)``. ``auto``: the model's dtype if the device computes in it,
    else the device's preferred one. bfloat16 on a device that computes only in float32 (the cpu)
    means bf16 *weights* (`layers.Linear`; the selected ``linear`` kernel decides the math: float32
    on the widened weights, or bf16 math for one with ``OpSpec.bf16_inputs``): asked for explicitly, always; under
    ``auto`` for a bf16 checkpoint, where the selected ``linear`` kernel reads bf16 in place (the
    portable one widens every layer per call, slower than float32 weights). Another explicit dtype
    the device does not compute in is a ConfigError."""
    from fdplug.core.portable import PORTABLE_LINEAR

    device = selection.device
    weights_only = "bfloat16" not in device.dtypes and "float32" in device.dtypes
    if asked == "auto":
        if model_dtype in device.dtypes:
            return model_dtype, model_dtype
        if model_dtype == "bfloat16" and weights_only and selection.ops["linear"].name != PORTABLE_LINEAR:
            return "float32", "bfloat16"
        return device.dtypes[0], device.dtypes[0]
    if asked in device.dtypes:
        return asked, asked
    if asked == "bfloat16" and weights_only:
        return "float32", "bfloat16"
    raise ConfigError(f"dtype {asked!r} cannot run on the {device.name} device, which computes in "
                      f"{', '.join(device.dtypes)} (weights of other dtypes are cast at load time).",
                      fix=f"use dtype='auto' or one of {', '.join(device.dtypes)} on {device.name}.")


def create_engine(model: str | None, device: str = "auto", runner: str | None = None, attention: str | None = None,
                  moe: str | None = None, **engine_args: Any) -> tuple[Any, EngineConfig, Any]:
    """Select once, let plugins configure, and build the engine."""
    from fdplug.core.engine.engine_core import EngineCore

    config, model_config, selection = resolve_engine(model, device, runner, attention, moe, **engine_args)
    return EngineCore(config, selection), config, model_config
