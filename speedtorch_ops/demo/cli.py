"""The demo's command line: python -m speedtorch_ops.demo --help."""

from __future__ import annotations

import argparse
import contextlib

import torch

import speedtorch_ops as so

from . import __doc__ as DOC
from .corpus import CORPORA
from .model import neighbour_precision
from .train import (DTYPES, OPTIMIZERS, resolve_switching, train_all_on_gpu, train_engine,
                    warmup_steps)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m speedtorch_ops.demo", description=DOC,
                                formatter_class=argparse.RawTextHelpFormatter)
    _workload_args(p)
    _engine_args(p)
    return p


def _workload_args(p: argparse.ArgumentParser) -> None:
    """What is trained: the corpus, the tables, the batches, the optimizer."""
    p.add_argument("--vocab", type=int, default=20_000, help="rows of each embedding table")
    p.add_argument("--cluster-size", type=int, default=20, help="words per planted cluster")
    p.add_argument("--tokens", type=int, default=2_000_000, help="corpus length")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024, help="centre words per step")
    p.add_argument("--negatives", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="the tables' and their optimizer state's dtype (collection and module engines; 16-bit "
                        "tables round their updates stochastically)")
    p.add_argument("--rounding", choices=["stochastic", "nearest"], default="stochastic",
                   help="how 16-bit tables store their updates")
    p.add_argument("--fused", choices=["auto", "on", "off"], default="auto",
                   help="torch's fused optimizer kernels (fused=True): adam, adamw, sgd; "
                        "adagrad on the CPU only (torch has no fused rmsprop); auto: on for the "
                        "collection and module engines on a GPU with adam or adamw (one kernel instead of "
                        "several a step; docs/decisions.md, 'The demo's fused optimizer')")
    p.add_argument("--corpus", choices=sorted(CORPORA), default="zipf",
                   help="zipf: word frequencies ~ 1/rank, as in natural text (the default); "
                        "uniform: near-uniform words (nothing for a cache to keep)")
    p.add_argument("--reuse-batches", action="store_true",
                   help="cycle 64 pre-drawn batches (times the transfers, not NumPy sampling)")


def _engine_args(p: argparse.ArgumentParser) -> None:
    """How it is trained: the device, the engine, its cache, capture and prefetch."""
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpu-budget-mb", type=float, default=None,
                   help="cap this process's CUDA memory (to show tables larger than the budget)")
    p.add_argument("--baseline", action="store_true",
                   help="also time plain PyTorch with the whole tables on the GPU")
    p.add_argument("--engine", choices=["auto", "collection", "module", "factories"],
                   default="auto",
                   help="collection: both tables in one speedtorch_ops.HostEmbeddingCollection "
                        "(one step plans both) with a GPU row cache of --cache-mb; module: a "
                        "speedtorch_ops.HostEmbedding a table, the cache split between them; "
                        "factories: SpeedTorch's ModelFactory/OptimizerFactory calls "
                        "(--switching); auto: collection on a GPU, factories on the CPU")
    # 1100: everything of ours within 1.5 GiB of GPU memory. A captured step with prefetch
    # needs room beside its cache for the step's buffers and, while it is captured, for a
    # second copy of them (the graph's own pool); a larger cache leaves the capture short of
    # a 1536 MiB budget. See docs/decisions.md, "The demo's row cache budget".
    p.add_argument("--cache-mb", type=float, default=1100,
                   help="GPU row cache of the collection and module engines, for both tables "
                        "together (rows with their optimizer state, and the cache's index)")
    p.add_argument("--graph", choices=["auto", "on", "off"], default="auto",
                   help="collection and module engines on a GPU: capture the whole step once in "
                        "a CUDA graph and replay it (speedtorch_ops.CapturedStep); auto: on "
                        "unless --optimizer adagrad (its step count stays on the CPU)")
    p.add_argument("--prefetch", choices=["auto", "on", "off"], default="auto",
                   help="collection and module engines: load the next batch's rows (those the "
                        "caches miss) on a side stream while the current batch trains "
                        "(HostEmbedding.prefetch; "
                        "a captured step takes the next batch's ids as inputs); auto: on in a "
                        "captured step, else off (docs/decisions.md, 'The demo's prefetch')")
    p.add_argument("--switching", choices=["auto", "plain", "colocated", "prefetch"],
                   default="auto",
                   help="plain: SpeedTorch 0.1.6's calls (separate weight and state tables); "
                        "colocated: weight and state rows side by side in one host table "
                        "(speedtorch_ops.colocate); prefetch: colocated, and the next batch's "
                        "rows load while the current one trains; auto: colocated on a GPU, "
                        "plain on the CPU (docs/decisions.md, 'The demo's colocated rows')")
    p.add_argument("--transfer-sms", type=int, default=16,
                   help="SMs the transfer kernels may use (0: all). Capped, the loads and "
                        "write-backs of the two tables run beside each other and beside the "
                        "training kernels; a few SMs move rows as fast as all of them "
                        "(docs/decisions.md, 'The demo's transfer SM cap')")


