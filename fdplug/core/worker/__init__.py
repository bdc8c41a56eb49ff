"""The portable model runner (`fdplug.plugin_api.model_runner.ModelRunner` for every device).

    model_runner.py  a step: the batch updated, inputs and attention metadata built in numpy, one
                     forward, logits only for sampling rows, sampling
    input_batch.py   persistent per-slot request state (all-or-nothing writes)
    kv_cache.py      KV cache sizing from memory, allocation in the attention backend's layout
    sampling.py      per-slot sampling fields -> the sampler's per-row metadata; logprobs back
"""
