"""A model with many embedding tables (recommenders have 26 and more), each with its own model and
optimizer factory, trained plain, colocated and with prefetch: every table equals an independent
float64 lazy-Adam reference written here (only the rows a step touched change, each with its
summed gradient; the step count is global per table)."""

import numpy as np
import pytest
import torch
from torch import nn

import speedtorch_ops as so
from conftest import HAS_CUDA

ROWS, DIM, BATCH, LR = 30, 4, 6, 0.05
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


class ManyTables(nn.Module):
    """One batch-sized embedding per table; the loss mixes every table's rows."""

    def __init__(self, tables):
        super().__init__()
        self.embeddings = nn.ModuleList(nn.Embedding(BATCH, DIM) for _ in range(tables))

    def forward(self, slots, target):
        rows = [e.weight.index_select(0, slots) for e in self.embeddings]
        out = sum((r * (k + 1)).sum(-1) for k, r in enumerate(rows))
        return ((out - target) ** 2).sum()


def lazy_adam_reference(init, batches, targets):
    """float64 Adam (torch's formula, defaults betas=(0.9, 0.999), eps=1e-8) on the touched rows."""
    tables = [t.clone() for t in init]
    m = [torch.zeros_like(t) for t in init]
    v = [torch.zeros_like(t) for t in init]
    b1, b2, eps = 0.9, 0.999, 1e-8
    for step, (ids, target) in enumerate(zip(batches, targets), start=1):
        full = [t.clone().requires_grad_() for t in tables]
        out = sum((f[torch.as_tensor(i)] * (k + 1)).sum(-1) for k, (f, i) in
                  enumerate(zip(full, ids)))
        ((out - target) ** 2).sum().backward()
        for k, i in enumerate(ids):
            rows = torch.unique(torch.as_tensor(i))
            g = full[k].grad[rows]
            m[k][rows] = b1 * m[k][rows] + (1 - b1) * g
            v[k][rows] = b2 * v[k][rows] + (1 - b2) * g * g
            denom = (v[k][rows] / (1 - b2 ** step)).sqrt() + eps
            tables[k][rows] -= LR / (1 - b1 ** step) * m[k][rows] / denom
    return tables, m, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tables", [9, 26])
@pytest.mark.parametrize("mode", ["plain", "colocated", "prefetch"])
def test_many_tables_train_like_lazy_adam(device, tables, mode, gen):
    steps = 4
    init = [torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen) for _ in range(tables)]
    # Duplicates within a batch and rows shared between consecutive batches (prefetch patches).
    batches = [[torch.randint(0, ROWS // 3, (BATCH,), generator=gen).numpy().astype(np.int32)
                for _ in range(tables)] for _ in range(steps)]
    targets = [torch.randn(BATCH, dtype=torch.float64, generator=gen) for _ in range(steps)]

    model = ManyTables(tables).to(device, torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    pairs = []
    for k, emb in enumerate(model.embeddings):
        mf = so.ModelFactory(emb, ROWS, DIM, datatype="float64", CPUPinn=True)
        of = so.OptimizerFactory(opt, ROWS, DIM, model, f"embeddings.{k}", "float64", True)
        if mode != "plain":
            so.colocate(mf, of)
        mf.customInit(lambda t, k=k: t.copy_(init[k]))
        of.optInit()
        pairs.append((mf, of))
    slots = torch.arange(BATCH, device=device)
    for step, (ids, target) in enumerate(zip(batches, targets)):
        with torch.no_grad():
            for (mf, of), i in zip(pairs, ids):
                mf.beforeForwardPass(i)
                of.beforeForwardPass(i)
                if mode == "prefetch" and step + 1 < steps:
                    mf.prefetch(batches[step + 1][pairs.index((mf, of))])
        opt.zero_grad()
        model(slots, target.to(device)).backward()
        opt.step()
        with torch.no_grad():
            for (mf, of), i in zip(pairs, ids):
                mf.afterOptimizerStep(i)
                of.afterOptimizerStep(i)

    want, m, v = lazy_adam_reference(init, batches, targets)
    for k, (mf, of) in enumerate(pairs):
        msg = f"table {k} of {tables}, {mode}, seed {gen.initial_seed()}"
        assert np.allclose(mf.getNumpyVersion(), want[k].numpy(), rtol=1e-9, atol=1e-9), msg
        state = of.getNumpyVersion()
        assert of.optVarList == ["exp_avg", "exp_avg_sq"]
        assert np.allclose(state[0], m[k].numpy(), rtol=1e-9, atol=1e-12), msg
        assert np.allclose(state[1], v[k].numpy(), rtol=1e-9, atol=1e-12), msg
