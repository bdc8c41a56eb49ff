"""Train fdplug's demo model (``fdplug/demo/model``): a tiny Qwen2 that answers in English, under 1 MB.

Why: a random-weight model answers "Hello" with byte soup. This trains the same kind of files instead
(``fdplug.demo``'s tokenizer regex, special/vision/tool-call tokens, ChatML template and multimodal
config keys, as a Hugging Face Qwen2 directory), so every path the demo exercises still runs. The
corpus is ``pydoc_data.topics`` (the text behind ``help("if")``): every Python has it, so nothing is
downloaded or copied into the repository; parts of it are also wrapped as ChatML conversations (topic
question -> the topic's opening; greetings -> a fixed reply) so chat answers too. The model is a
standalone Paddle forward of Qwen2 (RMSNorm, RoPE, GQA with q/k/v biases, SwiGLU, tied lm_head)
trained with AdamW, stored as float16 (fdplug casts to the compute dtype). Fixed seeds: the same
Python, Paddle and ``tokenizers`` versions give the same files. From the repository root (measured:
19 min 16 s on 2 shared CPU cores, paddle 3.3.1 CPU, Python 3.11.7; final loss 0.59)::

    PYTHONPATH=. python tools/train_demo_model.py --out fdplug/demo/model
"""

from __future__ import annotations

import argparse
import math
import re
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from pydoc_data.topics import topics
from typing import Any

import numpy as np
import paddle
import paddle.nn.functional as F
from safetensors.numpy import save_file

from fdplug.demo import bpe, chatml
from fdplug.demo.chatml import EXTRA_TOKENS, SPECIAL_TOKENS, VISION_TOKENS
from fdplug.demo.publish import write_json
from fdplug.demo.random_model import build_config, tensor_shapes

SEED = 20240601
MAX_BYTES = 1_000_000  # every file of the model directory together
SYSTEM = "You are a helpful assistant."
GREETINGS = ("Hello", "Hello!", "Hi", "Hi!", "Hey", "Hello, who are you?", "Good morning", "Hi there")
GREETING_REPLY = ("Hello! I am a tiny demo model trained on the Python documentation. Ask me about a "
                  "statement such as \"if\", \"for\" or \"class\", and I will tell you what I know.")
QUESTIONS = ("What is {title}?", "Tell me about {title}.", "Explain {name}.", "{name}")


@dataclass(frozen=True)
class Shape:
    """About 430k parameters (860 kB as float16); RoPE theta and RMSNorm eps are random_model.py's."""

    vocab_size: int = 1024  # 256 bytes + learned merges + the 9 added tokens
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2


@dataclass(frozen=True)
class Schedule:
    """AdamW with linear warmup and cosine decay; sized for ~20 minutes on two CPU cores."""

    steps: int = 1600
    batch_size: int = 16
    seq_len: int = 256
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup: int = 100
    weight_decay: float = 0.1
    chat_repeats: int = 3  # each topic question/answer conversation, so chat is not drowned by prose
    greeting_repeats: int = 8


def load_topics() -> list[tuple[str, str]]:
    """``(name, text)`` per pydoc topic, sorted, without the ``****`` lines under headings."""
    underline = re.compile(r"\s*[*=~^-]+\s*")
    return [(name, "\n".join(ln for ln in topics[name].splitlines() if not underline.fullmatch(ln)).strip())
            for name in sorted(topics)]


def conversation(user: str, answer: str) -> str:
    """One conversation exactly as ``CHATML_TEMPLATE`` renders it, plus the answer and its end."""
    return (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
            f"<|im_start|>assistant\n{answer}<|im_end|>\n")


def chat_prompt(user: str) -> str:
    """What ``apply_chat_template(..., add_generation_prompt=True)`` gives for one user message."""
    return conversation(user, "").removesuffix("<|im_end|>\n")


SAMPLE_PROMPTS = (chat_prompt("Hello"), chat_prompt("Explain if."), 'The "for" statement', "A class definition")


def opening(text: str, max_chars: int = 600) -> str:
    """The topic's first paragraphs, whole, up to ``max_chars`` (at least the first one)."""
    paras, keep = text.split("\n\n"), 1
    while keep < len(paras) and len("\n\n".join(paras[:keep])) + len(paras[keep]) <= max_chars:
        keep += 1
    return "\n\n".join(paras[:keep])


def build_samples(topics: list[tuple[str, str]], sched: Schedule) -> list[str]:
    """Plain topic texts, topic Q&A conversations and greeting conversations."""
    samples = [text + "<|endoftext|>" for _, text in topics]
    for name, text in topics:
        title, answer = text.splitlines()[0], opening(text)
        samples += [conversation(q.format(title=title, name=name), answer) for q in QUESTIONS] * sched.chat_repeats
    samples += [conversation(g, GREETING_REPLY) for g in GREETINGS] * sched.greeting_repeats
    return samples


