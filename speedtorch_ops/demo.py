"""The main job: skip-gram with negative sampling, the embedding tables and their optimizer state
in pinned host memory (the GPU holds only the batch), trained through the SpeedTorch-compatible
factories, on an embedded corpus with planted structure.

The corpus is generated deterministically: the vocabulary is split into clusters of
--cluster-size words; each sentence draws most of its words from one cluster and the rest from
the whole vocabulary (Zipf-like noise). Words of a cluster co-occur, so a trained embedding puts
them next to each other: the quality score is the share of each word's nearest neighbours
(cosine, centre embeddings) that are in its own cluster (chance: about cluster_size / vocab).

    python -m speedtorch_ops.demo                      # CPU when no GPU is present
    python -m speedtorch_ops.demo --vocab 4000000 --dim 128 --batch 8192 --device cuda \
        --gpu-budget-mb 2048 --baseline                 # table bigger than the GPU budget
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np
import torch
from torch import Tensor, nn

import speedtorch_ops as so

OPTIMIZERS = {  # name -> (params, lr, fused) -> optimizer
    "adam": lambda p, lr, fused: torch.optim.Adam(p, lr=lr, fused=fused),
    "adamw": lambda p, lr, fused: torch.optim.AdamW(p, lr=lr, fused=fused),
    "adagrad": lambda p, lr, fused: torch.optim.Adagrad(p, lr=lr * 10, fused=fused),
    "rmsprop": lambda p, lr, fused: torch.optim.RMSprop(p, lr=lr / 5),  # no fused version
    "sgd": lambda p, lr, fused: torch.optim.SGD(p, lr=lr * 100, momentum=0.9, fused=fused),
}


class Corpus:
    """Sentences with planted clusters, generated from a fixed seed (the embedded default data)."""

    def __init__(self, vocab: int, cluster_size: int, tokens: int, seed: int = 2019):
        rng = np.random.default_rng(seed)
        self.vocab, self.cluster_size = vocab, cluster_size
        self.cluster = rng.permutation(vocab) // cluster_size  # word -> its cluster
        members = np.argsort(self.cluster, kind="stable").reshape(-1, cluster_size)
        sentence = 12
        topics = rng.integers(0, members.shape[0], tokens // sentence)
        in_cluster = members[topics[:, None], rng.integers(0, cluster_size, (len(topics), sentence))]
        noise = np.minimum(rng.zipf(1.3, (len(topics), sentence)) - 1, vocab - 1)
        self.text = np.where(rng.random((len(topics), sentence)) < 0.8, in_cluster, noise)
        counts = np.bincount(self.text.ravel(), minlength=vocab).astype(np.float64) + 1
        self.negative_weights = torch.from_numpy(counts ** 0.75 / (counts ** 0.75).sum())
        self.rng = rng

    def batch(self, size: int, negatives: int, window: int = 3):
        """(centres (B,1), contexts (B,1), negatives (B,N)) as int32 NumPy arrays."""
        rows = self.rng.integers(0, self.text.shape[0], size)
        cols = self.rng.integers(0, self.text.shape[1], size)
        shift = self.rng.integers(1, window + 1, size) * self.rng.choice([-1, 1], size)
        ctx_cols = np.clip(cols + shift, 0, self.text.shape[1] - 1)
        ctx_cols = np.where(ctx_cols == cols, (cols + 1) % self.text.shape[1], ctx_cols)
        negs = torch.multinomial(self.negative_weights, size * negatives, replacement=True)
        return (self.text[rows, cols].reshape(size, 1).astype(np.int32),
                self.text[rows, ctx_cols].reshape(size, 1).astype(np.int32),
                negs.numpy().reshape(size, negatives).astype(np.int32))


class SkipGram(nn.Module):
    """Batch-sized embeddings: called with slot numbers (variableTransformer), not word ids.

    The lookups use ``index_select`` on the embeddings' weights: its backward adds into the
    gradient without reading anything back to the host, while nn.Embedding's dense CUDA backward
    waits for the GPU once per call (a count read back), which would stop the host from queueing
    the next step's transfers ahead. Same values, same gradients."""

    def __init__(self, u_rows: int, v_rows: int, dim: int, sparse: bool = False):
        super().__init__()
        self.u_embeddings = nn.Embedding(u_rows, dim, sparse=sparse)
        self.v_embeddings = nn.Embedding(v_rows, dim, sparse=sparse)

    @staticmethod
    def _lookup(embedding: nn.Embedding, slots: Tensor) -> Tensor:
        if embedding.sparse:
            return embedding(slots)
        return embedding.weight.index_select(0, slots.reshape(-1)).view(*slots.shape, -1)

    def forward(self, centre, context, negatives):
        u = self._lookup(self.u_embeddings, centre)                          # (B, 1, D)
        pos = (u * self._lookup(self.v_embeddings, context)).sum(-1)         # (B, 1)
        neg = (u * self._lookup(self.v_embeddings, negatives)).sum(-1)       # (B, N)
        return -(nn.functional.logsigmoid(pos).mean() + nn.functional.logsigmoid(-neg).sum(1).mean())


