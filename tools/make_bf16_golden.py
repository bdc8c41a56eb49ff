"""transformers' greedy tokens in bf16 for the golden fixtures stored in bf16: the bf16-math reference.

Needs torch and transformers (dev only)::

    pip install torch transformers
    python tools/make_golden.py                # the fixtures themselves (float32 logits)
    python tools/make_bf16_golden.py           # writes tests/fixtures/golden/<name>/bf16_greedy.json

transformers computes a model loaded with ``dtype=torch.bfloat16`` in bf16 throughout (every
activation, norm, softmax input and residual rounded to bf16, as vLLM's bf16 does); fdplug's bf16
math rounds only the linear layers' inputs and keeps float32 elsewhere. The two are not bit-exact,
so the file records transformers' tokens and the smallest top-1/top-2 logit gap of its greedy
steps, and tests/test_bf16_math.py states how far fdplug must agree with them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, GenerationConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_golden import OUT, SEQUENCES

NEW_TOKENS = 24


def bf16_greedy(path: Path) -> dict:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager",
                                                 experts_implementation="eager").eval()
    model.generation_config.eos_token_id = None
    runs, gaps = [], []
    with torch.no_grad():
        for seq in SEQUENCES:
            gen = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=NEW_TOKENS, pad_token_id=0,
                                   output_logits=True, return_dict_in_generate=True)
            out = model.generate(torch.tensor([seq]), generation_config=gen)
            tokens = out.sequences[0, len(seq):].tolist()
            steps = torch.cat(out.logits).float()
            top2 = steps.topk(2, dim=-1).values
            gaps.append((top2[:, 0] - top2[:, 1]).tolist())
            runs.append({"prompt": seq, "tokens": tokens})
    return {"torch": torch.__version__, "transformers": transformers.__version__, "dtype": "bfloat16",
            "greedy": runs, "logit_gaps": [[round(g, 5) for g in run] for run in gaps]}


def main() -> None:
    torch.use_deterministic_algorithms(True)
    for fixture in sorted(p for p in OUT.iterdir() if (p / "golden.json").is_file()):
        meta = json.loads((fixture / "golden.json").read_text())
        if meta.get("storage_dtype") != "bfloat16":
            continue
        (fixture / "bf16_greedy.json").write_text(json.dumps(bf16_greedy(fixture)) + "\n")
        print(f"{fixture.name:20s} bf16_greedy.json")


if __name__ == "__main__":
    main()
