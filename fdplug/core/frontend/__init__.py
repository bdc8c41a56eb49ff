"""Between users and the engine, shared by ``fdplug.LLM`` and the API server.

    llm.py        fdplug.LLM: offline generate / chat / stream on an in-process EngineCore
    processor.py  prompts in (validated, tokenized, fanned out for n > 1), text out (detokenized, stopped)
    outputs.py    RequestOutput / CompletionOutput / Logprob, vLLM's shapes
"""
