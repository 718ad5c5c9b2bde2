"""The store of a step's distinct rows over the host rows: a step stages the distinct rows of
its ids (weight and optimizer state together) in a working buffer on the device, the optimizer
updates the buffer, and the step commits it back. ``HostRows`` reads and writes every distinct
row from the host table; ``cache.py:CachedRows`` keeps hot rows with their optimizer state in a
GPU row cache in front of it and moves only the misses (and the rows they evict).

Everything a step decides (distinct ids, hits, misses, victims) is computed on the device with
shapes fixed by the batch size, so the host never waits for the GPU: row counts known only on
the device travel to the transfer kernels as ``count`` tensors.

Prefetch (both stores): ``prefetch(plan)``, called while a step is staged (between its forward
and its commit) or between steps, loads the coming step's rows that the host table will still
hold unchanged when that step stages them (rows neither cached now nor in the staged step, whose
commit may write them back) into the store's carry buffer, on a side stream, so the transfer
overlaps the current step's backward, update and commit. The next ``stage`` takes a carried row
where the carry holds the id of that very position (compared on the device: a prefetch of other
ids wastes bytes, never gives a wrong row) and loads the other misses; every stage empties the
carry. The carry keeps its addresses, so a step captured in a CUDA graph may prefetch the ids of
the step after it: the replay's prefetch fills what the next replay takes (the carry is made by
the eager warm-up steps' prefetches; once a step is captured, a prefetch outside the graph
raises). A staged step's commit joins its prefetch (a captured step holds the fork and the
join); a prefetch between steps is joined by the next stage.
"""
from __future__ import annotations

import contextlib
import functools
import math
from enum import IntEnum
from typing import NamedTuple, Optional

import torch
from torch import Tensor
from torch.profiler import record_function

from .. import ops
from .plan import Plan
from .stores import on_stream, prefetch_stream, wait_for

_NO_WAIT = "prechecked"  # plans check host ids before any op runs


def phase(method):
    """Label a method's work for torch.profiler as "speedtorch_ops.<Class>.<method>", so a
    profile shows a step's phases (bench/step_profile.py reads them); nothing when no profiler
    runs."""
    label = f"speedtorch_ops.{method.__qualname__}"

    @functools.wraps(method)
    def labelled(*args, **kwargs):
        if not torch.autograd._profiler_enabled():
            return method(*args, **kwargs)
        with record_function(label):
            return method(*args, **kwargs)
    return labelled
# The row cache's SM caps by default, loads and write-backs (why: CachedRows.__init__).
LANE_SMS, WRITE_SMS = 8, 6


class SmCap:
    """An SM cap of a store's transfer kernels (an int >= 0; 0: no cap of its own), checked
    when set."""

    def __init__(self, default: int):
        self.default = default

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None) -> int:
        return self.default if obj is None else obj.__dict__.get(self.name, self.default)

    def __set__(self, obj, value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{type(obj).__name__}: {self.name} must be an int >= 0, got "
                             f"{value!r}")
        obj.__dict__[self.name] = value


class Distinct:
    """The distinct ids of a plan (each below `rows`), on its device, in fixed shapes:
    ``ids[:count]`` ascending, ``ids[count:]`` zero; ``inverse[i]`` the position in ``ids`` of
    the plan's i-th id; the plan's positions of ``ids[r]`` are ``perm[starts[r]:starts[r+1]]``
    (a lookup's backward sums its gradients there: ``ops._segment_sum``)."""

    @phase
    def __init__(self, plan: Plan, rows: int):
        index = plan.index
        self.n = len(plan)
        (self.ids, self.inverse, self.count, self.perm,
         self.starts) = ops._distinct(index, max(rows, 1))
        self._positions: Optional[Tensor] = None
        self._valid: Optional[Tensor] = None
        self._key: Optional[Tensor] = None
        if index.device.type != "cpu":  # on a GPU made now, on the stage's stream
            self._valid = self.valid

    @property
    def positions(self) -> Tensor:
        """0, 1, ..., n - 1 on the device (on the CPU made on first use: a step that pools in
        the table needs none)."""
        if self._positions is None:
            self._positions = torch.arange(self.n, device=self.ids.device)
        return self._positions

    @property
    def valid(self) -> Tensor:
        """Whether each place holds a distinct id (below ``count``), as ``positions``."""
        if self._valid is None:
            self._valid = self.positions < self.count
        return self._valid

    @property
    def key(self) -> Tensor:
        """The distinct ids with every place past ``count`` at the largest int64: ascending
        throughout, for searches (made once a step, on first use)."""
        if self._key is None:
            self._key = torch.where(self.valid, self.ids, torch.iinfo(torch.int64).max)
        return self._key


