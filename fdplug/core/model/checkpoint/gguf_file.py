"""A GGUF file (llama.cpp's format) as fdplug reads it: metadata, a config.json's facts, tensors by HF name.

One file holds what a Hugging Face directory spreads over several: the hyperparameters (under
``<arch>.*`` keys), the tokenizer and chat template (``tokenizer.*``, `gguf_tokenizer`) and the
weights in GGML's block formats (`fdplug.core.quant.gguf_blocks`). It is read with ``gguf``, ggml's
own reader, memory-mapped: nothing is converted on disk, and a tensor's bytes are read when the
loader copies them into the model.

The metadata becomes the ``config.json`` dict that transformers' own GGUF loader would write
(`hf_config`), so `ModelConfig.from_dict` applies the same defaults and checks as for a directory.
The tensors get their Hugging Face names (`HF_NAMES`), and the q/k rows of the Llama family get
back the order the checkpoint had: llama.cpp's converter interleaves each head's two halves
(its RoPE rotates neighbouring pairs); ours rotates halves, as transformers does (`unpermute_rows`).
Llama 3.1's RoPE scaling arrives as a tensor of per-frequency divisors (``rope_freqs``), which
becomes `RopeConfig.freq_factors`.

MoE files (``qwen2moe``, ``qwen3moe``) stack each layer's routed experts into one 3-D tensor per
projection (``ffn_gate_exps`` ``[E, I, H]``, ``ffn_up_exps``, ``ffn_down_exps`` ``[E, H, I]``), named
here ``mlp.experts.gate_proj`` etc.: the modules `moe_block.SparseMoEBlock` keeps in their blocks.
"""

from __future__ import annotations

import functools
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fdplug.errors import ModelLoadError, UnsupportedModelError
from fdplug.plugin_api.gguf_formats import format_of

