"""Checkpoint conversion to FP8 blocks (`checkpoint`); the formats themselves are part of the plugin
contract (`fdplug.plugin_api.fp8`), so kernels and the core agree on every bit."""
