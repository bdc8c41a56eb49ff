"""transformers' reference for a real GGUF model: tokens, chat prompt, greedy runs, perplexity, logits.

Needs torch, transformers and gguf (dev only, never a runtime or CI dependency)::

    pip install torch "transformers>=5" gguf accelerate
    python tools/make_gguf_golden.py --gguf PATH --out tests/fixtures/gguf/smollm2_q4_1.json

fdplug loads GGUF files itself (no torch); CI has no torch either, so it cannot ask transformers what a
GGUF file means. This tool asks once, on a developer's machine, and writes the answers to one small
JSON file that CI's tests compare fdplug against:

- ``tokenize``: transformers' GGUF tokenizer (built from the file's ``tokenizer.ggml.*`` metadata) on
  texts chosen to expose pre-tokenizer differences (spaces, newlines, digits, contractions,
  punctuation runs, code, CJK, emoji, special-token text, NBSP, a very long word), without special
  tokens; ``tokenize_special`` shows what ``add_special_tokens=True`` adds (the BOS behaviour). Where
  the file names a pre-tokenizer transformers does not apply (SmolLM2's ``smollm``: digits split one
  by one), ``ids_file_pre`` also gives that pre-tokenizer's ids on the texts where the two differ.
- ``specials``: the bos/eos/unk/pad tokens the tokenizer reports, and the generation config's eos.
- ``chat``: the file's chat template rendered (``add_generation_prompt=True``), its ids as a server
  tokenizes the rendered text (no special tokens added), and transformers' greedy reply (stops at eos).
- ``greedy``: plain prompts with exactly ``GREEDY_TOKENS`` greedy tokens (eos disabled), and per step
  the top-1/top-2 logit gap, whose minimum says whether float noise could flip a token.
- ``perplexity``: mean NLL (float64) over ``PPL_TOKENS`` ids of a stdlib text, one forward pass.
- ``logits``: the top-20 (id, logit) of the first greedy prompt's last position.

The weights are transformers' dequantization of the file to float32 ("transformers' dequantized
reference"): bit-identical to ``gguf.dequantize`` for Q8_0/Q4_1/F32 (checked when this was written),
so a loader that dequantizes exactly and computes in float32 should give these tokens. The model runs
in float32 with eager attention on copied (aligned) tensors, as tools/make_golden.py does. The output
is deterministic for a given file, torch/transformers version and CPU, all of which it records.

Use transformers 5.x (made with 5.18.0): 4.57.6's GGUF tokenizer gets this file's specials wrong (it
reports eos = ``<|im_start|>`` and prepends it as BOS although the file says ``add_bos_token = false``).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import platform
import subprocess
from pathlib import Path

import gguf
import torch
import transformers
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

GREEDY_TOKENS = 32
CHAT_TOKENS = 24
PPL_TOKENS = 512
PPL_TOPIC = "assignment"           # a pydoc_data.topics key present in Python 3.10-3.13
PPL_CHARS = 2500                   # stored text prefix; its tokens must reach PPL_TOKENS
TOP_LOGITS = 20

# Each text aims at one place where a tokenizer reimplementation tends to differ from transformers.
TEXTS = [
    "Hello, world! This is a plain English sentence.",
    " leading space",
    "trailing space ",
    "multiple   spaces    between  words",
    "   ",
    "tab\tseparated\tvalues\t\tand a double tab",
    "line one\nline two\n\nline four after a blank line",
    "windows\r\nline\r\nendings\r\n",
    "\n\n\nthree newlines first",
    "The number 1234567 and 3.14159 and 2026-11-26, also 1,000,000 and 0x1F.",
    "don't won't I'LL we've she's they're I'm he'd DON'T",
    "Wait... what?!?! (yes) [no] {maybe} --- *** ### !!! ??? ;;; ::",
    "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n    if a > b:\n        return a + b\n    return b + a\n",
    "café résumé naïve Ünïcödé façade",
    "中文分词测试：你好，世界。",
    "日本語のテキストです。カタカナとひらがな。",
    "party 🎉 family 👨‍👩‍👧‍👦 flag 🇫🇷 thumbs 👍🏽 heart ❤️",
    "<|im_start|>user\nhi<|im_end|>",
    "<|endoftext|>text after the end token<|im_end|>\n",
    "non\u00a0breaking\u00a0space and a\u00a0\u00a0double",
    "Pneumonoultramicroscopicsilicovolcanoconiosis" + "supercalifragilisticexpialidocious" * 3,
    "https://example.com/path?query=1&other=two#frag user@example.org",
    "MixedCASE camelCaseWord snake_case_word SCREAMING_SNAKE kebab-case-word",
    "  \n  \t mixed whitespace \t\n  ",
    "Ω≈ç√∫ µ≤≥÷ ¡™£¢∞§¶•ªº – — “quotes” ‘single’ … ½ ²",
    "non-ASCII numerals after a space: ½ x² ٣١٢ ① Ⅻ ７",
    "",
]
SPECIAL_TEXT = "Hello world"

# The pre-tokenizers the file's ``tokenizer.ggml.pre`` names but transformers' GGUF tokenizer does not
# apply (it falls back to GPT-2's byte-level split): the split the model's own tokenizer.json (and
# llama.cpp) uses. For "smollm" that is every \p{N} character on its own, then GPT-2's regex.
UNAPPLIED_PRE = {"smollm": lambda: pre_tokenizers.Sequence([
    pre_tokenizers.Digits(individual_digits=True),
    pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])}

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a terse assistant. Answer in one short sentence."},
     {"role": "user", "content": "Name a primary color."},
     {"role": "assistant", "content": "Red."},
     {"role": "user", "content": "Name another one."}],
]
PROMPTS = ["The quick brown fox", "def fibonacci(n):", "Once upon a time"]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cpu_model() -> str:
    """``lscpu``'s model name: CPU kernels can move float32 logits in the last bits."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def load(path: Path) -> tuple[torch.nn.Module, transformers.PreTrainedTokenizerBase]:
    """The file through transformers: float32 dequantized weights, eager attention, aligned copies."""
    model, info = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                       attn_implementation="eager", output_loading_info=True)
    assert not any(info.get(k) for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    with torch.no_grad():
        for t in [*model.parameters(), *model.buffers()]:
            t.data = t.data.clone()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def gguf_metadata(path: Path) -> dict:
    """The file's own tokenizer settings, to set beside what transformers made of them."""
    reader = gguf.GGUFReader(path)
    keys = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.ggml.add_bos_token",
            "tokenizer.ggml.add_eos_token", "tokenizer.ggml.add_space_prefix", "tokenizer.ggml.bos_token_id",
            "tokenizer.ggml.eos_token_id", "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id")
    return {k: reader.fields[k].contents() for k in keys if k in reader.fields}


