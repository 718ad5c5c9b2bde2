"""Probe: reading a peer GPU's rows in place (torch symmetric memory over NVLink) against NCCL's
all_to_all_single moving the same rows, and whether a symmetric-memory barrier can sit in a
CUDA graph. Needs 2+ GPUs of one host:

    python3 bench/probe_peer_rows.py [--rows 65536] [--dim 128]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _timing import timed


def worker(rank: int, world: int, args, queue) -> None:
    import torch.distributed._symmetric_memory as symm_mem
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))
    n, dim = args.rows, args.dim
    out = {}
    buf = symm_mem.empty(n, dim, dtype=torch.float32, device=f"cuda:{rank}")
    hdl = symm_mem.rendezvous(buf, dist.group.WORLD)
    buf.fill_(rank + 1)
    hdl.barrier(channel=0)
    peer = (rank + 1) % world
    remote = hdl.get_buffer(peer, (n, dim), torch.float32)
    out["remote_first"] = float(remote[0, 0])
    out["ptrs"] = len(hdl.buffer_ptrs)
    idx = torch.randint(0, n, (n,), device="cuda")
    dst = torch.empty(n, dim, device="cuda")
    nbytes = n * dim * 4
    out["gather_local_ms"] = timed(lambda: torch.index_select(buf, 0, idx, out=dst), 50, 10)
    out["gather_peer_ms"] = timed(lambda: torch.index_select(remote, 0, idx, out=dst), 50, 10)
    out["copy_peer_ms"] = timed(lambda: dst.copy_(remote), 50, 10)
    out["gather_peer_GBps"] = nbytes / out["gather_peer_ms"] / 1e6
    # NCCL moving the same rows to the peer (half of a bucketed exchange's 2n rows each way).
    send = torch.randn(world * n, dim, device="cuda")
    recv = torch.empty_like(send)
    out["nccl_a2a_ms"] = timed(lambda: dist.all_to_all_single(recv, send), 50, 10)
    out["nccl_a2a_GBps_to_peers"] = (world - 1) * nbytes / out["nccl_a2a_ms"] / 1e6

    def step():
        buf.add_(1)
        hdl.barrier(channel=0)
        torch.index_select(remote, 0, idx, out=dst)
        hdl.barrier(channel=1)
    out["step_eager_ms"] = timed(step, 50, 10)
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        dist.barrier()
        before = float(buf[0, 0])
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        dist.barrier()
        expect = before + 5  # each rank added 5 (the peers run in step)
        out["captured_ok"] = bool(float(buf[0, 0]) == expect
                                  and bool((dst == float(remote[0, 0])).all()))
        out["step_graph_ms"] = timed(graph.replay, 50, 10)
    except Exception as e:  # the probe's question: can it be captured at all
        out["captured_error"] = repr(e)[:300]
    out["nvshmem"] = bool(symm_mem.is_nvshmem_available())
    queue.put((rank, out))
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=65536)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--port", type=int, default=29541)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    world = torch.cuda.device_count()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, world, args, queue)) for r in range(world)]
    for pr in procs:
        pr.start()
    results = dict(queue.get(timeout=300) for _ in procs)
    for pr in procs:
        pr.join()
    text = json.dumps({"world": world, "rows": args.rows, "dim": args.dim, "ranks": results},
                      indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    sys.exit(0 if all(pr.exitcode == 0 for pr in procs) else 1)


if __name__ == "__main__":
    main()
