"""A collection's tables as a whole (a part of ``HostEmbeddingBagCollection``): where each
table's rows live, their counts, the cache budget's split and the tables' initialisation."""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from .collection_hashed import hashed_stats, load_increment, pad_row, reset_hashed
from .collection_io import save_collection
from .table_config import table_index
from .training.cache import cache_slots, check_cache_bytes
from .training.table import normal_init


class TablePlace(NamedTuple):
    """Where a table's rows live: its width group, its first row there and its rows."""
    group: int
    offset: int
    rows: int


class CollectionTables:
    """The collection's tables as a whole: ``cache_stats``, ``set_cache_bytes``,
    ``reset_parameters``, ``place``, ``tables_of``, ``table_weight`` (a part of
    ``HostEmbeddingBagCollection``, over its ``tables``, ``groups``, ``hashed`` and rows)."""

    def cache_stats(self) -> dict:
        """Per group of tables ("dim<D>", or "dim<D>-<dtype>" where tables of one width have
        several dtypes, "-<group>" after it where a conversion gave them one) and in total
        ("total"): HostEmbedding.cache_stats's counts (the tables
        of a group share one cache); per table (by name): distinct rows looked up, cache hits
        and the hit rate, under "tables". Reading them waits for the GPU."""
        for g in self.groups:  # the counting queued so far
            g.store.counters()
        per_table = self._table_stats.tolist()
        widths = [g.embedding_dim for g in self.groups]
        out = {}
        for n, g in enumerate(self.groups):
            name = f"dim{g.embedding_dim}"
            if widths.count(g.embedding_dim) > 1:
                name += "-" + str(g.dtype).removeprefix("torch.")
            out[name if name not in out else f"{name}-{n}"] = g.cache_stats()
        total = {}
        for stats in out.values():
            for key, value in stats.items():
                if key != "hit_rate":
                    total[key] = total.get(key, 0) + value
        total["hit_rate"] = total["hits"] / total["lookups"] if total["lookups"] else 0.0
        out["total"] = total
        out["tables"] = {t.name: {"lookups": lookups, "hits": hits,
                                  "hit_rate": hits / lookups if lookups else 0.0,
                                  **(hashed_stats(self, k) if k in self.hashed else {})}
                         for k, (t, (lookups, hits)) in enumerate(zip(self.tables, per_table))}
        return out

    def set_cache_bytes(self, cache_bytes: int) -> None:
        """The GPU row caches' budget for all tables (0: none), as
        ``HostEmbedding.set_cache_bytes`` (between steps; a ``CapturedStep`` made before must
        not replay): shared by the groups by their tables' bytes; a share too small for a
        group's index and one row leaves that group without a cache."""
        check_cache_bytes(cache_bytes)
        # A group of hashed tables has no cache: a row given to another id is written on the
        # host, where a cached copy would not see it.
        sizes = [0 if pad_row(self, n) is not None else g.num_embeddings * g.row_bytes
                 for n, g in enumerate(self.groups)]
        for g, size in zip(self.groups, sizes):
            share = cache_bytes * size // max(1, sum(sizes))
            fits = cache_slots(share, g.num_embeddings, g.row_bytes, strict=False) > 0
            g.set_cache_bytes(share if fits and size else 0)

    def reset_parameters(self, init=None) -> None:
        """Re-initialise each table's weight in place, and its optimizer state, as
        ``HostEmbedding.reset_parameters``: `init` a function of a table's weight (its rows
        held here, dim), or a dict of them by table name (a table not named, or init None:
        normal(0, 1), as nn.Embedding's; a hashed table's held rows, and those it gives new
        ids from now on, at `init` or zero); cached copies are dropped."""
        inits = dict(init) if isinstance(init, dict) else {t.name: init for t in self.tables}
        unknown = sorted(set(inits) - {t.name for t in self.tables})
        if unknown:
            raise KeyError(f"init: no table named {unknown}")
        for g, group in enumerate(self.groups):
            mine = [k for k in range(len(self.tables)) if self._group_of[k] == g]

            def each_table(weight, mine=mine):
                for k in mine:
                    if k in self.hashed:
                        reset_hashed(self, k, inits.get(self.tables[k].name))
                        continue
                    rows = weight[self._offset[k]:self._offset[k] + self._rows[k]]
                    fn = inits.get(self.tables[k].name) or normal_init
                    fn(rows)
            group.reset_parameters(each_table)

    def place(self, k: int) -> TablePlace:
        """Where table `k`'s rows live: its width group, its first row there, its rows held."""
        return TablePlace(self._group_of[k], self._offset[k], self._rows[k])

    def tables_of(self, g: int) -> list:
        """The positions of width group `g`'s tables, in their row order."""
        return [k for k in range(len(self.tables)) if self._group_of[k] == g]

    def table_weight(self, name: str) -> Tensor:
        """Table `name`'s weight (a view of the host table; flushed first). A hashed table's
        rows are in its ``state_dict`` (``<table>.weight`` beside ``<table>.ids``)."""
        k = table_index(self.tables, name)
        if k in self.hashed:
            raise TypeError(f"table {name!r} is hashed: its rows and their ids are in "
                            f"state_dict() ({name}.weight, {name}.ids)")
        g = self.groups[self._group_of[k]]
        return g.weight[self._offset[k]:self._offset[k] + self._rows[k]]

    def incremental_state_dict(self, since: dict) -> dict:
        """The rows changed after the save `since` (a ``state_dict()`` of this collection, or
        an earlier increment): each hashed table's changed ids with their rows, state and
        scores, the ids it evicted since (``<table>.removed``) and the version it follows
        (``<table>.since``); dense tables and the groups' scalars whole. `since` must be the
        latest save (a ``state_dict()`` or an increment; an older one raises), which this
        increment then replaces as the latest.

        Example::

            base = ebc.state_dict(); ...train...; inc = ebc.incremental_state_dict(base)
            fresh.load_state_dict(base); fresh.load_increment(inc)
        """
        out: dict = {}
        save_collection(self, out, "", since)
        return {key: value.detach().clone() if isinstance(value, Tensor) else value
                for key, value in out.items()}

    def load_increment(self, increment: dict) -> None:
        """Apply an ``incremental_state_dict`` onto the save it follows (an error names the
        entry and writes nothing: ``collection_hashed.load_increment``)."""
        load_increment(self, increment)