def tokenize(tok, texts: list[str], pre: str | None) -> tuple[list[dict], str | None]:
    """Each text's ids; where the file's pre-tokenizer is one transformers does not apply, also the ids
    that pre-tokenizer gives (``ids_file_pre``), on the texts where the two differ."""
    entries = [{"text": t, "ids": tok(t, add_special_tokens=False).input_ids} for t in texts]
    if pre not in UNAPPLIED_PRE:
        return entries, None
    backend = copy.deepcopy(tok.backend_tokenizer)
    backend.pre_tokenizer = UNAPPLIED_PRE[pre]()
    for entry in entries:
        ids = backend.encode(entry["text"], add_special_tokens=False).ids
        if ids != entry["ids"]:
            entry["ids_file_pre"] = ids
    note = (f"transformers {transformers.__version__} ignores tokenizer.ggml.pre={pre!r} and splits with GPT-2's "
            "byte-level regex; 'ids_file_pre' (only where they differ) are the ids with that pre-tokenizer "
            "(each \\p{N} char split off first, as the model's tokenizer.json and llama.cpp do). "
            "'ids' is the reference.")
    return entries, note


def gaps(steps: torch.Tensor) -> list[float]:
    top2 = steps.float().topk(2, dim=-1).values
    return [round(g, 5) for g in (top2[:, 0] - top2[:, 1]).tolist()]


