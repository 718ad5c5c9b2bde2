"""RowWiseAdagrad (one accumulator per row) against an independent float64 formula, on a plain
tensor and through HostEmbedding, whose host rows pack the accumulator beside the weight: the
module equals nn.Embedding trained on the full table with the same optimizer (dense gradients:
untouched rows do not change), state_dict round trips resume exactly, and the factories refuse it with a clear error (the sharded
modules' tests cover it in tests/distributed)."""

import pytest
import torch
from torch import nn

import speedtorch_ops as so
from conftest import HAS_CUDA

ROWS, DIM = 30, 5
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
KW = dict(lr=0.3, eps=1e-8, weight_decay=0.0, initial_accumulator_value=0.1)


def reference_step(w, acc, g, lr, eps, weight_decay, touched):
    """FBGEMM's exact row-wise Adagrad, row by row, in float64 (lazy: `touched` rows only)."""
    w, acc = w.clone(), acc.clone()
    for r in touched:
        grad = g[r] + weight_decay * w[r]
        acc[r] += float((grad * grad).sum()) / grad.numel()
        w[r] = w[r] - lr * grad / (acc[r].sqrt() + eps)
    return w, acc


@pytest.mark.parametrize("weight_decay", [0.0, 0.05])
def test_optimizer_equals_the_formula(weight_decay, gen):
    w0 = torch.randn(ROWS, 3, 2, dtype=torch.float64, generator=gen)  # rows of any shape
    p = w0.clone().requires_grad_()
    kw = {**KW, "weight_decay": weight_decay}
    opt = so.RowWiseAdagrad([p], **kw)
    w, acc = w0.clone(), torch.full((ROWS,), KW["initial_accumulator_value"], dtype=torch.float64)
    for _ in range(4):
        g = torch.randn(ROWS, 3, 2, dtype=torch.float64, generator=gen)
        g[::3] = 0  # rows without a gradient
        p.grad = g.clone()
        opt.step()
        w, acc = reference_step(w, acc, g, kw["lr"], kw["eps"], weight_decay, range(ROWS))
    assert torch.allclose(p.detach(), w, rtol=1e-12, atol=1e-12)
    assert torch.allclose(opt.state[p]["sum"], acc, rtol=1e-12, atol=1e-12)
    if weight_decay == 0:
        assert torch.equal(p.detach()[::3], w0[::3])  # zero gradient: the row stays


def test_optimizer_names_bad_arguments():
    with pytest.raises(ValueError, match="lr must be a number >= 0"):
        so.RowWiseAdagrad([torch.zeros(2, 2, requires_grad=True)], lr=-1)
    p = torch.zeros((), requires_grad=True)
    p.grad = torch.ones(())
    with pytest.raises(ValueError, match="at least 1-D"):
        so.RowWiseAdagrad([p]).step()
    dense = torch.ones(3, 2, requires_grad=True)
    dense.grad = torch.ones(3, 2)
    sparse = torch.ones(3, 2, requires_grad=True)
    sparse.grad = torch.ones(3, 2).to_sparse()
    with pytest.raises(RuntimeError, match="dense gradients"):
        so.RowWiseAdagrad([dense, sparse]).step()
    assert torch.equal(dense.detach(), torch.ones(3, 2))  # a refused step changes nothing


@pytest.mark.parametrize("device", DEVICES)
def test_module_equals_full_table_training(device, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=so.RowWiseAdagrad,
                                           optimizer_kwargs=KW, device=device)
    # One record: the weight, the accumulator after it.
    assert tuple(emb.host.shape) == (ROWS, 1, (DIM + 1) * 8) and emb.row_bytes == (DIM + 1) * 8
    full = nn.Embedding.from_pretrained(init.clone(), freeze=False).to(device)
    opt = so.RowWiseAdagrad(full.parameters(), **KW)
    w, acc = init.clone(), torch.full((ROWS,), KW["initial_accumulator_value"],
                                      dtype=torch.float64)
    for _ in range(6):
        ids = torch.randint(0, ROWS, (4, 7), generator=gen)
        ids[0, :3] = ids[1, 0]  # repeats
        target = torch.randn(4, 7, DIM, dtype=torch.float64, generator=gen)
        for module in (emb, full):
            ((module(ids.to(device)) * target.to(device)).sum(-1) - 1).pow(2).sum().backward()
        emb.step()
        opt.step()
        opt.zero_grad()
        g = torch.zeros_like(w).index_add_(  # the independent gradient, on the CPU
            0, ids.view(-1), (2 * ((w[ids] * target).sum(-1, keepdim=True) - 1) * target)
            .view(-1, DIM))
        w, acc = reference_step(w, acc, g, KW["lr"], KW["eps"], 0.0, torch.unique(ids).tolist())
    # The module's fused update sums a row's squared gradients in its own order.
    tol = 1e-12
    assert torch.allclose(emb.weight.cpu(), full.weight.detach().cpu(), rtol=tol, atol=tol)
    assert torch.allclose(emb.weight.cpu(), w, rtol=1e-12, atol=1e-12)
    sd = emb.state_dict()
    assert set(sd) == {"weight", "optimizer.sum"} and sd["optimizer.sum"].shape == (ROWS,)
    assert torch.allclose(sd["optimizer.sum"].cpu(), acc, rtol=1e-12, atol=1e-12)
    assert torch.allclose(sd["optimizer.sum"].cpu(),
                          opt.state[full.weight]["sum"].cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip(device, gen, tmp_path):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    kw = dict(optimizer=so.RowWiseAdagrad, optimizer_kwargs=KW, device=device)
    batches = [torch.randint(0, ROWS, (9,), generator=gen) for _ in range(4)]

    def train(emb, ids_list):
        for ids in ids_list:
            emb(ids.to(device)).pow(2).sum().backward()
            emb.step()

    whole = so.HostEmbedding.from_pretrained(init, freeze=False, **kw)
    train(whole, batches)
    first = so.HostEmbedding.from_pretrained(init, freeze=False, **kw)
    train(first, batches[:2])
    torch.save(first.state_dict(), tmp_path / "emb.pt")
    resumed = so.HostEmbedding(ROWS, DIM, dtype=torch.float64, **kw)
    resumed.load_state_dict(torch.load(tmp_path / "emb.pt"))
    train(resumed, batches[2:])
    tol = 0 if device == "cpu" else 1e-12
    for key, value in whole.state_dict().items():
        assert torch.allclose(resumed.state_dict()[key], value, rtol=tol, atol=tol), key


def test_factories_refuse_it():
    model = nn.Module()
    model.emb = nn.Embedding(4, 3)
    opt = so.RowWiseAdagrad(model.parameters())
    with pytest.raises(ValueError, match="given_optimizer: RowWiseAdagrad keeps one value per row"):
        so.OptimizerFactory(opt, 10, 3, model, "emb", CPUPinn=False)

