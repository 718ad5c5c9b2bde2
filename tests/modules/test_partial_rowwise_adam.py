"""PartialRowWiseAdam (a first moment per element, one second moment per row) against a
written-out float64 formula, on a plain tensor and through HostEmbedding (the lazy rule: the
touched rows only, each with its own step count of the table's steps), fused and through the
optimizer's own step; state_dict round trips resume exactly; bad arguments name themselves.
The "cuda" cases run on the GPU machine."""

import math

import pytest
import torch

import speedtorch_ops as so
from conftest import HAS_CUDA

ROWS, DIM = 30, 6
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
KW = dict(lr=0.05, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)


def reference_step(w, m, v, g, t, touched, lr, betas, eps, weight_decay):
    """FBGEMM's partial row-wise Adam at step t, row by row, in float64."""
    w, m, v = w.clone(), m.clone(), v.clone()
    b1, b2 = betas
    for r in touched:
        m[r] = b1 * m[r] + (1 - b1) * g[r]
        v[r] = b2 * v[r] + (1 - b2) * float((g[r] * g[r]).mean())
        m_hat = m[r] / (1 - b1 ** t)
        v_hat = float(v[r]) / (1 - b2 ** t)
        w[r] = w[r] - lr * (m_hat / (math.sqrt(v_hat) + eps) + weight_decay * w[r])
    return w, m, v


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_optimizer_equals_the_formula(weight_decay, gen):
    kw = {**KW, "weight_decay": weight_decay}
    w0 = torch.randn(ROWS, 2, 3, dtype=torch.float64, generator=gen)  # rows of any shape
    p = w0.clone().requires_grad_()
    opt = so.PartialRowWiseAdam([p], **kw)
    w, m = w0.clone(), torch.zeros_like(w0)
    v = torch.zeros(ROWS, dtype=torch.float64)
    for t in range(1, 5):
        g = torch.randn(ROWS, 2, 3, dtype=torch.float64, generator=gen)
        p.grad = g.clone()
        opt.step()
        w, m, v = reference_step(w, m, v, g, t, range(ROWS), **kw)
    state = opt.state[p]
    assert float(state["step"]) == 4
    assert torch.allclose(p.detach(), w, rtol=1e-12, atol=1e-13)
    assert torch.allclose(state["exp_avg"], m, rtol=1e-12, atol=1e-13)
    assert state["exp_avg_sq"].shape == (ROWS,)
    assert torch.allclose(state["exp_avg_sq"], v, rtol=1e-12, atol=1e-15)


def test_optimizer_names_bad_arguments():
    p = torch.zeros(3, 2, requires_grad=True)
    for kwargs, message in [(dict(lr=-1), "lr must be a number >= 0"),
                            (dict(eps=-1e-8), "eps must be"),
                            (dict(weight_decay="x"), "weight_decay must be"),
                            (dict(betas=(0.9, 1.0)), "betas must be two numbers in"),
                            (dict(betas=0.9), "betas must be"),
                            (dict(capturable=1), "capturable must be a bool")]:
        with pytest.raises((ValueError, TypeError), match=message):
            so.PartialRowWiseAdam([p], **kwargs)
    scalar = torch.zeros((), requires_grad=True)
    scalar.grad = torch.ones(())
    with pytest.raises(ValueError, match="at least 1-D"):
        so.PartialRowWiseAdam([scalar]).step()
    dense = torch.ones(3, 2, requires_grad=True)
    dense.grad = torch.ones(3, 2)
    sparse = torch.ones(3, 2, requires_grad=True)
    sparse.grad = torch.ones(3, 2).to_sparse()
    opt = so.PartialRowWiseAdam([dense, sparse])
    with pytest.raises(RuntimeError, match="PartialRowWiseAdam takes dense gradients"):
        opt.step()
    assert torch.equal(dense.detach(), torch.ones(3, 2)) and not opt.state  # nothing changed


def _train(emb, batches, targets, device):
    for ids, target in zip(batches, targets):
        out = emb(ids.to(device))
        ((out.double() * target.to(device)).sum(-1) - 1).pow(2).sum().backward()
        emb.step()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fused", [True, False])