def neighbour_precision(table: torch.Tensor, cluster: np.ndarray, sample: int = 1000, k: int = 5,
                        seed: int = 0) -> float:
    """Share of the k nearest neighbours (cosine) of `sample` words that share their cluster."""
    rng = np.random.default_rng(seed)
    words = rng.choice(table.shape[0], min(sample, table.shape[0]), replace=False)
    emb = torch.nn.functional.normalize(table.float(), dim=1)
    hits = 0
    for chunk in np.array_split(words, max(1, len(words) // 256)):
        sims = emb[torch.from_numpy(chunk)] @ emb.T
        sims[torch.arange(len(chunk)), torch.from_numpy(chunk)] = -2  # not itself
        top = sims.topk(k, dim=1).indices.numpy()
        hits += (cluster[top] == cluster[chunk][:, None]).sum()
    return hits / (len(words) * k)


def progress(iterable, total):
    try:
        from tqdm import tqdm
        return tqdm(iterable, total=total, mininterval=1.0, unit="step")
    except ImportError:  # tqdm is optional
        return iterable


def batch_source(a, corpus):
    """step -> batch: fresh draws, or with --reuse-batches 64 batches drawn ahead and cycled."""
    if not a.reuse_batches:
        return lambda step: corpus.batch(a.batch, a.negatives)
    batches = [corpus.batch(a.batch, a.negatives) for _ in range(min(a.steps, 64))]
    return lambda step: batches[step % len(batches)]


def resolve_switching(switching: str, device) -> str:
    if switching == "auto":
        return "colocated" if torch.device(device).type == "cuda" else "plain"
    return switching


class SwitcherTraining:
    """The tables in pinned host memory (ordinary memory without a GPU), the optimizer state
    too; a step loads the batch's rows, trains the batch-sized model, and writes the rows back.

    On a GPU each table's weight and optimizer state share one host table by default
    (``speedtorch_ops.colocate``: one transfer of 1.5 KiB rows per table each way instead of
    three of 512 B); ``--switching prefetch`` also loads the next batch while the current one
    trains, ``--switching plain`` uses SpeedTorch 0.1.6's calls only."""

    def __init__(self, a, device):
        B, N = a.batch, a.negatives
        self.model = SkipGram(B, B * (1 + N), a.dim).to(device)
        self.optimizer = OPTIMIZERS[a.optimizer](self.model.parameters(), a.lr, a.fused or None)
        self.u_sw = so.ModelFactory(self.model.u_embeddings, a.vocab, a.dim, CPUPinn=True)
        self.v_sw = so.ModelFactory(self.model.v_embeddings, a.vocab, a.dim, CPUPinn=True)
        self.u_opt = so.OptimizerFactory(self.optimizer, a.vocab, a.dim, self.model,
                                         "u_embeddings", CPUPinn=True)
        self.v_opt = so.OptimizerFactory(self.optimizer, a.vocab, a.dim, self.model,
                                         "v_embeddings", CPUPinn=True)
        if device.type == "cuda" and a.transfer_sms:
            so.set_transfer_sm_limit(a.transfer_sms)  # process-wide
        switching = resolve_switching(a.switching, device)
        self.prefetching = switching == "prefetch"
        if switching != "plain":  # before the init methods: they fill the shared tables
            so.colocate(self.u_sw, self.u_opt)
            so.colocate(self.v_sw, self.v_opt)
        bound = 0.5 / a.dim
        self.u_sw.uniformDistributionInit(-bound, bound)
        self.v_sw.normalDistributionInit(0.0, bound)
        self.u_opt.optInit()
        self.v_opt.optInit()
        self.centre = torch.as_tensor(self.u_sw.variableTransformer(B, 1), device=device)
        self.context, self.negatives = (torch.as_tensor(x, device=device)
                                        for x in self.v_sw.variableTransformer(B, 1, N))

    def _each_factory(self, method: str, labels, ctx, negs) -> None:
        """factory.<method>(ids) for the weights and the optimizer state of both tables:
        centre words for u, contexts then negatives for v (SpeedTorch's index order)."""
        with torch.no_grad():
            for factory, ids in ((self.u_sw, (labels,)), (self.v_sw, (ctx, negs)),
                                 (self.u_opt, (labels,)), (self.v_opt, (ctx, negs))):
                getattr(factory, method)(*ids)

    def load(self, labels, ctx, negs) -> None:
        self._each_factory("beforeForwardPass", labels, ctx, negs)

    def prefetch(self, labels, ctx, negs) -> None:
        """Start moving the next batch's rows while this one trains (colocated factories)."""
        with torch.no_grad():
            self.u_sw.prefetch(labels)
            self.v_sw.prefetch(ctx, negs)

    def compute(self) -> Tensor:
        self.optimizer.zero_grad(set_to_none=True)
        loss = self.model(self.centre, self.context, self.negatives)
        loss.backward()
        self.optimizer.step()
        return loss.detach()

    def write_back(self, labels, ctx, negs) -> None:
        self._each_factory("afterOptimizerStep", labels, ctx, negs)

    def step(self, batch, following=None) -> Tensor:
        """One training step on `batch` (labels, contexts, negatives); with prefetch on, the
        `following` batch (if any) starts loading while this one trains."""
        self.load(*batch)
        if following is not None and self.prefetching:
            self.prefetch(*following)
        loss = self.compute()
        self.write_back(*batch)
        return loss

    def tables(self) -> list:
        return [self.u_sw.CUPYcorpus, self.v_sw.CUPYcorpus, *self.u_opt.CUPYcorpi,
                *self.v_opt.CUPYcorpi]


def timed_steps(a, device, step) -> float:
    """Runs step(i) for i in range(a.steps) and returns the seconds of the steps after the
    first `warmup_steps(a)` (first calls allocate, load kernels and fill caches); the clock
    starts and stops with the device idle."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    warmup, start = warmup_steps(a), None
    for i in progress(range(a.steps), a.steps):
        if i == warmup:
            sync()
            start = time.perf_counter()
        step(i)
    sync()
    return time.perf_counter() - start


def warmup_steps(a) -> int:
    return min(10, a.steps // 10)


def train_switchers(a, corpus, device):
    run = SwitcherTraining(a, device)
    losses = []
    next_batch = batch_source(a, corpus)
    batch = [next_batch(0)]  # this step's

    def step(i):
        following = next_batch(i + 1) if i + 1 < a.steps else None
        loss = run.step(batch[0], following)
        batch[0] = following
        if i % max(1, a.steps // 20) == 0 or i == a.steps - 1:
            losses.append(loss)  # read after the run: a read here would wait for the GPU

    seconds = timed_steps(a, device, step)
    B, N = a.batch, a.negatives
    rows_per_step = 2 * (B + B * (1 + N)) * (1 + len(run.u_opt.optVarList))  # loaded + written
    return dict(seconds=seconds, losses=[float(x) for x in losses], rows_per_step=rows_per_step,
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                host_table_bytes=sum(t.nbytes for t in run.tables()), table=run.u_sw.CUPYcorpus)


def train_all_on_gpu(a, corpus, device):
    """Plain PyTorch baseline: the full tables on the GPU, sparse gradients, SparseAdam (the same
    lazy semantics as the switchers with Adam). Timed like the switchers (timed_steps)."""
    model = SkipGram(a.vocab, a.vocab, a.dim, sparse=True).to(device)
    optimizer = torch.optim.SparseAdam(model.parameters(), lr=a.lr)
    next_batch = batch_source(a, corpus)

    def step(i):
        ids = [torch.as_tensor(x, dtype=torch.int64).to(device, non_blocking=True)
               for x in next_batch(i)]
        optimizer.zero_grad(set_to_none=True)
        model(*ids).backward()
        optimizer.step()

    return timed_steps(a, device, step)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--vocab", type=int, default=20_000, help="rows of each embedding table")
    p.add_argument("--cluster-size", type=int, default=20, help="words per planted cluster")
    p.add_argument("--tokens", type=int, default=2_000_000, help="corpus length")
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1024, help="centre words per step")
    p.add_argument("--negatives", type=int, default=5)
    p.add_argument("--steps", type=int, default=3000)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    p.add_argument("--fused", action="store_true",
                   help="torch's fused optimizer kernels (fused=True): adam, adamw, sgd; "
                        "adagrad on the CPU only (torch has no fused rmsprop)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--gpu-budget-mb", type=float, default=None,
                   help="cap this process's CUDA memory (to show tables larger than the budget)")
    p.add_argument("--baseline", action="store_true",
                   help="also time plain PyTorch with the whole tables on the GPU")
    p.add_argument("--switching", choices=["auto", "plain", "colocated", "prefetch"],
                   default="auto",
                   help="plain: SpeedTorch 0.1.6's calls (separate weight and state tables); "
                        "colocated: weight and state rows side by side in one host table "
                        "(speedtorch_ops.colocate); prefetch: colocated, and the next batch's "
                        "rows load while the current one trains; auto: colocated on a GPU, "
                        "plain on the CPU (bench/RESULTS.md has the measurements)")
    p.add_argument("--transfer-sms", type=int, default=16,
                   help="SMs the transfer kernels may use (0: all). Capped, the loads and "
                        "write-backs of the two tables run beside each other and beside the "
                        "training kernels; on the H100, 16 SMs move rows as fast as all 132 "
                        "(bench/probes/overlap.py) and the demo steps faster")
    p.add_argument("--reuse-batches", action="store_true",
                   help="cycle 64 pre-drawn batches (times the transfers, not NumPy sampling)")
    return p


def main(argv=None) -> None:
    p = parser()
    a = p.parse_args(argv)
    if a.steps < 1:
        p.error("--steps must be at least 1")
    if a.fused and a.optimizer == "rmsprop":
        p.error("--fused: torch has no fused RMSprop")
    device = torch.device(a.device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)

    corpus = Corpus(a.vocab, a.cluster_size, a.tokens)
    table_mb = a.vocab * a.dim * 4 / 2**20
    if a.gpu_budget_mb is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(a.gpu_budget_mb * 2**20 / total, device)
    print(f"skip-gram: vocab {a.vocab:,} x dim {a.dim} ({table_mb:,.0f} MiB per table, 2 tables "
          f"+ {a.optimizer} state in {'pinned host' if device.type == 'cuda' else 'host'} memory), "
          f"batch {a.batch:,} x (1 context + {a.negatives} negatives), {a.steps} steps on {device}"
          f" ({resolve_switching(a.switching, device)} switching)"
          + (f", GPU budget {a.gpu_budget_mb:,.0f} MiB" if a.gpu_budget_mb else ""))

    r = train_switchers(a, corpus, device)
    quality = neighbour_precision(r["table"], corpus.cluster)
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
    print(f"quality: nearest-neighbour precision@5 {quality:.3f} (chance {chance:.4f})")
    if a.baseline and device.type == "cuda":
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.reset_peak_memory_stats(device)
        base = timed / train_all_on_gpu(a, corpus, device)
        print(f"baseline, whole tables on the GPU (SparseAdam): steps/s {base:,.1f}, GPU peak "
              f"{torch.cuda.max_memory_allocated(device) / 2**20:,.0f} MiB; switchers / baseline "
              f"= {steps_per_s / base:.2f}")
    # Judged only when each word was a centre ~20 times (short runs on huge tables time speed).
    if a.steps * a.batch >= 20 * a.vocab and not (r["losses"][-1] < r["losses"][0]
                                                   and quality > 5 * chance):
        raise SystemExit("training did not learn the planted structure")


if __name__ == "__main__":
    main()