def build_tokenizer(texts: list[str], vocab_size: int) -> Any:
    """``fdplug.demo.bpe``'s tokenizer, merges learned on ``texts`` with the added tokens cut out of them
    first (so no merge is spent on pieces of ``<|im_end|>``); ``bpe.build_tokenizer`` takes one text as it is."""
    pre = bpe.pre_tokenizer()
    added = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + VISION_TOKENS + EXTRA_TOKENS))
    pieces = [piece for text in texts for part in added.split(text) for piece, _ in pre.pre_tokenize_str(part)]
    return bpe.tokenizer_from_pieces(pieces, vocab_size, pre)


def model_config(tok: Any, shape: Shape) -> dict[str, Any]:
    """config.json: the random model's Qwen2 config plus multimodal keys, at this shape, as float16."""
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS + VISION_TOKENS}
    return build_config(shape.vocab_size, bos_id=ids["<|endoftext|>"], eos_id=ids["<|im_end|>"]) | {
        "torch_dtype": "float16", "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_hidden_layers": shape.num_hidden_layers, "max_window_layers": shape.num_hidden_layers,
        "num_attention_heads": shape.num_attention_heads, "num_key_value_heads": shape.num_key_value_heads,
        "image_token_id": ids["<|image_pad|>"], "video_token_id": ids["<|video_pad|>"],
        "vision_start_token_id": ids["<|vision_start|>"], "vision_end_token_id": ids["<|vision_end|>"],
        "vision_config": {"spatial_merge_size": 2}, "fdplug_mm_mask_policy": "bidirectional_items"}


def init_params(config: dict[str, Any], seed: int) -> dict[str, Any]:
    """N(0, 0.02) weights (residual outputs scaled down by depth, as GPT-2), zero biases, unit norms."""
    out = {}
    for name, shape in tensor_shapes(config).items():
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if name.endswith(("norm.weight", ".bias")):
            value = np.full(shape, 1.0 if name.endswith("norm.weight") else 0.0, np.float32)
        else:
            residual = name.endswith(("o_proj.weight", "down_proj.weight"))
            std = 0.02 / (math.sqrt(2 * config["num_hidden_layers"]) if residual else 1)
            value = (std * rng.standard_normal(shape)).astype(np.float32)
        out[name] = paddle.create_parameter(list(shape), "float32",
                                            default_initializer=paddle.nn.initializer.Assign(value))
    return out


