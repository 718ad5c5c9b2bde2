"""On the CPU a fused step updates the host table in place (HostRows.direct_target): the
rows train exactly as torch's optimizer trains an nn.Embedding (float64), nothing is written
back at commit, and a step that cannot fuse after such a forward refuses, writing nothing."""

import pytest
import torch

import speedtorch_ops as so


@pytest.mark.parametrize("opt", [torch.optim.SGD, torch.optim.Adagrad])
def test_a_cpu_step_updates_the_table_in_place(opt, gen):
    emb = so.HostEmbedding(500, 8, optimizer=opt, optimizer_kwargs={"lr": 0.05}, device="cpu",
                           dtype=torch.float64)
    ref = torch.nn.Embedding(500, 8, dtype=torch.float64, sparse=False)
    with torch.no_grad():
        ref.weight.copy_(emb.weight)
    ref_opt = opt(ref.parameters(), lr=0.05)
    for _ in range(4):
        ids = torch.randint(0, 500, (64,), generator=gen)
        target = torch.randn(64, 8, generator=gen, dtype=torch.float64)
        ((emb(ids) - target) ** 2).sum().backward()
        emb.step()
        ref_opt.zero_grad()
        ((ref(ids) - target) ** 2).sum().backward()
        ref_opt.step()  # SGD and Adagrad leave rows without a gradient as they are
    stats = emb.cache_stats()
    assert stats["direct_writebacks"] == 0 and stats["host_loads"] > 0
    assert torch.allclose(emb.weight, ref.weight, rtol=1e-12, atol=1e-12)


def test_a_step_that_cannot_fuse_after_an_in_place_forward_refuses(gen):
    """The forward left the rows' state in the table for the fused update; with the fused
    update turned off before step() nothing may be half-updated."""
    emb = so.HostEmbedding(50, 4, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.1},
                           device="cpu")
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    emb(torch.randint(0, 50, (10,), generator=gen)).sum().backward()
    emb.fused_update = False
    with pytest.raises(RuntimeError, match="cannot run now"):
        emb.step()
    after = emb.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    emb.discard()
    emb(torch.randint(0, 50, (10,), generator=gen)).sum().backward()
    emb.step()  # torch's Adam on the staged rows, written back
    assert not torch.equal(before["weight"], emb.state_dict()["weight"])
