"""The demo's training loops: through the SpeedTorch-compatible factories (tables in pinned host
memory), and the plain-PyTorch baseline with the whole tables on the GPU; both timed alike."""

from __future__ import annotations

import inspect
import resource
import time

import torch
from torch import Tensor

import speedtorch_ops as so

from .model import SkipGram, skipgram_loss

OPTIMIZERS = {  # name -> (lr, fused) -> (optimizer class, its keyword arguments)
    "adam": lambda lr, fused: (torch.optim.Adam, dict(lr=lr, fused=fused)),
    "adamw": lambda lr, fused: (torch.optim.AdamW, dict(lr=lr, fused=fused)),
    "adagrad": lambda lr, fused: (torch.optim.Adagrad, dict(lr=lr * 10, fused=fused)),
    "rmsprop": lambda lr, fused: (torch.optim.RMSprop, dict(lr=lr / 5)),  # no fused version
    "sgd": lambda lr, fused: (torch.optim.SGD, dict(lr=lr * 100, momentum=0.9, fused=fused)),
    # One accumulator per row: a third of Adam's bytes per row (module engine only).
    "rowwise-adagrad": lambda lr, fused: (so.RowWiseAdagrad, dict(lr=lr * 10)),
    # Adam's first moment per element, its second per row (module engine only).
    "partial-rowwise-adam": lambda lr, fused: (so.PartialRowWiseAdam, dict(lr=lr)),
}
# --dtype: the tables' and their state's dtype (module engine only).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
        cls, kwargs = OPTIMIZERS[a.optimizer](a.lr, a.fused or None)
        self.optimizer = cls(self.model.parameters(), **kwargs)
        self.u_sw = so.ModelFactory(self.model.u_embeddings, a.vocab, a.dim, CPUPinn=True)
        self.v_sw = so.ModelFactory(self.model.v_embeddings, a.vocab, a.dim, CPUPinn=True)
        self.u_opt = so.OptimizerFactory(self.optimizer, a.vocab, a.dim, self.model,
                                         "u_embeddings", CPUPinn=True)
        self.v_opt = so.OptimizerFactory(self.optimizer, a.vocab, a.dim, self.model,
                                         "v_embeddings", CPUPinn=True)
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

    def weight(self) -> Tensor:
        return self.u_sw.CUPYcorpus

    def rows_per_step(self, a) -> float:
        """Rows moved per step: every slot's weight and state rows, loaded and written back."""
        B, N = a.batch, a.negatives
        return 2 * (B + B * (1 + N)) * (1 + len(self.u_opt.optVarList))

    def describe(self) -> str:
        return ""


def set_sm_caps(ebc, a) -> None:
    """The SM caps of the collection `ebc`'s row caches (CachedRows.lane_sms, write_sms) from
    `a.lane_sms` and `a.write_sms` where they are given (not None); groups without a cache
    have none."""
    for cap in ("lane_sms", "write_sms"):
        for g in ebc.groups:
            if getattr(a, cap, None) is not None and hasattr(g.store, cap):
                setattr(g.store, cap, getattr(a, cap))


def _graph_settings(a, cls, kwargs: dict, device) -> tuple:
    """(captured, prefetching) for --graph and --prefetch with optimizer `cls`; sets
    ``capturable`` in `kwargs` where a captured step needs it."""
    graph, prefetch = getattr(a, "graph", "off"), getattr(a, "prefetch", "off")
    # Adagrad keeps its step count on the CPU and has no capturable mode (the others of
    # OPTIMIZERS either have one or keep no step count).
    cpu_step = cls is torch.optim.Adagrad and not kwargs.get("fused")
    # auto: a graph on a GPU (a replay queues the whole step at once, where eager steps
    # wait for the host: docs/decisions.md, "The demo's captured step"); eager steps when
    # the optimizer cannot be captured.
    graphed = device.type == "cuda" and (graph == "on" or (graph == "auto" and not cpu_step))
    if graphed and "capturable" in inspect.signature(cls).parameters:
        # The step counter stays on the GPU; torch refuses to capture an optimizer without
        # it, fused or not.
        kwargs["capturable"] = True
    # Each step prefetches the next one's rows (a captured step takes its ids as inputs).
    # auto: in a captured step, where the prefetch's transfers run beside the step's own
    # kernels (eager steps would add its host work to theirs): docs/decisions.md, "The
    # demo's prefetch".
    return graphed, prefetch == "on" or (prefetch == "auto" and graphed)


