"""A CPU collection's pooled step (the backward from the step's sort, the fused update in the
host table) against plain PyTorch in float64: one full table a feature's table, pooled by
torch's embedding_bag, trained lazily by torch's optimizer (the touched rows, the group's step
count). Sum and mean pooling, per-sample weights, duplicate ids within and across bags, empty
bags, groups of one pooling and mixed ones, 1 and several threads; gradients read and clipped
between the backward and step(); the cases the fast path leaves to torch (weights that take a
gradient, torch's own optimizer step); a group that only pools reads the host table in place
where the update writes it there (no rows staged)."""

import pytest
import torch
import torch.nn.functional as F

import speedtorch_ops as so

OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.1}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "RowWiseAdagrad": (so.RowWiseAdagrad, {"lr": 0.1}),
    "Adam": (torch.optim.Adam, {"lr": 0.05}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01}),  # torch's own step, not fused
}
# (name, rows, dim, pooling, features): one group of sum-pooled tables, one of mean, one mixed
TABLES = {
    "sum": [("a", 40, 8, "sum", 2), ("b", 30, 8, "sum", 1)],
    "mean": [("m", 25, 5, "mean", 2)],
    "mixed": [("s", 20, 6, "sum", 1), ("e", 15, 6, "mean", 1), ("n", 10, 6, "none", 1)],
}


def configs(kind):
    return [so.TableConfig(name, rows, dim, pooling=pooling,
                           feature_names=[f"{name}{k}" for k in range(features)])
            for name, rows, dim, pooling, features in TABLES[kind]]


def make_batch(cfgs, gen, stride=6, weighted=False):
    """Lengths 0..6 (the first bag of every feature empty), ids from a few rows (duplicates
    within and across bags)."""
    keys, values, lengths = [], [], []
    for t in cfgs:
        for f in t.feature_names:
            ls = torch.randint(0, 7, (stride,), generator=gen)
            ls[0], ls[-1] = 0, max(int(ls[-1]), 1)
            keys.append(f)
            lengths.append(ls)
            values.append(torch.randint(0, min(t.num_embeddings, 9), (int(ls.sum()),),
                                        generator=gen))
    values = torch.cat(values)
    weights = torch.rand(len(values), generator=gen, dtype=torch.float64) if weighted else None
    return so.KeyedJaggedTensor.from_lengths_sync(keys, values, torch.cat(lengths),
                                                  weights=weights)


def reference_outputs(cfgs, full, kjt):
    out, stride = {}, kjt.stride()
    offsets, values, w = kjt.offsets(), kjt.values(), kjt.weights_or_none()
    for t in cfgs:
        for f in t.feature_names:
            i = kjt.keys().index(f)
            lo, hi = int(offsets[i * stride]), int(offsets[(i + 1) * stride])
            if t.pooling == "none":
                out[f] = F.embedding(values[lo:hi], full[t.name])
                continue
            psw = w[lo:hi] if w is not None and t.pooling == "sum" else None
            out[f] = F.embedding_bag(values[lo:hi], full[t.name],
                                     offsets[i * stride:(i + 1) * stride + 1] - lo,
                                     mode=t.pooling, per_sample_weights=psw,
                                     include_last_offset=True)
    return out


def loss_of(out, targets):
    return sum(((out[k] - targets[k]) ** 2).sum() for k in targets)


