"""The collections' inputs against plain PyTorch: configs, batches of every kind (ours,
TorchRec-like ones, duck-typed ones, inconsistent ones), weights, freezing, zero-sample batches
and checkpoints that must load whole or not at all. A bad input raises naming what is wrong and
writes nothing; a good one gives one nn.EmbeddingBag per table's result (float64)."""

import pytest
import torch
import torch.nn.functional as F

import speedtorch_ops as so
from conftest import HAS_CUDA, plain

DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
F64 = torch.float64


def collection(cfgs, device="cpu", cls=so.HostEmbeddingBagCollection, **kwargs):
    return cls(cfgs, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.1}, device=device,
               dtype=F64, **kwargs)


def bag_reference(ebc, table, ids, lengths, mode="sum", weights=None):
    """nn's pooling of `ids` in bags of `lengths` over a copy of the table's weight."""
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    return F.embedding_bag(ids, ebc.table_weight(table).cpu().clone(), offsets, mode=mode,
                           per_sample_weights=weights, include_last_offset=True)


def test_a_string_feature_name_is_one_feature(gen):
    cfg = so.TableConfig("t", 10, 4, feature_names="user")
    assert cfg.feature_names == ("user",)
    ebc = collection([cfg])
    ids, lengths = torch.randint(0, 10, (5,), generator=gen), torch.tensor([2, 0, 3])
    out = plain(ebc(so.KeyedJaggedTensor.from_lengths_sync(["user"], ids, lengths)))
    assert list(out) == ["user"]
    assert torch.allclose(out["user"], bag_reference(ebc, "t", ids, lengths))


@pytest.mark.parametrize("bad_table", ["a", "b", "c"])
@pytest.mark.parametrize("bad_step", [torch.zeros(3), "three", None])
def test_a_bad_group_scalar_loads_nothing(bad_table, bad_step, gen):
    """A step count of the wrong shape, or not a number, in any table of any width group (c
    shares a's group, whose count a's entry gives): the load raises naming that table's key and
    no group loads (the tables keep their rows)."""
    ebc = collection([so.TableConfig("a", 10, 4), so.TableConfig("b", 8, 6),
                      so.TableConfig("c", 5, 4)])
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    checkpoint = {k: torch.randn(v.shape, generator=gen, dtype=F64) if v.dim() else v.clone()
                  for k, v in before.items()}
    checkpoint[f"{bad_table}.optimizer.step"] = bad_step
    with pytest.raises(RuntimeError, match=rf"{bad_table}\.optimizer\.step"):
        ebc.load_state_dict(checkpoint)
    after = ebc.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    checkpoint[f"{bad_table}.optimizer.step"] = torch.tensor(3.0)  # still usable
    ebc.load_state_dict(checkpoint)
    assert torch.equal(ebc.state_dict()["a.weight"], checkpoint["a.weight"])


class Batch:
    """A duck-typed jagged batch: only the methods given (a TorchRec-like batch, or less)."""

    def __init__(self, keys, values, lengths, **methods):
        self._parts = {"keys": list(keys), "values": values, "lengths": lengths, **methods}

    def __getattr__(self, name):
        if name.startswith("_") or name not in self._parts:
            raise AttributeError(name)
        return lambda: self._parts[name]


def two_features(gen, device="cpu"):
    """A collection of tables a (feature a) and b (features b1, b2), the ids of a good batch
    (stride 3) and its lengths."""
    ebc = collection([so.TableConfig("a", 10, 4),
                      so.TableConfig("b", 12, 4, pooling="mean", feature_names=["b1", "b2"])],
                     device)
    lengths = torch.tensor([2, 0, 1, 1, 3, 0, 2, 1, 1])
    values = torch.randint(0, 10, (int(lengths.sum()),), generator=gen)
    return ebc, ["a", "b1", "b2"], values.to(device), lengths.to(device)


def assert_refused(ebc, features, error, match):
    """`features` raises `error` matching `match`, and the collection is unchanged."""
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    with pytest.raises(error, match=match):
        out = plain(ebc(features))
        sum(o.sum() for o in out.values()).backward()
        ebc.step()
    after = ebc.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key


