"""Quantization of the core: FP8 block formats (`fp8`) and checkpoint conversion (`checkpoint`)."""
