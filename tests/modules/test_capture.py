"""A whole training step (HostEmbedding with a small GPU row cache, a dense head, both
optimizers) captured in a CUDA graph by CapturedStep trains exactly like the same step run
eagerly (float64, Adam with capturable=True, evictions every step); bad ids and wrong shapes
are refused on the host before anything runs. The capture needs the GPU machine."""

import gc

import pytest
import torch
from torch import nn

import speedtorch_ops as so
from conftest import HAS_CUDA

ROWS, DIM, SHAPE = 60, 6, (5, 4)
cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA GPU "
                                                    "(scripts/gpu_check.sh)")


def step_fn(emb, head, opt):
    def train_step(ids, other):
        a, b = emb(ids, other)
        out = head(torch.tanh(a + b)).squeeze(-1)
        loss = (out - 0.5).pow(2).sum()
        loss.backward()
        emb.step()
        opt.step()
        opt.zero_grad(set_to_none=False)  # the graph keeps its gradient buffers
        return loss.detach()
    return train_step


def build(init, slots, bounds_check, fused=False):
    emb = so.HostEmbedding.from_pretrained(
        init, freeze=False, optimizer=torch.optim.Adam,
        optimizer_kwargs={"lr": 0.05, "capturable": True, "fused": fused},
        device="cuda", bounds_check=bounds_check,
        cache_bytes=ROWS * 8 + slots * init[0].nbytes * 3 if slots else 0)
    head = nn.Linear(DIM, 1, dtype=torch.float64, device="cuda")
    with torch.no_grad():
        head.weight.copy_(torch.linspace(-1, 1, DIM, dtype=torch.float64))
        head.bias.fill_(0.1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1, momentum=0.9)
    return emb, head, step_fn(emb, head, opt)


def batches(steps, gen):
    out = []
    for _ in range(steps):
        ids = torch.randint(0, ROWS, SHAPE, generator=gen)
        hot = torch.randint(0, 8, SHAPE, generator=gen)
        ids = torch.where(torch.rand(SHAPE, generator=gen) < 0.5, hot, ids)  # repeats
        out.append((ids, torch.randint(0, ROWS, SHAPE, generator=gen)))
    return out


