"""What the model runner checks before it reads a weight: that they fit the device, and that an
expert-parallel group is one this model and process can run."""

from __future__ import annotations

from typing import Any

from fdplug.core.config import EngineConfig
from fdplug.errors import ConfigError
from fdplug.plugin_api.model_runner import format_bytes
from fdplug.plugin_api.selection import Selection


def check_weights_fit(cfg: Any, dtype: str, selection: Selection, expert_shards: int = 1) -> Any:
    """The weights' footprint from config.json (``expert_shards``: the routed experts split over
    that many ranks); a ConfigError with the numbers, before anything is read, if the device has
    less free memory than they need."""
    from fdplug.core.model.checkpoint.footprint import weight_footprint

    footprint = weight_footprint(cfg, dtype, expert_shards)
    free = selection.device.free_memory(0) if selection.device.free_memory else None
    if free is not None and footprint.total_bytes > free:
        raise ConfigError(f"the model's weights need {footprint.describe(cfg)} as {dtype}, but only "
                          f"{format_bytes(free)} are free on device {selection.device.name!r}.",
                          fix="use a device with more memory, a smaller model, or free memory on this one.")
    return footprint


def expert_parallel_group(config: EngineConfig, cfg: Any) -> Any:
    """This engine's expert-parallel group (`lockstep.current_group`), None when it runs alone; a
    ConfigError when ``expert_parallel_size`` asks for one this process is not part of."""
    from fdplug.core.parallel.lockstep import current_group

    if config.expert_parallel_size == 1:
        return None
    group = current_group()
    if group is None or group.size != config.expert_parallel_size:
        raise ConfigError(f"expert_parallel_size={config.expert_parallel_size}, but this process is not a rank of "
                          "such a group.", fix="run expert parallel through `fdplug serve --expert-parallel-size N`.")
    if cfg.moe is not None and cfg.moe.vision is not None:
        raise ConfigError(f"--expert-parallel-size {group.size}: {cfg.architecture}'s modality experts do not run "
                          "expert parallel yet.", fix="use --data-parallel-size.")
    if cfg.moe is None:
        raise ConfigError(f"--expert-parallel-size {group.size} shards a MoE model's experts, and "
                          f"{cfg.architecture} has none.", fix="use --data-parallel-size for a dense model.")
    return group
