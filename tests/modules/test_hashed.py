"""Hashed tables in the collections (``TableConfig(num_embeddings=None, capacity=...)``): any
int64 id, rows given on first sight (or after ``admit_after`` sightings), evicted by a score
when full, nothing lost silently. The reference is a Python dict of rows, one torch optimizer a
row (so a row's state starts fresh when its id comes back after an eviction), float64, fresh
random ids from the whole int64 range. CPU here; the same tests run on the GPU machine
(``device`` "cuda")."""

import numpy as np
import pytest
import torch

import speedtorch_ops as so
from conftest import HAS_CUDA, plain


def close(a, b) -> bool:
    """Equal up to float64's rounding of sums in another order (a bag's rows, a gradient's)."""
    return torch.allclose(a.detach().cpu(), b.detach().cpu(), rtol=1e-12, atol=1e-12)

DIM = 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="hashed tables on the GPU: the GPU machine"))]
OPTIMIZERS = {"SGD": (torch.optim.SGD, {"lr": 0.3}),
              "SGD-momentum": (torch.optim.SGD, {"lr": 0.2, "momentum": 0.9}),
              "Adagrad": (torch.optim.Adagrad, {"lr": 0.4}),
              # a state that starts away from zero: a reused row's state must start there too
              "Adagrad-init": (torch.optim.Adagrad, {"lr": 0.4, "initial_accumulator_value": 0.3})}


class Reference:
    """Rows by id: each a float64 parameter starting at zero with an optimizer of its own."""

    def __init__(self, cls, kwargs):
        self.cls, self.kwargs, self.rows = cls, kwargs, {}

    def row(self, i: int):
        if i not in self.rows:
            p = torch.zeros(DIM, dtype=torch.float64, requires_grad=True)
            self.rows[i] = (p, self.cls([p], **self.kwargs))
        return self.rows[i][0]

    def pooled(self, ids, lengths, has_row):
        out, at = [], 0
        for n in lengths.tolist():
            bag = [self.row(int(i)) for i in ids[at:at + n] if has_row(int(i))]
            out.append(torch.stack(bag).sum(0) if bag else torch.zeros(DIM, dtype=torch.float64))
            at += n
        return torch.stack(out)

    def step(self):
        for p, opt in self.rows.values():
            if p.grad is not None:
                opt.step()
                p.grad = None


def backward_both(out, want, gen):
    """One random loss on ours and the reference's outputs, backward through both."""
    w = torch.randn(want.shape, dtype=torch.float64, generator=gen)
    (out * w.to(out.device)).sum().backward()
    if want.requires_grad:  # else no id of the step has a row (or the step has no ids)
        (want * w).sum().backward()


def random_ids(gen, n, pool):
    """n ids drawn from `pool` (distinct int64 values anywhere in the range)."""
    return pool[torch.randint(0, pool.numel(), (n,), generator=gen)]


def id_pool(gen, n):
    return torch.unique(torch.randint(-2**63, 2**63 - 1, (n,), generator=gen, dtype=torch.int64))


def collection(device, opt, capacity, **kw):
    cls, kwargs = OPTIMIZERS[opt]
    tables = [so.TableConfig("h", None, DIM, capacity=capacity, **kw),
              so.TableConfig("d", 7, DIM)]
    return so.HostEmbeddingBagCollection(tables, optimizer=cls, optimizer_kwargs=kwargs,
                                         device=device, dtype=torch.float64)


