"""Stores of distinct rows for the modules: a step stages the distinct rows of its ids (weight and
optimizer state together) in a working buffer on the device, the optimizer updates the buffer,
and the step commits it back. ``HostRows`` reads and writes every distinct row from the host
table; ``CachedRows`` keeps hot rows with their optimizer state in a GPU row cache and moves only
the misses (and the rows they evict).

Everything a step decides (distinct ids, hits, misses, victims) is computed on the device with
shapes fixed by the batch size, so the host never waits for the GPU: row counts known only on
the device travel to the transfer kernels as ``count`` tensors.

The cache (``CachedRows``):
- ``slots`` rows of (parts, *row) on the GPU; a step's entries that hold no slot (misses,
  padding) name slot number ``slots``, past the cache, and the row moves skip them (fixed
  shapes: no compaction on the host);
- a direct map ``slot_of`` (table row -> slot, -1 when not cached) and each slot's row ``id_of``;
- access frequencies ``freq`` of every table row (LFU), halved every ``aging_steps`` steps so the
  cache follows a drifting distribution;
- a miss is admitted when a slot not used by this step, among the step's candidates (the next
  slots of a cyclic hand: ``CachedRows.victim_sample``), holds a row accessed less often (or
  nothing; ``admission="always"``: whatever that slot holds); the evicted row is written back
  to the host (every cached row has been trained, so every cached row is dirty). A tie keeps the
  cached row: a row seen once does not push out another seen once, which would miss again when
  its turn came (docs/decisions.md, "Admission by frequency"). In a cache smaller than its
  table (``defer``) a miss that is not admitted is kept on the device by the commit
  (``Deferred``) and written back by the next stage, on the lane, which takes from there the
  misses it stages again; a flush writes them too. Otherwise the commit writes it back.
The map and the frequencies cost 8 bytes per table row (counted in the budget).

The lane (on a GPU, ``overlap=True``): a side stream of the store. At stage it writes back the
misses the last commit kept, and once the lookup is done the victims are chosen and their rows
written back on it, while the stage copies the hits and loads the misses (on the current
stream, which needs them next: the link's other direction) and the step trains (another table
stages, the forward, the backward and the update run); the commit joins it before the cache
and its map take the step's rows, so a captured step (CUDA graph) holds the fork and the join.
Its transfer kernels, and a stage's miss loads and the prefetch's, use at most ``lane_sms``
SMs (loads) and ``write_sms`` (write-backs), so the training kernels keep the rest
(docs/decisions.md, "The row cache's lane").

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
from .stores import on_stream, wait_for

_NO_WAIT = "prechecked"  # plans check host ids before any op runs


def _phase(method):
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
_LANE_SMS, _WRITE_SMS = 8, 6


class _SmCap:
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

    @_phase
    def __init__(self, plan: Plan, rows: int):
        index = plan.index
        self.n = len(plan)
        (self.ids, self.inverse, self.count, self.perm,
         self.starts) = ops._distinct(index, max(rows, 1))
        self.positions = torch.arange(self.n, device=index.device)
        self.valid = self.positions < self.count
        self._key: Optional[Tensor] = None

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
    *row): one transfer each way, each distinct row once, in address order."""

    def __init__(self, host: Tensor, device: torch.device):
        self.host = host
        self.device = torch.device(device)
        self.parts = host.shape[1]
        self.row_shape = tuple(host.shape[2:])
        self._staged: Optional[Staged] = None
        self._kept: Optional[Tensor] = None  # a CPU store's stage buffer (_stage_buffer)
        self.stats = torch.zeros(len(Stat), dtype=torch.int64, device=self.device)  # see Stat
        self._carry: Optional[Carry] = None
        self._side = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
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

    @_phase
    def stage(self, plan: Plan, spare: int = 0, direct: bool = False,
              weights: Optional[int] = None) -> tuple:
        """(buffer (parts, n + spare, *row) whose first ``count`` rows are the distinct rows,
        Distinct). The rows past ``count`` are undefined and never moved (nothing reads them; an
        optimizer that reduces over the whole buffer would see them); ``spare`` rows past the
        plan's are the caller's (a bag's padding entries point there). On the CPU the buffer is
        the store's own, and the next stage reuses it (``_stage_buffer``). ``direct`` (the
        caller updates the rows with ``direct_target``): a cache stages only the first
        ``weights`` bytes of its hits' records, their weights (none with 0: the caller reads
        them in their slots too; None: whole records), and updates them in their slots; this
        store has none, so neither changes anything."""
        d = self._begin_stage(plan)
        buf = self._stage_buffer(d.n + spare)
        carried = self._take_carry(buf, d, d.valid)
        if carried is None:
            self._move(buf.unbind(0), d.ids, d.positions, d.count, load=True)
        else:
            self._load(buf, d, d.valid & ~carried)
        with self.counting(d.count):
            self.stats[Stat.LOOKUPS] += d.count[0]
            self.stats[Stat.HOST_LOADS] += d.count[0]
        self._staged = Staged(d, buf)
        return buf, d

    def last_hits(self) -> Optional[Tensor]:
        """Which distinct ids of the last stage the cache held (bool, on the device), or None:
        this store holds none."""
        return None

    def direct_target(self) -> tuple:
        """(cache, at) for a fused update of the staged step's rows where they live (see
        ``ops._fused_row_update``), or (None, None) when every row lives in the buffer."""
        return None, None

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

    @_phase
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
    ahead_sms = _SmCap(32)
    # The most SMs of a commit's write-back (0: no cap of its own), which may run beside the
    # prefetch's loads; in the uncached step a cap changed nothing beyond the spread of runs,
    # so none by default (docs/decisions.md, "The prefetch's SM cap").
    write_sms = _SmCap(0)

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

    @_phase
    def commit(self) -> None:
        """Write the staged rows (updated in place) back."""
        d, buf = self._take()[:2]
        with self.counting(d.count):  # every staged row goes straight back
            self.stats[Stat.DIRECT_WRITEBACKS] += d.count[0]
        self._move(buf.unbind(0), d.ids, d.positions, d.count, load=False, sms=self._write_sms)
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


