"""The built-in demo model: a tiny, deterministic Qwen2 written in Hugging Face format.

Why: ``fdplug generate --model demo``, the tests and the conformance kit need a real model directory
on a machine that cannot download one. The weights are random (the text is gibberish) but the files
are exactly what a Hugging Face Qwen2 checkpoint looks like (config.json, generation_config.json,
model.safetensors, tokenizer.json, tokenizer_config.json with a ChatML template), so the same loader,
tokenizer and chat-template code paths run as for a real model.

Everything is generated from fixed seeds: two machines produce byte-identical files (for one
version of the ``tokenizers`` library, which serialises tokenizer.json). The files are written to a
temporary directory and renamed into place, so concurrent first runs never see a half-written model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
import uuid
import zlib
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from fdplug.core.config import env
from fdplug.errors import ConfigError

DEMO_VERSION = 2
DEMO_SEED = 20240601
MARKER = "fdplug-demo.json"

VOCAB_SIZE = 512  # 256 bytes + learned merges + added tokens, exactly
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2-VL's multimodal placeholder tokens: the demo takes pre-encoded image/video features.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
EXTRA_TOKENS = ("<tool_call>", "</tool_call>")  # added, not special: Qwen2's tool-call markers

# Qwen2's pre-tokenizer regex (tokenizer.json of Qwen2/Qwen2.5).
QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Qwen2.5's ChatML template with Qwen2's default system prompt.
CHATML_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

# Text the byte-level BPE merges are learned from: small, fixed, mixed (prose, code, numbers, CJK).
_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun while the fox runs into the forest.
A language model reads a sequence of tokens and predicts the next token. The model is a stack of
transformer layers: each layer has an attention block and a feed forward block, and each block is
wrapped in a residual connection with a normalization before it. The attention block lets every token
look at the tokens before it; the feed forward block transforms each token on its own.
An inference server receives requests from many users at the same time. The scheduler decides which
requests run in each step, how many tokens each one may process, and when a request must wait because
the cache is full. The cache stores the keys and the values of the attention layers in blocks, so that
the server does not compute them again for the tokens it has already seen.
Hello, world! How are you today? I am fine, thank you. What is the weather like where you are?
It is sunny and warm here, but the weather report says that it will rain in the evening.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i))

class Request:
    def __init__(self, prompt, max_tokens=16):
        self.prompt = prompt
        self.max_tokens = max_tokens
{"role": "user", "content": "Write a short poem about the sea."}
{"role": "assistant", "content": "The sea is wide, the sea is deep, the sea is where the sailors sleep."}
The numbers one, two, three, four, five, six, seven, eight, nine and ten; 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.
In the beginning there was the word, and the word was written in the book, and the book was read by
the people of the town. They read the book in the morning and in the evening, and they talked about
the story with their friends and with their families.
你好，世界！今天天气很好。我们一起去公园散步吧。语言模型是一个很有用的工具。
"""


# ---------------------------------------------------------------------------------------------------
# public entry point
# ---------------------------------------------------------------------------------------------------


def default_cache_root() -> Path:
    """``$FDPLUG_CACHE_DIR`` or ``~/.cache/fdplug``."""
    return Path(env("FDPLUG_CACHE_DIR") or "~/.cache/fdplug").expanduser()


def ensure_demo_model(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """The demo model's directory under ``cache_dir`` (default: ``default_cache_root()``), written once.

    Safe to call from several processes at once: each writes its own temporary directory and renames
    it into place; a loser of the race finds the winner's complete copy and discards its own.
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / f"demo-{DEMO_VERSION}"
    if _is_complete(target):
        return target
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
    except OSError as exc:
        raise ConfigError(f"cannot write the demo model under {root}: {exc.strerror or exc}.",
                          fix="set FDPLUG_CACHE_DIR to a writable directory.") from None
    try:
        write_demo_files(tmp)
        _publish(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _remove_stale_temps(root, target.name)
    return target


def write_demo_files(out_dir: Path, **config_overrides: Any) -> None:
    """Write every file of the demo model into ``out_dir`` (which must exist), the marker last.

    ``config_overrides`` change the model's shape or init (tests and benchmarks use them for a
    smaller, sharper, or bigger random model with the same tokenizer); the demo itself uses none.
    """
    tokenizer = build_tokenizer()
    vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = build_config(vocab_size, bos_id=ids["<|endoftext|>"], eos_id=ids["<|im_end|>"])
    config |= {"image_token_id": tokenizer.token_to_id("<|image_pad|>"),
               "video_token_id": tokenizer.token_to_id("<|video_pad|>"),
               "vision_start_token_id": tokenizer.token_to_id("<|vision_start|>"),
               "vision_end_token_id": tokenizer.token_to_id("<|vision_end|>"),
               "vision_config": {"spatial_merge_size": 2},
               "fdplug_mm_mask_policy": "bidirectional_items"} | config_overrides
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
        "pad_token_id": ids["<|endoftext|>"],
    })
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True), encoding="utf-8")
    _write_json(out_dir / "tokenizer_config.json", _tokenizer_config(tokenizer))
    _save_safetensors(build_weights(config), out_dir / "model.safetensors")
    files = sorted(p.name for p in out_dir.iterdir())
    _write_json(out_dir / MARKER, {"version": DEMO_VERSION, "files": {n: _sha256(out_dir / n) for n in files}})


# ---------------------------------------------------------------------------------------------------
# tokenizer
# ---------------------------------------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE tokens are spelled in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def build_tokenizer() -> Any:
    """A Qwen2-style byte-level BPE tokenizer of exactly ``VOCAB_SIZE`` tokens."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    byte_tokens = [ch for _, ch in sorted(bytes_to_unicode().items())]
    pieces = [piece for piece, _ in pre.pre_tokenize_str(_CORPUS)]
    n_learned = VOCAB_SIZE - 256 - len(SPECIAL_TOKENS) - len(VISION_TOKENS) - len(EXTRA_TOKENS)
    vocab, merges = _learn_bpe(byte_tokens, pieces, n_learned)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre
    tok.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS + VISION_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in EXTRA_TOKENS])
    return tok


