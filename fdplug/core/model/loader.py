"""Loading a Hugging Face safetensors checkpoint into ``DecoderForCausalLM``.

Every checkpoint tensor has exactly one *slot* (`weight_slots`): the Paddle parameter it lands in, the shape it must
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
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import paddle

from fdplug.core.model.checkpoint.config import DIR_FIX, ModelConfig
from fdplug.core.model.checkpoint.gguf_file import gguf_path, open_gguf
from fdplug.core.model.checkpoint.rope import rope_permutation
from fdplug.core.model.gguf_loader import load_gguf_weights
from fdplug.core.model.layers.decoder import DecoderForCausalLM
from fdplug.core.model.layers.fp8_linear import Fp8Linear
from fdplug.core.model.layers.gguf_linear import GgufLinear
from fdplug.core.model.layers.linear import Linear
from fdplug.core.model.layers.linear_shapes import LinearShape, fp8_format
from fdplug.core.model.weight_slots import Slot, assign_pieces, hand_over_experts, weight_slots
from fdplug.core.portable.ops import PORTABLE
from fdplug.core.quant.fp8_rows import expand_scale_rows, fp8_rows
from fdplug.core.vision.tower import VISION_PREFIXES, language_name
from fdplug.errors import ModelLoadError, WeightMismatchError
from fdplug.plugin_api.ops import Kernels

logger = logging.getLogger("fdplug")

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that no architecture here uses: old Llama exports' RoPE buffers and
# ERNIE-4.5's multi-token-prediction head (transformers ignores "mtp" tensors too).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_IGNORED_SUBSTRING = "mtp"


def _tied_table_note(model: Any, head_copy: int) -> str:
    """The load log's words on a tied GGUF table laid out for the lm_head (``head_copy`` bytes; 0: none)."""
    if not head_copy:
        return ""
    if model.embed_tokens is None:   # `prepare_tied_head` dropped the file's table: one copy
        return (f", the tied embedding table ({head_copy / 1e6:.1f} MB) once, laid out for the lm_head's kernel, "
                "the embedding reading its rows there")
    return f", {head_copy / 1e6:.1f} MB of it the tied lm_head laid out for its kernel beside the embedding table"


def load_model(model_dir: str | Path, attn_backend: Any, dtype: str = "float32", *,
               max_positions: int | None = None, show_progress: bool = True,
               kernels: Kernels = PORTABLE, moe_backend: Any | None = None,
               quantization: str | None = None,
               weight_dtype: str | None = None, expert_parallel: Any = None,
               linear_plans: Sequence[Any] = ()) -> tuple[DecoderForCausalLM, ModelConfig]:
    """Build the decoder for ``model_dir``'s config and fill it from its safetensors files.

    ``dtype`` is the compute dtype (float32 on CPU); checkpoint tensors are cast to it.
    ``max_positions`` sizes the RoPE tables (default: the config's ``max_position_embeddings``).
    ``moe_backend`` runs the routed experts of a MoE model (default: the portable reference).
    ``quantization="fp8"`` quantizes a float checkpoint's linears to FP8 blocks as they are read.
    ``weight_dtype="bfloat16"`` with a float32 ``dtype`` keeps the float linears, the embedding and
    the lm_head in bf16 (`layers.Linear`, the ``linear`` op): half the bytes, float32 math.
    ``expert_parallel`` (a `lockstep.LockstepGroup`): keep this rank's share of the routed experts.
    ``linear_plans`` (`op_timing.LinearPlan`s of ``linear``, ``fp8_linear``, ``gguf_linear``): the
    layer shapes where the portable op runs instead of the op's kernel (faster there, as measured); an
    op without one runs its kernel on every layer.
    """
    started = time.perf_counter()
    cfg = ModelConfig.from_dir(model_dir, quantization).keep_weights(dtype, weight_dtype)
    gguf = gguf_path(model_dir)
    files = [gguf] if gguf is not None else weight_files(model_dir)
    model = DecoderForCausalLM(cfg, attn_backend, dtype=dtype, max_positions=max_positions, kernels=kernels,
                               moe_backend=moe_backend, expert_parallel=expert_parallel)
    if gguf is not None:
        load_gguf_weights(model, cfg, open_gguf(gguf), show_progress=show_progress)
    else:
        load_weights(model, cfg, files, show_progress=show_progress)
    for plan in linear_plans:   # first: a layer on the portable op keeps its weight as it is
        _portable_where_faster(model, plan)
    if kernels.prepare_gguf_linear is not None:
        for layer in model.sublayers():
            if isinstance(layer, GgufLinear):
                layer.prepare(kernels.prepare_gguf_linear)
        if model.embed_type is None or model.gguf_kernel is not PORTABLE.gguf_linear:
            model.prepare_tied_head(kernels.prepare_gguf_linear)
    for kind, prepare in ((Linear, kernels.prepare_linear), (Fp8Linear, kernels.prepare_fp8_linear)):
        layers = [layer for layer in model.sublayers() if isinstance(layer, kind)]
        if prepare is None or not layers:
            continue
        for layer in layers:
            if layer.kernel not in (PORTABLE.linear, PORTABLE.fp8_linear):   # the portable op reads it as it is
                layer.prepare(prepare)
        prepared = [layer.prepared.layout for layer in layers if layer.prepared is not None]
        logger.info("%s layers: %d of %d laid out for their kernel at load%s", kind.__name__, len(prepared),
                    len(layers), f" ({prepared[0]})" if prepared else "")
    logger.info("loaded %s (%s, %d layers) from %d file(s) as %s in %.1f s", model_dir, cfg.architecture,
                cfg.num_layers, len(files), dtype + (" (bf16 weights)" if cfg.bf16_weights else ""),
                time.perf_counter() - started)
    if gguf is not None:
        held = sum(int(p.numel()) * p.element_size() for p in model.parameters())
        held += sum(getattr(layer, "expert_bytes", 0) for layer in model.sublayers())   # the MoE backend's
        head_copy = model.head_copy_bytes()
        logger.info("%s; %.1f MB of weights held (the file: %.1f MB)%s", cfg.quant.describe(), (held + head_copy) / 1e6,
                    gguf.stat().st_size / 1e6, _tied_table_note(model, head_copy))
    return model, cfg


