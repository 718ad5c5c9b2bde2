"""What each rank runs in the sharded tests, against the single-process reference: HostEmbedding
(or HostEmbeddingBag) on the CPU, float64, trained on the concatenation of all ranks' batches
with the sum of their losses (times grad_scale). Every rank computes every rank's batch from
(seed, step, rank, world), so each can run the reference itself."""

import pytest
import torch
import torch.distributed as dist

from speedtorch_ops import HostEmbedding, HostEmbeddingBag, PartialRowWiseAdam, RowWiseAdagrad
from speedtorch_ops.distributed import (ShardedEmbeddingDict, ShardedHostEmbedding,
                                        ShardedHostEmbeddingBag, exchange, full_state_dict)

ROWS, DIM, HOT = 37, 5, 7  # 37 is divisible by none of 2, 3, 4; an odd dimension
OPTIMIZERS = {
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "Adam": (torch.optim.Adam, {"lr": 0.05}),
    "AdamW-amsgrad": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1, "amsgrad": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    # Its accumulator is packed beside the weight in a row (one part per row, not 1 + states).
    "RowWiseAdagrad": (RowWiseAdagrad, {"lr": 0.1, "initial_accumulator_value": 0.1}),
    # Its second moment is packed beside the weight too, its first moment a part of its own.
    "PartialRowWiseAdam": (PartialRowWiseAdam, {"lr": 0.05, "weight_decay": 0.1}),
}
F64 = torch.float64


def initial_table(seed, rows=ROWS):
    return torch.randn(rows, DIM, dtype=F64, generator=torch.Generator().manual_seed(seed))


def batch(seed, step, rank, world, rows=ROWS, empty_rank=None):
    """(ids, target) of `rank` at `step`: sizes differ by rank, ids repeat within and across
    ranks, the hot id is in every rank's batch; `empty_rank` gets nothing."""
    g = torch.Generator().manual_seed(seed * 1000 + step * 10 + rank)
    n = 0 if rank == empty_rank else 2 + rank
    ids = torch.randint(0, rows, (n, 3), generator=g)
    if n:
        ids[0, 0] = HOT % rows
    return ids, torch.randn(n, 3, DIM, dtype=F64, generator=g)


def loss_of(out, target):
    return ((out * target).sum(-1) - 1.0).pow(2).sum()


def assert_same_state(sharded, ref, msg):
    got, want = sharded.gather_state_dict(), ref.state_dict()
    assert sorted(got) == sorted(want), msg
    for key, value in want.items():
        assert torch.allclose(got[key].cpu().to(value.dtype), value.cpu(), rtol=1e-10,
                              atol=1e-12), (msg, key)


def reference_step(ref, batches, grad_scale=1.0):
    outs = ref(*[ids for ids, _ in batches])
    outs = outs if len(batches) > 1 else (outs,)
    (sum(loss_of(o, t) for o, (_, t) in zip(outs, batches)) * grad_scale).backward()
    ref.step()


def train_like_one_process(rank, world, device, seed, names, grad_scale=1.0, own_route=False,
                           steps=3):
    """Every optimizer in `names`: step for step equal to the reference, with an empty batch on
    the last rank at step 1; with `own_route`, ids travel on a group of their own."""
    init = initial_table(seed)
    route_group = dist.new_group(backend="gloo") if own_route else None
    for name in names:
        cls, kwargs = OPTIMIZERS[name]
        emb = ShardedHostEmbedding.from_pretrained(init, optimizer=cls, optimizer_kwargs=kwargs,
                                                   device=device, grad_scale=grad_scale,
                                                   route_group=route_group)
        ref = HostEmbedding.from_pretrained(init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                            device="cpu")
        for step in range(steps):
            empty = world - 1 if step == 1 else None
            batches = [batch(seed, step, r, world, empty_rank=empty) for r in range(world)]
            ids, target = batches[rank]
            out = emb(ids.to(device))
            assert out.shape == (*ids.shape, DIM)
            loss_of(out, target.to(device)).backward()
            emb.step()
            reference_step(ref, batches, grad_scale)
            assert_same_state(emb, ref, f"{name} step {step} world {world} seed {seed}")
        assert torch.allclose(emb.gather_weight(), ref.weight, rtol=1e-10, atol=1e-12)