@cuda_only
@pytest.mark.parametrize("slots", [0, 7, 25])
@pytest.mark.parametrize("fused", [False, True])
def test_captured_steps_train_like_eager(slots, fused, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    data = batches(12, gen)
    emb_e, head_e, eager = build(init, slots, "raise", fused)
    emb_g, head_g, graphed = build(init, slots, "prechecked", fused)
    captured = so.CapturedStep(graphed, rows=(ROWS, ROWS), warmup=2)
    losses = []
    for ids, other in data:
        losses.append((float(eager(ids.cuda(), other.cuda())),
                       float(captured(ids.numpy(), other))))
    assert captured.graph is not None  # the later steps were replays
    close = lambda a, b: torch.allclose(a, b, rtol=1e-10, atol=1e-12)  # noqa: E731
    for e, g in losses:
        assert abs(e - g) <= 1e-10 * max(1.0, abs(e)), losses
    assert close(emb_g.weight, emb_e.weight)
    for key, value in emb_e.state_dict().items():
        assert close(emb_g.state_dict()[key].to(value.device), value), key
    assert close(head_g.weight, head_e.weight)
    if slots:
        stats = emb_g.cache_stats()  # the counts advanced in the replays too
        assert stats == emb_e.cache_stats()
        assert stats["lookups"] > 0 and stats["hits"] > 0
        if slots == 7:
            assert stats["evictions"] + stats["direct_writebacks"] > 0, stats


@cuda_only
def test_ids_on_the_gpu_train_like_host_ids_and_are_checked_there(gen):
    """Ids already on the step's GPU: checked there (a bad one raises naming it, nothing runs)
    and copied on the device; the same training as host ids, mixed call by call."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    data = batches(8, gen)
    emb_h, _, host_step = build(init, 7, "prechecked")
    emb_d, _, dev_step = build(init, 7, "prechecked")
    on_host = so.CapturedStep(host_step, rows=(ROWS, ROWS), warmup=2)
    on_gpu = so.CapturedStep(dev_step, rows=(ROWS, ROWS), warmup=2)
    for k, (ids, other) in enumerate(data):
        on_host(ids, other)
        if k == 5:  # a host call between GPU calls refills the same inputs
            on_gpu(ids, other.numpy())
        else:
            on_gpu(ids.cuda(), other.cuda().int())
    assert on_gpu.graph is not None
    assert torch.allclose(emb_d.weight, emb_h.weight, rtol=1e-10, atol=1e-12)
    before = emb_d.weight.clone()
    bad = data[0][1].cuda()
    bad.view(-1)[5] = -1
    with pytest.raises(RuntimeError, match=r"ids\[1\]\[5\] = -1 is out of range"):
        on_gpu(data[0][0].cuda(), bad)
    with pytest.raises(TypeError, match=r"ids\[0\] must be integers"):
        on_gpu(data[0][0].cuda().double(), data[0][1].cuda())
    torch.cuda.synchronize()
    assert torch.equal(emb_d.weight, before)


@cuda_only
def test_host_ids_of_any_integer_dtype_train_like_int64(gen):
    """Host ids of one narrower dtype cross as they are and widen on the GPU; a call of mixed
    dtypes takes the general path: every call trains as int64 ids do, and a bad id of a narrow
    dtype raises naming its input and position, with nothing run."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    data = batches(9, gen)
    emb_w, _, wide_step = build(init, 7, "prechecked")
    emb_n, _, narrow_step = build(init, 7, "prechecked")
    wide = so.CapturedStep(wide_step, rows=(ROWS, ROWS), warmup=2)
    narrow = so.CapturedStep(narrow_step, rows=(ROWS, ROWS), warmup=2)
    kinds = [lambda x: x.numpy().astype("int32"), lambda x: x.to(torch.int16),
             lambda x: x.numpy().astype("uint8"), lambda x: x.to(torch.int8)]
    for k, (ids, other) in enumerate(data):
        wide(ids, other)
        if k == 4:  # mixed dtypes
            narrow(ids.int().numpy(), other)
        else:
            narrow(*(kinds[k % len(kinds)](x) for x in (ids, other)))
    assert narrow.graph is not None
    assert torch.allclose(emb_n.weight, emb_w.weight, rtol=1e-10, atol=1e-12)
    before = emb_n.weight.clone()
    ids, other = data[0]
    bad = other.numpy().astype("int32")
    bad.reshape(-1)[6] = -3
    with pytest.raises(RuntimeError, match=r"ids\[1\]\[6\] = -3 is out of range"):
        narrow(ids.numpy().astype("int32"), bad)
    bad = ids.numpy().astype("uint8")
    bad.reshape(-1)[2] = ROWS
    with pytest.raises(RuntimeError, match=rf"ids\[0\]\[2\] = {ROWS} is out of range"):
        narrow(bad, other.numpy().astype("uint8"))
    torch.cuda.synchronize()
    assert torch.equal(emb_n.weight, before)  # nothing ran


@cuda_only
def test_captured_step_refuses_bad_ids_and_shapes(gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    emb, _, step = build(init, 7, "prechecked")
    captured = so.CapturedStep(step, rows=(ROWS, ROWS), warmup=1)
    data = batches(3, gen)
    for ids, other in data[:2]:  # an eager step, then the capture
        captured(ids, other)
    before = emb.weight.clone()
    bad = data[2][1].clone()
    bad.view(-1)[7] = ROWS
    with pytest.raises(RuntimeError, match=rf"ids\[1\]\[7\] = {ROWS} is out of range"):
        captured(data[2][0], bad)
    with pytest.raises(ValueError, match=r"ids\[0\] has shape \(3, 4\)"):
        captured(data[2][0][:3], data[2][1])
    with pytest.raises(ValueError, match="expected 2 id tensors"):
        captured(data[2][0])
    torch.cuda.synchronize()
    assert torch.equal(emb.weight, before)  # nothing ran


@cuda_only
def test_device_ids_cannot_be_checked_inside_a_capture(gen):
    """With bounds_check="raise", ids on the GPU are checked with a wait for the GPU, which a
    capture cannot do: the capture fails with an error that says what to do."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    _, _, step = build(init, 7, "raise")
    captured = so.CapturedStep(step, rows=(ROWS, ROWS), warmup=1)
    ids, other = batches(2, gen)[0]
    captured(ids, other)
    with pytest.raises(RuntimeError, match="bounds_check='prechecked'"):
        captured(ids, other)


def test_captured_step_needs_a_gpu_or_a_warmup():
    if not HAS_CUDA:
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            so.CapturedStep(lambda ids: ids, rows=(4,))
    else:
        with pytest.raises(ValueError, match="warmup must be at least 1"):
            so.CapturedStep(lambda ids: ids, rows=(4,), warmup=0)


def test_plans_of_device_ids_check_or_trust_them():
    """Plan.on_device (the modules' plan for ids already on their GPU; built here on the CPU,
    the same code): "raise" finds the first bad id, "prechecked" leaves the ids to the caller."""
    from speedtorch_ops.training.plan import Plan
    ids = torch.tensor([[3, 0], [9, 12]])
    with pytest.raises(RuntimeError, match=r"ids\[3\] = 12 is out of range for a table of 10"):
        Plan.on_device(ids).check(10)
    Plan.on_device(ids, "prechecked").check(10)  # trusted: no error
    Plan.on_device(ids).check(13)
    assert len(Plan.on_device(ids)) == 4
    with pytest.raises(TypeError, match="ids must be integers"):
        Plan.on_device(ids.float())
    with pytest.raises(ValueError, match="bounds_check must be"):
        Plan.on_device(ids, "later")
    with pytest.raises(ValueError, match="bounds_check must be 'raise' or 'prechecked'"):
        so.HostEmbedding(10, 4, bounds_check="later")


@cuda_only
def test_capture_refuses_optimizer_state_on_the_cpu(gen):
    """torch's Adagrad (not fused) counts its steps on the CPU: a graph would freeze the count,
    so the capture fails naming the optimizer."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.Adagrad,
                                           device="cuda", bounds_check="prechecked")

    def train_step(ids):
        emb(ids).pow(2).sum().backward()
        emb.step()

    captured = so.CapturedStep(train_step, rows=(ROWS,), warmup=1)
    ids = torch.randint(0, ROWS, (6,), generator=gen)
    captured(ids)
    with pytest.raises(RuntimeError, match=r"optimizer: Adagrad keeps \['step'\] on the CPU"):
        captured(ids)


@cuda_only
def test_capture_survives_garbage_pinned_tables(gen):
    """A pinned table in a reference cycle is freed by the cyclic collector whenever that runs;
    freed during a capture, its unregistration would invalidate the capture. Here the step drops
    the last reference to such a cycle, so it becomes garbage inside the capture, and the
    collector is set to run at almost every allocation: CapturedStep keeps it off while it
    captures."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    emb, head, step = build(init, 7, "prechecked")
    box = []

    def step_with_garbage(ids, other):
        box.clear()
        return step(ids, other)

    graphed = so.CapturedStep(step_with_garbage, rows=(ROWS, ROWS), warmup=1)
    data = batches(3, gen)
    graphed(*data[0])  # eager warm-up
    cycle = [so.empty_pinned((1000, 16))]
    cycle.append(cycle)
    box.append(cycle)
    del cycle
    old = gc.get_threshold()
    try:
        gc.set_threshold(1, 1, 1)
        graphed(*data[1])  # the capture
        graphed(*data[2])
    finally:
        gc.set_threshold(*old)
    assert graphed.graph is not None
    torch.cuda.synchronize()


FAILING_CAPTURE = """
import torch
import speedtorch_ops as so

side = torch.cuda.Stream()

def step(ids):
    out = torch.zeros(4, device="cuda").index_add_(0, ids % 4, torch.ones(ids.shape, device="cuda"))
    if torch.cuda.is_current_stream_capturing():
        side.wait_stream(torch.cuda.current_stream())  # a fork never joined
        with torch.cuda.stream(side):
            out.add_(1)
        raise MemoryError("the step's own error")
    return out

captured = so.CapturedStep(step, rows=(10,), warmup=1)
captured(torch.arange(6))
try:
    captured(torch.arange(6))
except MemoryError as error:
    print("raised:", type(error).__name__, error, "| graph:", captured.graph)
"""


@cuda_only
def test_a_step_failing_inside_the_capture_raises_its_own_error():
    """A step that fails after forking a side stream (as a prefetch or the cache's lane does)
    also makes the capture's end fail; the step's own error is the one raised. In a process of
    its own: torch leaves a failed capture's CUDA random generator unusable (the next
    nn.Linear failed with "Offset increment outside graph capture")."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", FAILING_CAPTURE], capture_output=True,
                          text=True, timeout=300)
    assert "raised: MemoryError the step's own error | graph: None" in done.stdout, (
        done.stdout + done.stderr)


