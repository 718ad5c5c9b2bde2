"""What each rank runs in the tests of ShardedHostEmbeddingBagCollection, against the
single-process HostEmbeddingBagCollection on the CPU in float64, trained on every rank's batch
concatenated (keys in order, each key's samples rank after rank) with the ranks' losses summed.
Every rank draws every rank's batch from (seed, step, rank), so each runs the reference itself."""

import torch

from speedtorch_ops import (HostEmbeddingBagCollection, KeyedJaggedTensor, PartialRowWiseAdam,
                            RowWiseAdagrad, TableConfig, clip_grad_norm_, count_parameters)
from speedtorch_ops.distributed import ShardedHostEmbeddingBagCollection

from conftest import plain

F64 = torch.float64
OPTIMIZERS = {
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01}),
    "Adam": (torch.optim.Adam, {"lr": 0.05}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1}),
    "RowWiseAdagrad": (RowWiseAdagrad, {"lr": 0.1}),
    "PartialRowWiseAdam": (PartialRowWiseAdam, {"lr": 0.05}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5}),  # torch's own step
}
# 37 and 23 rows: divisible by none of 2, 3, 4; one table of 2 rows (a rank owns none at 3
# and 4 ranks); two widths; a table read by two features; every pooling.
TABLES = [TableConfig("a", 37, 5, pooling="sum", feature_names=["fa", "fa2"]),
          TableConfig("b", 23, 5, pooling="mean"),
          TableConfig("c", 2, 5, pooling="none"),
          TableConfig("d", 23, 3, pooling="none")]
WEIGHTED = [TableConfig("a", 37, 5, pooling="sum"), TableConfig("c", 29, 4, pooling="none")]


def batch(tables, seed, step, rank, stride, empty=False, weighted=False):
    """(keys, values, lengths, weights): each feature's bags of 0-3 ids (none at all when
    `empty`), a hot id in every rank's first bag of the first feature."""
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    keys, values, lengths = [], [], []
    for t in tables:
        for f in t.feature_names:
            lens = torch.zeros(stride, dtype=torch.int64) if empty else \
                torch.randint(0, 4, (stride,), generator=g)
            ids = torch.randint(0, t.num_embeddings, (int(lens.sum()),), generator=g)
            if len(keys) == 0 and len(ids):
                ids[0] = 1
            keys.append(f)
            values.append(ids)
            lengths.append(lens)
    weights = [torch.rand(len(v), dtype=F64, generator=g) for v in values] if weighted else None
    return keys, values, lengths, weights


def kjt(b, device):
    keys, values, lengths, weights = b
    return KeyedJaggedTensor.from_lengths_sync(
        keys, torch.cat(values).to(device), torch.cat(lengths).to(device),
        weights=torch.cat(weights).to(device) if weights is not None else None)


def concatenated(batches):
    """The ranks' batches as one: each key's samples rank after rank."""
    keys = batches[0][0]
    values = [torch.cat([b[1][i] for b in batches]) for i in range(len(keys))]
    lengths = [torch.cat([b[2][i] for b in batches]) for i in range(len(keys))]
    weights = None if batches[0][3] is None else \
        [torch.cat([b[3][i] for b in batches]) for i in range(len(keys))]
    return keys, values, lengths, weights


def targets(tables, b, seed, step, rank):
    """A random target per feature in the shape the collection returns for batch `b`."""
    g = torch.Generator().manual_seed(seed * 7 + step * 10 + rank)
    keys, values, lengths, _ = b
    out = {}
    for t in tables:
        for f in t.feature_names:
            i = keys.index(f)
            n = len(values[i]) if t.pooling == "none" else len(lengths[i])
            out[f] = torch.randn(n, t.embedding_dim, dtype=F64, generator=g)
    return out


def loss_of(out, target):
    return sum(((out[f] * target[f].to(out[f].device)).sum(-1) - 0.5).pow(2).sum()
               for f in sorted(out))


