"""The portable components: plain Paddle, correct on every device, fast on none in particular.

The reference attention (`attention`), the reference MoE (`moe`) and its routing rule
(`moe_routing`), one kernel per op of `fdplug.plugin_api.ops` (`ops`), and what a plugin may build
on: a device probe of the usual shape (`device_probe`), KV block copies between cache layouts
(`kv_blocks`), parallel downloads in order (`ordered_fetch`), structured outputs' token masks
(`grammar_masks`), a file lock with a deadline for work one process of a machine does for all
(`file_lock`: the op timings, a model's download, the cpu kernels' build). The core registers them for every
device as the plugin ``core`` (`fdplug.core.plugin_loading.core_plugin`; the ops' specs: `op_specs`); a device plugin
registers faster ones with a higher priority, and may import and extend these.
"""

PORTABLE_LINEAR = "paddle_linear"
"""The portable ``linear``: it widens a whole bf16 layer per call, so ``dtype=auto`` keeps a bf16
checkpoint's weights in bf16 on a float32 device only where another kernel reads them in place."""
