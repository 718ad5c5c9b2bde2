"""The main job end to end, small: the demo trains skip-gram with each engine and option and
learns the planted clusters (its own check: the loss falls and the neighbours' precision beats
5x chance, else it exits with an error), on the CPU here; on a GPU machine also with the row
cache, a CUDA-graph step and prefetch."""

import pytest
import torch

from speedtorch_ops.demo.cli import main
from conftest import HAS_CUDA

SMALL = ["--vocab", "2000", "--dim", "16", "--batch", "256", "--steps", "300",
         "--tokens", "200000", "--lr", "0.05"]
CASES = [
    ["--engine", "factories", "--switching", "plain"],
    ["--engine", "factories", "--switching", "prefetch"],
    ["--engine", "module"],
    ["--engine", "module", "--prefetch", "on"],
    ["--engine", "module", "--optimizer", "rowwise-adagrad"],
    ["--engine", "module", "--corpus", "uniform"],
    ["--engine", "module", "--dtype", "bfloat16"],
    ["--engine", "module", "--optimizer", "partial-rowwise-adam", "--dtype", "bfloat16"],
]
GPU_CASES = [
    ["--engine", "module", "--cache-mb", "1", "--graph", "off"],  # evicts every step, eager
    ["--engine", "module", "--cache-mb", "1", "--prefetch", "on"],
    ["--engine", "module", "--cache-mb", "1", "--graph", "on"],
    ["--engine", "factories", "--switching", "colocated"],
    ["--engine", "module", "--optimizer", "adagrad"],  # no capturable mode: eager steps
    ["--engine", "module", "--cache-mb", "1", "--dtype", "bfloat16", "--graph", "on"],
]


def run(args, device, capsys):
    main(SMALL + ["--device", device] + args)
    out = capsys.readouterr().out
    first, last = (float(x) for x in out.split("loss ")[1].split()[0:3:2])
    assert last < first, out
    return out


@pytest.mark.parametrize("args", CASES, ids=" ".join)
def test_demo_learns_on_the_cpu(args, capsys):
    out = run(args, "cpu", capsys)
    assert "quality: nearest-neighbour precision@5" in out


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run scripts/gpu_check.sh there)")
@pytest.mark.parametrize("args", CASES + GPU_CASES, ids=" ".join)
def test_demo_learns_on_the_gpu(args, capsys):
    out = run(args, "cuda", capsys)
    if "--cache-mb" in args:
        assert "hit rate" in out