def greedy(model: torch.nn.Module, ids: list[int], new_tokens: int, eos: int | list[int] | None) -> dict:
    """transformers' greedy continuation (stopping at ``eos`` unless None) and each step's logit gap."""
    model.generation_config.eos_token_id = eos        # (None in the call would mean "the model's")
    gen = GenerationConfig(do_sample=False, num_beams=1, max_new_tokens=new_tokens, eos_token_id=eos,
                           pad_token_id=model.generation_config.pad_token_id, output_logits=True,
                           return_dict_in_generate=True)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             generation_config=gen)
    tokens = out.sequences[0, len(ids):].tolist()
    steps = torch.cat(out.logits)
    assert steps.argmax(-1).tolist() == tokens, "not plain greedy"
    assert eos is not None or len(tokens) == new_tokens
    step_gaps = gaps(steps)
    return {"tokens": tokens, "gaps": step_gaps, "min_gap": min(step_gaps)}


def first_eos(tokens: list[int], eos_ids: list[int]) -> int | None:
    return next((i for i, t in enumerate(tokens) if t in eos_ids), None)


def perplexity(model: torch.nn.Module, tokenizer) -> dict:
    """Mean NLL of ids[1:] given their prefixes, one forward pass, log-softmax in float64.

    The text is tokenized as the tokenizer does by default (``add_special_tokens=True``), so a BOS is
    in the ids exactly when the tokenizer adds one; ``bos_added`` says which.
    """
    from pydoc_data.topics import topics

    text = topics[PPL_TOPIC][:PPL_CHARS]
    all_ids = tokenizer(text, add_special_tokens=True).input_ids
    bos_added = all_ids != tokenizer(text, add_special_tokens=False).input_ids and all_ids[0] == tokenizer.bos_token_id
    assert len(all_ids) >= PPL_TOKENS + 8, f"{PPL_CHARS} chars give only {len(all_ids)} tokens"
    ids = all_ids[:PPL_TOKENS]
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    nll = -logp.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).mean().item()
    return {"source": f"pydoc_data.topics.topics[{PPL_TOPIC!r}][:{PPL_CHARS}] (Python {platform.python_version()})",
            "text": text, "ids": ids, "n_tokens": len(ids), "n_predicted": len(ids) - 1,
            "bos_added": bos_added, "nll": nll, "ppl": math.exp(nll)}


