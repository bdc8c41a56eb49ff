"""InputBatch against a plain dict model: every field of every request survives any sequence of ops."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fdplug.core.worker.input_batch import SLOT_FIELDS, InputBatch

MAX_SEQS, MAX_LEN, MAX_BLOCKS = 6, 12, 4
WIDTHS = {"max_model_len": MAX_LEN, "max_blocks": MAX_BLOCKS}


def values_for(i: int) -> dict:
    """Distinct, non-default values for every field (except req_id), derived from ``i``."""
    rng = np.random.default_rng(i)
    out = {}
    for f in SLOT_FIELDS:
        if f.name == "req_id":
            continue
        if f.width is not None:
            out[f.name] = rng.integers(1, 1000, size=WIDTHS[f.width]).astype(f.dtype)
        elif f.dtype is object:
            out[f.name] = f"obj-{i}"
        elif np.dtype(f.dtype) == np.bool_:
            out[f.name] = True
        elif np.dtype(f.dtype) == np.float32:
            out[f.name] = float(np.float32(rng.uniform(2, 3)))
        else:
            out[f.name] = int(rng.integers(1, 1000))
    return out


def check(batch: InputBatch, model: dict[str, dict]) -> None:
    assert batch.check() == []
    assert batch.num_reqs == len(model)
    assert set(batch.req_id_to_slot) == set(model)
    for req_id, expected in model.items():
        slot = batch.slot_of(req_id)
        assert batch.req_id[slot] == req_id
        for name, value in expected.items():
            np.testing.assert_array_equal(batch.arrays[name][slot], value, err_msg=f"{req_id}.{name}")
    used = set(batch.req_id_to_slot.values())
    for slot in range(MAX_SEQS):
        if slot not in used:  # free slots hold defaults only: nothing stale leaks into a new request
            for f in SLOT_FIELDS:
                assert np.all(batch.arrays[f.name][slot] == f.default) or f.default is None and \
                    batch.arrays[f.name][slot] is None, f"stale {f.name} in free slot {slot}"


# values a slot cannot hold: each must leave the batch exactly as it was
UNFIT = [("top_k", 2**63), ("seed", -(2**63) - 1), ("temperature", float("nan")), ("min_p", 1e300),
         ("token_ids", list(range(MAX_LEN + 1))), ("block_table", [[1, 2]]), ("num_tokens", "five"),
         ("top_k", 2.5)]

ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(0, 30)),
    st.tuples(st.just("add_unfit"), st.integers(0, 30), st.integers(0, len(UNFIT) - 1)),
    st.tuples(st.just("remove"), st.integers(0, 30)),
    st.tuples(st.just("swap"), st.integers(0, MAX_SEQS - 1), st.integers(0, MAX_SEQS - 1)),
    st.tuples(st.just("condense")),
), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_match_a_dict_model(operations):
    batch, model = InputBatch(MAX_SEQS, MAX_LEN, MAX_BLOCKS), {}
    for op in operations:
        if op[0] == "add":
            req_id = f"r{op[1]}"
            if req_id in model or batch.num_reqs == MAX_SEQS:
                continue
            model[req_id] = values_for(op[1])
            batch.add(req_id, model[req_id])
        elif op[0] == "add_unfit":
            req_id = f"r{op[1]}"
            if req_id in model or batch.num_reqs == MAX_SEQS:
                continue
            name, value = UNFIT[op[2]]
            before = {k: v.copy() for k, v in batch.arrays.items()}
            with pytest.raises((ValueError, OverflowError)):
                batch.add(req_id, {**values_for(op[1]), name: value})
            assert req_id not in batch.req_id_to_slot
            for k, v in batch.arrays.items():   # not one element written
                assert np.array_equal(v, before[k]) if v.dtype != object else list(v) == list(before[k]), k
        elif op[0] == "remove":
            batch.remove(f"r{op[1]}")
            model.pop(f"r{op[1]}", None)
        elif op[0] == "swap":
            if max(op[1], op[2]) < batch.num_slots:
                batch.swap(op[1], op[2])
        else:
            batch.condense()
            assert sorted(batch.req_id_to_slot.values()) == list(range(batch.num_reqs))
        check(batch, model)


def test_add_fills_the_lowest_hole_and_condense_moves_the_last_request():
    batch = InputBatch(4, 8, 2)
    for i in range(4):
        batch.add(f"r{i}", {"num_tokens": i + 1})
    batch.remove("r1")
    batch.remove("r0")
    assert batch.add("new", {"num_tokens": 9}) == 0
    batch.condense()
    assert batch.slot_of("r3") == 1 and batch.num_slots == 3
    assert list(batch.num_tokens[:3]) == [9, 4, 3]


def test_removing_the_last_slots_shrinks_instead_of_leaving_holes():
    batch = InputBatch(4, 8, 2)
    for i in range(3):
        batch.add(f"r{i}", {})
    batch.remove("r1")
    batch.remove("r2")
    assert batch.num_slots == 1 and batch.add("x", {}) == 1


def test_full_batch_and_duplicates_are_errors():
    batch = InputBatch(1, 8, 2)
    batch.add("a", {})
    with pytest.raises(KeyError):
        batch.add("a", {})
    with pytest.raises(RuntimeError, match="full"):
        batch.add("b", {})
    with pytest.raises(KeyError, match="not slot fields"):
        InputBatch(2, 8, 2).add("c", {"no_such_field": 1})
