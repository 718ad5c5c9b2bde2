"""torch.distributed.checkpoint's state-dict helpers on the collections: get_model_state_dict,
get_state_dict and set_model_state_dict walk each key's dotted names as attributes, and a
collection's keys name its tables (``<table>.weight``, ``<table>.optimizer.<state>``). The
helpers need no process group for these calls; the reference is the module's own
``state_dict()``, and a model loaded through them trains on exactly as the saved one."""

import copy

import pytest
import torch

import speedtorch_ops as so

from conftest import plain

helpers = pytest.importorskip("torch.distributed.checkpoint.state_dict")

OPTIMIZERS = {
    "Adam": (torch.optim.Adam, {"lr": 0.05}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
}


def configs(dtype):
    return [so.TableConfig("user", 30, 4, feature_names=["u1", "u2"]),
            so.TableConfig("item", 20, 6, pooling="mean", dtype=dtype),
            so.TableConfig("tag", 25, 4)]


class Model(torch.nn.Module):
    """A collection and a dense head, the collection under a prefix (``ebc.``)."""

    def __init__(self, cls, optimizer, dtype):
        super().__init__()
        opt, kwargs = OPTIMIZERS[optimizer]
        self.ebc = cls(configs(dtype), optimizer=opt, optimizer_kwargs=kwargs, device="cpu",
                       dtype=torch.float64)
        self.head = torch.nn.Linear(4, 1, dtype=torch.float64)

    def forward(self, kjt):
        out = plain(self.ebc(kjt))
        return sum(v.to(torch.float64).sum() for v in out.values()) + \
            self.head(out["u1"].to(torch.float64)).sum()


def batch(gen):
    keys, lengths, values = ["u1", "u2", "item", "tag"], [], []
    for rows in (30, 30, 20, 25):
        ls = torch.randint(1, 4, (3,), generator=gen)
        lengths.append(ls)
        values.append(torch.randint(0, rows, (int(ls.sum()),), generator=gen))
    return so.KeyedJaggedTensor.from_lengths_sync(keys, torch.cat(values), torch.cat(lengths))


def train(model, dense, kjt):
    loss = model(kjt)
    loss.backward()
    model.ebc.step()
    dense.step()
    dense.zero_grad()
    return float(loss.detach())


@pytest.mark.parametrize("cls", [so.HostEmbeddingBagCollection, so.HostEmbeddingCollection])
@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16], ids=["f64", "bf16"])
def test_dcp_state_dict_helpers_work_on_a_collection(cls, optimizer, dtype, gen):
    if cls is so.HostEmbeddingCollection:
        optimizer = "Adam"  # the keys' walk does not depend on pooling
    model = Model(cls, optimizer, dtype)
    dense = torch.optim.Adam(model.head.parameters())
    train(model, dense, batch(gen))
    own = model.state_dict()
    sd = helpers.get_model_state_dict(model)
    assert set(sd) == set(own) and any(k.startswith("ebc.item.optimizer.") for k in sd)
    for key, value in own.items():
        assert torch.equal(sd[key], value), key
    model_sd, optim_sd = helpers.get_state_dict(model, dense)
    assert set(model_sd) == set(own) and optim_sd["state"]

    other = Model(cls, optimizer, dtype)
    other_dense = torch.optim.Adam(other.head.parameters())
    # Copies: the helpers load the dense optimizer's state by reference.
    helpers.set_state_dict(other, other_dense, model_state_dict=copy.deepcopy(sd),
                           optim_state_dict=copy.deepcopy(optim_sd))
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key
    nxt = batch(gen)
    assert train(other, other_dense, nxt) == train(model, dense, nxt)
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


def test_dcp_get_model_state_dict_on_the_collection_itself(gen):
    ebc = so.HostEmbeddingBagCollection(configs(torch.float32), device="cpu")
    ebc(batch(gen))["tag"].sum().backward()
    ebc.step()
    sd = helpers.get_model_state_dict(ebc)
    assert sorted(sd) == sorted(ebc.state_dict())
    assert torch.equal(sd["tag.weight"], ebc.table_weight("tag"))
    fresh = so.HostEmbeddingBagCollection(configs(torch.float32), device="cpu")
    helpers.set_model_state_dict(fresh, {k: v.clone() for k, v in sd.items()})
    for key, value in ebc.state_dict().items():
        assert torch.equal(fresh.state_dict()[key], value), key
