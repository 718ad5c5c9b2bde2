"""Checkpoints of sharded tables: one file per rank (its rows, weight and optimizer state side by
side, and the optimizer's scalars) and one small ``meta.json``; loadable at any world size, and
as one state_dict for the single-process ``HostEmbedding`` (``full_state_dict``).

Layout of ``directory``:
    meta.json                   sizes, dtype, world size, partition, optimizer and its settings
    shard-00000-of-00002.pt     {"rows": (local_rows, 1, record) uint8, "parts": where each
                                 state_dict entry sits in a record ([name, byte offset,
                                 values (None: one), dtype]), "scalars": {name: tensor}}
                                (files written before rows were records: "rows" (local_rows,
                                 parts, width) of the table's dtype, "parts" [name, part,
                                 start, stop], stop None for one column; they load too)
Row ``id`` of a checkpoint saved at world ``W`` is row ``id // W`` of file ``id % W``.
"""

from __future__ import annotations

import inspect
import json
import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from .. import optim
from ..training.checkpoint import load_rows, save_rows
from .exchange import agree, local_rows

FORMAT = 1
META = "meta.json"


def shard_file(directory: str, rank: int, world: int) -> str:
    return os.path.join(directory, f"shard-{rank:05d}-of-{world:05d}.pt")


def split_state(shard, state: Optional[dict] = None) -> tuple:
    """(where each per-row state_dict entry of the single-process module `shard` sits in its
    host table's records (layout_places); the optimizer's scalars as state_dict entries). `state`: the module's state_dict entries, when its
    ``state_dict()`` does not hold them (a collection's group)."""
    places = layout_places(shard)
    names = {place[0] for place in places}
    state = shard.state_dict() if state is None else state
    scalars = {k: v.clone() for k, v in state.items() if k not in names}
    return places, scalars


def _save_atomically(payload, path: str) -> None:
    torch.save(payload, path + ".tmp")
    os.replace(path + ".tmp", path)  # a reader never sees half a file