def _portable_where_faster(model: DecoderForCausalLM, plan: Any) -> None:
    """The portable op of ``plan.op`` for the layers (a GGUF projection's block-type groups, the tied
    lm_head) whose shape it runs faster than the kernel (`op_timing.LinearPlan`); those keep their
    weight as it is (nothing to prepare)."""
    def kernel_on(n: int, k: int, fmt: Any, logits: bool, prepared: bool = True) -> bool:
        return plan.uses_kernel(LinearShape(int(n), int(k), str(fmt).removeprefix("paddle."), prepared, logits, ()))

    for layer in model.sublayers():
        logits = layer is model.lm_head
        if plan.op == "linear" and isinstance(layer, Linear) and not kernel_on(*layer.weight.shape,
                                                                                layer.weight.dtype, logits):
            layer.kernel = PORTABLE.linear
        elif plan.op == "fp8_linear" and isinstance(layer, Fp8Linear) and not kernel_on(
                *layer.weight.shape, fp8_format(layer.block_k), logits):
            layer.kernel = PORTABLE.fp8_linear
        elif plan.op == "gguf_linear" and isinstance(layer, GgufLinear):
            for group, (qtype, rows) in enumerate(layer.layout.groups):
                if not kernel_on(rows, layer.in_features, qtype, logits):
                    layer.use_portable(group)
    if model.lm_head is not None:
        return
    cfg = model.config
    if plan.op == "linear" and model.embed_type is None and not kernel_on(*model.embed_tokens.shape,
                                                                           model.embed_tokens.dtype, True, False):
        model.logits_kernel = PORTABLE.linear
    if plan.op == "gguf_linear" and model.embed_type is not None and not kernel_on(cfg.vocab_size, cfg.hidden_size,
                                                                                    model.embed_type, True):
        model.gguf_kernel = PORTABLE.gguf_linear


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
                         fix=DIR_FIX + " Convert .bin/.pdparams checkpoints to safetensors first.")


def load_weights(model: DecoderForCausalLM, cfg: ModelConfig, files: list[Path], *, show_progress: bool = True) -> None:
    """Fill every parameter of ``model`` from ``files``; any mismatch is a WeightMismatchError."""
    from tqdm.auto import tqdm

    names = [name for path in files for name in _tensor_names(path)]
    slots = weight_slots(cfg, fused_experts=any(name.endswith("mlp.experts.gate_up_proj") for name in names))
    params = dict(model.named_parameters())
    pending = {name: 0 for name in params}
    for slot in slots.values():
        pending[slot.param] += 1
    unfed = [name for name, count in pending.items() if count == 0]
    assert not unfed, f"decoder parameters with no checkpoint slot (a loader bug): {unfed}"
    pieces: dict[str, list[tuple[Slot, Any]]] = {}
    with tqdm(total=len(names), desc="Loading weights", unit="tensor", disable=not show_progress) as bar:
        for name, read, shape, path in _iter_tensors(files):
            bar.update(1)
            name = language_name(name)
            slot = None if name.startswith(VISION_PREFIXES) else _claim(slots, name, cfg, path)
            if slot is None:
                continue
            if tuple(shape) != slot.shape:
                raise WeightMismatchError(
                    f"tensor {name!r} in {path.name} has shape {list(shape)}, but {cfg.architecture} with this "
                    f"config.json expects {list(slot.shape)}.", tensor=name,
                    fix="check that config.json belongs to these weights (hidden_size, heads, head_dim, vocab).")
            for piece, value in _quantized_online(name, read(), slot, slots, params, cfg):
                value = _read_as(value, params[piece.param], name, path)
                if piece.scale_rows:
                    value = expand_scale_rows(value, piece.stop - piece.start, piece.scale_rows)
                pieces.setdefault(piece.param, []).append((piece, _permute(value, cfg) if piece.permute else value))
                pending[piece.param] -= 1
                if pending[piece.param] == 0:
                    assign_pieces(params[piece.param], pieces.pop(piece.param))
                    hand_over_experts(model, piece.param, pending)
    if slots:
        missing = sorted(slots)
        raise WeightMismatchError(f"{len(missing)} tensor(s) missing from the checkpoint, first {missing[0]!r} "
                                  f"(expected shape {list(slots[missing[0]].shape)}).", tensor=missing[0],
                                  fix="download the checkpoint again, or check that config.json belongs to "
                                      "these weights.")