def _learn_bpe(alphabet: list[str], pieces: list[str], n_tokens: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Plain BPE training in Python: the most frequent pair wins, ties go to the smallest pair.

    Done here rather than with ``tokenizers``' trainer so the merges depend on nothing but this code.
    """
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    words = Counter(tuple(piece) for piece in pieces)
    merges: list[tuple[str, str]] = []
    target = len(vocab) + n_tokens
    while len(vocab) < target:
        pairs: Counter[tuple[str, str]] = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            raise RuntimeError("demo corpus too small for the requested vocabulary")
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        vocab.setdefault(best[0] + best[1], len(vocab))
        words = Counter({_merge_word(w, best): c for w, c in words.items()})
    return vocab, merges


def _merge_word(word: tuple[str, ...], pair: tuple[str, str]) -> tuple[str, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def _tokenizer_config(tokenizer: Any) -> dict[str, Any]:
    added = {}
    for token in (*SPECIAL_TOKENS, *VISION_TOKENS, *EXTRA_TOKENS):
        added[str(tokenizer.token_to_id(token))] = {
            "content": token, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": token not in EXTRA_TOKENS,
        }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "chat_template": CHATML_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 4096,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ---------------------------------------------------------------------------------------------------
# config and weights
# ---------------------------------------------------------------------------------------------------


def build_config(vocab_size: int, *, bos_id: int, eos_id: int) -> dict[str, Any]:
    """Qwen2 config: big enough that decode does real work on a CPU, small enough to be instant."""
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "attention_dropout": 0.0,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "hidden_act": "silu",
        "hidden_size": 256,
        "initializer_range": 0.02,
        "intermediate_size": 512,
        "max_position_embeddings": 4096,
        "max_window_layers": 4,
        "model_type": "qwen2",
        "num_attention_heads": 8,
        "num_hidden_layers": 4,
        "num_key_value_heads": 4,
        "rms_norm_eps": 1e-6,
        "rope_scaling": None,
        "rope_theta": 10000.0,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def tensor_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face Qwen2 tensor names and shapes (Linear weights are [out, in])."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = hidden // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config["vocab_size"], hidden)}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q_dim, hidden), p + "self_attn.q_proj.bias": (q_dim,),
            p + "self_attn.k_proj.weight": (kv_dim, hidden), p + "self_attn.k_proj.bias": (kv_dim,),
            p + "self_attn.v_proj.weight": (kv_dim, hidden), p + "self_attn.v_proj.bias": (kv_dim,),
            p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
            p + "mlp.down_proj.weight": (hidden, inter),
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
        }
    shapes["model.norm.weight"] = (hidden,)
    return shapes


def build_weights(config: dict[str, Any]) -> dict[str, np.ndarray]:
    """Seeded weights, each tensor from its own stream so the values do not depend on order.

    Linear weights and embeddings are N(0, 0.02) as in HF's init. Biases and norm weights are
    perturbed away from HF's zeros and ones on purpose: a loader that drops a bias or a norm weight
    then gives different logits, so golden comparisons catch it.
    """
    std = config["initializer_range"]
    out = {}
    for name, shape in tensor_shapes(config).items():
        rng = np.random.default_rng([DEMO_SEED, zlib.crc32(name.encode())])
        noise = rng.standard_normal(shape, dtype=np.float32)
        if name.endswith("norm.weight"):
            out[name] = 1.0 + np.float32(0.1) * noise
        else:
            out[name] = np.float32(std) * noise
    return out


def _save_safetensors(tensors: dict[str, np.ndarray], path: Path) -> None:
    from safetensors.numpy import save_file

    save_file(tensors, str(path), metadata={"format": "pt"})  # "pt": transformers refuses files without it


# ---------------------------------------------------------------------------------------------------
# atomic publication and verification
# ---------------------------------------------------------------------------------------------------


def _publish(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; keep a complete ``target`` that another process already put there."""
    error: OSError | None = None
    for _ in range(5):
        try:
            os.rename(tmp, target)
            return
        except OSError as exc:
            error = exc
            if _is_complete(target):
                return
        # A broken leftover (interrupted by hand, edited): move it aside, then try again.
        aside = target.with_name(f".{target.name}.broken-{uuid.uuid4().hex}")
        try:
            os.rename(target, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside, ignore_errors=True)
    raise ConfigError(f"could not put the demo model at {target}: {error}.",
                      fix="set FDPLUG_CACHE_DIR to a writable directory, or delete the old one.")


def _remove_stale_temps(root: Path, name: str, max_age_s: float = 3600.0) -> None:
    """Temporary directories left by killed runs; an hour old means nobody is writing them."""
    now = time.time()
    for path in root.glob(f".{name}.*"):
        try:
            if now - path.stat().st_mtime > max_age_s:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _is_complete(model_dir: Path) -> bool:
    """Whether the marker exists, names this version, and every file matches its recorded hash."""
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
        files = marker["files"]
        return marker["version"] == DEMO_VERSION and bool(files) and all(
            _sha256(model_dir / name) == digest for name, digest in files.items())
    except (OSError, ValueError, KeyError, TypeError):
        return False


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False, sort_keys=False) + "\n", encoding="utf-8")
