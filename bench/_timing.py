"""Shared by the benchmarks: CUDA-event timing (median after warm-up) and the CuPy view of a
pinned table (the original SpeedTorch technique), when CuPy is installed."""

import statistics

import torch


def timed(fn, reps, warmup=3):
    """Median milliseconds of fn() over `reps` runs after `warmup`, CUDA events around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def cupy_view(table):
    """(cupy, a CuPy array over the pinned table's memory via UVA), or None without CuPy."""
    try:
        import cupy
    except ImportError:
        return None
    dtype = {torch.float32: cupy.float32, torch.bfloat16: None}.get(table.dtype)
    if dtype is None:
        return None
    mem = cupy.cuda.UnownedMemory(table.data_ptr(), table.nbytes, table)
    return cupy, cupy.ndarray(table.shape, dtype, cupy.cuda.MemoryPointer(mem, 0))
