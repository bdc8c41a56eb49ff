"""One engine's timings for bench/peers.py, run in that engine's own interpreter (no fdplug import
unless the engine is fdplug): ``python bench/peer_worker.py ENGINE JOB.json OUT.json``.

The job names the model dir, the weight format and the work: TTFT prompts, a decode prompt and
length, and (optionally) the batched workload. The engine is built and warmed up first; only the
work is timed. Greedy, every request produces exactly its token count (``ignore_eos`` or its
equivalent), prompts are token ids.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _fdplug(model: str, fmt: str):
    from fdplug.core.frontend.llm import LLM
    from fdplug.plugin_api.sampling_params import SamplingParams

    dtype, quantization = {"fp32": ("float32", None), "bf16": ("bfloat16", None), "int8": ("float32", "fp8")}[fmt]
    llm = LLM(model, dtype=dtype, quantization=quantization, max_model_len=2048, max_num_seqs=64)

    def generate(prompts, lengths):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def _vllm(model: str, fmt: str):
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0-1")   # both cores (default: one)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model, dtype={"fp32": "float32", "bf16": "bfloat16"}[fmt], max_model_len=2048, max_num_seqs=64,
              skip_tokenizer_init=True, seed=0)

    def generate(prompts, lengths):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in lengths]
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    return generate


def _ctranslate2(model: str, fmt: str):
    import ctranslate2

    converted = f"{model}-ct2-{fmt}"
    if not os.path.isdir(converted):
        ctranslate2.converters.TransformersConverter(model).convert(converted,
            quantization={"int8": "int8", "fp32": "float32"}[fmt])
    generator = ctranslate2.Generator(converted, device="cpu", compute_type={"int8": "int8", "fp32": "float32"}[fmt],
                                      inter_threads=1, intra_threads=os.cpu_count() or 1)
    with open(os.path.join(converted, "vocabulary.json")) as f:
        vocabulary = json.load(f)     # the model's ids as CTranslate2's token strings (padded past the tokenizer)

    def generate(prompts, lengths):
        tokens = [[vocabulary[i] for i in p] for p in prompts]
        results = generator.generate_batch(tokens, max_length=max(lengths), min_length=max(lengths), sampling_topk=1,
                                           include_prompt_in_result=False, max_batch_size=64)
        return [r.sequences_ids[0][:n] for r, n in zip(results, lengths)]
    return generate


def _transformers(model: str, fmt: str):
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    net = AutoModelForCausalLM.from_pretrained(model, dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[fmt]).eval()

    def generate(prompts, lengths):
        out = []
        with torch.inference_mode():
            for p, n in zip(prompts, lengths):       # one at a time: only TTFT and decode are asked of it
                ids = net.generate(torch.tensor([p]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
                out.append(ids[0, len(p):].tolist())
        return out
    return generate


ENGINES = {"fdplug": _fdplug, "vllm": _vllm, "ctranslate2": _ctranslate2, "transformers": _transformers}


def seconds(generate, prompts, lengths) -> tuple[float, list]:
    start = time.perf_counter()
    tokens = generate(prompts, lengths)
    return time.perf_counter() - start, tokens


def main() -> None:
    engine, job_path, out_path = sys.argv[1:4]
    with open(job_path) as f:
        job = json.load(f)
    generate = ENGINES[engine](job["model"], job["format"])
    for prompt in job["warmup"]:      # steady state: a long prefill and a decode before anything is timed
        generate([prompt], [8])
    result = {"ttft": [seconds(generate, [p], [1])[0] for p in job["ttft_prompts"]]}
    decode = []
    for first, full in job["decode_prompts"]:
        t_first = seconds(generate, [first], [1])[0]
        t_full, tokens = seconds(generate, [full], [job["decode_tokens"]])
        decode.append((job["decode_tokens"] - 1) / (t_full - t_first))
    result["decode_tok_s"] = decode
    result["agreement_tokens"] = seconds(generate, job["agreement_prompts"], [job["agreement_tokens"]] *
                                         len(job["agreement_prompts"]))[1]
    if job.get("batch_prompts"):
        elapsed, tokens = seconds(generate, job["batch_prompts"], job["batch_lengths"])
        assert [len(t) for t in tokens] == job["batch_lengths"], "every request must produce its token count"
        result["throughput_tok_s"] = sum(job["batch_lengths"]) / elapsed
    with open(out_path, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