@cuda_only
def test_upload_all_is_one_buffer_of_the_inputs(gen):
    """A captured step's ids cross in one copy: views of one device buffer, refilled in place;
    an empty list, mixed dtypes and a buffer of another size are refused or handled."""
    from speedtorch_ops.training.placement import upload_all
    values = [torch.randint(0, 99, shape, generator=gen) for shape in [(5, 4), (7,), (0,), (3, 2)]]
    flat, views = upload_all(values, torch.device("cuda"))
    assert flat.shape == (sum(v.numel() for v in values),) and flat.is_cuda
    for v, w in zip(values, views):
        assert w.shape == v.shape and torch.equal(w.cpu(), v)
        assert w.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    again = [torch.randint(0, 99, v.shape, generator=gen) for v in values]
    same, views2 = upload_all(again, torch.device("cuda"), out=flat)
    assert same is flat
    for v, w in zip(again, views):  # the first call's views see the new ids
        assert torch.equal(w.cpu(), v)
    assert upload_all([], torch.device("cuda"))[1] == []
    with pytest.raises(TypeError, match="one dtype"):
        upload_all([values[0], values[1].int()], torch.device("cuda"))
    with pytest.raises(ValueError, match="out must be the 1-D"):
        upload_all(values, torch.device("cuda"), out=flat[1:])
    assert torch.equal(flat.cpu(), torch.cat([v.reshape(-1) for v in again]))  # untouched