class CollectionTraining:
    """Both tables in one ``speedtorch_ops.HostEmbeddingCollection`` (u: the centre words,
    feature "centre"; v: each centre's context and its negatives, features "context" and
    "negatives"): one step plans both tables at once, one sort, one cache lookup, one transfer
    each way, one fused update; their rows and optimizer state in (pinned) host memory behind
    one GPU row cache of ``--cache-mb``. On a GPU (``--graph auto`` or ``on``) the whole step is captured once in a
    CUDA graph (``speedtorch_ops.CapturedStep``) that also prefetches the next batch's rows.
    `sharded`: the tables split by rows over the default process group
    (``ShardedHostEmbeddingBagCollection``, `exchange` its exchange)."""

    def __init__(self, a, device, sharded: bool = False, exchange: str = "auto"):
        cls, kwargs = OPTIMIZERS[a.optimizer](a.lr, getattr(a, "fused", None) or None)
        self.graphed, self.prefetching = _graph_settings(a, cls, kwargs, device)
        self.a, self.vocab, self.steps_done = a, a.vocab, 0
        tables = [so.TableConfig("u", a.vocab, a.dim, pooling="none", feature_names=["centre"]),
                  so.TableConfig("v", a.vocab, a.dim, pooling="none",
                                 feature_names=["context", "negatives"])]
        options = dict(optimizer=cls, optimizer_kwargs=kwargs, device=device,
                       cache_bytes=int(a.cache_mb * 2**20) if device.type == "cuda" else 0,
                       bounds_check=getattr(a, "bounds_check", None)
                       or ("prechecked" if self.graphed else "raise"),
                       dtype=DTYPES[getattr(a, "dtype", "float32")],
                       stochastic_rounding=getattr(a, "rounding", None) != "nearest")
        if sharded:
            self.ebc = so.distributed.ShardedHostEmbeddingBagCollection(tables, exchange=exchange,
                                                                        **options)
        else:
            self.ebc = so.HostEmbeddingCollection(tables, **options)
        bound = 0.5 / a.dim
        self.ebc.reset_parameters({"u": lambda w: so.fill_random_(w, "uniform", -bound, bound),
                                   "v": lambda w: so.fill_random_(w, "normal", 0.0, bound)})
        set_sm_caps(self.ebc, a)  # where a bench sets them
        self._captured = None
        self._jagged: dict = {}  # (batch, negatives, device) -> the jagged batch's lengths

    def set_cache_mb(self, cache_mb: float) -> None:
        """The caches resized to share `cache_mb` (see the collection's set_cache_bytes)."""
        self._captured = None  # the graph used the old caches
        self.ebc.set_cache_bytes(int(cache_mb * 2**20))

    def _kjt(self, labels, ctx, negs):
        """The batch as a jagged batch: a bag of one centre, one context and the negatives
        per sample; its lengths and offsets depend on the shapes only, made once (a captured
        step's warm-up makes them)."""
        b, n = labels.shape[0], negs.shape[1]
        values = torch.cat([labels.reshape(-1), ctx.reshape(-1), negs.reshape(-1)])
        key = (b, n, values.device)
        if key not in self._jagged:
            lengths = torch.tensor([1] * (2 * b) + [n] * b, dtype=torch.int64)
            offsets = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
            self._jagged[key] = (lengths.to(values.device), offsets.to(values.device))
        lengths, offsets = self._jagged[key]
        return so.KeyedJaggedTensor(["centre", "context", "negatives"], values, lengths=lengths,
                                    offsets=offsets, length_per_key=[b, b, b * n])

    def _train(self, labels, ctx, negs, *following) -> Tensor:
        out = self.ebc(self._kjt(labels, ctx, negs))
        if following:  # loads while this step's backward and update run
            self.ebc.prefetch(self._kjt(*following))
        b, d = labels.shape[0], self.a.dim
        # 16-bit rows: float32 math
        loss = skipgram_loss(out["centre"].values().view(b, 1, d).float(),
                             out["context"].values().view(b, 1, d).float(),
                             out["negatives"].values().view(b, -1, d).float())
        loss.backward()
        self.ebc.step()
        return loss.detach()

    def step(self, batch, following=None) -> Tensor:
        """One step on `batch`; with prefetching on, the rows of `following` (the next batch;
        None: there is none, and a captured step prefetches `batch` again, which loads
        nothing) load during it."""
        self.steps_done += 1
        if not self.prefetching:
            following = None
        elif following is None:
            following = batch
        if self.graphed:
            if self._captured is None:
                self._captured = so.CapturedStep(
                    self._train, rows=(self.vocab,) * (6 if self.prefetching else 3),
                    device=self.ebc.device, group=getattr(self.ebc, "route_group", None))
            return self._captured(*batch, *(following or ())).clone()  # overwritten next step
        inputs = [torch.as_tensor(x).to(self.ebc.device) for x in (*batch, *(following or ()))]
        return self._train(*inputs)

    @property
    def embeddings(self) -> list:
        """The modules whose stores hold the rows (each with ``store`` and ``cache_stats()``):
        the collection's groups of tables, each one store."""
        return list(self.ebc.groups)

    def tables(self) -> list:
        return [g.host for g in self.ebc.groups]

    def weight(self) -> Tensor:
        return self.ebc.table_weight("u")

    def rows_per_step(self, a) -> float:
        """Rows that crossed the host link per step so far (loads, evictions, write-backs)."""
        stats = self.ebc.cache_stats()["total"]
        return stats["host_bytes"] / self.ebc.groups[0].row_bytes / max(1, self.steps_done)

    def describe(self) -> str:
        steps = "each step one CUDA graph replay" if self.graphed else ""
        if self.prefetching:
            steps += (", " if steps else "") + "the next batch's rows prefetched"
        if not any(g.store.cached_bytes() for g in self.ebc.groups):
            return steps  # no cache (the CPU): nothing more to say
        stats = self.ebc.cache_stats()
        parts = [steps] if steps else []
        parts += [f"{name}: hit rate {stats['tables'][name]['hit_rate']:.3f}"
                  for name in ("u", "v")]
        parts.append(f"one cache of {stats['total']['cache_bytes'] / 2**20:,.0f} MiB")
        return "; ".join(parts)