@pytest.mark.parametrize("device", DEVICES)
def test_any_batch_type_is_checked(device, gen):
    """A duck-typed batch: ids past what the lengths cover, a stride that does not fit the
    lengths, non-integer lengths, a negative length in a key the collection does not read, and a
    dict raise, naming what is wrong; nothing is written; a good duck-typed batch gives nn's
    result."""
    ebc, keys, values, lengths = two_features(gen, device)
    extra = torch.cat([values, values[:2]])
    assert_refused(ebc, Batch(keys, extra, lengths), ValueError, r"cover 11 ids.*values hold 13")
    assert_refused(ebc, Batch(keys, values, lengths, stride=2), ValueError,
                   r"stride x keys = 2 x 3")
    assert_refused(ebc, Batch(keys, values, lengths.double()), TypeError, "lengths must be int")
    unread = Batch(keys + ["x"], values, torch.cat([lengths, lengths.new_tensor([1, -1, 0])]))
    assert_refused(ebc, unread, ValueError, "feature 'x' has a negative length")
    assert_refused(ebc, {"a": values}, TypeError, r"KeyedJaggedTensor.*got dict")
    out = plain(ebc(Batch(keys, values, lengths)))
    bags = lengths.cpu().view(3, 3)
    at = torch.cumsum(bags.sum(1), 0).tolist()
    ids = values.cpu().split([at[0], at[1] - at[0], at[2] - at[1]])
    for (f, table, mode), piece, bag in zip([("a", "a", "sum"), ("b1", "b", "mean"),
                                             ("b2", "b", "mean")], ids, bags):
        assert torch.allclose(out[f].cpu(), bag_reference(ebc, table, piece, bag, mode)), f


@pytest.mark.parametrize("device", DEVICES)
def test_length_per_key_must_agree_with_the_lengths(device, gen):
    """length_per_key that moves ids from one feature to another (same total) raises naming
    length_per_key and the feature: our batch refuses it at once for lengths on the host (on a
    GPU it cannot look without a wait), the collection for any batch type; nothing is
    written."""
    ebc, keys, values, lengths = two_features(gen, device)
    wrong = [5, 1, 5]  # the lengths give a 3, b1 4, b2 4
    if device == "cpu":
        with pytest.raises(ValueError, match="length_per_key gives feature 'a' 5 ids.* 3"):
            so.KeyedJaggedTensor(keys, values, lengths=lengths, length_per_key=wrong)
    else:
        kjt = so.KeyedJaggedTensor(keys, values, lengths=lengths, length_per_key=wrong)
        assert_refused(ebc, kjt, ValueError, "length_per_key gives feature 'a' 5 ids")
    assert_refused(ebc, Batch(keys, values, lengths, length_per_key=wrong), ValueError,
                   "length_per_key gives feature 'a' 5 ids, its lengths sum to 3")
    right = so.KeyedJaggedTensor(keys, values, lengths=lengths, length_per_key=[3, 4, 4])
    assert torch.allclose(ebc(right)["a"].cpu(),
                          bag_reference(ebc, "a", values.cpu()[:3], lengths.cpu()[:3]))


@pytest.mark.parametrize("device", DEVICES)
def test_weights_follow_is_weighted(device, gen):
    """As TorchRec: built is_weighted=True, the batch's weights weigh the sum-pooled ids (read
    from weights_or_none() or TorchRec's weights()) and are required; built without, a batch's
    weights are ignored. Weights nn.EmbeddingBag would refuse (integers, another floating dtype
    than the table's, but TorchRec's float32) raise naming the feature."""
    cfgs = [so.TableConfig("a", 10, 4), so.TableConfig("c", 10, 4, pooling="none")]
    lengths = torch.tensor([2, 0, 3, 1, 1, 2])
    values = torch.randint(0, 10, (9,), generator=gen)
    w = torch.rand(9, generator=gen, dtype=F64)
    place = dict(values=values.to(device), lengths=lengths.to(device))

    def check(ebc, out, weights):
        want = bag_reference(ebc, "a", values[:5], lengths[:3],
                             weights=None if weights is None else weights[:5])
        assert torch.allclose(out["a"].cpu(), want)
        # a pooling="none" feature beside pooled ones: its rows and its samples' lengths
        assert torch.equal(out["c"].values().cpu(), ebc.table_weight("c").cpu()[values[5:]])
        assert torch.equal(out["c"].lengths().cpu(), lengths[3:])

    weighted = collection(cfgs, device, is_weighted=True)
    assert weighted.is_weighted()
    torchrec_like = Batch(["a", "c"], weights=w.to(device), **place)  # weights() only
    check(weighted, weighted(torchrec_like), w)
    ours = so.KeyedJaggedTensor(["a", "c"], weights=w.to(device), **place)
    check(weighted, weighted(ours), w)
    plain = collection(cfgs, device)
    check(plain, plain(ours), None)  # ignored, as TorchRec's
    check(plain, plain(torchrec_like), None)
    assert_refused(weighted, Batch(["a", "c"], **place), ValueError, "is_weighted=True")
    for dtype in (torch.int64, torch.float16, torch.bfloat16):
        bad = so.KeyedJaggedTensor(["a", "c"], weights=w.to(device, dtype), **place)
        assert_refused(weighted, bad, TypeError, rf"feature 'a'.*{dtype}")
    f32 = so.KeyedJaggedTensor(["a", "c"], weights=w.float().to(device), **place)
    check(weighted, weighted(f32), w.float().double())
    single = collection([so.TableConfig("a", 10, 4, dtype=torch.float32)], device,
                        is_weighted=True)
    a_only = so.KeyedJaggedTensor(["a"], values[:5].to(device), w[:5].to(device),
                                  lengths=lengths[:3].to(device))
    assert_refused(single, a_only, TypeError, r"feature 'a'.*torch.float64")
    with pytest.raises(ValueError, match="is_weighted"):
        collection(cfgs, device, cls=so.HostEmbeddingCollection, is_weighted=True)
    with pytest.raises(TypeError, match="is_weighted"):
        collection(cfgs, device, is_weighted="yes")


