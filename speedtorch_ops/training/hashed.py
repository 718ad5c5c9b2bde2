"""Hashed tables: any int64 id mapped to a row of a fixed region of host rows, with admission
(an id gets a row once it was seen ``admit_after`` times) and eviction by a score when the
region is full. Nothing is lost silently: an evicted row goes to the ``on_evict`` callback with
its exact weight and optimizer state before its row is reused, and is counted; an id that gets
no row (not yet admitted, or no row free of this step's own) reads zeros, its gradient is
dropped, and it is counted.

The parts: ``IdMap`` (id -> row, open addressing with linear probing), ``CountSketch``
(occurrences of ids without a row, a count-min sketch), ``HashedRows`` (one table: the map,
the scores, the free rows, the policy, the stats, over rows ``[offset, offset + capacity)`` of
a ``HostTable``). The map lives on the host: a step's ids come to the host once (ids on a GPU
with one wait), so a hashed table trains eagerly (no CUDA graph capture yet).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional, Union

import numpy as np
import torch
from torch import Tensor

from .. import ops
from .table import HostTable

EMPTY, ERASED = -1, -2  # a map slot's row, where it holds none
_M1, _M2 = np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53)
_SEEDS = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB, 0x2545F4914F6CDD1D)
POLICIES = ("lru", "lfu")


def mix(ids: np.ndarray, seed: int = 0) -> np.ndarray:
    """A 64-bit mix of `ids` (int64): MurmurHash3's finalizer, so nearby ids land far apart."""
    with np.errstate(over="ignore"):
        x = ids.view(np.uint64) ^ np.uint64(seed)
        x = (x ^ (x >> np.uint64(33))) * _M1
        x = (x ^ (x >> np.uint64(33))) * _M2
        return x ^ (x >> np.uint64(33))


def check_hashed(name: str, capacity, admit_after, evict, on_evict) -> None:
    """Raise naming the argument unless a hashed table's settings are valid."""
    if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
        raise ValueError(f"table {name!r}: capacity must be a positive int, got {capacity!r}")
    if not isinstance(admit_after, int) or isinstance(admit_after, bool) or admit_after < 1:
        raise ValueError(f"table {name!r}: admit_after must be an int >= 1, got {admit_after!r}")
    if not callable(evict) and evict not in POLICIES:
        raise ValueError(f"table {name!r}: evict must be one of {POLICIES} or a function of "
                         f"(count, last_step) giving each row's score, got {evict!r}")
    if on_evict is not None and not callable(on_evict):
        raise TypeError(f"table {name!r}: on_evict must be callable or None, got {on_evict!r}")


class Found(NamedTuple):
    """``IdMap.find``'s answer: each id's row (or EMPTY) and its slot (or -1)."""
    rows: np.ndarray
    slots: np.ndarray


