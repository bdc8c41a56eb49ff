"""Multimodal inputs as pre-encoded features (vision encoders run elsewhere).

    inputs.py         a request's feature items and their placeholder tokens
    config.py         what a model declares: placeholder tokens, token counts, mask policy
    fetch.py          the storage serving each URL scheme
    features.py       bytes -> a checked [num_tokens, hidden_size] array
    loader.py         fetching off the step loop, into the encoder cache
    encoder_cache.py  features by mm_hash, shared by every request
    chunking.py       where a prefill chunk may end when item tokens attend bidirectionally
"""
