"""Synthetic GGUF models for tests, and the float Hugging Face directory with exactly their numbers.

`write_pair` writes a tiny random decoder twice: as a GGUF file the way llama.cpp's converter
writes one (its tensor names, its metadata keys, its q/k row permutation for the Llama family, a
chosen GGML type per tensor), and as a float32 safetensors directory holding each weight's
dequantization (by ``gguf.quants``, ggml's own reference) in transformers' row order. fdplug's
safetensors path is checked against transformers by the golden fixtures, so equal logits from the
two files check the GGUF path: names, metadata, permutation, fusion of mixed types, the quantized
embedding and lm_head, and the blocks' decoding in the model.

Types ``gguf.quants`` can quantize (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, F16, BF16) get random floats
quantized; the K-quants (which it cannot write) get random blocks with finite scales.

The MoE architectures (``qwen2moe``, ``qwen3moe``) are written as llama.cpp's converter writes them:
every layer MoE, the router ``ffn_gate_inp`` in F32, each projection's experts stacked into one 3-D
tensor of one type (``ffn_gate_exps`` ``[E, I, H]``...), Qwen2-MoE's shared expert (``*_shexp``) and
its gate ``ffn_gate_inp_shexp`` (``[1, H]``, or ``[H]`` as converters before 2025 squeezed it); the
float twin holds the experts one by one, as a Hugging Face checkpoint does.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# HF module in a layer -> llama.cpp's. Written out from llama.cpp's tensor_mapping.py on purpose, not
# derived from `gguf_file._LAYER_NAMES` (its inverse): a writer that took the reader's table would
# hide a wrong name in it.
LLAMA_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps", "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps", "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp", "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
}
_SCALES_AT = {"Q4_K": (0, 4), "Q5_K": (0, 4), "Q6_K": (208, 210), "Q2_K": (80, 84), "Q3_K": (108, 110)}
ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
         "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}
_FLOAT_ONLY = (".mlp.gate",)   # llama.cpp's converter and llama-quantize keep the router F32


def random_blocks(rng: np.random.Generator, qtype: str, rows: int, cols: int) -> np.ndarray:
    """``[rows, row_bytes]`` uint8 GGML blocks of ``qtype`` with values of order 0.1."""
    import gguf

    kind = gguf.GGMLQuantizationType[qtype]
    if qtype in _SCALES_AT:   # random quants, sane f16 super-block scales
        block, nbytes = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (rows, cols // block, nbytes), dtype=np.uint8)
        lo, hi = _SCALES_AT[qtype]
        scales = (rng.uniform(0.2, 1.0, (rows, cols // block, (hi - lo) // 2)) * 2e-3).astype(np.float16)
        raw[..., lo:hi] = scales.view(np.uint8)
        return raw.reshape(rows, -1)
    floats = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
    if qtype == "F32":
        return floats.view(np.uint8)
    return gguf.quants.quantize(floats, kind).reshape(rows, -1)


def dequantized(raw: np.ndarray, qtype: str, cols: int) -> np.ndarray:
    import gguf

    if qtype == "F32":
        return raw.view(np.float32).reshape(-1, cols)
    return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype]).reshape(-1, cols).astype(np.float32)


def permute_rows(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's q/k permutation as a row order (file row ``i`` = HF row ``order[i]``)."""
    d = rows // heads
    pair = np.arange(d).reshape(2, d // 2).T.reshape(d)     # [0, d/2, 1, d/2 + 1, ...]
    return (np.arange(heads)[:, None] * d + pair[None, :]).reshape(rows)


def write_pair(out: Path, arch: str = "llama", *, types: dict[str, str], default: str = "Q8_0", hidden: int = 256,
               inter: int = 512, layers: int = 2, heads: int = 4, kv_heads: int = 2, vocab: int = 300,
               tied: bool = True, seed: int = 0, llama3: dict | None = None,
               tokenizer: bool = False, experts: int = 4, top_k: int = 2, expert_inter: int = 256,
               shared_inter: int = 512, squeezed_gate: bool = False) -> tuple[Path, Path]:
    """``(gguf file, float HF dir)`` under ``out``. ``types``: GGML type by HF module name, with
    ``*`` for "any layer" (``model.layers.*.self_attn.v_proj``); others get ``default``. ``llama3``:
    Llama 3.1's RoPE scaling (``factor``, ``low_freq_factor``, ``high_freq_factor``,
    ``original_max_position_embeddings``), in the file as llama.cpp's ``rope_freqs`` tensor.
    ``tokenizer``: the file gets a byte-level SentencePiece vocabulary (`byte_vocab`), so that
    ``fdplug.LLM`` and ``fdplug serve`` take it (the float directory has none). MoE: ``experts`` of
    width ``expert_inter``, ``top_k`` per token, (qwen2moe) a shared expert of width ``shared_inter``
    whose gate is 1-D when ``squeezed_gate``; the stacks' types are ``types``' ``mlp.experts.<proj>``."""
    import gguf
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    d = hidden // heads
    writer = gguf.GGUFWriter(str(out / f"tiny-{arch}.gguf"), arch)
    for key, value in (("block_count", layers), ("context_length", 512), ("embedding_length", hidden),
                       ("feed_forward_length", inter), ("attention.head_count", heads),
                       ("attention.head_count_kv", kv_heads), ("attention.key_length", d),
                       ("rope.freq_base", 10000.0), ("attention.layer_norm_rms_epsilon", 1e-6)):
        (writer.add_float32 if isinstance(value, float) else writer.add_uint32)(f"{arch}.{key}", value)
    moe = arch.endswith("moe")
    if moe:
        for key, value in (("expert_count", experts), ("expert_used_count", top_k),
                           ("expert_feed_forward_length", expert_inter)):
            writer.add_uint32(f"{arch}.{key}", value)
        if arch == "qwen2moe":
            writer.add_uint32(f"{arch}.expert_shared_feed_forward_length", shared_inter)
    if tokenizer:
        byte_vocab(writer, vocab)
    floats: dict[str, np.ndarray] = {}
    shapes = {"model.embed_tokens": (vocab, hidden), "model.norm": (hidden,)}
    if not tied:
        shapes["lm_head"] = (vocab, hidden)
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm": (hidden,), p + "post_attention_layernorm": (hidden,),
                   p + "self_attn.q_proj": (heads * d, hidden), p + "self_attn.k_proj": (kv_heads * d, hidden),
                   p + "self_attn.v_proj": (kv_heads * d, hidden), p + "self_attn.o_proj": (hidden, heads * d)}
        shapes |= _moe_shapes(arch, p, hidden, experts, expert_inter, shared_inter) if moe else {
            p + "mlp.gate_proj": (inter, hidden), p + "mlp.up_proj": (inter, hidden),
            p + "mlp.down_proj": (hidden, inter)}
        if arch in ("qwen3", "qwen3moe"):
            shapes |= {p + "self_attn.q_norm": (d,), p + "self_attn.k_norm": (d,)}
    for module, shape in shapes.items():
        gguf_name = _gguf_name(module)
        if len(shape) == 1:   # norms: F32, near 1
            value = (1 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
            writer.add_tensor(gguf_name + ".weight", value)
            floats[module + ".weight"] = value
            continue
        squeezed = squeezed_gate and module.endswith("shared_expert_gate")   # 1-D: F32, as the converter did
        qtype = ("F32" if squeezed or module.endswith(_FLOAT_ONLY)
                 else types.get(module) or types.get(_wildcard(module)) or default)
        raw = random_blocks(rng, qtype, int(np.prod(shape[:-1])), shape[-1])
        stored = (shape[-1],) if squeezed else shape
        writer.add_tensor(gguf_name + ".weight", raw.reshape(*stored[:-1], -1),
                          raw_dtype=gguf.GGMLQuantizationType[qtype])
        value = dequantized(raw, qtype, shape[-1]).reshape(shape)
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):   # the file holds permuted rows
            n_heads = heads if module.endswith("q_proj") else kv_heads
            value = value[np.argsort(permute_rows(shape[0], n_heads))]
        if len(shape) == 3:   # a Hugging Face checkpoint holds the experts one by one
            floats |= {module.replace(".experts.", f".experts.{x}.") + ".weight": value[x] for x in range(shape[0])}
            continue
        floats[module + ".weight"] = value
        if arch in ("qwen2", "qwen2moe") and module.endswith(("q_proj", "k_proj", "v_proj")):
            bias = (0.1 * rng.standard_normal(shape[0])).astype(np.float32)
            writer.add_tensor(gguf_name + ".bias", bias)
            floats[module + ".bias"] = bias
    if llama3:
        writer.add_tensor("rope_freqs.weight", rope_freqs(llama3, 10000.0, d))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ref = out / f"tiny-{arch}-float"
    ref.mkdir()
    save_file(floats, str(ref / "model.safetensors"), metadata={"format": "pt"})
    config = {"architectures": [ARCHS[arch]], "model_type": arch, "hidden_size": hidden, "intermediate_size": inter,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "head_dim": d, "rms_norm_eps": float(np.float32(1e-6)), "rope_theta": 10000.0,
              "max_position_embeddings": 512, "vocab_size": vocab, "tie_word_embeddings": tied,
              "torch_dtype": "float32", "hidden_act": "silu"}
    if llama3:
        config["rope_scaling"] = {"rope_type": "llama3", **llama3}
    if moe:   # the routing llama.cpp applies (`gguf_file._moe_config`)
        config |= {"num_experts": experts, "num_experts_per_tok": top_k, "moe_intermediate_size": expert_inter,
                   "norm_topk_prob": arch == "qwen3moe", "decoder_sparse_step": 1, "mlp_only_layers": []}
        config["shared_expert_intermediate_size"] = shared_inter if arch == "qwen2moe" else 0
    (ref / "config.json").write_text(json.dumps(config))
    return out / f"tiny-{arch}.gguf", ref


