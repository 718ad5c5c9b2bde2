"""Where an op call's host time goes: host µs per call of the seed table's pinned and CUDA-table
ops, and of CUDA-resident calls of 64 B rows (1 GiB table, 131,072 rows) beside index_select /
index_copy_, with the GPU kept busy (nothing waits); then torch.profiler's CPU side (CUDA
runtime calls included) of 20 calls. Prints; run from the repository root:
python3 bench/op_host.py
"""
import argparse
import sys

import torch

sys.path.insert(0, "bench")
import speedtorch_ops  # noqa: E402
from _timing import host_while_busy  # noqa: E402
from _workloads import add_seed_shape, seed_workload  # noqa: E402

p = argparse.ArgumentParser()
add_seed_shape(p)
a = p.parse_args([])
dev = torch.device("cuda")
pinned, on_gpu, idx_cpu = seed_workload(a)
idx = idx_cpu.to(dev)
var = torch.randn(a.batch, a.dim, device=dev)
ops = speedtorch_ops
narrow = torch.randn((1 << 30) // 64, 16, device=dev)
n_idx = torch.randint(0, narrow.size(0), (a.batch,), device=dev)
n_var = torch.randn(a.batch, 16, device=dev)
calls = {
    "pinned scatter deferred":
        lambda: ops.pinned_scatter(pinned, idx, var, bounds_check="deferred"),
    "pinned scatter prechecked":
        lambda: ops.pinned_scatter(pinned, idx, var, bounds_check="prechecked"),
    "pinned gather deferred":
        lambda: ops.pinned_gather_into(pinned, idx, var, bounds_check="deferred"),
    "cuda scatter deferred":
        lambda: ops.pinned_scatter(on_gpu, idx, var, bounds_check="deferred"),
    "is_zero_copy_usable": lambda: ops.is_zero_copy_usable(pinned),
    "64 B cuda scatter deferred": lambda: ops.pinned_scatter(narrow, n_idx, n_var),
    "64 B cuda scatter prechecked":
        lambda: ops.pinned_scatter(narrow, n_idx, n_var, bounds_check="prechecked"),
    "64 B cuda gather deferred": lambda: ops.pinned_gather_into(narrow, n_idx, n_var),
    "64 B index_copy_": lambda: narrow.index_copy_(0, n_idx, n_var),
    "64 B index_select": lambda: torch.index_select(narrow, 0, n_idx, out=n_var),
    "torch.empty (CUDA, 1 KiB)": lambda: torch.empty(256, device=dev),
    "stream capture query": torch.cuda.is_current_stream_capturing,
}
for name, fn in calls.items():
    for _ in range(3):
        fn()
    hs = sorted(host_while_busy(fn, calls=20) * 1e6 for _ in range(5))
    print(f"{name}: host {hs[2]:.1f} us a call (GPU busy; median of 5 runs, {hs[0]:.1f}-"
          f"{hs[-1]:.1f})", flush=True)
activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
for name in ("pinned scatter deferred", "cuda scatter deferred", "64 B cuda scatter deferred",
             "64 B cuda gather deferred", "64 B index_copy_"):
    fn = calls[name]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    print(f"\n== {name}")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18,
                                    max_name_column_width=60))
