"""Which requests run each step, and with how many tokens (vLLM v1's token-budget scheduler).

    scheduler.py         admission, schedule() -> SchedulerOutput, preemption, update_from_output
    request_rules.py     per request: the chunk it may run, an item needing a step of its own, stop rules
    kv_cache_manager.py  blocks per request, prefix-cache hits (chained block hashes)
    block_pool.py        the free list (LRU of cached free blocks) and the null block
    output.py            SchedulerOutput (what a runner executes), EngineCoreOutput, stats
    config.py            SchedulerConfig, derived from the EngineConfig and the runner's KV cache
"""
