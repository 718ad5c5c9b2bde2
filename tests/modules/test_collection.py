"""HostEmbeddingBagCollection / HostEmbeddingCollection against one nn.EmbeddingBag /
nn.Embedding per table trained with torch's optimizer, lazily (torch's optimizer applied to the
touched rows only, with their summed gradient and the global step count), in float64: mixed
widths, a table shared by two features, duplicates, empty bags, per-sample weights. Bad ids and
lengths raise naming the feature and write nothing; state_dict round trips resume exactly. The
"cuda" cases (and caches that evict every step, and captured steps) run on the GPU machine."""

import copy

import pytest
import torch
import torch.nn.functional as F

import speedtorch_ops as so
from conftest import HAS_CUDA, plain

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
OPTIMIZERS = {
    "SGD": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.05, "weight_decay": 0.01}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01}),  # torch's own step, not fused
}


def tables(pooled=True):
    return [so.TableConfig("a", 30, 4, pooling="sum", feature_names=["a1", "a2"]),
            so.TableConfig("b", 20, 6, pooling="mean" if pooled else "none"),
            so.TableConfig("c", 25, 4, pooling="none")]


def batch(cfgs, gen, stride=3, weighted=False, device="cpu"):
    """A jagged batch of every feature: lengths 0..4 (empty bags too), ids with duplicates."""
    keys, values, lengths = [], [], []
    for t in cfgs:
        for f in t.feature_names:
            keys.append(f)
            ls = torch.randint(0, 5, (stride,), generator=gen)
            ls[0] = 0 if len(keys) % 2 else ls[0]
            # Every feature has an id: a step count is its width group's (TorchRec's is its
            # TBE's), counting every step, where the reference counts each table's own steps.
            ls[-1] = max(int(ls[-1]), 1)
            lengths.append(ls)
            values.append(torch.randint(0, min(t.num_embeddings, 8), (int(ls.sum()),),
                                        generator=gen))
    values, lengths = torch.cat(values), torch.cat(lengths)
    weights = torch.rand(len(values), generator=gen, dtype=torch.float64) if weighted else None
    return so.KeyedJaggedTensor.from_lengths_sync(
        keys, values.to(device), lengths.to(device),
        weights=None if weights is None else weights.to(device))


def reference_outputs(cfgs, weights, kjt, pooled=True):
    """Each feature's output from full float64 tables (requires_grad) with torch's functions."""
    out = {}
    keys, stride = kjt.keys(), kjt.stride()
    offsets = kjt.offsets().cpu()
    values = kjt.values().cpu()
    w = kjt.weights_or_none()
    for t in cfgs:
        for f in t.feature_names:
            i = keys.index(f)
            lo, hi = int(offsets[i * stride]), int(offsets[(i + 1) * stride])
            ids = values[lo:hi]
            pooling = t.pooling if pooled else "none"
            if pooling == "none":
                out[f] = F.embedding(ids, weights[t.name])
            else:
                bags = offsets[i * stride:(i + 1) * stride + 1] - lo
                psw = None if w is None or pooling != "sum" else w.cpu()[lo:hi]
                out[f] = F.embedding_bag(ids, weights[t.name], bags, mode=pooling,
                                         per_sample_weights=psw, include_last_offset=True)
    return out


def loss_of(outputs, targets):
    return sum(((outputs[k].double() * targets[k]).sum(-1) - 0.5).pow(2).sum() for k in targets)


class LazyReference:
    """Full float64 tables trained lazily with torch's optimizer (per table, global step)."""

    def __init__(self, cfgs, init, name):
        self.cfgs, self.cls, self.kwargs = cfgs, *OPTIMIZERS[name]
        self.tables = {k: v.clone() for k, v in init.items()}
        self.states = {k: {} for k in init}
        self.scalars = {k: None for k in init}

    def step(self, kjt, targets, pooled=True):
        full = {k: v.clone().requires_grad_() for k, v in self.tables.items()}
        loss_of(reference_outputs(self.cfgs, full, kjt, pooled), targets).backward()
        for name, param_full in full.items():
            if param_full.grad is None:
                continue
            touched = torch.unique(kjt.values().cpu()[self._positions(kjt, name)])
            if touched.numel() == 0:
                continue
            param = self.tables[name][touched].clone().requires_grad_()
            param.grad = param_full.grad[touched]
            opt = self.cls([param], **self.kwargs)
            if self.scalars[name] is not None:
                opt.state[param].update(copy.deepcopy(self.scalars[name]))
                for key, full_state in self.states[name].items():
                    opt.state[param][key] = full_state[touched].clone()
            opt.step()
            with torch.no_grad():
                self.tables[name][touched] = param
            st = opt.state[param]
            for key, value in st.items():
                if torch.is_tensor(value) and value.shape == param.shape:
                    if key not in self.states[name]:
                        fill = self.kwargs.get("initial_accumulator_value", 0.0)
                        self.states[name][key] = torch.full_like(self.tables[name],
                                                                 fill if key == "sum" else 0.0)
                    self.states[name][key][touched] = value
            self.scalars[name] = {k: v for k, v in st.items() if k not in self.states[name]}

    def _positions(self, kjt, table):
        keys, stride, offsets = kjt.keys(), kjt.stride(), kjt.offsets().cpu()
        mask = torch.zeros(len(kjt.values()), dtype=torch.bool)
        for t in self.cfgs:
            if t.name == table:
                for f in t.feature_names:
                    i = keys.index(f)
                    mask[int(offsets[i * stride]):int(offsets[(i + 1) * stride])] = True
        return mask


