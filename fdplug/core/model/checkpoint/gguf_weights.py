"""Which of a GGUF model's weights stay in GGML blocks, and in which type: the model's ``quant`` for GGUF.

A GGUF file picks a block type per tensor (a ``Q4_K_M`` file mixes Q4_K and Q6_K, and falls back to
Q5_0 or Q8_0 where a row is not a multiple of 256), so the format is known per HF module, not per
model. The decoder asks `fused` for each (fused) projection: the row groups of one block type, in
row order, that its `gguf_layers.GgufLinear` keeps; a projection whose tensors are all float
(F32) is a plain `layers.Linear`. A MoE file's routed experts (3-D, one tensor per projection and
layer) are the MoE backend's: `expert_types` gives a layer's, and the experts of the whole model
are the weight format ``gguf`` unless every one of them is F32 (`expert_format`). The router and
the shared expert's gate are kept float whatever the file stores (dequantized at load: a matmul of
``[H, E]`` and ``[H, 1]``). No paddle here: the config is read before a device is.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from fdplug.errors import WeightMismatchError

FLOAT_TYPES = ("F32",)
"""Types a plain float `layers.Linear` takes; F16 and BF16 stay as stored (2 bytes a weight), read by
the ``gguf_linear`` op like the block types (widening them to float32 doubled their memory)."""
GGUF = "gguf"   # the weight format name runners list in ``weight_formats``
EXPERTS = ("gate_proj", "up_proj", "down_proj")   # a MoE layer's stacked expert tensors, ``mlp.experts.<name>``
_KEPT_FLOAT = (".mlp.gate", ".mlp.shared_expert_gate")   # router, shared expert gate: float parameters


@dataclass(frozen=True, slots=True)
class GgufLayout:
    """The weights of one (fused) projection: ``groups`` of ``(qtype, rows)`` in row order, neighbours
    of one type merged (q, k and v of one type are one group, one weight)."""

    groups: tuple[tuple[str, int], ...]
    modules: tuple[str, ...] = ()      # the HF modules fused, in row order (for errors)

    @property
    def rows(self) -> int:
        return sum(rows for _, rows in self.groups)


@dataclass(frozen=True, slots=True)
class GgufQuant:
    """A GGUF model's linear weights: ``types`` maps each HF module (``model.layers.0.mlp.down_proj``,
    ``lm_head``, ``model.embed_tokens``) to its GGML type and its number of rows."""

    types: dict[str, tuple[str, int]] = field(repr=False)
    held: tuple[int, int] = (0, 0)   # (weights, bytes) of the tensors kept in blocks, routed experts aside
    format: str = GGUF
    block: tuple[int, int] = ()
    online: bool = False
    experts: dict[str, str] = field(default_factory=dict, repr=False)   # ``...mlp.experts.gate_proj`` -> type
    expert_bytes: int = 0            # the routed experts' bytes in the file (all layers)

    @classmethod
    def from_tensors(cls, tensors: dict[str, Any]) -> GgufQuant:
        """From `gguf_file.GgufFile.tensors`: every 2-D ``.weight`` (norms stay as they are) but the
        router's and the shared expert gate's, and the 3-D expert stacks."""
        matrices = {name: t for name, t in tensors.items() if name.endswith(".weight") and len(t.shape) == 2
                    and not name.removesuffix(".weight").endswith(_KEPT_FLOAT)}
        blocks = [t for t in matrices.values() if t.qtype not in FLOAT_TYPES]
        held = (sum(t.shape[0] * t.shape[1] for t in blocks), sum(int(t.data.nbytes) for t in blocks))
        stacks = {name.removesuffix(".weight"): t for name, t in tensors.items()
                  if name.endswith(".weight") and len(t.shape) == 3}
        return cls({name.removesuffix(".weight"): (t.qtype, t.shape[0]) for name, t in matrices.items()}, held,
                   experts={name: t.qtype for name, t in stacks.items()},
                   expert_bytes=sum(int(t.data.nbytes) for t in stacks.values()))

    @property
    def expert_format(self) -> str:
        """The routed experts' weight format: ``gguf`` (kept in blocks) unless every one is F32
        (``none``: float parameters, as a plain `layers.Linear` takes an F32 projection)."""
        return GGUF if any(qtype not in FLOAT_TYPES for qtype in self.experts.values()) else "none"

    def expert_types(self, prefix: str) -> dict[str, str]:
        """The GGML types of the experts at ``prefix`` (``model.layers.3.mlp.experts.``), keyed
        ``gate``/``up``/``down`` as `fdplug.plugin_api.moe.ExpertWeights.qtypes`; a missing tensor
        is refused by name."""
        out = {}
        for name in EXPERTS:
            if prefix + name not in self.experts:
                raise WeightMismatchError(f"tensor {prefix}{name}.weight (llama.cpp's ffn_{name[:-5]}_exps) is "
                                          "missing from the GGUF file.", tensor=prefix + name + ".weight",
                                          fix="download the file again, or convert it again with llama.cpp.")
            out[name.removesuffix("_proj")] = self.experts[prefix + name]
        return out

    def converts(self, module: str) -> bool:
        """Whether ``module``'s weight stays in GGML blocks (not a float type)."""
        return module in self.types and self.types[module][0] not in FLOAT_TYPES

    def fused(self, prefix: str, names: tuple[str, ...]) -> GgufLayout | None:
        """The layout of the projection fusing ``prefix + name`` for ``names`` (in that row order);
        None when all of them are float (a plain `layers.Linear` takes them, cast at load)."""
        modules = [prefix + name for name in names]
        if not any(self.converts(module) for module in modules):
            return None
        groups: list[tuple[str, int]] = []
        for module in modules:
            if module not in self.types:
                raise WeightMismatchError(f"tensor {module}.weight is missing from the GGUF file.",
                                          tensor=module + ".weight", fix="download the file again, or convert it "
                                                                         "again with llama.cpp.")
            qtype, rows = self.types[module]
            if groups and groups[-1][0] == qtype:
                groups[-1] = (qtype, groups[-1][1] + rows)
            else:
                groups.append((qtype, rows))
        return GgufLayout(tuple(groups), tuple(modules))

    @property
    def embedding_type(self) -> str | None:
        """The embedding table's GGML type when it stays in blocks (None: float)."""
        return self.types["model.embed_tokens"][0] if self.converts("model.embed_tokens") else None

    def weight_types(self) -> tuple[str, ...]:
        """The block types the linear kernels must read, most used first."""
        counts = Counter(qtype for qtype, _ in self.types.values() if qtype not in FLOAT_TYPES)
        return tuple(name for name, _ in counts.most_common())

    def describe(self) -> str:
        counts = Counter([qtype for qtype, _ in self.types.values()] + list(self.experts.values()))
        return "GGUF weights: " + ", ".join(f"{n} x {qtype}" for qtype, n in counts.most_common())