def test_module_equals_the_lazy_formula(device, fused, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=so.PartialRowWiseAdam,
                                           optimizer_kwargs=KW, device=device)
    emb.fused_update = fused
    assert emb.fused is fused
    # One record: weight and exp_avg (DIM values each), the second moment after them.
    assert tuple(emb.host.shape) == (ROWS, 1, (2 * DIM + 1) * 8)
    assert emb.row_bytes == (2 * DIM + 1) * 8
    w, m = init.clone(), torch.zeros_like(init)
    v = torch.zeros(ROWS, dtype=torch.float64)
    batches, targets = [], []
    for t in range(1, 6):
        ids = torch.randint(0, ROWS, (4, 5), generator=gen)
        ids[0, :3] = ids[1, 0]  # repeats
        target = torch.randn(4, 5, DIM, dtype=torch.float64, generator=gen)
        batches.append(ids)
        targets.append(target)
        g = torch.zeros_like(w).index_add_(  # the independent gradient, on the CPU
            0, ids.view(-1), (2 * ((w[ids] * target).sum(-1, keepdim=True) - 1) * target)
            .view(-1, DIM))
        w, m, v = reference_step(w, m, v, g, t, torch.unique(ids).tolist(), **KW)
    _train(emb, batches, targets, device)
    sd = emb.state_dict()
    assert set(sd) == {"weight", "optimizer.exp_avg", "optimizer.exp_avg_sq", "optimizer.step"}
    assert torch.allclose(sd["weight"].cpu(), w, rtol=1e-11, atol=1e-12)
    assert torch.allclose(sd["optimizer.exp_avg"].cpu(), m, rtol=1e-11, atol=1e-12)
    assert torch.allclose(sd["optimizer.exp_avg_sq"].cpu(), v, rtol=1e-11, atol=1e-14)
    assert float(sd["optimizer.step"]) == 5


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip(device, gen, tmp_path):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    kw = dict(optimizer=so.PartialRowWiseAdam, optimizer_kwargs=KW, device=device)
    batches = [torch.randint(0, ROWS, (9,), generator=gen) for _ in range(4)]
    targets = [torch.randn(9, DIM, dtype=torch.float64, generator=gen) for _ in batches]
    whole = so.HostEmbedding.from_pretrained(init, freeze=False, **kw)
    _train(whole, batches, targets, device)
    first = so.HostEmbedding.from_pretrained(init, freeze=False, **kw)
    _train(first, batches[:2], targets[:2], device)
    torch.save(first.state_dict(), tmp_path / "emb.pt")
    resumed = so.HostEmbedding(ROWS, DIM, dtype=torch.float64, **kw)
    resumed.load_state_dict(torch.load(tmp_path / "emb.pt"))
    _train(resumed, batches[2:], targets[2:], device)
    for key, value in whole.state_dict().items():
        assert torch.equal(resumed.state_dict()[key], value), key


def test_captured_step_counts_on_the_device():
    if not HAS_CUDA:
        pytest.skip("needs a CUDA GPU (run scripts/gpu_check.sh on the GPU machine)")
    gen = torch.Generator().manual_seed(7)
    init = torch.randn(ROWS, DIM, generator=gen)
    batches = [torch.randint(0, ROWS, (16,), generator=gen).cuda() for _ in range(8)]
    kw = dict(optimizer=so.PartialRowWiseAdam,
              optimizer_kwargs={**KW, "capturable": True}, device="cuda",
              bounds_check="prechecked")
    eager = so.HostEmbedding.from_pretrained(init, freeze=False, **kw)
    graphed = so.HostEmbedding.from_pretrained(init, freeze=False, **kw)

    def step(emb, ids):
        loss = emb(ids).pow(2).sum()
        loss.backward()
        emb.step()
        return loss.detach()

    for ids in batches:
        step(eager, ids)
    captured = so.CapturedStep(lambda ids: step(graphed, ids), rows=(ROWS,), warmup=2)
    for ids in batches:
        captured(ids)
    assert captured.graph is not None
    for key, value in eager.state_dict().items():
        assert torch.allclose(graphed.state_dict()[key].cpu(), value.cpu(), rtol=1e-5,
                              atol=1e-6), key


@pytest.mark.parametrize("fused", [True, False])
def test_a_step_without_rows_counts_and_changes_no_row(fused, gen):
    """A step whose forward looked nothing up counts the step (as torch's Adam does, and the
    fused update) and changes no row; the next step goes on from there."""
    emb = so.HostEmbedding(10, 4, optimizer=so.PartialRowWiseAdam, optimizer_kwargs=KW,
                           device="cpu", dtype=torch.float64)
    emb.fused_update = fused
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    emb(torch.zeros(0, dtype=torch.int64)).sum().backward()
    emb.step()
    after = emb.state_dict()
    assert float(after["optimizer.step"]) == 1
    for key, value in after.items():
        if key != "optimizer.step":
            assert torch.equal(value, before[key]), key
    emb(torch.tensor([3, 3, 5])).pow(2).sum().backward()
    emb.step()
    assert float(emb.state_dict()["optimizer.step"]) == 2