def check_cache_bytes(cache_bytes) -> int:
    """`cache_bytes` checked: an int >= 0 (0: no cache). The one check of a cache budget."""
    if not isinstance(cache_bytes, int) or isinstance(cache_bytes, bool) or cache_bytes < 0:
        raise ValueError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
    return cache_bytes


def cache_slots(cache_bytes: int, rows: int, row_bytes: int, strict: bool = True) -> int:
    """The rows a cache of `cache_bytes` holds for a table of `rows` rows of `row_bytes` bytes
    (each with its optimizer state): what the budget leaves after the map and the frequencies,
    at most the table (slots beyond it are waste); 0 for a budget of 0. A budget that holds no
    row raises naming ``cache_bytes`` (``strict``) or gives 0. The one slot formula."""
    check_cache_bytes(cache_bytes)
    if cache_bytes == 0:
        return 0
    slots = (cache_bytes - CachedRows.index_bytes(rows)) // row_bytes
    if slots >= 1:
        return min(slots, rows)
    if not strict:
        return 0
    raise ValueError(f"cache_bytes={cache_bytes} holds no row: the cache's index takes "
                     f"{CachedRows.index_bytes(rows)} bytes and a row with its optimizer state "
                     f"{row_bytes}; pass 0 for no cache or more bytes")


