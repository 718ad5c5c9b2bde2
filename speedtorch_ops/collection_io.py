"""Checkpoint I/O of a collection: each table's rows and optimizer state under its own name
(``<table>.weight``, ``<table>.optimizer.<state>``), cut from and gathered into the width
groups that hold them, every entry checked before any group loads."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Optional

import torch
from torch import Tensor

from .collection_hashed import check_hashed_load, hashed_piece, load_hashed, save_hashed
from .training.checkpoint import load_rows, same_view, save_rows
from .training.update import OPTIONAL_STATE, ROUNDING_STATE


def save_collection(coll, destination: dict, prefix: str, since: Optional[dict] = None) -> None:
    """Every table's entries of collection `coll` under `prefix`: views of its group's (a
    hashed table's: its held rows, with its ids and scores; with `since`, a save of `coll`,
    only the rows changed after it: ``save_hashed``)."""
    for g, group in enumerate(coll.groups):
        whole: dict = {}
        save_rows(group.engine, whole)
        for k in coll.tables_of(g):
            if k in coll.hashed:
                save_hashed(coll, k, whole, destination, prefix, since)
                continue
            place = coll.place(k)
            for key, value in whole.items():
                rows = value.dim() >= 1 and value.shape[0] == group.num_embeddings
                destination[f"{prefix}{coll.tables[k].name}.{key}"] = (
                    value[place.offset:place.offset + place.rows] if rows else value)


def _scalar_errors(state_dict: dict, names: list, current: Tensor) -> list:
    """Why checkpoint entries `names` cannot load into a group's scalar `current` (a number, or a
    tensor of its shape or of one element), checked before any group loads."""
    errors = []
    for name in names:
        value = state_dict[name]
        if isinstance(value, (int, float)) and not isinstance(value, bool) or \
                isinstance(value, Tensor) and (value.shape == current.shape or (
                    current.dim() == 0 and value.numel() == 1)):
            continue
        got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        errors.append(f"{name}: shape {got} in the checkpoint, {tuple(current.shape)} here")
    return errors


def _gather_rows(coll, state_dict: dict, names: list, mine: list, current: Tensor,
                 errors: list):
    """The group's whole entry from its tables' entries `names` (a table missing from the
    checkpoint keeps its rows; the group's spare rows are kept), or None after an error."""
    pieces, in_place, present = [], True, 0
    for k, n in zip(mine, names):
        place = coll.place(k)
        here = current[place.offset:place.offset + place.rows]
        if k in coll.hashed and (n in state_dict or k in coll.hashed_load):
            pieces.append(hashed_piece(coll, k, state_dict.get(n), here, n, errors))
            present += 1
            in_place = False
            continue
        if n not in state_dict:
            pieces.append(here)  # not in the checkpoint: kept as it is
            continue
        v = state_dict[n]
        want = (place.rows, *current.shape[1:])
        if not isinstance(v, Tensor) or tuple(v.shape) != want:
            got = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            errors.append(f"{n}: shape {got} in the checkpoint, {want} here")
            continue
        in_place &= same_view(v, here)
        pieces.append(v)
        present += 1
    if len(pieces) != len(mine) or any(p is None for p in pieces):
        return None
    last = coll.place(mine[-1])
    pieces.append(current[last.offset + last.rows:])  # the group's spare rows, kept
    if in_place and present == len(names):
        return current
    return torch.cat([p.to(current.device, current.dtype) for p in pieces])


def _gather_group(coll, g: int, state_dict: dict, prefix: str, missing_keys: list,
                  errors: list, known: set) -> dict:
    """Group `g`'s entries gathered from its tables' (its scalars: the first table's)."""
    group = coll.groups[g]
    whole: dict = {}
    save_rows(group.engine, whole)  # the group's keys and their current tensors (flushed)
    mine = coll.tables_of(g)
    optional_keys = {f"optimizer.{key}" for key in OPTIONAL_STATE}
    gathered = {}
    for key, current in whole.items():
        names = [f"{prefix}{coll.tables[k].name}.{key}" for k in mine]
        known.update(names)
        present = [n for n in names if n in state_dict]
        if key not in optional_keys:  # checkpoints may lack those (OPTIONAL_STATE)
            missing_keys.extend(n for n in names if n not in state_dict)
        if not (current.dim() >= 1 and current.shape[0] == group.num_embeddings):
            errors += _scalar_errors(state_dict, present, current)  # a step count
            if present:
                gathered[key] = state_dict[present[0]]
        elif present or any(k in coll.hashed_load for k in mine):
            rows = _gather_rows(coll, state_dict, names, mine, current, errors)
            if rows is not None:
                gathered[key] = rows
    return gathered


def load_collection(coll, state_dict: dict, prefix: str, missing_keys: list,
                    unexpected_keys: list, error_msgs: list) -> None:
    """Collection `coll`'s tables from `state_dict` (nn's ``_load_from_state_dict``
    contract): every group's entries checked first, so an error loads nothing."""
    known, errors = set(), []
    found = check_hashed_load(coll, state_dict, prefix, errors, known)
    loads = [_gather_group(coll, g, state_dict, prefix, missing_keys, errors, known)
             for g in range(len(coll.groups))]
    names = {t.name for t in coll.tables}
    rounding_keys = {f"optimizer.{key}" for key in ROUNDING_STATE}
    for key in state_dict:
        if not key.startswith(prefix) or key in known:
            continue
        table, _, rest = key[len(prefix):].partition(".")
        if table not in names or rest not in rounding_keys:  # 16-bit tables' own
            unexpected_keys.append(key)
    if errors:
        error_msgs.extend(errors)
        return  # nothing loaded
    for group, gathered in zip(coll.groups, loads):
        if gathered:
            load_rows(group.engine, gathered, "", [], [], error_msgs)
    load_hashed(coll, state_dict, prefix, found)


class CheckpointNames:
    """The checkpoint keys of a collection (a mixin) for torch.distributed.checkpoint's
    state-dict helpers (``get_model_state_dict``, ``set_model_state_dict``, ``get_state_dict``),
    which walk each key's dotted names as attributes of the module: a key's first name is a
    table's, not an attribute, so ``_fqn_modifiers`` sends the walk of each table's name through
    a stand-in that holds every name of its keys (``<table>.weight``,
    ``<table>.optimizer.<state>``)."""

    def _fqn_modifiers(self) -> dict:
        return {t.name: "_checkpoint_tables" for t in self.tables}

    @property
    def _checkpoint_tables(self) -> SimpleNamespace:
        tables = {}
        for k, t in enumerate(self.tables):
            state = self.groups[self.place(k).group].engine.update.state
            optimizer = SimpleNamespace(**dict.fromkeys(state))
            tables[t.name] = SimpleNamespace(weight=None, optimizer=optimizer)
        return SimpleNamespace(**tables)
