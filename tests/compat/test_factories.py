"""The SpeedTorch-compatible classes: training through the switchers equals training the full
table (exactly for SGD; for stateful optimizers against a "lazy" reference written here), with
unique and duplicate ids, on every store the machine has."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

import speedtorch_ops as so
from conftest import HAS_CUDA

V, D, B, P, N = 40, 6, 5, 2, 3  # vocabulary, dim, batch, positives and negatives per example

# (model device, store): "pinned" is CPUPinn=True (ordinary memory on a machine without a GPU).
CONFIGS = [("cpu", "cpu"), ("cpu", "pinned")]
if HAS_CUDA:
    CONFIGS += [("cuda", "pinned"), ("cuda", "cuda"), ("cuda", "cpu")]


class SlotModel(nn.Module):
    """Skip-gram-like model over batch-sized embeddings, called with slot numbers."""

    def __init__(self, u_rows, v_rows, sparse=False):
        super().__init__()
        self.u_embeddings = nn.Embedding(u_rows, D, sparse=sparse)
        self.v_embeddings = nn.Embedding(v_rows, D, sparse=sparse)

    def forward(self, u, v_pos, v_neg):
        eu = self.u_embeddings(u)                       # (B, 1, D)
        pos = (eu * self.v_embeddings(v_pos)).sum(-1)   # (B, P)
        neg = (eu * self.v_embeddings(v_neg)).sum(-1)   # (B, N)
        return -(nn.functional.logsigmoid(pos).sum() + nn.functional.logsigmoid(-neg).sum())


def batches(steps, duplicates, gen):
    out = []
    for _ in range(steps):
        if duplicates:  # few distinct ids: repeats within and across positives and negatives
            labels = torch.randint(0, 6, (B, 1), generator=gen)
            ctx = torch.randint(0, 6, (B, P), generator=gen)
            negs = torch.randint(0, 6, (B, N), generator=gen)
        else:
            perm = torch.randperm(V, generator=gen)
            labels = perm[:B].reshape(B, 1)
            ctx_negs = torch.randperm(V, generator=gen)[: B * (P + N)]
            ctx, negs = ctx_negs[: B * P].reshape(B, P), ctx_negs[B * P:].reshape(B, N)
        out.append((labels.numpy().astype(np.int32), ctx.numpy().astype(np.int32),
                    negs.numpy().astype(np.int32)))
    return out


def make_optimizer(name, params):
    return {
        "SGD": lambda: torch.optim.SGD(params, lr=0.1),
        "SGD-momentum": lambda: torch.optim.SGD(params, lr=0.1, momentum=0.9),
        "Adam": lambda: torch.optim.Adam(params, lr=0.05),
        "Adam-fused": lambda: torch.optim.Adam(params, lr=0.05, fused=True),
        "AdamW": lambda: torch.optim.AdamW(params, lr=0.05, weight_decay=0.1, amsgrad=True),
        "Adagrad": lambda: torch.optim.Adagrad(params, lr=0.1, initial_accumulator_value=0.1),
        "RMSprop": lambda: torch.optim.RMSprop(params, lr=0.01, momentum=0.5, centered=True),
        "Adamax": lambda: torch.optim.Adamax(params, lr=0.05),
        "Adadelta": lambda: torch.optim.Adadelta(params, lr=1.0),
        "ASGD": lambda: torch.optim.ASGD(params, lr=0.05),
        "Rprop": lambda: torch.optim.Rprop(params, lr=0.01),
        "SparseAdam": lambda: torch.optim.SparseAdam(params, lr=0.05),
    }[name]()


def factories(store, model, opt, dtype):
    """A model and an optimizer switcher per embedding, for `store`."""
    if store == "pinned":
        mk = lambda var: so.ModelFactory(var, V, D, datatype=dtype, CPUPinn=True)
        ok = lambda name: so.OptimizerFactory(opt, V, D, model, name, dtype, True)
    elif store == "cuda":
        mk = lambda var: so.GPUPytorchModelFactory(var, V, D, dtype)
        ok = lambda name: so.GPUPytorchOptimizerFactory(opt, V, D, model, name, dtype)
    else:
        mk = lambda var: so.PytorchModelFactory(var, V, D, dtype, deviceType="cpu")
        ok = lambda name: so.PytorchOptimizerFactory(opt, V, D, model, name, dtype, "cpu")
    return mk(model.u_embeddings), mk(model.v_embeddings), ok("u_embeddings"), ok("v_embeddings")


def train_switchers(device, store, opt_name, data, init_u, init_v, mode="plain"):
    """mode: "plain" (0.1.6's calls), "colocated" (so.colocate on each pair before the init
    methods), "prefetch" (colocated after them, and each step prefetches the next batch right
    after beforeForwardPass), "cached" (colocated before them with a GPU row cache),
    "cached-prefetch" (that, prefetching)."""
    dtype = torch.float64
    model = SlotModel(B, B * (P + N), sparse=opt_name == "SparseAdam").to(device, dtype)
    opt = make_optimizer(opt_name, model.parameters())
    u_sw, v_sw, u_opt, v_opt = factories(store, model, opt, dtype)
    if mode == "colocated":  # before the init methods (they fill the shared tables)
        so.colocate(u_sw, u_opt)
        so.colocate(v_sw, v_opt)
    if mode.startswith("cached"):  # a GPU row cache of 4 rows: evictions every step
        row = (1 + len(u_opt.optVarList)) * D * 8
        so.colocate(u_sw, u_opt, cache_bytes=V * 8 + 4 * row)
        so.colocate(v_sw, v_opt, cache_bytes=V * 8 + 4 * row)
    u_sw.customInit(lambda t: t.copy_(init_u))
    v_sw.customInit(lambda t: t.copy_(init_v))
    u_opt.optInit()
    v_opt.optInit()
    if mode == "prefetch":  # after them (the tables are copied in)
        so.colocate(u_sw, u_opt)
        so.colocate(v_sw, v_opt)
    u_slots = torch.as_tensor(u_sw.variableTransformer(B, 1), device=device)
    v_pos, v_neg = (torch.as_tensor(s, device=device) for s in v_sw.variableTransformer(B, P, N))
    for step, (labels, ctx, negs) in enumerate(data):
        with torch.no_grad():
            u_sw.beforeForwardPass(labels)
            v_sw.beforeForwardPass(ctx, negs)
            u_opt.beforeForwardPass(labels)
            v_opt.beforeForwardPass(ctx, negs)
            if mode.endswith("prefetch") and step + 1 < len(data):
                next_labels, next_ctx, next_negs = data[step + 1]
                u_sw.prefetch(next_labels)
                v_opt.prefetch(next_ctx, next_negs)  # either factory of a pair may call it
        opt.zero_grad()
        model(u_slots, v_pos, v_neg).backward()
        opt.step()
        with torch.no_grad():
            u_sw.afterOptimizerStep(labels)
            v_sw.afterOptimizerStep(ctx, negs)
            u_opt.afterOptimizerStep(labels)
            v_opt.afterOptimizerStep(ctx, negs)
    return u_sw, v_sw, u_opt, v_opt


# Per-element state that torch does not start at zero (the hyperparameters of make_optimizer).
INITIAL = {"sum": 0.1, "step_size": 0.01}


def lazy_reference(opt_name, data, init_u, init_v, opt_keys, device):
    """Full tables with real ids (on the CPU); the optimizer math runs on `device`, the model's,
    since torch's CPU and CUDA optimizer implementations may round differently. Each step: the gradient of the loss w.r.t. the full tables;
    for the batch's distinct rows only, one optimizer step with their summed gradient, their
    state rows and the global step count; other rows and their state stay as they are."""
    tables = {"u": init_u.clone(), "v": init_v.clone()}
    states = {name: {} for name in tables}
    scalars = {name: None for name in tables}
    for labels, ctx, negs in data:
        u_ids, pos_ids, neg_ids = (torch.as_tensor(x, dtype=torch.int64) for x in (labels, ctx, negs))
        full = {k: t.clone().requires_grad_() for k, t in tables.items()}
        eu = full["u"][u_ids]
        pos = (eu * full["v"][pos_ids]).sum(-1)
        neg = (eu * full["v"][neg_ids]).sum(-1)
        (-(nn.functional.logsigmoid(pos).sum() + nn.functional.logsigmoid(-neg).sum())).backward()
        for name, ids in (("u", u_ids), ("v", torch.cat([pos_ids.flatten(), neg_ids.flatten()]))):
            rows = torch.unique(ids.flatten())
            param = tables[name][rows].clone().to(device).requires_grad_()
            param.grad = full[name].grad[rows].to(device)
            if opt_name == "SparseAdam":
                param.grad = param.grad.to_sparse()
            opt = make_optimizer(opt_name, [param])
            if scalars[name] is not None:  # carry the per-parameter scalars (step, ...) along
                opt.state[param].update(copy.deepcopy(scalars[name]))
                for key in opt_keys:
                    opt.state[param][key] = states[name][key][rows].to(device)
            opt.step()
            with torch.no_grad():
                tables[name][rows] = param.cpu()
            st = opt.state[param]
            for key in opt_keys:
                if key not in states[name]:  # rows never seen start from torch's initial value
                    states[name][key] = torch.full_like(tables[name], INITIAL.get(key, 0.0))
                states[name][key][rows] = st[key].cpu()
            scalars[name] = {k: v for k, v in st.items() if k not in opt_keys}
    return tables, states


def assert_matches_lazy_reference(opt_name, data, init_u, init_v, switchers, device, msg):
    """The switchers' tables and state tables equal lazy_reference's (float64, 1e-10)."""
    u_sw, v_sw, u_opt, v_opt = switchers
    tables, states = lazy_reference(opt_name, data, init_u, init_v, u_opt.optVarList, device)
    for sw, opt_sw, name in ((u_sw, u_opt, "u"), (v_sw, v_opt, "v")):
        got = torch.from_numpy(sw.getNumpyVersion())
        assert torch.allclose(got, tables[name], rtol=1e-10, atol=1e-10), msg
        stacked = torch.from_numpy(opt_sw.getNumpyVersion())
        for k, key in enumerate(opt_sw.optVarList):
            assert torch.allclose(stacked[k], states[name][key], rtol=1e-10, atol=1e-10), (msg, key)


@pytest.mark.parametrize("device,store", CONFIGS)
@pytest.mark.parametrize("duplicates", [False, True])
def test_sgd_equals_full_table_training(device, store, duplicates, gen):
    data = batches(4, duplicates, gen)
    init_u = torch.randn(V, D, dtype=torch.float64, generator=gen)
    init_v = torch.randn(V, D, dtype=torch.float64, generator=gen)
    u_sw, v_sw, _, _ = train_switchers(device, store, "SGD", data, init_u, init_v)

    full = SlotModel(V, V).double()  # the whole table trained directly, real ids
    with torch.no_grad():
        full.u_embeddings.weight.copy_(init_u)
        full.v_embeddings.weight.copy_(init_v)
    opt = torch.optim.SGD(full.parameters(), lr=0.1)
    for labels, ctx, negs in data:
        opt.zero_grad()
        full(*(torch.as_tensor(x, dtype=torch.int64) for x in (labels, ctx, negs))).backward()
        opt.step()
    assert torch.allclose(torch.from_numpy(u_sw.getNumpyVersion()), full.u_embeddings.weight,
                          rtol=1e-12, atol=1e-12), f"seed {gen.initial_seed()}"
    assert torch.allclose(torch.from_numpy(v_sw.getNumpyVersion()), full.v_embeddings.weight,
                          rtol=1e-12, atol=1e-12), f"seed {gen.initial_seed()}"


@pytest.mark.parametrize("device,store", CONFIGS)
@pytest.mark.parametrize("duplicates", [False, True])
@pytest.mark.parametrize("opt_name", ["Adam", "Adam-fused", "AdamW", "Adagrad", "RMSprop",
                                      "SGD-momentum", "Adamax", "Adadelta", "ASGD", "Rprop",
                                      "SparseAdam"])
def test_stateful_optimizers_equal_lazy_reference(device, store, duplicates, opt_name, gen):
    data = batches(4, duplicates, gen)
    init_u = torch.randn(V, D, dtype=torch.float64, generator=gen)
    init_v = torch.randn(V, D, dtype=torch.float64, generator=gen)
    switchers = train_switchers(device, store, opt_name, data, init_u, init_v)
    assert_matches_lazy_reference(opt_name, data, init_u, init_v, switchers, device,
                                  f"{opt_name} seed {gen.initial_seed()}")



# ---- colocated factories and prefetch (speedtorch_ops.colocate) ----------------------------


@pytest.mark.parametrize("device,store", CONFIGS)
@pytest.mark.parametrize("duplicates", [False, True])
@pytest.mark.parametrize("mode", ["colocated", "prefetch", "cached", "cached-prefetch"])
def test_colocated_sgd_equals_full_table_training(device, store, duplicates, mode, gen):
    if mode.startswith("cached") and (device == "cpu" or store == "cpu"):
        pytest.skip("the row cache is on the GPU, in front of a pinned or CUDA store")
    data = batches(5, duplicates, gen)
    init_u = torch.randn(V, D, dtype=torch.float64, generator=gen)
    init_v = torch.randn(V, D, dtype=torch.float64, generator=gen)
    plain = train_switchers(device, store, "SGD", data, init_u, init_v)
    got = train_switchers(device, store, "SGD", data, init_u, init_v, mode)
    for a, b in zip(plain[:2], got[:2]):
        # Bit for bit on the CPU; on CUDA the duplicate-gradient hook (index_add_, atomics) may
        # round differently from run to run when a batch repeats a row.
        tol = 0 if device == "cpu" else 1e-12
        assert np.allclose(a.getNumpyVersion(), b.getNumpyVersion(), rtol=tol, atol=tol), (
            f"seed {gen.initial_seed()}")


@pytest.mark.parametrize("device,store", CONFIGS)
@pytest.mark.parametrize("duplicates", [False, True])
@pytest.mark.parametrize("mode", ["colocated", "prefetch", "cached", "cached-prefetch"])
@pytest.mark.parametrize("opt_name", ["Adam", "Adam-fused", "AdamW", "Adagrad", "RMSprop",
                                      "Rprop", "SparseAdam"])
def test_colocated_optimizers_equal_lazy_reference(device, store, duplicates, mode, opt_name,
                                                   gen):
    """Colocated rows, with and without prefetch, and behind a GPU row cache of 4 rows (with
    and without prefetch): the same result as the lazy reference (the duplicate batches repeat
    rows from step to step, so the next batch shares rows with the one being trained when its
    prefetch starts, and cached rows hit)."""
    if mode.startswith("cached") and (device == "cpu" or store == "cpu"):
        pytest.skip("the row cache is on the GPU, in front of a pinned or CUDA store")
    data = batches(5, duplicates, gen)
    init_u = torch.randn(V, D, dtype=torch.float64, generator=gen)
    init_v = torch.randn(V, D, dtype=torch.float64, generator=gen)
    switchers = train_switchers(device, store, opt_name, data, init_u, init_v, mode)
    assert_matches_lazy_reference(opt_name, data, init_u, init_v, switchers, device,
                                  f"{opt_name} {mode} seed {gen.initial_seed()}")


def test_colocate_before_init_fills_the_shared_table(gen):
    """colocate() right after construction: the init methods write into the shared table, no
    second copy of the tables is made, and re-initializing keeps the views."""
    model = SlotModel(B, B).double()
    opt = torch.optim.Adagrad(model.parameters(), initial_accumulator_value=0.25)
    mf = so.ModelFactory(model.u_embeddings, V, D, datatype="float64", CPUPinn=True)
    of = so.OptimizerFactory(opt, V, D, model, "u_embeddings", "float64", True)
    rows = so.colocate(mf, of)
    init = torch.randn(V, D, dtype=torch.float64, generator=gen)
    mf.customInit(lambda t: t.copy_(init))
    of.optInit()
    assert mf.CUPYcorpus.data_ptr() == rows.host.data_ptr()
    assert torch.equal(rows.host[:, 0], init)
    assert torch.equal(rows.host[:, 1], torch.full((V, D), 0.25, dtype=torch.float64))
    assert [t.data_ptr() for t in of.CUPYcorpi] == [rows.host[:, 1].data_ptr()]
    mf.zerosInit()  # in place
    assert mf.CUPYcorpus.data_ptr() == rows.host.data_ptr() and not rows.host[:, 0].any()
    assert torch.equal(rows.host[:, 1], torch.full((V, D), 0.25, dtype=torch.float64))


def test_colocated_tables_are_views_of_one_table(gen):
    model = SlotModel(B, B).double()
    opt = torch.optim.Adam(model.parameters())
    mf = so.ModelFactory(model.u_embeddings, V, D, datatype="float64", CPUPinn=True)
    of = so.OptimizerFactory(opt, V, D, model, "u_embeddings", "float64", True)
    init = torch.randn(V, D, dtype=torch.float64, generator=gen)
    mf.customInit(lambda t: t.copy_(init))
    of.optInit()
    rows = so.colocate(mf, of)
    assert rows.host.shape == (V, 3, D)
    assert mf.CUPYcorpus.data_ptr() == rows.host.data_ptr()
    assert [t.data_ptr() for t in of.CUPYcorpi] == [rows.host[:, k].data_ptr() for k in (1, 2)]
    with torch.no_grad():  # the batch's weight and state are contiguous (fused optimizers)
        mf.beforeForwardPass(np.array([4, 0, 4]))
        of.beforeForwardPass(np.array([4, 0, 4]))
    state = opt.state[model.u_embeddings.weight]
    for t in (model.u_embeddings.weight, state["exp_avg"], state["exp_avg_sq"]):
        assert t.is_contiguous() and t.shape == (3, D)
    assert torch.equal(model.u_embeddings.weight[[0, 2]], init[[4, 4]])
    assert np.array_equal(mf.getNumpyVersion(), init.numpy())  # contents carried over
    assert np.array_equal(of.getNumpyVersion(), np.zeros((2, V, D)))


def test_colocate_refuses_bad_pairs(tmp_path, monkeypatch, gen):
    monkeypatch.chdir(tmp_path)
    model = SlotModel(B, B).double()
    opt = torch.optim.Adam(model.parameters())
    mf = so.ModelFactory(model.u_embeddings, V, D, datatype="float64", CPUPinn=True)
    mf.zerosInit()
    other = so.OptimizerFactory(opt, V, D, model, "v_embeddings", "float64", True)
    other.optInit()
    with pytest.raises(ValueError, match="not this model factory's weight"):
        so.colocate(mf, other)
    f32 = so.ModelFactory(model.v_embeddings, V, D, datatype="float32", CPUPinn=True)
    f32.zerosInit()
    with pytest.raises(ValueError, match="must match"):
        so.colocate(f32)
    mm = so.ModelFactoryMM(model.v_embeddings, V, D, datatype="float64")
    mm.zerosInit()
    with pytest.raises(ValueError, match="only pinned, CPU and CUDA"):
        so.colocate(mm)
    with pytest.raises(RuntimeError, match="needs colocated factories"):
        mf.prefetch(np.arange(3))
    so.colocate(mf)
    with pytest.raises(ValueError, match="already colocated"):
        so.colocate(mf)
    mf.beforeForwardPass(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="not the batch loaded"):
        mf.afterOptimizerStep(np.array([1, 2, 4]))
    with pytest.raises(RuntimeError, match="out of range"):
        mf.prefetch(np.array([0, V]))


@pytest.mark.parametrize("device,store", CONFIGS)
def test_colocate_refuses_bad_cache_bytes_and_changes_nothing(device, store, gen):
    """A cache_bytes that is no int >= 0, too small for one row, or (on a GPU) in front of
    ordinary host memory raises naming it; the factories keep their tables and colocate after."""
    model = SlotModel(B, B).to(device, torch.float64)
    opt = torch.optim.Adam(model.parameters())
    mf, _, of, _ = factories(store, model, opt, torch.float64)
    init = torch.randn(V, D, dtype=torch.float64, generator=gen)
    mf.customInit(lambda t: t.copy_(init))
    of.optInit()
    bad = [-1, 1.5, True]
    if device == "cuda":  # the CPU has no cache: a budget there is not used
        bad.append(V * 8 + 10)  # the index fits, no row does
    for cache_bytes in bad:
        with pytest.raises(ValueError, match="cache_bytes"):
            so.colocate(mf, of, cache_bytes=cache_bytes)
    if device == "cuda" and store == "cpu":
        with pytest.raises(ValueError, match="cache_bytes.*needs a pinned or CUDA"):
            so.colocate(mf, of, cache_bytes=1 << 20)
    assert np.array_equal(mf.getNumpyVersion(), init.numpy())
    rows = so.colocate(mf, of)  # not colocated by the failed calls
    assert torch.equal(rows.host[:, 0].cpu(), init)


def test_colocated_checkpoint_waits_and_drops_prefetch(gen):
    """state_dict() after a prefetch sees the written-back rows; load_state_dict() makes the
    next batch load fresh rows, not the prefetched (now stale) ones."""
    model = SlotModel(B, B).double()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    mf = so.ModelFactory(model.u_embeddings, V, D, datatype="float64", CPUPinn=True)
    init = torch.randn(V, D, dtype=torch.float64, generator=gen)
    mf.customInit(lambda t: t.copy_(init))
    so.colocate(mf)
    ids = np.array([3, 1, 4, 1, 5])
    with torch.no_grad():
        mf.beforeForwardPass(ids)
        mf.prefetch(ids)
        model.u_embeddings.weight.add_(1.0)
        mf.afterOptimizerStep(ids)
    expect = init.clone()
    expect[torch.as_tensor(ids)] += 1.0
    saved = mf.state_dict()
    assert torch.equal(saved["tables"][0], expect)
    replacement = torch.randn(V, D, dtype=torch.float64, generator=gen)
    mf.load_state_dict({"tables": [replacement]})
    mf.beforeForwardPass(ids)
    assert torch.equal(model.u_embeddings.weight.detach().cpu(), replacement[torch.as_tensor(ids)])


@pytest.mark.skipif(not HAS_CUDA, reason="the race is between the GPU's write-backs and the CPU")
def test_pinned_tables_rewritten_after_queued_write_backs(gen):
    """A pinned model factory's write-back is queued on the GPU; load_state_dict then copies a
    replacement into the table on the CPU. With the GPU kept busy the write-back lands late: it
    must not land over the replacement."""
    model = SlotModel(B, B).double().cuda()
    mf = so.ModelFactory(model.u_embeddings, V, D, datatype="float64", CPUPinn=True)
    mf.zerosInit()
    ids = np.array([3, 1, 4, 1, 5])
    with torch.no_grad():
        mf.beforeForwardPass(ids)
        model.u_embeddings.weight.add_(1.0)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # the write-back below waits behind this
        mf.afterOptimizerStep(ids)
    replacement = torch.randn(V, D, dtype=torch.float64, generator=gen)
    mf.load_state_dict({"tables": [replacement]})
    torch.cuda.synchronize()
    assert torch.equal(mf.state_dict()["tables"][0], replacement)