def build(cfgs, name, device, cls=so.HostEmbeddingBagCollection, **kwargs):
    opt, okw = OPTIMIZERS[name]
    return cls(cfgs, optimizer=opt, optimizer_kwargs=okw, device=device, dtype=torch.float64,
               **kwargs)


def set_tables(ebc, init):
    sd = ebc.state_dict()
    with torch.no_grad():
        for name, value in init.items():
            sd[f"{name}.weight"].copy_(value)
    ebc.load_state_dict(sd)


def targets_for(outputs, gen):
    return {k: torch.randn(v.shape, generator=gen, dtype=torch.float64) for k, v in outputs.items()}


def run_both(cfgs, name, device, gen, steps=3, pooled=True, weighted=False, **kwargs):
    cls = so.HostEmbeddingBagCollection if pooled else so.HostEmbeddingCollection
    if weighted:
        kwargs["is_weighted"] = True  # else the batch's weights are ignored, as TorchRec's
    ebc = build(cfgs, name, device, cls, **kwargs)
    init = {t.name: torch.randn(t.num_embeddings, t.embedding_dim, generator=gen,
                                dtype=torch.float64) for t in cfgs}
    set_tables(ebc, init)
    ref = LazyReference(cfgs, init, name)
    for _ in range(steps):
        kjt = batch(cfgs, gen, weighted=weighted, device=device)
        out = plain(ebc(kjt))
        targets = targets_for(out, gen)
        loss_of({k: v.cpu() for k, v in out.items()}, targets)  # shapes agree
        loss_of({k: v for k, v in out.items()}, {k: v.to(device) for k, v in targets.items()}
                ).backward()
        ebc.step()
        ref.step(kjt, targets, pooled)
    return ebc, ref


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_collection_equals_one_nn_table_each(device, name, gen):
    cfgs = tables()
    ebc, ref = run_both(cfgs, name, device, gen)
    assert ebc.fused == (name != "RMSprop")
    sd = ebc.state_dict()
    for t in cfgs:
        assert torch.allclose(sd[f"{t.name}.weight"].cpu(), ref.tables[t.name], rtol=1e-9,
                              atol=1e-11), (name, t.name)
        for key, value in ref.states[t.name].items():
            assert torch.allclose(sd[f"{t.name}.optimizer.{key}"].cpu(), value, rtol=1e-9,
                                  atol=1e-11), (name, t.name, key)


@pytest.mark.parametrize("device", DEVICES)
def test_per_table_counts(device, gen):
    """cache_stats()["tables"] counts each table's distinct rows a step (features sharing a
    table counted once a row)."""
    cfgs = tables()
    ebc = build(cfgs, "SGD", device)
    want = {t.name: 0 for t in cfgs}
    for _ in range(3):
        kjt = batch(cfgs, gen, device=device)
        out = plain(ebc(kjt))
        sum(v.sum() for v in out.values()).backward()
        ebc.step()
        keys, stride, offsets = kjt.keys(), kjt.stride(), kjt.offsets().cpu()
        for t in cfgs:
            seen = set()
            for f in t.feature_names:
                i = keys.index(f)
                seen |= set(kjt.values().cpu()[int(offsets[i * stride]):
                                               int(offsets[(i + 1) * stride])].tolist())
            want[t.name] += len(seen)
    got = {name: s["lookups"] for name, s in ebc.cache_stats()["tables"].items()}
    assert got == want


