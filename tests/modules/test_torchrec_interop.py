"""TorchRec's own classes beside ours, in one process (the optional extra
requirements-interop.txt, which CI installs; skipped without it): its configs and batches go
into our collections as they are, and the same model trains to the same tables and outputs
through TorchRec's EmbeddingBagCollection / EmbeddingCollection (its plain, unsharded modules,
with torch's optimizers on their dense gradients) and ours."""

import types

import pytest
import torch

import speedtorch_ops as so
from speedtorch_ops.table_config import from_torchrec


def test_configs_that_ask_for_what_has_no_table_here_raise():
    """A TorchRec-like config (duck-typed: runs without TorchRec) converts; fields ours has no
    table for, and non-float data types, raise naming the table and the field."""
    base = dict(name="t", num_embeddings=10, embedding_dim=4, feature_names=["f"],
                data_type=types.SimpleNamespace(value="BF16"),
                pooling=types.SimpleNamespace(value="MEAN"))
    cfg = from_torchrec(types.SimpleNamespace(**base))
    assert (cfg.name, cfg.pooling, cfg.feature_names, cfg.dtype) == \
        ("t", "mean", ("f",), torch.bfloat16)
    with pytest.raises(NotImplementedError, match="'t'.*use_virtual_table"):
        from_torchrec(types.SimpleNamespace(**base, use_virtual_table=True))
    with pytest.raises(TypeError, match="'t'.*data_type"):
        from_torchrec(types.SimpleNamespace(**{**base, "data_type": "INT8"}))


torchrec = pytest.importorskip("torchrec", reason="TorchRec is the optional interop extra "
                                                  "(pip install -r requirements-interop.txt)")
from torchrec.modules.embedding_configs import (EmbeddingBagConfig, EmbeddingConfig,  # noqa: E402
                                                PoolingType)
from torchrec.modules.embedding_modules import (EmbeddingBagCollection,  # noqa: E402
                                                EmbeddingCollection)
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor as TorchRecKJT  # noqa: E402
from torchrec.sparse.jagged_tensor import KeyedTensor as TorchRecKT  # noqa: E402


def batch(keys, rows, gen, stride=4):
    lengths = torch.randint(0, 4, (len(keys) * stride,), generator=gen)
    values = torch.cat([torch.randint(0, rows[k], (int(n),), generator=gen)
                        for k, n in zip(keys, lengths.view(len(keys), stride).sum(1))])
    return TorchRecKJT.from_lengths_sync(keys, values, lengths)


@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.Adagrad])
def test_an_embedding_bag_collection_trains_as_torchrecs(optimizer, gen):
    """SGD and Adagrad leave rows without a gradient as they are, so torch's dense step on
    TorchRec's tables is the lazy step ours takes: outputs and tables agree step by step."""
    configs = [EmbeddingBagConfig(name="a", num_embeddings=50, embedding_dim=8,
                                  feature_names=["f1", "f2"]),
               EmbeddingBagConfig(name="b", num_embeddings=30, embedding_dim=4,
                                  feature_names=["g"], pooling=PoolingType.MEAN)]
    theirs = EmbeddingBagCollection(tables=configs, device=torch.device("cpu"))
    ours = so.HostEmbeddingBagCollection(configs, optimizer=optimizer,
                                         optimizer_kwargs={"lr": 0.1}, device="cpu")
    assert [t.pooling for t in ours.tables] == ["sum", "mean"]
    ours.load_state_dict({f"{t}.weight": theirs.embedding_bags[t].weight.detach()
                          for t in ("a", "b")}, strict=False)
    their_opt = optimizer(theirs.parameters(), lr=0.1)
    rows = {"f1": 50, "f2": 50, "g": 30}
    for _ in range(3):
        kjt = batch(["f1", "f2", "g"], rows, gen)
        kt, ref = ours(kjt), theirs(kjt)
        assert isinstance(kt, so.KeyedTensor) and isinstance(ref, TorchRecKT)
        assert kt.keys() == ref.keys() and kt.offset_per_key() == ref.offset_per_key()
        assert torch.allclose(kt.values(), ref.values(), rtol=1e-6, atol=1e-7)
        target = torch.randn(kt.values().shape, generator=gen)
        for out in (kt.values(), ref.values()):
            ((out - target) ** 2).sum().backward()
        their_opt.step()
        their_opt.zero_grad()
        ours.step()
    for t in ("a", "b"):
        assert torch.allclose(ours.table_weight(t), theirs.embedding_bags[t].weight.detach(),
                              rtol=1e-5, atol=1e-6), t


