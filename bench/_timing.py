"""Shared by the benchmarks: how they time. Medians after warm-up, with CUDA events for work
that runs on the GPU alone and with a wall clock for work with a host part."""

import statistics
import time

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


def loop_ms(fn, calls=20, warmup=3):
    """Milliseconds per call of `calls` calls of fn() queued back to back after `warmup`, CUDA
    events around the loop: the GPU's rate, a call's host time counting only where it is the
    longer."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / calls


def wall(fn, reps, warmup=3):
    """Median wall-clock milliseconds of fn() over `reps` runs after `warmup`, for work with a
    host part (CPU kernels, calls that wait): the GPU is synchronized around each run when
    there is one."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    times = []
    for _ in range(warmup + reps):
        sync()
        start = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[warmup:])


def host_while_busy(fn, calls=1, sleep_cycles=200_000_000):
    """Host seconds per call of fn() over `calls` calls queued while the GPU sleeps (about 0.1
    s at the default), so nothing they queue can make the host wait: what a call costs the
    host alone."""
    torch.cuda.synchronize()
    torch.cuda._sleep(sleep_cycles)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = (time.perf_counter() - start) / calls
    torch.cuda.synchronize()
    return seconds
