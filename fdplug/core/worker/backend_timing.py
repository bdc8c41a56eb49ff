"""Selection that measures, for the attention and MoE backends: one chosen by priority runs only where
it is not slower than the core's ``reference`` on this machine, at this model's shapes.

Why: as for the op kernels (`op_timing`, `row_op_timing`, `stack_timing`), a priority says nothing of
a backend's speed on a given machine: a compiled kernel's fallback below the instruction-set level it
was written for, another plugin's backend on a device generation it was not tuned for. A backend
whose spec names a ``measure_key`` (`AttentionBackendSpec.measure_key`, plugin API 4.7), chosen by
priority, is timed against the reference once per machine and shape, on synthetic inputs:

- attention, one layer's ``forward`` (a step's ``prepare`` is done once, outside: every layer of the
  step shares it) on a decode step of 1 and 32 sequences of `CONTEXT` keys each, and on a prefill
  chunk of `PREFILL` tokens, in KV caches of the backend's own layout (`kv_cache_shape`) and dtype;
- the routed experts, one layer's ``forward`` on 1, 32 and 256 tokens in each expert format the
  model's MoE layers have (float, FP8 blocks, a GGUF file's types), with the model's top-k over as
  many of its experts as `EXPERT_BYTES` holds (a large model's layer would take gigabytes).

Microseconds a call, interleaved pairs, medians (`timing_cache`), cached under the backend's
``measure_key`` with the shapes in each item's name, so that `fdplug explain --model DIR` prints them
too. Slower anywhere (beyond the timing's noise) or a failed timing, and the reference is selected
instead, before the model is built: the backend object goes into every layer, and a MoE backend
converts the experts to its own layout at load and drops the checkpoint's.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from fdplug.core.worker import timing_cache as tc
from fdplug.core.worker.timing_cache import Figures, Timing

logger = logging.getLogger(__name__)

CONTEXT = 512             # keys a decode step's sequences have (within the model's length)
DECODE_SEQUENCES = (1, 32)
PREFILL = 256             # tokens of a prefill chunk (within the model's length)
MOE_TOKENS = (1, 32, 256)
EXPERT_BYTES = 64 << 20   # the timing's experts: at most this many bytes (and at least the top-k)


@dataclass(frozen=True, slots=True)
class Case:
    """One timed item: its name (the shapes it stands for) and the sizes it is timed at."""

    name: str
    rows: tuple[int, ...]
    unit: str             # what ``rows`` counts
    build: Any            # (backend, rng) -> (rows -> a call without arguments): the weights loaded once


@dataclass(frozen=True, slots=True)
class BackendPlan:
    """One role's backend against the reference on the model's cases, and whether it keeps the role."""

    role: str
    backend: str
    timings: tuple[Timing, ...]
    cached: bool

    @property
    def keeps(self) -> bool:
        return all(t.kernel_wins for t in self.timings)

    def describe(self) -> str:
        lost = "; ".join(f"{t.subject.name.split(':')[0]} at {'/'.join(map(str, t.slower_at))} {t.subject.unit}"
                         if t.rows else f"{t.subject.name.split(':')[0]}: its timing failed" for t in self.timings
                         if not t.kernel_wins)
        verdict = self.backend if self.keeps else f"reference ({self.backend} slower on {lost})"
        lines = [f"{self.role} backend ({'cached figures' if self.cached else 'measured now'}; one layer's call) "
                 f"-> {verdict}"]
        for t in self.timings:
            figures = t.figures(self.backend, "reference").replace(" rows", f" {t.subject.unit}")
            lines.append(f"  {t.subject.name}: {figures}")
        return "\n".join(lines)


def plan_backends(selection: Any, config: Any, model_config: Any) -> list[BackendPlan]:
    """The plans of the measured backend roles (`Selection.measured_ops`) on ``model_config``'s shapes;
    a role whose figures' lock another process held too long keeps its backend, unplanned."""
    plans = []
    for role, cases in (("attention", attention_cases(model_config, config)),
                        ("moe", moe_cases(model_config, config.dtype))):
        spec = getattr(selection, role)
        if role in selection.measured_ops and spec.measure_key is not None and cases and \
                (plan := _plan(role, spec, cases, selection, config)) is not None:
            plans.append(plan)
    return plans


def settle(selection: Any, config: Any, model_config: Any) -> Any:
    """Plan, log, and select the reference for each role whose backend lost. -> the selection."""
    from fdplug.core.portable.op_specs import REFERENCE_BACKENDS

    for plan in plan_backends(selection, config, model_config):
        for line in plan.describe().splitlines():
            logger.info(line)
        if not plan.keeps:
            selection = dataclasses.replace(selection, **{plan.role: REFERENCE_BACKENDS[plan.role]})
    return selection


def _plan(role: str, spec: Any, cases: list[Case], selection: Any, config: Any) -> BackendPlan | None:
    from fdplug.core.portable.op_specs import REFERENCE_BACKENDS

    key = tc.cache_key(spec.name, role, config.dtype, spec.measure_key(config), "us a layer's call")
    sync = tc.on_device(selection.device.paddle_place_name(config.device_index))
    backends = (spec.factory(config), REFERENCE_BACKENDS[role].factory(config))

    def time_case(case: Case) -> Figures | None:
        try:
            return _time_case(case, backends, sync)
        except Exception as exc:   # noqa: BLE001 - any failure: the reference runs
            logger.warning("timing %s backend %s on %s failed (%r): the reference runs", role, spec.name, case.name,
                           exc)
            return None

    found = tc.measured(tc.cache_path(key), key, cases, lambda c: c.name, time_case)
    if found is None:
        return None
    figures, cached = found
    return BackendPlan(role, spec.name, tuple(Timing.of(c, figures.get(c.name, tc.NO_FIGURES), "us") for c in cases),
                       cached)


