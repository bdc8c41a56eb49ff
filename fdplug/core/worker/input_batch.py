"""Persistent per-slot state of the requests a model runner holds.

Every per-slot field is declared once, in ``SLOT_FIELDS``. ``add``, ``remove``, ``swap``,
``condense`` and ``reset`` walk that registry, so a field added later (a multimodal offset, a new
sampling knob) cannot be forgotten in one of them: the bug where a field was missed in a swap
cannot happen here by construction.

Every operation is all-or-nothing. ``add`` converts every value to its field's dtype and width
before it takes a slot, so a value that does not fit (a ``top_k`` past int64, a row longer than the
table) raises with the batch exactly as it was: no half-written slot for the next step to read.
``check`` states the invariants, for the engine to verify after a failed step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fdplug.errors import show_value


@dataclass(frozen=True, slots=True)
class SlotField:
    """One per-slot array: ``width`` names its trailing dimension (None: one value per slot)."""

    name: str
    dtype: Any
    default: Any
    width: str | None = None


SLOT_FIELDS: tuple[SlotField, ...] = (
    SlotField("req_id", object, None),
    SlotField("token_ids", np.int64, 0, "max_model_len"),     # prompt then output tokens
    SlotField("num_tokens", np.int64, 0),                      # known tokens (prompt + output)
    SlotField("num_prompt_tokens", np.int64, 0),
    SlotField("num_computed_tokens", np.int64, 0),             # tokens whose KV is in the cache
    SlotField("block_table", np.int64, 0, "max_blocks"),
    SlotField("num_blocks", np.int64, 0),
    SlotField("key_end_offset", np.int64, 0, "max_model_len"), # mask spec minus causal (0: causal)
    SlotField("mm_positions", object, ()),                      # the request's MMPlaceholders
    SlotField("rope_delta", np.int64, 0),                      # multimodal RoPE: position - index after the items
    SlotField("items_end", np.int64, 0),                       # tokens before it may fall on an item
    SlotField("temperature", np.float32, 1.0),
    SlotField("top_p", np.float32, 1.0),
    SlotField("top_k", np.int64, 0),
    SlotField("min_p", np.float32, 0.0),
    SlotField("presence_penalty", np.float32, 0.0),
    SlotField("frequency_penalty", np.float32, 0.0),
    SlotField("repetition_penalty", np.float32, 1.0),
    SlotField("penalised", np.bool_, False),                   # any of the three penalties is on
    SlotField("plain_greedy", np.bool_, False),                # greedy, no penalty, no logprobs: argmax alone
    SlotField("seed", np.int64, 0),                            # read where ``seeded``
    SlotField("seeded", np.bool_, False),
    SlotField("num_logprobs", np.int64, -1),                   # -1: no logprobs
    SlotField("penalty_ids", np.int64, -1, "max_model_len"),   # distinct prompt+output ids (penalties)
    SlotField("penalty_counts", np.int32, 0, "max_model_len"), # output count of each of those ids
    SlotField("num_penalty_ids", np.int64, 0),
)


class InputBatch:
    """Slots ``0..num_slots-1``; a removed request leaves a hole until ``condense``.

    Arrays are attributes named after their field (``batch.token_ids[slot, :n]``).
    """

    def __init__(self, max_num_seqs: int, max_model_len: int, max_blocks: int) -> None:
        self.max_num_seqs = max_num_seqs
        widths = {"max_model_len": max_model_len, "max_blocks": max_blocks}
        self.arrays: dict[str, np.ndarray] = {}
        for f in SLOT_FIELDS:
            shape = (max_num_seqs,) if f.width is None else (max_num_seqs, widths[f.width])
            array = np.empty(shape, dtype=f.dtype)
            array.fill(f.default)
            self.arrays[f.name] = array
            setattr(self, f.name, array)
        self.req_id_to_slot: dict[str, int] = {}
        self.num_slots = 0          # slots in use, holes included
        self._holes: list[int] = []

    # ----------------------------------------------------------------------------------------------
    # membership
    # ----------------------------------------------------------------------------------------------

    @property
    def num_reqs(self) -> int:
        return len(self.req_id_to_slot)

    def slot_of(self, req_id: str) -> int:
        return self.req_id_to_slot[req_id]

    def add(self, req_id: str, values: dict[str, Any]) -> int:
        """Put a request in the lowest free slot; ``values`` maps field name -> value (others: default).

        All or nothing: a value that does not convert raises before any slot is taken.
        """
        if req_id in self.req_id_to_slot:
            raise KeyError(f"request {req_id!r} is already in the batch")
        unknown = set(values) - set(self.arrays)
        if unknown:
            raise KeyError(f"not slot fields: {sorted(unknown)}")
        converted = {name: self._convert(name, value) for name, value in values.items()}
        if not self._holes and self.num_slots >= self.max_num_seqs:
            raise RuntimeError(f"input batch is full ({self.max_num_seqs} slots)")
        if self._holes:
            slot = min(self._holes)
            self._holes.remove(slot)
        else:
            slot = self.num_slots
            self.num_slots += 1
        self.reset(slot)
        for name, value in converted.items():   # same dtype and a width that fits: these cannot fail
            array = self.arrays[name]
            if array.ndim == 2:
                array[slot, :len(value)] = value
            else:
                array[slot] = value
        self.req_id[slot] = req_id
        self.req_id_to_slot[req_id] = slot
        return slot

    def remove(self, req_id: str) -> int | None:
        """Free a request's slot (reset to defaults); unknown ids are ignored and return None."""
        slot = self.req_id_to_slot.pop(req_id, None)
        if slot is None:
            return None
        self.reset(slot)
        if slot == self.num_slots - 1:
            self.num_slots -= 1
            while self.num_slots and self.num_slots - 1 in self._holes:  # trailing holes are not holes
                self._holes.remove(self.num_slots - 1)
                self.num_slots -= 1
        else:
            self._holes.append(slot)
        return slot

    def swap(self, a: int, b: int) -> None:
        """Exchange two slots, every field of them."""
        if a == b:
            return
        for array in self.arrays.values():
            array[[a, b]] = array[[b, a]]
        for slot in (a, b):
            if self.req_id[slot] is not None:
                self.req_id_to_slot[self.req_id[slot]] = slot
        a_hole, b_hole = a in self._holes, b in self._holes
        if a_hole != b_hole:
            self._holes.remove(a if a_hole else b)
            self._holes.append(b if a_hole else a)

    def condense(self) -> None:
        """Move the last requests into the holes, so slots ``0..num_reqs-1`` are all in use."""
        for hole in sorted(self._holes):
            if hole >= self.num_reqs:
                break
            last = self.num_slots - 1
            while self.req_id[last] is None:
                last -= 1
            self.swap(hole, last)
        self._holes.clear()
        self.num_slots = self.num_reqs

    def reset(self, slot: int) -> None:
        """Every field of ``slot`` back to its default."""
        for f in SLOT_FIELDS:
            self.arrays[f.name][slot] = f.default

    def _convert(self, name: str, value: Any) -> Any:
        """``value`` as its field stores it, or a ValueError/OverflowError naming the field."""
        array = self.arrays[name]
        if array.dtype == object:
            return value
        try:
            with np.errstate(over="ignore", invalid="ignore"):   # an overflow to inf is caught below
                converted = np.asarray(value, dtype=array.dtype) if array.ndim == 2 else array.dtype.type(value)
        except (OverflowError, ValueError, TypeError) as exc:
            raise ValueError(f"slot field {name!r} cannot hold {type(value).__name__} {show_value(value)}: "
                             f"{exc}") from None
        if array.ndim == 2 and (converted.ndim != 1 or len(converted) > array.shape[1]):
            raise ValueError(f"slot field {name!r} holds up to {array.shape[1]} values, got shape {converted.shape}")
        if array.dtype.kind == "f" and not np.all(np.isfinite(converted)):
            raise ValueError(f"slot field {name!r} got a non-finite value {show_value(value)}")
        if array.dtype.kind in "iu" and np.ndim(value) == 0 and isinstance(value, float) and value != int(value):
            raise ValueError(f"slot field {name!r} takes integers, got {value!r}")
        return converted

    # ----------------------------------------------------------------------------------------------
    # invariants
    # ----------------------------------------------------------------------------------------------

    def check(self) -> list[str]:
        """What is wrong with the slot bookkeeping (empty: consistent)."""
        problems = []
        for req_id, slot in self.req_id_to_slot.items():
            if not 0 <= slot < self.num_slots or self.req_id[slot] != req_id:
                problems.append(f"request {req_id!r} maps to slot {slot}, which holds {self.req_id[slot]!r}")
        for slot in range(self.num_slots):
            holder = self.req_id[slot]
            if (holder is None) != (slot in self._holes):
                problems.append(f"slot {slot} holds {holder!r} but is {'' if slot in self._holes else 'not '}a hole")
            if holder is not None and self.req_id_to_slot.get(holder) != slot:
                problems.append(f"slot {slot} holds {holder!r}, which is not mapped to it")
        if any(self.req_id[slot] is not None for slot in range(self.num_slots, self.max_num_seqs)):
            problems.append("a slot past num_slots holds a request")
        return problems
