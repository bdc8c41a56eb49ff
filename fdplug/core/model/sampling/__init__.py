"""One token per row of logits (vLLM semantics): `SamplingMetadata`, penalties, filters, the draw."""