@pytest.mark.parametrize("device", DEVICES)
def test_unpooled_collection_and_per_sample_weights(device, gen):
    cfgs = [so.TableConfig("a", 30, 4, pooling="sum", feature_names=["a1", "a2"]),
            so.TableConfig("c", 25, 6, pooling="none")]
    ebc, ref = run_both(cfgs, "Adam", device, gen, weighted=True)
    for t in cfgs:
        assert torch.allclose(ebc.table_weight(t.name).cpu(), ref.tables[t.name], rtol=1e-9,
                              atol=1e-11)
    ebc, ref = run_both(tables(pooled=False), "SGD", device, gen, pooled=False)
    for t in tables(pooled=False):
        assert torch.allclose(ebc.table_weight(t.name).cpu(), ref.tables[t.name], rtol=1e-9,
                              atol=1e-11)


@pytest.mark.skipif(not HAS_CUDA, reason="the row cache needs a GPU (GPU machine)")
def test_caches_that_evict_every_step_train_like_no_cache(gen):
    cfgs = tables()
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    # A few rows of cache for 75 rows: rows go back every step (evicted, or refused and kept).
    small = so.training.cache.CachedRows.index_bytes(75) + 6 * 3 * 6 * 8
    results = []
    for budget in (0, small):
        g = torch.Generator().manual_seed(seed)
        ebc, ref = run_both(cfgs, "Adam", "cuda", g, steps=4, cache_bytes=budget)
        results.append(ebc.state_dict())
        if budget:
            stats = ebc.cache_stats()
            assert stats["total"]["evictions"] + stats["total"]["direct_writebacks"] > 0
            per_table = stats["tables"]
            assert sum(t["lookups"] for t in per_table.values()) == stats["total"]["lookups"]
            assert sum(t["hits"] for t in per_table.values()) == stats["total"]["hits"]
            assert all(t["lookups"] > 0 for t in per_table.values())
    for key, value in results[0].items():
        assert torch.allclose(results[1][key].cpu(), value.cpu(), rtol=1e-12, atol=1e-13), key


@pytest.mark.parametrize("device", DEVICES)
def test_bad_ids_and_lengths_name_the_feature_and_write_nothing(device, gen):
    cfgs = tables()
    ebc = build(cfgs, "Adam", device)
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    good = batch(cfgs, gen)
    keys, values, lengths = good.keys(), good.values().clone(), good.lengths()
    # An id of table b's feature past b's 20 rows (still inside the stacked group's rows).
    i = keys.index("b")
    at = int(good.offsets()[i * good.stride()])
    if int(lengths[i * good.stride():(i + 1) * good.stride()].sum()) == 0:
        lengths = lengths.clone()
        lengths[i * good.stride()] = 1
        values = torch.cat([values[:at], torch.zeros(1, dtype=values.dtype), values[at:]])
    values[at] = 20
    kjt = so.KeyedJaggedTensor.from_lengths_sync(keys, values.to(device), lengths.to(device))
    with pytest.raises(RuntimeError, match="feature 'b'.*20"):
        ebc(kjt)
    bad_len = lengths.clone()
    bad_len[0] = -1
    bad_len[1] += 1
    kjt = so.KeyedJaggedTensor(keys, values.to(device), lengths=bad_len.to(device),
                               length_per_key=good.length_per_key())
    with pytest.raises(ValueError, match="feature 'a1'.*negative"):
        ebc(kjt)
    missing = so.KeyedJaggedTensor.from_lengths_sync(keys[1:], values[:0].to(device),
                                                     torch.zeros(len(keys[1:]) * 3,
                                                                 dtype=torch.int64).to(device))
    with pytest.raises(KeyError, match="a1"):
        ebc(missing)
    after = ebc.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key].cpu(), value.cpu()), key
    out = plain(ebc(good))  # still usable
    loss_of(out, targets_for({k: v.cpu() for k, v in out.items()}, gen) and
            {k: torch.zeros(v.shape, dtype=torch.float64, device=device) for k, v in out.items()}
            ).backward()
    ebc.step()


@pytest.mark.parametrize("device", DEVICES)
def test_state_dict_round_trip_resumes_exactly(device, gen):
    cfgs = tables()
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    g = torch.Generator().manual_seed(seed)
    ebc, _ = run_both(cfgs, "Adam", device, g, steps=2)
    saved = {k: v.clone() for k, v in ebc.state_dict().items()}
    single = so.HostEmbedding(30, 4, optimizer=torch.optim.Adam, device=device,
                              dtype=torch.float64).state_dict()
    assert {k[2:]: tuple(v.shape) for k, v in saved.items() if k.startswith("a.")} == \
        {k: tuple(v.shape) for k, v in single.items()}
    other = build(cfgs, "Adam", device)
    other.load_state_dict(saved)
    for e in (ebc, other):
        g = torch.Generator().manual_seed(seed + 1)
        for _ in range(2):
            out = plain(e(batch(cfgs, g, device=device)))
            loss_of(out, {k: v.to(device) for k, v in targets_for(
                {k: v.cpu() for k, v in out.items()}, g).items()}).backward()
            e.step()
    a, b = ebc.state_dict(), other.state_dict()
    for key in a:
        assert torch.equal(a[key].cpu(), b[key].cpu()), key
    with pytest.raises(RuntimeError, match="a.weight"):
        other.load_state_dict({**saved, "a.weight": torch.zeros(3, 4, dtype=torch.float64)})


