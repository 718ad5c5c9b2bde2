"""HostEmbedding and HostEmbeddingBag against independent references: nn.Embedding / nn.EmbeddingBag
with SGD on the full table, and a float64 "lazy" reference (torch's optimizer applied to the
touched rows only, with their summed gradient and the global step count). The GPU row cache must
train exactly like no cache, with budgets that force evictions every step (GPU machine)."""

import copy

import pytest
import torch
from torch import nn

import speedtorch_ops as so
from conftest import HAS_CUDA

ROWS, DIM = 40, 5
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.1}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.05}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
    "Adam-l2-maximize": (torch.optim.Adam, {"lr": 0.05, "betas": (0.8, 0.99), "eps": 1e-6,
                                            "weight_decay": 0.2, "maximize": True}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.8, "nesterov": True,
                                       "weight_decay": 0.05}),
    "SGD-dampening": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.7, "dampening": 0.3,
                                        "maximize": True}),
    "Adagrad-decay": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.05, "weight_decay": 0.1,
                                            "eps": 1e-6}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "Rprop": (torch.optim.Rprop, {"lr": 0.01}),
    "Adamax": (torch.optim.Adamax, {"lr": 0.05}),
}


def id_batches(steps, gen, rows=ROWS, shape=(4, 6), hot=None):
    """Random ids with duplicates; with `hot`, most ids from the first `hot` rows (so a small
    cache has hits, and misses evict)."""
    out = []
    for _ in range(steps):
        ids = torch.randint(0, rows, shape, generator=gen)
        if hot is not None:
            ids = torch.where(torch.rand(shape, generator=gen) < 0.6,
                              torch.randint(0, hot, shape, generator=gen), ids)
        out.append(ids)
    return out


def loss_of(out, target):
    return ((out * target).sum(-1) - 1.0).pow(2).sum()


def lazy_reference(name, init, batches, targets):
    """The full table after lazy training with torch's optimizer `name` on the CPU, float64."""
    cls, kwargs = OPTIMIZERS[name]
    table = init.clone()
    states, scalars = {}, None
    for ids, target in zip(batches, targets):
        full = table.clone().requires_grad_()
        loss_of(full[ids], target).backward()
        rows = torch.unique(ids)
        param = table[rows].clone().requires_grad_()
        param.grad = full.grad[rows]
        opt = cls([param], **kwargs)
        if scalars is not None:
            opt.state[param].update(copy.deepcopy(scalars))
            for key, full_state in states.items():
                opt.state[param][key] = full_state[rows].clone()
        opt.step()
        with torch.no_grad():
            table[rows] = param
        st = opt.state[param]
        for key, value in st.items():
            if torch.is_tensor(value) and value.shape == param.shape:
                if key not in states:
                    fill = kwargs.get("initial_accumulator_value", 0.0) if key == "sum" else (
                        kwargs["lr"] if key == "step_size" else 0.0)
                    states[key] = torch.full_like(table, fill)
                states[key][rows] = value
        scalars = {k: v for k, v in st.items() if k not in states}
    return table, states


def train(emb, batches, targets, device):
    for ids, target in zip(batches, targets):
        loss_of(emb(ids.to(device)), target.to(device)).backward()
        emb.step()


