"""The id map ops (``ops._hash_find`` / ``ops._hash_insert``, CPU) against a Python dict: ids
from the whole int64 range, inserts into erased slots, a map filled to its last slot, and bad
arguments refused naming them with nothing written."""

import pytest
import torch

from speedtorch_ops import ops


def empty(slots):
    return torch.zeros(slots, dtype=torch.int64), torch.full((slots,), -1, dtype=torch.int64)


def test_finds_what_was_inserted_and_nothing_else(gen):
    keys, rows = empty(256)
    ref = {}
    for _ in range(6):
        ids = torch.unique(torch.randint(-2**63, 2**63 - 1, (30,), generator=gen,
                                         dtype=torch.int64))
        ids = ids[[int(i) not in ref for i in ids]]
        new = torch.randint(0, 1000, ids.shape, generator=gen)
        ops._hash_insert(keys, rows, ids, new)
        ref.update(zip(ids.tolist(), new.tolist()))
        # erase a few through the slots find reports
        held = torch.tensor(list(ref)[:5], dtype=torch.int64)
        found, slots = ops._hash_find(keys, rows, held)
        assert found.tolist() == [ref[i] for i in held.tolist()]
        rows[slots] = -2
        for i in held.tolist():
            del ref[i]
        probe = torch.cat([torch.tensor(list(ref), dtype=torch.int64), held,
                           torch.tensor([0, -1, 2**62], dtype=torch.int64)])
        found, slots = ops._hash_find(keys, rows, probe)
        assert found.tolist() == [ref.get(i, -1) for i in probe.tolist()], gen.initial_seed()
        assert all(keys[s] == i for s, i, r in zip(slots.tolist(), probe.tolist(),
                                                   found.tolist()) if r >= 0)


def test_erased_slots_are_taken_again_and_counted():
    keys, rows = empty(8)
    ops._hash_insert(keys, rows, torch.arange(8), torch.arange(8))  # every slot
    _, slots = ops._hash_find(keys, rows, torch.tensor([3, 5]))
    rows[slots] = -2
    assert int(ops._hash_insert(keys, rows, torch.tensor([100, 200]), torch.tensor([7, 9]))) == 2
    found, _ = ops._hash_find(keys, rows, torch.tensor([100, 200, 3, 5, 0]))
    assert found.tolist() == [7, 9, -1, -1, 0]


@pytest.mark.parametrize("args, match", [
    (lambda k, r: (k[:6], r[:6], torch.tensor([1]), torch.tensor([0])), "power-of-two"),
    (lambda k, r: (k, r[:4], torch.tensor([1]), torch.tensor([0])), "rows must have"),
    (lambda k, r: (k, r, torch.tensor([1], dtype=torch.int32), torch.tensor([0])), "ids"),
    (lambda k, r: (k, r, torch.tensor([1, 2]), torch.tensor([0])), "new_rows"),
    (lambda k, r: (k, r, torch.tensor([1]), torch.tensor([-3])), "new_rows\\[0\\]"),
    (lambda k, r: (k, r, torch.arange(9), torch.arange(9)), "free slots"),
])
def test_bad_arguments_raise_and_insert_nothing(args, match):
    keys, rows = empty(8)
    with pytest.raises(RuntimeError, match=match):
        ops._hash_insert(*args(keys, rows))
    assert (rows == -1).all()


def test_opcheck():
    keys, rows = empty(16)
    torch.library.opcheck(torch.ops.speedtorch_ops._hash_insert.default,
                          (keys, rows, torch.tensor([5, -9]), torch.tensor([0, 1])))
    torch.library.opcheck(torch.ops.speedtorch_ops._hash_find.default,
                          (keys, rows, torch.tensor([5, 7])))