class Reference:
    """Full float64 tables; each step torch's optimizer over the touched rows of each table,
    their state kept full-size, the step count one for the collection (its groups count every
    step, as each table here is touched every step)."""

    def __init__(self, cfgs, init, name):
        self.cfgs, (self.cls, self.kwargs) = cfgs, OPTIMIZERS[name]
        self.tables = {k: v.clone() for k, v in init.items()}
        self.state = {k: {} for k in init}

    def backward(self, kjt, targets):
        full = {k: v.clone().requires_grad_() for k, v in self.tables.items()}
        loss_of(reference_outputs(self.cfgs, full, kjt), targets).backward()
        return {k: v.grad for k, v in full.items()}

    def step(self, kjt, grads):
        for t in self.cfgs:
            touched = torch.unique(torch.cat([kjt[f].values() for f in t.feature_names]))
            param = self.tables[t.name][touched].clone().requires_grad_()
            param.grad = grads[t.name][touched].clone()
            opt = self.cls([param], **self.kwargs)
            for key, value in self.state[t.name].items():
                opt.state[param][key] = value[touched].clone() if torch.is_tensor(value) and \
                    value.dim() and value.shape[0] == self.tables[t.name].shape[0] else value
            opt.step()
            with torch.no_grad():
                self.tables[t.name][touched] = param
            for key, value in opt.state[param].items():
                if torch.is_tensor(value) and value.dim() and value.shape[0] == len(touched):
                    full = self.state[t.name].get(key)
                    if full is None:
                        fill = self.kwargs.get("initial_accumulator_value", 0.0)
                        full = torch.full((self.tables[t.name].shape[0], *value.shape[1:]),
                                          fill, dtype=value.dtype)
                    full[touched] = value
                    self.state[t.name][key] = full
                else:
                    self.state[t.name][key] = value


def build(cfgs, name, weighted=False):
    cls, kwargs = OPTIMIZERS[name]
    ebc = so.HostEmbeddingBagCollection(cfgs, optimizer=cls, optimizer_kwargs=kwargs,
                                        device="cpu", dtype=torch.float64, is_weighted=weighted)
    sd = ebc.state_dict()
    return ebc, {t.name: sd[f"{t.name}.weight"].clone() for t in cfgs}


def forward(ebc, kjt, gen):
    """(each feature's output as a tensor, random float64 targets of their shapes)."""
    got = ebc(kjt)
    got = got.to_dict() if isinstance(got, so.KeyedTensor) else {
        k: v.values() if isinstance(v, so.JaggedTensor) else v for k, v in got.items()}
    return got, {k: torch.randn(v.shape, generator=gen, dtype=torch.float64)
                 for k, v in got.items()}


def check_tables(ebc, ref, cfgs, seed, tol=1e-10):
    for t in cfgs:
        got = ebc.table_weight(t.name)
        assert torch.allclose(got, ref.tables[t.name], rtol=tol, atol=tol), (t.name, seed)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("kind", sorted(TABLES))
def test_pooled_steps_equal_torch_per_table(kind, name, threads, gen):
    cfgs = configs(kind)
    ebc, init = build(cfgs, name)
    ref = Reference(cfgs, init, name)
    for _ in range(3):
        kjt = make_batch(cfgs, gen)
        got, targets = forward(ebc, kjt, gen)
        # A group that only pools, updated in place by a rule whose records hold whole
        # weight rows, pools in the host table: nothing staged (StagedStep.ids set).
        in_table = kind != "mixed" and name not in ("RMSprop", "RowWiseAdagrad")
        assert all((g.engine.staged.ids is not None) == in_table for g in ebc.groups)
        want = reference_outputs(cfgs, ref.tables, kjt)
        for k in want:
            assert torch.allclose(got[k], want[k], rtol=1e-12, atol=1e-12), (k, gen.initial_seed())
        loss_of(got, targets).backward()
        ebc.step()
        ref.step(kjt, ref.backward(kjt, targets))
    check_tables(ebc, ref, cfgs, gen.initial_seed())


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "RowWiseAdagrad"])
def test_per_sample_weights(name, threads, gen):
    cfgs = configs("sum")
    ebc, init = build(cfgs, name, weighted=True)
    ref = Reference(cfgs, init, name)
    for _ in range(3):
        kjt = make_batch(cfgs, gen, weighted=True)
        got, targets = forward(ebc, kjt, gen)
        loss_of(got, targets).backward()
        ebc.step()
        ref.step(kjt, ref.backward(kjt, targets))
    check_tables(ebc, ref, cfgs, gen.initial_seed())


