"""Vision towers in Paddle, and the image preprocessing that feeds them. They compute with the
selected ops (`fdplug.plugin_api.ops`): norms, RoPE, SwiGLU, and their attention, the
``vision_attention`` op (portable: `fdplug.core.portable.vision_attention`), which a device plugin
may replace with a faster kernel.

    image_processing.py  bytes -> header probe (size, format), PIL -> patches (transformers' values)
    qwen2_5_vl.py        Qwen2.5-VL's tower (windowed attention, 2-D RoPE, patch merger)
    tower.py             which tower a checkpoint has, loaded from its ``visual.`` tensors
    encoder.py           a picture's bytes -> its placeholder tokens' features
"""
