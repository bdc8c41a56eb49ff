"""``cpu_native_decoder_stack``: every decoder layer of a decode step in one compiled call.

A one-token decode step of a small model spends more time between its kernels than in them: ~12
ops a layer from Python, 10-20 us each. SmolLM2-135M (30 layers, Q4_1): 5.3 ms of 10.2 a token
were that (this 2-core Zen 5, AVX-512). ``fdplug_decoder_stack`` (csrc/decoder_stack.c) runs the
same kernels the cpu plugin's ops run, back to back in C, for steps whose every sequence has one
query token (what ``cpu_native`` attention prepares as a single decode group); other steps
(prefill, mixed) run layer by layer. The result is the layer-by-layer one bit for bit.

It takes what its own ops compute: GGUF linears of the types csrc/gguf_linear.c decodes, or float
and bf16 linears packed at load for ``cpu_native_linear`` (``cpu_native_bf16_linear``), float32
activations and norms, ``cpu_native`` attention and the plugin's norm, RoPE, SwiGLU, GGUF and linear
kernels selected for those ops. Anything else (FP8 linears, float layers the startup timing left
on paddle's matmul or the kernel left unpacked, a user's ``--op-kernel`` choice of another kernel)
it declines at load, with the reason, and the layers run one by one.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from fdplug.core.portable.attention import _Prepared
from fdplug.plugin_api.decoder_stack import DecoderStack, StackLinear
from fdplug.plugin_api.gguf_formats import row_bytes
from fdplug.plugin_api.ops import PreparedWeight
from fdplug.plugins.cpu import kernels, native_linear
from fdplug.plugins.cpu.native_attention import _KernelGroup
from fdplug.plugins.cpu.native_gguf import _IDS, SUPPORTED, takes
from fdplug.plugins.cpu.native_gguf_packed import LAYOUT, TYPES

MAX_GROUPS = 4   # csrc/decoder_stack.c's DS_MAX_GROUPS
MATHS = {"cpu_native_gguf_linear": 0, "cpu_native_gguf_bf16_linear": 1, "cpu_native_gguf_q8_linear": 2,
         "cpu_native_gguf_packed_linear": 3}
"""The GGUF linear kernels and their math, as csrc/gguf_linear.c numbers it (GG_MATH_F32, _BF16, _Q8,
_PACKED: the last reads weights the loader packed, `native_gguf_packed.prepare`)."""
PACKED = MATHS["cpu_native_gguf_packed_linear"]
FLOAT_KINDS = {"cpu_native_linear": False, "cpu_native_bf16_linear": True}
"""The float linear kernels whose packed layers it runs, and whether in bf16 math (bf16 weights)."""
OWN_OPS = {"rms_norm": ("cpu_native_rms_norm",), "add_rms_norm": ("cpu_native_add_rms_norm",),
           "rope": ("cpu_native_rope",), "swiglu": ("cpu_native_swiglu",), "gguf_linear": tuple(MATHS),
           "linear": tuple(FLOAT_KINDS)}
"""The kernels whose work the stack does: it runs only where one of these was selected for each op
(for the linears, in the math of the one selected; ``gguf_linear`` only for GGUF layers, ``linear``
only for float ones)."""

_p, _i, _f = ctypes.c_void_p, ctypes.c_int, ctypes.c_float


class _Linear(ctypes.Structure):
    _fields_ = [("weight", _p * MAX_GROUPS), ("bias", _p), ("qtype", _i * MAX_GROUPS), ("rows", _i * MAX_GROUPS),
                ("groups", _i), ("depth", _i), ("cols", _i), ("packed_kind", _i)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _p), ("post_norm", _p), ("qk_norm", _p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear)]


class _Model(ctypes.Structure):
    _fields_ = [("layers", ctypes.POINTER(_Layer)), ("embed_table", _p), ("embed_row_bytes", ctypes.c_int64),
                ("embed_qtype", _i), ("num_layers", _i), ("hidden", _i), ("inter", _i), ("heads", _i),
                ("kv_heads", _i), ("head_dim", _i), ("eps", _f), ("scale", _f), ("math", _i), ("embed_packed", _i)]


class _Step(ctypes.Structure):
    _fields_ = [("embed", _p), ("ids", _p), ("cos", _p), ("sin", _p), ("key_caches", _p),
                ("value_caches", _p), ("slots", _p),
                ("q_rows", _p), ("block_tables", _p), ("seq_of_token", _p), ("key_end", _p), ("x", _p),
                ("residual", _p), ("scratch", _p), ("tokens", _i), ("num_blocks", _i), ("block_size", _i),
                ("table_width", _i), ("max_key_end", _i), ("threads", _i), ("kv_type", _i)]


def _float32_vector(t: Any, shape: list[int], what: str) -> str | None:
    if str(t.dtype) != "paddle.float32" or list(t.shape) != shape or not t.is_contiguous():
        return f"{what} is {t.dtype} {list(t.shape)}, not a contiguous float32 {shape}"
    return None


def _float_reason(linear: StackLinear) -> str | None:
    """None if the stack runs float ``linear``: one float32 or bf16 weight packed by
    `native_linear.prepare` in the loaded library's layout (what ``cpu_native_linear`` reads)."""
    (weight, _), = linear.groups
    if not isinstance(weight, PreparedWeight) or weight.layout != native_linear.layout():
        return ("float linear layers left [N, K] (the startup timing put their shape on paddle's matmul, where "
                "--op-kernel linear=cpu_native_linear keeps the kernel, and so the stack, on every shape; or N is not "
                "a multiple of 16, or FDPLUG_CPU_PACK_WEIGHTS=0)")
    if str(weight.dtype) not in ("paddle.float32", "paddle.bfloat16"):
        return f"{weight.dtype} packed weights (it runs float32 and bf16)"
    return None


