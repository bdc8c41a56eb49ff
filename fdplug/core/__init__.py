"""The device-agnostic core, written once for every device.

    engine/          EngineCore's step loop, admission checks, step recovery, startup (config,
                     selection, dtype), requests and sampling parameters
    scheduler/       the token-budget scheduler (chunked prefill, preemption), paged KV blocks with
                     prefix caching, SchedulerOutput
    worker/          the portable model runner, its input batch, KV cache sizing, sampling metadata
    model/           Paddle model code (Llama / Qwen2 / Qwen3 / ERNIE-4.5 dense), loader, sampler,
                     tokenizer, chat templates, detokenizer
    multimodal/      pre-encoded features: inputs, placeholders, fetch, encoder cache, chunk splits
    portable/        the components registered for every device: reference attention and MoE,
                     the op kernels (plain Paddle), and their registration as plugin ``core``
    plugin_loading/  loading plugins (built-in and entry points), the registry, selection
    frontend/        between users and the engine: ``fdplug.LLM``, input and output processing
    config.py        EngineConfig and ModelTraits;  settings.py  the core's environment variables

Nothing here imports ``fdplug.server`` or ``fdplug.plugins``; the contract with plugins is
`fdplug.plugin_api`.
"""

from fdplug.core import settings as _settings  # noqa: F401  (declares the core's environment variables)
