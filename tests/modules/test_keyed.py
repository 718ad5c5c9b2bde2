"""The collections' outputs in TorchRec's types (speedtorch_ops/keyed.py): a pooled collection's
KeyedTensor and an unpooled one's JaggedTensors, against plain tensors built from the same
rows. CPU here; the types are the same on a GPU."""

import pytest
import torch

import speedtorch_ops as so

F64 = torch.float64


def pooled(gen):
    tables = [so.TableConfig("a", 30, 4, feature_names=["a1", "a2"]),
              so.TableConfig("b", 20, 6, pooling="mean")]
    ebc = so.HostEmbeddingBagCollection(tables, optimizer=torch.optim.SGD,
                                        optimizer_kwargs={"lr": 0.1}, device="cpu", dtype=F64)
    lengths = torch.randint(0, 4, (9,), generator=gen)  # 3 features x 3 samples
    values = torch.cat([torch.randint(0, 30, (int(lengths[:6].sum()),), generator=gen),
                        torch.randint(0, 20, (int(lengths[6:].sum()),), generator=gen)])
    return ebc, so.KeyedJaggedTensor.from_lengths_sync(["a1", "a2", "b"], values, lengths)


def test_a_pooled_collection_returns_a_keyed_tensor(gen):
    ebc, kjt = pooled(gen)
    assert [t.name for t in ebc.embedding_bag_configs()] == ["a", "b"]
    assert ebc.embedding_configs() == ebc.embedding_bag_configs()
    kt = ebc(kjt)
    assert isinstance(kt, so.KeyedTensor)
    assert kt.keys() == ["a1", "a2", "b"] and kt.key_dim() == 1
    assert kt.length_per_key() == [4, 4, 6] and kt.offset_per_key() == [0, 4, 8, 14]
    parts = kt.to_dict()
    assert list(parts) == ["a1", "a2", "b"]
    assert all(parts[k].shape == (3, n) for k, n in zip(kt.keys(), kt.length_per_key()))
    assert torch.equal(kt.values(), torch.cat([parts["a1"], parts["a2"], parts["b"]], 1))
    assert kt.values() is kt.values()  # made once
    assert torch.equal(kt["b"], parts["b"])
    with pytest.raises(KeyError, match="no key 'c'"):
        kt["c"]
    with pytest.raises(TypeError, match="not iterable"):
        list(kt)
    ab, = so.KeyedTensor.regroup([kt], [["b", "a1"]])
    assert torch.equal(ab, torch.cat([parts["b"], parts["a1"]], 1))
    named = so.KeyedTensor.regroup_as_dict([kt], [["a2"], ["a1", "b"]], ["x", "y"])
    assert torch.equal(named["x"], parts["a2"]) and named["y"].shape == (3, 10)
    with pytest.raises(KeyError, match="holds"):
        so.KeyedTensor.regroup([kt], [["a1", "zz"]])


def test_a_loss_through_values_trains_as_one_through_each_feature(gen):
    """values() is a concatenation of the features' tensors: a loss on it gives each row the
    gradient a loss on the features' own tensors gives."""
    seed = int(torch.randint(0, 2**31, (1,), generator=gen))
    results = []
    for through_values in (True, False):
        g = torch.Generator().manual_seed(seed)
        ebc, _ = pooled(g)
        ebc.reset_parameters(lambda w: w.normal_(generator=torch.Generator().manual_seed(seed)))
        for _ in range(3):
            _, kjt = pooled(g)
            target = torch.randn(3, 14, generator=g, dtype=F64)
            kt = ebc(kjt)
            out = kt.values() if through_values else torch.cat(
                [kt[k] for k in kt.keys()], 1)
            ((out - target) ** 2).sum().backward()
            ebc.step()
        results.append({k: v.clone() for k, v in ebc.state_dict().items()})
    assert results[0].keys() == results[1].keys()
    for k in results[0]:
        assert torch.equal(results[0][k], results[1][k]), k


