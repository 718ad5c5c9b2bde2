"""optimizer_state_swap: write-back then load, for several state tensors at once."""

import pytest
import torch

import speedtorch_ops
from conftest import (STORES, index_device, last_wins_reference, place, random_index,
                      random_rows)


def _stores(store, gen, rows=80, dims=(6, 6, 6), dtype=torch.float32):
    datas = [random_rows((rows, d), dtype, gen) for d in dims]
    return datas, [place(d, store) for d in datas]


@pytest.mark.parametrize("store", STORES)
def test_swap_writes_back_then_loads(store, gen):
    datas, stores = _stores(store, gen)  # e.g. weights, exp_avg, exp_avg_sq
    dev = index_device(store)
    wb = random_index(32, 80, torch.int64, store, gen)
    load = torch.cat([wb[:8], random_index(24, 80, torch.int64, store, gen)])  # overlaps wb
    batch = [random_rows((32, 6), torch.float32, gen).to(dev) for _ in stores]
    written = [b.clone() for b in batch]
    speedtorch_ops.optimizer_state_swap(stores, batch, wb, load)
    for data, s, b, w in zip(datas, stores, batch, written):
        ref = last_wins_reference(data, wb, w)
        assert torch.equal(s.cpu(), ref)
        # Rows in both indices are loaded after their write-back: the batch sees new values.
        assert torch.equal(b.cpu(), ref[load.cpu()])


@pytest.mark.parametrize("store", STORES)
def test_swap_load_only_and_writeback_only(store, gen):
    datas, stores = _stores(store, gen, dims=(4, 10))
    dev = index_device(store)
    load = random_index(16, 80, torch.int32, store, gen)
    batch = [torch.full((16, d.shape[1]), 7.0, device=dev) for d in datas]
    speedtorch_ops.optimizer_state_swap(stores, batch, None, load)
    for d, s, b in zip(datas, stores, batch):
        assert torch.equal(b.cpu(), d[load.cpu().long()])
        assert torch.equal(s.cpu(), d)
    new = [random_rows(b.shape, torch.float32, gen).to(dev) for b in batch]
    speedtorch_ops.optimizer_state_swap(stores, new, load, None)
    for d, s, n in zip(datas, stores, new):
        assert torch.equal(s.cpu(), last_wins_reference(d, load, n))


@pytest.mark.parametrize("store", STORES)
def test_swap_mixed_dtypes_per_pair(store, gen):
    dev = index_device(store)
    datas = [random_rows((40, 3), torch.float32, gen), random_rows((40, 3), torch.bfloat16, gen),
             random_rows((40, 1), torch.int64, gen)]
    stores = [place(d, store) for d in datas]
    load = random_index(10, 40, torch.int64, store, gen)
    batch = [torch.zeros((10, d.shape[1]), dtype=d.dtype, device=dev) for d in datas]
    speedtorch_ops.optimizer_state_swap(stores, batch, None, load)
    for d, b in zip(datas, batch):
        assert torch.equal(b.cpu(), d[load.cpu()])