def test_an_embedding_collection_returns_torchrecs_jagged_rows(gen):
    configs = [EmbeddingConfig(name="t", num_embeddings=40, embedding_dim=6,
                               feature_names=["x", "y"])]
    theirs = EmbeddingCollection(tables=configs, device=torch.device("cpu"))
    ours = so.HostEmbeddingCollection(configs, optimizer=torch.optim.SGD,
                                      optimizer_kwargs={"lr": 0.1}, device="cpu")
    ours.load_state_dict({"t.weight": theirs.embeddings["t"].weight.detach()}, strict=False)
    kjt = batch(["x", "y"], {"x": 40, "y": 40}, gen)
    out, ref = ours(kjt), theirs(kjt)
    assert set(out) == set(ref) == {"x", "y"}
    for key in ("x", "y"):
        assert torch.equal(out[key].values(), ref[key].values())
        assert torch.equal(out[key].lengths(), ref[key].lengths())
        assert torch.equal(out[key].offsets(), ref[key].offsets())


def test_torchrecs_initialisation_is_kept(gen):
    """A TorchRec config's init_fn initialises our table as it does TorchRec's (uniform in
    +-1/sqrt(rows) by default)."""
    config = EmbeddingBagConfig(name="a", num_embeddings=400, embedding_dim=8,
                                feature_names=["f"])
    ours = so.HostEmbeddingBagCollection([config], optimizer=torch.optim.SGD,
                                         optimizer_kwargs={"lr": 0.1}, device="cpu")
    weight, bound = ours.table_weight("a"), 400 ** -0.5
    assert weight.abs().max() <= bound and weight.abs().max() > 0.9 * bound
    assert abs(float(weight.mean())) < 0.1 * bound


def test_our_batches_run_torchrecs_collections(gen):
    """speedtorch_ops.KeyedJaggedTensor into TorchRec's EmbeddingBagCollection (weighted) and
    EmbeddingCollection: the outputs TorchRec's own batch of the same ids gives; its methods
    agree with TorchRec's."""
    bags = EmbeddingBagCollection(tables=[EmbeddingBagConfig(
        name="a", num_embeddings=50, embedding_dim=8, feature_names=["f1", "f2"])],
        is_weighted=True, device=torch.device("cpu"))
    rows = EmbeddingCollection(tables=[EmbeddingConfig(
        name="t", num_embeddings=50, embedding_dim=4, feature_names=["f1", "f2"])],
        device=torch.device("cpu"))
    theirs = batch(["f1", "f2"], {"f1": 50, "f2": 50}, gen)
    weights = torch.rand(theirs.values().shape, generator=gen)
    theirs = TorchRecKJT.from_lengths_sync(["f1", "f2"], theirs.values(), theirs.lengths(),
                                           weights)
    ours = so.KeyedJaggedTensor.from_lengths_sync(["f1", "f2"], theirs.values(),
                                                  theirs.lengths(), weights)
    assert torch.equal(bags(ours).values(), bags(theirs).values())
    got, want = rows(ours), rows(theirs)
    assert all(torch.equal(got[k].values(), want[k].values()) for k in ("f1", "f2"))
    assert ours.offset_per_key() == theirs.offset_per_key()
    for key in ("f1", "f2"):
        for method in ("values", "lengths", "offsets", "weights"):
            assert torch.equal(getattr(ours[key], method)(), getattr(theirs[key], method)())
    for a, b in ((ours.permute([1, 0]), theirs.permute([1, 0])),
                 (ours.split([1, 1])[1], theirs.split([1, 1])[1])):
        assert a.keys() == b.keys() and torch.equal(a.values(), b.values())
        assert torch.equal(a.lengths(), b.lengths()) and torch.equal(a.weights(), b.weights())