class ModuleTraining:
    """The tables and their optimizer state in host memory behind ``speedtorch_ops.HostEmbedding``
    modules (pinned on a GPU), with GPU row caches sharing ``--cache-mb`` in proportion to the
    ids each table sees per step: a step moves only the rows the caches miss (and the rows they
    evict). On a GPU (``--graph auto`` or ``on``) the whole step is captured once in a CUDA
    graph (``speedtorch_ops.CapturedStep``) and replayed: the host checks the ids and launches
    one graph per step."""

    def __init__(self, a, device):
        cls, kwargs = OPTIMIZERS[a.optimizer](a.lr, a.fused or None)
        cache = a.cache_mb if device.type == "cuda" else 0
        bound = 0.5 / a.dim
        self.negatives = a.negatives
        self.vocab = a.vocab
        self.graphed, self.prefetching = _graph_settings(a, cls, kwargs, device)
        dtype = DTYPES[getattr(a, "dtype", "float32")]
        self.u, self.v = (so.HostEmbedding(a.vocab, a.dim, optimizer=cls, optimizer_kwargs=kwargs,
                                           device=device, cache_bytes=share, dtype=dtype,
                                           stochastic_rounding=getattr(a, "rounding", None)
                                           != "nearest",
                                           bounds_check="prechecked" if self.graphed else "raise")
                          for share in self.cache_split(cache))
        self._captured = None
        self.steps_done = 0
        self.u.reset_parameters(lambda w: so.fill_random_(w, "uniform", -bound, bound))
        self.v.reset_parameters(lambda w: so.fill_random_(w, "normal", 0.0, bound))

    def cache_split(self, cache_mb: float) -> tuple:
        """(u's, v's) cache bytes: the budget split by ids per step (v sees a context and the
        negatives per centre word)."""
        v_share = (1 + self.negatives) / (2 + self.negatives)
        total = int(cache_mb * 2**20)
        return int(total * (1 - v_share)), int(total * v_share)

    def set_cache_mb(self, cache_mb: float) -> None:
        """Both caches resized to share `cache_mb` (see HostEmbedding.set_cache_bytes)."""
        self._captured = None  # the graph used the old caches
        for emb, share in zip((self.u, self.v), self.cache_split(cache_mb)):
            emb.set_cache_bytes(share)

    def _train(self, labels, ctx, negs, following=None) -> Tensor:
        # With caches each table prefetches right after its own forward, v (whose loads are
        # the larger) first: v's load then waits for v's planning only, not for u's too.
        # Without caches both forwards go first: each prefetch then moves every row of the next
        # batch, and started before u's forward it slowed the step. See docs/decisions.md,
        # "The demo's prefetch" (its order).
        ahead = following is not None
        if ahead and self.v.store.cached_bytes() > 0:
            vc, vn = self.v(ctx, negs)
            self.v.prefetch(following[1], following[2])
            u = self.u(labels)
            self.u.prefetch(following[0])
        else:
            u = self.u(labels)
            vc, vn = self.v(ctx, negs)
            if ahead:  # loads while this step's backward and updates run
                self.u.prefetch(following[0])
                self.v.prefetch(following[1], following[2])
        loss = skipgram_loss(u.float(), vc.float(), vn.float())  # 16-bit rows: float32 math
        loss.backward()
        self.u.step()
        self.v.step()
        return loss.detach()

    def _train_ahead(self, labels, ctx, negs, *following) -> Tensor:
        return self._train(labels, ctx, negs, following=following)

    def step(self, batch, following=None) -> Tensor:
        """One step on `batch`; with prefetching on, the rows of `following` (the next batch;
        None: there is none, and a captured step prefetches `batch` again, which loads
        nothing) load during it."""
        self.steps_done += 1
        if not self.graphed:
            following = ([torch.from_numpy(x) for x in following]
                         if self.prefetching and following is not None else None)
            return self._train(*(torch.from_numpy(x) for x in batch), following=following)
        if self._captured is None:
            fn = self._train_ahead if self.prefetching else self._train
            self._captured = so.CapturedStep(fn, rows=(self.vocab,) * (6 if self.prefetching
                                                                       else 3),
                                             device=self.u.device)
        inputs = (*batch, *(following if following is not None else batch)) \
            if self.prefetching else batch
        return self._captured(*inputs).clone()  # the graph's output is overwritten next step

    @property
    def embeddings(self) -> list:
        """The modules whose stores hold the rows (each with ``store`` and ``cache_stats()``)."""
        return [self.u, self.v]

    def tables(self) -> list:
        return [self.u.host, self.v.host]

    def weight(self) -> Tensor:
        return self.u.weight

    def rows_per_step(self, a) -> float:
        """Rows that crossed the host link per step so far (loads, evictions, write-backs)."""
        moved = 0
        for emb in (self.u, self.v):
            s = emb.cache_stats()
            moved += (s["host_bytes"] / emb.host[0].nbytes) / max(1, self.steps_done)
        return moved

    def describe(self) -> str:
        steps = "each step one CUDA graph replay" if self.graphed else ""
        if self.prefetching:
            steps += (", " if steps else "") + "the next batch's rows prefetched"
        if not any(emb.store.cached_bytes() for emb in (self.u, self.v)):
            return steps  # no cache (the CPU): nothing more to say
        parts = [steps] if steps else []
        for name, emb in (("u", self.u), ("v", self.v)):
            s = emb.cache_stats()
            parts.append(f"{name}: hit rate {s['hit_rate']:.3f}, cache "
                         f"{s['cache_bytes'] / 2**20:,.0f} MiB")
        return "; ".join(parts)


# --engine: the training loops by name (the benches time the first two too).
ENGINES = {"collection": CollectionTraining, "module": ModuleTraining,
           "factories": SwitcherTraining}


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


def train_engine(a, corpus, device):
    """Train with the engine of --engine (a HostEmbeddingCollection of both tables, a
    HostEmbedding a table, or the factories); timed."""
    run = ENGINES[a.engine](a, device)
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
    return dict(seconds=seconds, losses=[float(x) for x in losses],
                rows_per_step=run.rows_per_step(a), describe=run.describe(),
                peak_rss=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                host_table_bytes=sum(t.nbytes for t in run.tables()), table=run.weight())


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