def batch(ids, lengths, device):
    dense = torch.arange(lengths.numel()) % 7
    return so.KeyedJaggedTensor.from_lengths_sync(
        ["h", "d"], torch.cat([ids, dense]).to(device),
        torch.cat([lengths, torch.ones_like(lengths)]).to(device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_rows_train_like_a_dict_of_rows_and_evictions_hand_over_exact_rows(device, opt, gen):
    """A capacity below the ids in play: rows are evicted every few steps; each evicted row
    reaches on_evict with the reference's exact weight and state, and its id starts afresh when
    it comes back. Outputs and every held row equal the reference's at every step."""
    cls, kwargs = OPTIMIZERS[opt]
    ref = Reference(cls, kwargs)
    evicted = []

    def on_evict(table, ids, weights, state):
        assert table == "h"
        for i, w, n in zip(ids.tolist(), weights, range(len(ids))):
            p, o = ref.rows.pop(i)
            assert close(w, p), (i, gen.initial_seed())
            for key, value in o.state[p].items():
                if key != "step":
                    assert close(state[key][n], value), (key, gen.initial_seed())
            evicted.append(i)

    ebc = collection(device, opt, 12, on_evict=on_evict)
    pool = id_pool(gen, 30)
    for _ in range(12):
        lengths = torch.randint(0, 4, (4,), generator=gen)
        ids = random_ids(gen, int(lengths.sum()), pool)
        out = plain(ebc(batch(ids, lengths, device)))
        want = ref.pooled(ids, lengths, lambda i: True)
        assert close(out["h"], want), gen.initial_seed()
        backward_both(out["h"], want, gen)
        ebc.step()
        ref.step()
    sd = ebc.state_dict()
    assert sorted(sd["h.ids"].tolist()) == sorted(ref.rows), gen.initial_seed()
    for i, w in zip(sd["h.ids"].tolist(), sd["h.weight"]):
        assert close(w, ref.rows[i][0]), gen.initial_seed()
    stats = ebc.cache_stats()["tables"]["h"]
    assert stats["rows"] == len(ref.rows) and stats["evicted"] == len(evicted) > 0
    assert stats["admitted"] == stats["rows"] + stats["evicted"]


@pytest.mark.parametrize("device", DEVICES)
def test_an_id_reads_zeros_and_drops_its_gradient_until_admitted(device, gen):
    """admit_after=3: an id's first two sightings read zeros and train nothing (counted); the
    third gives it a row starting at zero; the others in its bags train as usual."""
    ref = Reference(*OPTIMIZERS["Adagrad"])
    ebc = collection(device, "Adagrad", 50, admit_after=3)
    pool = id_pool(gen, 8)
    seen, dropped = {}, 0
    for _ in range(10):
        lengths = torch.randint(1, 4, (3,), generator=gen)
        ids = random_ids(gen, int(lengths.sum()), pool)
        for i in ids.tolist():
            seen[i] = seen.get(i, 0) + 1
        admitted = {i for i, n in seen.items() if n >= 3}
        dropped += sum(i not in admitted for i in ids.tolist())
        out = plain(ebc(batch(ids, lengths, device)))
        want = ref.pooled(ids, lengths, lambda i: i in admitted)
        assert close(out["h"], want), gen.initial_seed()
        backward_both(out["h"], want, gen)
        ebc.step()
        ref.step()
    stats = ebc.cache_stats()["tables"]["h"]
    assert stats["not_admitted"] == dropped > 0 and stats["rows"] == len(ref.rows)
    sd = ebc.state_dict()
    for i, w in zip(sd["h.ids"].tolist(), sd["h.weight"]):
        assert close(w, ref.rows[i][0]), gen.initial_seed()


def test_more_new_ids_than_rows_leaves_the_rest_without_one_this_step(gen):
    """Ten new ids for four rows: four get rows, six read zeros (counted); no row of this
    step is taken from another id of the same step."""
    ebc = collection("cpu", "SGD", 4)
    ids = id_pool(gen, 10)[:10]
    out = plain(ebc(batch(ids, torch.ones(10, dtype=torch.int64), "cpu")))
    assert torch.equal(out["h"], torch.zeros(10, DIM, dtype=torch.float64))
    stats = ebc.cache_stats()["tables"]["h"]
    assert (stats["rows"], stats["not_admitted"], stats["evicted"]) == (4, 6, 0)
    out["h"].sum().backward()
    ebc.step()
    sd = ebc.state_dict()
    assert set(sd["h.ids"].tolist()) < set(ids.tolist())
    assert torch.all(sd["h.weight"] == -0.3)  # each held id's bag, summed once, lr 0.3


@pytest.mark.parametrize("policy", ["lru", "lfu", "callable"])
def test_the_policy_picks_the_victim(policy):
    """Capacity 2: id 1 touched three times, id 2 once but later; a new id evicts id 2 under
    lfu, id 1 under lru, and under a function of (count, last_step) its lowest score."""
    got = []
    evict = (lambda count, last: count * 0 - last) if policy == "callable" else policy
    ebc = so.HostEmbeddingBagCollection(
        [so.TableConfig("h", None, 2, capacity=2, evict=evict,
                        on_evict=lambda t, ids, w, s: got.extend(ids.tolist()))],
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, device="cpu")
    for ids in ([1], [1], [1], [2], [3]):
        out = ebc(so.KeyedJaggedTensor.from_lengths_sync(["h"], torch.tensor(ids),
                                                         torch.tensor([1])))
        out.values().sum().backward()
        ebc.step()
    assert got == {"lru": [1], "lfu": [2], "callable": [2]}[policy]


def test_an_evaluation_forward_reads_without_giving_rows(gen):
    ebc = collection("cpu", "SGD", 10)
    ids = id_pool(gen, 3)
    ebc.eval()
    out = plain(ebc(batch(ids, torch.ones(3, dtype=torch.int64), "cpu")))
    assert torch.equal(out["h"], torch.zeros(3, DIM, dtype=torch.float64))
    stats = ebc.cache_stats()["tables"]["h"]
    assert (stats["rows"], stats["not_admitted"]) == (0, 3)


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoints_round_trip_and_training_goes_on_equal(device, gen):
    """A saved hashed table (ids, rows, state, scores) loads into a fresh collection, which
    then trains (evicting too) exactly as the original."""
    pool = id_pool(gen, 20)
    a = collection(device, "SGD-momentum", 8)
    steps = []
    for _ in range(8):
        lengths = torch.randint(1, 3, (3,), generator=gen)
        steps.append((random_ids(gen, int(lengths.sum()), pool), lengths))
    for ids, lengths in steps[:4]:
        plain(a(batch(ids, lengths, device)))["h"].pow(2).sum().backward()
        a.step()
    b = collection(device, "SGD-momentum", 8)
    b.load_state_dict(a.state_dict())
    for ids, lengths in steps[4:]:
        for m in (a, b):
            plain(m(batch(ids, lengths, device)))["h"].pow(2).sum().backward()
            m.step()
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), key


def test_a_bad_checkpoint_loads_nothing(gen):
    a = collection("cpu", "SGD", 5)
    ids = id_pool(gen, 4)
    plain(a(batch(ids, torch.ones(4, dtype=torch.int64), "cpu")))["h"].sum().backward()
    a.step()
    before = {k: v.clone() for k, v in a.state_dict().items()}
    sd = a.state_dict()
    for bad, match in ((dict(sd, **{"h.ids": torch.cat([sd["h.ids"], sd["h.ids"][:1]])}),
                        "distinct"),
                       (dict(sd, **{"h.ids": torch.arange(6)}), "capacity 5"),
                       (dict(sd, **{"h.weight": sd["h.weight"][:2]}), "h.weight"),
                       ({k: v for k, v in sd.items() if k != "h.count"}, "h.count")):
        with pytest.raises(RuntimeError, match=match):
            a.load_state_dict(bad)
        after = a.state_dict()
        for key, value in before.items():
            assert torch.equal(after[key], value), key


def test_reset_parameters_gives_rows_an_init():
    ebc = collection("cpu", "SGD", 4)
    ebc(batch(torch.tensor([5, 6]), torch.tensor([1, 1]), "cpu"))
    ebc.discard()
    ebc.reset_parameters({"h": lambda w: w.fill_(0.25)})
    ebc.eval()
    out = plain(ebc(batch(torch.tensor([5, 9]), torch.tensor([1, 1]), "cpu")))["h"]
    assert out[0].eq(0.25).all() and out[1].eq(0).all()  # held: init; 9 has no row
    ebc.train()
    out = plain(ebc(batch(torch.tensor([9]), torch.tensor([1]), "cpu")))["h"]
    assert out.eq(0.25).all()  # a new row starts at the init


def test_unpooled_collection_takes_hashed_tables(gen):
    ec = so.HostEmbeddingCollection([so.TableConfig("h", None, DIM, capacity=6)],
                                    optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 1.0},
                                    device="cpu", dtype=torch.float64)
    ids = id_pool(gen, 3)
    kjt = so.KeyedJaggedTensor.from_lengths_sync(["h"], torch.cat([ids, ids[:1]]),
                                                 torch.tensor([2, 2]))
    out = ec(kjt)["h"].values()
    out.sum().backward()
    ec.step()
    out = ec(kjt)["h"].values()
    assert torch.equal(out[0], torch.full((DIM,), -2.0, dtype=torch.float64))  # seen twice
    assert torch.equal(out[1], torch.full((DIM,), -1.0, dtype=torch.float64))


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(capacity=0), ValueError, "capacity"),
    (dict(capacity=4, evict="fifo"), ValueError, "evict"),
    (dict(capacity=4, admit_after=0), ValueError, "admit_after"),
    (dict(capacity=4, on_evict="x"), TypeError, "on_evict"),
    (dict(), ValueError, "capacity"),
])
def test_bad_settings_raise_naming_the_argument(kwargs, error, match):
    with pytest.raises(error, match=match):
        so.TableConfig("h", None, DIM, **kwargs)
    with pytest.raises(ValueError, match="num_embeddings=None"):
        so.TableConfig("h", 10, DIM, capacity=4)
    with pytest.raises(ValueError, match="hashed"):
        so.TableConfig("h", 10, DIM, admit_after=2)


