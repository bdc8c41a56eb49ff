"""Seeded random cases for checking attention and MoE backends against the CPU reference.

Used by the conformance kit and by fdplug's own tests. A case is plain numpy; ``run_attention``
plays it through a backend on a given paddle place in two steps (a context prefill, then the
queries), so a backend must both write the cache correctly and read it back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from fdplug.plugin_api.attention import AttentionMetadata, causal_key_end, cdiv
from fdplug.plugin_api.moe import Routing


@dataclass(slots=True)
class SeqCase:
    """One sequence: ``context`` tokens already cached by step 1, then ``query`` new tokens in step 2.

    ``spans`` are bidirectional ranges ``[start, end)`` of positions (an image's placeholder tokens):
    every token inside a span sees the whole span.
    """

    context: int
    query: int
    spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass(slots=True)
class AttentionCase:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    seqs: list[SeqCase]
    seed: int

    def describe(self) -> str:
        shapes = ", ".join(f"{s.context}+{s.query}{'(bi)' if s.spans else ''}" for s in self.seqs)
        return f"heads={self.num_heads}/{self.num_kv_heads} dim={self.head_dim} bs={self.block_size} seqs=[{shapes}]"


def key_end_with_spans(positions: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
    """The mask spec: causal, except that a token inside a span sees up to the span's end."""
    key_end = causal_key_end(positions)
    for start, end in spans:
        inside = (positions >= start) & (positions < end)
        key_end[inside] = np.maximum(key_end[inside], end)
    return key_end


def attention_cases(seed: int = 0) -> list[AttentionCase]:
    """A fixed, seeded family: decode-only, prefill-only, mixed, GQA, bidirectional spans, odd lengths."""
    rng = np.random.default_rng(seed)
    layouts = [(4, 4, 16, 16), (8, 2, 32, 16), (4, 1, 64, 32), (6, 3, 8, 8)]
    shapes = [
        [SeqCase(0, 7)],                                   # one prefill
        [SeqCase(5, 1), SeqCase(33, 1), SeqCase(1, 1)],    # decode batch
        [SeqCase(16, 1), SeqCase(0, 33), SeqCase(20, 12)], # mixed, chunked prefill
        [SeqCase(0, 100)],                                 # longer than a few blocks
    ]
    cases = []
    for i, (h, kvh, d, bs) in enumerate(layouts):
        for j, seqs in enumerate(shapes):
            cases.append(AttentionCase(h, kvh, d, bs, [SeqCase(s.context, s.query) for s in seqs],
                                       seed * 1000 + i * 10 + j))
        with_spans = [SeqCase(0, 24, [(3, 11)]), SeqCase(8, 16, [(10, 20)]), SeqCase(4, 1)]
        cases.append(AttentionCase(h, kvh, d, bs, with_spans, seed * 1000 + i * 10 + 9))
    rng.shuffle(cases)
    return cases


def _step_metadata(case: AttentionCase, starts: list[int], lens: list[int],
                   block_tables: np.ndarray) -> AttentionMetadata:
    positions = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lens)]).astype(np.int64)
    key_end = np.concatenate([key_end_with_spans(np.arange(s, s + n), seq.spans)
                              for s, n, seq in zip(starts, lens, case.seqs)]).astype(np.int64)
    seq_of_token = np.repeat(np.arange(len(lens)), lens)
    bs = case.block_size
    slots = block_tables[seq_of_token, positions // bs] * bs + positions % bs
    return AttentionMetadata(
        query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64),
        seq_lens=np.array([s + n for s, n in zip(starts, lens)], dtype=np.int64),
        positions=positions, key_end=key_end, slot_mapping=slots.astype(np.int64),
        block_tables=block_tables, block_size=bs)


def case_steps(case: AttentionCase) -> tuple[int, list[AttentionMetadata]]:
    """Blocks needed and the metadata of the two steps (the first only if some sequence has context).

    Block ids are shuffled, so a backend that assumes contiguous blocks fails.
    """
    rng = np.random.default_rng(case.seed)
    bs = case.block_size
    per_seq = [cdiv(s.context + s.query, bs) for s in case.seqs]
    ids = rng.permutation(np.arange(1, sum(per_seq) + 1))
    width = max(per_seq)
    tables = np.zeros((len(case.seqs), width), dtype=np.int64)
    offset = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = ids[offset:offset + n]
        offset += n
    steps = []
    with_context = [i for i, s in enumerate(case.seqs) if s.context > 0]
    if with_context:
        sub = case.seqs
        steps.append(_step_metadata(
            AttentionCase(case.num_heads, case.num_kv_heads, case.head_dim, bs, [sub[i] for i in with_context],
                          case.seed),
            [0] * len(with_context), [sub[i].context for i in with_context], tables[with_context]))
    steps.append(_step_metadata(case, [s.context for s in case.seqs], [s.query for s in case.seqs], tables))
    return sum(per_seq) + 1, steps


