"""The GPU row cache (``CachedRows``): hot rows with their optimizer state on the GPU in front
of the host rows (``host_rows.py:HostRows``); a step moves only its misses and the rows they
evict.

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
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from .. import ops
from .host_rows import (LANE_SMS, WRITE_SMS, Deferred, Distinct, HostRows, SmCap, Staged, Stat,
                        Victims, phase)
from .plan import Plan
from .stores import on_stream, wait_for


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
    """A GPU row cache of ``slots`` rows in front of the host table (see the module docstring).

    Args:
        host: the host table (rows, parts, record), pinned.
        device: the GPU the cache and a step's rows live on.
        slots: the rows it holds (``cache_slots`` gives them for a budget).
        aging_steps: steps between halvings of the use counts.
        overlap, lane_sms, write_sms: the lane (a side stream for the victims and their
            write-backs) and the transfers' SM caps.
        admission: "frequency" (a miss takes a colder row's slot) or "always".
        defer: keep refused misses on the GPU for the next stage (None: when smaller than
            its table).

    Example::

        store = CachedRows(engine.table.host, torch.device("cuda"), slots=100_000)
        buf, d = store.stage(plan)      # the step's distinct rows; then commit() or discard()
    """

    lane_sms = SmCap(LANE_SMS)
    write_sms = SmCap(WRITE_SMS)
    # A step's victims are the coldest unused slots among the next max(2 k, victim_sample)
    # slots of a cyclic hand (k: the step's ids), every slot when that covers the cache: LFU by
    # sampling, so a step's cost follows its ids, not the cache's size; sorting every slot's
    # count each step cost more than the rest of the step in a large cache (docs/decisions.md,
    # "Victims by sampling").
    victim_sample = 1 << 16

    def __init__(self, host: Tensor, device: torch.device, slots: int, aging_steps: int = 256,
                 overlap: bool = True, lane_sms: int = LANE_SMS, write_sms: int = WRITE_SMS,
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

    @phase
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

    @phase
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

    @phase
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
