"""`SamplingMetadata`: every row's sampling parameters as arrays, what the sampler and its filters read."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

SAMPLING_EPS = 1e-5   # temperature below this is greedy (vLLM's _SAMPLING_EPS)
MAX_NUM_LOGPROBS = 20


@dataclass(slots=True)
class SamplingMetadata:
    """Per-row sampling state; row i of every array belongs to logits row i.

    Penalty tokens are sparse: ``penalty_token_ids[i]`` lists the distinct ids of row i's prompt and
    output (padding -1), ``penalty_token_counts[i]`` how often each occurs in the output (0: prompt
    only). Repetition applies to every listed id, frequency to the count, presence to ``count > 0``.
    Build a slot's row with ``penalty_tokens`` and update it with ``record_tokens``: O(tokens), not
    O(vocab), per step.
    """

    temperature: np.ndarray          # float32 [n]; < SAMPLING_EPS: greedy
    top_k: np.ndarray                # int64 [n]; <= 0 or >= vocab: off
    top_p: np.ndarray                # float32 [n] in (0, 1]; 1: off
    min_p: np.ndarray                # float32 [n] in [0, 1]; 0: off
    presence_penalty: np.ndarray     # float32 [n]; 0: off
    frequency_penalty: np.ndarray    # float32 [n]; 0: off
    repetition_penalty: np.ndarray   # float32 [n]; 1: off
    seeds: np.ndarray                # int64 or uint64 [n]; read where ``seeded``
    seeded: np.ndarray               # bool [n]
    steps: np.ndarray                # int64 [n]: output tokens the request had before this one
    num_logprobs: np.ndarray         # int64 [n]; -1: none, 0: sampled token only, N: and the top N
    penalty_token_ids: np.ndarray | None = None      # int64 [n, L], padded with -1
    penalty_token_counts: np.ndarray | None = None   # int32 [n, L]
    greedy: np.ndarray = field(init=False)
    all_greedy: bool = field(init=False)
    all_random: bool = field(init=False)
    no_penalties: bool = field(init=False)
    max_num_logprobs: int = field(init=False)

    def __post_init__(self) -> None:
        self.greedy = self.temperature < SAMPLING_EPS
        self.all_greedy = bool(self.greedy.all())
        self.all_random = not self.greedy.any()
        self.no_penalties = self.penalty_token_ids is None or not self.penalised().any()
        self.max_num_logprobs = min(int(self.num_logprobs.max(initial=-1)), MAX_NUM_LOGPROBS)

    def penalised(self) -> np.ndarray:
        """Rows with any penalty switched on."""
        return ((self.repetition_penalty != 1) | (self.frequency_penalty != 0)
                | (self.presence_penalty != 0))

    @classmethod
    def make(cls, num_reqs: int, **values) -> SamplingMetadata:
        """Defaults (temperature 1, no filter, penalty, seed or logprobs) overridden by ``values``;
        scalars broadcast to every row."""
        defaults = dict(temperature=(1.0, np.float32), top_k=(0, np.int64), top_p=(1.0, np.float32),
                        min_p=(0.0, np.float32), presence_penalty=(0.0, np.float32),
                        frequency_penalty=(0.0, np.float32), repetition_penalty=(1.0, np.float32),
                        seeds=(0, np.int64), seeded=(False, np.bool_), steps=(0, np.int64),
                        num_logprobs=(-1, np.int64))
        for name, (default, dtype) in defaults.items():
            value = np.asarray(values.get(name, default), dtype=dtype)
            values[name] = np.broadcast_to(value, (num_reqs,)).copy()
        return cls(**values)

    def rows(self, idx: np.ndarray) -> SamplingMetadata:
        """The metadata of some rows, in ``idx`` order."""
        return SamplingMetadata(**{f.name: None if (v := getattr(self, f.name)) is None else v[idx]
                                   for f in fields(self) if f.init})