def _moe_shapes(arch: str, p: str, hidden: int, experts: int, width: int, shared: int) -> dict[str, tuple]:
    """A MoE layer's weights by HF module (the experts stacked, as the GGUF file holds them)."""
    out = {p + "mlp.gate": (experts, hidden), p + "mlp.experts.gate_proj": (experts, width, hidden),
           p + "mlp.experts.up_proj": (experts, width, hidden), p + "mlp.experts.down_proj": (experts, hidden, width)}
    if arch == "qwen2moe":
        out |= {p + "mlp.shared_expert.gate_proj": (shared, hidden), p + "mlp.shared_expert.up_proj": (shared, hidden),
                p + "mlp.shared_expert.down_proj": (hidden, shared), p + "mlp.shared_expert_gate": (1, hidden)}
    return out


def byte_vocab(writer, vocab: int) -> None:
    """A ``llama`` (SentencePiece) vocabulary of ``vocab`` tokens: <unk> <s> </s>, the 256 byte tokens,
    then plain tokens ``t0``, ``t1``...: every text encodes (as bytes), every id decodes."""
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    types = [2, 3, 3] + [6] * 256               # UNKNOWN, CONTROL, BYTE
    tokens += [f"t{i}" for i in range(vocab - len(tokens))]
    types += [1] * (vocab - len(types))         # NORMAL
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)


def rope_freqs(llama3: dict, theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py for Llama 3.1: one divisor per inverse frequency."""
    old = llama3["original_max_position_embeddings"]
    low, high = old / llama3["low_freq_factor"], old / llama3["high_freq_factor"]
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * np.pi / freq
        if wavelen < high:
            factors.append(1.0)
        elif wavelen > low:
            factors.append(llama3["factor"])
        else:
            smooth = ((old / wavelen - llama3["low_freq_factor"])
                      / (llama3["high_freq_factor"] - llama3["low_freq_factor"]))
            factors.append(1 / ((1 - smooth) / llama3["factor"] + smooth))
    return np.asarray(factors, dtype=np.float32)


def _gguf_name(module: str) -> str:
    globals_ = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    if module in globals_:
        return globals_[module]
    _, _, index, rest = module.split(".", 3)
    return f"blk.{index}.{LLAMA_NAMES[rest]}"


def _wildcard(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2] + ["*"] + parts[3:]) if len(parts) > 3 and parts[1] == "layers" else module
