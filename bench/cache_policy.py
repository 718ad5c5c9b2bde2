"""The row cache's policy on its own, on the CPU: the hit rate of CachedRows (LFU with aging,
admission against the coldest unused slot) on the demo's v table (contexts and word2vec
negatives of the Zipf corpus), against two fixed caches of the same size: the rows used most
in these very batches (an oracle that knows the future) and the rows most frequent in the
corpus (what a frequency-sorted warm start would hold). Only ids move (rows of one float), so
the full 4 M-row vocabulary fits on a laptop; the policy is the same tensor code as on a GPU.

--workload bdet: one table of the public benchmark instead (bench/bdet.py's power-law ids,
--cap rows, 104,857 ids a step, --batches batches cycled, a cache of --cfr x the rows they
touch), against the best static cache of as many rows (the most drawn). --ties admit: a miss
also takes the slot of a row used exactly as often (the rule before admission by frequency
kept ties; emulated here by comparing against the next float below the victim's count).

With --prefetch, each step also prefetches the next batch (as HostEmbedding.prefetch does, after
the forward and before the commit), with no cache and with the cache: of the rows that cross
the host link per step, how many load ahead (off the step's critical path) and how many still
load in the step; and how many rows the prefetches loaded in all.

    python3 bench/cache_policy.py --slots 681338 --steps 190 600 --batches 120
    python3 bench/cache_policy.py --slots 681338 --steps 190 --prefetch
    python3 bench/cache_policy.py --slots 681338 --steps 190 600 --admission frequency always
    python3 bench/cache_policy.py --workload bdet --cap 1677721 --ties keep admit
"""

import argparse
import time

import numpy as np
import torch

from speedtorch_ops import ops
from speedtorch_ops.demo.corpus import ZipfCorpus
from speedtorch_ops.training.cache import CachedRows
from speedtorch_ops.training.host_rows import HostRows
from speedtorch_ops.training.plan import Plan


def v_ids(batch) -> np.ndarray:
    return np.concatenate([batch[1].ravel(), batch[2].ravel()])


def fixed_hit_rate(per_step, keep: np.ndarray) -> float:
    return sum(int(keep[u].sum()) for u in per_step) / sum(len(u) for u in per_step)


def simulate(store, batches, steps: int, warmup: int, prefetch: bool, ids=v_ids) -> list:
    """`steps` steps of the v table (or what `ids` takes of a batch) through `store` (each
    staging its batch, with `prefetch` prefetching the next, then committing, as the module
    does); the store's counts over the steps after `warmup`."""
    for i in range(steps):
        store.stage(Plan(ids(batches[i % len(batches)]), "cpu"))
        if prefetch:
            store.prefetch(Plan(ids(batches[(i + 1) % len(batches)]), "cpu"))
        store.commit()
        if i == warmup - 1:
            before = store.counters().clone()
    return (store.counters() - before).tolist()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, default=4_000_000)
    p.add_argument("--tokens", type=int, default=4_000_000)
    p.add_argument("--batch", type=int, default=8192)
    p.add_argument("--negatives", type=int, default=5)
    p.add_argument("--slots", type=int, default=681_338, help="the v table's share of 1200 MiB")
    p.add_argument("--batches", type=int, default=120, help="distinct batches, cycled")
    p.add_argument("--steps", type=int, nargs="+", default=[190, 600])
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--aging", type=int, default=256)
    p.add_argument("--admission", nargs="+", choices=["frequency", "always"],
                   default=["frequency"], help="CachedRows' admission rule(s), one run each")
    p.add_argument("--prefetch", action="store_true",
                   help="also the prefetch's split of the loads (no cache and --slots)")
    p.add_argument("--workload", choices=["skipgram", "bdet"], default="skipgram")
    p.add_argument("--cap", type=int, default=1_677_721, help="bdet: rows of the table")
    p.add_argument("--cfr", type=float, default=0.8, help="bdet: cache rows over touched rows")
    p.add_argument("--ties", nargs="+", choices=["keep", "admit"], default=["keep"],
                   help="bdet: the admission rule's ties (keep: the rule as it is)")
    a = p.parse_args()
    if a.workload == "bdet":
        return bdet_policy(a)
    corpus = ZipfCorpus(a.vocab, 20, a.tokens)
    batches = [corpus.batch(a.batch, a.negatives) for _ in range(a.batches)]
    per_step = [np.unique(v_ids(b)) for b in batches]
    used = np.bincount(np.concatenate(per_step), minlength=a.vocab)
    oracle = np.zeros(a.vocab, dtype=bool)
    oracle[np.argsort(-used, kind="stable")[: a.slots]] = True
    by_count = np.zeros(a.vocab, dtype=bool)
    by_count[np.argsort(-corpus.counts, kind="stable")[: a.slots]] = True
    print(f"v table, {a.vocab:,} rows, {a.slots:,} slots, {a.batches} batches cycled: oracle "
          f"{fixed_hit_rate(per_step, oracle):.3f}, corpus-frequency cache "
          f"{fixed_hit_rate(per_step, by_count):.3f}")
    for admission in a.admission:
        for steps in a.steps:
            store = CachedRows(torch.zeros(a.vocab, 1, 1), torch.device("cpu"), a.slots,
                               aging_steps=a.aging, admission=admission)
            start = time.perf_counter()
            d = simulate(store, batches, steps, a.warmup, prefetch=False)
            print(f"LFU, admission {admission}, steps {a.warmup}-{steps}: hit rate "
                  f"{d[1] / d[0]:.3f}, evictions {d[3] / (steps - a.warmup):,.0f} and direct "
                  f"write-backs {d[4] / (steps - a.warmup):,.0f} per step "
                  f"({time.perf_counter() - start:.0f} s)")
    if a.prefetch:
        prefetch_split(a, batches)