def test_config_errors_name_the_argument():
    with pytest.raises(ValueError, match="pooling"):
        so.TableConfig("t", 10, 4, pooling="max")
    with pytest.raises(ValueError, match="num_embeddings"):
        so.TableConfig("t", 0, 4)
    with pytest.raises(ValueError, match="table names"):
        so.HostEmbeddingBagCollection([so.TableConfig("t", 10, 4), so.TableConfig("t", 5, 4)],
                                      device="cpu")
    with pytest.raises(ValueError, match="feature names"):
        so.HostEmbeddingBagCollection([so.TableConfig("t", 10, 4),
                                       so.TableConfig("u", 5, 4, feature_names=["t"])],
                                      device="cpu")
    with pytest.raises(ValueError, match="lengths"):
        so.KeyedJaggedTensor(["a", "b"], torch.arange(3), lengths=torch.tensor([1, 1, 1]))


@pytest.mark.parametrize("device", DEVICES)
def test_partial_and_bad_loads(device, gen):
    """strict=False loads the tables the checkpoint has and keeps the others; a load with a bad
    key loads nothing at all."""
    cfgs = [so.TableConfig("a", 10, 4), so.TableConfig("b", 8, 4), so.TableConfig("c", 6, 3)]
    ebc = build(cfgs, "Adam", device)
    sd = {k: v.clone() for k, v in ebc.state_dict().items()}
    before = {k: v.clone() for k, v in sd.items()}
    new_a = torch.randn(10, 4, generator=gen, dtype=torch.float64)
    partial = {"a.weight": new_a}
    result = ebc.load_state_dict(partial, strict=False)
    assert "b.weight" in result.missing_keys and "a.weight" not in result.missing_keys
    assert not any("momentum_started" in k for k in result.missing_keys)
    now = ebc.state_dict()
    assert torch.equal(now["a.weight"].cpu(), new_a)
    assert torch.equal(now["b.weight"].cpu(), before["b.weight"].cpu())
    assert torch.equal(now["c.weight"].cpu(), before["c.weight"].cpu())
    bad = {k: v.clone() for k, v in now.items()}
    bad["a.weight"].fill_(3.0)
    bad["b.optimizer.exp_avg"] = torch.zeros(3, 4, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="b.optimizer.exp_avg"):
        ebc.load_state_dict(bad)
    assert torch.equal(ebc.state_dict()["a.weight"].cpu(), new_a)  # nothing was loaded


def test_jagged_offsets_are_checked():
    with pytest.raises(ValueError, match="start at 0"):
        so.KeyedJaggedTensor(["a", "b"], torch.arange(5), offsets=torch.tensor([5, 6, 8, 8, 9]))
    with pytest.raises(ValueError, match="disagree"):
        so.KeyedJaggedTensor(["a", "b"], torch.arange(4), lengths=torch.tensor([1, 1, 1, 1]),
                             offsets=torch.tensor([0, 2, 2, 3, 4]))