@pytest.mark.parametrize("device", DEVICES)
def test_requires_grad_freezes_every_table(device, gen):
    """requires_grad_(False) on the collection freezes every table as on nn.EmbeddingBags (the
    outputs need no grad, a step writes nothing); requires_grad_(True) trains again, one step
    equal to torch's Adam on an nn.EmbeddingBag per table."""
    ebc, keys, values, lengths = two_features(gen, device)
    kjt = so.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
    refs = {t: torch.nn.EmbeddingBag.from_pretrained(ebc.table_weight(t).cpu().clone(),
                                                     freeze=False, mode=m,
                                                     include_last_offset=True)
            for t, m in (("a", "sum"), ("b", "mean"))}
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    assert ebc.requires_grad_(False) is ebc
    for ref in refs.values():
        ref.requires_grad_(False)
    out = plain(ebc(kjt))
    assert not any(o.requires_grad for o in out.values())
    ebc.step()
    after = ebc.state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    ebc.requires_grad_(True)
    for ref in refs.values():
        ref.requires_grad_(True)
    opt = torch.optim.Adam([r.weight for r in refs.values()], lr=0.1)
    out = plain(ebc(kjt))
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths.cpu(), 0)])
    want = {}
    for i, (f, t) in enumerate(zip(keys, ["a", "b", "b"])):  # stride 3
        bags = offsets[3 * i:3 * i + 4]
        want[f] = refs[t](values.cpu()[int(bags[0]):int(bags[-1])], bags - bags[0])
    sum((o.cpu() * (k + 1)).sum() for k, o in enumerate(out.values())).backward()
    sum((want[f] * (k + 1)).sum() for k, f in enumerate(out)).backward()
    ebc.step()
    opt.step()
    for t, ref in refs.items():
        assert torch.allclose(ebc.table_weight(t).cpu(), ref.weight), t


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cls", [so.HostEmbeddingBagCollection, so.HostEmbeddingCollection])
def test_a_batch_of_zero_samples(cls, device):
    """Stride 0 with two features of one pooling in one width group (and more): each feature
    gives nn's empty output ((0, D)); a step after it changes no row (its group's step count
    counts it, as every step)."""
    cfgs = [so.TableConfig("a", 10, 4, feature_names=["a1", "a2"]),
            so.TableConfig("b", 12, 4, pooling="mean", feature_names=["b1", "b2"]),
            so.TableConfig("c", 8, 6, pooling="none")]
    ebc = collection(cfgs, device, cls)
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    keys = ["a1", "a2", "b1", "b2", "c"]
    empty = torch.zeros(0, dtype=torch.int64, device=device)
    out = plain(ebc(so.KeyedJaggedTensor.from_lengths_sync(keys, empty, empty)))
    nothing = torch.zeros(0, dtype=torch.int64)
    for f, t in zip(keys, ["a", "a", "b", "b", "c"]):
        mode = cfgs[["a", "b", "c"].index(t)].pooling if cls is so.HostEmbeddingBagCollection \
            else "none"
        weight = ebc.table_weight(t).cpu()
        want = F.embedding(nothing, weight) if mode == "none" else \
            F.embedding_bag(nothing, weight, torch.zeros(1, dtype=torch.int64), mode=mode,
                            include_last_offset=True)
        assert out[f].shape == want.shape and out[f].dtype == want.dtype, f
    sum(o.sum() for o in out.values()).backward()
    ebc.step()
    after = ebc.state_dict()
    for key, value in before.items():
        assert value.dim() == 0 or torch.equal(after[key], value), key


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32])
def test_narrow_integer_ids_read_the_same_rows_as_int64(dtype, gen):
    """Ids of any integer dtype, in a table past a first one of 200 rows (its rows start at
    an offset a narrow dtype cannot hold): the same outputs as int64 ids."""
    tables = [so.TableConfig("a", 200, 4), so.TableConfig("b", 100, 4)]
    ebc = so.HostEmbeddingBagCollection(tables, optimizer=torch.optim.SGD,
                                        optimizer_kwargs={"lr": 0.1}, device="cpu")
    ebc.eval()
    lengths = torch.randint(0, 4, (6,), generator=gen)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=gen)
    wide = so.KeyedJaggedTensor.from_lengths_sync(["a", "b"], values, lengths)
    narrow = so.KeyedJaggedTensor.from_lengths_sync(["a", "b"], values.to(dtype), lengths)
    assert torch.equal(ebc(narrow).values(), ebc(wide).values()), gen.initial_seed()
