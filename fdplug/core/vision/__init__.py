"""Vision towers in Paddle, and the image preprocessing that feeds them.

    image_processing.py  bytes -> header probe (size, format), PIL -> patches (transformers' values)
    segments.py          attention within windows / frames, batched by segment length
    qwen2_5_vl.py        Qwen2.5-VL's tower (windowed attention, 2-D RoPE, patch merger)
    tower.py             which tower a checkpoint has, loaded from its ``visual.`` tensors
    encoder.py           a picture's bytes -> its placeholder tokens' features
"""