def _among(ids: Tensor, of: "Distinct") -> Tensor:
    """Whether each of `ids` is one of the distinct ids of `of` (of at least one id): a binary
    search on the device, no wait. `of`'s key is made here when it has none yet, and not kept
    (this may run on another stream than `of`'s)."""
    key = of._key if of._key is not None else torch.where(of.valid, of.ids,
                                                           torch.iinfo(torch.int64).max)
    at = torch.searchsorted(key, ids).clamp_(max=of.n - 1)
    return key[at] == ids


class Stat(IntEnum):
    """The counters of a store's ``stats`` (one int64 tensor on its device, so the replays of a
    captured step count too), since construction: distinct rows looked up, cache hits, rows a
    stage took from the host (misses; now, ahead, or kept by the last commit), rows evicted from
    the cache, misses not admitted (written back by the next stage or the commit), the misses a
    prefetch had loaded, rows prefetches loaded (taken or not), the misses whose values came
    from the rows the last commit kept on the device (over what the stage loaded for them)."""
    LOOKUPS = 0
    HITS = 1
    HOST_LOADS = 2
    EVICTIONS = 3
    DIRECT_WRITEBACKS = 4
    PREFETCHED_LOADS = 5
    PREFETCHED_ROWS = 6
    DEFERRED_LOADS = 7


class Victims(NamedTuple):
    """A step's admission decisions (made at stage, applied at commit): the victim slots (the
    coldest unused ones, coldest first), the staged positions of the first k misses paired with
    them, which of those are admitted, and how many rows the victims' slots gave back to the
    host (one int64 on the device)."""
    slots: Tensor
    first: Tensor
    admit: Tensor
    evicted: Tensor


class Staged(NamedTuple):
    """A stage's rows, kept for its commit: the distinct ids, the buffer (parts, n, *row); in
    the cache also each row's slot (``at``: the slot past the cache for a miss), the staged
    positions with the misses first (``order``), how many misses (``misses``, on the device)
    and the admission decisions (``victims``); ``direct``: the hits are updated in their slots
    (``direct_target``), so only their weight part was staged and none is put back."""
    distinct: "Distinct"
    buf: Tensor
    at: Optional[Tensor] = None
    order: Optional[Tensor] = None
    misses: Optional[Tensor] = None
    victims: Optional[Victims] = None
    direct: bool = False


class Carry:
    """Rows a prefetch loaded for a coming step: ``buf`` (parts, n, *row), the distinct ids it
    loaded them for (``ids``, by position, as ``Distinct`` orders them) and which positions hold
    their row (``loaded``). A store keeps one and reuses it for prefetches of the same size."""

    def __init__(self, buf: Tensor):
        n = buf.shape[1]
        self.buf = buf
        self.ids = torch.full((n,), -1, dtype=torch.int64, device=buf.device)
        self.loaded = torch.zeros(n, dtype=torch.bool, device=buf.device)