SUFFIX = ".gguf"
# general.architecture -> (transformers architecture, whether llama.cpp's converter permuted q/k rows)
ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
    "qwen2moe": ("Qwen2MoeForCausalLM", False),
    "qwen3moe": ("Qwen3MoeForCausalLM", False),
}
# MoE architectures: whether llama.cpp renormalises the top-k routing weights (``build_moe_ffn``'s
# ``norm_w``, fixed per architecture in src/models/qwen*moe.cpp, not read from the file)
_NORM_TOPK = {"qwen2moe": False, "qwen3moe": True}
_LAYER_NAMES = {  # blk.{i}.<name> -> model.layers.{i}.<name>
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
    "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj", "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj", "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
_SHARED_GATE = ".mlp.shared_expert_gate.weight"
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
ROPE_FREQS = "rope_freqs.weight"
_SPLIT = re.compile(r"-\d{5}-of-\d{5}\.gguf$")
_FIX = "pass a .gguf file written by llama.cpp's convert_hf_to_gguf.py (or llama-quantize), or a directory holding one."


@dataclass(slots=True)
class GgufTensor:
    """One tensor: its HF name, GGML type, logical shape in HF order (``[rows, cols]`` for a matrix)
    and its data as the reader maps it (quantized: uint8 ``[rows, row_bytes]``)."""

    name: str
    gguf_name: str
    qtype: str
    shape: tuple[int, ...]
    data: Any = field(repr=False)


@dataclass(slots=True)
class GgufFile:
    """An opened GGUF file: ``metadata`` (key -> Python value) and ``tensors`` by HF name."""

    path: Path
    metadata: dict[str, Any] = field(repr=False)
    tensors: dict[str, GgufTensor] = field(repr=False)
    rope_freqs: tuple[float, ...] = ()    # Llama 3.1+: the divisors of RoPE's inverse frequencies

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def hf_config(self) -> dict[str, Any]:
        """The ``config.json`` dict these weights would have: what `ModelConfig.from_dict` reads."""
        return hf_config(self.metadata, self.tensors)

    def file_bytes(self) -> int:
        return self.path.stat().st_size


def gguf_path(model: str | Path | None) -> Path | None:
    """The GGUF file ``model`` names (a ``.gguf`` file, or a directory with one and no config.json),
    else None (a Hugging Face directory). A directory with several is refused by name."""
    if model is None:
        return None
    path = Path(model)
    if path.suffix == SUFFIX and not path.is_dir():
        if not path.is_file():
            raise ModelLoadError(f"GGUF file {str(path)!r} does not exist.", fix=_FIX)
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*" + SUFFIX))
    if len(found) > 1:
        raise ModelLoadError(f"{str(path)!r} holds {len(found)} GGUF files ({', '.join(p.name for p in found[:4])}).",
                             fix="pass the one to serve as --model DIR/NAME.gguf.")
    return found[0] if found else None


def open_gguf(path: str | Path) -> GgufFile:
    """Read the metadata and the tensor index of ``path`` (memory-mapped; no weight is read yet).
    Cached by path, size and modification time: startup reads the config from several places, and
    ``gguf``'s reader takes 1-2 s over a 50k-token vocabulary."""
    path = Path(path)
    stat = path.stat()
    return _open(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.cache
def _reader_class() -> type:
    """``gguf.GGUFReader`` slicing a plain ndarray view of the file's map instead of the ``np.memmap``.

    Why: the reader takes two numpy slices per string of the vocabulary and merges, and a memmap's
    slice runs its Python-level ``__getitem__`` and ``__array_finalize__``: SmolLM2's file (49,152
    tokens, 48,900 merges) took 3.2-5.5 s to open, in the API process and again in the engine's,
    1.1-1.5 s so (AMD EPYC, avx2-or-less); a 150k vocabulary three times that. The same parsing (the
    package's own), the same values (tests/test_gguf_models.py compares them), still memory-mapped:
    a tensor's ``data`` is a view of the map, read when the loader copies it."""
    from gguf import GGUFReader

    class PlainSliceReader(GGUFReader):
        @property
        def data(self) -> Any:
            return self._plain

        @data.setter
        def data(self, mapped: Any) -> None:   # set once, by GGUFReader.__init__
            self._plain = mapped.view(np.ndarray)

    return PlainSliceReader


@functools.lru_cache(maxsize=4)
def _open(name: str, size: int, mtime_ns: int) -> GgufFile:
    path = Path(name)
    if _SPLIT.search(path.name):
        raise UnsupportedModelError(f"{path.name} is one part of a split GGUF file; split files are not supported.",
                                    fix="merge the parts first: llama-gguf-split --merge FIRST_PART OUT.gguf.")
    try:
        reader = _reader_class()(str(path), "r")
        metadata = {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}
    except (ValueError, KeyError, IndexError, TypeError, OSError, struct.error) as exc:   # a damaged file
        raise ModelLoadError(f"cannot read GGUF file {str(path)!r}: {exc}.",
                             fix="download the file again; it looks truncated or is not a GGUF file.") from None
    arch = str(metadata.get("general.architecture", ""))
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(f"GGUF architecture {arch!r} ({path.name}) is not supported; supported: "
                                    f"{', '.join(ARCHITECTURES)}.", fix=_FIX)
    tensors, rope_freqs = {}, ()
    for t in reader.tensors:
        try:                                # an unsupported type is refused by name before anything loads
            format_of(t.tensor_type.name)
        except UnsupportedModelError as exc:
            raise UnsupportedModelError(f"GGUF tensor {t.name!r}: {exc.message}", fix=exc.fix) from None
        if t.name == ROPE_FREQS:            # not a weight: Llama 3.1's RoPE scaling (`RopeConfig.freq_factors`)
            rope_freqs = tuple(float(v) for v in np.asarray(t.data, dtype=np.float32).reshape(-1))
            continue
        name = hf_name(t.name)
        shape = tuple(int(n) for n in reversed(t.shape.tolist()))   # ggml lists ne0 (the row length) first
        if name.endswith(_SHARED_GATE) and len(shape) == 1:   # older converters squeezed HF's [1, H]
            shape = (1, *shape)
        tensors[name] = GgufTensor(name, t.name, t.tensor_type.name, shape, t.data)
    return GgufFile(path, metadata, tensors, rope_freqs)


def hf_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``; unknown names are refused."""
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} is a tensor no supported architecture has.", fix=_FIX)


def hf_config(md: dict[str, Any], tensors: dict[str, GgufTensor]) -> dict[str, Any]:
    """What transformers' GGUF loader makes of ``md``: the keys `ModelConfig.from_dict` reads. The
    end-of-turn and end-of-message ids (``eot``/``eom``, Llama 3's ``<|eot_id|>``) end generation
    too, as llama.cpp has them do."""
    arch = str(md.get("general.architecture"))

    def key(name: str, kind: type, default: Any = None) -> Any:
        value = md.get(f"{arch}.{name}", default)
        if value is None or isinstance(value, (bool, list, str)) or not isinstance(value, (int, float)):
            raise ModelLoadError(f"GGUF metadata {arch}.{name} is {value!r}; a number was expected.", fix=_FIX)
        return kind(value)

    heads, hidden = key("attention.head_count", int), key("embedding_length", int)
    vocab = md.get(f"{arch}.vocab_size") or (tensors["model.embed_tokens.weight"].shape[0]
                                             if "model.embed_tokens.weight" in tensors else None)
    raw: dict[str, Any] = {
        "architectures": [ARCHITECTURES[arch][0]], "model_type": arch, "hidden_act": "silu",
        "hidden_size": hidden, "intermediate_size": key("feed_forward_length", int),
        "num_hidden_layers": key("block_count", int), "num_attention_heads": heads,
        "num_key_value_heads": key("attention.head_count_kv", int, heads),
        "head_dim": key("attention.key_length", int, hidden // max(heads, 1)),
        "rms_norm_eps": key("attention.layer_norm_rms_epsilon", float),
        "rope_theta": key("rope.freq_base", float, 10000.0),
        "max_position_embeddings": key("context_length", int),
        "vocab_size": vocab if isinstance(vocab, int) else key("vocab_size", int),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "qkv_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,     # Qwen2-MoE's name for it
        "torch_dtype": "float32",
    }
    ids = {token: md.get(f"tokenizer.ggml.{token}_token_id") for token in ("bos", "eos", "eot", "eom", "padding")}
    ids = {token: value for token, value in ids.items() if isinstance(value, int) and not isinstance(value, bool)}
    raw |= {name: ids[token] for name, token in (("bos_token_id", "bos"), ("pad_token_id", "padding")) if token in ids}
    raw["eos_token_id"] = list(dict.fromkeys(ids[token] for token in ("eos", "eot", "eom") if token in ids))
    scaling = md.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raw["rope_scaling"] = {"rope_type": scaling, "factor": key("rope.scaling.factor", float)}
        if md.get(f"{arch}.rope.scaling.original_context_length"):
            raw["rope_scaling"]["original_max_position_embeddings"] = key("rope.scaling.original_context_length", int)
    rotary = key("rope.dimension_count", int, raw["head_dim"])
    if rotary != raw["head_dim"]:
        raw["partial_rotary_factor"] = rotary / raw["head_dim"]
    if arch in _NORM_TOPK:
        raw |= _moe_config(arch, key, raw["intermediate_size"])
    return raw


def _moe_config(arch: str, key: Any, ffn: int) -> dict[str, Any]:
    """The config.json keys of a Qwen MoE file (`moe_config._qwen_moe` reads them), with llama.cpp's
    defaults for absent ones (src/models/qwen*moe.cpp): an expert's width is ``feed_forward_length /
    expert_used_count``, the shared expert's ``feed_forward_length`` (Qwen2-MoE; Qwen3-MoE has none).
    Every layer is MoE (llama.cpp reads no ``mlp_only_layers``). ``norm_topk_prob`` is llama.cpp's,
    fixed per architecture: Qwen2-MoE weighs the top-k softmax scores as they are (transformers'
    default too), Qwen3-MoE renormalises them to sum 1 (its checkpoints' ``norm_topk_prob: true``)."""
    used = key("expert_used_count", int)
    out = {"num_experts": key("expert_count", int), "num_experts_per_tok": used,
           "moe_intermediate_size": key("expert_feed_forward_length", int, ffn // max(used, 1)),
           "norm_topk_prob": _NORM_TOPK[arch], "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "qwen2moe":
        out["shared_expert_intermediate_size"] = key("expert_shared_feed_forward_length", int, ffn)
    return out


def qk_permuted(arch: str) -> bool:
    """Whether llama.cpp's converter reordered the q/k rows of ``arch`` (`unpermute_rows` undoes it)."""
    return ARCHITECTURES[arch][1]


def unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's q/k permutation of ``rows`` rows in ``heads`` heads:
    the file holds each head's rows as pairs ``(j, j + D/2)`` side by side (``2j``, ``2j + 1``);
    transformers' (and our) order has the first halves first. Row ``i`` of the result is row
    ``order[i]`` of the file, for weights, biases and quantized rows alike (blocks run along a row)."""
    d = rows // heads
    pair = np.arange(d).reshape(d // 2, 2).T.reshape(d)       # [0, 2, 4, ..., 1, 3, 5, ...]
    return (np.arange(heads)[:, None] * d + pair[None, :]).reshape(rows)