class IdMap:
    """Int64 ids to rows: open addressing over a power-of-two number of slots (at least twice
    the rows, so probes stay short), linear probing (``ops._hash_find`` / ``_hash_insert``);
    erased slots are skipped by a search and reused by an insert, and the map is rebuilt when
    they pile up.

    Args:
        capacity: the most ids held at once.

    Example::

        m = IdMap(100)
        m.insert(np.array([7, -3]), np.array([0, 1]))
        m.find(np.array([-3, 5])).rows    # array([1, -1])
    """

    def __init__(self, capacity: int):
        self.slots = 1 << max(6, (2 * capacity - 1).bit_length())
        self.keys = np.zeros(self.slots, dtype=np.int64)
        self.rows = np.full(self.slots, EMPTY, dtype=np.int64)
        self.held, self.erased = 0, 0

    def find(self, ids: np.ndarray) -> "Found":
        """The row of each of `ids` (or EMPTY) and the slot holding it (or -1)."""
        rows, slots = ops._hash_find(torch.from_numpy(self.keys), torch.from_numpy(self.rows),
                                     torch.from_numpy(np.ascontiguousarray(ids, np.int64)))
        return Found(rows.numpy(), slots.numpy())

    def insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        """Hold distinct `ids` (none held already) at `rows`."""
        if self.held + self.erased + ids.size > self.slots * 3 // 4:
            self._rebuild(extra=ids.size)
        reused = ops._hash_insert(torch.from_numpy(self.keys), torch.from_numpy(self.rows),
                                  torch.from_numpy(np.ascontiguousarray(ids, np.int64)),
                                  torch.from_numpy(np.ascontiguousarray(rows, np.int64)))
        self.erased -= int(reused)
        self.held += ids.size

    def erase(self, slots: np.ndarray) -> None:
        """Drop the ids held at `slots` (from ``find``)."""
        self.rows[slots] = ERASED
        self.held -= slots.size
        self.erased += slots.size

    def items(self) -> tuple:
        """(every id held, its row)."""
        live = np.flatnonzero(self.rows >= 0)
        return self.keys[live], self.rows[live]

    def clear(self) -> None:
        self.rows.fill(EMPTY)
        self.held = self.erased = 0

    def _rebuild(self, extra: int) -> None:
        """Every id held put back without the erased slots (grown where `extra` more ids would
        fill three quarters of the slots)."""
        ids, rows = self.items()
        while (ids.size + extra) > self.slots * 3 // 4:
            self.slots *= 2
        self.keys = np.zeros(self.slots, dtype=np.int64)
        self.rows = np.full(self.slots, EMPTY, dtype=np.int64)
        self.held = self.erased = 0
        self.insert(ids, rows)