def bfloat16_tracks_float64(rank, world, device, seed, state_dtype=None, steps=3):
    """bfloat16 shards (stochastic rounding on, their default) against one process training
    the same start in float64: each weight within a few bfloat16 roundings of its row's scale
    a step; the gathered state keeps its dtype (`state_dtype`, a name; None: bfloat16) and
    each rank's rounding entries."""
    init = initial_table(seed).to(torch.bfloat16)
    cls, kwargs = OPTIMIZERS["SGD-momentum"]
    state = torch.bfloat16 if state_dtype is None else getattr(torch, state_dtype)
    emb = ShardedHostEmbedding.from_pretrained(init, optimizer=cls, optimizer_kwargs=kwargs,
                                               device=device, state_dtype=state_dtype)
    assert emb.shard.stochastic_rounding and emb.state_dtype == state
    ref = HostEmbedding.from_pretrained(init.double(), freeze=False, optimizer=cls,
                                        optimizer_kwargs=kwargs, device="cpu")
    for step in range(steps):
        batches = [batch(seed, step, r, world) for r in range(world)]
        ids, target = batches[rank]
        loss_of(emb(ids.to(device)).double(), target.to(device)).backward()
        emb.step()
        reference_step(ref, batches)
    got = emb.gather_state_dict()
    assert got["weight"].dtype == torch.bfloat16
    assert got["optimizer.momentum_buffer"].dtype == state
    assert int(got["optimizer.rounding_counter"]) == steps
    want = ref.weight
    scale = want.abs().amax(1, keepdim=True).clamp(min=1)
    err = float(((got["weight"].cpu().double() - want) / scale).abs().max())
    assert err <= steps * 16 * 2.0**-8, (err, world, seed)


def bag_like_one_process(rank, world, device, seed, directory):
    """The bag variant (mean of fixed-length bags) against HostEmbeddingBag on the
    concatenated bags, saved and loaded; also two id tensors in one forward of the plain
    variant, a read-only forward, bad constructor arguments."""
    init = initial_table(seed)
    cls, kwargs = OPTIMIZERS["Adam"]
    emb = ShardedHostEmbeddingBag.from_pretrained(init, mode="mean", optimizer=cls,
                                                  optimizer_kwargs=kwargs, device=device)
    ref = HostEmbeddingBag.from_pretrained(init, freeze=False, mode="mean", optimizer=cls,
                                           optimizer_kwargs=kwargs, device="cpu")
    for step in range(2):
        batches = [batch(seed, step, r, world) for r in range(world)]
        ids, target = batches[rank]
        loss_of(emb(ids.to(device)), target[:, 0].to(device)).backward()
        emb.step()
        outs = ref(torch.cat([i for i, _ in batches])).split([len(i) for i, _ in batches])
        sum(loss_of(o, t[:, 0]) for o, (_, t) in zip(outs, batches)).backward()
        ref.step()
        assert_same_state(emb, ref, f"bag step {step} world {world} seed {seed}")
    emb.save(directory)
    loaded = ShardedHostEmbeddingBag.load(directory, device=device)
    assert loaded.mode == "mean" and loaded.steps == 2
    assert_same_state(loaded, ref, f"bag loaded, world {world} seed {seed}")
    two = ShardedHostEmbedding.from_pretrained(init, optimizer=cls, optimizer_kwargs=kwargs,
                                               device=device)
    a, b = batch(seed, 5, rank, world)[0], batch(seed, 6, rank, world)[0][:1]
    out_a, out_b = two(a.to(device), b.to(device))
    assert out_a.shape == (*a.shape, DIM) and out_b.shape == (*b.shape, DIM)
    assert torch.equal(out_b.cpu(), init[b])
    two.step()
    with torch.no_grad():  # a read-only forward: nothing staged, no step to take
        out = two(b.to(device))
    with pytest.raises(RuntimeError, match="no forward"):
        two.step()
    assert torch.equal(out.cpu(), two.gather_weight()[b])
    # A packed row layout (RowWiseAdagrad) saved and loaded: sharded and single-process.
    cls, kwargs = OPTIMIZERS["RowWiseAdagrad"]
    packed = ShardedHostEmbedding.from_pretrained(init, optimizer=cls, optimizer_kwargs=kwargs,
                                                  device=device)
    ref = HostEmbedding.from_pretrained(init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                        device="cpu")
    batches = [batch(seed, 7, r, world) for r in range(world)]
    loss_of(packed(batches[rank][0].to(device)), batches[rank][1].to(device)).backward()
    packed.step()
    reference_step(ref, batches)
    packed.save(directory + "-packed")
    loaded = ShardedHostEmbedding.load(directory + "-packed", device=device)
    assert type(loaded.optimizer) is cls
    assert_same_state(loaded, ref, f"packed rows loaded, world {world} seed {seed}")
    single = HostEmbedding(ROWS, DIM, dtype=F64, optimizer=cls, optimizer_kwargs=kwargs)
    single.load_state_dict(full_state_dict(directory + "-packed"))
    for key, value in ref.state_dict().items():
        assert torch.allclose(single.state_dict()[key], value, rtol=1e-10, atol=1e-12), key
    with pytest.raises(ValueError, match="grad_scale"):
        ShardedHostEmbedding(ROWS, DIM, grad_scale=float("nan"))
    with pytest.raises(ValueError, match="num_embeddings"):
        ShardedHostEmbedding(0, DIM)


