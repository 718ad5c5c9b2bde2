"""The ops under torch.compile(fullgraph=True): no graph break, results equal to eager."""

import pytest
import torch

import speedtorch_ops
from conftest import STORES, index_device, place, random_index, random_rows


@pytest.mark.parametrize("store", STORES)
def test_compiled_gather_scatter_equal_eager(store, gen):
    data = random_rows((64, 8), torch.float32, gen)
    index_device(store)  # skips without a GPU

    def step(table, index, scale):
        rows = speedtorch_ops.pinned_gather(table, index) * scale
        speedtorch_ops.pinned_scatter(table, index, rows, accumulate=True)
        return rows.sum(dim=1)

    # Inductor re-inplaces the mutation of the table; aot_eager would run the op on a clone of
    # the table, which for a pinned store is no longer pinned (and costs a full copy).
    backend = "aot_eager" if store == "cpu" else "inductor"
    compiled = torch.compile(step, fullgraph=True, backend=backend, dynamic=True)
    for n in (5, 9, 17):
        index = random_index(n, 64, torch.int64, store, gen)
        eager_table, compiled_table = place(data, store), place(data, store)
        expected = step(eager_table, index, 2.0)
        got = compiled(compiled_table, index, 2.0)
        assert torch.equal(got.cpu(), expected.cpu())
        assert torch.equal(compiled_table.cpu(), eager_table.cpu())