def bdet_policy(a) -> None:
    """One table of the public benchmark: --batches batches cycled for max(--steps) steps, the
    counts after the first --batches (the warm-up pass, as bench/bdet.py runs them)."""
    from bdet import power_law  # bench/ is this script's folder
    torch.manual_seed(0)
    per = power_law(1, a.cap, 1.05, a.batches * 104_857, "cpu").view(a.batches, -1)
    per_step = [np.unique(b.numpy()) for b in per]
    drawn = np.bincount(per.flatten().numpy(), minlength=a.cap)
    slots = int(a.cfr * int((drawn > 0).sum()))
    static = np.zeros(a.cap, dtype=bool)
    static[np.argsort(-drawn, kind="stable")[:slots]] = True
    print(f"bdet table, {a.cap:,} rows, {slots:,} slots ({a.cfr} x the touched rows), "
          f"{a.batches} batches cycled: best static cache {fixed_hit_rate(per_step, static):.3f}")
    real = ops._admission
    for ties in a.ties:
        def admission(ids, first, victims, cold, misses, freq, id_of, by_frequency):
            if ties == "admit":  # freq > the next float below cold: freq >= cold
                cold = torch.nextafter(cold, torch.tensor(-float("inf")))
            return real(ids, first, victims, cold, misses, freq, id_of, by_frequency)
        ops._admission = admission
        try:
            for steps in a.steps:
                store = CachedRows(torch.zeros(a.cap, 1, 1), torch.device("cpu"), slots,
                                   aging_steps=a.aging)
                d = simulate(store, per, steps, a.batches, prefetch=False, ids=lambda b: b)
                n = steps - a.batches
                print(f"LFU, ties {ties}, steps {a.batches}-{steps}: hit rate {d[1] / d[0]:.3f}, "
                      f"host loads {d[2] / n:,.0f}, evictions {d[3] / n:,.0f} and misses not "
                      f"admitted {d[4] / n:,.0f} per step")
        finally:
            ops._admission = real


def prefetch_split(a, batches) -> None:
    """Per step, with each step prefetching the next: distinct rows, hits, host loads (misses:
    of them loaded ahead, the rest in the step), rows the prefetches loaded (taken or not)."""
    steps = max(a.steps)
    table = torch.zeros(a.vocab, 1, 1)
    for slots in (0, a.slots):
        store = (CachedRows(table, torch.device("cpu"), slots, aging_steps=a.aging) if slots
                 else HostRows(table, torch.device("cpu")))
        d = [x / (steps - a.warmup) for x in simulate(store, batches, steps, a.warmup, True)]
        lookups, hits, loads, ahead, prefetched = d[0], d[1], d[2], d[5], d[6]
        print(f"prefetch, {'no cache' if not slots else f'{slots:,} slots'}, steps "
              f"{a.warmup}-{steps}, per step: {lookups:,.0f} distinct rows, {hits:,.0f} hits, "
              f"{loads:,.0f} host loads: {ahead:,.0f} ahead ({ahead / max(loads, 1):.3f}), "
              f"{loads - ahead:,.0f} in the step; {prefetched:,.0f} rows prefetched")

if __name__ == "__main__":
    main()
