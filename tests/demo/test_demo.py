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
    ["--engine", "collection"],
    ["--engine", "collection", "--prefetch", "on"],
    ["--engine", "collection", "--optimizer", "rowwise-adagrad"],
    ["--engine", "collection", "--corpus", "uniform"],
    ["--engine", "collection", "--dtype", "bfloat16"],
    ["--engine", "collection", "--optimizer", "partial-rowwise-adam", "--dtype", "bfloat16"],
    ["--engine", "module"],
    ["--engine", "module", "--prefetch", "on", "--dtype", "bfloat16"],
]
GPU_CASES = [
    ["--engine", "collection", "--cache-mb", "1", "--graph", "off"],  # evicts every step, eager
    ["--engine", "collection", "--cache-mb", "1", "--prefetch", "on"],
    ["--engine", "collection", "--cache-mb", "1", "--graph", "on"],
    ["--engine", "factories", "--switching", "colocated"],
    ["--engine", "collection", "--optimizer", "adagrad"],  # no capturable mode: eager steps
    ["--engine", "collection", "--cache-mb", "1", "--dtype", "bfloat16", "--graph", "on"],
    ["--engine", "module", "--cache-mb", "1", "--graph", "on"],
    ["--engine", "module", "--cache-mb", "1", "--prefetch", "on"],
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


def test_the_default_engine_is_the_collection_where_the_factories_cannot_serve(capsys):
    """On the CPU the default is the factories (SpeedTorch's calls), except for what they
    cannot train: 16-bit tables, the row-wise optimizers."""
    out = run(["--dtype", "bfloat16", "--steps", "60"], "cpu", capsys)
    assert "a HostEmbeddingCollection of both tables" in out
