"""_bag_segment_sum (CPU) against plain PyTorch in float64: each distinct row's gradient of a
sum- or mean-pooled lookup (torch's embedding_bag backward), from the positions _distinct
sorted, for the positions [lo, lo + n) of a longer step; per-sample weights, duplicates within
and across bags, empty bags, every dtype, 1 and several threads. Bad input raises naming the
argument."""

import pytest
import torch
import torch.nn.functional as F

from speedtorch_ops import ops

TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 5e-2}


def case(gen, bags=9, rows=12, dim=19, before=5, after=7, max_len=5):
    """A step of `before` positions of another lookup, then bags of ids (empty ones too), then
    `after` more; the step's distinct ids as _distinct gives them."""
    lengths = torch.randint(0, max_len + 1, (bags,), generator=gen)
    lengths[0] = 0
    n = int(lengths.sum())
    ids = torch.randint(0, rows, (before + n + after,), generator=gen)
    d = ops._distinct(ids, rows)
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    grad = torch.randn(bags, dim, generator=gen, dtype=torch.float64)
    weights = torch.rand(n, generator=gen, dtype=torch.float64)
    return ids, d, offsets, grad, weights, before, n


def reference(ids, d, offsets, grad, weights, mean, lo, n):
    """torch's embedding_bag backward over the staged rows, in float64."""
    count = int(d[2])
    rows = torch.zeros(count, grad.shape[1], dtype=torch.float64, requires_grad=True)
    out = F.embedding_bag(d[1][lo:lo + n], rows, offsets, mode="mean" if mean else "sum",
                          per_sample_weights=weights, include_last_offset=True)
    out.backward(grad)
    return rows.grad


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("mode", ["sum", "mean", "weighted"])
@pytest.mark.parametrize("dim", [1, 7, 16, 19, 64, 100])
def test_bag_segment_sum_equals_embedding_bags_backward(dtype, mode, dim, threads, gen):
    ids, d, offsets, grad, weights, lo, n = case(gen, bags=40, dim=dim)
    w = weights if mode == "weighted" else None
    want = reference(ids, d, offsets, grad, w, mode == "mean", lo, n)
    count = int(d[2])
    got = ops._bag_segment_sum(grad.to(dtype), offsets, None if w is None else w.to(dtype),
                               mode == "mean", d[3], d[4], d[2], lo, count + 3)
    assert got.dtype == dtype and got.shape == (count + 3, dim)
    assert torch.allclose(got[:count].double(), want, rtol=TOL[dtype], atol=TOL[dtype]), \
        gen.initial_seed()
    assert not got[count:].any()  # rows past count: zero


def test_large_step_on_several_threads(threads, gen):
    """Rows enough that the pass splits over threads: the same sums as torch's."""
    ids, d, offsets, grad, weights, lo, n = case(gen, bags=3000, rows=5000, dim=33, max_len=9)
    want = reference(ids, d, offsets, grad, None, False, lo, n)
    got = ops._bag_segment_sum(grad, offsets, None, False, d[3], d[4], d[2], lo, int(d[2]))
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), gen.initial_seed()


def test_no_positions_and_no_rows(gen):
    d = ops._distinct(torch.zeros(0, dtype=torch.int64), 4)
    offsets = torch.zeros(4, dtype=torch.int64)  # three empty bags
    out = ops._bag_segment_sum(torch.ones(3, 5), offsets, None, True, d[3], d[4], d[2], 0, 2)
    assert out.shape == (2, 5) and not out.any()


@pytest.mark.parametrize("bad,match", [
    (lambda a: a.update(offsets=a["offsets"].flip(0)), "offsets"),
    (lambda a: a.update(offsets=a["offsets"] + 1), r"offsets\[0\]"),
    (lambda a: a.update(offsets=a["offsets"][:-1]), "offsets"),
    (lambda a: a.update(offsets=a["offsets"].int()), "offsets"),
    (lambda a: a.update(lo=10**6), "lo"),
    (lambda a: a.update(lo=a["perm"].numel() - 1), "offsets"),
    (lambda a: a.update(weights=torch.ones(3, dtype=torch.float64)), "per_sample_weights"),
    (lambda a: a.update(weights=torch.ones(a["n"]), ), "per_sample_weights"),
    (lambda a: a.update(weights=torch.ones(a["n"], dtype=torch.float64), mean=True),
     "per_sample_weights"),
    (lambda a: a["perm"].__setitem__(0, 10**6), "perm"),
    (lambda a: a.update(grad=a["grad"].t()), "grad"),
    (lambda a: a.update(grad=a["grad"].long()), "grad"),
    (lambda a: a.update(count=a["count"].expand(2).clone()), "count"),
    (lambda a: a.update(rows=-1), "rows"),
])
def test_bad_input_names_the_argument(bad, match, gen):
    ids, d, offsets, grad, weights, lo, n = case(gen)
    a = dict(grad=grad, offsets=offsets, weights=None, mean=False, perm=d[3].clone(),
             starts=d[4], count=d[2], lo=lo, rows=int(d[2]), n=n)
    bad(a)
    with pytest.raises(RuntimeError, match=match):
        ops._bag_segment_sum(a["grad"], a["offsets"], a["weights"], a["mean"], a["perm"],
                             a["starts"], a["count"], a["lo"], a["rows"])


def test_opcheck(gen):
    ids, d, offsets, grad, weights, lo, n = case(gen)
    op = torch.ops.speedtorch_ops._bag_segment_sum.default
    torch.library.opcheck(op, (grad, offsets, weights, False, d[3], d[4], d[2], lo, int(d[2])))
    torch.library.opcheck(op, (grad.float(), offsets, None, True, d[3], d[4], d[2], lo, 2))
