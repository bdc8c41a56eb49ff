"""Loading a Hugging Face safetensors checkpoint into ``DecoderForCausalLM``.

Every checkpoint tensor has exactly one *slot*: the Paddle parameter it lands in, the shape it must
have, and how it gets there (HF ``nn.Linear`` weights are ``[out, in]``, ours ``[in, out]``; q/k/v
and gate/up are fused, so several tensors share one parameter). Shapes are checked from the
safetensors header before any data is read, so a wrong checkpoint fails fast with the tensor's name
and both shapes. Tensors are read with ``framework="paddle"`` (bf16 is not a numpy dtype; measured
on paddle 3.3.1), cast to the compute dtype on the host, fused and transposed once per parameter,
and assigned to the device once.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import paddle

from fdplug.core.model.config import _DIR_FIX, ModelConfig
from fdplug.core.model.decoder import DecoderForCausalLM
from fdplug.core.portable.ops import PORTABLE
from fdplug.errors import ModelLoadError, WeightMismatchError
from fdplug.plugin_api.ops import Kernels

logger = logging.getLogger("fdplug")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that no architecture here uses: old Llama exports' RoPE buffers and
# ERNIE-4.5's multi-token-prediction head (transformers ignores "mtp" tensors too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_IGNORED_SUBSTRING = "mtp"


@dataclass(frozen=True, slots=True)
class Slot:
    """Where one checkpoint tensor goes.

    ``kind``: ``copy`` (same layout), ``linear`` (HF ``[out, in]`` -> columns ``start:stop`` of an
    ``[in, out]`` parameter), ``vec`` (a bias -> entries ``start:stop``), ``heads`` (one per-head
    norm weight ``[D]`` -> rows ``start:stop`` of a ``[heads, D]`` parameter). ``permute`` applies the
    interleaved->NeoX RoPE permutation to each head's dimensions (ERNIE-4.5 q and k). A parameter
    fed by several slots is assembled when its last piece arrives, whichever shard holds it.
    """

    param: str
    shape: tuple[int, ...]
    kind: str = "copy"
    start: int = 0
    stop: int = 0
    permute: bool = False


def load_model(model_dir: str | Path, attn_backend: Any, dtype: str = "float32", *,
               max_positions: int | None = None, show_progress: bool = True,
               kernels: Kernels = PORTABLE) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Build the decoder for ``model_dir``'s config and fill it from its safetensors files.

    ``dtype`` is the compute dtype (float32 on CPU); checkpoint tensors are cast to it.
    ``max_positions`` sizes the RoPE tables (default: the config's ``max_position_embeddings``).
    """
    started = time.perf_counter()
    cfg = ModelConfig.from_dir(model_dir)
    files = weight_files(model_dir)
    model = DecoderForCausalLM(cfg, attn_backend, dtype=dtype, max_positions=max_positions, kernels=kernels)
    load_weights(model, cfg, files, show_progress=show_progress)
    logger.info("loaded %s (%s, %d layers) from %d file(s) as %s in %.1f s", model_dir, cfg.architecture,
                cfg.num_layers, len(files), dtype, time.perf_counter() - started)
    return model, cfg


