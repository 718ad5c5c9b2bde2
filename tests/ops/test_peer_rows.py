"""_peer_rows (the sharded step's row reads in place) against indexing, on the CPU (addresses of
host tensors) and on the GPU machine (addresses of GPU tensors of one device, which its kernel
reads as it reads a peer's over NVLink); its errors; opcheck. The peers themselves: the NCCL
tests of tests/distributed/test_sharded_collection.py (exchange='peer')."""

import pytest
import torch

from speedtorch_ops import ops

from test_cache_ops import DEVICES, device_of, gen


def _case(dev, dtype, dim, ranks, offset_rows, n, seed):
    """(buffers, ptrs, offset, rank_of, row_of): each rank's buffer of `offset_rows` rows before
    its rows, random sources, a fifth of them -1."""
    g = gen(seed)
    rows = [int(torch.randint(1, 40, (1,), generator=g)) for _ in range(ranks)]
    buffers = [(torch.randn(offset_rows + r, dim, generator=g) * 100).to(dtype).to(dev)
               for r in rows]
    rank_of = torch.randint(0, ranks, (n,), generator=g)
    row_of = torch.stack([torch.randint(0, rows[int(k)], (1,), generator=g)[0] for k in rank_of]) \
        if n else torch.zeros(0, dtype=torch.int64)
    row_of[torch.rand(n, generator=g) < 0.2] = -1
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=dev)
    offset = offset_rows * dim * buffers[0].element_size()
    return buffers, ptrs, offset, rank_of.to(dev), row_of.to(dev)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,dim", [(torch.float32, 128), (torch.float32, 5),
                                       (torch.bfloat16, 8), (torch.bfloat16, 3),
                                       (torch.float64, 3), (torch.int64, 1), (torch.uint8, 3)])
@pytest.mark.parametrize("offset_rows", [0, 3])
@pytest.mark.parametrize("n", [0, 1, 7, 1000])
def test_rows_read_in_place(device, dtype, dim, offset_rows, n):
    dev = device_of(device)
    seed = n * 31 + dim * 7 + offset_rows
    buffers, ptrs, offset, rank_of, row_of = _case(dev, dtype, dim, 3, offset_rows, n, seed)
    got = ops._peer_rows(ptrs, offset, rank_of, row_of, dim, dtype)
    want = torch.zeros(n, dim, dtype=dtype)
    for i, (k, r) in enumerate(zip(rank_of.tolist(), row_of.tolist())):
        if r >= 0:
            want[i] = buffers[k][offset_rows + r].cpu()
    assert got.dtype == dtype and got.shape == (n, dim) and got.device.type == dev.type
    assert torch.equal(got.cpu(), want)


def test_bad_arguments_name_themselves():
    i64 = torch.zeros(3, dtype=torch.int64)
    ptrs = torch.tensor([torch.zeros(4).data_ptr()])
    cases = [
        (lambda: ops._peer_rows(ptrs.int(), 0, i64, i64, 1, torch.float32), "ptrs"),
        (lambda: ops._peer_rows(ptrs, 0, i64.int(), i64, 1, torch.float32), "rank_of"),
        (lambda: ops._peer_rows(ptrs, 0, i64, i64[:2], 1, torch.float32), "rank_of and row_of"),
        (lambda: ops._peer_rows(ptrs, -16, i64, i64, 1, torch.float32), "offset"),
        (lambda: ops._peer_rows(ptrs, 0, i64, i64, -1, torch.float32), "dim"),
        (lambda: ops._peer_rows(ptrs, 0, i64 + 1, i64, 1, torch.float32), "rank_of must hold"),
    ]
    for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
            call()


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    dev = device_of(device)
    buffers, ptrs, offset, rank_of, row_of = _case(dev, torch.float32, 4, 2, 1, 9, 5)
    torch.library.opcheck(torch.ops.speedtorch_ops._peer_rows.default,
                          (ptrs, offset, rank_of, row_of, 4, torch.float32))
