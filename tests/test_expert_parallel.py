"""Expert parallel on real paddle.distributed processes (gloo, 2 ranks on this machine).

Each rank holds half of a MoE layer's experts and its own tokens. Through either exchange every
rank's tokens get the same outputs as one rank holding every expert (float32 rounding apart: the
parts are summed in another order), including steps where one rank has no tokens at all (it runs
the collectives with zero rows and gets zero rows back; nobody waits on it). gloo has no
all_to_all, so `AllToAllExchange`'s own routing runs here over an all_gather stand-in for
``alltoall_single`` (``GatheredAllToAll``); the capability probe itself is checked on gloo.

The lockstep protocol (`lockstep.LockstepGroup`) runs with blocks that make one real collective a
layer: a rank idle for many passes of the other never blocks it, a pass that raises part way is
finished with dummy layers (the other rank's pass completes), and a leaving rank ends both loops.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fdplug.core.parallel.exchange import AllToAllExchange, ExpertShard

EXPERTS, HIDDEN, INTER, TOP_K = 4, 16, 24, 2
STEPS = [(5, 3), (4, 0), (0, 2), (0, 0), (1, 1)]    # tokens of rank 0 and rank 1 a step: idle ranks included

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="paddle.distributed.spawn with gloo: Linux")


def experts(seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = {"gate": (EXPERTS, INTER, HIDDEN), "up": (EXPERTS, INTER, HIDDEN), "down": (EXPERTS, HIDDEN, INTER)}
    return {name: (rng.standard_normal(s) * 0.3).astype(np.float32) for name, s in shape.items()}


def tokens(step: int, rank: int, count: int):
    rng = np.random.default_rng(100 * step + rank)
    x = rng.standard_normal((count, HIDDEN)).astype(np.float32)
    ids = np.array([rng.choice(EXPERTS, TOP_K, replace=False) for _ in range(count)]).reshape(count, TOP_K)
    weights = rng.random((count, TOP_K)).astype(np.float32)
    return x, ids.astype(np.int64), weights


def reference(first: int = 0, count: int = EXPERTS):
    """The reference backend on experts [first, first + count) and its loaded layer."""
    import paddle

    from fdplug.core.portable.moe import ReferenceMoE
    from fdplug.plugin_api.moe import ExpertWeights

    backend, weights = ReferenceMoE(), experts()
    return backend, backend.load_weights(ExpertWeights(*(paddle.to_tensor(weights[n][first:first + count])
                                                        for n in ("gate", "up", "down"))))


class GatheredAllToAll(AllToAllExchange):
    """`AllToAllExchange` with ``alltoall_single`` done as gloo can (every rank's pieces all_gathered,
    each rank keeping those sent to it): the exchange's own sorting, splitting and combining run."""

    def _counts(self, send):
        import paddle

        everyone = []
        self.comm.all_gather(everyone, paddle.to_tensor(send, dtype="int64"))
        return [int(sent.numpy()[self.shard.rank]) for sent in everyone]

    def _all_to_all(self, tensor, send, recv):
        import paddle

        from fdplug.core.parallel.exchange import _pad

        sizes, splits = [], []
        self.comm.all_gather(sizes, paddle.to_tensor([int(tensor.shape[0])], dtype="int64"))
        self.comm.all_gather(splits, paddle.to_tensor(send, dtype="int64"))
        parts = []
        self.comm.all_gather(parts, _pad(tensor, max(1, *(int(s.numpy()[0]) for s in sizes))))
        me = self.shard.rank
        pieces = [part[int(split.numpy()[:me].sum()):int(split.numpy()[:me + 1].sum())]
                  for part, split in zip(parts, splits)]
        out = paddle.concat(pieces)
        assert [int(p.shape[0]) for p in pieces] == recv
        return out


