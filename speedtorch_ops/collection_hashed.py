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

from .training.checkpoint import save_rows
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
        rows.sync = lambda group=group: _wait_for(group.device)  # its device now (.to() moves)
        out[k] = rows
    return out


def _wait_for(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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
    rows.touch_all()  # the next increment holds every row


# ---- checkpoints ---------------------------------------------------------------------------

SCORES = ("ids", "count", "last_step", "clock", "version")
INCREMENT = ("removed", "since")  # an increment's own entries


def save_hashed(coll, k: int, whole: dict, destination: dict, prefix: str,
                since: Optional[dict] = None) -> None:
    """Hashed table `k`'s entries: its ids (ascending), their rows and state, and the scores;
    with `since` (a save of this collection) only the ids changed after it, the ids evicted
    after it (``<table>.removed``) and the version it follows (``<table>.since``)."""
    rows = coll.hashed[k]
    name = coll.tables[k].name
    if since is None:
        ids, held = rows.held_rows()
    else:
        key = f"{prefix}{name}.version"
        if key not in since:
            raise KeyError(f"since: no {key!r}: pass a state_dict of this collection (a full "
                           "save or an increment)")
        base = int(torch.as_tensor(since[key]))
        held, gone = rows.changes(base)
        ids = rows.id_of[held]
        destination[f"{prefix}{name}.removed"] = torch.from_numpy(gone)
        destination[f"{prefix}{name}.since"] = torch.tensor(base)
    place = coll.place(k)
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


def load_increment(coll, inc: dict) -> None:
    """An increment (``save_hashed`` with `since`) applied to collection `coll`, which holds the
    save it follows: every hashed part checked first (nothing is written on an error), the rest
    (dense tables, the groups' scalars) loaded as a state_dict, then each hashed table's
    evicted ids dropped and its changed ids' rows, state and scores written."""
    errors, parts, own = [], {}, set()
    for k, rows in coll.hashed.items():
        name = coll.tables[k].name
        group = coll.groups[coll.place(k).group]
        whole: dict = {}
        save_rows(group.engine, whole)
        row_keys = [key for key, v in whole.items()
                    if v.dim() >= 1 and v.shape[0] == group.num_embeddings]
        names = [f"{name}.{key}" for key in (*SCORES, *INCREMENT, *row_keys)]
        own.update(names)
        missing = [n for n in names if n not in inc]
        if missing:
            errors.append(f"{missing[0]}: missing (an increment holds every hashed table's)")
            continue
        since = int(torch.as_tensor(inc[f"{name}.since"]))
        ids = inc[f"{name}.ids"]
        why = (f"{name}.since: the increment follows version {since}, the table is at "
               f"{rows.version}: apply increments in order, onto the save they follow"
               if since != rows.version else rows.check_upsert(ids, inc[f"{name}.removed"]))
        for key in ("count", "last_step", *row_keys):
            value = inc[f"{name}.{key}"]
            want = (ids.numel(), *(whole[key].shape[1:] if key in whole else ()))
            if why is None and (not isinstance(value, Tensor) or tuple(value.shape) != want):
                why = f"{name}.{key}: shape {want}, got {_shape(value)}"
        if why is not None:
            errors.append(why)
            continue
        parts[k] = (row_keys, whole)
    if errors:
        raise RuntimeError("load_increment: " + "; ".join(errors) + ". Nothing was written.")
    coll.load_state_dict({n: v for n, v in inc.items() if n not in own}, strict=False)
    for k, (row_keys, whole) in parts.items():
        _apply(coll, k, inc, row_keys, whole)


def _apply(coll, k: int, inc: dict, row_keys: list, whole: dict) -> None:
    """Table `k`'s part of `inc` written: `whole`, views of its group's host table."""
    rows, name = coll.hashed[k], coll.tables[k].name
    rows.sync()  # a GPU's last commit may still write the rows
    at = rows.upsert(inc[f"{name}.ids"], inc[f"{name}.removed"], inc[f"{name}.count"],
                     inc[f"{name}.last_step"], int(torch.as_tensor(inc[f"{name}.clock"])),
                     int(torch.as_tensor(inc[f"{name}.version"])))
    where = torch.from_numpy(at + rows.offset)
    with torch.no_grad():
        for key in row_keys:
            whole[key].index_copy_(0, where, inc[f"{name}.{key}"].to(whole[key].dtype))


def _shape(value) -> str:
    return str(tuple(value.shape)) if isinstance(value, Tensor) else type(value).__name__


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
                            int(torch.as_tensor(state_dict[name + "clock"])),
                            int(torch.as_tensor(state_dict[name + "version"])))
    coll.hashed_load = {}
