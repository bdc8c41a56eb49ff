"""The text side of a model: tokenizers (Hugging Face or a GGUF file's), incremental detokenizing,
and sandboxed, metered chat templates."""