def _linear_reason(linear: StackLinear, packed: bool = False) -> str | None:
    """None if the stack runs ``linear``: the file's blocks, or (``packed``) every group as
    `native_gguf_packed.prepare` laid it out; a float layer as `_float_reason` says."""
    if linear.format == "float":
        return _float_reason(linear)
    if linear.format != "gguf":
        return f"{linear.format} linear layers (it runs GGUF blocks and packed float ones)"
    if len(linear.groups) > MAX_GROUPS:
        return f"a projection of {len(linear.groups)} block-type groups (at most {MAX_GROUPS})"
    for weight, qtype in linear.groups:
        if not takes(qtype, linear.in_features):
            return f"{qtype} rows of {linear.in_features} weights (it decodes {', '.join(SUPPORTED)})"
        if packed and qtype in TYPES:
            if not (isinstance(weight, PreparedWeight) and weight.layout == LAYOUT):
                return ("GGUF weights the packed kernel's loader left unpacked (a row count not a multiple of 16, "
                        "or FDPLUG_CPU_PACK_WEIGHTS=0)")
        elif isinstance(weight, PreparedWeight) or not weight.is_contiguous():
            return "GGUF weights laid out by another kernel"
    return None


def _formats(stack: DecoderStack) -> set[str]:
    return {linear.format for layer in stack.layers for linear in (layer.qkv, layer.o, layer.gate_up, layer.down)}


def decline_reason(stack: DecoderStack) -> str | None:
    """None if the stack runs these layers; else why not."""
    formats = _formats(stack)
    if len(formats) > 1:
        return f"layers of {' and '.join(sorted(formats))} linears (it runs one kind a model)"
    unused = {"gguf_linear"} if "gguf" not in formats else {"linear"}
    other = [f"{op}={stack.ops.get(op)}" for op, names in OWN_OPS.items()
             if op not in unused and stack.ops.get(op) not in names]
    if other:
        return "ops chosen that it does not run: " + ", ".join(other)
    if stack.attention != "cpu_native":
        return f"attention backend {stack.attention!r} (it runs cpu_native's)"
    if stack.dtype != "float32":
        return f"{stack.dtype} activations (it computes in float32)"
    qk = [stack.num_heads + stack.num_kv_heads, stack.head_dim]
    hidden, inter, attn = stack.hidden_size, stack.intermediate_size, stack.num_heads * stack.head_dim
    shapes = ((hidden, attn + 2 * stack.num_kv_heads * stack.head_dim), (attn, hidden), (hidden, 2 * inter),
              (inter, hidden))   # (in, out) of qkv, o, gate_up, down: the C code's strides
    packed = MATHS.get(stack.ops["gguf_linear"]) == PACKED
    for i, layer in enumerate(stack.layers):
        for linear, shape in zip((layer.qkv, layer.o, layer.gate_up, layer.down), shapes, strict=True):
            reason = _linear_reason(linear, packed) or (linear.bias is not None and _float32_vector(
                linear.bias, [linear.out_features], "a bias")) or None
            if not reason and ((linear.in_features, linear.out_features) != shape
                               or sum(linear.group_rows()) != shape[1]):
                reason = f"a {linear.in_features} x {linear.out_features} projection where the shapes make {shape}"
            if reason:
                return f"layer {i}: {reason}"
        for weight, shape in ((layer.input_norm, [stack.hidden_size]), (layer.post_norm, [stack.hidden_size]),
                              (layer.qk_norm, qk)):
            reason = weight is not None and _float32_vector(weight, shape, "a norm weight")
            if reason:
                return f"layer {i}: {reason}"
    return None