def _write_meta(directory: str, meta: dict) -> None:
    with open(os.path.join(directory, META + ".tmp"), "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(os.path.join(directory, META + ".tmp"), os.path.join(directory, META))


def _places(parts, width: int) -> list:
    """A file's "parts" as places: [name, byte offset, values, dtype] in records; files of
    typed rows: [name, part, start, stop]; the oldest list names only, one part each."""
    return [[p, k, 0, width] if isinstance(p, str) else list(p) for k, p in enumerate(parts)]


def _names(places) -> list:
    return [p[0] for p in places]


def row_views(rows: Tensor, parts) -> dict:
    """The state_dict entries (views) of `rows` laid out as `parts`: records (n, 1, record)
    uint8, or the typed rows (n, parts, width) of files written before records."""
    out = {}
    for place in _places(parts, rows.shape[2]):
        if isinstance(place[3], str):  # [name, offset, values, dtype] in a record
            name, offset, values, dtype = place
            dtype = getattr(torch, dtype)
            view = rows[:, 0, offset:offset + dtype.itemsize * (values or 1)].view(dtype)
            out[name] = view if values is not None else view[:, 0]
        else:
            name, part, start, stop = place
            out[name] = rows[:, part, start:stop] if stop is not None else rows[:, part, start]
    return out


def _json_settings(group: dict) -> dict:
    """The optimizer's settings that JSON can hold (lr, betas, ...; not the params)."""
    out = {}
    for key, value in group.items():
        if key == "params":
            continue
        if isinstance(value, Tensor) and value.numel() == 1:
            value = value.item()
        if isinstance(value, tuple):
            value = list(value)
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


def save(module, directory: str) -> None:
    os.makedirs(directory, exist_ok=True)
    places, scalars = split_state(module.shard)
    payload = {"rows": module.local_table(), "parts": places, "scalars": scalars}
    _save_atomically(payload, shard_file(directory, module.rank, module.world))
    if module.rank == 0:
        meta = {"format": FORMAT, "kind": type(module).__name__,
                "num_embeddings": module.num_embeddings, "embedding_dim": module.embedding_dim,
                "dtype": str(module.dtype).removeprefix("torch."), "world_size": module.world,
                "partition": "cyclic", "steps": module.steps,
                "optimizer": type(module.optimizer).__name__,
                "optimizer_kwargs": _json_settings(module.optimizer.param_groups[0])}
        if hasattr(module, "mode"):
            meta["mode"] = module.mode
        if module.state_dtype != module.dtype:
            meta["state_dtype"] = str(module.state_dtype).removeprefix("torch.")
        _write_meta(directory, meta)
    dist.barrier(group=module.route_group)  # a load that follows sees every file


def read_meta(directory: str) -> dict:
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        raise FileNotFoundError(f"directory: no {META} in {directory!r}; is it a checkpoint "
                                "written by ShardedHostEmbedding.save?")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("partition") != "cyclic":
        raise ValueError(f"directory: {path} is format {meta.get('format')} with partition "
                         f"{meta.get('partition')!r}; this version reads format {FORMAT}, cyclic")
    return meta


def _open_shard(directory: str, rank: int, world: int) -> dict:
    path = shard_file(directory, rank, world)
    if not os.path.exists(path):
        raise FileNotFoundError(f"directory: {path} is missing (the checkpoint was saved by "
                                f"{world} ranks; every rank's file must be visible here)")
    # mmap: a rank reads only the pages of the rows it keeps
    return torch.load(path, mmap=True, weights_only=True)


def _optimizer_kwargs(optimizer, saved: dict) -> dict:
    """The saved settings the optimizer's constructor takes (a param group also holds derived
    ones, e.g. AdamW's decoupled_weight_decay)."""
    accepted = inspect.signature(optimizer.__init__).parameters
    return {k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()
            if k in accepted}


def rows_of(directory: str, meta: dict, ids: Tensor) -> tuple:
    """(rows (len(ids), parts, width) of the global `ids`, where the entries sit in them, the
    scalars) read from the shard files of a checkpoint."""
    world = meta["world_size"]
    first = _open_shard(directory, 0, world)
    parts, scalars = first["parts"], first["scalars"]
    out = torch.empty((len(ids), *first["rows"].shape[1:]), dtype=first["rows"].dtype)
    owner = ids % world
    for rank in range(world):
        mine = (owner == rank).nonzero().flatten()
        if len(mine):
            shard = first if rank == 0 else _open_shard(directory, rank, world)
            out[mine] = shard["rows"][ids[mine] // world]
    return out, parts, scalars


def full_state_dict(directory: str) -> dict:
    """The state_dict of the single-process ``HostEmbedding`` (or ``HostEmbeddingBag``) with
    this checkpoint's table and optimizer state; no process group needed:

        emb = HostEmbedding(n, dim, optimizer=torch.optim.Adam, ...)
        emb.load_state_dict(full_state_dict(directory))"""
    meta = read_meta(directory)
    rows, parts, scalars = rows_of(directory, meta, torch.arange(meta["num_embeddings"]))
    out = row_views(rows, parts)
    out.update(scalars)
    return out


def load(cls, directory: str, group, optimizer, optimizer_kwargs: Optional[dict],
         kwargs: dict):
    meta = read_meta(directory)
    if optimizer is None:
        optimizer = getattr(torch.optim, meta["optimizer"], None) or getattr(
            optim, meta["optimizer"], None)
        if optimizer is None:
            raise ValueError(f"optimizer: the checkpoint names {meta['optimizer']!r}, found "
                             "neither in torch.optim nor in speedtorch_ops.optim; pass the class")
    elif getattr(optimizer, "__name__", None) != meta["optimizer"]:
        raise ValueError(f"optimizer: the checkpoint holds {meta['optimizer']}'s state, got "
                         f"{optimizer!r}")
    if optimizer_kwargs is None:
        optimizer_kwargs = _optimizer_kwargs(optimizer, meta["optimizer_kwargs"])
    if "mode" in meta and "mode" in inspect.signature(cls.__init__).parameters:
        kwargs.setdefault("mode", meta["mode"])  # a bag's reduction
    kwargs.setdefault("dtype", getattr(torch, meta["dtype"]))
    if "state_dtype" in meta:
        kwargs.setdefault("state_dtype", getattr(torch, meta["state_dtype"]))
    module = cls(meta["num_embeddings"], meta["embedding_dim"], optimizer=optimizer,
                 optimizer_kwargs=optimizer_kwargs, group=group, **kwargs)
    ids = torch.arange(module.rank, module.num_embeddings, module.world)
    rows, parts, scalars = rows_of(directory, meta, ids)
    places, _ = split_state(module.shard)
    saved = _places(parts, rows.shape[2])
    if _names(saved) != _names(places):
        raise ValueError(f"optimizer: the checkpoint's rows hold {_names(saved)}, this "
                         f"optimizer keeps {_names(places)} (settings such as amsgrad or "
                         "momentum differ)")
    padded = torch.cat([rows, rows.new_zeros((1, *rows.shape[1:]))])  # the shard's padding row
    state = row_views(padded, parts)
    state.update(scalars)
    module.shard.load_state_dict(state)
    module.steps = meta["steps"]
    return module


# ---- ShardedHostEmbeddingBagCollection -----------------------------------------------------
# Layout: meta.json (the tables, the world size) and one file per rank holding, per width group
# of the collection, its rows of the group's tables (the tables one after the other, no
# padding row), where each state_dict entry sits in a row, and the group's scalars.

# The kind a collection's meta.json records: the class's name when the layout was made, kept
# under the class's later name so that checkpoints written before the rename load.
COLLECTION = "ShardedEmbeddingBagCollection"


def _group_places(group) -> tuple:
    """(places of the per-row entries in the group's rows, the group's scalars)."""
    whole: dict = {}
    save_rows(group.engine, whole)
    return split_state(group, whole)


def layout_places(module) -> list:
    """Where each per-row state_dict entry of `module` (a single-process module, or a
    collection's group) sits in its host table's records: [name, byte offset, values (None:
    one), dtype]."""
    return [[key if key == "weight" else f"optimizer.{key}", *rest]
            for key, *rest in module.layout.places()]


def _tables_meta(ebc) -> list:
    """[name, rows, dim, dtype] of each table, and its state's dtype after them where it is
    not the table's."""
    out = []
    for k, t in enumerate(ebc.tables):
        group = ebc.groups[ebc.place(k).group]
        meta = [t.name, t.num_embeddings, t.embedding_dim,
                str(group.dtype).removeprefix("torch.")]
        if group.state_dtype != group.dtype:
            meta.append(str(group.state_dtype).removeprefix("torch."))
        out.append(meta)
    return out


def save_collection(ebc, directory: str) -> None:
    error = None
    try:
        os.makedirs(directory, exist_ok=True)
        groups = []
        for g, group in enumerate(ebc.groups):
            group.flush()
            held = group.num_embeddings - ebc.padding_rows  # its tables' rows, not the padding
            places, scalars = _group_places(group)
            groups.append({"rows": group.host[:held], "parts": places, "scalars": scalars})
        _save_atomically({"groups": groups}, shard_file(directory, ebc.rank, ebc.world))
        if ebc.rank == 0:
            _write_meta(directory, {"format": FORMAT, "kind": COLLECTION,
                                    "world_size": ebc.world, "partition": "cyclic",
                                    "tables": _tables_meta(ebc)})
    except Exception as e:  # raised on every rank by agree, so none waits for it
        error = e
    agree(ebc.route_group, error, [])  # also: a load that follows sees every file


def load_collection(ebc, directory: str) -> None:
    """Each group's rows of this rank read from the files of a checkpoint saved at any world
    size (memory-mapped: a rank reads the pages of its rows), checked on every rank before
    anything loads anywhere (a rank that cannot read its rows makes every rank raise)."""
    loads, error = [], None
    try:
        loads = _collection_rows(ebc, directory)
    except Exception as e:
        error = e
    agree(ebc.route_group, error, [])
    errors: list = []
    for group, state in loads:
        load_rows(group.engine, state, "", errors, errors, errors)  # none: tables, places match
    if errors:
        raise RuntimeError(f"directory: {errors}")


def _collection_rows(ebc, directory: str) -> list:
    """(group, its state_dict for this rank) of every group, from a checkpoint's files."""
    path = os.path.join(directory, META)
    if not os.path.exists(path):
        raise FileNotFoundError(f"directory: no {META} in {directory!r}; is it a checkpoint "
                                f"written by {type(ebc).__name__}.save_shards?")
    with open(path) as f:
        meta = json.load(f)
    if meta.get("format") != FORMAT or meta.get("kind") != COLLECTION:
        raise ValueError(f"directory: {path} holds a {meta.get('kind')} checkpoint of format "
                         f"{meta.get('format')}; this reads {type(ebc).__name__}'s (kind "
                         f"{COLLECTION}), format {FORMAT}")
    if meta["tables"] != _tables_meta(ebc):
        raise ValueError(f"directory: the checkpoint's tables [name, rows, dim, dtype] are "
                         f"{meta['tables']}, this collection's {_tables_meta(ebc)}")
    saved_world = meta["world_size"]
    files = [_open_shard(directory, r, saved_world) for r in range(saved_world)]
    loads = []
    for g, group in enumerate(ebc.groups):
        places = layout_places(group)
        saved = files[0]["groups"][g]
        saved_places = _places(saved["parts"], saved["rows"].shape[2])
        if _names(saved_places) != _names(places):
            raise ValueError(f"directory: the checkpoint's rows hold "
                             f"{_names(saved_places)}, this optimizer keeps "
                             f"{_names(places)} (settings such as amsgrad or momentum "
                             "differ)")
        pieces = []
        starts = [0] * saved_world  # where the table's rows begin in each saved rank's group
        for k in ebc.tables_of(g):
            rows_k = ebc.tables[k].num_embeddings
            ids = torch.arange(ebc.rank, rows_k, ebc.world)
            owner = ids % saved_world
            rows = saved["rows"].new_empty((len(ids), *saved["rows"].shape[1:]))
            for r in range(saved_world):
                at = (owner == r).nonzero().flatten()
                if len(at):
                    rows[at] = files[r]["groups"][g]["rows"][starts[r] + ids[at] // saved_world]
                starts[r] += local_rows(rows_k, r, saved_world)
            pieces.append(row_views(rows, saved["parts"]))
        held = group.num_embeddings - ebc.padding_rows
        # this rank's padding rows, as they are
        pieces.append(row_views(group.host[held:].clone(), places))
        # Entry by entry: a file's rows need not be records of this group's layout.
        state = {name: torch.cat([p[name].to(pieces[-1][name].dtype) for p in pieces])
                 for name in _names(places)}
        # The scalars (step counts, a 16-bit group's rounding seed): this rank's own at the
        # same world size, so a resumed run draws as the unbroken one; else rank 0's.
        own = files[ebc.rank] if saved_world == ebc.world else files[0]
        state.update(own["groups"][g]["scalars"])
        loads.append((group, state))
    return loads
