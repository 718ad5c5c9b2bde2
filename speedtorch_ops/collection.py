"""Collections of tables trained in one step, in TorchRec's conventions:
``HostEmbeddingBagCollection`` (pooled features, like ``EmbeddingBagCollection``) and
``HostEmbeddingCollection`` (every id's row, like ``EmbeddingCollection``).

    tables = [TableConfig("user", 4_000_000, 128, pooling="sum"),
              TableConfig("item", 1_000_000, 128, pooling="mean", feature_names=["item", "seen"])]
    ebc = HostEmbeddingBagCollection(tables, optimizer=torch.optim.Adam,
                                     optimizer_kwargs={"lr": 1e-3}, cache_bytes=2**30)
    out = ebc(KeyedJaggedTensor.from_lengths_sync(keys, values, lengths))  # a KeyedTensor
    out["user"]  # (B, 128); out.values(): (B, 384), features side by side
    loss.backward(); ebc.step()

Tables of one width are one table underneath (a ``HostEmbedding`` of their rows stacked, each
table at its row offset), so a step plans all of them at once: one sort of their ids, one cache
lookup, one transfer of their misses, one of their write-backs, one optimizer update (fused
where ``HostEmbedding.fused`` says). Tables of different widths or dtypes (``TableConfig.dtype``,
default the collection's ``dtype``) form one such group each. Every table of a collection
shares its optimizer and hyper-parameters; the cache budget is split between the groups by
their bytes. Several features may share a table.

``forward(features)`` takes a jagged batch with ``keys()``, ``values()``, ``lengths()`` (the
bags and each feature's ids follow from them) and, for a collection built
``is_weighted=True``, ``weights()`` (per-sample weights of sum-pooled features; ignored
otherwise, as TorchRec's), TorchRec's
``KeyedJaggedTensor`` or ``speedtorch_ops.KeyedJaggedTensor``; keys the collection does not
know are ignored, a feature it needs and does not find raises. It returns TorchRec's types
(``keyed.py``): with every feature pooled a ``KeyedTensor`` of ``(stride, D)`` per feature (an
empty bag gives zeros); otherwise a dict by feature of a ``JaggedTensor`` (``values()``: the
feature's ids' rows, ``lengths()``: its samples') for each ``pooling="none"`` feature and a
``(stride, D)`` tensor for each pooled one. Ids are checked per feature against its table's
rows (host ids on the host; ids on the GPU with one wait unless ``bounds_check="prechecked"``):
a bad id raises naming the feature and nothing is written.

``state_dict()`` holds each table as ``"<table>.weight"`` and ``"<table>.optimizer.<state>"``
(the shapes and dtype a ``HostEmbedding`` of that table has; a step count, and a 16-bit
group's rounding seed and counter, are its group's); ``step()``,
``flush()``, ``discard()``, ``prefetch(next_features)``, ``cache_stats()`` and
``speedtorch_ops.CapturedStep`` work as for ``HostEmbedding``.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import List, NamedTuple, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .eager import compile_eagerly, eager
from .collection_batch import check_batch, host_offsets, layout_batch
from .keyed import collection_outputs
from .modules import HostEmbedding
from .collection_io import CheckpointNames, load_collection, save_collection
from .collection_hashed import build_hashed, hashed_group_rows, pad_row, refuse_capture, tick
from .collection_tables import CollectionTables
from .table_config import TableConfig, table_configs
from .training.table import check_state_dtype
from .training.cache import check_cache_bytes
from .training.placement import resolve_dtype, upload
from .training.plan import check_bounds_mode

def _kind(t: TableConfig, dtype, state_dtype) -> tuple:
    """(width, dtype, state dtype setting) of table `t`: the tables of one kind share a group.
    The collection's dtype and state_dtype where the table names none (float64 tables keep
    float64 state); the table's own checked as given."""
    table_dtype = resolve_dtype(t.dtype or dtype)
    setting = t.state_dtype or (state_dtype if table_dtype != torch.float64 else None)
    try:
        setting = check_state_dtype(setting, table_dtype)
    except TypeError as e:
        raise TypeError(f"TableConfig {t.name!r}: {e}") from None
    return t.embedding_dim, table_dtype, setting