def test_an_unpooled_collection_returns_jagged_tensors(gen):
    ec = so.HostEmbeddingCollection([so.TableConfig("t", 40, 3, feature_names=["x", "y"])],
                                    optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                                    device="cpu", dtype=F64)
    lengths = torch.tensor([2, 0, 3, 1, 1, 4])  # x: 2, 0, 3; y: 1, 1, 4
    values = torch.randint(0, 40, (11,), generator=gen)
    out = ec(so.KeyedJaggedTensor.from_lengths_sync(["x", "y"], values, lengths))
    assert set(out) == {"x", "y"}
    weight = ec.table_weight("t")
    for key, ids, lens in (("x", values[:5], lengths[:3]), ("y", values[5:], lengths[3:])):
        jt = out[key]
        assert isinstance(jt, so.JaggedTensor)
        assert torch.equal(jt.values(), weight[ids]) and torch.equal(jt.lengths(), lens)
        assert torch.equal(jt.offsets(), torch.cat([torch.zeros(1, dtype=lens.dtype),
                                                    lens.cumsum(0)]))
        assert jt.weights_or_none() is None
        dense = jt.to_dense()
        assert [d.shape[0] for d in dense] == lens.tolist()
        assert torch.equal(torch.cat(dense), weight[ids])
        padded = jt.to_padded_dense(desired_length=2, padding_value=-1.0)
        assert padded.shape == (3, 2, 3)
        start = 0
        for i, n in enumerate(lens.tolist()):
            assert torch.equal(padded[i, :min(n, 2)], weight[ids[start:start + min(n, 2)]])
            assert (padded[i, min(n, 2):] == -1).all()
            start += n
    with pytest.raises(ValueError, match="no weights"):
        out["x"].weights()


def test_jagged_tensor_from_offsets():
    jt = so.JaggedTensor(torch.arange(8.).view(4, 2), offsets=torch.tensor([0, 3, 3, 4]))
    assert torch.equal(jt.lengths(), torch.tensor([3, 0, 1]))
    assert jt.lengths_or_none() is not None and jt.offsets_or_none() is not None
    with pytest.raises(ValueError, match="lengths and offsets"):
        so.JaggedTensor(torch.zeros(2, 2))
    kt = so.KeyedTensor(["p", "q"], [2, 1], torch.arange(6.).view(2, 3))
    assert torch.equal(kt["q"], torch.tensor([[2.], [5.]]))
    with pytest.raises(ValueError, match="key_dim"):
        so.KeyedTensor(["p"], [2], torch.zeros(2, 3))


def random_kjt(gen, keys=("a", "b", "c"), stride=4, weighted=True):
    lengths = torch.randint(0, 4, (len(keys) * stride,), generator=gen)
    values = torch.randint(0, 100, (int(lengths.sum()),), generator=gen)
    weights = torch.rand(values.shape, generator=gen) if weighted else None
    return so.KeyedJaggedTensor.from_lengths_sync(list(keys), values, lengths, weights)


def per_key(kjt):
    """{key: (ids, lengths, weights)} by plain Python walking of the lengths (the reference)."""
    out, at, s = {}, 0, kjt.stride()
    lengths = kjt.lengths().tolist()
    for k, key in enumerate(kjt.keys()):
        n = sum(lengths[k * s:(k + 1) * s])
        w = kjt.weights_or_none()
        out[key] = (kjt.values()[at:at + n].tolist(), lengths[k * s:(k + 1) * s],
                    None if w is None else w[at:at + n].tolist())
        at += n
    return out


def test_jagged_batch_methods_against_their_keys(gen):
    """to_dict, [key], offset_per_key, permute, split, concat, to, empty: each key's ids,
    lengths and weights as a plain walk of the lengths finds them."""
    kjt = random_kjt(gen)
    ref = per_key(kjt)
    for key, jt in kjt.to_dict().items():
        assert (jt.values().tolist(), jt.lengths().tolist(), jt.weights().tolist()) == ref[key]
    assert kjt["b"].values().tolist() == ref["b"][0]
    with pytest.raises(KeyError, match="no key 'z'"):
        kjt["z"]
    sizes = [len(ref[k][0]) for k in ("a", "b", "c")]
    assert kjt.offset_per_key() == [0, sizes[0], sizes[0] + sizes[1], sum(sizes)]
    assert kjt.stride_per_key() == [4, 4, 4] and kjt.inverse_indices_or_none() is None
    permuted = kjt.permute([2, 0])
    assert permuted.keys() == ["c", "a"] and per_key(permuted) == {k: ref[k] for k in ("c", "a")}
    first, rest = kjt.split([1, 2])
    assert first.keys() == ["a"] and rest.keys() == ["b", "c"]
    assert per_key(first) == {"a": ref["a"]} and per_key(rest) == {k: ref[k] for k in "bc"}
    joined = so.KeyedJaggedTensor.concat([rest, first])
    assert joined.keys() == ["b", "c", "a"] and per_key(joined) == ref
    with pytest.raises(ValueError, match="one stride"):
        so.KeyedJaggedTensor.concat([kjt, random_kjt(gen, keys=("d",), stride=3)])
    with pytest.raises(ValueError, match="segments"):
        kjt.split([1, 1])
    assert per_key(kjt.to("cpu")) == ref
    empty = so.KeyedJaggedTensor.empty(stride=4)
    assert empty.keys() == [] and empty.values().numel() == 0 and empty.stride() == 4