def rope_tables(config: dict[str, Any], seq_len: int) -> tuple[Any, Any]:
    """NeoX RoPE ``cos``/``sin`` ``[seq_len, head_dim]``, computed as fdplug's rope.py does."""
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    inv = (1.0 / config["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)).astype(np.float32)
    emb = np.tile(np.outer(np.arange(seq_len, dtype=np.float32), inv), 2)  # [freqs, freqs]
    return paddle.to_tensor(np.cos(emb)), paddle.to_tensor(np.sin(emb))


def rms_norm(x: Any, weight: Any, eps: float) -> Any:
    return weight * (x * paddle.rsqrt((x * x).mean(axis=-1, keepdim=True) + eps))


def linear(x: Any, weight: Any, bias: Any = None) -> Any:
    out = paddle.matmul(x, weight, transpose_y=True)
    return out if bias is None else out + bias


def rotate(x: Any, cos: Any, sin: Any) -> Any:
    half = x.shape[-1] // 2
    return x * cos + paddle.concat([-x[..., half:], x[..., :half]], axis=-1) * sin


def forward(p: dict[str, Any], ids: Any, config: dict[str, Any]) -> Any:
    """Qwen2ForCausalLM logits ``[B, S, vocab]`` for token ids ``[B, S]``."""
    batch, seq = ids.shape
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim, eps = config["hidden_size"] // heads, config["rms_norm_eps"]
    cos, sin = rope_tables(config, seq)
    mask = paddle.to_tensor(np.triu(np.full((seq, seq), -1e9, np.float32), 1))
    h = F.embedding(ids, p["model.embed_tokens.weight"])
    for i in range(config["num_hidden_layers"]):
        w = {k.removeprefix(f"model.layers.{i}."): v for k, v in p.items() if k.startswith(f"model.layers.{i}.")}
        x = rms_norm(h, w["input_layernorm.weight"], eps)
        q, k, v = (linear(x, w[f"self_attn.{n}_proj.weight"], w[f"self_attn.{n}_proj.bias"])
                   .reshape([batch, seq, -1, head_dim]).transpose([0, 2, 1, 3]) for n in "qkv")
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k, v = (paddle.repeat_interleave(t, heads // kv_heads, axis=1) for t in (k, v))  # q head j: kv head j // g
        scores = paddle.matmul(q, k, transpose_y=True) / math.sqrt(head_dim) + mask
        att = paddle.matmul(F.softmax(scores, axis=-1), v).transpose([0, 2, 1, 3]).reshape([batch, seq, -1])
        h = h + linear(att, w["self_attn.o_proj.weight"])
        x = rms_norm(h, w["post_attention_layernorm.weight"], eps)
        h = h + linear(F.silu(linear(x, w["mlp.gate_proj.weight"])) * linear(x, w["mlp.up_proj.weight"]),
                       w["mlp.down_proj.weight"])
    h = rms_norm(h, p["model.norm.weight"], eps)
    return paddle.matmul(h, p["model.embed_tokens.weight"], transpose_y=True)  # tied lm_head


def greedy(p: dict[str, Any], config: dict[str, Any], ids: list[int], max_tokens: int, stop: int) -> list[int]:
    """Greedy continuation (no KV cache: the prompts are short)."""
    out: list[int] = []
    with paddle.no_grad():
        for _ in range(max_tokens):
            out.append(int(forward(p, paddle.to_tensor([ids + out]), config)[0, -1].argmax()))
            if out[-1] == stop:
                break
    return out


def train(p: dict[str, Any], config: dict[str, Any], stream: np.ndarray, sched: Schedule) -> float:
    """Causal-LM training on random windows of ``stream``; returns the mean loss of the last 100 steps."""
    rng = np.random.default_rng(SEED)
    decay = [v for k, v in p.items() if not k.endswith(("norm.weight", ".bias"))]
    rest = [v for k, v in p.items() if k.endswith(("norm.weight", ".bias"))]
    opt = paddle.optimizer.AdamW(learning_rate=sched.lr, beta2=0.95, grad_clip=paddle.nn.ClipGradByGlobalNorm(1.0),
                                 parameters=[{"params": decay, "weight_decay": sched.weight_decay},
                                             {"params": rest, "weight_decay": 0.0}])
    losses, started = [], time.perf_counter()
    for step in range(sched.steps):
        progress = max(0.0, (step - sched.warmup) / max(1, sched.steps - sched.warmup))
        lr = sched.min_lr + 0.5 * (sched.lr - sched.min_lr) * (1 + math.cos(math.pi * progress))
        opt.set_lr(lr * min(1.0, (step + 1) / sched.warmup))
        starts = rng.integers(0, len(stream) - sched.seq_len - 1, sched.batch_size)
        window = paddle.to_tensor(np.stack([stream[s:s + sched.seq_len + 1] for s in starts]))
        logits = forward(p, window[:, :-1], config)
        loss = F.cross_entropy(logits.reshape([-1, config["vocab_size"]]), window[:, 1:].reshape([-1, 1]))
        loss.backward()
        opt.step()
        opt.clear_grad()
        losses.append(float(loss))
        if (step + 1) % 50 == 0 or step == 0:
            print(f"step {step + 1:5d}/{sched.steps}  loss {np.mean(losses[-50:]):.3f}  lr {opt.get_lr():.2e}  "
                  f"{time.perf_counter() - started:6.0f} s", flush=True)
    return float(np.mean(losses[-100:]))


def write_model(out: Path, tok: Any, config: dict[str, Any], p: dict[str, Any]) -> int:
    """The Hugging Face directory (files as random_model.py writes them); returns its size in bytes."""
    out.mkdir(parents=True, exist_ok=True)
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    write_json(out / "config.json", config)
    write_json(out / "generation_config.json", {"bos_token_id": eot, "eos_token_id": [im_end, eot],
                                                  "pad_token_id": eot})
    (out / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")
    write_json(out / "tokenizer_config.json", chatml.tokenizer_config(tok))  # the demo's tokens and ChatML template
    save_file({k: v.numpy().astype(np.float16) for k, v in p.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})  # "pt": transformers refuses files without it
    total = sum(f.stat().st_size for f in out.iterdir())
    if total > MAX_BYTES:
        raise SystemExit(f"model directory is {total} bytes, over the {MAX_BYTES}-byte budget: shrink Shape.")
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="model directory to write")
    parser.add_argument("--steps", type=int, default=Schedule.steps, help="training steps (a quick try: 50)")
    args = parser.parse_args()
    shape, sched = Shape(), Schedule(steps=args.steps)
    paddle.seed(SEED)
    started = time.perf_counter()
    samples = build_samples(load_topics(), sched)
    tok = build_tokenizer(list(dict.fromkeys(samples)), shape.vocab_size)
    order = np.random.default_rng(SEED).permutation(len(samples))
    stream = np.array([i for j in order for i in tok.encode(samples[j]).ids], dtype=np.int64)
    print(f"tokenizer: {shape.vocab_size} tokens, {len(samples)} samples, {len(stream)} training tokens "
          f"({time.perf_counter() - started:.0f} s)", flush=True)
    config = model_config(tok, shape)
    params = init_params(config, SEED)
    print(f"model: {sum(int(v.size) for v in params.values())} parameters, {asdict(shape)}\n{asdict(sched)}")
    final_loss = train(params, config, stream, sched)
    size = write_model(args.out, tok, config, params)
    print(f"final loss {final_loss:.3f}; wrote {args.out} ({size} bytes) in {time.perf_counter() - started:.0f} s")
    stored = {k: paddle.to_tensor(v.numpy().astype(np.float16).astype(np.float32)) for k, v in params.items()}
    for prompt in SAMPLE_PROMPTS:  # greedy, on the float16 weights as written: what fdplug will answer
        answer = greedy(stored, config, tok.encode(prompt).ids, 24, tok.token_to_id("<|im_end|>"))
        print(f"--- {prompt!r}\n -> {tok.decode(answer)!r}")


if __name__ == "__main__":
    main()
