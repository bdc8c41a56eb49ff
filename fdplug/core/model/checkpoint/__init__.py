"""What a checkpoint says about its model: `ModelConfig` from config.json or a GGUF file's metadata,
the architectures we run, rope scaling, FP8 and MoE configs, GGUF weight layouts, parameter footprints."""