class CachedRows(HostRows):
    """A GPU row cache of ``slots`` rows in front of the host table (see the module docstring)."""

    lane_sms = _SmCap(_LANE_SMS)
    write_sms = _SmCap(_WRITE_SMS)
    # A step's victims are the coldest unused slots among the next max(2 k, victim_sample)
    # slots of a cyclic hand (k: the step's ids), every slot when that covers the cache: LFU by
    # sampling, so a step's cost follows its ids, not the cache's size; sorting every slot's
    # count each step cost more than the rest of the step in a large cache (docs/decisions.md,
    # "Victims by sampling").
    victim_sample = 1 << 16

    def __init__(self, host: Tensor, device: torch.device, slots: int, aging_steps: int = 256,
                 overlap: bool = True, lane_sms: int = _LANE_SMS, write_sms: int = _WRITE_SMS,
                 admission: str = "frequency", defer: Optional[bool] = None):
        super().__init__(host, device)
        # Whether a commit keeps the misses it does not admit on the device for the next stage
        # to write back beside its own work (Deferred), or writes them back itself and waits.
        # Keeping them costs a dozen small kernels a step whatever the misses: by default only
        # a cache smaller than its table does, where misses are refused every step; a cache of
        # every row refuses few (docs/decisions.md, "Admission by frequency"). May change
        # between steps (a captured step keeps doing what it did when captured: _keeps).
        self.defer = slots < host.shape[0] if defer is None else bool(defer)
        if slots < 1:
            raise ValueError(f"CachedRows: slots must be at least 1, got {slots}")
        # "always" writes every admitted miss's victim back at stage (beside the training
        # kernels), so the commit writes back only the misses that find no unused slot (none
        # when the step's misses fit in the slots it does not use); on the Zipf skip-gram's v
        # table it held the same hit rate (bench/cache_policy.py --admission).
        self.admission = admission
        # The lane (on a GPU, with ``overlap``, which may change between steps): a side stream
        # on which the victims are chosen and the evicted rows written back while the step
        # stages and trains. With it, the store's loads (a stage's misses, the prefetch) use at
        # most ``lane_sms`` SMs and its write-backs at most ``write_sms`` (0: no cap of their
        # own), so the training kernels keep the rest. Without it the cache's own transfers
        # run in order on the current stream, uncapped.
        # The caps are low because a transfer that keeps more requests in flight than the link
        # takes slows every kernel beside it, not only itself; with both capped, a load and a
        # write-back share the link instead of taking turns (docs/decisions.md, "The row
        # cache's SM caps").
        self.overlap = overlap
        self.lane_sms = lane_sms
        self.write_sms = write_sms
        # Not the prefetch's stream (torch hands streams out of a pool of 32, so many stores may
        # share one; that costs speed, never order): a prefetch queued behind the step's
        # evictions would delay the commit's join. The two never touch the same host rows (a
        # prefetch skips cached rows and the staged step's).
        self._lanes = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._lane_uses: list = []
        self._lane_done = None  # the event after the staged step's last lane work
        rows = host.shape[0]
        self.slots = slots
        self.aging_steps = aging_steps
        self.cache = torch.zeros((self.parts, slots, *self.row_shape), dtype=host.dtype,
                                 device=self.device)
        self.slot_of = torch.full((rows + 1,), -1, dtype=torch.int32, device=self.device)
        self.id_of = torch.full((slots,), -1, dtype=torch.int64, device=self.device)
        self.freq = torch.zeros(rows + 1, dtype=torch.float32, device=self.device)
        # Steps counted on the device: a captured step (CUDA graph) ages the frequencies too.
        self._age = torch.zeros(1, dtype=torch.int64, device=self.device)
        # Where the next step's victim candidates start (see victim_sample), on the device.
        self._hand = torch.zeros(1, dtype=torch.int64, device=self.device)
        self._last_lookup: Optional[tuple] = None  # the last stage's slots, for last_hits
        # The misses the last commit did not admit (_defer).
        self._deferred: Optional[Deferred] = None

    @property
    def admission(self) -> str:
        return self._admission

    @admission.setter
    def admission(self, admission: str) -> None:
        if admission not in ("frequency", "always"):
            raise ValueError("CachedRows: admission must be 'frequency' (a miss takes its victim's "
                             "slot when used more often) or 'always' (every miss that finds an "
                             f"unused slot takes it), got {admission!r}")
        self._admission = admission

    @staticmethod
    def index_bytes(rows: int) -> int:
        """Bytes of the map and the frequencies for a table of `rows` rows."""
        return rows * 8

    def cached_bytes(self) -> int:
        return (self.cache.nbytes + self.slot_of.nbytes + self.id_of.nbytes + self.freq.nbytes)

    def _cached(self, ids: Tensor) -> Tensor:  # in a slot, or kept by the last commit
        return self.slot_of[ids] != -1

    @_phase
    def stage(self, plan: Plan, spare: int = 0, direct: bool = False,
              weights: Optional[int] = None) -> tuple:
        self._join()  # a step's transfers are done before the next one stages
        d = self._begin_stage(plan)
        # The misses the last commit kept go back first, on the lane: nothing of this step's
        # is needed for that, and the stage below takes the ones it stages again.
        if self._deferred is not None:
            with self._on_lane():
                self._write_deferred(sms=self._write_sms)
        # Hits from the cache (every other entry names the slot past its end), misses from the
        # host, the carry or the kept misses; the lookup counts each id's use.
        at, miss = ops._cache_lookup(d.ids, d.count, self.slot_of, self.freq, self.slots)
        order, misses = ops._partition(miss)  # misses first, ascending
        with self.counting(d.count, misses):
            self.stats[Stat.LOOKUPS:Stat.HOST_LOADS + 1] += torch.cat([d.count, d.count - misses,
                                                                        misses])
        # On the lane, as soon as the lookup is done: the victims are chosen and their rows
        # written back while the stage copies the hits and loads the misses, and the step
        # trains. Forked after the copies, the write-back waited for them, on the step's longest
        # stretch, the link's (docs/decisions.md, "The row cache's lane"). The lane's work reads
        # these (and allocates what it makes): they stay alive until it joins.
        with self._on_lane():
            victims = self._evict(d, at, order, misses)
            self._lane_done = self._lane_event()
        self._lane_uses = [d, at, order, misses, victims]
        buf = self._buffer(d.n + spare)
        # The hits' rows only (a miss's `at` is past the cache), not every position as an
        # index_select would; direct: their weights only (the update reads their state in the
        # cache and writes them there).
        if not direct or weights is None:
            ops._take_rows(buf, self.cache, at, d.count)
        elif weights:
            ops._take_rows(buf[..., :weights], self.cache[..., :weights], at, d.count)
        # The misses no prefetch loaded, on this stream (it needs them next), capped like the
        # lane's loads: they share the link with the evictions. No row is in both: a miss is not
        # cached, an evicted row is.
        carried = self._take_carry(buf, d, miss)
        if carried is None:
            self._move(buf.unbind(0), d.ids[order], order, misses, load=True,
                       sms=self._lane_sms)
        else:
            self._load(buf, d, miss & ~carried, sms=self._lane_sms)
        self._take_deferred(buf, d)
        self._staged = Staged(d, buf, at, order, misses, victims, direct)
        self._last_lookup = (at, d.valid)  # see last_hits (made when asked for)
        return buf, d

    def _take_deferred(self, buf: Tensor, d: Distinct) -> None:
        """Copy the staged rows the last commit kept (not admitted) into `buf` on the device,
        over what the stage loaded for them from the host, where their write-back (queued on the
        lane, reading the same kept rows) may not have landed yet. The map names a kept row's
        place in the kept rows: -2 - place."""
        kept = self._deferred
        if kept is None:
            return
        at = (-2 - self.slot_of[d.ids]).long()  # a place, or negative: nothing to take
        ops._take_rows(buf, kept.buf, at, d.count)
        with self.counting(at):
            self.stats[Stat.DEFERRED_LOADS] += ((at >= 0) & d.valid).sum()

    @property
    def _spare(self) -> int:
        """The map's entry past the table's rows: it names no row and stays -1."""
        return self.slot_of.numel() - 1

    def _write_deferred(self, sms: int = 0) -> None:
        """Queue the write-back of the kept rows (the current stream's; a count on the device)."""
        kept = self._deferred
        self._move(kept.buf.unbind(0), kept.rows, kept.positions, kept.count, load=False,
                   sms=sms)

    def _unmark_deferred(self) -> None:
        """The map forgets the kept rows (written back, taken by the stage that used them):
        before the commit admits any of them to a slot."""
        if self._deferred is not None:
            self.slot_of.index_fill_(0, self._deferred.rows, -1)

    def _defer(self, buf: Tensor, d: Distinct, back: Tensor, rows: Tensor,
               count: Tensor) -> None:
        """Keep the staged rows at positions `back[:count]` (ids `rows`, ascending) on the
        device for the next stage to write back (``Deferred``), and mark them in the map; the
        lane has written the last ones (the commit joined it) and the map no longer names
        them (_unmark_deferred)."""
        n = d.n
        kept = self._deferred
        if kept is None or kept.rows.numel() < n:  # grown, never shrunk
            size = max(n, 1)
            positions = torch.arange(size, device=self.device)
            kept = Deferred(self._buffer(size),
                            torch.full((size,), self._spare, dtype=torch.int64,
                                       device=self.device),
                            torch.zeros(1, dtype=torch.int64, device=self.device), positions,
                            (-2 - positions).int())
            self._deferred = kept
        live = d.positions < count
        # Past the count: the map's spare entry (no table row), which they leave at -1; so are
        # the places past this step's (a larger step's rows, unmarked already).
        kept.rows[:n].copy_(torch.where(live, rows, self._spare))
        if kept.rows.numel() > n:
            kept.rows[n:].fill_(self._spare)
        self.slot_of.index_put_((kept.rows[:n],), torch.where(live, kept.codes[:n], -1))
        ops._take_rows(kept.buf, buf, back, count)
        kept.count.copy_(count)

    def _keeps(self, n: int) -> bool:
        """Whether this commit (of a step of `n` distinct ids) keeps the misses it refuses
        (``defer``). Once a step of this store is captured in a CUDA graph, the kept buffer is
        never made or grown: the graph's stages write back and take from the buffer they
        captured (or none), so a commit whose rows would not fit it writes them back itself."""
        if not self.defer or not self._graphed:
            return self.defer
        return self._deferred is not None and self._deferred.rows.numel() >= n

    def _empty_deferred(self) -> None:
        """Nothing is kept (the map no longer marks the rows: _unmark_deferred)."""
        if self._deferred is not None:
            self._deferred.rows.fill_(self._spare)
            self._deferred.count.zero_()

    def _forget_deferred(self) -> None:
        """No row is kept any more (written back, or the host table is being replaced)."""
        self._unmark_deferred()
        self._empty_deferred()

    def last_hits(self) -> Optional[Tensor]:
        if self._last_lookup is None:
            return None
        at, valid = self._last_lookup
        return (at < self.slots) & valid

    def direct_target(self) -> tuple:
        staged = self._staged
        if staged is None or not staged.direct:
            return None, None
        return self.cache, staged.at

    @_phase
    def _evict(self, d: Distinct, at: Tensor, order: Tensor, misses: Tensor) -> Victims:
        """Choose the slots the misses take: the least-frequently used slots this step does not
        use, the coldest for the first misses; a miss is admitted when its row is accessed more
        often than its victim's (``admission="always"``: whenever such a slot is left).
        The victims' rows (final: this step does not use them) go back to the host (queued on
        the lane, beside the step's training kernels); their slots are overwritten at commit,
        after the lane joins."""
        k = min(d.n, self.slots)
        # Coldest first; slots holding rows of this step (`at`) cannot be victims.
        window = max(2 * k, self.victim_sample)
        window = 0 if window >= self.slots else window  # 0: every slot
        victims, cold = ops._coldest_slots(self.id_of, self.freq, at, k, self._hand, window)
        first = order[:k]  # the staged positions of the misses (ascending), then the rest
        # A miss takes a slot this step does not use (finite priority), with "frequency" only
        # one whose row is used less often than the miss; the rows such slots held are evicted.
        admit, keys, evicted = ops._admission(d.ids, first, victims, cold, misses, self.freq,
                                              self.id_of, self.admission == "frequency")
        # Evicted rows in address order (the others' keys, len(freq), sort last).
        ev_sorted, ev_order = ops._sort_ids(keys, self.freq.numel() + 1)
        self._move(self.cache.unbind(0), ev_sorted, victims[ev_order], evicted, load=False,
                   sms=self._write_sms)
        return Victims(victims, first, admit, evicted)

    @_phase
    def commit(self) -> None:
        d, buf, at, order, misses, (victims, first, admit, evicted), direct = self._take()
        self._join()  # the evicted rows are on the host: their slots can be overwritten
        with self.counting(evicted):
            self.stats[Stat.EVICTIONS] += evicted[0]
        k = first.numel()
        # Misses not admitted: with ``defer`` they stay on the device and the next stage writes
        # them back on its lane, beside its loads and training (_defer); else they go back now,
        # on the lane while the cache and its map take the step's rows (no row is in both).
        rest = (d.positions < misses)
        rest[:k] &= ~admit
        take, rest_count = ops._partition(rest)
        back = order[take]
        rest_rows = d.ids[back]
        keeps = self._keeps(d.n)
        if not keeps:
            with self._on_lane():
                self._move(buf.unbind(0), rest_rows, back, rest_count, load=False,
                           sms=self._write_sms)
                self._lane_done = self._lane_event()
            self._lane_uses = [buf, rest_rows, back, rest_count]
        # The map takes the admitted misses. Each staged row's slot: hits their own, admitted
        # misses their victim's, the rest none (the slot past the cache: not moved); one call
        # puts them all back.
        if self._ahead_planned is not None:  # a prefetch reads the map as it was (prefetch)
            torch.cuda.current_stream(self.device).wait_event(self._ahead_planned)
        self._unmark_deferred()
        dest = ops._cache_admit(self.slot_of, self.id_of, d.ids, at, first, victims, admit)
        if direct:  # the hits were updated in their slots: only admitted misses move
            dest = torch.where(at < self.slots, self.slots, dest)
        ops._put_rows(self.cache, buf, dest, d.count)
        if keeps:
            self._defer(buf, d, back, rest_rows, rest_count)
        elif self._deferred is not None and not self._graphed:  # kept before: written back
            self._deferred = None  # by this stage; a stage without it does less
        else:
            self._empty_deferred()
        with self.counting(rest_count):
            self.stats[Stat.DIRECT_WRITEBACKS] += rest_count[0]
        # LFU aging: the frequencies halve every aging_steps steps (decided on the device).
        ops._age_frequencies(self.freq, self._age, self.aging_steps)
        self._join()
        self._join_side()

    @property
    def _lane(self):
        return self._lanes if self.overlap else None

    @property
    def _lane_sms(self) -> int:
        return self.lane_sms if self._lane is not None else 0

    @property
    def _write_sms(self) -> int:
        return self.write_sms if self._lane is not None else 0

    @property
    def _ahead_sms(self) -> int:  # a prefetch runs beside the training kernels like the lane
        return self._lane_sms

    def _on_lane(self):
        """Work queued inside runs on the lane (after the work queued so far), or here and now
        without one."""
        return on_stream(self._lane, self.device)

    def _lane_event(self):
        return self._lane.record_event() if self._lane is not None else None

    def _join(self) -> None:
        """The current stream waits for the staged step's lane transfers; what they read may
        then be freed."""
        if self._lane_done is not None:
            torch.cuda.current_stream(self.device).wait_event(self._lane_done)
        self._lane_done, self._lane_uses = None, []

    def discard(self) -> None:
        """Forget the staged rows (a read-only forward): the rows evicted at stage were written
        back but keep their slots, so the cache and the host agree on them; so were the misses
        the last commit kept, which stay kept (the next stage writes the same values again)."""
        self._drop_staged()
        super().discard()

    def _drop_staged(self) -> None:
        """Before a staged step is dropped (never committed): the lane joins, and the victims
        the step wrote back at stage are counted."""
        self._join()
        if self._staged is not None:
            evicted = self._staged.victims.evicted
            with self.counting(evicted):
                self.stats[Stat.EVICTIONS] += evicted[0]

    def reset(self) -> None:
        """The host table is about to be rewritten: the cached copies are dropped, not written
        back."""
        self._drop_staged()
        super().reset()
        self.slot_of.fill_(-1)
        self.id_of.fill_(-1)
        self._forget_deferred()

    def flush(self) -> None:
        """Write every cached row to the host table (it is then complete); the rows stay cached.
        Waits for the GPU (the number of cached rows is read)."""
        self._join()
        ids = self.id_of
        key = torch.where(ids >= 0, ids, torch.iinfo(torch.int64).max)
        rows, order = torch.sort(key)
        count = (ids >= 0).sum().view(1)
        self._move(self.cache.unbind(0), rows, order, count, load=False)
        if self._deferred is not None:  # the misses the last commit kept, then none
            self._write_deferred()
            if self._ahead_planned is not None:  # a prefetch reads the map (prefetch)
                torch.cuda.current_stream(self.device).wait_event(self._ahead_planned)
            self._forget_deferred()
        wait_for(self.device)  # the host reads the table next
