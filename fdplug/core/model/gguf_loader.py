"""Filling `DecoderForCausalLM` from a GGUF file: quantized weights as their bytes, the rest as floats.

The same `weight_slots` as a Hugging Face checkpoint say where each tensor goes (the file's tensors
have their HF names, `gguf_file.hf_name`). A weight whose projection keeps GGML blocks
(`gguf_layers.GgufLinear`, the embedding table, a MoE layer's stacked experts) is copied as the
file's rows of bytes into the parameter of its block type; any other tensor (norms, biases, F32
weights; F16/BF16 ones fused with F32 ones; the MoE router) is converted to the parameter's dtype.
A MoE layer's experts go to its backend once their three stacks are in
(`moe_block.SparseMoEBlock.load_experts`). Llama-family q/k rows are put back in transformers' order first
(`gguf_file.unpermute_rows`): a row permutation, so quantized rows move as they are. Shapes are
checked from the file's index before any data is read, as for safetensors.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import paddle

from fdplug.core.model.checkpoint.config import ModelConfig
from fdplug.core.model.checkpoint.gguf_file import (
    GgufFile,
    GgufTensor,
    qk_permuted,
    unpermute_rows,
)
from fdplug.core.model.layers.decoder import DecoderForCausalLM
from fdplug.core.model.layers.gguf_linear import GgufLinear
from fdplug.core.model.weight_slots import Slot, assign_pieces, hand_over_experts, weight_slots
from fdplug.core.quant.gguf_blocks import dequantize, row_bytes
from fdplug.errors import WeightMismatchError

_FIX = "the file does not match its own metadata: download it again, or convert it again with llama.cpp."


def load_gguf_weights(model: DecoderForCausalLM, cfg: ModelConfig, gguf: GgufFile, *,
                      show_progress: bool = True) -> None:
    """Fill every parameter of ``model`` from ``gguf``; any mismatch is a WeightMismatchError."""
    from tqdm.auto import tqdm


    slots = weight_slots(cfg)
    params = dict(model.named_parameters())
    targets = {name: _target(model, slot) for name, slot in slots.items()}
    pending: dict[str, int] = {}
    for param, _ in targets.values():
        pending[param] = pending.get(param, 0) + 1
    unfed = sorted(set(params) - set(pending))
    assert not unfed, f"decoder parameters with no GGUF slot (a loader bug): {unfed}"
    pieces: dict[str, list[tuple[Slot, Any]]] = {}
    for name, tensor in tqdm(gguf.tensors.items(), desc="Loading weights", unit="tensor", disable=not show_progress):
        slot = slots.pop(name, None)
        if slot is None:
            raise WeightMismatchError(f"GGUF tensor {tensor.gguf_name!r} ({name}) has no place in {cfg.architecture} "
                                      "as the file's metadata describes it.", tensor=tensor.gguf_name, fix=_FIX)
        if tensor.shape != slot.shape:
            raise WeightMismatchError(f"GGUF tensor {tensor.gguf_name!r} has shape {list(tensor.shape)}, but the "
                                      f"file's metadata makes it {list(slot.shape)}.",
                                          tensor=tensor.gguf_name, fix=_FIX)
        param, start = targets[name]
        value = _read(tensor, params[param], _row_order(tensor, cfg, gguf))
        placed = Slot(param, slot.shape, slot.kind, start, start + slot.stop - slot.start)
        pieces.setdefault(param, []).append((placed, value))
        pending[param] -= 1
        if pending[param] == 0:
            assign_pieces(params[param], pieces.pop(param))
            hand_over_experts(model, param, pending)     # a MoE layer's experts go to its backend
    if slots:
        missing = sorted(slots)
        raise WeightMismatchError(f"{len(missing)} tensor(s) missing from the GGUF file, first {missing[0]!r}.",
                                  tensor=missing[0], fix=_FIX)


def _target(model: DecoderForCausalLM, slot: Slot) -> tuple[str, int]:
    """The parameter a slot's rows land in and their first row there: a `GgufLinear`'s weight is
    one parameter per block-type group (`GgufLinear.group_of`)."""
    layer_path, _, leaf = slot.param.rpartition(".")
    layer = model.get_sublayer(layer_path) if layer_path else None
    if isinstance(layer, GgufLinear) and leaf == "weight":
        name, row = layer.group_of(slot.start)
        return f"{layer_path}.{name}", row
    return slot.param, slot.start


def _row_order(tensor: GgufTensor, cfg: ModelConfig, gguf: GgufFile) -> np.ndarray | None:
    """The rows of a Llama-family q/k weight or bias in transformers' order (None: as stored)."""
    if not qk_permuted(gguf.architecture):
        return None
    for proj, heads in (("q_proj", cfg.num_heads), ("k_proj", cfg.num_kv_heads)):
        if f".self_attn.{proj}." in tensor.name:
            return unpermute_rows(tensor.shape[0], heads)
    return None


def _read(tensor: GgufTensor, param: Any, order: np.ndarray | None) -> Any:
    """The tensor as ``param`` holds it: its bytes for a uint8 (GGML blocks) parameter, else its
    values (dequantized on the host if the file quantized a tensor the model keeps in float)."""
    k = tensor.shape[-1]
    raw = np.asarray(tensor.data).view(np.uint8).reshape(-1, row_bytes(tensor.qtype, k))
    if order is not None:
        raw = raw[order]
    value = paddle.to_tensor(np.ascontiguousarray(raw))
    if param.dtype == paddle.uint8:
        if value.shape[-1] != param.shape[-1]:
            raise WeightMismatchError(f"GGUF tensor {tensor.gguf_name!r} is {tensor.qtype}, but the projection it "
                                      "joins keeps another block type.", tensor=tensor.gguf_name, fix=_FIX)
        return value
    floats = dequantize(value, tensor.qtype, k, "float32").reshape(list(tensor.shape))
    return floats if floats.dtype == param.dtype else floats.astype(param.dtype)