def checkpoint_phase(rank, world, device, seed, schedule, load_from, save_to, steps):
    """Load from `load_from` (or start from the initial table), train `steps` (a range of step
    numbers) comparing with an uninterrupted reference, save to `save_to`."""
    init = initial_table(seed)
    cls, kwargs = OPTIMIZERS["AdamW-amsgrad"]
    if load_from is None:
        emb = ShardedHostEmbedding.from_pretrained(init, optimizer=cls, optimizer_kwargs=kwargs,
                                                   device=device)
    else:
        emb = ShardedHostEmbedding.load(load_from, device=device)
    assert type(emb.optimizer) is cls and emb.optimizer.param_groups[0]["amsgrad"]
    ref = uninterrupted(seed, schedule, steps.start)
    assert_same_state(emb, ref, f"after load from {load_from}, world {world}")
    for step in steps:
        ids, target = batch(seed, step, rank, world)
        loss_of(emb(ids.to(device)), target.to(device)).backward()
        emb.step()
        reference_step(ref, [batch(seed, step, r, world) for r in range(world)])
        assert_same_state(emb, ref, f"step {step} world {world} seed {seed}")
    if save_to is not None:
        emb.save(save_to)


def uninterrupted(seed, schedule, steps):
    """The reference after `steps` steps; step s was trained by schedule[s] ranks (a step's
    batches are the same whatever its split, so the reference needs only the schedule)."""
    cls, kwargs = OPTIMIZERS["AdamW-amsgrad"]
    ref = HostEmbedding.from_pretrained(initial_table(seed), freeze=False, optimizer=cls,
                                        optimizer_kwargs=kwargs, device="cpu")
    for step in range(steps):
        world = schedule[step]
        reference_step(ref, [batch(seed, step, r, world) for r in range(world)])
    return ref


def bad_ids_raise_everywhere(rank, world, device, seed):
    """A bad id on one rank (and a non-integer id tensor on another) makes every rank raise,
    nothing is written, and training goes on; a world larger than the table works."""
    init = initial_table(seed)
    cls, kwargs = OPTIMIZERS["Adam"]
    emb = ShardedHostEmbedding.from_pretrained(init, optimizer=cls, optimizer_kwargs=kwargs,
                                               device=device)
    ref = HostEmbedding.from_pretrained(init, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                        device="cpu")
    reference_step(ref, [batch(seed, 0, r, world) for r in range(world)])
    ids, target = batch(seed, 0, rank, world)
    loss_of(emb(ids.to(device)), target.to(device)).backward()
    emb.step()
    before = emb.gather_state_dict()
    bad = batch(seed, 1, rank, world)[0]
    if rank == 1:
        bad[-1, -1] = ROWS
        match = rf"ids\[\d+\] = {ROWS} is out of range"
    else:
        match = r"rank\(s\) \[1\] of the group passed ids out of range"
    with pytest.raises(RuntimeError, match=match):
        emb(bad.to(device))
    wrong = torch.zeros(2, dtype=F64) if rank == world - 1 else batch(seed, 1, rank, world)[0]
    with pytest.raises((TypeError, RuntimeError), match="integers|failed in forward"):
        emb(wrong.to(device))
    with pytest.raises(RuntimeError, match="no forward"):
        emb.step()
    after = emb.gather_state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), "a failed forward wrote"
    batches = [batch(seed, 2, r, world) for r in range(world)]
    loss_of(emb(batches[rank][0].to(device)), batches[rank][1].to(device)).backward()
    emb.step()
    reference_step(ref, batches)
    assert_same_state(emb, ref, f"after the errors, world {world} seed {seed}")
    tiny = initial_table(seed, rows=world - 1)  # the last rank owns no row
    small = ShardedHostEmbedding.from_pretrained(tiny, optimizer=cls, optimizer_kwargs=kwargs,
                                                 device=device)
    small_ref = HostEmbedding.from_pretrained(tiny, freeze=False, optimizer=cls, optimizer_kwargs=kwargs,
                                              device="cpu")
    batches = [batch(seed, 3, r, world, rows=world - 1) for r in range(world)]
    loss_of(small(batches[rank][0].to(device)), batches[rank][1].to(device)).backward()
    small.step()
    reference_step(small_ref, batches)
    assert_same_state(small, small_ref, f"tiny table, world {world} seed {seed}")


