"""Parallelism across ranks (paddle.distributed): expert parallel MoE exchanges (`exchange`) and the
lockstep of the ranks' forward passes (`lockstep`)."""
