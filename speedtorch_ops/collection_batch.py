"""A collection's batch read, laid out and checked (a part of ``collection.py``): where each
feature's ids sit (``layout_batch``), and every id in its table's rows and every key's lengths
consistent (``check_batch``), on the host by NumPy or on a GPU with one wait."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from .jagged import JaggedBatch, per_key_mismatch, read_batch
from .training.plan import _INTEGER


class Span(NamedTuple):
    """Where a feature's ids sit in a batch: its key's index, its first id's position in the
    batch's values and the end of its ids."""
    key: int
    start: int
    end: int


def layout_batch(coll, features) -> tuple:
    """(the batch's parts, where each of collection `coll`'s features' ids sit: a ``Span``) of
    a jagged batch: every feature present. Offsets are not read: the lengths place every id
    and bag."""
    weighted = {f.name: coll.groups[coll.place(f.table).group].dtype for f in coll.features
                if f.pooling == "sum"} if coll.is_weighted() else None
    batch = read_batch(features, weighted)
    keys = batch.keys
    for name, t in (("values", batch.values), ("lengths", batch.lengths)):
        if t.dtype not in _INTEGER:
            raise TypeError(f"features: {name} must be integers, got {t.dtype}")
    starts = np.concatenate([[0], np.cumsum(batch.length_per_key, dtype=np.int64)])
    at = {}
    for f in coll.features:
        if f.name not in keys:
            raise KeyError(f"features: no feature {f.name!r} in the batch (keys: {keys})")
        i = keys.index(f.name)
        at[f.name] = Span(i, int(starts[i]), int(starts[i + 1]))
    return batch, at


def out_of_range(ids: np.ndarray, rows: int) -> bool:
    """Whether any of `ids` is outside [0, rows): int64 ids in one pass (a negative id is a
    huge unsigned one)."""
    if ids.dtype == np.int64:
        return bool((ids.view(np.uint64) >= np.uint64(rows)).any())
    return ids.size > 0 and bool(ids.min() < 0 or ids.max() >= rows)


def host_flags(coll, batch: JaggedBatch, at: dict) -> list:
    """[each feature's ids out of its table's range, each key's lengths negative, each key's
    lengths' sum] of a batch on the host, by NumPy (torch's CPU ops wake its thread pool, which
    on a many-core host cost milliseconds a step)."""
    values = batch.values.numpy()
    flags = []
    for f in coll.features:
        span, rows = at[f.name], coll.tables[f.table].num_embeddings
        ids = values[span.start:span.end]
        flags.append(int(rows is not None and out_of_range(ids, rows)))  # hashed: any id
    per_key = batch.lengths.cpu().numpy().reshape(len(batch.keys), batch.stride)
    return flags + (per_key < 0).any(1).astype(int).tolist() + per_key.sum(1).tolist()


def device_flags(coll, batch: JaggedBatch, at: dict) -> list:
    """``host_flags`` of a batch on a GPU, read back with one wait."""
    values = batch.values
    flags = []
    for f in coll.features:
        span, rows = at[f.name], coll.tables[f.table].num_embeddings
        ids = values[span.start:span.end]
        flags.append(ids.new_zeros((), dtype=torch.bool) if rows is None
                     else ((ids < 0) | (ids >= rows)).any())
    per_key = batch.lengths.reshape(len(batch.keys), batch.stride).to(values.device)
    return torch.cat([torch.stack(flags), (per_key < 0).any(1), per_key.sum(1)]
                     ).to(torch.int64).cpu().tolist()


def check_batch(coll, batch: JaggedBatch, at: dict) -> None:
    """Each feature's ids of collection `coll` in its table's rows, every key's lengths >= 0
    and summing to the batch's ids of that key (a key not read places the ids after it too),
    naming the feature: on the host, or with one wait for a batch on a GPU (none when
    prechecked)."""
    values = batch.values
    on_gpu = values.device.type == "cuda"
    if on_gpu and coll.bounds_check == "prechecked":
        return
    bad = (device_flags if values.device.type != "cpu" else host_flags)(coll, batch, at)
    n = len(coll.features)
    split = n + len(batch.keys)  # ids flags, negative flags, sums
    for key, flag in zip(batch.keys, bad[n:split]):
        if flag:
            raise ValueError(f"features: feature {key!r} has a negative length")
    wrong = per_key_mismatch(batch.keys, batch.length_per_key, bad[split:])
    if wrong:  # a batch's own count read ids of another feature
        raise ValueError(f"features: {wrong}")
    for k, f in enumerate(coll.features):
        span = at[f.name]
        if bad[k]:
            rows = coll.tables[f.table].num_embeddings
            ids = values[span.start:span.end].cpu()
            p = int(torch.nonzero((ids < 0) | (ids >= rows))[0])
            raise RuntimeError(f"feature {f.name!r}: id {int(ids[p])} at position {p} is out "
                               f"of range for table {coll.tables[f.table].name!r} of {rows} "
                               "rows; every id must be in [0, rows). Nothing was written.")


def host_offsets(lengths: Tensor, spans: list, stride: int, total: int) -> Tensor:
    """``embedding_bag``'s offsets (``include_last_offset``) of the bags of the features at
    `spans` side by side: each bag's first position among their `total` ids, then `total`. From
    host lengths by NumPy: torch's small CPU ops cost more than they compute here."""
    lens = lengths.numpy()
    out = np.zeros(len(spans) * stride + 1, dtype=np.int64)
    np.cumsum(np.concatenate([lens[s.key * stride:(s.key + 1) * stride] for s in spans]),
              out=out[1:])
    out[-1] = total
    return torch.from_numpy(out)