class CountSketch:
    """Occurrences of ids without a row: a count-min sketch (four rows of counters, each id a
    counter a row; its count the least of its four), updated conservatively. It may count an
    id early (another id sharing all four counters), never late.

    Args:
        capacity: the table's rows (the sketch has four times as many counters a row, at least
            1,024 and at most 4 M).

    Example::

        sketch = CountSketch(1000)
        sketch.add(np.array([5, 9]), np.array([2, 1]))   # array([2, 1])
    """

    def __init__(self, capacity: int):
        width = 1 << min(22, max(10, (4 * capacity - 1).bit_length()))
        self.mask = np.uint64(width - 1)
        self.counts = np.zeros((len(_SEEDS), width), dtype=np.int64)

    def add(self, ids: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Count distinct `ids` `counts` times more; their counts now."""
        at = [(mix(ids, seed) & self.mask).astype(np.int64) for seed in _SEEDS]
        now = np.min([row[a] for row, a in zip(self.counts, at)], axis=0) + counts
        for row, a in zip(self.counts, at):
            np.maximum.at(row, a, now)
        return now

    def clear(self) -> None:
        self.counts.fill(0)


class HashedRows:
    """One hashed table: any int64 id to a row of ``table``'s rows ``[offset, offset +
    capacity)``, admitted, scored and evicted as the module docstring says.

    Args:
        name: the table's name (its errors and ``on_evict`` name it).
        table: the host rows; offset: the table's first row there; capacity: its rows.
        admit_after: occurrences an id needs before it gets a row (1: at once).
        evict: "lru" (the row touched longest ago), "lfu" (the fewest touches, then the
            oldest), or a function ``(count, last_step) -> score`` of int64 tensors (the
            lowest score goes first).
        on_evict: ``on_evict(name, ids, weights, state)``, called with each evicted row's id,
            weight and optimizer state (a dict of tensors, a row an id) before its row is
            reused; None: evictions are counted only.

    Example::

        rows = HashedRows("user", table, 0, 1000, admit_after=2)
        rows.tick()
        rows.rows_for(np.array([2**40, 7, 2**40]), training=True)   # [0, -1, 0]
    """

    def __init__(self, name: str, table: HostTable, offset: int, capacity: int,
                 admit_after: int = 1, evict: Union[str, Callable] = "lru",
                 on_evict: Optional[Callable] = None):
        check_hashed(name, capacity, admit_after, evict, on_evict)
        self.name, self.table, self.offset, self.capacity = name, table, offset, capacity
        self.admit_after, self.evict, self.on_evict = admit_after, evict, on_evict
        self.init: Optional[Callable] = None  # a new row's weight: zero, or init(weight)
        self.map = IdMap(capacity)
        self.sketch = CountSketch(capacity) if admit_after > 1 else None
        self.id_of = np.zeros(capacity, dtype=np.int64)
        self.count = np.zeros(capacity, dtype=np.int64)  # touches
        self.last = np.full(capacity, -1, dtype=np.int64)  # the step of the last touch
        self.free = np.arange(capacity - 1, -1, -1, dtype=np.int64)  # a stack: pop the end
        self.used = np.zeros(capacity, dtype=bool)  # rows holding an id
        self.clock = 0  # training forwards so far
        self.version = 0  # rises with every change of the rows (a forward, a reset, a load)
        self.stamp = np.zeros(capacity, dtype=np.int64)  # the version of a row's last change
        # (version, ids) of each eviction since the latest save (``mark``, its version; None
        # before any): the next increment's tombstones. Kept only after a save, so a run that
        # never saves keeps none.
        self.removed: list = []
        self.mark: Optional[int] = None
        self.stats = {"admitted": 0, "evicted": 0, "not_admitted": 0}
        self.sync: Callable[[], None] = lambda: None  # waits for writes queued to the rows

    @property
    def held(self) -> int:
        """Ids with a row now."""
        return self.map.held

    def tick(self) -> None:
        """A training forward begins: rows touched from now on are this step's, never
        evicted by it."""
        self.clock += 1
        self.version += 1

    def rows_for(self, ids: np.ndarray, training: bool) -> np.ndarray:
        """The row of each of `ids` (int64) in ``[0, capacity)``, or -1 where it has none. A
        training forward counts, admits and evicts; any other only reads."""
        uniq, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        rows, _ = self.map.find(uniq)
        if training and uniq.size:
            hit = rows >= 0
            self.last[rows[hit]] = self.clock
            self.stamp[rows[hit]] = self.version
            self.count[rows[hit]] += counts[hit]
            new = np.flatnonzero(~hit)
            if self.sketch is not None and new.size:
                new = new[self.sketch.add(uniq[new], counts[new]) >= self.admit_after]
            if new.size:
                given = self._rows_for_new(new.size)
                new = new[:given.size]  # the rest find no row this step
                self._start(given, uniq[new], counts[new])
                self.map.insert(uniq[new], given)
                rows[new] = given
        out = rows[inverse.reshape(-1)]
        self.stats["not_admitted"] += int((out < 0).sum())
        return out

    def _rows_for_new(self, n: int) -> np.ndarray:
        """Up to `n` rows for new ids: free ones, then the lowest-scored rows not touched in
        this step, handed to ``on_evict`` first."""
        take = min(n, self.free.size)
        rows = self.free[self.free.size - take:][::-1].copy()
        victims = np.zeros(0, dtype=np.int64)
        if take < n:
            held = self.id_of_rows()
            older = held[self.last[held] < self.clock]
            victims = older[self._lowest(older, n - take)]
        if victims.size:
            self.sync()  # the rows may still be written by the last step's commit
            self._hand_over(victims)  # may raise: nothing has changed yet
            if self.mark is not None:
                self.removed.append((self.version, self.id_of[victims].copy()))
            self.used[victims] = False
            _, slots = self.map.find(self.id_of[victims])
            self.map.erase(slots)
            self.stats["evicted"] += victims.size
        self.free = self.free[:self.free.size - take]
        return np.concatenate([rows, victims])

    def id_of_rows(self) -> np.ndarray:
        """The rows that hold an id, ascending."""
        return np.flatnonzero(self.used)

    def _lowest(self, rows: np.ndarray, n: int) -> np.ndarray:
        """Positions of the `n` lowest-scored of `rows` (all where there are no more)."""
        if rows.size <= n:
            return np.arange(rows.size)
        if self.evict == "lru":
            score = self.last[rows]
        elif self.evict == "lfu":
            score = self.count[rows] * (self.clock + 2) + self.last[rows] + 1
        else:
            got = self.evict(torch.from_numpy(self.count[rows].copy()),
                             torch.from_numpy(self.last[rows].copy()))
            score = torch.as_tensor(got).reshape(-1).numpy()
            if score.shape != rows.shape:
                raise ValueError(f"table {self.name!r}: evict returned {score.shape[0]} scores "
                                 f"for {rows.size} rows")
        # The n lowest, ties broken by the lower id: the choice depends on the scores and the
        # ids only, never on where rows sit (a loaded checkpoint evicts as its source would).
        kth = np.partition(score, n - 1)[n - 1]
        below, ties = np.flatnonzero(score < kth), np.flatnonzero(score == kth)
        need = n - below.size
        if need < ties.size:
            ties = ties[np.argpartition(self.id_of[rows[ties]], need - 1)[:need]]
        return np.concatenate([below, ties])

    def _hand_over(self, victims: np.ndarray) -> None:
        """Evicted rows, with their state, to ``on_evict`` (copies)."""
        if self.on_evict is None:
            return
        at = torch.from_numpy(victims + self.offset)
        state = {key: self.table.view(key).index_select(0, at) for key in self.table.state_keys}
        self.on_evict(self.name, torch.from_numpy(self.id_of[victims].copy()),
                      self.table.view("weight").index_select(0, at), state)

    @torch.no_grad()
    def _start(self, rows: np.ndarray, ids: np.ndarray, counts: np.ndarray) -> None:
        """Rows given to new `ids`: the weight at its initial value, the state at its fills,
        the scores begun."""
        self.id_of[rows], self.count[rows], self.last[rows] = ids, counts, self.clock
        self.stamp[rows] = self.version
        self.used[rows] = True
        self.stats["admitted"] += rows.size
        self.write_start(rows)

    @torch.no_grad()
    def write_start(self, rows: np.ndarray) -> None:
        """`rows` (of the table's) at a new row's values: zero or ``init``, state filled."""
        at = torch.from_numpy(rows + self.offset)
        # One record (a zero weight, the state at its fills) copied whole into each row: the
        # fields' strided views would fill one element at a time.
        host, layout = self.table.host, self.table.layout
        record = torch.zeros((1, 1, host.shape[2]), dtype=host.dtype)
        for key, fill in self.table.fills.items():
            layout.of_table(record, key).fill_(fill)
        host.index_put_((at,), record[0])
        if self.init is not None:
            weight = self.table.view("weight")
            start = torch.zeros((rows.size, weight.shape[1]), dtype=weight.dtype)
            self.init(start)
            weight.index_copy_(0, at, start)

    # ---- checkpoints ---------------------------------------------------------------------

    def held_rows(self) -> tuple:
        """(the ids held, ascending; their rows)."""
        ids, rows = self.map.items()
        order = np.argsort(ids, kind="stable")
        return ids[order], rows[order]

    def scores(self, rows: np.ndarray) -> dict:
        """The scores of `rows` and the table's clock and version, for a full save (which the
        next increment follows)."""
        self.mark, self.removed = self.version, []
        return {"count": torch.from_numpy(self.count[rows].copy()),
                "last_step": torch.from_numpy(self.last[rows].copy()),
                "clock": torch.tensor(self.clock), "version": torch.tensor(self.version)}

    def touch_all(self) -> None:
        """Every held row changed (a reset): the next increment holds them all."""
        self.version += 1
        self.stamp[self.used] = self.version

    def changes(self, since: int) -> tuple:
        """(the rows changed after version `since`, ascending by id; the ids evicted after
        it), `since` the latest save's version (raises otherwise: the evictions before the
        latest save are forgotten); the increment is then the latest save."""
        if since != self.mark:
            raise ValueError(f"since: table {self.name!r} was last saved at version "
                             f"{self.mark}, since names {since}: an increment follows the "
                             "latest save (state_dict() or incremental_state_dict())")
        _, rows = self.held_rows()
        keep = self.stamp[rows] > since
        gone = np.concatenate([i for _, i in self.removed] or [np.zeros(0, np.int64)])
        self.mark, self.removed = self.version, []
        return rows[keep], gone

    def _check_ids(self, ids, key: str = "ids", distinct: bool = True) -> Optional[str]:
        """Why checkpoint entry `key` is not a 1-D int64 tensor (of distinct ids)."""
        if not isinstance(ids, Tensor) or ids.dim() != 1 or ids.dtype != torch.int64:
            return f"{self.name}.{key}: a 1-D int64 tensor, got {_described(ids)}"
        if distinct and np.unique(ids.numpy()).size != ids.numel():
            return f"{self.name}.{key}: the ids must be distinct"
        return None

    def check_upsert(self, ids: Tensor, gone: Tensor) -> Optional[str]:
        """Why an increment's `ids` (changed) and `gone` (evicted) cannot apply (None: they
        can): ids distinct int64, and room for the new ones."""
        why = self._check_ids(ids) or self._check_ids(gone, "removed", distinct=False)
        if why is not None:
            return why
        held_gone = int((self.map.find(gone.numpy()).rows >= 0).sum()) if gone.numel() else 0
        stays = (self.map.find(ids.numpy()).rows >= 0) & ~np.isin(ids.numpy(), gone.numpy())
        new = int((~stays).sum())
        if self.held - held_gone + new > self.capacity:
            return (f"{self.name}.ids: {new} new ids do not fit a table of capacity "
                    f"{self.capacity} holding {self.held - held_gone}")
        return None

    def upsert(self, ids: Tensor, gone: Tensor, count: Tensor, last: Tensor, clock: int,
               version: int) -> np.ndarray:
        """Apply an increment (checked by ``check_upsert``) taken at `clock` and `version`:
        `gone` ids dropped, `ids` given rows (their own where they hold one) with their scores;
        their rows, for the caller to write."""
        rows, slots = self.map.find(gone.numpy())
        if (rows >= 0).any():
            self.map.erase(slots[rows >= 0])
            self.used[rows[rows >= 0]] = False
            self.free = np.concatenate([self.free, rows[rows >= 0][::-1]])
        self.clock, self.version = max(self.clock, int(clock)), int(version)
        self.mark, self.removed = self.version, []
        want = ids.numpy().copy()
        rows, _ = self.map.find(want)
        new = np.flatnonzero(rows < 0)
        if new.size:
            rows[new] = self.free[self.free.size - new.size:][::-1]
            self.free = self.free[:self.free.size - new.size]
            self.map.insert(want[new], rows[new])
        self.id_of[rows], self.used[rows], self.stamp[rows] = want, True, self.version
        self.count[rows], self.last[rows] = count.numpy(), last.numpy()
        return rows

    def check_load(self, ids: Tensor, count: Tensor, last: Tensor) -> Optional[str]:
        """Why `ids` and their scores cannot load (None: they can)."""
        why = self._check_ids(ids)
        if why is None and ids.numel() > self.capacity:
            why = f"{self.name}.ids: {ids.numel()} ids for a table of capacity {self.capacity}"
        if why is not None:
            return why
        for key, value in (("count", count), ("last_step", last)):
            if not isinstance(value, Tensor) or tuple(value.shape) != tuple(ids.shape):
                return f"{self.name}.{key}: shape {tuple(ids.shape)}, got {_described(value)}"
        return None

    def load(self, ids: Tensor, count: Tensor, last: Tensor, clock: int,
             version: Optional[int] = None) -> None:
        """Hold `ids` at rows 0, 1, ... (their rows already written there) with their scores;
        checked first by ``check_load``."""
        n = ids.numel()
        self.map.clear()
        if self.sketch is not None:
            self.sketch.clear()
        self.map.insert(ids.numpy().copy(), np.arange(n, dtype=np.int64))
        self.id_of[:n] = ids.numpy()
        self.count[:n], self.last[:n] = count.numpy(), last.numpy()
        self.free = np.arange(self.capacity - 1, n - 1, -1, dtype=np.int64)
        self.used[:] = False
        self.used[:n] = True
        self.clock = max(int(clock), int(self.last[:n].max()) if n else 0)
        self.version = self.clock if version is None else int(version)
        self.stamp[:] = 0
        self.stamp[:n] = self.version
        self.mark, self.removed = self.version, []


def _described(value) -> str:
    if isinstance(value, Tensor):
        return f"shape {tuple(value.shape)} {value.dtype}"
    return type(value).__name__