def _checked_weighted(is_weighted, cls) -> bool:
    """A collection's `is_weighted`: a bool, False for one that never pools."""
    if not isinstance(is_weighted, bool):
        raise TypeError(f"is_weighted must be a bool, got {is_weighted!r}")
    if is_weighted and not cls._pooled:
        raise ValueError(f"is_weighted: {cls.__name__} never pools, so it takes no weights (as "
                         "TorchRec's EmbeddingCollection)")
    return is_weighted


class _Group(HostEmbedding):
    """The tables of one width stacked into one HostEmbedding. Its state lives in the
    collection's state_dict under the tables' names, so its own keys are never emitted."""

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        pass

    def _load_from_state_dict(self, *args, **kwargs) -> None:
        pass


@dataclass
class _Feature:
    name: str
    table: int   # position in the collection's tables
    pooling: str


class GroupIds(NamedTuple):
    """A width group's part of a batch: its features in output order, their ids as rows of the
    group (each table's row offset added) on the collection's device, and where each feature's
    ids start in them."""
    features: list
    flat: Tensor
    starts: list


class Prepared(NamedTuple):
    """A forward's batch checked and laid out: its weights (None unweighted), lengths and
    stride, each feature's ``Span``, and each group's ``GroupIds``."""
    weights: Optional[Tensor]
    lengths: Tensor
    stride: int
    at: dict
    grouped: list


class _Piece(NamedTuple):
    """Ids of one table side by side in a batch's values: [start, end)."""
    start: int
    end: int
    table: int


def _capturing(coll) -> bool:
    """Whether a CUDA graph capture is on for collection `coll`'s device (a capture holds no
    host buffer's copy, so prepared batches wait)."""
    return coll.device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _on(flat: Tensor, device: torch.device) -> Tensor:
    """A group's host ids on `device` (queued: they sit in pinned memory)."""
    return flat.to(device, non_blocking=True) if flat.device != device else flat


@dataclass
class _Named:
    batch: object
    work: object  # a Future of the host Prepared, or the Prepared on the device


class _Ahead:
    """The batches a collection's ``prepare_next`` named (the last two: a loader names one
    before the step of the one before it has run), each with its preparation: a future of
    ``_prepare(batch, host=True)`` on the worker thread, then its ``Prepared`` on the device
    once a ``step()`` found it done (its rows' prefetch started)."""

    _pool: Optional[ThreadPoolExecutor] = None  # one worker for every collection

    def __init__(self):
        self.named: List[_Named] = []

    def name(self, coll, features) -> None:
        values = getattr(features, "values", None)
        values = values() if callable(values) else None
        if (coll.hashed or not isinstance(values, Tensor) or values.device.type != "cpu"
                or type(coll).forward is not HostEmbeddingBagCollection.forward):
            return  # a forward of its own (sharded) does not take prepared batches
        if _Ahead._pool is None:
            _Ahead._pool = ThreadPoolExecutor(1, thread_name_prefix="speedtorch_ops-prepare")
        work = _Ahead._pool.submit(coll._prepare, features, True, True)
        self.named = self.named[-1:] + [_Named(features, work)]

    def settle(self, coll) -> None:
        """In a step(), its update queued: the newest preparation, if done, sent to the
        device and its rows' prefetch started (an error waits for the batch's own forward)."""
        if not self.named or _capturing(coll):
            return
        last = self.named[-1]
        work = last.work
        if isinstance(work, Future) and work.done() and work.exception() is None:
            last.work = self.on_device(coll, work.result())
            if coll.device.type == "cuda":  # a CPU step reads the host table itself
                coll._prefetch(last.work.grouped)

    def take(self, coll, features) -> Optional[Prepared]:
        """The ``Prepared`` on the device of `features` if it was named (its error raised
        here; it and the batches named before it are then forgotten), else None."""
        at = next((k for k, n in enumerate(self.named) if n.batch is features), None)
        if at is None or _capturing(coll):
            return None
        work = self.named[at].work
        del self.named[:at + 1]
        return self.on_device(coll, work.result()) if isinstance(work, Future) else work

    @staticmethod
    def on_device(coll, p: Prepared) -> Prepared:
        """`p`'s groups' ids (in pinned buffers) sent to the collection's device."""
        return p._replace(grouped=[g._replace(flat=_on(g.flat, coll.device))
                                   for g in p.grouped])


