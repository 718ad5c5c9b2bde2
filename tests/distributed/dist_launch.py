"""Runs a function on `world` processes of one torch.distributed group (torch.multiprocessing,
forkserver): gloo on the CPU, or NCCL with one GPU per rank. A rank that raises fails the test with
its traceback (the others are terminated); a run past `timeout` seconds (a hang) fails it too."""

import datetime
import faulthandler
import os
import sys
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BACKENDS = ["gloo", "nccl"]
# Ranks fork from a server that imported torch once (a fresh interpreter per rank spends
# seconds importing it) and never ran OpenMP or CUDA (which a fork would inherit broken). Dynamo
# too: the modules import it at their class's first instance (to keep their eager methods out
# of a compiled graph), which took every rank of every run seconds.
mp.set_forkserver_preload(["torch", "torch._dynamo", "speedtorch_ops.distributed",
                          "sharded_workers", "collection_workers"])


def skip_unless_backend(backend: str, world: int = 2) -> None:
    if backend == "nccl" and (not torch.cuda.is_available()
                              or torch.cuda.device_count() < world):
        pytest.skip(f"NCCL needs {world} GPUs (run on the 2-GPU machine)")


def _entry(rank, world, backend, store, fn, args, timeout):
    torch.set_num_threads(1)  # several ranks share the machine's cores
    # A rank still running shortly before the test gives up prints where it waits: a hang's
    # traceback, in the test's captured output.
    faulthandler.dump_traceback_later(max(1.0, timeout - 10.0), exit=False)
    if backend == "nccl":
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # no NVLink multicast on the test hosts
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
        extra = {"device_id": device}
    else:
        device, extra = torch.device("cpu"), {}
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60), **extra)
    try:
        fn(rank, world, device, *args)
    except BaseException:
        # Out at once, its traceback first: a teardown could wait for peers stuck in a
        # collective this rank will never join, and hide the error behind a hang.
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    dist.destroy_process_group()


def run_ranks(fn, world: int, *args, backend: str = "gloo", timeout: float = 120.0) -> None:
    """fn(rank, world, device, *args) on each of `world` spawned ranks."""
    skip_unless_backend(backend, world)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        ctx = mp.start_processes(_entry, args=(world, backend, store, fn, args, timeout),
                                 nprocs=world, join=False, start_method="forkserver")
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=1.0):  # raises as soon as a rank raises
            if time.monotonic() > deadline:
                for p in ctx.processes:
                    if p.is_alive():
                        p.kill()
                for p in ctx.processes:
                    p.join()
                pytest.fail(f"{fn.__name__} on {world} {backend} ranks did not finish in "
                            f"{timeout:.0f} s (a hang)")


def run_checkpoint_schedule(fn, seed, schedule, tmp_path, backend: str) -> tuple:
    """fn(rank, world, device, seed, schedule, load_from, save_to, steps) in three runs: steps
    0-1 at schedule[0] ranks saved to `first`; loaded at schedule[2] ranks for steps 2-3, saved
    to `second`; loaded at schedule[4] ranks for step 4. Returns (first, second)."""
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    run_ranks(fn, schedule[0], seed, schedule, None, first, range(0, 2), backend=backend)
    run_ranks(fn, schedule[2], seed, schedule, first, second, range(2, 4), backend=backend)
    run_ranks(fn, schedule[4], seed, schedule, second, None, range(4, 5), backend=backend)
    return first, second
