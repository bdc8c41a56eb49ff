"""Parallelism across ranks (paddle.distributed): expert parallel MoE exchanges (`expert_parallel`)."""
