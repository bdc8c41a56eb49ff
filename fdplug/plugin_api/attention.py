"""The attention contract: what the core tells an attention backend each step.

The core describes a step with numpy arrays (device-independent); a backend turns that into its
kernel's inputs once per step in ``prepare`` and then runs ``forward`` once per layer. The mask is
given as a *spec*: for each query token, the exclusive end of the key range it may see within its
own sequence. Causal attention is ``position + 1``; a model whose image tokens attend
bidirectionally gives every token of an image span the span's end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:  # numpy is imported where used: importing the contract starts no BLAS threads
    import numpy as np



@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention layout for a batch of sequences (all arrays int64 unless noted).

    Query rows ``query_start_loc[i]:query_start_loc[i+1]`` belong to sequence ``i``. After this
    step's keys are written, sequence ``i`` has ``seq_lens[i]`` keys in the cache, held in the
    blocks ``block_tables[i]`` (padded with the null block 0). Query token ``t`` sits at
    ``positions[t]``, writes its key/value to flat slot ``slot_mapping[t]`` (block * block_size +
    offset) and sees keys ``[0, key_end[t])`` of its sequence.
    """

    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    positions: np.ndarray
    key_end: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    block_size: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    def query_lens(self) -> np.ndarray:
        import numpy as np

        return np.diff(self.query_start_loc)

    def validate(self) -> None:
        """Check the invariants a backend relies on; a violation is a core bug, so this raises AssertionError."""
        import numpy as np

        qsl, n = self.query_start_loc, self.num_seqs
        assert qsl.shape == (n + 1,) and qsl[0] == 0 and np.all(np.diff(qsl) >= 1), "query_start_loc"
        t = self.num_tokens
        assert self.positions.shape == self.key_end.shape == self.slot_mapping.shape == (t,), "per-token arrays"
        seq_of_token = np.repeat(np.arange(n), np.diff(qsl))
        assert np.all(self.key_end >= 1) and np.all(self.key_end <= self.seq_lens[seq_of_token]), "key_end"
        assert np.all(self.positions < self.seq_lens[seq_of_token]), "positions"
        assert self.block_tables.shape[0] == n, "block_tables"
        assert self.block_tables.shape[1] * self.block_size >= int(self.seq_lens.max()), "block_tables too short"


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative ints (also numpy arrays): e.g. the blocks that hold ``a`` tokens."""
    return -(-a // b)


def causal_key_end(positions: np.ndarray) -> np.ndarray:
    """The causal mask spec: each token sees every key up to and including its own position."""
    return positions.astype("int64") + 1


@runtime_checkable
class AttentionBackend(Protocol):
    """What an attention backend's factory returns.

    Shapes: ``q`` is ``[num_tokens, num_heads, head_dim]``; ``k`` and ``v`` are
    ``[num_tokens, num_kv_heads, head_dim]`` (GQA: ``num_heads`` is a multiple of ``num_kv_heads``);
    the result is ``[num_tokens, num_heads, head_dim]`` in ``q``'s dtype. ``forward`` first writes
    ``k``/``v`` into the layer's caches at ``slot_mapping`` and then attends over the cache, so a
    token sees the keys of its own step too.
    """

    name: str

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """Shape of one layer's key cache (and, identically, value cache). A backend may also say
        where a block lives in it, ``kv_cache_layout`` (optional, API 3.7): a permutation of
        ``"BTHD"``, or None for an opaque cache (`fdplug.plugin_api.kv_layout`)."""
        ...

    def prepare(self, meta: AttentionMetadata) -> Any:
        """Turn the step's metadata into device tensors and masks; called once per step."""
        ...

    def forward(self, q: Any, k: Any, v: Any, key_cache: Any, value_cache: Any, prepared: Any,
                scale: float) -> Any:
        """Write this step's keys/values, then attend; called once per layer."""
        ...