def weight_files(model_dir: str | Path) -> list[Path]:
    """The checkpoint's safetensors files: the index's shards, ``model.safetensors``, or ``*.safetensors``."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"cannot read {str(index)!r}: {exc!r}.",
                                 fix=f"restore {INDEX_FILE} from the original checkpoint.") from None
        files = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"weight shard {str(path)!r} listed in {INDEX_FILE} is missing.",
                                     fix="download the checkpoint again; every shard must be present.")
        return files
    if (model_dir / SINGLE_FILE).is_file():
        return [model_dir / SINGLE_FILE]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    other = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pdparams"))
    hint = f" (found {', '.join(other[:3])}: only safetensors are read)" if other else ""
    raise ModelLoadError(f"no weights in {str(model_dir)!r}: expected {SINGLE_FILE} or {INDEX_FILE}{hint}.",
                         fix=_DIR_FIX + " Convert .bin/.pdparams checkpoints to safetensors first.")


def weight_slots(cfg: ModelConfig) -> dict[str, Slot]:
    """HF tensor name -> slot, for every tensor the checkpoint must hold."""
    hid, inter, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    slots = {"model.embed_tokens.weight": Slot("embed_tokens", (cfg.vocab_size, hid)),
             "model.norm.weight": Slot("norm.weight", (hid,))}
    if not cfg.tie_word_embeddings:
        slots["lm_head.weight"] = Slot("lm_head", (cfg.vocab_size, hid))
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        slots[src + "input_layernorm.weight"] = Slot(dst + "input_layernorm.weight", (hid,))
        slots[src + "post_attention_layernorm.weight"] = Slot(dst + "post_attention_layernorm.weight", (hid,))
        offset = 0
        for name, n in (("q", heads), ("k", kv), ("v", kv)):
            rows = (offset * d, (offset + n) * d)
            permute = cfg.rope.interleaved and name != "v"
            slots[src + f"self_attn.{name}_proj.weight"] = Slot(dst + "self_attn.qkv_proj.weight", (n * d, hid),
                                                                "linear", *rows, permute)
            if cfg.attention_bias:
                slots[src + f"self_attn.{name}_proj.bias"] = Slot(dst + "self_attn.qkv_proj.bias", (n * d,),
                                                                  "vec", *rows, permute)
            offset += n
        slots[src + "self_attn.o_proj.weight"] = Slot(dst + "self_attn.o_proj.weight", (hid, heads * d),
                                                      "linear", 0, hid)
        if cfg.o_proj_bias:
            slots[src + "self_attn.o_proj.bias"] = Slot(dst + "self_attn.o_proj.bias", (hid,))
        if cfg.qk_norm:
            for name, (start, stop) in (("q", (0, heads)), ("k", (heads, heads + kv))):
                slots[src + f"self_attn.{name}_norm.weight"] = Slot(dst + "self_attn.qk_norm.weight", (d,),
                                                                    "heads", start, stop, cfg.rope.interleaved)
        for name, cols in (("gate", (0, inter)), ("up", (inter, 2 * inter))):
            slots[src + f"mlp.{name}_proj.weight"] = Slot(dst + "mlp.gate_up_proj.weight", (inter, hid),
                                                          "linear", *cols)
            if cfg.mlp_bias:
                slots[src + f"mlp.{name}_proj.bias"] = Slot(dst + "mlp.gate_up_proj.bias", (inter,), "vec", *cols)
        slots[src + "mlp.down_proj.weight"] = Slot(dst + "mlp.down_proj.weight", (hid, inter), "linear", 0, hid)
        if cfg.mlp_bias:
            slots[src + "mlp.down_proj.bias"] = Slot(dst + "mlp.down_proj.bias", (hid,))
    return slots


def load_weights(model: DecoderForCausalLM, cfg: ModelConfig, files: list[Path], *, show_progress: bool = True) -> None:
    """Fill every parameter of ``model`` from ``files``; any mismatch is a WeightMismatchError."""
    from tqdm.auto import tqdm

    slots = weight_slots(cfg)
    params = dict(model.named_parameters())
    pending = {name: 0 for name in params}
    for slot in slots.values():
        pending[slot.param] += 1
    unfed = [name for name, count in pending.items() if count == 0]
    assert not unfed, f"decoder parameters with no checkpoint slot (a loader bug): {unfed}"
    pieces: dict[str, list[tuple[Slot, Any]]] = {}
    total = sum(_count_tensors(path) for path in files)
    with tqdm(total=total, desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for name, read, shape, path in _iter_tensors(files):
            bar.update(1)
            slot = _claim(slots, name, cfg, path)
            if slot is None:
                continue
            if tuple(shape) != slot.shape:
                raise WeightMismatchError(
                    f"tensor {name!r} in {path.name} has shape {list(shape)}, but {cfg.architecture} with this "
                    f"config.json expects {list(slot.shape)}.", tensor=name,
                    fix="check that config.json belongs to these weights (hidden_size, heads, head_dim, vocab).")
            param = params[slot.param]
            value = read().astype(param.dtype)
            pieces.setdefault(slot.param, []).append((slot, _permute(value, cfg.head_dim) if slot.permute else value))
            pending[slot.param] -= 1
            if pending[slot.param] == 0:
                _assign(param, pieces.pop(slot.param))
    if slots:
        missing = sorted(slots)
        raise WeightMismatchError(f"{len(missing)} tensor(s) missing from the checkpoint, first {missing[0]!r} "
                                  f"(expected shape {list(slots[missing[0]].shape)}).", tensor=missing[0],
                                  fix="download the checkpoint again, or check that config.json belongs to "
                                      "these weights.")


def _count_tensors(path: Path) -> int:
    from safetensors import safe_open

    with safe_open(str(path), framework="paddle") as f:
        return len(list(f.keys()))


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, Any, list[int], Path]]:
    """``(name, load(), shape, file)`` per tensor; ``load`` reads the data only when called."""
    from safetensors import safe_open

    for path in files:
        try:
            handle = safe_open(str(path), framework="paddle")
        except Exception as exc:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"cannot open weight file {str(path)!r}: {exc}.",
                                 fix="download the checkpoint again; the file looks truncated or corrupt.") from None
        with handle as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                yield name, (lambda f=f, name=name: f.get_tensor(name)), shape, path


def _claim(slots: dict[str, Slot], name: str, cfg: ModelConfig, path: Path) -> Slot | None:
    """The slot for ``name`` (removed from ``slots``), None for a tensor safely ignored."""
    if name in slots:
        return slots.pop(name)
    if name.endswith(_IGNORED_SUFFIXES) or _IGNORED_SUBSTRING in name:
        return None
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
        return None  # HF ties lm_head to the embedding and ignores a stored copy
    raise WeightMismatchError(f"unexpected tensor {name!r} in {path.name}: {cfg.architecture} with this config.json "
                              "has no such weight (or it was already loaded from another file).", tensor=name,
                              fix="check that config.json's architectures and sizes match the checkpoint.")


def neox_permutation(head_dim: int) -> np.ndarray:
    """Per-head dim order mapping interleaved RoPE pairs ``(2i, 2i+1)`` to NeoX pairs ``(i, i + d/2)``.

    Applied to the q and k projections alike it leaves every q.k dot product unchanged, so an
    interleaved checkpoint runs through the NeoX RoPE with no per-step cost.
    """
    return np.concatenate([np.arange(0, head_dim, 2), np.arange(1, head_dim, 2)])


def _permute(t: Any, head_dim: int) -> Any:
    """Apply ``neox_permutation`` to each head's dims of a q/k weight ``[heads*D, in]``, bias or norm ``[D]``."""
    shape = list(t.shape)
    perm = paddle.to_tensor(neox_permutation(head_dim))
    return paddle.gather(t.reshape([-1, head_dim] + shape[1:]), perm, axis=1).reshape(shape)


def _assign(param: Any, parts: list[tuple[Slot, Any]]) -> None:
    """Fuse a parameter's pieces in HF layout (rows in ``start`` order), convert once, assign.

    Concatenating ``[out, in]`` pieces along rows is a contiguous copy; the single transpose that
    follows goes through ``paddle.assign``, which is several times faster than ``set_value`` of a
    transposed view on CPU.
    """
    parts.sort(key=lambda part: part[0].start)
    kind = parts[0][0].kind
    if kind == "heads":  # one [D] norm weight per head range
        values = [v.unsqueeze(0).expand([s.stop - s.start, v.shape[0]]) for s, v in parts]
    else:
        values = [v for _, v in parts]
    value = values[0] if len(values) == 1 else paddle.concat(values, axis=0)
    if kind == "linear":
        value = paddle.transpose(value, [1, 0])
    device = paddle.device.get_device()
    if device != "cpu":
        value = value.to(device)  # safetensors hands out host tensors
    paddle.assign(value, param)
