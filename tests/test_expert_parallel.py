"""Expert parallel on real paddle.distributed processes (gloo, 2 ranks on this machine).

Each rank holds half of a MoE layer's experts and its own tokens; through `AllGatherExchange` every
rank's tokens get the same outputs as one rank holding every expert (float32 rounding apart: the
parts are summed in another order), including a step where one rank has no tokens at all (it runs
the collectives with zero rows and gets zero rows back; nobody waits on it).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from fdplug.core.parallel.expert_parallel import ExpertShard

EXPERTS, HIDDEN, INTER, TOP_K = 4, 16, 24, 2
STEPS = [(5, 3), (4, 0), (0, 2)]    # tokens of rank 0 and rank 1 in each step: idle ranks included


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


def moe(weights, x, ids, w, first: int = 0, count: int = EXPERTS):
    """The reference backend on experts [first, first + count) of ``weights``."""
    import paddle

    from fdplug.core.portable.moe import ReferenceMoE
    from fdplug.plugin_api.moe import ExpertWeights

    backend = ReferenceMoE()
    layer = backend.load_weights(ExpertWeights(*(paddle.to_tensor(weights[n][first:first + count])
                                                 for n in ("gate", "up", "down"))))
    return backend.forward(paddle.to_tensor(x), paddle.to_tensor(w), paddle.to_tensor(ids), layer)


def rank_main(out_dir: str) -> None:
    import paddle
    import paddle.distributed as dist

    from fdplug.core.parallel.expert_parallel import AllGatherExchange

    dist.init_parallel_env()
    rank = dist.get_rank()
    shard = ExpertShard(rank, dist.get_world_size(), EXPERTS)
    exchange, weights, results = AllGatherExchange(), experts(), []
    for step, counts in enumerate(STEPS):
        x, ids, w = tokens(step, rank, counts[rank])
        sent = exchange.dispatch(paddle.to_tensor(x), paddle.to_tensor(ids), paddle.to_tensor(w))
        local_ids, local_w = shard.localize(sent.topk_ids, sent.topk_weights)
        if int(sent.hidden.shape[0]):
            partial = moe(weights, sent.hidden.numpy(), local_ids.numpy(), local_w.numpy(), shard.first, shard.count)
        else:
            partial = paddle.zeros([0, HIDDEN])
        results.append(exchange.combine(partial, sent).numpy().tolist())
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def test_two_ranks_give_one_ranks_outputs_with_an_idle_rank(tmp_path):
    import paddle.distributed as dist

    if sys.platform != "linux":
        pytest.skip("paddle.distributed.spawn with gloo: Linux")
    dist.spawn(rank_main, args=(str(tmp_path),), nprocs=2, backend="gloo", join=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for step, counts in enumerate(STEPS):
            x, ids, w = tokens(step, rank, counts[rank])
            want = moe(experts(), x, ids, w).numpy() if counts[rank] else np.zeros((0, HIDDEN), np.float32)
            assert np.asarray(got[step]).reshape(want.shape).shape == (counts[rank], HIDDEN)
            np.testing.assert_allclose(np.asarray(got[step]).reshape(want.shape), want, rtol=1e-5, atol=1e-5,
                                       err_msg=f"rank {rank}, step {step}")


def test_a_shard_keeps_its_experts_and_weighs_the_others_zero():
    import paddle

    shard = ExpertShard(1, 2, 4)
    assert (shard.first, shard.count) == (2, 2)
    ids, w = shard.localize(paddle.to_tensor([[0, 3], [2, 1]]), paddle.to_tensor([[0.5, 0.25], [0.75, 0.125]]))
    assert ids.numpy().tolist() == [[0, 1], [0, 0]] and w.numpy().tolist() == [[0.0, 0.25], [0.75, 0.0]]
    with pytest.raises(ValueError, match="do not split"):
        ExpertShard(0, 3, 4)
