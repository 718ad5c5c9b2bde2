"""``Prefetcher(loader, collection)`` and ``prepare_next``: a loader's batches prepared by the
step before theirs. Training through it equals training without it, bit for bit (the
reference: the same collection fed the same batches directly, and the plain nn per-table
reference of test_collection.py is what that one is held to); a bad batch named ahead raises in
its own forward, with nothing written. CPU here; the GPU machine runs the same ("cuda")."""

import pytest
import torch

import speedtorch_ops as so
from conftest import HAS_CUDA, plain

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not HAS_CUDA, reason="the GPU path of prepare_next: the GPU machine"))]


def tables(hashed=False):
    out = [so.TableConfig("a", 50, 4, pooling="sum", feature_names=["f", "g"]),
           so.TableConfig("b", 20, 8, pooling="mean")]
    if hashed:
        out.append(so.TableConfig("h", None, 4, capacity=30))
    return out


def loader(gen, n, hashed=False, bad_at=None):
    keys = ["f", "g", "b"] + (["h"] if hashed else [])
    out = []
    for i in range(n):
        lengths = torch.randint(0, 4, (len(keys) * 5,), generator=gen)
        values = torch.randint(0, 20, (int(lengths.sum()),), generator=gen)
        if i == bad_at and values.numel():
            values[0] = 10_000  # out of every table's range (f reads a's 50 rows)
            lengths[0] = max(int(lengths[0]), 1)
            values = torch.cat([values, torch.zeros(int(lengths.sum()) - values.numel(),
                                                    dtype=values.dtype)])
        kjt = so.KeyedJaggedTensor.from_lengths_sync(keys, values, lengths)
        out.append(kjt.pin_memory() if HAS_CUDA else kjt)
    return out


def make(device, hashed=False):
    torch.manual_seed(0)
    return so.HostEmbeddingBagCollection(tables(hashed), optimizer=torch.optim.Adagrad,
                                         optimizer_kwargs={"lr": 0.1}, device=device,
                                         dtype=torch.float64)


def train(ebc, batches, device):
    losses = []
    for kjt in batches:
        out = plain(ebc(kjt))
        loss = sum((v * torch.arange(v.numel(), device=v.device).view(v.shape)).sum()
                   for v in out.values())
        loss.backward()
        ebc.step()
        losses.append(loss.item())  # a loop that waits for each step
    return losses


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hashed", [False, True])
def test_training_through_a_prefetcher_equals_training_without(device, hashed, gen):
    batches = loader(gen, 6, hashed)
    a, b = make(device, hashed), make(device, hashed)
    assert train(a, so.Prefetcher(batches, a), device) == train(b, batches, device)
    sa, sb = a.state_dict(), b.state_dict()
    for key in sa:
        assert torch.equal(sa[key], sb[key]), (key, gen.initial_seed())
    assert len(so.Prefetcher(batches, a)) == 6


def test_each_forward_after_the_first_takes_the_batch_prepared_ahead(gen):
    """The worker thread prepares each named batch; its forward takes that preparation (a
    hashed collection prepares in the forward)."""
    for hashed in (False, True):
        ebc, ahead, taken = make("cpu", hashed), [], []
        prepare, forward = ebc._prepare, ebc._forward

        def spy_prepare(features, pooling=True, host=False):
            out = prepare(features, pooling, host)
            if host:
                ahead.append(out.at)  # the layout dict: the same object once on the device
            return out

        ebc._prepare = spy_prepare
        ebc._forward = lambda p: taken.append(any(p.at is a for a in ahead)) or forward(p)
        train(ebc, so.Prefetcher(loader(gen, 4, hashed), ebc), "cpu")
        assert taken == ([False] * 4 if hashed else [False, True, True, True])


@pytest.mark.parametrize("device", DEVICES)
def test_a_bad_batch_named_ahead_raises_in_its_own_forward(device, gen):
    batches = loader(gen, 3, bad_at=1)
    ebc = make(device)
    it = iter(so.Prefetcher(batches, ebc))
    train(ebc, [next(it)], device)  # its step() prepared the bad batch: nothing raised there
    before = {k: v.clone() for k, v in ebc.state_dict().items()}
    with pytest.raises(RuntimeError, match="out of range"):
        ebc(next(it))
    for key, value in ebc.state_dict().items():
        assert torch.equal(value, before[key]), key
    train(ebc, [next(it)], device)  # still usable


@pytest.mark.parametrize("device", DEVICES)
def test_another_batch_than_the_one_named_is_prepared_as_usual(device, gen):
    batches = loader(gen, 4)
    a, b = make(device), make(device)
    a.prepare_next(batches[3])
    assert train(a, batches[:3], device) == train(b, batches[:3], device)
    for key, value in a.state_dict().items():
        assert torch.equal(value, b.state_dict()[key]), key


def test_a_prefetcher_needs_a_collection():
    with pytest.raises(TypeError, match="collection"):
        so.Prefetcher([], torch.nn.Linear(2, 2))
