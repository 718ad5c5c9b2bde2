"""Checkpoint I/O of one engine's table: its weight, per-row optimizer state and the optimizer's
scalars as ``state_dict`` entries (``weight``, ``optimizer.<state>``), saved as views of the host
table (no copy) and loaded with every entry checked before any is written."""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .update import OPTIONAL_STATE, ROUNDING_STATE, STARTED


def same_view(a, b: Tensor) -> bool:
    """Whether `a` is the very view `b` (a state_dict of this table loaded in place)."""
    return (isinstance(a, Tensor) and a.device == b.device and a.dtype == b.dtype
            and a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())


def save_rows(engine, destination: dict, prefix: str = "") -> None:
    """`engine`'s entries into `destination` under `prefix` (the cache flushed first)."""
    engine.store.flush()
    table, update = engine.table, engine.update
    destination[prefix + "weight"] = table.view("weight")
    for key in update.state_keys:
        destination[f"{prefix}optimizer.{key}"] = table.view(key)
    update.take_scalar_views()
    for key, value in update.state.items():
        if key not in update.state_keys:
            # The live tensor (an in-place load restores it); Python scalars a kept view.
            destination[f"{prefix}optimizer.{key}"] = (
                value.detach() if isinstance(value, Tensor) else update.scalar_view(key, value))


def _expected(engine, state_dict: dict, prefix: str) -> tuple:
    """(the table's entries by name, the scalars' keys, every name a checkpoint holds)."""
    update = engine.update
    tables = {"weight": engine.table.view("weight")}
    tables.update({f"optimizer.{key}": engine.table.view(key) for key in update.state_keys})
    scalars = [key for key in update.state if key not in update.state_keys]
    expected = list(tables) + [f"optimizer.{key}" for key in scalars
                               if key not in OPTIONAL_STATE
                               or prefix + f"optimizer.{key}" in state_dict]
    return tables, scalars, expected


def check_rows(engine, state_dict: dict, prefix: str, missing_keys: list,
               unexpected_keys: list, expected: Optional[tuple] = None) -> tuple:
    """(the entries of `state_dict` under `prefix` that `engine` would load, the errors that
    keep it from loading any); the missing and unexpected keys added to those lists.
    `expected`: ``_expected``'s result, when the caller has it."""
    tables, _, expected = expected or _expected(engine, state_dict, prefix)
    optional = {f"optimizer.{key}" for key in ROUNDING_STATE}  # never unexpected
    # Only this table's keys: missing_keys and error_msgs are the whole model's, and nn
    # passes strict=True here whatever the caller asked (it judges strict itself).
    present = [name for name in expected if prefix + name in state_dict]
    missing_keys.extend(prefix + name for name in expected if name not in present)
    for key in state_dict:  # no children: every key under prefix is this table's
        name = key[len(prefix):]
        if key.startswith(prefix) and name not in expected and name not in optional:
            unexpected_keys.append(key)
    errors = []
    for name in present:
        value = state_dict[prefix + name]
        shape = tuple(tables[name].shape) if name in tables else ()
        if not isinstance(value, (Tensor, int, float)) or isinstance(value, bool) or (
                name in tables and not isinstance(value, Tensor)) or (
                isinstance(value, Tensor) and (tuple(value.shape) != shape
                                               and not (shape == () and value.numel() == 1))):
            got = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
            errors.append(f"{prefix + name}: shape {got} in the checkpoint, {shape} here")
    return present, errors


def load_rows(engine, state_dict: dict, prefix: str, missing_keys: list,
              unexpected_keys: list, error_msgs: list) -> None:
    """`engine`'s entries from `state_dict` (nn's ``_load_from_state_dict`` contract): every
    entry checked first; an error loads nothing of this table."""
    expected = _expected(engine, state_dict, prefix)
    present, errors = check_rows(engine, state_dict, prefix, missing_keys, unexpected_keys,
                                 expected)
    if errors or not present:
        error_msgs.extend(errors)
        return  # nothing of this table written
    engine.discard()
    tables, scalars, _ = expected
    # A state_dict of this table loaded in place (DCP, load_safetensors) is the table itself:
    # nothing to copy, and the cached rows must not be flushed over it.
    in_place = {name for name in present if name in tables
                and same_view(state_dict[prefix + name], tables[name])}
    if not all(name in present for name in tables):
        # A partial load keeps the cached rows' latest values of what it does not load.
        kept = {name: tables[name].clone() for name in in_place}
        engine.store.flush()
        with torch.no_grad():
            for name, value in kept.items():
                tables[name].copy_(value)
    engine.store.reset()
    with torch.no_grad():
        for name, table in tables.items():
            if name in present and name not in in_place:
                table.copy_(state_dict[prefix + name])
    _load_scalars(engine.update, state_dict, prefix, scalars, present)


def _load_scalars(update, state_dict: dict, prefix: str, scalars: list, present: list) -> None:
    state = update.state
    for key in scalars:
        name = f"optimizer.{key}"
        if name in present:
            value = state_dict[prefix + name]
            old = state[key]
            if isinstance(old, Tensor):  # in place: a captured step holds this tensor
                if value is not old:
                    old.copy_(torch.as_tensor(value).reshape(()).to(old.device, old.dtype))
            else:
                state[key] = type(old)(value.item() if isinstance(value, Tensor) else value)
                update.forget_scalar_view(key)
    if STARTED in state and f"optimizer.{STARTED}" not in present and \
            "optimizer.momentum_buffer" in present:
        state[STARTED].fill_(1)  # a checkpoint from before the flag: a buffer means started
