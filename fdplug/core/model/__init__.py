"""Paddle model code, shared by every device, and the text side of a model.

    decoder.py, layers.py, rope.py   one decoder for Llama / Qwen2 / Qwen3 / ERNIE-4.5 (dense); its
                                     RMSNorm and SwiGLU run the selected op kernels
    config.py, loader.py             Hugging Face config.json -> ModelConfig; safetensors -> weights
    sampler.py, penalties.py, sampling_filters.py   greedy / seeded sampling, penalties, top-k/p, min-p
    tokenizer.py, detokenizer.py     tokenizers-based encode; incremental decode
    chat_template.py, template_budget.py, chat_messages.py   sandboxed, metered chat templates
"""
