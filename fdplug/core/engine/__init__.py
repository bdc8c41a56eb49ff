"""The engine: requests in, one step at a time, outputs out.

    engine_core.py      EngineCore: add, abort, and the step loop (schedule -> execute -> update)
    executor.py         one step on the model runner; failures contained (the culprits fail alone)
    step_recovery.py    finding the requests that broke a step by re-running subsets
    runner_check.py     checking a runner's tokens and state against the scheduler; rebuilding it
    admission.py        a request checked against the running model before it is queued
    profiler.py         where a step's time goes (read by bench/, never by control flow)
    startup.py          arguments -> EngineConfig (validated once) -> Selection -> EngineCore
    request.py          Request and its statuses;  sampling_params.py  SamplingParams and bounds
"""