def build(path: Path) -> dict:
    torch.manual_seed(0)
    model, tok = load(path)
    meta = gguf_metadata(path)
    entries, tokenize_note = tokenize(tok, TEXTS, meta.get("tokenizer.ggml.pre"))
    gen_eos = model.generation_config.eos_token_id
    gen_eos_ids = [] if gen_eos is None else [gen_eos] if isinstance(gen_eos, int) else list(gen_eos)

    special = tok(SPECIAL_TEXT, add_special_tokens=True).input_ids
    plain = tok(SPECIAL_TEXT, add_special_tokens=False).input_ids
    added = [t for t in special if t not in plain] if len(special) != len(plain) else []
    tokenize_special = {"text": SPECIAL_TEXT, "ids": special, "ids_without_specials": plain,
                        "bos_prepended": bool(special and special[0] == tok.bos_token_id and special != plain),
                        "eos_appended": bool(special and special[-1] == tok.eos_token_id and special != plain),
                        "added_ids": added}

    specials = {name: {"text": getattr(tok, f"{name}_token"), "id": getattr(tok, f"{name}_token_id")}
                for name in ("bos", "eos", "unk", "pad")}
    specials["eos_token_id"] = tok.eos_token_id
    specials["add_bos_token"] = getattr(tok, "add_bos_token", None)
    specials["config"] = {k: getattr(model.config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    specials["generation_config_eos"] = gen_eos_ids

    chats = []
    for messages in CHATS:
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, add_special_tokens=False).input_ids
        run = greedy(model, ids, CHAT_TOKENS, gen_eos_ids or None)
        chats.append({"messages": messages, "prompt": prompt, "ids": ids, **run,
                      "stopped_at_eos": first_eos(run["tokens"], gen_eos_ids) is not None,
                      "text": tok.decode(run["tokens"], skip_special_tokens=True)})

    runs = []
    for text in PROMPTS:
        ids = tok(text, add_special_tokens=False).input_ids
        run = greedy(model, ids, GREEDY_TOKENS, None)
        runs.append({"prompt": text, "ids": ids, **run, "first_eos": first_eos(run["tokens"], gen_eos_ids),
                     "text": tok.decode(run["tokens"], skip_special_tokens=False)})

    with torch.no_grad():
        last = model(torch.tensor([runs[0]["ids"]])).logits[0, -1].float()
    top = last.topk(TOP_LOGITS)
    logits = {"prompt": PROMPTS[0], "ids": runs[0]["ids"], "position": len(runs[0]["ids"]) - 1,
              "top": [[i, v] for i, v in zip(top.indices.tolist(), top.values.tolist())]}
    assert logits["top"][0][0] == runs[0]["tokens"][0]

    return {
        "file": path.name,
        "sha256": sha256(path),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "gguf": getattr(gguf, "__version__", None) or _dist_version("gguf"),
                     "python": platform.python_version()},
        "cpu": cpu_model(),
        "reference": "transformers from_pretrained(gguf_file=...) dequantized to float32, eager attention",
        "gguf_tokenizer_metadata": meta,
        "tokenize_note": tokenize_note,
        "tokenize": entries,
        "tokenize_special": tokenize_special,
        "specials": specials,
        "chat": chats,
        "greedy": runs,
        "perplexity": perplexity(model, tok),
        "logits": logits,
    }


def _dist_version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def dumps(obj: object, indent: int = 0) -> str:
    """JSON with one key per line but every list of scalars on one line: small and diffable."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict):
        if not obj:
            return "{}"
        items = [f"{inner}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and any(isinstance(v, dict) for v in obj):
        return "[\n" + ",\n".join(inner + dumps(v, indent + 1) for v in obj) + "\n" + pad + "]"
    return json.dumps(obj, ensure_ascii=False)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--gguf", type=Path, required=True, help="the .gguf file")
    parser.add_argument("--out", type=Path, required=True, help="the JSON file to write")
    args = parser.parse_args()

    data = build(args.gguf.resolve())
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(dumps(data) + "\n", encoding="utf-8")

    print(f"{args.out}: {args.out.stat().st_size} bytes, "
          f"transformers {transformers.__version__}, torch {torch.__version__}")
    print(f"specials: {data['specials']}; add_special_tokens=True adds {data['tokenize_special']['added_ids']}")
    split = [e["text"] for e in data["tokenize"] if "ids_file_pre" in e]
    print(f"tokenize: {len(data['tokenize'])} texts; {len(split)} differ under the file's own pre-tokenizer: {split}")
    for run in data["chat"]:
        print(f"chat  min_gap {run['min_gap']:8.5f}  {len(run['tokens'])} tokens  {run['text']!r}")
    for run in data["greedy"]:
        print(f"greedy min_gap {run['min_gap']:8.5f}  {run['prompt']!r} -> {run['text']!r}")
    ppl = data["perplexity"]
    print(f"perplexity: nll {ppl['nll']:.6f}  ppl {ppl['ppl']:.4f} over {ppl['n_tokens']} tokens")


if __name__ == "__main__":
    main()
