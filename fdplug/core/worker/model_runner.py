"""The device-agnostic model runner: one step of the scheduler's plan on the selected device.

Per step: apply the scheduler's changes to the persistent ``InputBatch``, build the flattened
inputs and the attention metadata with numpy (no Python loop over tokens), run the model once,
compute logits only for the rows that sample, sample, and record the sampled tokens.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from functools import partial

import numpy as np

from fdplug.core.config import EngineConfig
from fdplug.core.model.sampling.penalties import penalty_tokens, record_tokens
from fdplug.core.model.sampling.sampler import Sampler
from fdplug.core.portable.grammar_masks import GrammarMasks
from fdplug.core.structured.grammars import compiler_for
from fdplug.core.worker.input_batch import InputBatch
from fdplug.core.worker.kv_cache import (
    allocate_kv_caches,
    bytes_per_block,
    plan_kv_cache,
)
from fdplug.core.worker.load_checks import check_weights_fit, expert_parallel_group
from fdplug.core.worker.mm_inputs import (
    item_slot_values,
    mm_embeddings,
    modality_rows,
    mrope_positions,
    span_offsets,
)
from fdplug.core.worker.sampling import plain_greedy, sampled_logprobs, sampling_metadata
from fdplug.plugin_api.attention import AttentionMetadata, cdiv
from fdplug.plugin_api.model_runner import KVCachePlan, ModelInfo, ModelRunnerOutput
from fdplug.plugin_api.ops import PREPARED_OPS, Kernels
from fdplug.plugin_api.paddle import import_paddle
from fdplug.plugin_api.scheduled_work import NewRequestData, SchedulerOutput
from fdplug.plugin_api.selection import Selection

logger = logging.getLogger("fdplug")


@dataclass(slots=True)
class StepInputs:
    req_ids: list[str]
    slots: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    meta: AttentionMetadata
    logits_rows: np.ndarray      # row of hidden for each sampling request
    sampling_slots: np.ndarray
    sampling_req_ids: list[str]
    mm_rows: np.ndarray | None = None      # token rows whose embedding is a feature row
    mm_values: np.ndarray | None = None    # [len(mm_rows), hidden] those feature rows
    rope_positions: np.ndarray | None = None   # [3, T] with multimodal RoPE (`meta` keeps the token indices)
    modality_rows: tuple | None = None     # modality experts: (text rows, vision rows)


class ModelRunner:
    """Owns the model, the KV caches and the input batch of one device (`fdplug.plugin_api.model_runner`)."""

    def __init__(self, config: EngineConfig, selection: Selection) -> None:
        self.config = config
        self.selection = selection
        self.paddle = import_paddle()
        self.place = selection.device.paddle_place_name(config.device_index)
        self.mrope = None   # multimodal RoPE's rule (`MRopeRule`), set by `load_model` for such a model
        self.image_encoder = None   # a picture's bytes -> features (`ImageEncoder`), for a vision-language model

    # -- setup ------------------------------------------------------------------------------------

    def load_model(self) -> ModelInfo:
        from fdplug.core.model.checkpoint.config import ModelConfig
        from fdplug.core.model.checkpoint.footprint import model_summary
        from fdplug.core.model.layers.fused_stack import attach as attach_stack
        from fdplug.core.model.loader import load_model
        from fdplug.core.worker.backend_timing import settle as settle_backends
        from fdplug.core.worker.op_timing import LINEAR_OPS, plan_linear
        from fdplug.core.worker.row_op_timing import plan_row_ops
        from fdplug.core.worker.stack_timing import plan_stack

        self.paddle.set_device(self.place)
        cfg = ModelConfig.from_dir(self.config.model_dir, self.config.quantization)
        cfg.keep_weights(self.config.dtype, self.config.weight_dtype)
        group = expert_parallel_group(self.config, cfg)
        footprint = check_weights_fit(cfg, self.config.dtype, self.selection, group.size if group else 1)
        self.selection = settle_backends(self.selection, self.config, cfg)   # a backend only where not slower
        self.attn_backend = self.selection.attention.factory(self.config)
        self.moe_backend = self.selection.moe.factory(self.config) if cfg.moe is not None else None
        linear_plans = [plan for op in LINEAR_OPS if (plan := plan_linear(self.selection, self.config, cfg, op))]
        for line in (line for plan in linear_plans for line in plan.describe().splitlines()):
            logger.info(line)
        ops = self.selection.ops
        kernels = Kernels(**{op: spec.factory(self.config) for op, spec in ops.items()},
                          **{f"prepare_{op}": ops[op].prepare(self.config) for op in PREPARED_OPS if ops[op].prepare})
        self.model, self.model_config = load_model(self.config.model_dir, self.attn_backend, dtype=self.config.dtype,
                                                   max_positions=self.config.max_model_len, kernels=kernels,
                                                   moe_backend=self.moe_backend, quantization=self.config.quantization,
                                                   weight_dtype=self.config.weight_dtype, expert_parallel=group,
                                                   linear_plans=linear_plans)
        self.model.eval()
        logger.info(attach_stack(self.model, kernels, self.selection))
        stack_plan = plan_stack(self.model, self.attn_backend, self.selection, self.config)   # kept where not slower
        if stack_plan is not None:
            logger.info(stack_plan.describe())
            self.selection = stack_plan.settle(self.model, self.selection)
        row_plan = plan_row_ops(self.selection, self.config, cfg)   # a row op's kernel only where not slower
        if row_plan is not None:
            self.selection, kernels, lines = row_plan.settle(self.model, kernels, self.selection, self.config)
            for line in lines:
                logger.info(line)
        self.argmax = kernels.argmax
        mm = self.model_config.multimodal
        self.mrope = mm.mrope_rule() if mm is not None and self.model_config.rope.mrope_section else None
        if mm is not None and mm.image_spec is not None:   # pictures in: the model's vision tower
            from fdplug.core.model.loader import weight_files
            from fdplug.core.vision.encoder import ImageEncoder

            self.image_encoder = ImageEncoder(self.config.model_dir, weight_files(self.config.model_dir),
                                              self.model_config.architecture, mm.image_spec, kernels)
        # The routed experts live in the MoE backend's layout, not as parameters: count them as loaded.
        params = sum(int(np.prod(p.shape)) * p.element_size() for p in self.model.parameters())
        self.model_bytes = params + footprint.expert_bytes + self.model.head_copy_bytes()
        for line in model_summary(cfg, self.config.dtype, self.selection.moe.name, self.selection.ops).splitlines():
            logger.info(line)
        return ModelInfo(self.model_config.vocab_size, self.model_config.hidden_size, self.model_bytes)

    def initialize_kv_cache(self) -> KVCachePlan:
        cfg, config = self.model_config, self.config
        per_block = bytes_per_block(cfg.num_layers, config.block_size, cfg.num_kv_heads, cfg.head_dim, config.kv_dtype())  # noqa: E501 (file at the 300-line cap)
        free = self.selection.device.free_memory(0) if self.selection.device.free_memory else None
        plan = plan_kv_cache(config, per_block, config.max_model_len, free, self.model_bytes)
        self.kv_caches = allocate_kv_caches(self.attn_backend, plan, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                            config.kv_dtype())
        self.batch = self._new_batch()
        self.grammar = GrammarMasks(partial(compiler_for, config.model_dir, cfg.vocab_size))
        self.sampler = Sampler(seed=config.seed, argmax=self.argmax)
        return plan

    # -- one step ---------------------------------------------------------------------------------

    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        paddle = self.paddle
        t0 = time.perf_counter()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput({})
        inputs = self._prepare_inputs(so)
        prepared = self.attn_backend.prepare(inputs.meta)
        input_ids = paddle.to_tensor(inputs.input_ids)
        positions = paddle.to_tensor(inputs.positions if inputs.rope_positions is None else inputs.rope_positions)
        masks = self.grammar.start(inputs.sampling_req_ids)   # structured outputs: beside the forward pass
        t1 = time.perf_counter()
        with paddle.no_grad():
            embeds = None
            if inputs.mm_rows is not None:  # features replace their placeholders' embeddings
                embeds = paddle.scatter(self.model.embed(input_ids), paddle.to_tensor(inputs.mm_rows),
                                        paddle.to_tensor(inputs.mm_values).astype(self.config.dtype))
            modality = None if inputs.modality_rows is None else \
                tuple(None if rows is None else paddle.to_tensor(rows) for rows in inputs.modality_rows)
            hidden = self.model(input_ids, positions, self.kv_caches, prepared, inputs_embeds=embeds,
                                modality_rows=modality)
            if len(inputs.logits_rows) == 0:
                return ModelRunnerOutput({}, timings={"prepare": t1 - t0, "forward": time.perf_counter() - t1})
            rows = hidden if len(inputs.logits_rows) == hidden.shape[0] else \
                paddle.gather(hidden, paddle.to_tensor(inputs.logits_rows))
            logits = self.grammar.apply(masks, self.model.compute_logits(rows), paddle)
        t2 = time.perf_counter()
        if plain_greedy(self.batch, inputs.sampling_slots):
            sampled, logprobs = self.argmax(logits), {}
        else:
            meta = sampling_metadata(self.batch, inputs.sampling_slots)
            result = self.sampler(logits, meta)
            sampled = result.sampled_token_ids
            logprobs = sampled_logprobs(result, meta, inputs.sampling_req_ids)
        self._record_sampled(inputs, sampled)
        self.grammar.accept(inputs.sampling_req_ids, sampled)
        t3 = time.perf_counter()
        tokens = {rid: [int(t)] for rid, t in zip(inputs.sampling_req_ids, sampled)}
        return ModelRunnerOutput(tokens, logprobs, {"prepare": t1 - t0, "forward": t2 - t1, "sample": t3 - t2})

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.batch
        for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
            batch.remove(req_id)
            self.grammar.remove(req_id)
        for new in so.scheduled_new_reqs:
            self._add_request(new)
        for cached in so.scheduled_cached_reqs:
            slot = batch.slot_of(cached.req_id)
            n = batch.num_blocks[slot]
            batch.block_table[slot, n:n + len(cached.new_block_ids)] = cached.new_block_ids
            batch.num_blocks[slot] = n + len(cached.new_block_ids)
            batch.num_computed_tokens[slot] = cached.num_computed_tokens
        batch.condense()

    def held_requests(self) -> dict[str, tuple[int, int]]:
        """The requests this runner holds, each with (tokens whose KV is computed, tokens known);
        raises if its batch is inconsistent. The engine compares them with the scheduler after a
        failed step."""
        problems = self.batch.check()
        if problems:
            raise RuntimeError("input batch is inconsistent: " + "; ".join(problems))
        batch = self.batch
        return {rid: (int(batch.num_computed_tokens[slot]), int(batch.num_tokens[slot]))
                for rid, slot in batch.req_id_to_slot.items()}

    def drop_all_requests(self) -> None:
        """Forget every request, whatever state the batch is in (the engine then rebuilds them all
        from the scheduler). The KV cache is the scheduler's and stays as it is."""
        self.batch = self._new_batch()
        self.grammar.clear()

    def _new_batch(self) -> InputBatch:
        config = self.config
        return InputBatch(config.max_num_seqs, config.max_model_len, cdiv(config.max_model_len, config.block_size))

    def _add_request(self, new: NewRequestData) -> None:
        """Every value of the slot computed first, then one all-or-nothing ``InputBatch.add``."""
        tokens = [*new.prompt_token_ids, *new.output_token_ids]
        params = new.sampling_params
        penalty_ids, penalty_counts = penalty_tokens(new.prompt_token_ids, new.output_token_ids)
        values = {
            "token_ids": tokens, "num_tokens": len(tokens), "num_prompt_tokens": len(new.prompt_token_ids),
            "num_computed_tokens": new.num_computed_tokens, "block_table": new.block_ids,
            "num_blocks": len(new.block_ids), "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "min_p": params.min_p, "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty, "repetition_penalty": params.repetition_penalty,
            "penalised": params.has_penalties,
            "plain_greedy": params.is_greedy and not params.has_penalties and params.logprobs is None,
            "seed": 0 if params.seed is None else params.seed, "seeded": params.seed is not None,
            "num_logprobs": -1 if params.logprobs is None else params.logprobs,
            "mm_positions": tuple(new.mm_positions), "penalty_ids": penalty_ids, "penalty_counts": penalty_counts,
            "num_penalty_ids": len(penalty_ids),
        }
        if new.mm_positions:
            values |= item_slot_values(self.mrope, tuple(new.mm_positions))
        spans = [item for item in new.mm_positions if item.span_length]
        if spans:
            values["key_end_offset"] = span_offsets(spans)
        if params.structured_outputs is not None:   # first: a constraint that fails leaves the batch as it was
            self.grammar.add(new.req_id, params.structured_outputs, new.output_token_ids, new.prompt_token_ids,
                             params.reasoning_end_token_ids)
        self.batch.add(new.req_id, values)

    def _prepare_inputs(self, so: SchedulerOutput) -> StepInputs:
        batch, bs = self.batch, self.config.block_size
        req_ids = sorted(so.num_scheduled_tokens, key=batch.slot_of)
        slots = np.fromiter((batch.slot_of(r) for r in req_ids), dtype=np.int64, count=len(req_ids))
        counts = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        query_start = np.zeros(len(slots) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        seq_of_token = np.repeat(np.arange(len(slots)), counts)
        start = batch.num_computed_tokens[slots]
        positions = np.arange(total, dtype=np.int64) - query_start[seq_of_token] + start[seq_of_token]
        token_slots = slots[seq_of_token]
        width = int(batch.num_blocks[slots].max())
        block_tables = batch.block_table[slots, :width]
        slot_mapping = block_tables[seq_of_token, positions // bs] * bs + positions % bs
        key_end = positions + 1 + batch.key_end_offset[token_slots, positions]
        seq_lens = start + counts
        meta = AttentionMetadata(query_start, seq_lens, positions, key_end, slot_mapping, block_tables, bs)
        samples = seq_lens >= batch.num_tokens[slots]        # the step reaches the last known token
        mm_rows, mm_values = mm_embeddings(batch, self.model_config.hidden_size, so, slots, start, query_start) \
            if so.mm_features else (None, None)
        rope = None if self.mrope is None else mrope_positions(batch, self.mrope, positions, token_slots,
                                                               self.config.max_model_len)
        mm = self.model_config.multimodal
        modality = modality_rows(batch, mm, slots, start, query_start) if self.model_config.moe is not None and \
            self.model_config.moe.vision is not None else None
        return StepInputs(req_ids, slots, batch.token_ids[token_slots, positions], positions, meta,
                          query_start[1:][samples] - 1, slots[samples],
                          [r for r, s in zip(req_ids, samples) if s], mm_rows, mm_values, rope, modality)

    def _record_sampled(self, inputs: StepInputs, sampled: np.ndarray) -> None:
        batch = self.batch
        batch.num_computed_tokens[inputs.slots] = inputs.meta.seq_lens
        slots = inputs.sampling_slots
        ends = batch.num_tokens[slots]
        batch.token_ids[slots, ends] = sampled
        batch.num_tokens[slots] = ends + 1
        counted = batch.penalised[slots]     # only penalised rows' tables are ever read (sampling_metadata)
        if counted.any():
            record_tokens(batch.penalty_ids, batch.penalty_counts, batch.num_penalty_ids, slots[counted],
                          sampled[counted])
