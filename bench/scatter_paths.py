"""Scatter paths A/B: the GPU-resident scatter against index_copy_, the seed scatter and gather
(1 M x 128 pinned, 131,072 rows: one call, a loop of 20, host time per call), and scatters into
8-24 GiB pinned tables (512 B, 128 B and 64 B rows) by a CUDA index, a CPU index (tuned
split), a CPU index with the CPU side alone, and the PyTorch recipe (copy down +
index_copy_), each checked against last-wins on the last 2,000 positions. Prints and writes
<out>/probe2-<tag>.json (out dir: bench/out, ignored by git). Needs a GPU and 24 GiB of
pinnable memory.

    python3 bench/scatter_paths.py <tag> [bench dir of the tree under test] [out dir]
"""
import json
import os
import sys

import torch
sys.path.insert(0, sys.argv[2] if len(sys.argv) > 2 else "bench")
import speedtorch_ops  # noqa: E402
from _timing import timed, host_while_busy  # noqa: E402
tag = sys.argv[1]
dev = torch.device("cuda")
g = torch.Generator().manual_seed(0)
GIB = 1 << 30
ops = speedtorch_ops
out = []
def loop_ms(fn, calls=20):
    for _ in range(3): fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(calls): fn()
    e.record(); e.synchronize()
    return s.elapsed_time(e) / calls
def rec(name, **kw):
    kw = {k: round(v, 4) if isinstance(v, float) else v for k, v in kw.items()}
    print(tag, name, kw, flush=True); out.append({"tree": tag, "case": name, **kw})
# resident scatter
for rb in (512, 64):
    rows = GIB // rb; dim = rb // 4; n = 131072
    table = torch.empty(rows, dim, device=dev)
    idx = torch.randint(0, rows, (n,), generator=g).to(dev)
    var = torch.randn(n, dim, device=dev)
    for k, fn in {"ours_scatter": lambda: ops.pinned_scatter(table, idx, var),
                  "index_copy_": lambda: table.index_copy_(0, idx, var)}.items():
        rec(f"resident {rb} B {k}", single=timed(fn, 30), loop=loop_ms(fn), host_us=host_while_busy(fn, 20) * 1e6)
    table = None
torch.cuda.empty_cache()
# seed pinned scatter/gather, 1 M x 128
table = ops.empty_pinned((1 << 20, 128), torch.float32)
idx = torch.randint(0, 1 << 20, (131072,), generator=g).to(dev)
var = torch.randn(131072, 128, device=dev)
for k, fn in {"scatter": lambda: ops.pinned_scatter(table, idx, var),
              "gather": lambda: ops.pinned_gather_into(table, idx, var)}.items():
    rec(f"seed {k}", single=timed(fn, 30), loop=loop_ms(fn), host_us=host_while_busy(fn, 20) * 1e6)
table = None
# big pinned tables, scatter
buf = ops.empty_pinned((24 * GIB // 4,), torch.float32)
for span, rb, n in ((8, 512, 131072), (16, 512, 131072), (24, 512, 131072), (8, 64, 1 << 20), (16, 64, 1 << 19), (16, 128, 1 << 19), (24, 64, 1 << 19), (24, 128, 1 << 19)):
    rows = span * GIB // rb; dim = rb // 4
    t = buf[: rows * dim].view(rows, dim)
    idx_cpu = torch.randint(0, rows, (n,), generator=g); idx = idx_cpu.to(dev)
    var = torch.randn(n, dim, device=dev)
    staging = torch.empty(n, dim, pin_memory=True)
    def recipe():
        staging.copy_(var); t.index_copy_(0, idx_cpu, staging)
    r = {"cuda_idx": timed(lambda: ops.pinned_scatter(t, idx, var), 15, 12),
         "cpu_idx": timed(lambda: ops.pinned_scatter(t, idx_cpu, var), 15, 12)}
    old = torch.ops.speedtorch_ops._set_hybrid_share(0.0)
    r["cpu_idx_share0"] = timed(lambda: ops.pinned_scatter(t, idx_cpu, var), 15, 3)
    torch.ops.speedtorch_ops._set_hybrid_share(old)
    r["recipe"] = timed(recipe, 15)
    r["memcpy_d2h"] = timed(lambda: staging.copy_(var), 15)
    # correctness: the table equals the last-wins reference for the scattered rows
    ops.pinned_scatter(t, idx, var); torch.cuda.synchronize()
    vc = var.cpu(); last = {}
    for i, x in enumerate(idx_cpu[-2000:].tolist()):
        last[x] = n - 2000 + i
    ok = all(torch.equal(t[x], vc[p]) for x, p in list(last.items())[:500])
    rec(f"scatter {span} GiB {rb} B n {n}", ok=ok, **r)
out_dir = sys.argv[3] if len(sys.argv) > 3 else "bench/out"
os.makedirs(out_dir, exist_ok=True)
json.dump(out, open(f"{out_dir}/probe2-{tag}.json", "w"), indent=1)