def test_bad_ids_raise_and_write_nothing(gen):
    ebc = collection("cpu", "SGD", 4)
    bad = so.KeyedJaggedTensor.from_lengths_sync(
        ["h", "d"], torch.tensor([1.0, 2.0]), torch.tensor([1, 1]))
    with pytest.raises(TypeError, match="integers"):
        ebc(bad)
    assert ebc.cache_stats()["tables"]["h"]["rows"] == 0
    with pytest.raises(RuntimeError, match="out of range"):  # the dense table still checks
        ebc(so.KeyedJaggedTensor.from_lengths_sync(["h", "d"], torch.tensor([2**62, 99]),
                                                   torch.tensor([1, 1])))
    assert ebc.cache_stats()["tables"]["h"]["rows"] == 0


def test_the_map_holds_many_ids_through_erasures(gen):
    """The id map itself against a dict: random inserts and erasures, rebuilt as erased slots
    pile up."""
    from speedtorch_ops.training.hashed import IdMap
    m, ref = IdMap(64), {}
    rng = np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=gen)))
    for _ in range(50):
        held = np.array(sorted(ref), dtype=np.int64)
        if held.size > 40:
            drop = rng.choice(held, 10, replace=False)
            rows, slots = m.find(drop)
            assert (rows == [ref.pop(int(i)) for i in drop]).all()
            m.erase(slots)
        new = np.setdiff1d(rng.integers(-2**63, 2**63 - 1, 12, dtype=np.int64), held)
        rows = rng.integers(0, 1000, new.size)
        m.insert(new, rows)
        ref.update(zip(new.tolist(), rows.tolist()))
        probe = np.concatenate([np.array(list(ref), dtype=np.int64), new + 1])
        got, _ = m.find(probe)
        want = [ref.get(int(i), -1) for i in probe]
        assert (got == want).all()