@pytest.mark.parametrize("device", DEVICES)
def test_sgd_equals_nn_embedding_on_the_full_table(device, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    batches = id_batches(4, gen)
    targets = [torch.randn(*b.shape, DIM, dtype=torch.float64, generator=gen) for b in batches]
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.SGD,
                                           optimizer_kwargs={"lr": 0.1}, device=device)
    train(emb, batches, targets, device)
    ref = nn.Embedding.from_pretrained(init.clone(), freeze=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for ids, target in zip(batches, targets):
        opt.zero_grad()
        loss_of(ref(ids), target).backward()
        opt.step()
    assert torch.allclose(emb.weight.cpu(), ref.weight, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_optimizers_equal_the_lazy_reference(device, name, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    batches = id_batches(4, gen, rows=ROWS // 2)  # rows repeat within and across steps
    targets = [torch.randn(*b.shape, DIM, dtype=torch.float64, generator=gen) for b in batches]
    cls, kwargs = OPTIMIZERS[name]
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                           device=device)
    train(emb, batches, targets, device)
    table, states = lazy_reference(name, init, batches, targets)
    msg = f"{name} seed {gen.initial_seed()}"
    assert torch.allclose(emb.weight.cpu(), table, rtol=1e-9, atol=1e-10), msg
    sd = emb.state_dict()
    for key, value in states.items():
        assert torch.allclose(sd[f"optimizer.{key}"].cpu(), value, rtol=1e-9, atol=1e-10), (msg, key)


@pytest.mark.parametrize("device", DEVICES)
def test_several_id_tensors_in_one_step(device, gen):
    """emb(a, b): one output per tensor, and a row in both is updated once with both gradients."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    a, b = torch.randint(0, 8, (5,), generator=gen), torch.randint(0, 8, (2, 3), generator=gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.SGD,
                                           optimizer_kwargs={"lr": 0.1}, device=device)
    out_a, out_b = emb(a.to(device), b.to(device))
    assert out_a.shape == (5, DIM) and out_b.shape == (2, 3, DIM)
    (out_a.sum() + 2 * out_b.pow(2).sum()).backward()
    emb.step()
    full = init.clone().requires_grad_()
    (full[a].sum() + 2 * full[b].pow(2).sum()).backward()
    assert torch.allclose(emb.weight.cpu(), init - 0.1 * full.grad, rtol=1e-12, atol=1e-12)
    # Two forwards in one step: the second drops the first's rows, whose output then refuses
    # its backward (nothing is written).
    before = emb.weight.clone()
    first = emb(a.to(device))
    second = emb(b.to(device))
    with pytest.raises(RuntimeError, match="dropped: a later forward"):
        (first.sum() + second.sum()).backward()
    emb.discard()
    assert torch.equal(emb.weight, before)


@pytest.mark.parametrize("device", DEVICES)
def test_read_only_forward_changes_nothing(device, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, device=device)
    ids = torch.randint(0, ROWS, (7,), generator=gen)
    with torch.no_grad():
        assert torch.equal(emb(ids.to(device)).cpu(), init[ids])
    emb.eval()
    assert torch.equal(emb(ids.to(device)).detach().cpu(), init[ids])
    with pytest.raises(RuntimeError, match="no forward"):
        emb.step()
    assert torch.equal(emb.weight.cpu(), init)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_ids_raise_and_write_nothing(device, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.Adam, device=device)
    for bad in (ROWS, -1):
        with pytest.raises(RuntimeError, match=rf"ids\[3\] = {bad} is out of range"):
            emb(torch.tensor([0, 1, 2, bad]).to(device))
    with pytest.raises(TypeError, match="ids must be integers"):
        emb(torch.zeros(3))
    ids = torch.tensor([1, 2]).to(device)
    emb(ids).sum().backward()  # a good step still works after the failed ones
    emb.step()
    changed = (emb.weight.cpu() != init).any(1)
    assert changed.nonzero().view(-1).tolist() == [1, 2]


def test_constructor_names_bad_arguments():
    with pytest.raises(ValueError, match="num_embeddings"):
        so.HostEmbedding(0, 4)
    with pytest.raises(ValueError, match="embedding_dim"):
        so.HostEmbedding(4, -1)
    with pytest.raises(ValueError, match="cache_bytes"):
        so.HostEmbedding(4, 4, cache_bytes=-5)
    with pytest.raises(TypeError, match="optimizer"):
        so.HostEmbedding(4, 4, optimizer="adam")
    with pytest.raises(ValueError, match="mode"):
        so.HostEmbeddingBag(4, 4, mode="median")
    with pytest.raises(ValueError, match="weights must have shape"):
        so.HostEmbedding(4, 4, _weight=torch.zeros(3, 4))


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_resumes_exactly(device, gen, tmp_path):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    batches = id_batches(6, gen)
    targets = [torch.randn(*b.shape, DIM, dtype=torch.float64, generator=gen) for b in batches]
    kwargs = dict(optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.05}, device=device)
    whole = so.HostEmbedding.from_pretrained(init, freeze=False, **kwargs)
    train(whole, batches, targets, device)

    first = so.HostEmbedding.from_pretrained(init, freeze=False, **kwargs)
    train(first, batches[:3], targets[:3], device)
    torch.save(first.state_dict(), tmp_path / "emb.pt")
    resumed = so.HostEmbedding(ROWS, DIM, dtype=torch.float64, **kwargs)
    resumed.load_state_dict(torch.load(tmp_path / "emb.pt"))
    train(resumed, batches[3:], targets[3:], device)
    # Bit for bit on the CPU; the GPU adds repeated ids' gradients with atomics, in no fixed order.
    tol = 0 if device == "cpu" else 1e-12
    assert torch.allclose(resumed.weight, whole.weight, rtol=tol, atol=tol)
    for key, value in whole.state_dict().items():
        assert torch.allclose(resumed.state_dict()[key], value, rtol=tol, atol=tol), key
    bad = {k: v for k, v in first.state_dict().items()}
    bad["weight"] = torch.zeros(ROWS + 1, DIM, dtype=torch.float64)
    before = resumed.weight.clone()
    with pytest.raises(RuntimeError, match="weight: shape"):
        resumed.load_state_dict(bad)
    assert torch.equal(resumed.weight, before)  # nothing written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean"])
def test_bag_equals_nn_embedding_bag(device, mode, gen):
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    bag = so.HostEmbeddingBag.from_pretrained(init, freeze=False, mode=mode, optimizer=torch.optim.SGD,
                                              optimizer_kwargs={"lr": 0.1}, device=device)
    ref = nn.EmbeddingBag.from_pretrained(init.clone(), freeze=False, mode=mode)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        flat = torch.randint(0, 12, (10,), generator=gen)
        offsets = torch.tensor([0, 3, 3, 7])  # an empty bag
        weights = torch.rand(10, dtype=torch.float64, generator=gen) if mode == "sum" else None
        two_d = torch.randint(0, 12, (3, 4), generator=gen)
        out = bag(flat.to(device), offsets.to(device),
                  None if weights is None else weights.to(device))
        want = ref(flat, offsets, per_sample_weights=weights)
        assert torch.allclose(out.detach().cpu(), want, rtol=1e-12, atol=1e-12)
        out.pow(2).sum().backward()
        bag.step()
        opt.zero_grad()
        want.pow(2).sum().backward()
        opt.step()
        with torch.no_grad():
            assert torch.allclose(bag(two_d.to(device)).cpu(), ref(two_d), rtol=1e-12, atol=1e-12)
    assert torch.allclose(bag.weight.cpu(), ref.weight, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="offsets is required"):
        bag(flat.to(device))
    with pytest.raises(NotImplementedError, match="per_sample_weights"):
        so.HostEmbeddingBag(4, 4, mode="mean")(torch.tensor([[1]]), None, torch.ones(1, 1))


# ---- the GPU row cache ---------------------------------------------------------------------

@pytest.mark.skipif(not HAS_CUDA, reason="the row cache needs a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("name", ["Adam", "SGD-momentum", "Adagrad", "RMSprop", "Rprop"])
@pytest.mark.parametrize("slots", [3, 12, 30])
def test_cache_trains_like_no_cache(name, slots, gen):
    """Budgets from 3 slots (fewer than a batch's rows: evictions and direct write-backs every
    step) to most of the table; duplicates and hot rows included."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    batches = id_batches(8, gen, hot=6)
    targets = [torch.randn(*b.shape, DIM, dtype=torch.float64, generator=gen) for b in batches]
    cls, kwargs = OPTIMIZERS[name]
    plain = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                             device="cuda")
    row_bytes = plain.host[0].nbytes
    cached = so.HostEmbedding.from_pretrained(
        init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs, device="cuda",
        cache_bytes=ROWS * 8 + slots * row_bytes)
    assert cached.store.slots == slots
    train(plain, batches, targets, "cuda")
    train(cached, batches, targets, "cuda")
    stats = cached.cache_stats()
    # Caches smaller than the rows in play send rows back: evicted, or written straight back
    # when admission by frequency keeps the hot rows in their slots (which of the two depends on
    # the seed, for 12 slots too). 30 slots may hold every row a short run touches.
    assert stats["hits"] > 0, (stats, gen.initial_seed())
    if slots <= 12:
        assert stats["evictions"] + stats["direct_writebacks"] > 0, (stats, gen.initial_seed())
    assert stats["hits"] + stats["host_loads"] == stats["lookups"]
    # Equal up to the rounding of the gradient sums of repeated ids (index_add_ on the GPU adds
    # with atomics, in no fixed order).
    close = lambda a, b: torch.allclose(a, b, rtol=1e-12, atol=1e-12)  # noqa: E731
    assert close(cached.weight, plain.weight)
    for key, value in plain.state_dict().items():
        assert close(cached.state_dict()[key], value), key
    # Trained on after the flush, still equal (the flush keeps the rows cached).
    train(plain, batches[:2], targets[:2], "cuda")
    train(cached, batches[:2], targets[:2], "cuda")
    assert close(cached.weight, plain.weight)


@pytest.mark.skipif(not HAS_CUDA, reason="the row cache needs a CUDA GPU (scripts/gpu_check.sh)")
def test_cache_keeps_the_hot_rows(gen):
    """With room for the hot rows, the cache ends up holding them: later steps mostly hit."""
    emb = so.HostEmbedding(1000, 8, device="cuda", cache_bytes=1000 * 8 + 64 * 3 * 8 * 4)
    hot = torch.arange(50)
    for step in range(40):
        ids = torch.cat([hot[torch.randperm(50, generator=gen)[:30]],
                         torch.randint(50, 1000, (10,), generator=gen)])
        emb(ids.cuda()).sum().backward()
        emb.step()
    cached = set(emb.store.id_of.cpu().tolist())
    assert set(range(50)) <= cached
    assert emb.cache_stats()["hit_rate"] > 0.6


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cache_budget_refuses_too_little():
    with pytest.raises(ValueError, match="cache_bytes=100 holds no row"):
        so.HostEmbedding(1000, 8, device="cuda", cache_bytes=100)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches_between_steps(device, gen):
    """A step with no ids (an empty batch) changes nothing and the next steps train normally."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.SGD,
                                           optimizer_kwargs={"lr": 0.1}, device=device)
    for ids in ([1, 2, 1], [], [3], []):
        ids = torch.tensor(ids, dtype=torch.int64)
        out = emb(ids.to(device))
        assert out.shape == (len(ids), DIM)
        out.pow(2).sum().backward()
        emb.step()
    # SGD on sum(w^2): each occurrence of a row adds 2w to its gradient (row 1 twice).
    assert torch.allclose(emb.weight.cpu(), init * torch.tensor(
        [0.6 if i == 1 else 0.8 if i in (2, 3) else 1.0 for i in range(ROWS)],
        dtype=torch.float64).unsqueeze(1), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_trains_like_eager(device, gen):
    """A model calling the module under torch.compile (the staging and step stay eager: graph
    breaks around them) gives the eager results."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    batches = id_batches(4, gen)
    results = []
    for compiled in (False, True):
        torch._dynamo.reset()
        emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.Adam,
                                               optimizer_kwargs={"lr": 0.1}, device=device)
        head = nn.Linear(DIM, 1, dtype=torch.float64, device=device)
        with torch.no_grad():
            head.weight.fill_(0.5)
            head.bias.zero_()

        def model(ids):
            return head(torch.tanh(emb(ids))).pow(2).sum()

        step = torch.compile(model) if compiled else model
        for ids in batches:
            step(ids.to(device)).backward()
            emb.step()
            head.zero_grad()
        results.append(emb.weight.cpu().clone())
    assert torch.allclose(results[0], results[1], rtol=1e-12, atol=1e-12)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_a_finished_step_holds_no_staged_rows(name, gen):
    """After step() the GPU holds what it held before the forward: the step's buffer of rows
    and state went back to the allocator (a CUDA graph's capture cannot reuse a buffer the
    module still holds, and within a tight budget it needs the room)."""
    cls, kwargs = OPTIMIZERS[name]
    emb = so.HostEmbedding(1000, 64, optimizer=cls, optimizer_kwargs=kwargs, device="cuda")
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated()
    for _ in range(3):
        ids = torch.randint(0, 1000, (4096,), generator=gen).cuda()
        emb(ids).square().sum().backward()
        del ids
        emb.step()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == held


def test_double_backward_is_refused(gen):
    """The lookup's backward (a segment sum) is not itself differentiable: asking for a second
    derivative raises instead of giving zeros."""
    emb = so.HostEmbedding(10, 3, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           device="cpu", dtype=torch.float64)
    out = emb(torch.tensor([1, 2, 1]))
    (g,) = torch.autograd.grad(out.pow(2).sum(), emb.step_parameters(), create_graph=True)
    with pytest.raises(RuntimeError, match="twice|once_differentiable|double backward"):
        g.sum().backward()


@pytest.mark.parametrize("device", DEVICES)
def test_a_second_forward_after_a_backward_raises_and_keeps_the_gradient(device, gen):
    """Gradient accumulation over forwards (nn sums both micro-batches' gradients) is refused
    rather than losing the first micro-batch: the second forward raises, and step() then
    applies the first forward's gradient exactly as nn.Embedding with SGD does."""
    init = torch.randn(ROWS, DIM, dtype=torch.float64, generator=gen)
    a, b = id_batches(2, gen)
    target = torch.randn(*a.shape, DIM, dtype=torch.float64, generator=gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.SGD,
                                           optimizer_kwargs={"lr": 0.1}, device=device)
    loss_of(emb(a.to(device)), target.to(device)).backward()
    with pytest.raises(RuntimeError, match="second forward"):
        emb(b.to(device))
    emb.step()
    ref = nn.Embedding.from_pretrained(init.clone(), freeze=False)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    loss_of(ref(a), target).backward()
    opt.step()
    assert torch.allclose(emb.weight.cpu(), ref.weight, rtol=1e-12, atol=1e-12), gen.initial_seed()
    emb(b.to(device)).sum().backward()  # usable afterwards
    emb.step()


def test_a_forward_after_zero_grad_or_discard_drops_the_staged_rows(gen):
    """Without a gradient (none yet, zero_grad, discard) a new forward replaces the staged
    one, as before: nothing is lost that a step would have applied."""
    emb = so.HostEmbedding(ROWS, DIM, optimizer=torch.optim.SGD, device="cpu")
    a, b = id_batches(2, gen)
    emb(a)
    emb(b).sum().backward()
    emb.zero_grad()
    emb(a).sum().backward()
    emb.step()