class _Ring:
    """A _PinnedRing without pinning (the CPU): buffers as they are asked for."""

    def take(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)


def test_host_ids_staged_as_they_are_or_left_to_the_general_path():
    """CapturedStep's host ids (the CPU part, no GPU needed): ids all of one of int8, uint8,
    int16, int32, int64 are staged as they are, in order, their shapes kept; other mixes are
    left to the general path (None); a bad id raises naming its input and position."""
    import numpy as np

    from speedtorch_ops.capture import _HostIds
    a = np.array([[3, 1], [0, 7]], dtype=np.int32)
    b = torch.tensor([5, 9, 2], dtype=torch.int32)
    staged = _HostIds.of((a, b), (8, 10), _Ring())
    assert staged.staging.dtype == torch.int32
    assert staged.staging.tolist() == [3, 1, 0, 7, 5, 9, 2]
    assert [tuple(s) for s in staged.shapes] == [(2, 2), (3,)]
    small = np.array([4, 0], dtype=np.uint8)
    assert _HostIds.of((small,), (5,), _Ring()).staging.dtype == torch.uint8
    assert _HostIds.of((a, b.long()), (8, 10), _Ring()) is None  # mixed dtypes
    assert _HostIds.of((a.astype(np.uint16),), (8,), _Ring()) is None
    assert _HostIds.of(([1, 2],), (8,), _Ring()) is None  # a list
    assert _HostIds.of((torch.tensor([1, 2])._neg_view(),), (8,), _Ring()) is None
    with pytest.raises(RuntimeError, match=r"ids\[1\]\[2\] = 10 is out of range"):
        _HostIds.of((a, np.array([1, 2, 10], dtype=np.int32)), (8, 10), _Ring())
    with pytest.raises(RuntimeError, match=r"ids\[0\]\[3\] = -1 is out of range"):
        _HostIds.of((np.array([0, 1, 2, -1], dtype=np.int8),), (8,), _Ring())