def case_tensors(case: AttentionCase, num_tokens: int, step: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng([case.seed, step])
    q = rng.standard_normal((num_tokens, case.num_heads, case.head_dim)).astype(np.float32)
    k = rng.standard_normal((num_tokens, case.num_kv_heads, case.head_dim)).astype(np.float32)
    v = rng.standard_normal((num_tokens, case.num_kv_heads, case.head_dim)).astype(np.float32)
    return q, k, v


def run_attention(backend, case: AttentionCase, place: str = "cpu", dtype: str = "float32",
                  kv_dtype: str | None = None) -> list[np.ndarray]:
    """Play a case through ``backend`` on ``place`` (computing in ``dtype``, the caches in ``kv_dtype``,
    default ``dtype``); returns each step's output as float32 numpy."""
    import paddle

    num_blocks, steps = case_steps(case)
    shape = backend.kv_cache_shape(num_blocks, case.block_size, case.num_kv_heads, case.head_dim)
    previous = paddle.get_device()
    paddle.set_device(place)
    try:
        key_cache = paddle.zeros(shape, dtype=kv_dtype or dtype)
        value_cache = paddle.zeros(shape, dtype=kv_dtype or dtype)
        outputs = []
        for i, meta in enumerate(steps):
            meta.validate()
            q, k, v = (paddle.to_tensor(x).astype(dtype) for x in case_tensors(case, meta.num_tokens, i))
            prepared = backend.prepare(meta)
            out = backend.forward(q, k, v, key_cache, value_cache, prepared, case.head_dim ** -0.5)
            outputs.append(out.astype("float32").numpy())
    finally:
        paddle.set_device(previous)
    return outputs


def naive_attention(case: AttentionCase) -> list[np.ndarray]:
    """The definition, in numpy, one query token at a time: what every backend must match."""
    num_blocks, steps = case_steps(case)
    group = case.num_heads // case.num_kv_heads
    keys = np.zeros((num_blocks * case.block_size, case.num_kv_heads, case.head_dim), np.float32)
    values = np.zeros_like(keys)
    outputs = []
    for i, meta in enumerate(steps):
        q, k, v = case_tensors(case, meta.num_tokens, i)
        keys[meta.slot_mapping], values[meta.slot_mapping] = k, v
        out = np.zeros_like(q)
        for s in range(meta.num_seqs):
            n = meta.seq_lens[s]
            pos = np.arange(n)
            slots = meta.block_tables[s, pos // case.block_size] * case.block_size + pos % case.block_size
            ks, vs = np.repeat(keys[slots], group, axis=1), np.repeat(values[slots], group, axis=1)
            for t in range(meta.query_start_loc[s], meta.query_start_loc[s + 1]):
                scores = np.einsum("hd,khd->hk", q[t], ks) * case.head_dim ** -0.5
                scores[:, meta.key_end[t]:] = -np.inf
                p = np.exp(scores - scores.max(axis=1, keepdims=True))
                out[t] = np.einsum("hk,khd->hd", p / p.sum(axis=1, keepdims=True), vs)
        outputs.append(out)
    return outputs


# ---------------------------------------------------------------------------------------------------
# MoE
# ---------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class MoECase:
    num_tokens: int
    hidden: int
    intermediate: int
    num_experts: int
    routing: Routing
    seed: int

    @property
    def label(self) -> str:
        r = self.routing
        return (f"T{self.num_tokens}-E{self.num_experts}-k{r.top_k}-{r.scoring}"
                f"{'-bias' if r.bias else ''}{f'-g{r.topk_groups}of{r.num_groups}' if r.num_groups > 1 else ''}")


def moe_cases(seed: int = 0) -> list[MoECase]:
    """Every routing variant: Qwen (softmax, renormalised or not), ERNIE-4.5 (biased selection, floor),
    DeepSeek-V3/GLM-4.5 (sigmoid, groups, scaling), and shapes from one token to a prefill's worth."""
    return [MoECase(1, 32, 16, 4, Routing(1), seed),
            MoECase(17, 64, 32, 8, Routing(2, renormalize=True), seed + 1),
            MoECase(64, 32, 48, 16, Routing(4), seed + 2),
            MoECase(5, 16, 8, 3, Routing(3, renormalize=True), seed + 3),
            MoECase(33, 32, 24, 8, Routing(2, bias=True, renormalize=True, norm_floor=1e-12, router_dtype="float32"),
                    seed + 4),
            MoECase(40, 32, 16, 16, Routing(4, scoring="sigmoid", bias=True, num_groups=4, topk_groups=2,
                                            renormalize=True, norm_floor=1e-20, scaling=2.5), seed + 5),
            MoECase(9, 24, 40, 6, Routing(2, scoring="sigmoid", scaling=1.5), seed + 6)]


def moe_case_arrays(case: MoECase) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(case.seed)
    e, h, i = case.num_experts, case.hidden, case.intermediate
    return {"hidden": rng.standard_normal((case.num_tokens, h)).astype(np.float32),
            "logits": rng.standard_normal((case.num_tokens, e)).astype(np.float32),
            "gate": (rng.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32),
            "up": (rng.standard_normal((e, i, h)) / np.sqrt(h)).astype(np.float32),
            "down": (rng.standard_normal((e, h, i)) / np.sqrt(i)).astype(np.float32),
            "bias": (0.2 * rng.standard_normal(e)).astype(np.float32)}


def run_moe(backend, case: MoECase, place: str = "cpu") -> np.ndarray:
    """The backend's output for the case, routed by the core's `select_experts`."""
    import paddle

    from fdplug.core.portable.moe_routing import select_experts
    from fdplug.plugin_api.moe import ExpertWeights

    arrays = moe_case_arrays(case)
    previous = paddle.get_device()
    paddle.set_device(place)
    try:
        t = {name: paddle.to_tensor(a) for name, a in arrays.items()}
        layer = backend.load_weights(ExpertWeights(t["gate"], t["up"], t["down"]))
        weights, ids = select_experts(t["logits"], case.routing, t["bias"] if case.routing.bias else None)
        return backend.forward(t["hidden"], weights, ids, layer).astype("float32").numpy()
    finally:
        paddle.set_device(previous)


def naive_routing(logits: np.ndarray, routing: Routing, bias: np.ndarray | None = None
                  ) -> tuple[np.ndarray, np.ndarray]:
    """The routing rule written from the formulas, token by token in float64: ``(weights, ids)``."""
    logits = logits.astype(np.float64)
    if routing.scoring == "softmax":
        z = np.exp(logits - logits.max(axis=1, keepdims=True))
        scores = z / z.sum(axis=1, keepdims=True)
    else:
        scores = 1.0 / (1.0 + np.exp(-logits))
    weights, ids = [], []
    for row in scores:
        choice = row + (bias if routing.bias else 0.0)
        if routing.num_groups > 1:
            groups = choice.reshape(routing.num_groups, -1)
            group_score = np.sort(groups, axis=1)[:, ::-1][:, :2].sum(axis=1)
            kept = np.argsort(-group_score, kind="stable")[:routing.topk_groups]
            allowed = np.zeros_like(groups, dtype=bool)
            allowed[kept] = True
            choice = np.where(allowed.reshape(-1), choice, -np.inf)
        top = np.argsort(-choice, kind="stable")[:routing.top_k]
        w = row[top]
        if routing.renormalize:
            w = w / max(w.sum(), routing.norm_floor)
        weights.append(w * routing.scaling)
        ids.append(top)
    return np.array(weights).reshape(-1, routing.top_k), np.array(ids).reshape(-1, routing.top_k)


def naive_moe(case: MoECase) -> np.ndarray:
    """The case's MoE output from the formulas: naive routing, then each chosen expert in float64."""
    a = {k: v.astype(np.float64) for k, v in moe_case_arrays(case).items()}
    weights, ids = naive_routing(a["logits"], case.routing, a["bias"])
    out = np.zeros_like(a["hidden"])
    for t in range(case.num_tokens):
        for e, w in zip(ids[t], weights[t]):
            x = a["hidden"][t]
            g, u = a["gate"][e] @ x, a["up"][e] @ x
            out[t] += w * (a["down"][e] @ (g / (1 + np.exp(-g)) * u))
    return out.astype(np.float32)
