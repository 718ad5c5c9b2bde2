"""HostRows on the CPU keeps one stage buffer and the next stage reuses it (grown when a stage
needs more rows): every stage still loads its distinct rows, every commit writes them back, and
the rows past the distinct ones hold numbers an optimizer can run on (zeros or earlier rows,
never what a freed tensor left), through stages that grow and shrink."""

import numpy as np
import torch

from speedtorch_ops.training.host_rows import HostRows
from speedtorch_ops.training.plan import Plan


def _table(rows: int, parts: int, width: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, parts, width, generator=torch.Generator().manual_seed(seed))


def test_stages_of_changing_sizes_load_and_commit_their_rows():
    host = _table(500, 3, 8, 0)
    want = host.clone()
    store = HostRows(host, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    for n, spare in ((300, 0), (40, 1), (900, 0), (900, 2), (5, 0), (1200, 1)):
        ids = torch.randint(0, 500, (n,), generator=g)
        buf, d = store.stage(Plan(ids, "cpu"), spare)
        assert buf.shape == (3, n + spare, 8)
        c = int(d.count)
        uniq = torch.from_numpy(np.unique(ids.numpy()))
        assert torch.equal(d.ids[:c], uniq)
        assert torch.equal(buf[:, :c], want[uniq].transpose(0, 1))
        # Past the distinct rows: finite, no subnormal numbers (zeros or earlier rows).
        tail = buf[:, c:]
        assert torch.isfinite(tail).all()
        assert not ((tail != 0) & (tail.abs() < torch.finfo(tail.dtype).tiny)).any()
        buf[:, :c] += 1.0  # an update
        want[uniq] += 1.0
        store.commit()
        assert torch.equal(host, want)


def test_the_next_stage_reuses_the_buffer():
    host = _table(100, 2, 4, 2)
    store = HostRows(host, torch.device("cpu"))
    first, _ = store.stage(Plan(torch.arange(60), "cpu"))
    store.commit()
    second, _ = store.stage(Plan(torch.arange(30) * 3, "cpu"))
    assert second.data_ptr() == first.data_ptr()
    store.discard()
    bigger, d = store.stage(Plan(torch.arange(100).repeat(2), "cpu"))  # grows: a new buffer
    assert bigger.shape == (2, 200, 4)
    assert torch.equal(bigger[:, :int(d.count)], host.transpose(0, 1))