def test_tables_with_their_own_dtype(gen):
    """TableConfig.dtype: tables of one width and dtype share a group, another dtype makes a
    group of its own; each table's state_dict and outputs have its dtype; a float64 table beside
    bfloat16 ones trains as in an all-float64 collection."""
    mixed = [so.TableConfig("a", 30, 4, feature_names=["a1", "a2"]),
             so.TableConfig("b", 20, 4, pooling="mean", dtype=torch.bfloat16),
             so.TableConfig("c", 25, 6, pooling="none", dtype=torch.bfloat16)]
    uniform = [so.TableConfig(t.name, t.num_embeddings, t.embedding_dim, t.pooling,
                              t.feature_names) for t in mixed]
    kjts = [batch(mixed, gen) for _ in range(3)]
    start = torch.randn(30, 4, generator=gen, dtype=torch.float64)
    results = []
    for cfgs in (mixed, uniform):
        ebc = so.HostEmbeddingBagCollection(cfgs, optimizer=torch.optim.Adam,
                                            optimizer_kwargs={"lr": 0.05}, device="cpu",
                                            dtype=torch.float64)
        ebc.load_state_dict({"a.weight": start}, strict=False)
        for kjt in kjts:
            out = plain(ebc(kjt))
            sum(o.double().pow(2).sum() for o in out.values()).backward()
            ebc.step()
        results.append((ebc, out))
    (ebc, out), (ref, _) = results
    assert ebc.dtype == torch.float64 and len(ebc.groups) == 3 and len(ref.groups) == 2
    assert out["a1"].dtype == torch.float64 and out["b"].dtype == out["c"].dtype == torch.bfloat16
    sd, want = ebc.state_dict(), ref.state_dict()
    assert sd["b.weight"].dtype == sd["b.optimizer.exp_avg"].dtype == torch.bfloat16
    for key in ("a.weight", "a.optimizer.exp_avg", "a.optimizer.exp_avg_sq"):
        assert sd[key].dtype == torch.float64
        assert torch.allclose(sd[key], want[key], rtol=1e-12, atol=1e-14), key
    assert set(ebc.cache_stats()) >= {"dim4-float64", "dim4-bfloat16", "dim6", "total"}
    with pytest.raises(TypeError, match="TableConfig 't': dtype must be a floating dtype"):
        so.TableConfig("t", 10, 4, dtype=torch.int32)


def test_a_converted_collection_reports_its_dtype_and_every_group():
    ebc = so.HostEmbeddingBagCollection(
        [so.TableConfig("a", 10, 4, dtype=torch.bfloat16), so.TableConfig("b", 10, 4)],
        device="cpu")
    assert ebc.dtype == torch.float32 and len(ebc.groups) == 2
    ebc.double()
    assert ebc.dtype == torch.float64
    stats = ebc.cache_stats()
    assert len([k for k in stats if k.startswith("dim4")]) == 2  # two groups, two names


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a GPU (GPU machine)")
def test_captured_read_only_forward_and_a_step_failing_in_a_capture(gen):
    """On the GPU: a read-only forward of a cached collection captures (its counts join at once:
    no fork left open) and reads the tables' rows; a step that fails inside a capture (Adagrad
    keeps its step count on the CPU) raises its own error with every group's forward dropped,
    so the capture ends cleanly, and the collection trains eagerly afterwards."""
    cfgs = [so.TableConfig("a", 30, 4, pooling="none"), so.TableConfig("b", 20, 6, pooling="none")]
    n = 5
    lengths = torch.ones(2 * n, dtype=torch.int64, device="cuda")
    offsets = torch.arange(2 * n + 1, device="cuda")

    def kjt(values):
        return so.KeyedJaggedTensor(["a", "b"], values, lengths=lengths, offsets=offsets,
                                    length_per_key=[n, n])

    ebc = so.HostEmbeddingCollection(cfgs, optimizer=torch.optim.SGD,
                                     optimizer_kwargs={"lr": 0.1}, device="cuda",
                                     cache_bytes=1 << 20, bounds_check="prechecked",
                                     dtype=torch.float64)
    ebc.eval()

    def read(values):
        with torch.no_grad():
            out = plain(ebc(kjt(values)))
        return out["a"], out["b"]

    captured = so.CapturedStep(read, rows=(20,), warmup=1)
    for _ in range(3):
        ids = torch.randint(0, 20, (2 * n,), generator=gen)
        a, b = captured(ids)
        assert torch.equal(a.cpu(), ebc.table_weight("a").cpu()[ids[:n]])
        assert torch.equal(b.cpu(), ebc.table_weight("b").cpu()[ids[n:]])
    assert captured.graph is not None

    ebc = so.HostEmbeddingCollection(cfgs, optimizer=torch.optim.Adagrad,
                                     optimizer_kwargs={"lr": 0.1}, device="cuda",
                                     cache_bytes=1 << 20, bounds_check="prechecked",
                                     dtype=torch.float64)

    def train(values):
        out = plain(ebc(kjt(values)))
        (out["a"].sum() + out["b"].sum()).backward()
        ebc.step()

    ids = torch.randint(0, 20, (2 * n,), generator=gen).cuda()
    train(ids)  # eager: Adagrad's CPU step count is fine here
    graph, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with pytest.raises(RuntimeError, match=r"Adagrad keeps \['step'\] on the CPU"):
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            train(ids)
    torch.cuda.current_stream().wait_stream(side)
    before = ebc.table_weight("a").cpu().clone()
    train(ids)
    torch.cuda.synchronize()
    assert not torch.equal(ebc.table_weight("a").cpu(), before)