def test_captured_steps_refuse_hashed_tables_clearly():
    """The map lives on the host: a collection with a hashed table trains eagerly; under a
    capture its forward raises naming the table (GPU only: captures are)."""
    if not HAS_CUDA:
        pytest.skip("captures need a GPU (the GPU machine)")
    ebc = collection("cuda", "SGD", 4)
    ebc.bounds_check = "prechecked"  # a capture cannot wait for the dense table's check
    kjt = batch(torch.tensor([1, 2]), torch.tensor([1, 1]), "cuda")
    g = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="'h' is hashed"):
        with torch.cuda.graph(g):
            ebc(kjt)


@pytest.mark.parametrize("device", DEVICES)
def test_increments_on_a_base_give_back_the_table_exactly(device, gen):
    """A base save, then two increments (the rows changed since, evictions as tombstones,
    ids evicted and admitted again between them): a fresh collection loading the base and
    applying both in order holds what the source holds, and trains on exactly like it. An
    increment out of order, or a damaged one, raises and writes nothing."""
    pool = id_pool(gen, 24)
    src = collection(device, "SGD-momentum", 10)
    steps = []
    for _ in range(12):
        lengths = torch.randint(1, 3, (3,), generator=gen)
        steps.append((random_ids(gen, int(lengths.sum()), pool), lengths))

    def run(m, part):
        for ids, lengths in part:
            plain(m(batch(ids, lengths, device)))["h"].pow(2).sum().backward()
            m.step()

    run(src, steps[:4])
    base = {k: v.clone() for k, v in src.state_dict().items()}
    run(src, steps[4:7])
    inc1 = src.incremental_state_dict(base)
    run(src, steps[7:10])
    inc2 = src.incremental_state_dict(inc1)
    assert inc1["h.removed"].numel() + inc2["h.removed"].numel() > 0, gen.initial_seed()
    dst = collection(device, "SGD-momentum", 10)
    dst.load_state_dict(base)
    with pytest.raises(RuntimeError, match="h.since"):
        dst.load_increment(inc2)  # out of order: nothing written
    bad = dict(inc1, **{"h.weight": inc1["h.weight"][:1]})
    with pytest.raises(RuntimeError, match="h.weight"):
        dst.load_increment(bad)
    for key, value in dst.state_dict().items():
        assert torch.equal(value, base[key]), key
    dst.load_increment(inc1)
    dst.load_increment(inc2)
    sa, sb = src.state_dict(), dst.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), (key, gen.initial_seed())
    run(src, steps[10:])
    run(dst, steps[10:])
    for key, value in src.state_dict().items():
        assert torch.equal(value, dst.state_dict()[key]), (key, gen.initial_seed())


