"""A collection's hashed tables (``TableConfig(num_embeddings=None, capacity=...)``): each one a
``HashedRows`` over its rows of its width group, which holds one more row past its tables':
the row every id without a row reads, zero and never updated (the group's padding row, whose
gradient the engine drops).

A training forward maps a hashed table's ids to rows on the host (ids on a GPU come over with
one wait), counting, admitting and evicting (``training/hashed.py``); any other forward only
reads the map; a prefetch leaves hashed groups alone (a row it loaded could be given to
another id before the step that reads it)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from .training.hashed import HashedRows


class _Rows:
    """A group's host rows as the group has them now (a conversion makes a new table)."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine.table, name)


def build_hashed(coll) -> dict:
    """{table position: ``HashedRows``} of collection `coll`'s hashed tables."""
    out = {}
    for k, t in enumerate(coll.tables):
        if not t.hashed:
            continue
        place = coll.place(k)
        group = coll.groups[place.group]
        rows = HashedRows(t.name, _Rows(group.engine), place.offset, t.capacity,
                          t.admit_after, t.evict, t.on_evict)
        if group.device.type == "cuda":
            device = group.device
            rows.sync = lambda device=device: torch.cuda.synchronize(device)
        out[k] = rows
    return out


def pad_row(coll, g: int) -> Optional[int]:
    """Group `g`'s row for ids without one (its last), None where it holds no hashed table."""
    if not any(coll.tables[k].hashed for k in coll.tables_of(g)):
        return None
    return coll.groups[g].num_embeddings - 1


def hashed_group_rows(coll, k: int, ids: Tensor, training: bool) -> Tensor:
    """Hashed table `k`'s `ids` as rows of its group: its row offset added, the group's pad
    row where an id has none."""
    rows = coll.hashed[k].rows_for(ids.cpu().numpy().astype(np.int64, copy=False), training)
    place = coll.place(k)
    pad = pad_row(coll, place.group)
    out = np.where(rows >= 0, rows + place.offset, pad)
    return torch.from_numpy(out).to(ids.device)


def refuse_capture(coll) -> None:
    """Raise, naming a hashed table, where `coll` has one and a CUDA graph capture is on: its
    ids map to rows on the host, which a capture cannot wait for."""
    if coll.hashed and coll.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        name = coll.tables[next(iter(coll.hashed))].name
        raise RuntimeError(f"table {name!r} is hashed: its ids map to rows on the host, which "
                           "a CUDA graph capture cannot wait for; train a collection with "
                           "hashed tables eagerly (no CapturedStep)")


def tick(coll) -> None:
    """A training forward of `coll` begins (its hashed tables' rows touched from now on are
    this step's)."""
    for k, rows in coll.hashed.items():
        if coll.groups[coll.place(k).group].trains:
            rows.tick()


def hashed_stats(coll, k: int) -> dict:
    rows = coll.hashed[k]
    return {"rows": rows.held, **rows.stats}


def reset_hashed(coll, k: int, init) -> None:
    """Hashed table `k`'s held rows at a new row's values, `init` (None: zero) its new rows'
    initialiser from now on; its state is the group's to reset."""
    rows = coll.hashed[k]
    rows.init = init
    rows.write_start(rows.id_of_rows())


# ---- checkpoints ---------------------------------------------------------------------------

SCORES = ("ids", "count", "last_step", "clock")


def save_hashed(coll, k: int, whole: dict, destination: dict, prefix: str) -> None:
    """Hashed table `k`'s entries: its ids (ascending), their rows and state, and the scores."""
    rows = coll.hashed[k]
    ids, held = rows.held_rows()
    place = coll.place(k)
    name = coll.tables[k].name
    at = torch.from_numpy(held + place.offset)
    group_rows = coll.groups[place.group].num_embeddings
    for key, value in whole.items():
        row_shaped = value.dim() >= 1 and value.shape[0] == group_rows
        destination[f"{prefix}{name}.{key}"] = value.index_select(0, at) if row_shaped else value
    destination[f"{prefix}{name}.ids"] = torch.from_numpy(ids.copy())
    for key, value in rows.scores(held).items():
        destination[f"{prefix}{name}.{key}"] = value


def hashed_piece(coll, k: int, value, here: Tensor, name: str, errors: list):
    """Hashed table `k`'s rows of a row-shaped entry `value` (one row an id of its
    ``<table>.ids``) as its whole region (the ids at rows 0, 1, ...; the rest kept: a row is
    written when an id gets it), or None after an error."""
    ids = coll.hashed_load.get(k)
    if ids is None:
        errors.append(f"{name}: a hashed table's rows load with its ids "
                      f"({coll.tables[k].name}.ids)")
        return None
    want = (ids.numel(), *here.shape[1:])
    if value is None:
        errors.append(f"{name}: missing beside {coll.tables[k].name}.ids")
        return None
    if not isinstance(value, Tensor) or tuple(value.shape) != want:
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        errors.append(f"{name}: shape {got} in the checkpoint, {want} here")
        return None
    return torch.cat([value.to(here.device, here.dtype), here[ids.numel():]])


def check_hashed_load(coll, state_dict: dict, prefix: str, errors: list, known: set) -> dict:
    """{table position: its ids} of the hashed tables whose ids `state_dict` holds, their
    scores checked (errors appended); sets ``coll.hashed_load`` for ``hashed_piece``."""
    found = {}
    for k, rows in coll.hashed.items():
        names = {key: f"{prefix}{coll.tables[k].name}.{key}" for key in SCORES}
        known.update(names.values())
        if names["ids"] not in state_dict:
            continue
        ids = state_dict[names["ids"]]
        missing = [n for n in names.values() if n not in state_dict]
        why = (f"{missing[0]}: missing beside {names['ids']}" if missing else
               rows.check_load(ids, state_dict[names["count"]], state_dict[names["last_step"]]))
        if why is not None:
            errors.append(why)
            continue
        found[k] = ids
    coll.hashed_load = found
    return found


def load_hashed(coll, state_dict: dict, prefix: str, found: dict) -> None:
    """The hashed tables' maps and scores from `state_dict` (checked, rows loaded)."""
    for k, ids in found.items():
        name = f"{prefix}{coll.tables[k].name}."
        coll.hashed[k].load(ids, state_dict[name + "count"], state_dict[name + "last_step"],
                            int(torch.as_tensor(state_dict[name + "clock"])))
    coll.hashed_load = {}
