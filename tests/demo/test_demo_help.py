"""`python -m speedtorch_ops.demo --help` describes what each device trains through, as the
engine's "auto" choice does."""

import re

from speedtorch_ops.demo.cli import parser


def test_help_says_a_gpu_trains_the_collection_and_the_cpu_the_factories():
    text = " ".join(parser().format_help().split())
    assert re.search(r"On a GPU both tables train as one speedtorch_ops\.HostEmbeddingCollection"
                     r" .*\(--engine collection, the default there", text), text
    assert re.search(r"on the CPU through the SpeedTorch-compatible factories.*"
                     r"\(--engine factories, the default there\)", text), text
    assert "trained through the SpeedTorch-compatible factories" not in text