def _open(path: Path) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(str(path), framework="paddle")
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ModelLoadError(f"cannot open weight file {str(path)!r}: {exc}.",
                             fix="download the checkpoint again; the file looks truncated or corrupt.") from None


def _tensor_names(path: Path) -> list[str]:
    with _open(path) as f:
        return list(f.keys())


def _iter_tensors(files: list[Path]) -> Iterator[tuple[str, Any, list[int], Path]]:
    """``(name, load(), shape, file)`` per tensor; ``load`` reads the data only when called."""
    for path in files:
        with _open(path) as f:
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
    if cfg.mtp_layers and _layer_index(name) in range(cfg.num_layers, cfg.num_layers + cfg.mtp_layers):
        return None  # GLM-4.5/DeepSeek-V3 store their multi-token-prediction layer as the next layer
    raise WeightMismatchError(f"unexpected tensor {name!r} in {path.name}: {cfg.architecture} with this config.json "
                              "has no such weight (or it was already loaded from another file).", tensor=name,
                              fix="check that config.json's architectures and sizes match the checkpoint.")


def _layer_index(name: str) -> int | None:
    """``7`` for ``model.layers.7.mlp...``, None for a tensor outside the layers."""
    parts = name.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit() else None


def _quantized_online(name: str, value: Any, slot: Slot, slots: dict[str, Slot], params: dict[str, Any],
                      cfg: ModelConfig) -> list[tuple[Slot, Any]]:
    """``[(slot, value)]``, or, when the config quantizes a float checkpoint at load and ``value`` is a
    float weight bound for FP8, its e4m3 blocks and their ``weight_scale_inv`` for that tensor's scale
    slot: exactly what an FP8 checkpoint made by `fdplug.core.quant.checkpoint` would hold."""
    fp8 = paddle.float8_e4m3fn
    if cfg.quant is None or not cfg.quant.online or params[slot.param].dtype != fp8 or value.dtype == fp8:
        return [(slot, value)]
    from fdplug.plugin_api.fp8 import block_quant

    try:
        q, scale_inv = block_quant(value.astype("float32"), cfg.quant.block)
    except ValueError as exc:   # NaN/inf weights: an e4m3 cast would turn them into a plausible 448
        raise WeightMismatchError(f"tensor {name!r} cannot be quantized to FP8: {exc}.", tensor=name,
                                  fix="check the checkpoint (non-finite weights), "
                                      "or load it without quantization.") from None
    return [(slot, q), (slots.pop(name + "_scale_inv"), scale_inv)]


def _read_as(value: Any, param: Any, name: str, path: Path) -> Any:
    """A checkpoint tensor in its parameter's dtype. FP8 must meet FP8: casting float weights to e4m3
    (or e4m3 to float) would drop the block scales and compute with wrong weights."""
    fp8 = paddle.float8_e4m3fn
    if (value.dtype == fp8) != (param.dtype == fp8):
        stored, wanted = ("float8_e4m3fn", "float") if value.dtype == fp8 else (str(value.dtype), "float8_e4m3fn")
        raise WeightMismatchError(f"tensor {name!r} in {path.name} is {stored}, but this config.json's "
                                  f"quantization_config makes it {wanted}.", tensor=name,
                                  fix="use the config.json that came with these weights (an FP8 checkpoint has a "
                                      "quantization_config with quant_method 'fp8').")
    return value if value.dtype == param.dtype else value.astype(param.dtype)


def _permute(t: Any, cfg: ModelConfig) -> Any:
    """Apply `rope_permutation` to each head's dims of a q/k weight ``[heads*D, in]`` (its per-row
    FP8 scales too), bias or norm ``[D]``."""
    shape = list(t.shape)
    perm = paddle.to_tensor(rope_permutation(cfg.rope, cfg.head_dim))
    return fp8_rows(t, lambda v: paddle.gather(v.reshape([-1, cfg.head_dim] + shape[1:]), perm, axis=1).reshape(shape))