def _time_case(case: Case, backends: tuple[Any, Any], sync: Any) -> Figures:
    import numpy as np

    rng = np.random.default_rng(len(case.name))
    kernel, portable = (case.build(backend, rng) for backend in backends)
    got: Figures = {"rows": list(case.rows), "kernel": [], "portable": []}
    for rows in case.rows:
        calls = {"kernel": kernel(rows), "portable": portable(rows)}
        for name, seconds in tc.median_seconds(calls, sync).items():
            got[name].append(seconds * 1e6)
    return got


def attention_cases(cfg: Any, config: Any) -> list[Case]:
    """A decode step's and a prefill chunk's attention for ``cfg``'s heads, in ``config``'s KV cache."""
    longest = config.max_model_len or cfg.max_position_embeddings
    context, prefill, block = min(CONTEXT, longest), min(PREFILL, longest), config.block_size
    heads = (f"{cfg.num_heads}/{cfg.num_kv_heads} heads x {cfg.head_dim}, {config.dtype}, kv {config.kv_dtype()}, "
             f"blocks of {block}")

    def decode(backend: Any, rng: Any) -> Any:
        return lambda seqs: attention_call(backend, cfg, config, *step_metadata(seqs, 1, context, block), rng)

    def prefill_chunk(backend: Any, rng: Any) -> Any:
        return lambda tokens: attention_call(backend, cfg, config, *step_metadata(1, tokens, tokens, block), rng)

    return [Case(f"decode, {context} keys a sequence: {heads}", DECODE_SEQUENCES, "sequences", decode),
            Case(f"prefill: {heads}", (prefill,), "tokens", prefill_chunk)]


def step_metadata(seqs: int, query_len: int, context: int, block_size: int) -> tuple[Any, int]:
    """`AttentionMetadata` of one step: ``seqs`` sequences of ``context`` keys, the last ``query_len`` of
    each queried (decode: 1; a fresh prompt: all), each in blocks of its own. -> (it, the blocks used)."""
    import numpy as np

    from fdplug.plugin_api.attention import AttentionMetadata, causal_key_end, cdiv

    blocks = cdiv(context, block_size)
    positions = np.tile(np.arange(context - query_len, context, dtype=np.int64), seqs)
    tables = 1 + np.arange(seqs * blocks, dtype=np.int64).reshape(seqs, blocks)   # block 0: the null block
    seq_of_token = np.repeat(np.arange(seqs), query_len)
    slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    meta = AttentionMetadata(query_start_loc=np.arange(seqs + 1, dtype=np.int64) * query_len,
                             seq_lens=np.full(seqs, context, dtype=np.int64), positions=positions,
                             key_end=causal_key_end(positions), slot_mapping=slots, block_tables=tables,
                             block_size=block_size)
    meta.validate()
    return meta, 1 + seqs * blocks


def attention_call(backend: Any, cfg: Any, config: Any, meta: Any, num_blocks: int, rng: Any) -> Any:
    """One layer's ``forward`` on caches of random keys and values, as a call without arguments."""
    import numpy as np
    import paddle

    def tensor(*shape: int, dtype: str = config.dtype) -> Any:
        return paddle.to_tensor(rng.standard_normal(shape, dtype=np.float32)).astype(dtype)

    shape = backend.kv_cache_shape(num_blocks, meta.block_size, cfg.num_kv_heads, cfg.head_dim)
    key_cache, value_cache = (tensor(*shape, dtype=config.kv_dtype()) for _ in range(2))
    tokens, d = meta.num_tokens, cfg.head_dim
    q, k, v = tensor(tokens, cfg.num_heads, d), tensor(tokens, cfg.num_kv_heads, d), tensor(tokens, cfg.num_kv_heads, d)
    prepared = backend.prepare(meta)
    return lambda: backend.forward(q, k, v, key_cache, value_cache, prepared, d ** -0.5)


def moe_cases(cfg: Any, dtype: str) -> list[Case]:
    """One case per expert format of ``cfg``'s MoE layers (none for a dense model), ``dtype`` the compute dtype."""
    from fdplug.core.worker.expert_samples import expert_formats

    return [] if cfg.moe is None else [moe_case(cfg, fmt, dtype) for fmt in expert_formats(cfg)]


def moe_case(cfg: Any, fmt: Any, dtype: str) -> Case:
    """One layer's routed experts in ``fmt`` (an `expert_samples.ExpertFormat`)."""
    from fdplug.core.worker.expert_samples import experts_call

    def build(backend: Any, rng: Any) -> Any:
        return experts_call(backend, cfg, fmt, dtype, EXPERT_BYTES, rng)

    return Case(f"routed experts: {fmt.describe(cfg, dtype, EXPERT_BYTES)}", MOE_TOKENS, "tokens", build)
