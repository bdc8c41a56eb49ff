"""One engine's timings for bench/gguf_peers.py, run in that engine's own interpreter (fdplug's venv, or
one with llama-cpp-python; nothing of fdplug is imported for llama.cpp):
``python bench/gguf_peer_worker.py ENGINE JOB.json OUT.json``.

The job names the GGUF file and the work: warm-up prompts, TTFT prompts, decode prompt pairs and
length, agreement prompts. The engine is built and warmed up first; only the work is timed, as in
bench/peer_worker.py: TTFT is one prompt run to its first token; decode tok/s is
``(n - 1) / (t(prompt B, n tokens) - t(prompt A, 1 token))`` for two fresh prompts of the same length,
so prefill and per-request costs cancel. Greedy; every request produces exactly its token count
(fdplug: ``ignore_eos``; llama.cpp: the loop below never looks for end of text). Prompts are token
ids, fresh each time: nothing is reused from an earlier prompt (fdplug's prefix cache sees new
tokens; llama.cpp's KV is cleared before each prompt).
"""

from __future__ import annotations

import json
import os
import sys
import time

from peer_worker import (
    seconds,  # (stdlib only at import: it loads in llama.cpp's venv too)
)


def _fdplug(model: str, kv_cache_dtype: str = "auto", op_kernels: dict | None = None):
    import fdplug
    from fdplug.plugins.cpu import isa

    llm = fdplug.LLM(model, max_model_len=2048, kv_cache_dtype=kv_cache_dtype, op_kernels=op_kernels or None)

    def generate(prompts, lengths):
        params = [fdplug.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    ops = {op: spec.name for op, spec in llm.engine.selection.ops.items()}
    info = {"level": isa.describe(), "cpu": isa.model_name(),
            "kernels": "ops " + ", ".join(f"{op}:{name}" for op, name in ops.items() if "gguf" in op)
            + "; attention " + llm.engine.selection.attention.name}
    return generate, info


def _llama_cpp(model: str):
    import llama_cpp

    llm = llama_cpp.Llama(model_path=model, n_ctx=2048, n_threads=2, n_batch=512, verbose=False)
    greedy = llama_cpp.llama_sampler_init_greedy()     # one C sampler for the run: argmax of the last logits

    def one(prompt, n):
        llm.reset()                  # n_tokens = 0: eval() then drops the whole KV cache before the prompt
        llm.eval(prompt)
        out = []
        for i in range(n):
            token = llama_cpp.llama_sampler_sample(greedy, llm.ctx, -1)
            out.append(token)
            if i + 1 < n:
                llm.eval([token])
        return out

    def generate(prompts, lengths):
        return [one(p, n) for p, n in zip(prompts, lengths)]

    system = llama_cpp.llama_print_system_info().decode(errors="replace")
    cpu_part = next((part for part in system.split(" | ") if "AVX" in part or "CPU" in part), system)
    flags = [kv.split(" = ")[0].strip() for kv in system.replace("CPU :", "|").split("|")
             if kv.strip().endswith("= 1")]
    info = {"level": "ggml built with " + (",".join(f for f in flags
                                                    if f.startswith(("AVX", "FMA", "F16C", "AMX", "BMI")))
                                           or cpu_part.strip()),
            "version": getattr(llama_cpp, "__version__", "?"), "system_info": system.strip()}
    return generate, info


ENGINES = {"fdplug": _fdplug, "llama.cpp": _llama_cpp}


def main() -> None:
    engine, job_path, out_path = sys.argv[1:4]
    with open(job_path) as f:
        job = json.load(f)
    start = time.perf_counter()
    generate, info = (_fdplug(job["model"], job.get("kv_cache_dtype", "auto"), job.get("op_kernels"))
                      if engine == "fdplug"
                      else ENGINES[engine](job["model"]))
    info["load_s"] = time.perf_counter() - start
    for prompt in job["warmup"]:      # steady state: a long prefill and a decode before anything is timed
        generate([prompt], [8])
    result = {"info": info, "ttft": [seconds(generate, [p], [1])[0] for p in job["ttft_prompts"]]}
    decode = []
    for first, full in job["decode_prompts"]:
        t_first = seconds(generate, [first], [1])[0]
        t_full, tokens = seconds(generate, [full], [job["decode_tokens"]])
        assert len(tokens[0]) == job["decode_tokens"], (len(tokens[0]), job["decode_tokens"])
        decode.append((job["decode_tokens"] - 1) / (t_full - t_first))
    result["decode_tok_s"] = decode
    result["agreement_tokens"] = seconds(generate, job["agreement_prompts"], [job["agreement_tokens"]] *
                                         len(job["agreement_prompts"]))[1]
    result["pid"] = os.getpid()
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