def load_into_single_process(directory, seed, schedule, steps):
    """full_state_dict of a checkpoint into HostEmbedding, trained on, equals the reference."""
    cls, kwargs = OPTIMIZERS["AdamW-amsgrad"]
    emb = HostEmbedding(ROWS, DIM, dtype=F64, optimizer=cls, optimizer_kwargs=kwargs,
                        device="cpu")
    emb.load_state_dict(full_state_dict(directory))
    for step in steps:
        world = schedule[step]
        reference_step(emb, [batch(seed, step, r, world) for r in range(world)])
    ref = uninterrupted(seed, schedule, steps.stop)
    for key, value in ref.state_dict().items():
        assert torch.allclose(emb.state_dict()[key], value, rtol=1e-10, atol=1e-12), key


def dict_like_one_process(rank, world, device, seed):
    """Two tables of different sizes and widths (an embedding with Adam, a sum bag with
    per-sample weights and RMSprop) in one ShardedEmbeddingDict: step for step equal to
    the single-process modules on the concatenated batches, with an empty batch on one rank,
    in 4 collectives per step (counts, ids, rows, gradients) where the two modules alone take
    8; bad input on one rank raises on all and writes nothing."""
    rows_b, dim_b = 23, 3
    init_a = initial_table(seed)
    init_b = torch.randn(rows_b, dim_b, dtype=F64,
                         generator=torch.Generator().manual_seed(seed + 1))
    opt_a, opt_b = OPTIMIZERS["Adam"], OPTIMIZERS["RMSprop"]

    def modules(sharded):
        kw = {"device": device} if sharded else {"device": "cpu", "freeze": False}
        ea, eb = ((ShardedHostEmbedding, ShardedHostEmbeddingBag) if sharded
                  else (HostEmbedding, HostEmbeddingBag))
        a = ea.from_pretrained(init_a, optimizer=opt_a[0], optimizer_kwargs=opt_a[1], **kw)
        if sharded:  # its own routing group, as each module on NCCL makes one
            kw["route_group"] = dist.new_group(backend="gloo")
        b = eb.from_pretrained(init_b, mode="sum", optimizer=opt_b[0],
                               optimizer_kwargs=opt_b[1], **kw)
        return a, b

    def bags(step, r, empty=None):
        g = torch.Generator().manual_seed(seed * 7 + step * 10 + r)
        n = 0 if r == empty else 1 + r
        return (torch.randint(0, rows_b, (n, 4), generator=g),
                torch.rand(n, 4, dtype=F64, generator=g),
                torch.randn(n, dim_b, dtype=F64, generator=g))

    a, b = modules(True)
    coll = ShardedEmbeddingDict({"a": a, "b": b})
    ref_a, ref_b = modules(False)
    calls = []
    real = exchange._all_to_all
    exchange._all_to_all = lambda *args: (calls.append(1), real(*args))[1]
    try:
        for step in range(3):
            empty = world - 1 if step == 1 else None
            ab = [batch(seed, step, r, world, empty_rank=empty) for r in range(world)]
            bb = [bags(step, r, empty) for r in range(world)]
            ids, target = ab[rank]
            bag_ids, weights, bag_target = bb[rank]
            before = len(calls)
            out = coll({"a": ids.to(device), "b": (bag_ids.to(device), None, weights.to(device))})
            (loss_of(out["a"], target.to(device))
             + loss_of(out["b"], bag_target.to(device))).backward()
            coll.step()
            assert len(calls) - before == (4 if world > 1 else 0)
            reference_step(ref_a, ab)
            outs = ref_b(torch.cat([x[0] for x in bb]), None, torch.cat([x[1] for x in bb]))
            loss_of(outs, torch.cat([x[2] for x in bb])).backward()
            ref_b.step()
            assert_same_state(a, ref_a, f"dict table a, step {step} world {world}")
            assert_same_state(b, ref_b, f"dict table b, step {step} world {world}")
        before = len(calls)
        out_a = a(ab[rank][0].to(device))  # alone: 2 collectives to route, 1 for the rows
        loss_of(out_a, ab[rank][1].to(device)).backward()
        a.step()
        assert len(calls) - before == (4 if world > 1 else 0)
        reference_step(ref_a, ab)
        assert_same_state(a, ref_a, f"table a alone after the dict, world {world}")
    finally:
        exchange._all_to_all = real
    saved = a.gather_state_dict(), b.gather_state_dict()
    ids = batch(seed, 5, rank, world)[0]
    bag_ids = bags(5, rank)[0]
    bad_rank = 1 if world > 1 else 0
    if rank == bad_rank:  # an id out of table b's range
        bag_ids[0, 0] = rows_b
        match = rf"inputs\['b'\]\[0\] = {rows_b} is out of range"
    else:
        match = rf"rank\(s\) \[{bad_rank}\] of the group passed ids out of range"
    with pytest.raises(RuntimeError, match=match):
        coll({"a": ids.to(device), "b": bag_ids.to(device)})
    inputs = {"a": ids.to(device)}
    if rank != 0:  # rank 0 forgets a table
        inputs["b"] = bags(5, rank)[0].to(device)
    with pytest.raises((ValueError, RuntimeError), match="every table's name|failed in forward"):
        coll(inputs)
    with pytest.raises(RuntimeError, match="no forward"):
        coll.step()
    for m, before in zip((a, b), saved):  # the failed forwards wrote nothing
        after = m.gather_state_dict()
        assert sorted(after) == sorted(before)
        assert all(torch.equal(after[k], before[k]) for k in before)
    out = coll({"a": ids.to(device), "b": bags(5, rank)[0].to(device)})
    assert out["a"].shape == (*ids.shape, DIM) and out["b"].shape == (len(bag_ids), dim_b)
    with pytest.raises(RuntimeError, match="call the dict's step"):
        a.step()
    coll.step()
    # A 1-D bag input with offsets through the dict, against the bag alone.
    flat_ids = bags(6, rank)[0].reshape(-1)
    offsets = torch.arange(0, flat_ids.numel(), 3)
    with torch.no_grad():
        out = coll({"a": ids.to(device), "b": (flat_ids.to(device), offsets.to(device))})
        alone = b(flat_ids.to(device), offsets.to(device))
    assert torch.equal(out["b"], alone)
    # Bad input on one rank only raises on every rank (nothing hangs, nothing is written):
    # bag arguments of a wrong type, in the dict and to a bag alone; mixed modes.
    before = b.gather_state_dict()
    weights = bags(5, rank)[1] if rank != world - 1 else [[1.0]]  # a list: no tensor methods
    with pytest.raises(Exception):
        coll({"a": ids.to(device), "b": (bags(5, rank)[0].to(device), None, weights)})
    with pytest.raises(Exception):
        b(flat_ids.to(device), None if rank == world - 1 else offsets.to(device))
    b.eval()
    with pytest.raises((ValueError, RuntimeError), match="all in eval mode|failed in forward"):
        coll({"a": ids.to(device), "b": bags(5, rank)[0].to(device)})
    b.train()
    after = b.gather_state_dict()
    assert all(torch.equal(after[k], before[k]) for k in before)
    out = coll({"a": ids.to(device), "b": bags(5, rank)[0].to(device)})
    coll.step()  # the dict goes on working
    with pytest.raises(ValueError, match="dtype"):
        ShardedEmbeddingDict({"a": a, "c": ShardedHostEmbedding(5, 2, dtype=torch.float32,
                                                                 device=device)})
    with pytest.raises(ValueError, match="listed twice"):
        ShardedEmbeddingDict({"a": a, "again": a})