def exchange_main(out_dir: str, kind: str) -> None:
    import paddle
    import paddle.distributed as dist

    from fdplug.core.parallel.exchange import AllGatherExchange, has_all_to_all

    dist.init_parallel_env()
    rank = dist.get_rank()
    shard = ExpertShard(rank, dist.get_world_size(), EXPERTS)
    step_counts = {"now": [0, 0]}
    exchange = {"all_gather": AllGatherExchange(shard),      # counts gathered in the layer, or from the header:
                "all_gather_counted": AllGatherExchange(shard, counts=lambda: step_counts["now"]),
                "all_to_all": GatheredAllToAll(shard)}[kind]
    backend, layer = reference(shard.first, shard.count)
    results = {"has_all_to_all": has_all_to_all(), "steps": []}
    for step, counts in enumerate(STEPS):
        step_counts["now"] = list(counts)
        x, ids, w = tokens(step, rank, counts[rank])
        batch = exchange.dispatch(paddle.to_tensor(x), paddle.to_tensor(w), paddle.to_tensor(ids))
        ids_seen = batch.topk_ids.numpy().reshape(-1).tolist()
        assert all(0 <= i < shard.count for i in ids_seen), ids_seen
        rows = int(batch.hidden.shape[0])
        out = (backend.forward(batch.hidden, batch.topk_weights, batch.topk_ids, layer) if rows
               else paddle.zeros([0, HIDDEN]))
        results["steps"].append({"out": exchange.combine(out, batch).numpy().tolist(), "rows": rows})
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))
    leave(rank)


def test_a_store_wait_returns_what_it_saw_when_time_runs_out():
    """`arrivals_within` polls a store's counter (``add(key, 0)``) until the count or the timeout: the
    count as soon as it is reached, else the last value seen (how `leave_group` and the startup
    barrier tell who did not come)."""
    from fdplug.core.parallel.group_exit import arrivals_within

    class Store:                        # a counter that one more rank reaches on each poll, up to ``top``
        def __init__(self, top: int) -> None:
            self.value, self.top, self.polls = 0, top, 0

        def add(self, key: str, amount: int) -> int:
            assert key == "fdplug/done" and amount == 0
            self.polls += 1
            self.value = min(self.value + 1, self.top)
            return self.value

    store = Store(top=3)
    assert arrivals_within(store, "fdplug/done", 3, timeout=30) == 3 and store.polls == 3
    store = Store(top=1)
    started = time.monotonic()
    assert arrivals_within(store, "fdplug/done", 2, timeout=0.2) == 1
    assert 0.2 <= time.monotonic() - started < 5


def leave(rank: int) -> None:
    """A rank's end, as an engine process's: with the group, then at once (`group_exit`: a plain exit
    could abort in paddle's store after the rank's work was written); status 1 if a rank did not come."""
    from fdplug.core.parallel.group_exit import exit_process, leave_group

    exit_process(0 if leave_group(rank, 2, timeout=60) else 1)


@pytest.mark.parametrize("kind", ["all_gather", "all_gather_counted", "all_to_all"])
def test_two_ranks_give_one_ranks_outputs_with_idle_ranks(tmp_path, kind):
    import paddle.distributed as dist

    dist.spawn(exchange_main, args=(str(tmp_path), kind), nprocs=2, backend="gloo", join=True)
    backend, layer = reference()
    rows = {0: [], 1: []}
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["has_all_to_all"] is False       # gloo: the capability probe says so on every rank
        for step, counts in enumerate(STEPS):
            x, ids, w = tokens(step, rank, counts[rank])
            want = (backend.forward(*(__import__("paddle").to_tensor(a) for a in (x, w, ids)), layer).numpy()
                    if counts[rank] else np.zeros((0, HIDDEN), np.float32))
            mine = np.asarray(got["steps"][step]["out"], np.float32).reshape(counts[rank], HIDDEN)
            np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-5, err_msg=f"rank {rank}, step {step}")
            rows[rank].append(got["steps"][step]["rows"])
    for step, counts in enumerate(STEPS):       # every assignment ran once, on its expert's rank
        assert rows[0][step] + rows[1][step] == TOP_K * sum(counts)


