"""CPU only: our HostEmbeddingBagCollection against TorchRec's FusedEmbeddingBagCollection
(FBGEMM's CPU kernels: the forward, the backward and the optimizer fused) on the same batches,
one process, the same intra-op threads. Needs the TorchRec extra (requirements-interop.txt);
without it only ours runs.

The workload: four sum-pooled tables (1 M x 64, 200 k x 64, 50 k x 32, 10 k x 32 fp32), 2,048
samples a step, each bag 1 to 20 ids drawn from a Zipf distribution over the table's rows (a
fixed random permutation spreads the hot ones); a step is the forward, a loss on the pooled
values, its backward and the tables' update. Optimizers: SGD, Adagrad, row-wise Adagrad
(TorchRec's torchrec.optim.RowWiseAdagrad for theirs, speedtorch_ops.RowWiseAdagrad for ours),
and Adam (FBGEMM's CPU kernels have none: TorchRec's plain EmbeddingBagCollection with sparse
gradients and torch's SparseAdam instead). The systems alternate in rounds (each
round --steps steps of one, then of the other) after warm-up; medians over the timed steps.

    python3 bench/cpu_torchrec.py --threads 1 2 [--optimizers sgd adagrad rowwise adam]

Output: a printed table, <out>/cpu_torchrec.json (and .png with matplotlib).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

TABLES = [(1_000_000, 64), (200_000, 64), (50_000, 32), (10_000, 32)]


def batches(a, gen):
    """--batches jagged batches as (values, lengths) of every feature, key-major."""
    perms = [torch.randperm(rows, generator=gen) for rows, _ in TABLES]
    out = []
    for _ in range(a.batches):
        lengths = torch.randint(1, a.bag_len + 1, (len(TABLES) * a.batch,), generator=gen)
        values = []
        for k, (rows, _) in enumerate(TABLES):
            n = int(lengths[k * a.batch:(k + 1) * a.batch].sum())
            # Zipf(s) by inversion of a continuous approximation: rank ~ rows ** u (s = 1)
            u = torch.rand(n, generator=gen, dtype=torch.float64)
            rank = (rows ** u).long().sub_(1).clamp_(0, rows - 1)
            values.append(perms[k][rank])
        out.append((torch.cat(values), lengths))
    return out


def ours(name, lr):
    import speedtorch_ops as so
    opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
           "rowwise": so.RowWiseAdagrad, "adam": torch.optim.Adam}[name]
    tables = [so.TableConfig(f"t{k}", rows, dim, feature_names=[f"f{k}"])
              for k, (rows, dim) in enumerate(TABLES)]
    ebc = so.HostEmbeddingBagCollection(tables, optimizer=opt, optimizer_kwargs={"lr": lr},
                                        device="cpu")
    return ebc, so.KeyedJaggedTensor, ebc.step


def theirs(name, lr):
    """TorchRec's fused collection for the optimizers FBGEMM's CPU kernels have; for Adam its
    plain EmbeddingBagCollection with sparse gradients and torch's SparseAdam."""
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection
    from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
    from torchrec.optim.rowwise_adagrad import RowWiseAdagrad
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor
    tables = [EmbeddingBagConfig(name=f"t{k}", num_embeddings=rows, embedding_dim=dim,
                                 feature_names=[f"f{k}"]) for k, (rows, dim) in enumerate(TABLES)]
    if name == "adam":
        ebc = EmbeddingBagCollection(tables=tables, device=torch.device("cpu"))
        for bag in ebc.embedding_bags.values():
            bag.sparse = True
        opt = torch.optim.SparseAdam(list(ebc.parameters()), lr=lr)

        def step():
            opt.step()
            opt.zero_grad()
        return ebc, KeyedJaggedTensor, step
    opt = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
           "rowwise": RowWiseAdagrad}[name]
    fused = FusedEmbeddingBagCollection(tables=tables, optimizer_type=opt,
                                        optimizer_kwargs={"lr": lr}, device=torch.device("cpu"))
    return fused, KeyedJaggedTensor, (lambda: None)  # the backward updates the tables


def child(a) -> dict:
    """One thread count: every optimizer, both systems, in this process."""
    torch.set_num_threads(a.threads[0])
    gen = torch.Generator().manual_seed(a.seed)
    data = batches(a, gen)
    keys = [f"f{k}" for k in range(len(TABLES))]
    width = sum(dim for _, dim in TABLES)
    target = torch.randn(a.batch, width, generator=gen)
    out = {}
    for name in a.optimizers:
        systems = {"ours": ours(name, a.lr)}
        try:
            made = theirs(name, a.lr)
        except ImportError:
            made = None
        if made is not None:
            systems["torchrec_sparse_adam" if name == "adam" else "torchrec_fused"] = made
        kjts = {s: [kjt_cls.from_lengths_sync(keys, v, l) for v, l in data]
                for s, (_, kjt_cls, _) in systems.items()}
        times = {s: [] for s in systems}

        def run(s, i):
            module, _, step = systems[s]
            kt = module(kjts[s][i % len(data)])
            ((kt.values() - target) ** 2).sum().backward()
            step()

        for s in systems:
            for i in range(a.warmup):
                run(s, i)
        for r in range(a.rounds):
            for s in systems:
                for i in range(a.steps):
                    t = time.perf_counter()
                    run(s, a.warmup + r * a.steps + i)
                    times[s].append(1e3 * (time.perf_counter() - t))
        out[name] = {s: statistics.median(v) for s, v in times.items()}
        print(f"threads {a.threads[0]} {name}: " + ", ".join(
            f"{s} {ms:.2f} ms" for s, ms in out[name].items()), file=sys.stderr, flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--optimizers", nargs="+", default=["sgd", "adagrad", "rowwise", "adam"],
                   choices=["sgd", "adagrad", "rowwise", "adam"])
    p.add_argument("--batch", type=int, default=2048)
    p.add_argument("--bag-len", type=int, default=20)
    p.add_argument("--batches", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--steps", type=int, default=10, help="timed steps a round, each system")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench/out")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a)))
        return
    results = {}
    for threads in a.threads:  # torch sizes its thread pools once: a process each
        args = [sys.executable, os.path.abspath(__file__), "--child", "--threads", str(threads),
                "--optimizers", *a.optimizers] + [
            f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items()
            if k not in ("threads", "optimizers", "child", "out")]
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        done = subprocess.run(args, env=env, check=True, stdout=subprocess.PIPE, text=True)
        results[threads] = json.loads(done.stdout.strip().splitlines()[-1])
    print(f"{'threads':>7} {'optimizer':>9} {'ours ms':>8} {'TorchRec ms':>11} {'x':>6}  "
          "(TorchRec: its fused collection; for Adam its collection + SparseAdam)")
    for threads, per in results.items():
        for name, r in per.items():
            theirs_ms = r.get("torchrec_fused", r.get("torchrec_sparse_adam"))
            x = f"{theirs_ms / r['ours']:.2f}" if theirs_ms else "-"
            print(f"{threads:>7} {name:>9} {r['ours']:>8.2f} "
                  f"{theirs_ms if theirs_ms else float('nan'):>11.2f} {x:>6}")
    record = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(a),
              "cpus": os.cpu_count(), "tables": TABLES, "ms": results}
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cpu_torchrec.json"), "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()
