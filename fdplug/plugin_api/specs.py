"""What a plugin registers: one frozen dataclass per role.

The registration hooks hand plugins a ``register`` callback that accepts exactly one of these types,
so the core validates every registration in one place (`fdplug.plugin_api.spec_checks`, called by
`fdplug.core.plugin_loading.registry`). Factories and
probes are plain callables: vendor SDKs are imported inside them, never at registration time.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from fdplug.plugin_api.parsers import ReasoningParserSpec, ToolParserSpec
from fdplug.plugin_api.settings import Setting

if TYPE_CHECKING:
    from fdplug.plugin_api.engine_config import EngineView
    from fdplug.plugin_api.storage import FeatureStorage

ANY_DEVICE = "*"
"""In ``devices=``: the component is portable Paddle code that runs on every device."""


@dataclass(frozen=True, slots=True)
class Probe:
    """A device probe's answer.

    ``reason`` says why the device is (not) usable in words a user understands; ``fix`` says what to
    do about it (what to install, which variable to set) and is empty when there is nothing to do.
    ``info`` carries facts worth showing in ``fdplug doctor`` (device count, driver, build).
    """

    available: bool
    reason: str
    fix: str = ""
    info: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    """A kind of device.

    ``probe`` must be cheap, side-effect free and honest: never report available when a kernel
    launch would fail. ``paddle_device`` is the prefix given to ``paddle.set_device`` (``cpu``,
    ``gpu``, ``xpu``, or a custom device type). ``setup`` does process-level initialisation (threads,
    env knobs) and is called in the process that will run the engine, before the model is built, and
    again at the start of each thread that computes off the engine's main thread (the feature
    loader's, which run vision towers: thread counts and OpenMP settings are per thread), so it
    must be idempotent.
    ``free_memory(index)`` returns the bytes free on that device (None: unknown); the engine uses it
    to say, with numbers, when the model and the KV cache cannot fit. ``dtypes`` are the compute
    dtypes it runs, preferred first: ``dtype="auto"`` takes the model's if listed, else the first.
    """

    name: str
    probe: Callable[[], Probe]
    paddle_device: str
    priority: int = 0
    setup: Callable[[], None] | None = None
    description: str = ""
    free_memory: Callable[[int], int | None] | None = None
    dtypes: tuple[str, ...] = ("bfloat16", "float16", "float32")

    def paddle_place_name(self, index: int = 0) -> str:
        """The string ``paddle.set_device`` takes for device ``index`` of this kind."""
        return self.paddle_device if self.paddle_device == "cpu" else f"{self.paddle_device}:{index}"


@dataclass(frozen=True, slots=True)
class ComponentSpec:
    """Common shape of the per-device components: model runners, attention and MoE backends, op kernels.

    ``devices`` lists the device names the component runs on (``"*"``: any). ``supports(config)``
    returns ``None`` if the component can serve the given `EngineView`, else the reason it cannot;
    it must not raise for an unsupported model. ``factory`` builds the object the core calls (its
    arguments per role: ``(config, selection)`` for a runner, ``(config)`` for the others).
    """

    name: str
    devices: tuple[str, ...]
    factory: Callable[..., Any]
    priority: int = 0
    supports: Callable[[EngineView], str | None] | None = None
    description: str = ""

    role = "component"

    def runs_on(self, device: str) -> bool:
        return ANY_DEVICE in self.devices or device in self.devices


@dataclass(frozen=True, slots=True)
class ModelRunnerSpec(ComponentSpec):
    """A model runner. ``factory(config, selection)`` returns a `fdplug.plugin_api.model_runner.ModelRunner`.

    ``weight_formats`` are the formats of the model's linear layers (attention, dense MLPs, shared
    experts) it executes: ``none`` (float), ``fp8_block`` (e4m3 with block scales), ... The routed
    experts are the MoE backend's (`MoEBackendSpec.weight_formats`). ``structured_outputs``: it holds
    a request to its `SamplingParams.structured_outputs` (else the engine refuses such requests).
    """

    weight_formats: tuple[str, ...] = ("none",)
    structured_outputs: bool = False

    role = "runner"


@dataclass(frozen=True, slots=True)
class AttentionBackendSpec(ComponentSpec):
    """An attention backend. ``factory(config)`` returns a `fdplug.plugin_api.attention.AttentionBackend`.

    ``measure_key`` (API 4.7; also `MoEBackendSpec`'s): as `OpSpec.measure_key`, for a backend whose
    speed against the core's ``reference`` depends on the machine. Chosen by priority (not by name,
    nor with FDPLUG_OP_TIMING=0), it is timed against ``reference`` once before the model is built,
    on synthetic inputs of the model's shapes (`fdplug.core.worker.backend_timing`: attention on
    decode steps of 1 and 32 sequences and a prefill chunk, the routed experts on 1, 32 and 256
    tokens in the model's expert format), and the reference runs where it is slower at any of them
    (beyond noise). ``measure_key(config)`` changes whenever those figures could; they are cached under it.
    """

    measure_key: Callable[[EngineView], str] | None = None

    role = "attention"


@dataclass(frozen=True, slots=True)
class MoEBackendSpec(ComponentSpec):
    """A MoE backend. ``factory(config)`` returns a `fdplug.plugin_api.moe.MoEBackend`.

    ``weight_formats`` are the expert weight formats it executes: ``none`` (plain float weights),
    ``fp8_block`` (float8_e4m3 weights with per-block scales), ...
    """

    weight_formats: tuple[str, ...] = ("none",)
    measure_key: Callable[[EngineView], str] | None = None   # `AttentionBackendSpec.measure_key`

    role = "moe"


@dataclass(frozen=True, slots=True)
class OpSpec(ComponentSpec):
    """A kernel for one op of the portable model (``op`` names one of `fdplug.plugin_api.ops.OPS`).

    ``factory(config)`` returns a callable with that op's contract. Selected per op, like the other
    components: the highest priority that runs on the device and whose ``supports`` does not object.

    ``bf16_inputs`` (``linear`` and ``gguf_linear`` only): bf16 math. ``linear``: with bf16 weights
    the kernel rounds ``x`` to bf16 and sums the exact bf16 products in float32 (as vLLM and
    transformers compute a bf16 model); float32 weights it computes as any other. ``gguf_linear``:
    ``x`` and each decoded weight rounded to bf16, the products summed in float32 (the rounding is
    far below the blocks' own; llama.cpp quantizes ``x`` to 8 bits). The conformance kit compares it
    with the portable op on the rounded values; `fdplug explain` says which math a model gets.

    ``q8_inputs`` (``gguf_linear`` only; API 3.14): q8 math, as llama.cpp computes GGUF models: ``x``
    quantized to 8-bit integers in runs of 4 values (``True``; API 4.4: or the run length, 4, 8, 16 or
    32, `q8_run` gives it), one float32 scale a run
    (`fdplug.plugin_api.gguf_formats.q8_inputs` defines the values), each run's products with the
    decoded weights summed exactly; the result is the portable op's on those values, up to float32
    rounding. Rows of F16 and BF16 (no integers to keep) are computed as without it. The conformance
    kit compares it so; `fdplug explain` says which math a model gets.

    ``prepare`` (``linear``, ``fp8_linear`` and ``gguf_linear`` only), like ``factory`` called with
    the config: returns a function that the core calls once per such layer after load with its
    weight ``[N, K]`` (``gguf_linear``: each block-type group's bytes and its type); what that returns
    (a `fdplug.plugin_api.ops.PreparedWeight`, or None to keep the weight as it is) is what the kernel
    then receives as that layer's ``weight`` (FP8 scales stay as they are).

    ``measure_key`` (`fdplug.plugin_api.ops.MEASURED_OPS`; the row ops since API 4.5, ``fp8_linear``,
    ``gguf_linear``, ``decoder_stack`` since 4.6): for a kernel whose speed against the portable op
    depends on the machine (a CPU's instruction-set level, a GPU's generation). Chosen by priority
    (not by name), it is then timed against the portable op once on the model's shapes at the row
    counts the engine gives it, and runs only where it is not slower at any of them (beyond noise): a
    linear kernel (``linear``, ``fp8_linear``, ``gguf_linear``) per layer shape (a GGUF projection's
    per block type; the other shapes run the portable op, `fdplug.core.worker.op_timing`), a row op's
    (``rms_norm``, ``add_rms_norm``, ``rope``, ``swiglu``, ``argmax``) per op: slower on any shape, and
    the op runs the portable one (`fdplug.core.worker.row_op_timing`), a ``decoder_stack`` on the
    loaded model's decode steps against its layers one by one (`fdplug.core.worker.stack_timing`).
    ``measure_key(config)`` is a string that changes whenever those figures could (the CPU model and
    level, the kernel build, the thread count): the figures are cached under it. Named with
    ``--op-kernel``, the kernel runs everywhere.
    """

    op: str = ""
    bf16_inputs: bool = False
    q8_inputs: bool | int = False
    prepare: Callable[[EngineView], Callable[[Any], Any]] | None = None
    measure_key: Callable[[EngineView], str] | None = None

    role = "op"

    @property
    def q8_run(self) -> int:
        """The values a scale of ``q8_inputs`` (0: not q8 math; ``True``: 4)."""
        from fdplug.plugin_api.gguf_formats import Q8_RUN  # (not at import: validate_spec says why)

        return 0 if self.q8_inputs is False else Q8_RUN if self.q8_inputs is True else int(self.q8_inputs)


@dataclass(frozen=True, slots=True)
class KVConnectorSpec(ComponentSpec):
    """A KV connector (`fdplug.plugin_api.kv_connector`): moves KV blocks between a prefill and a
    decode instance. ``factory(config, role, caches)`` returns a ``KVSender`` for role ``"prefill"``
    and a ``KVReceiver`` for ``"decode"`` (``caches``: a ``KVCaches``). Selected only for an instance
    with a ``--role``; ``supports(config)`` may refuse (an opaque cache layout, a missing transport).
    """

    role = "kv_connector"


@dataclass(frozen=True, slots=True)
class FeatureStorageSpec:
    """A feature storage for the URL ``schemes`` it handles.

    ``factory(config)`` returns a `fdplug.plugin_api.storage.FeatureStorage`; it is called lazily, the first
    time a URL of one of these schemes is fetched, so credentials are read only when needed.
    """

    name: str
    schemes: tuple[str, ...]
    factory: Callable[[EngineView], FeatureStorage]
    priority: int = 0
    description: str = ""

    role = "storage"


SPEC_TYPES: dict[str, type] = {
    "device": DeviceSpec,
    "runner": ModelRunnerSpec,
    "attention": AttentionBackendSpec,
    "moe": MoEBackendSpec,
    "op": OpSpec,
    "storage": FeatureStorageSpec,
    "kv_connector": KVConnectorSpec,
    "setting": Setting,
    "reasoning_parser": ReasoningParserSpec,
    "tool_parser": ToolParserSpec,
}