def test_a_shard_runs_only_its_assignments():
    import paddle

    shard = ExpertShard(1, 2, 4)
    assert (shard.first, shard.count) == (2, 2)
    token, ids, w = shard.assignments(paddle.to_tensor([[0, 3], [2, 1], [3, 2]]),
                                      paddle.to_tensor([[0.5, 0.25], [0.75, 0.125], [1.0, 2.0]]))
    assert token.numpy().tolist() == [0, 1, 2, 2]
    assert ids.numpy().tolist() == [[1], [0], [1], [0]] and w.numpy().tolist() == [[0.25], [0.75], [1.0], [2.0]]
    assert shard.owner(paddle.to_tensor([0, 1, 2, 3])).numpy().tolist() == [0, 0, 1, 1]
    with pytest.raises(ValueError, match="do not split"):
        ExpertShard(0, 3, 4)


# -- the lockstep protocol -------------------------------------------------------------------------

LAYERS = 3


class CollectiveLayer:
    """A MoE block's part in a pass: one real collective (its sum checks who took part)."""

    def __init__(self, group, index: int, log: list) -> None:
        self.group, self.index, self.log = group, index, log

    def expert_round(self, x):
        import paddle

        value = paddle.to_tensor([0 if x is None else 1], dtype="int64")
        self.group.collective(lambda: self.group.dist.all_reduce(value))
        self.group.moe_layer()
        self.log.append((self.index, int(value.numpy()[0])))
        if x == "fail" and self.index == 0:
            raise RuntimeError("a kernel failed in layer 0")


def lockstep_main(out_dir: str) -> None:
    import paddle.distributed as dist

    from fdplug.core.parallel.lockstep import LockstepGroup

    dist.init_parallel_env()
    rank = dist.get_rank()
    group = LockstepGroup(rank, 2)
    log: list = []
    group.blocks = [CollectiveLayer(group, i, log) for i in range(LAYERS)]
    errors = []
    if rank == 0:     # 40 real passes, the 5th failing in its first layer; rank 1 has nothing to do
        for n in range(40):
            try:
                with group.forward_pass(tokens=5):
                    for layer in group.blocks:
                        layer.expert_round("fail" if n == 4 else "x")
                        if n == 4:
                            break
            except RuntimeError as exc:
                errors.append(str(exc))
        group.idle_round(leaving=True)
    else:
        rounds = 0
        while not group.leaving:
            group.idle_round()
            rounds += 1
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(
        {"log": log, "errors": errors, "passes": group.passes, "dummy": group.dummy_passes, "leaving": group.leaving}))
    leave(rank)


def test_lockstep_an_idle_rank_a_failed_pass_and_leaving(tmp_path):
    import paddle.distributed as dist

    dist.spawn(lockstep_main, args=(str(tmp_path),), nprocs=2, backend="gloo", join=True)
    busy, idle = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert busy["passes"] == 40 and busy["errors"] == ["a kernel failed in layer 0"]
    assert idle["dummy"] == 40 and idle["passes"] == 0 and busy["leaving"] and idle["leaving"]
    # every layer of every pass ran on both ranks, matched: the failed pass's layers 1-2 as dummies
    assert len(busy["log"]) == len(idle["log"]) == 40 * LAYERS
    assert [i for i, _ in busy["log"]] == [i for i, _ in idle["log"]] == list(range(LAYERS)) * 40
    assert busy["log"][4 * LAYERS:5 * LAYERS] == [[0, 1], [1, 0], [2, 0]]   # layer 0 real, then dummies


def test_a_moe_backend_brings_its_own_exchange_and_gets_what_it_needs():
    from fdplug.core.parallel.exchange import choose_exchange
    from fdplug.plugin_api.moe import ExpertExchange

    class DeepEPLike:
        name = "deepep_like"

        def dispatch(self, hidden, topk_weights, topk_ids):
            raise NotImplementedError

        def combine(self, expert_out, batch):
            raise NotImplementedError

    class Backend:
        def __init__(self):
            self.asked = None

        def make_exchange(self, group, rank, size, num_experts):
            self.asked = (group, rank, size, num_experts)
            return DeepEPLike()

    backend = Backend()
    exchange = choose_exchange(backend, "the-group", ExpertShard(1, 4, 16))
    assert isinstance(exchange, ExpertExchange) and exchange.name == "deepep_like"
    assert backend.asked == ("the-group", 1, 4, 16)