def group_grads(ebc, cfgs):
    """Each table's gradient rows as the collection holds them between backward and step():
    {table: {row: gradient}} from its groups' step_parameters()."""
    out = {}
    for g, group in enumerate(ebc.groups):
        (param,) = group.step_parameters()
        ids = group.engine.staged.distinct.ids[:param.shape[0]]
        for k in ebc.tables_of(g):
            place = ebc.place(k)
            mine = (ids >= place.offset) & (ids < place.offset + place.rows)
            out[cfgs[k].name] = dict(zip((ids[mine] - place.offset).tolist(), param.grad[mine]))
    return out


@pytest.mark.parametrize("name", ["SGD", "Adagrad", "Adam"])
@pytest.mark.parametrize("kind", ["sum", "mixed"])
def test_gradients_read_and_clipped_between_backward_and_step(kind, name, gen):
    """The gradient a reader sees between backward and step() is torch's; clipping it scales
    what step() applies."""
    cfgs = configs(kind)
    ebc, init = build(cfgs, name)
    ref = Reference(cfgs, init, name)
    for _ in range(2):
        kjt = make_batch(cfgs, gen)
        got, targets = forward(ebc, kjt, gen)
        loss_of(got, targets).backward()
        grads = ref.backward(kjt, targets)
        for table, rows in group_grads(ebc, cfgs).items():
            for row, g in rows.items():
                assert torch.allclose(g, grads[table][row], rtol=1e-12, atol=1e-12), \
                    (table, row, gen.initial_seed())
        total = torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g) for g in grads.values()]))
        norm = so.clip_grad_norm_(ebc, 0.5)
        assert torch.allclose(norm, total, rtol=1e-12), gen.initial_seed()
        scale = min(1.0, 0.5 / (float(total) + 1e-6))
        ebc.step()
        ref.step(kjt, {k: v * scale for k, v in grads.items()})
    check_tables(ebc, ref, cfgs, gen.initial_seed())


def test_weights_that_take_a_gradient_keep_torchs_backward(gen):
    """Per-sample weights with requires_grad get their gradient (torch's backward runs)."""
    cfgs = configs("sum")
    ebc, init = build(cfgs, "SGD", weighted=True)
    kjt = make_batch(cfgs, gen, weighted=True)
    w = kjt.weights().clone().requires_grad_()
    kjt = so.KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(),
                                                  weights=w)
    ebc(kjt).values().pow(2).sum().backward()
    full = {k: v.clone().requires_grad_() for k, v in init.items()}
    w_ref = w.detach().clone().requires_grad_()
    kjt_ref = so.KeyedJaggedTensor.from_lengths_sync(kjt.keys(), kjt.values(), kjt.lengths(),
                                                      weights=w_ref)
    sum(v.pow(2).sum() for v in reference_outputs(cfgs, full, kjt_ref).values()).backward()
    assert torch.allclose(w.grad, w_ref.grad, rtol=1e-12, atol=1e-12), gen.initial_seed()
    ebc.step()
    with torch.no_grad():
        for k, v in full.items():
            v -= 0.1 * v.grad
    for t in cfgs:
        assert torch.allclose(ebc.table_weight(t.name), full[t.name], rtol=1e-10, atol=1e-10)


def test_a_read_only_forward_pools_the_same(gen):
    cfgs = configs("mixed")
    ebc, init = build(cfgs, "SGD")
    kjt = make_batch(cfgs, gen)
    with torch.no_grad():
        got = ebc(kjt)
    want = reference_outputs(cfgs, init, kjt)
    for k, v in want.items():
        g = got[k].values() if isinstance(got[k], so.JaggedTensor) else got[k]
        assert torch.allclose(g, v, rtol=1e-12, atol=1e-12)
