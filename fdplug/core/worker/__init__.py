"""The portable model runner (`fdplug.plugin_api.model_runner.ModelRunner` for every device).

    model_runner.py  a step: the batch updated, inputs and attention metadata built in numpy, one
                     forward, logits only for sampling rows, sampling
    input_batch.py   persistent per-slot request state (all-or-nothing writes)
    kv_cache.py      KV cache sizing from memory, allocation in the attention backend's layout
    sampling.py      per-slot sampling fields -> the sampler's per-row metadata; logprobs back
    load_checks.py   the weights against the device's memory; the expert-parallel group
    mm_inputs.py     a step's multimodal inputs: bidirectional mask offsets, the feature rows

Selection that measures (a kernel or backend runs only where it is not slower than the portable one):
    timing_cache.py    the interleaved timer, the tie rule, the figures' cache under a file lock
    op_timing.py       the linear kernels (float, FP8, GGUF) per layer shape
    row_op_timing.py   the norms, RoPE, SwiGLU and argmax kernels per op
    stack_timing.py    a fused decoder stack on the loaded model's decode steps
    backend_timing.py  the attention and MoE backends against the reference, before the model is built
    expert_samples.py  random routed experts in a model's own formats, for the MoE timing
"""