def like_one_process(rank, world, device, seed, names, weighted=False, grad_scale=1.0,
                     cache_bytes=0, exchange="auto"):
    """Every optimizer of `names`: 3 steps of the sharded collection equal to the reference
    step for step (outputs, then the whole tables and state by gather_state_dict), an empty
    batch on the last rank at step 1; the sharded one starts from the reference's state_dict
    (whole tables: each rank keeps its rows)."""
    tables = WEIGHTED if weighted else TABLES
    for name in names:
        cls, kwargs = OPTIMIZERS[name]
        torch.manual_seed(seed)
        ref = HostEmbeddingBagCollection(tables, optimizer=cls, optimizer_kwargs=kwargs,
                                         device="cpu", dtype=F64, is_weighted=weighted)
        sharded = ShardedHostEmbeddingBagCollection(tables, optimizer=cls, optimizer_kwargs=kwargs,
                                                    device=device, dtype=F64, grad_scale=grad_scale,
                                                    cache_bytes=cache_bytes, exchange=exchange,
                                                    is_weighted=weighted)
        sharded.load_state_dict(ref.state_dict())
        for step in range(3):
            batches = [batch(tables, seed, step, r, 2 + r, empty=step == 1 and r == world - 1,
                             weighted=weighted) for r in range(world)]
            goals = [targets(tables, b, seed, step, r) for r, b in enumerate(batches)]
            out = plain(sharded(kjt(batches[rank], device)))
            if step == 0:  # the next batch's rows ahead: changes nothing but when rows load
                nxt = batch(tables, seed, 1, rank, 2 + rank, empty=rank == world - 1,
                            weighted=weighted)
                sharded.prefetch(kjt(nxt, device))
            loss_of(out, goals[rank]).backward()
            sharded.step()
            ref_out = plain(ref(kjt(concatenated(batches), "cpu")))
            for f, o in out.items():  # this rank's rows of the reference's output
                at = sum(len(goals[r][f]) for r in range(rank))
                assert torch.allclose(o.detach().cpu(), ref_out[f][at:at + len(o)].detach(),
                                      rtol=1e-10, atol=1e-12), (name, step, f, seed)
            (loss_of(ref_out, {f: torch.cat([t[f] for t in goals]) for f in ref_out})
             * grad_scale).backward()
            ref.step()
            assert_same_state(sharded, ref, (name, step, seed))
        sharded.eval()  # a read: the reference's rows, nothing written, no step
        ref.eval()
        batches = [batch(tables, seed, 9, r, 2, weighted=weighted) for r in range(world)]
        with torch.no_grad():
            out = plain(sharded(kjt(batches[rank], device)))
            ref_out = plain(ref(kjt(concatenated(batches), "cpu")))
        goals = [targets(tables, b, seed, 9, r) for r, b in enumerate(batches)]
        for f, o in out.items():
            at = sum(len(goals[r][f]) for r in range(rank))
            # allclose: torch's CPU embedding_bag sums a strided weight (rows packed with
            # per-row state) in another order than contiguous rows
            assert torch.allclose(o.cpu(), ref_out[f][at:at + len(o)], rtol=1e-12,
                                  atol=1e-14), (name, "eval", f, seed)
        assert_same_state(sharded, ref, (name, "after eval", seed))


def assert_same_state(sharded, ref, msg):
    got, want = sharded.gather_state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want), (msg, sorted(got), sorted(want))
    for key, value in want.items():
        assert torch.allclose(got[key].cpu().to(value.dtype), value, rtol=1e-9, atol=1e-11), \
            (msg, key)


def bad_input_raises_everywhere(rank, world, device, seed, exchange="auto"):
    """An id out of range on the last rank, then a missing feature on rank 0: every rank raises
    (the bad rank naming the feature and the id), nothing is written, and the next good step
    equals the reference."""
    cls, kwargs = OPTIMIZERS["Adam"]
    ref = HostEmbeddingBagCollection(TABLES, optimizer=cls, optimizer_kwargs=kwargs,
                                     device="cpu", dtype=F64)
    sharded = ShardedHostEmbeddingBagCollection(TABLES, optimizer=cls, optimizer_kwargs=kwargs,
                                                device=device, dtype=F64, exchange=exchange)
    sharded.load_state_dict(ref.state_dict())
    before = sharded.gather_state_dict()
    b = batch(TABLES, seed, 0, rank, 3)
    if rank == world - 1:
        if len(b[1][1]) == 0:  # feature fa2 drew no ids: give its first bag one
            b[1][1], b[2][1][0] = torch.zeros(1, dtype=torch.int64), 1
        b[1][1][0] = 37  # feature fa2 of table a (37 rows)
    try:
        sharded(kjt(b, device))
    except RuntimeError as e:
        msg = str(e)
        if rank == world - 1:
            assert "'fa2'" in msg and "37" in msg, msg
        else:
            assert f"rank(s) [{world - 1}]" in msg, msg
    else:
        raise AssertionError("no error")
    keys, values, lengths, weights = batch(TABLES, seed, 0, rank, 3)
    if rank == 0:
        keys, values, lengths = keys[1:], values[1:], lengths[1:]
    try:
        sharded(kjt((keys, values, lengths, weights), device))
    except (KeyError, RuntimeError) as e:
        assert ("'fa'" in str(e)) if rank == 0 else "rank(s) [0]" in str(e), str(e)
    else:
        raise AssertionError("no error")
    if rank == 0:  # a read on one rank while the others train: every rank raises
        sharded.eval()
    try:
        sharded(kjt(batch(TABLES, seed, 0, rank, 3), device))
    except RuntimeError as e:
        assert "disagree" in str(e), str(e)
    else:
        raise AssertionError("no error")
    sharded.train()
    after = sharded.gather_state_dict()
    for key, value in before.items():
        assert torch.equal(after[key], value), key
    # A backward of an output whose step is over raises (nothing else notices it).
    stale = plain(sharded(kjt(batch(TABLES, seed, 5, rank, 2), device)))
    sharded.discard()
    try:
        loss_of(stale, targets(TABLES, batch(TABLES, seed, 5, rank, 2), seed, 5, rank)).backward()
    except RuntimeError as e:
        assert "whose step is over" in str(e), str(e)
    else:
        raise AssertionError("no error")
    # The tables count whole; clipping cannot see gradients that reach the owners in step().
    assert count_parameters(sharded) == sum(t.num_embeddings * t.embedding_dim for t in TABLES)
    try:
        clip_grad_norm_(sharded, 1.0)
    except ValueError as e:
        assert "sharded" in str(e), str(e)
    else:
        raise AssertionError("no error")
    batches = [batch(TABLES, seed, 1, r, 2) for r in range(world)]
    goals = [targets(TABLES, b, seed, 1, r) for r, b in enumerate(batches)]
    out = plain(sharded(kjt(batches[rank], device)))
    loss_of(out, goals[rank]).backward()
    sharded.step()
    ref_out = plain(ref(kjt(concatenated(batches), "cpu")))
    loss_of(ref_out, {f: torch.cat([t[f] for t in goals]) for f in ref_out}).backward()
    ref.step()
    assert_same_state(sharded, ref, ("after the errors", seed))