class HostEmbeddingBagCollection(CollectionTables, CheckpointNames, nn.Module):
    """Tables in host memory trained as one step (see the module docstring).

    Args:
        tables: the ``TableConfig`` of each table (distinct names, distinct feature names).
        optimizer, optimizer_kwargs: the torch optimizer class every table trains with, and its
            arguments (as HostEmbedding's).
        device: where a step's rows are staged (default: the current GPU, else the CPU).
        cache_bytes: the GPU row cache's budget for all tables (0: none).
        bounds_check: "raise" (ids on a GPU checked with one wait) or "prechecked".
        dtype: the tables' dtype, where their TableConfig names none.
        state_dtype: their optimizer state's dtype, where their TableConfig names none (None:
            each table's own dtype; float64 tables keep float64 state), as HostEmbedding's.
        stochastic_rounding: as HostEmbedding's (float16 and bfloat16 tables round their
            fused updates stochastically unless False).
        is_weighted: as TorchRec's: True, the batch's per-id weights (``weights_or_none()`` or
            ``weights()``; required) weigh the sum-pooled features' ids, in the table's dtype or
            float32 (TorchRec's; cast to the table's); False, a batch's weights are ignored, as
            TorchRec's ``EmbeddingBagCollection`` ignores them.

    Returns (forward): a ``KeyedTensor`` (``kt["f"]``: ``(stride, D)``; ``values()``: the
    features side by side, in the order of the tables' features) when every table pools; else
    a dict by feature: a ``JaggedTensor`` for ``pooling="none"``, ``(stride, D)`` otherwise.

    Example::

        ebc = HostEmbeddingBagCollection(
            [TableConfig("user", 4_000_000, 128), TableConfig("tag", 50_000, 32, "mean")],
            optimizer=torch.optim.Adagrad, optimizer_kwargs={"lr": 0.05}, cache_bytes=1 << 30)
        out = ebc(KeyedJaggedTensor.from_lengths_sync(["user", "tag"], values, lengths))
        (out["user"].sum() + out["tag"].sum()).backward(); ebc.step()
    """

    _pooled = True

    def __init__(self, tables: Sequence[TableConfig], optimizer=torch.optim.Adam,
                 optimizer_kwargs: Optional[dict] = None, device=None, cache_bytes: int = 0,
                 bounds_check: str = "raise", dtype=torch.float32,
                 stochastic_rounding: Optional[bool] = None, state_dtype=None,
                 is_weighted: bool = False, _held_rows=None, _spare_rows=0):
        # _held_rows: the rows of each table this module holds (a sharded collection's rank
        # holds a part of each), default all; _spare_rows: rows each group holds past its
        # tables' (a sharded group's padding row).
        super().__init__()
        compile_eagerly(type(self))
        tables, inits = table_configs(tables)  # inits: TorchRec's, run once the tables exist
        names = [t.name for t in tables]
        if len(set(names)) != len(names):
            raise ValueError(f"tables: table names must be distinct, got {names}")
        check_bounds_mode(bounds_check)
        check_cache_bytes(cache_bytes)
        self._is_weighted = _checked_weighted(is_weighted, type(self))
        self.tables = tables
        self._rows = list(_held_rows) if _held_rows is not None else [t.rows for t in tables]
        self.bounds_check = bounds_check
        self.features: List[_Feature] = []
        for k, t in enumerate(tables):
            for f in t.feature_names:
                self.features.append(_Feature(f, k, t.pooling if self._pooled else "none"))
        fnames = [f.name for f in self.features]
        if len(set(fnames)) != len(fnames):
            raise ValueError(f"tables: feature names must be distinct, got {fnames}")
        # One group a (width, dtype, state dtype), tables in their given order at row offsets.
        kinds = [_kind(t, dtype, state_dtype) for t in tables]
        widths = sorted(set(kinds), key=lambda kind: (kind[0], str(kind[1]), str(kind[2])))
        self._group_of = [widths.index(kind) for kind in kinds]
        self._offset = [0] * len(tables)
        rows = [0] * len(widths)
        for k, t in enumerate(tables):
            g = self._group_of[k]
            self._offset[k] = rows[g]
            rows[g] += self._rows[k]
        # A group of hashed tables holds one more row: every id without a row reads it.
        pads = [int(any(t.hashed for k, t in enumerate(tables) if self._group_of[k] == g))
                for g in range(len(widths))]
        groups = [_Group(rows[g] + _spare_rows + pads[g], width,
                         padding_idx=rows[g] + _spare_rows if pads[g] else None,
                         optimizer=optimizer, optimizer_kwargs=optimizer_kwargs, device=device,
                         bounds_check="prechecked", dtype=group_dtype,
                         stochastic_rounding=stochastic_rounding, state_dtype=group_state)
                  for g, (width, group_dtype, group_state) in enumerate(widths)]
        self._default_dtype = dtype
        self.groups = nn.ModuleList(groups)
        self.hashed = build_hashed(self)  # {table position: HashedRows}
        self.hashed_load: dict = {}  # a checkpoint's hashed ids while it loads
        self._ahead = _Ahead()  # the batch prepare_next named, and its preparation
        if cache_bytes and self.device.type != "cuda":
            warnings.warn(f"cache_bytes={cache_bytes} is ignored on the CPU: the tables already "
                          "live in the memory the step runs in", stacklevel=2)
        elif cache_bytes:
            self.set_cache_bytes(cache_bytes)
        self._register_counts()
        if inits:
            self.reset_parameters(inits)

    def _register_counts(self) -> None:
        """Per table (lookups, hits) of distinct rows, counted on the device (a captured step
        counts too); each group's tables end at the rows ``_ends<g>`` of the group. Buffers,
        not state: they follow .to(device) and stay out of the checkpoint."""
        self.register_buffer("_table_stats", torch.zeros((len(self.tables), 2),
                                                         dtype=torch.int64, device=self.device),
                             persistent=False)
        for g in range(len(self.groups)):
            mine = self.tables_of(g)
            ends = [self._offset[k] + self._rows[k] for k in mine]
            self.register_buffer(f"_ends{g}", torch.tensor(ends, device=self.device),
                                 persistent=False)
            self.register_buffer(f"_tables{g}", torch.tensor(mine, device=self.device),
                                 persistent=False)

    @property
    def device(self) -> torch.device:
        return self.groups[0].device

    def is_weighted(self) -> bool:
        """Whether a batch's weights weigh the ids (TorchRec's method)."""
        return self._is_weighted

    def embedding_bag_configs(self) -> List[TableConfig]:
        """The tables' configs, in order (TorchRec's method; ``embedding_configs`` alike)."""
        return list(self.tables)

    embedding_configs = embedding_bag_configs

    @property
    def dtype(self) -> torch.dtype:
        """The collection's dtype: that of the tables whose TableConfig names none (as a
        conversion such as ``.double()`` left them)."""
        for k, t in enumerate(self.tables):
            if t.dtype is None:
                return self.groups[self._group_of[k]].dtype
        return self._default_dtype

    # ---- a step --------------------------------------------------------------------------

    def _group_ids(self, values: Tensor, at: dict, device: torch.device,
                   forward: bool = True, host: bool = False) -> list:
        """Each group's ``GroupIds`` of the batch (`forward`: a forward's, which may give a
        hashed table's ids rows; else a prefetch's, which only reads their map)."""
        out = []
        order = {"none": 0, "sum": 1, "mean": 2}  # a pooling's features stay together
        for g in range(len(self.groups)):
            feats = sorted((f for f in self.features if self._group_of[f.table] == g),
                           key=lambda f: order[f.pooling])
            pieces, starts, n = [], [], 0
            for f in feats:
                span = at[f.name]
                last = pieces[-1] if pieces else None
                if last is not None and last.end == span.start and last.table == f.table:
                    pieces[-1] = last._replace(end=span.end)  # one table's features side by side
                else:
                    pieces.append(_Piece(span.start, span.end, f.table))
                starts.append(n)
                n += span.end - span.start
            if values.device.type == "cpu" and self._offsets_only(pieces):
                flat = self._host_flat(values, pieces, n, device)
                out.append(GroupIds(feats, flat if host else _on(flat, device), starts))
                continue
            trains = forward and self.groups[g].trains
            pieces = [self._stacked(p.table, values[p.start:p.end].to(torch.int64), trains)
                      for p in pieces]
            flat = (pieces[0] if len(pieces) == 1 else torch.cat(pieces) if pieces
                    else values.new_zeros(0, dtype=torch.int64))
            if flat.device != device:
                flat = upload(flat, device) if flat.device.type == "cpu" else flat.to(device)
            out.append(GroupIds(feats, flat, starts))
        return out

    def _offsets_only(self, pieces: list) -> bool:
        """Whether `pieces`' ids become their group's rows by their tables' offsets alone."""
        return (type(self)._stacked is HostEmbeddingBagCollection._stacked
                and not any(p.table in self.hashed for p in pieces))

    def _host_flat(self, values: Tensor, pieces: list, n: int, device: torch.device) -> Tensor:
        """A group's `n` ids of the host `values` in `pieces` as its rows, laid out by NumPy
        straight into the buffer that goes to `device` (pinned for a GPU; ``_on`` sends
        it): torch's CPU ops
        would wake its thread pool, which on a many-core host costs milliseconds a step."""
        buf = torch.empty(n, dtype=torch.int64, pin_memory=device.type == "cuda")
        ids, out, at = values.numpy(), buf.numpy(), 0
        for p in pieces:
            np.add(ids[p.start:p.end], np.int64(self._offset[p.table]),
                   out=out[at:at + p.end - p.start])
            at += p.end - p.start
        return buf

    def _stacked(self, table: int, ids: Tensor, trains: bool = False) -> Tensor:
        """Table `table`'s ids as rows of its group (the table's row offset added; a hashed
        table's mapped, given rows where `trains`)."""
        if table in self.hashed:
            return hashed_group_rows(self, table, ids, trains)
        offset = self._offset[table]
        return ids + offset if offset else ids

    def _prepare(self, features, pooling: bool = True, host: bool = False) -> Prepared:
        """A forward's input checked and laid out; `pooling`: check what the pooling needs
        too (a prefetch only loads rows); `host`: a host batch's ids left in pinned host
        buffers (``_Ahead``'s worker thread, which queues nothing on a GPU)."""
        if not host:
            refuse_capture(self)
        batch, at = layout_batch(self, features)
        check_batch(self, batch, at)
        weights = batch.weights
        for f in self.features:
            if pooling and weights is not None and f.pooling == "mean":
                raise NotImplementedError(f"feature {f.name!r}: per-sample weights need "
                                          "pooling='sum' (as nn.EmbeddingBag)")
        if pooling and self.hashed:  # a forward: no hashed row is given before it can run
            for group in self.groups:
                group.engine.check_restage()
            tick(self)
        return Prepared(weights, batch.lengths, batch.stride, at,
                        self._group_ids(batch.values, at, self.device, pooling, host))

    def _group_rows(self, g: int, flat: Tensor, lookup_only: bool,
                    pool_only: bool = False) -> tuple:
        """(rows, the position of every id of `flat` in them, ``pick(lo, hi, sizes)``: the rows
        of positions lo..hi split into pieces of `sizes`): group `g`'s staged rows
        (`lookup_only`, `pool_only`: as ``RowEngine.stage``'s)."""
        group = self.groups[g]
        engine = group.engine
        d = engine.stage((flat,), group.trains, lookup_only=lookup_only,
                         pool_only=pool_only).distinct
        self._count(g, d)
        staged = engine.staged
        rows = engine.lookup_rows(d.inverse, staged.pad_at if staged is not None else None)

        def pick(lo: int, hi: int, sizes: list) -> tuple:
            if lo == 0 and hi == len(d.inverse):  # the segment sum needs every position
                return engine.lookup(rows, d, sizes)  # no joins
            # split, not slices: its backward is one cat, a slice's a zeroed whole
            return F.embedding(d.inverse[lo:hi], rows).split(sizes)
        return rows, d.inverse, pick

    @eager
    def forward(self, features):
        ready = self._ahead.take(self, features)
        return self._forward(ready if ready is not None else self._prepare(features))

    def _forward(self, p: Prepared) -> dict:
        for group in self.groups:  # before any group drops its staged rows
            group.engine.check_restage()
        at, stride = p.at, p.stride
        outputs = {}
        lens = None
        for g, (feats, flat, starts) in enumerate(p.grouped):
            if not feats:
                continue
            group = self.groups[g]
            # Features without pooling alone read the rows through the engine's lookup only;
            # pooled ones alone (weights without a gradient), through its pooling only.
            rows, index, pick = self._group_rows(
                g, flat, all(f.pooling == "none" for f in feats),
                all(f.pooling != "none" for f in feats)
                and (p.weights is None or not p.weights.requires_grad))
            for mode in ("none", "sum", "mean"):
                mine = [(f, s) for f, s in zip(feats, starts) if f.pooling == mode]
                if not mine:
                    continue
                spans = [at[f.name] for f, _ in mine]
                sizes = [span.end - span.start for span in spans]
                _, lo = mine[0]
                hi = lo + sum(sizes)
                if mode == "none":
                    for (f, _), piece in zip(mine, pick(lo, hi, sizes)):
                        outputs[f.name] = piece
                    continue
                # The bags from the lengths, which placed the features' ids.
                if self.device.type == "cpu" and p.lengths.device.type == "cpu":
                    bags = host_offsets(p.lengths, spans, stride, hi - lo)
                else:
                    if lens is None:
                        lens = p.lengths.to(torch.int64)
                        lens = (upload(lens, self.device) if lens.device.type == "cpu"
                                else lens.to(self.device))
                    mode_lens = torch.cat([lens[span.key * stride:(span.key + 1) * stride]
                                           for span in spans])
                    bags = torch.cat([torch.cumsum(mode_lens, 0) - mode_lens,
                                      torch.full((1,), hi - lo, dtype=torch.int64,
                                                 device=self.device)])
                psw = None
                if p.weights is not None and mode == "sum":
                    psw = torch.cat([p.weights[span.start:span.end] for span in spans])
                    psw = psw.to(self.device, group.dtype)
                pooled = group.engine.pool(rows, index, lo, hi, bags, mode, psw)
                # sizes, not a split size: a split of size 0 gives no piece at all
                for (f, _), piece in zip(mine, pooled.split([stride] * len(mine))):
                    outputs[f.name] = piece
        return collection_outputs(self.features, outputs, p.lengths, p.stride, p.at)

    def _count(self, g: int, d) -> None:
        """Add a stage's distinct rows of group `g`, and the cache's hits among them, to their
        tables' counts: the distinct ids ascend and each table holds a range of the group's
        rows, so a table's counts are differences of running counts at its end (a few
        searches, not an add a row: those pile onto a handful of counters)."""
        group = self.groups[g]
        ends, mine = getattr(self, f"_ends{g}"), getattr(self, f"_tables{g}")
        if self.device.type == "cpu":  # no cache, no hits; NumPy wakes no thread pool
            upto = np.searchsorted(d.ids.numpy()[:int(d.count)], ends.numpy())
            self._table_stats.numpy()[mine.numpy(), 0] += np.diff(upto, prepend=0)
            return
        # On the store's books: nothing in the step reads the counts. What is made there
        # stays there (the Distinct's key, made here, would be another stream's to use).
        with group.store.counting(d):
            key = torch.where(d.valid, d.ids, torch.iinfo(torch.int64).max)
            upto = torch.searchsorted(key, ends)  # distinct rows below each table's end
            hits = group.store.last_hits()
            zero = upto.new_zeros(1)
            hits_upto = (torch.cat([zero, torch.cumsum(hits, 0)])[upto] if hits is not None
                         else torch.zeros_like(upto))
            counts = torch.stack([torch.diff(upto, prepend=zero),
                                  torch.diff(hits_upto, prepend=zero)], 1)
            self._table_stats.index_add_(0, mine, counts)
        if group.engine.staged is None:  # a read-only forward: no commit will join the counting
            group.store.join_books()

    @eager
    def step(self) -> None:
        """Update every table's touched rows (and state) and commit them; then prepare the
        batch ``prepare_next`` named, if any."""
        self._step_groups()
        self._ahead.settle(self)

    @eager
    def prepare_next(self, features) -> None:
        """Name the next step's batch (ids on the host): a worker thread checks it and lays
        its ids out in pinned buffers at once (NumPy, which lets this thread run the step
        meanwhile); the next ``step()``, once it has queued its update, sends them to the
        device and starts loading their rows (as ``prefetch``) if the worker is done. The
        next forward of this very batch object takes it as prepared (waiting for the worker
        if need be); any other batch is prepared as usual. A bad batch raises in its own
        forward. ``speedtorch_ops.Prefetcher`` calls this for a loader's batches. Batches on a
        GPU, and collections with a hashed table (a forward gives rows), prepare in the
        forward."""
        self._ahead.name(self, features)

    def _step_groups(self) -> None:
        """Each group's step(). Inside a CUDA graph capture a failing one drops every group's
        staged forward, so all their side streams are joined and the capture ends on that
        error."""
        try:
            for group in self.groups:
                group.step()
        except BaseException:
            if _capturing(self):
                for group in self.groups:
                    group.discard()
            raise

    @eager
    def prefetch(self, features) -> None:
        """Start loading the rows of the next step's batch (see HostEmbedding.prefetch)."""
        self._prefetch(self._prepare(features, pooling=False).grouped)

    def _prefetch(self, grouped: list) -> None:
        for g, (group, (feats, flat, _)) in enumerate(zip(self.groups, grouped)):
            if feats and pad_row(self, g) is None:  # a hashed group's rows may change hands
                group.prefetch(flat)

    @eager
    def discard(self) -> None:
        for group in self.groups:
            group.discard()

    def requires_grad_(self, requires_grad: bool = True) -> "HostEmbeddingBagCollection":
        """Freezes (False) or unfreezes every table, as ``HostEmbedding.requires_grad_``, and
        sets nn's flag on any other parameter (the tables are none: nn's walk misses them)."""
        super().requires_grad_(requires_grad)
        for group in self.groups:
            group.requires_grad_(requires_grad)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        for group in self.groups:
            group.zero_grad(set_to_none)

    def flush(self) -> None:
        for group in self.groups:
            group.flush()

    @property
    def fused(self) -> bool:
        return all(group.fused for group in self.groups)

    # ---- checkpoints ---------------------------------------------------------------------

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        save_collection(self, destination, prefix)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        load_collection(self, state_dict, prefix, missing_keys, unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        tables = ", ".join(f"{t.name}({t.num_embeddings or f'hashed {t.capacity}'}x"
                           f"{t.embedding_dim}"
                           + (f", {t.pooling}" if self._pooled else "") + ")"
                           for t in self.tables)
        return f"tables=[{tables}]"


class HostEmbeddingCollection(HostEmbeddingBagCollection):
    """Every id's row, no pooling (TorchRec's EmbeddingCollection): ``forward`` returns
    ``{feature: JaggedTensor}`` (``values()``: ``(ids of the feature, D)``, ``lengths()``: the
    feature's samples'); the tables' ``pooling`` is not used.

    Args:
        tables, optimizer, optimizer_kwargs, device, cache_bytes, bounds_check, dtype,
            state_dtype, stochastic_rounding: as ``HostEmbeddingBagCollection``'s (no
            ``is_weighted``: nothing is pooled, as TorchRec's EmbeddingCollection).

    Example::

        ec = HostEmbeddingCollection([TableConfig("t0", 1_677_721, 128)],
                                     optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.1},
                                     cache_bytes=8 << 30)
        out = ec(KeyedJaggedTensor.from_lengths_sync(["t0"], ids, torch.ones_like(ids)))
        out["t0"].values().backward(grad); ec.step()
    """

    _pooled = False