# -- whole engines in lockstep, with faults -----------------------------------------------------------

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32], [27, 18, 28], [1, 2, 3, 4, 5, 6, 7]]
MAX_TOKENS = (12, 5)     # per rank: rank 1 is idle for the last passes of rank 0


def engine_main(out_dir: str, model: str, fault: str) -> None:
    """One rank: an offline engine of the group generating its share of PROMPTS, then idle rounds
    until every rank is idle (a header with nobody running); ``fault`` injected on one rank once."""
    import paddle.distributed as dist

    from fdplug.core.frontend.llm import LLM
    from fdplug.core.parallel.lockstep import init_group
    from fdplug.plugin_api.sampling_params import SamplingParams

    rank = dist.ParallelEnv().rank
    group = init_group(rank, 2, os.environ["PADDLE_TRAINER_ENDPOINTS"].split(","), "cpu")
    llm = LLM(model, expert_parallel_size=2, moe_backend="reference", num_kv_blocks=64, max_model_len=128)
    group.barrier(60)
    runner, calls = llm.engine.runner, {"n": 0}
    if fault == "experts" and rank == 1:           # the 4th expert call of rank 1 raises, once
        forward = runner.moe_backend.forward

        def failing(*args):
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("injected: experts failed")
            return forward(*args)

        runner.moe_backend.forward = failing
    if fault == "attention" and rank == 0:         # rank 0's last layer attention raises once, mid-pass
        attention = runner.model.layers[-1].self_attn
        forward = attention.forward

        def failing_attention(*args):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected: attention failed")
            return forward(*args)

        attention.forward = failing_attention
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[rank::2]],
                        SamplingParams(temperature=0, max_tokens=MAX_TOKENS[rank], ignore_eos=True), use_tqdm=False)
    group.idle_round()
    while group.busy:
        group.idle_round()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({
        "tokens": [o.outputs[0].token_ids for o in outs], "failed_steps": llm.engine.num_failed_steps,
        "passes": group.passes, "dummy": group.dummy_passes}))
    leave(rank)


@pytest.mark.parametrize("fault", ["none", "experts", "attention"])
def test_engines_in_lockstep_give_one_engines_tokens_through_faults(tmp_path, fault):
    """Two engines of an expert-parallel group give one engine's greedy tokens (each its own
    prompts, different lengths: one rank idles while the other finishes); with the experts of one
    rank failing once (the other rank, whose tokens they served, fails that pass too and both
    re-run: nobody continues without the rows) or one rank failing mid-pass (the other's pass
    completes), the tokens are the same."""
    import paddle.distributed as dist

    from fdplug.core.frontend.llm import LLM
    from fdplug.plugin_api.sampling_params import SamplingParams
    from tests.conftest import write_test_model
    from tests.test_moe_models import QWEN2_MOE

    model = str(write_test_model(tmp_path / "moe", **QWEN2_MOE))
    want = [o.outputs[0].token_ids for o in LLM(model, moe_backend="reference", num_kv_blocks=64, max_model_len=128)
            .generate([{"prompt_token_ids": p} for p in PROMPTS],
                      [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i % 2], ignore_eos=True)
                       for i in range(len(PROMPTS))], use_tqdm=False)]
    dist.spawn(engine_main, args=(str(tmp_path), model, fault), nprocs=2, backend="gloo", join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert got[0]["tokens"] == want[0::2] and got[1]["tokens"] == want[1::2]
    assert got[1]["dummy"] >= MAX_TOKENS[0] - MAX_TOKENS[1]     # rank 1's experts served rank 0 meanwhile
    failed = [g["failed_steps"] for g in got]
    assert failed == {"none": [0, 0], "experts": [1, 1], "attention": [1, 0]}[fault], failed