def captured_equals_eager(rank, world, device, seed, exchange):
    """On GPUs (NCCL): the step captured whole by CapturedStep (collectives, caches that evict
    every step, the fused Adam) trains bit for bit as the eager step on the same batches; a bad
    id on one rank makes every rank raise before the replay, and the replays go on after it.
    The eager modules train first, then the captured one: their exchanges never interleave
    (docs/decisions.md, "A sharded step of fixed shapes", says what hung and when)."""
    from speedtorch_ops import CapturedStep
    tables = [TableConfig("a", 4001, 32, pooling="sum"), TableConfig("b", 997, 32, pooling="none")]
    kwargs = dict(optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.05, "capturable": True},
                  device=device, cache_bytes=200 * 32 * 4 * 3, bounds_check="prechecked",
                  exchange=exchange)
    eager = ShardedHostEmbeddingBagCollection(tables, **kwargs)
    start = eager.gather_state_dict()
    stride, per_bag = 64 + 16 * rank, 3

    def draw(step):
        g = torch.Generator().manual_seed(seed * 100 + step * 10 + rank)
        a = (torch.rand(stride * per_bag, generator=g) ** 3 * 4001).long()  # hot low ids
        b = torch.randint(0, 997, (stride,), generator=g)
        return a, b

    def train(module, a, b):
        values = torch.cat([a, b])
        lengths = torch.cat([torch.full((stride,), per_bag, device=device),
                             torch.ones(stride, dtype=torch.int64, device=device)])
        out = plain(module(KeyedJaggedTensor("a b".split(), values, lengths=lengths,
                                             length_per_key=[len(a), len(b)])))
        loss = (out["a"].pow(2).sum(1) - out["b"].sum(1)).pow(2).mean()
        loss.backward()
        module.step()
        return loss.detach()

    steps = [i for i in range(11) if i != 8]  # step 8: a bad id on the last rank
    losses = [train(eager, *(x.to(device) for x in draw(i))) for i in steps]
    want = eager.gather_state_dict()
    del eager
    # The eager step is reproducible, on the default stream and on a side stream (where
    # CapturedStep runs its warm-up calls): a difference below is then the capture's.
    for side in (None, torch.cuda.Stream(device)):
        again = ShardedHostEmbeddingBagCollection(tables, **kwargs)
        again.load_state_dict(start)
        for i, loss in zip(steps, losses):
            if side is None:
                got = train(again, *(x.to(device) for x in draw(i)))
            else:
                side.wait_stream(torch.cuda.current_stream(device))
                with torch.cuda.stream(side):
                    got = train(again, *(x.to(device) for x in draw(i)))
                torch.cuda.current_stream(device).wait_stream(side)
            assert torch.equal(got, loss), ("eager again", side is not None, i, float(got),
                                            float(loss), seed)
        del again
    captured = ShardedHostEmbeddingBagCollection(tables, **kwargs)
    captured.load_state_dict(start)
    step = CapturedStep(lambda a, b: train(captured, a, b), rows=(4001, 997),
                        group=captured.route_group)
    for i, loss in zip(steps, losses):
        if i == 8 + 1:
            a, b = draw(8)
            if rank == world - 1:
                a[5] = 4001
            try:
                step(a, b)
            except RuntimeError as e:
                assert ("4001" in str(e)) if rank == world - 1 else \
                    f"rank(s) [{world - 1}]" in str(e), str(e)
            else:
                raise AssertionError("no error")
        got = step(*draw(i))
        assert torch.equal(got, loss), ("captured", i, step.calls, float(got), float(loss),
                                        seed)
    got = captured.gather_state_dict()
    for key, value in want.items():
        assert torch.equal(got[key], value), (key, seed)
    stats = captured.cache_stats()["total"]
    assert 0 < stats["hits"] < stats["lookups"], stats  # the cache served some, evicted others


