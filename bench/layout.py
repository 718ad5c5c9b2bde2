"""Does a row's weight and its Adam state side by side in one host table (`colocate`: rows of
3 x 512 B) move faster than the same rows in three tables? And do the transfer kernels, capped
to a few SMs (so training kernels can run beside them), move those rows as fast as on all SMs?

At a training step's shape (4 M-row tables, dim 128, 49,152 random rows loaded and 49,152
distinct rows written back), zero-copy with CUDA ids, by CUDA events (medians):
- three pinned tables of 512 B rows, one optimizer_state_swap each way (SpeedTorch's layout);
- one pinned table of 1536 B rows, pinned_gather_into / pinned_scatter;
- the same table moved as the colocated store moves it: ids sorted once beforehand, each row
  split into contiguous weight and state tensors on the device (the private _sorted_transfer);
each under every SM cap of --caps (0: all SMs).

    python3 bench/layout.py [--rows 4000000] [--batch 49152] [--caps 0 16 8]
"""

import argparse

import torch

import speedtorch_ops as so
from _timing import timed
from _workloads import generator, pinned_table, random_index, unique_index


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=4_000_000)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=49_152)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--caps", type=int, nargs="+", default=[0, 16, 8])
    a = p.parse_args()
    V, D, n, parts = a.rows, a.dim, a.batch, 3  # weight + Adam's exp_avg, exp_avg_sq
    gen = generator(0)
    separate = [pinned_table((V, D), gen) for _ in range(parts)]
    colocated = pinned_table((V, parts, D), gen)
    flat = colocated.view(V, parts * D)
    load_cpu, wb_cpu = random_index(V, n, gen), unique_index(V, n, gen)
    load, wb = load_cpu.cuda(), wb_cpu.cuda()
    out3 = [torch.empty(n, D, device="cuda") for _ in range(parts)]
    out = torch.empty(n, parts * D, device="cuda")
    split = [torch.empty(n, D, device="cuda") for _ in range(parts)]
    # Write-backs write the tables' own rows: every case leaves the tables as they were.
    rows3 = [t[wb_cpu].cuda() for t in separate]
    rows = flat[wb_cpu].cuda()
    rows_split = [rows.view(n, parts, D)[:, k].contiguous() for k in range(parts)]
    by_load = torch.sort(load, stable=True)  # (sorted rows, the slot of each)
    by_wb = torch.sort(wb)  # distinct rows: each its own owner

    so.optimizer_state_swap(separate, out3, None, load)
    assert all(torch.equal(o.cpu(), t[load_cpu]) for o, t in zip(out3, separate))
    so.pinned_gather_into(flat, load, out)
    assert torch.equal(out.cpu(), flat[load_cpu])
    so.ops._sorted_transfer(colocated, split, *by_load, load=True)
    assert all(torch.equal(s, out.view(n, parts, D)[:, k]) for k, s in enumerate(split))

    cases = [
        ("3 tables x 512 B rows (one swap)",
         lambda: so.optimizer_state_swap(separate, out3, None, load),
         lambda: so.optimizer_state_swap(separate, rows3, wb, None)),
        ("1 table x 1536 B rows",
         lambda: so.pinned_gather_into(flat, load, out),
         lambda: so.pinned_scatter(flat, wb, rows)),
        ("1 table x 1536 B, sorted once, split into parts",
         lambda: so.ops._sorted_transfer(colocated, split, *by_load, load=True),
         lambda: so.ops._sorted_transfer(colocated, rows_split, *by_wb, load=False)),
    ]
    mb = n * parts * D * 4 / 1e6
    print(f"{torch.cuda.get_device_name()}; {V:,} rows; {n:,} rows each way = {mb:.1f} MB "
          "(weight + 2 states); ms load / write-back (GB/s of the load)")
    for cap in a.caps:
        with so.transfer_sm_limit(cap):
            for name, load_fn, wb_fn in cases:
                ms_load, ms_wb = timed(load_fn, a.reps), timed(wb_fn, a.reps)
                print(f"  SMs {cap or 'all':>3}  {name:<48} {ms_load:6.3f} / {ms_wb:6.3f} "
                      f"({mb / ms_load:5.1f})", flush=True)


if __name__ == "__main__":
    main()