def test_an_increment_after_a_reset_holds_every_row(gen):
    src, dst = collection("cpu", "SGD", 6), collection("cpu", "SGD", 6)
    src(batch(id_pool(gen, 4), torch.ones(4, dtype=torch.int64), "cpu"))["h"].sum().backward()
    src.step()
    base = src.state_dict()
    dst.load_state_dict(base)
    src.reset_parameters({"h": lambda w: w.fill_(0.5), "d": lambda w: w.fill_(1.0)})
    inc = src.incremental_state_dict(base)
    assert inc["h.ids"].numel() == 4
    dst.load_increment(inc)
    for key, value in src.state_dict().items():
        assert torch.equal(value, dst.state_dict()[key]), key


def test_an_increment_follows_the_latest_save_only(gen):
    ebc = collection("cpu", "SGD", 6)
    old = ebc.state_dict()
    ebc(batch(id_pool(gen, 3), torch.ones(3, dtype=torch.int64), "cpu"))["h"].sum().backward()
    ebc.step()
    ebc.state_dict()  # a later save: the tombstones before it are gone
    with pytest.raises(ValueError, match="latest save"):
        ebc.incremental_state_dict(old)


def test_an_on_evict_that_raises_loses_no_row(gen):
    """The callback raises on the first eviction (of a step that takes the last free row
    too): the forward raises, every id keeps its row, no row is lost, and the next forward
    takes the free row and evicts as usual."""
    calls = []

    def on_evict(table, ids, weights, state):
        calls.append(ids.tolist())
        if len(calls) == 1:
            raise OSError("spill full")

    ebc = so.HostEmbeddingBagCollection(
        [so.TableConfig("h", None, 2, capacity=4, on_evict=on_evict)],
        optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1}, device="cpu")

    def train(ids):
        out = ebc(so.KeyedJaggedTensor.from_lengths_sync(["h"], torch.tensor(ids),
                                                         torch.ones(len(ids), dtype=torch.int64)))
        out.values().sum().backward()
        ebc.step()

    train([1, 2, 3])
    with pytest.raises(OSError, match="spill full"):
        train([4, 5])
    assert sorted(ebc.state_dict()["h.ids"].tolist()) == [1, 2, 3]
    train([4, 5])
    assert len(calls) == 2 and len(calls[1]) == 1
    assert ebc.cache_stats()["tables"]["h"]["rows"] == 4
    assert sorted(ebc.state_dict()["h.ids"].tolist())[-2:] == [4, 5]