def _reference(seed, schedule, steps):
    """The single-process collection after `steps` of `schedule` (the world size of each
    step: its batch is that many ranks' batches concatenated)."""
    cls, kwargs = OPTIMIZERS["AdamW-amsgrad"]
    torch.manual_seed(seed)
    ref = HostEmbeddingBagCollection(TABLES, optimizer=cls, optimizer_kwargs=kwargs,
                                     device="cpu", dtype=F64)
    for step in steps:
        batches = [batch(TABLES, seed, step, r, 2 + r) for r in range(schedule[step])]
        goals = [targets(TABLES, b, seed, step, r) for r, b in enumerate(batches)]
        out = plain(ref(kjt(concatenated(batches), "cpu")))
        loss_of(out, {f: torch.cat([t[f] for t in goals]) for f in out}).backward()
        ref.step()
    return ref


def checkpoint_phase(rank, world, device, seed, schedule, load_from, save_to, steps):
    """Steps `steps` of `schedule` at this world size, starting from the reference's first
    state (load_from None) or from the files a phase at another world size saved; then saves.
    Each step's whole tables equal the reference's."""
    cls, kwargs = OPTIMIZERS["AdamW-amsgrad"]
    sharded = ShardedHostEmbeddingBagCollection(TABLES, optimizer=cls, optimizer_kwargs=kwargs,
                                                device=device, dtype=F64)
    if load_from is None:
        sharded.load_state_dict(_reference(seed, schedule, []).state_dict())
    else:
        sharded.load_shards(load_from)
        assert_same_state(sharded, _reference(seed, schedule, range(steps[0])),
                          ("loaded", world, seed))
    for step in steps:
        assert schedule[step] == world
        batches = [batch(TABLES, seed, step, r, 2 + r) for r in range(world)]
        goals = [targets(TABLES, b, seed, step, r) for r, b in enumerate(batches)]
        out = plain(sharded(kjt(batches[rank], device)))
        loss_of(out, goals[rank]).backward()
        sharded.step()
    assert_same_state(sharded, _reference(seed, schedule, range(steps[-1] + 1)),
                      ("trained", world, seed))
    if save_to is not None:
        sharded.save_shards(save_to)


def bad_checkpoints_raise(rank, world, device, directory):
    """A checkpoint of other tables, or of another optimizer's state, raises naming what
    differs and loads nothing."""
    tables = [TableConfig("a", 37, 5, pooling="sum"), TableConfig("b", 23, 3, pooling="none")]
    adam = ShardedHostEmbeddingBagCollection(tables, optimizer=torch.optim.Adam, device=device,
                                             dtype=F64)
    adam.save_shards(directory)
    sgd = ShardedHostEmbeddingBagCollection(tables, optimizer=torch.optim.SGD,
                                            optimizer_kwargs={"lr": 0.1, "momentum": 0.9},
                                            device=device, dtype=F64)
    before = sgd.gather_state_dict()
    try:
        sgd.load_shards(directory)
    except ValueError as e:
        assert "momentum_buffer" in str(e) and "exp_avg" in str(e), str(e)
    else:
        raise AssertionError("no error")
    other = ShardedHostEmbeddingBagCollection(tables[:1], optimizer=torch.optim.Adam, device=device,
                                              dtype=F64)
    try:
        other.load_shards(directory)
    except ValueError as e:
        assert "'b'" in str(e), str(e)
    else:
        raise AssertionError("no error")
    after = sgd.gather_state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def bad_exchange_raises(rank, world, device):
    """exchange='peer' needs NCCL GPUs of one host: on gloo it raises naming the argument on
    every rank (each decides alike, so none is left waiting); an unknown exchange raises."""
    import pytest
    for exchange, message in (("peer", "exchange='peer' needs"), ("ring", "exchange must be")):
        with pytest.raises(ValueError, match=message):
            ShardedHostEmbeddingBagCollection(TABLES, optimizer=torch.optim.Adam, device=device,
                                              exchange=exchange)
    ok = ShardedHostEmbeddingBagCollection(TABLES, optimizer=torch.optim.Adam, device=device,
                                           exchange="collective")  # the group goes on working
    assert ok._peer is None