class Deferred(NamedTuple):
    """The misses a commit did not admit, kept on the device until the next stage writes them
    back: their rows (``buf``: parts, size, *row), their ids ascending, then the map's spare
    entry (``rows``), how many (``count``, one int64), ``positions`` (0..size-1) and the codes
    the map holds for them (``codes``: -2 - position, int32)."""
    buf: Tensor
    rows: Tensor
    count: Tensor
    positions: Tensor
    codes: Tensor


class HostRows:
    """Every distinct row of a step read from and written back to the host table (rows, parts,
    *row): one transfer each way, each distinct row once, in address order.

    Args:
        host: the host table (rows, parts, record): pinned for a GPU, else ordinary memory.
        device: where a step's rows are staged.

    Example::

        store = HostRows(engine.table.host, torch.device("cpu"))
        buf, d = store.stage(Plan(ids, store.device))   # d.count distinct rows in buf
        store.commit()                                   # written back
    """

    def __init__(self, host: Tensor, device: torch.device):
        self.host = host
        self.device = torch.device(device)
        self.parts = host.shape[1]
        self.row_shape = tuple(host.shape[2:])
        self._staged: Optional[Staged] = None
        self._kept: Optional[Tensor] = None  # a CPU store's stage buffer (_stage_buffer)
        self.stats = torch.zeros(len(Stat), dtype=torch.int64, device=self.device)  # see Stat
        self._carry: Optional[Carry] = None
        self._side = prefetch_stream(self.device)
        self._ahead_done = None  # the event after the last prefetch's transfer
        self._ahead_planned = None  # the event after it read the cache's map (see prefetch)
        self._ahead_captured = False  # that event belongs to a CUDA graph capture
        self._ahead_uses: list = []  # what that transfer reads, alive until it is joined
        # A step of this store was captured in a CUDA graph: its replays take and refill the
        # carry without Python, so a prefetch outside the graph would race with them.
        self._graphed = False
        # The books: a side stream for the counters nothing in a step reads (``stats``, a
        # collection's counts a table), so their small kernels leave the chain of kernels
        # each one waits for; joined at every stage, commit and discard (``_join_side``) and
        # before the counters are read (``counters``).
        self._books = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._books_done = None  # the event after the last counting
        self._books_captured = False  # that event belongs to a CUDA graph capture
        self._books_uses: list = []  # what that counting reads, alive until it is joined

    def _buffer(self, n: int) -> Tensor:
        return torch.empty((self.parts, n, *self.row_shape), dtype=self.host.dtype,
                           device=self.device)

    def _stage_buffer(self, n: int) -> Tensor:
        """A stage's buffer of `n` rows. On the CPU the store keeps one from stage to stage,
        grown to the largest stage yet (zeros when new): a fresh buffer each step took pages
        the allocator had handed back, faulted in again every step, and its rows past the
        distinct ones held what freed tensors had left there (ids read as floats are denormal
        numbers, slow for the optimizer's arithmetic over the whole buffer); the kept one holds
        earlier steps' rows there (docs/decisions.md, "A CPU store's kept stage buffer")."""
        if self.device.type != "cpu":
            return self._buffer(n)
        size = self.parts * n * math.prod(self.row_shape)
        if self._kept is None or self._kept.numel() < size:
            # A quarter to spare: a batch's distinct count moves a little from step to step.
            grown = size if self._kept is None else max(size, self._kept.numel() * 5 // 4)
            self._kept = torch.zeros(grown, dtype=self.host.dtype)
        return self._kept[:size].view(self.parts, n, *self.row_shape)

    def _move(self, parts, rows: Tensor, slots: Tensor, count: Tensor, load: bool,
              sms: int = 0) -> None:
        ops._sorted_transfer(self.host, parts, rows, slots, load, count=count,
                             bounds_check=_NO_WAIT, sms=sms)

    @phase
    def stage(self, plan: Plan, spare: int = 0, direct: bool = False,
              weights: Optional[int] = None) -> tuple:
        """(buffer (parts, n + spare, *row) whose first ``count`` rows are the distinct rows,
        Distinct). The rows past ``count`` are undefined and never moved (nothing reads them; an
        optimizer that reduces over the whole buffer would see them); ``spare`` rows past the
        plan's are the caller's (a bag's padding entries point there). On the CPU the buffer is
        the store's own, and the next stage reuses it (``_stage_buffer``). ``direct`` (the
        caller updates the rows with ``direct_target``): a cache stages only the first
        ``weights`` bytes of its hits' records, their weights (none with 0: the caller reads
        them in their slots too; None: whole records), and updates them in their slots. On the
        CPU this store stages whole records and the update writes the host table itself, so
        the commit writes nothing back (docs/decisions.md, "The CPU step updates the table in
        place"); with ``weights=0`` there, and no rows carried, it stages none: the caller reads
        the host rows and only the buffer's shape counts."""
        d = self._begin_stage(plan)
        buf = self._stage_buffer(d.n + spare)
        carry = self._carry
        in_table = (direct and weights == 0 and self.device.type == "cpu"
                    and (carry is None or not bool(carry.loaded.any())))
        carried = None
        if not in_table:
            # Whole records, even where the update reads the state in the table: one sorted
            # transfer with read-ahead took less than a gather of the weights alone.
            carried = self._take_carry(buf, d, d.valid)
            if carried is None:
                self._move(buf.unbind(0), d.ids, d.positions, d.count, load=True)
            else:
                self._load(buf, d, d.valid & ~carried)
        # Not after taking a carry of this step's size: those rows are updated in the buffer
        # and written back, the old way.
        in_place = direct and self.device.type == "cpu" and carried is None
        if self.device.type == "cpu":  # a number already: no tensor ops
            self.stats.numpy()[[Stat.LOOKUPS, Stat.HOST_LOADS]] += int(d.count)
        else:
            with self.counting(d.count):
                self.stats[Stat.LOOKUPS] += d.count[0]
                self.stats[Stat.HOST_LOADS] += d.count[0]
        self._staged = Staged(d, buf, direct=in_place)
        return buf, d

    def last_hits(self) -> Optional[Tensor]:
        """Which distinct ids of the last stage the cache held (bool, on the device), or None:
        this store holds none."""
        return None

    def direct_target(self) -> tuple:
        """(cache, at) for a fused update of the staged step's rows where they live (see
        ``ops._fused_row_update``), or (None, None) when every row lives in the buffer. On the
        CPU, after a direct stage: the host table as (1, rows, record) and each distinct row's
        id as its slot."""
        staged = self._staged
        if staged is None or not staged.direct:
            return None, None
        return self.host.transpose(0, 1), staged.distinct.ids

    def _begin_stage(self, plan: Plan) -> "Distinct":
        """What every stage does first: check the ids, note a capture, join the prefetch (its
        carry is read next); returns the plan's distinct ids."""
        plan.check(self.host.shape[0])
        self._graphed |= self._capturing()
        self._join_side()
        return Distinct(plan, self.host.shape[0])

    def _load(self, buf: Tensor, d: "Distinct", which: Tensor, sms: int = 0) -> tuple:
        """Load the rows of the positions `which` of `d` into `buf` (ascending ids); returns what
        the transfer reads (to keep alive while it runs on another stream)."""
        order, count = ops._partition(which)
        rows = d.ids[order]
        self._move(buf.unbind(0), rows, order, count, load=True, sms=sms)
        return order, rows, count

    def _take_carry(self, buf: Tensor, d: "Distinct", miss: Tensor) -> Optional[Tensor]:
        """The positions of `miss` whose row the carry holds (a prefetch loaded it for this very
        id), copied into `buf` on the device; None when there is no carry of this size. The
        carry is emptied either way: the rows this step commits may change."""
        carry, take = self._carry, None
        if carry is None:
            return None
        if carry.ids.numel() == d.n:
            take = miss & carry.loaded & (carry.ids == d.ids)
            # Only the carried rows move (a where over every position moved all of them).
            ops._take_rows(buf, carry.buf, torch.where(take, d.positions, -1), d.count)
            with self.counting(take):
                self.stats[Stat.PREFETCHED_LOADS] += take.sum()
        carry.loaded.zero_()
        return take

    def _cached(self, ids: Tensor) -> Optional[Tensor]:
        """Whether each row of `ids` is held on the device, so that the host's copy may be
        stale (None: this store holds none)."""
        return None

    @phase
    def prefetch(self, plan: Plan) -> None:
        """Start loading the rows of `plan`, the ids of a coming step, that the host table will
        still hold unchanged when that step stages them, into the carry (see the module
        docstring). On a GPU the transfer runs on a side stream after the work queued so far;
        nothing waits. Inside a CUDA graph capture only while a step is staged (its commit
        joins the transfer)."""
        plan.check(self.host.shape[0])
        capturing = self._capturing()
        if capturing and self._staged is None:
            raise RuntimeError("prefetch inside a CUDA graph capture: call it between the "
                               "step's forward and its step() (the step's commit joins the "
                               "transfer, so the graph holds it whole)")
        if self._graphed and not capturing:
            raise RuntimeError("prefetch: this table's step was captured in a CUDA graph, whose "
                               "replays take and refill the prefetched rows without Python; a "
                               "prefetch outside the graph would race with them. Prefetch "
                               "inside the captured step (between its forward and step())")
        self._join_ahead()  # an earlier prefetch, never taken, is overwritten
        n = len(plan)
        if self._carry is None or self._carry.ids.numel() != n:
            if capturing:  # a graph keeps the addresses it captured: the carry must exist
                raise RuntimeError(f"prefetch inside a CUDA graph capture needs the buffer an "
                                   f"eager prefetch of {n} ids makes: prefetch in the eager "
                                   "warm-up steps too (CapturedStep's), with the same shapes")
            self._carry = Carry(self._buffer(n))
        carry = self._carry
        # All of it on the side stream, the planning too: the step's forward, backward and
        # update queued next on the current stream need none of it, and run beside it. The
        # current stream waits for the planning before the commit changes the cache's map
        # (CachedRows.commit): a row this step evicts is cached until then, so it is not
        # prefetched from the host before its write-back.
        with on_stream(self._side, self.device):
            d = Distinct(plan, self.host.shape[0])
            want = d.valid.clone()
            cached = self._cached(d.ids)
            if cached is not None:
                want &= ~cached
            # The staged step's commit may write its rows back: the next stage loads them.
            if self._staged is not None and self._staged.distinct.n:
                want &= ~_among(d.ids, self._staged.distinct)
            self._ahead_planned = self._side.record_event() if self._side is not None else None
            carry.ids.copy_(d.ids)
            carry.loaded.copy_(want)
            uses = self._load(carry.buf, d, want, sms=self._ahead_sms)
            self._ahead_done = self._side.record_event() if self._side is not None else None
            with self.counting(want):
                self.stats[Stat.PREFETCHED_ROWS] += want.sum()
        self._ahead_captured = capturing
        # What the side stream reads stays alive until it is joined: the staged step's distinct
        # ids too (a discard may drop the step before its commit would join the prefetch).
        staged = self._staged.distinct if self._staged is not None else None
        self._ahead_uses = [plan, d, want, staged, *uses]

    # The most SMs of a prefetch's transfer kernels (0: no cap of its own), which run beside the
    # training kernels: uncapped, they took the SMs the training kernels needed and the
    # prefetch lost to none (docs/decisions.md, "The prefetch's SM cap"). The cache's lane has
    # its own cap (lane_sms).
    ahead_sms = SmCap(32)
    # The most SMs of a commit's write-back (0: no cap of its own), which may run beside the
    # prefetch's loads; in the uncached step a cap changed nothing beyond the spread of runs,
    # so none by default (docs/decisions.md, "The prefetch's SM cap").
    write_sms = SmCap(0)

    @property
    def _ahead_sms(self) -> int:
        return self.ahead_sms

    @property
    def _write_sms(self) -> int:
        return self.write_sms

    def _join_ahead(self) -> None:
        """The current stream waits for the last prefetch's transfer (its carry may then be read
        or rewritten, what it read freed)."""
        self._wait(self._ahead_done, self._ahead_captured,
                   "a prefetch made outside this CUDA graph capture is still loading",
                   "Prefetch inside the captured step only (between its forward and step())")
        self._ahead_done, self._ahead_planned, self._ahead_uses = None, None, []

    def _wait(self, event, captured: bool, pending: str, remedy: str) -> None:
        """The current stream waits for `event` (None: nothing to wait for), recorded inside a
        CUDA graph capture when `captured`; inside a capture an event from outside it raises
        (a graph cannot wait for it): `pending` says what, `remedy` what to do."""
        if event is None:
            return
        if self._capturing() and not captured:
            raise RuntimeError(f"{pending}: a graph cannot wait for it. {remedy}")
        torch.cuda.current_stream(self.device).wait_event(event)

    def _join_side(self) -> None:
        """The current stream waits for the store's side work: the prefetch and the counting."""
        self._join_ahead()
        self.join_books()

    @contextlib.contextmanager
    def counting(self, *used: Tensor):
        """Counting queued inside (kernels that only add to counters) runs on the books, after
        the work queued so far on the current stream; `used` stay alive until it is joined."""
        with on_stream(self._books, self.device):
            yield
        if self._books is not None:
            self._books_done = self._books.record_event()
            self._books_captured = self._capturing()
            self._books_uses.extend(used)

    def join_books(self) -> None:
        """The current stream waits for the counting queued so far."""
        self._wait(self._books_done, self._books_captured,
                   "counting queued outside this CUDA graph capture is still pending",
                   "Finish the step before the capture (step() or discard())")
        self._books_done, self._books_uses = None, []

    def counters(self) -> Tensor:
        """``stats``, once the counting queued so far is in them (the current stream waits for
        it; reading them then waits for the GPU)."""
        self.join_books()
        return self.stats

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def drop_prefetch(self) -> None:
        """Forget what a prefetch loaded (after its transfer, which the current stream waits
        for)."""
        self._join_side()
        if self._carry is not None:
            self._carry.loaded.zero_()

    @phase
    def commit(self) -> None:
        """Write the staged rows (updated in place) back; after a direct stage they were
        updated in the host table itself, and nothing moves."""
        staged = self._take()
        d, buf = staged.distinct, staged.buf
        if not staged.direct:
            with self.counting(d.count):  # every staged row goes straight back
                self.stats[Stat.DIRECT_WRITEBACKS] += d.count[0]
            self._move(buf.unbind(0), d.ids, d.positions, d.count, load=False,
                       sms=self._write_sms)
        self._join_side()

    def _take(self) -> Staged:
        if self._staged is None:
            raise RuntimeError("commit: no rows are staged (call stage, i.e. the module's "
                               "forward, first)")
        staged, self._staged = self._staged, None
        return staged

    def discard(self) -> None:
        """Forget the staged rows without writing them (a read-only forward); the current stream
        joins the prefetch's side stream and the counting (their forks inside a capture end
        here too; the carry stays loaded)."""
        self._staged = None
        self._join_side()

    def reset(self) -> None:
        """The host table is about to be rewritten on the CPU: forget any device copy of its
        rows, and wait for the GPU's current stream and this store's streams (queued
        write-backs would land over the new rows; work queued on other streams is the
        caller's to wait for)."""
        self._staged = None
        self.drop_prefetch()
        wait_for(self.device)

    def flush(self) -> None:
        """Make the host table complete: it is once the queued write-backs ran (waits for the
        GPU)."""
        wait_for(self.device)  # the host reads the table next

    def cached_bytes(self) -> int:
        return 0