def _resolve(p: argparse.ArgumentParser, a: argparse.Namespace) -> torch.device:
    """The "auto" choices made and the contradictory ones refused; the device."""
    if a.steps < 1:
        p.error("--steps must be at least 1")
    if a.fused == "on" and a.optimizer == "rmsprop":
        p.error(f"--fused: there is no fused {a.optimizer}")
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)

    module_only = a.optimizer in ("rowwise-adagrad", "partial-rowwise-adam")
    if a.engine == "auto":
        a.engine = "collection" if device.type == "cuda" or module_only or a.dtype != "float32" \
            else "factories"
    if a.engine == "factories" and a.dtype != "float32":
        p.error("--dtype: the factories keep float32 tables; use --engine collection")
    if a.engine == "factories" and module_only:
        p.error(f"--optimizer {a.optimizer}: the factories keep per-element state; use "
                "--engine collection")
    a.fused = a.fused == "on" or (a.fused == "auto" and a.engine in ("collection", "module") and
                                  device.type == "cuda" and a.optimizer in ("adam", "adamw"))
    return device


def _describe(a: argparse.Namespace, device: torch.device) -> str:
    table_mb = a.vocab * a.dim * DTYPES[a.dtype].itemsize / 2**20
    engine = ({"collection": "a HostEmbeddingCollection of both tables",
               "module": "HostEmbedding modules"}[a.engine]
              + (f", GPU row cache {a.cache_mb:,.0f} MiB" if device.type == "cuda" else "")
              if a.engine != "factories"
              else f"factories ({resolve_switching(a.switching, device)} switching)")
    return (f"skip-gram: vocab {a.vocab:,} x dim {a.dim} ({table_mb:,.0f} MiB per table, 2 "
            f"tables + {a.optimizer} state in "
            f"{'pinned host' if device.type == 'cuda' else 'host'} memory), batch {a.batch:,} x "
            f"(1 context + {a.negatives} negatives), {a.steps} steps on {device}, {a.corpus} "
            f"corpus, {engine}"
            + (f", GPU budget {a.gpu_budget_mb:,.0f} MiB" if a.gpu_budget_mb else ""))


def main(argv=None) -> None:
    p = parser()
    a = p.parse_args(argv)
    device = _resolve(p, a)
    corpus = CORPORA[a.corpus](a.vocab, a.cluster_size, a.tokens)
    if a.gpu_budget_mb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(a.gpu_budget_mb * 2**20 / total, device)
    print(_describe(a, device))
    # The SM cap is process-wide: set for the factories' training only, restored after it.
    capped = device.type == "cuda" and a.transfer_sms and a.engine == "factories"
    with so.transfer_sm_limit(a.transfer_sms) if capped else contextlib.nullcontext():
        r = train_engine(a, corpus, device)
    _report(a, r, corpus, device)


def _report(a: argparse.Namespace, r: dict, corpus, device: torch.device) -> None:
    """The run's loss, speed, memory and quality; the baseline's speed with --baseline."""
    quality = neighbour_precision(r["table"], corpus.cluster, corpus.judged_words())
    chance = (a.cluster_size - 1) / (a.vocab - 1)
    timed = a.steps - warmup_steps(a)
    steps_per_s = timed / r["seconds"]
    print(f"loss {r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}")
    print(f"steps/s {steps_per_s:,.1f} (the {timed} steps after {a.steps - timed} warm-up steps); "
          f"rows moved {r['rows_per_step'] * steps_per_s / 1e6:,.2f} M/s "
          f"(weights and optimizer state, loaded and written back)")
    print(f"host tables {r['host_table_bytes'] / 2**20:,.0f} MiB; process peak RSS "
          f"{r['peak_rss'] / 2**20:,.0f} MiB (set-up and training)"
          + (f"; GPU peak {torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB"
             if device.type == "cuda" else ""))
    if r["describe"]:
        print(r["describe"])
    print(f"quality: nearest-neighbour precision@5 {quality:.3f} of the words seen 50+ times "
          f"(chance {chance:.4f})")
    if a.baseline and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.reset_peak_memory_stats(device)
        base = timed / train_all_on_gpu(a, corpus, device)
        print(f"baseline, whole tables on the GPU (SparseAdam): steps/s {base:,.1f}, GPU peak "
              f"{torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB; ours / baseline "
              f"= {steps_per_s / base:.2f}")  # noqa
    # Judged only when each word was a centre ~20 times (short runs on huge tables time speed).
    if a.steps * a.batch >= 20 * a.vocab and not (r["losses"][-1] < r["losses"][0]
                                                   and quality > 5 * chance):
        raise SystemExit("training did not learn the planted structure")