def _ptr(t: Any) -> int | None:
    return None if t is None else t.data_ptr()


def _c_linear(linear: StackLinear, bf16_math: bool) -> _Linear:
    rows = linear.group_rows()
    weights = [w.data if isinstance(w, PreparedWeight) else w for w, _ in linear.groups]
    if linear.format == "float":   # native_linear._linear_packed's call: the bias inside, the same kind
        (weight, _), = linear.groups
        return _Linear((_p * MAX_GROUPS)(weights[0].data_ptr()), native_linear.bias_pointer(weight),
                       (_i * MAX_GROUPS)(), (_i * MAX_GROUPS)(*rows), 1, linear.in_features, linear.out_features,
                       native_linear.packed_kind(weight, bf16_math))
    return _Linear((_p * MAX_GROUPS)(*(w.data_ptr() for w in weights)), _ptr(linear.bias),
                   (_i * MAX_GROUPS)(*(_IDS[q] for _, q in linear.groups)), (_i * MAX_GROUPS)(*rows),
                   len(linear.groups), linear.in_features, linear.out_features, -1)


class CpuDecoderStack:
    """The ``run`` the op returns: `__call__` runs a decode-only step, or returns None for another."""

    def __init__(self, stack: DecoderStack, threads: int) -> None:
        self.stack, self.threads = stack, threads     # (the stack holds the tensors the pointers point into)
        self.lib = kernels.load()
        bf16_math = FLOAT_KINDS.get(stack.ops.get("linear"), False)
        layers = (_Layer * len(stack.layers))(*(
            _Layer(_ptr(ly.input_norm), _ptr(ly.post_norm), _ptr(ly.qk_norm),
                   *(_c_linear(linear, bf16_math) for linear in (ly.qkv, ly.o, ly.gate_up, ly.down)))
            for ly in stack.layers))
        table = stack.embedding
        gguf_table = table is not None and table.format == "gguf"
        packed = (gguf_table and isinstance(table.groups[0][0], PreparedWeight)   # the tied lm_head's copy
                  and table.groups[0][0].layout == LAYOUT)
        self.embeds = gguf_table and _linear_reason(table, packed) is None   # rows it decodes
        self.vocab = table.out_features if self.embeds else 0
        embed_ptr, embed_type = ((table.groups[0][0].data if packed else table.groups[0][0]).data_ptr(),
                                 _IDS[table.groups[0][1]]) if self.embeds else (None, 0)
        self.model = _Model(layers, embed_ptr, row_bytes(table.groups[0][1], stack.hidden_size) if self.embeds else 0,
                            embed_type, len(stack.layers), stack.hidden_size, stack.intermediate_size,
                            stack.num_heads, stack.num_kv_heads, stack.head_dim, stack.rms_norm_eps,
                            stack.attention_scale, MATHS.get(stack.ops["gguf_linear"], 0), int(packed))
        self.layers = layers
        self.caches: Any = None          # the kv_caches list the pointer arrays below were made from
        self.cache_pointers: tuple[np.ndarray, np.ndarray] | None = None
        self.cache_shape: list[int] = []
        self.kv_type = 0                 # the caches' element type (kernels.kv_type), with the caches
        self.scratch = np.empty(0, dtype=np.float32)
        self.scratch_per_token = self.lib.fdplug_decoder_stack_scratch(ctypes.byref(self.model), 1)   # (linear)

    def _bind_caches(self, kv_caches: list[tuple[Any, Any]]) -> None:
        """Pointer arrays of every layer's caches, checked once for each list of caches."""
        shape = list(kv_caches[0][0].shape)
        if len(kv_caches) != len(self.stack.layers) or len(shape) != 4 or shape[0] != self.stack.num_kv_heads \
                or shape[3] != self.stack.head_dim:
            raise ValueError(f"decoder stack: {len(kv_caches)} caches of {shape} for {len(self.stack.layers)} "
                             f"layers of {self.stack.num_kv_heads} kv heads x {self.stack.head_dim}")
        dtype = kv_caches[0][0].dtype
        for pair in kv_caches:
            for cache in pair:
                if list(cache.shape) != shape or cache.dtype != dtype or not cache.is_contiguous():
                    raise ValueError(f"decoder stack: a cache of {cache.dtype} {list(cache.shape)},"
                                     f" not {dtype} {shape}")
        self.kv_type = kernels.kv_type(*kv_caches[0])
        self.cache_pointers = tuple(np.array([pair[i].data_ptr() for pair in kv_caches], dtype=np.uint64)
                                    for i in (0, 1))
        self.caches, self.cache_shape = kv_caches, shape

    def __call__(self, input_ids: Any, hidden: Any, cos: Any, sin: Any, kv_caches: list[tuple[Any, Any]],
                 prepared: Any) -> Any:
        if not (isinstance(prepared, _Prepared) and len(prepared.groups) == 1
                and isinstance(prepared.groups[0], _KernelGroup)) or prepared.token_order is not None:
            return None
        group = prepared.groups[0]
        tokens = cos.shape[0]
        if kv_caches is not self.caches:
            self._bind_caches(kv_caches)
        _, num_blocks, block_size, _ = self.cache_shape
        low, high = prepared.slot_range
        if group.max_block >= num_blocks or (low <= high and (low < 0 or high >= num_blocks * block_size)):
            raise ValueError(f"block {group.max_block} or slots {low}..{high} outside the KV cache "
                             f"({num_blocks} blocks of {block_size})")
        if len(group.q_rows) != tokens or len(prepared.slots) != tokens:
            return None
        ids = None
        if hidden is None:   # (self.embeds) the table's rows of checked ids
            ids = np.ascontiguousarray(input_ids.numpy(), dtype=np.int64)
            if ids.shape != (tokens,) or (tokens and (ids.min() < 0 or ids.max() >= self.vocab)):
                raise ValueError(f"decoder stack: token ids {ids.tolist()[:8]}..."
                                 f" outside the vocabulary of {self.vocab}")
        else:
            hidden = kernels._contiguous(hidden)
            if list(hidden.shape) != [tokens, self.stack.hidden_size]:
                raise ValueError(f"decoder stack: hidden {list(hidden.shape)} for {tokens} tokens")
        cos, sin = kernels._contiguous(cos), kernels._contiguous(sin)
        kernels._check_float32(cos, sin, *(() if hidden is None else (hidden,)))
        need = self.scratch_per_token * tokens
        if self.scratch.size < need:
            self.scratch = np.empty(need, dtype=np.float32)
        x, residual = kernels.empty_f32([tokens, self.stack.hidden_size]), kernels.empty_f32(
            [tokens, self.stack.hidden_size])
        keys, values = self.cache_pointers
        step = _Step(None if hidden is None else hidden.data_ptr(), None if ids is None else ids.ctypes.data,
                     cos.data_ptr(), sin.data_ptr(), keys.ctypes.data, values.ctypes.data,
                     prepared.slots.ctypes.data, group.q_rows.ctypes.data, group.block_tables.ctypes.data,
                     group.seq_of_token.ctypes.data, group.key_end.ctypes.data, x.data_ptr(), residual.data_ptr(),
                     self.scratch.ctypes.data, tokens, num_blocks, block_size, group.block_tables.shape[1],
                     group.max_key_end, self.threads, self.kv_type)
        status = self.lib.fdplug_decoder_stack(ctypes.byref(self.model), ctypes.byref(step))
        if status != 0:
            raise MemoryError(f"the cpu decoder stack failed ({status}):"
                              f" no scratch memory (attention's, or bf16 math's "
                              "copy of a layer's input) or threads")
        return x, residual


def decoder_stack(stack: DecoderStack, threads: int) -> CpuDecoderStack | str:
    """The ``decoder_stack`` op: a `CpuDecoderStack` for these layers, or why not."""
    return decline_reason(stack) or CpuDecoderStack(stack, threads)
