"""The model: Paddle code shared by every device, and the text around it.

Four concepts, each a subpackage, and the loader that joins them:

    checkpoint/   what a checkpoint says: config.json or a GGUF file's metadata -> `ModelConfig`
                  (architectures, rope scaling, FP8 and MoE configs, GGUF layouts, footprints)
    layers/       the network: one decoder for Llama / Qwen2 / Qwen3 / ERNIE-4.5 (dense and MoE),
                  its linears in every weight format (float, FP8 blocks, GGML blocks), running the
                  selected op kernels
    sampling/     one token per row of logits: greedy / seeded sampling, penalties, top-k/p, min-p
    text/         tokenizers (Hugging Face or a GGUF file's), incremental detokenizing, and
                  sandboxed, metered chat templates
    loader.py, gguf_loader.py, weight_slots.py   a checkpoint's tensors into the network's
                  parameters (safetensors or GGUF)

Dependencies run one way: the loader uses all of them; layers and text read checkpoint; sampling
stands alone.
"""
