"""The fused update's rule numbers and flag bits are defined once for the C++ side
(csrc/optim/rules.h: the Rule and Flag enums, which the op's checks and kernels use by name);
speedtorch_ops/training/fused.py must pass the same numbers."""

import pathlib
import re

from speedtorch_ops.training import fused

RULES_H = pathlib.Path(__file__).resolve().parents[2] / "csrc" / "optim" / "rules.h"


def _enum(text: str, name: str) -> dict:
    """{kName: value} of the C++ enum `name`."""
    body = re.search(r"enum (?:class )?%s\b[^{]*\{(.*?)\};" % name, text, re.S).group(1)
    return {k: int(v) for k, v in re.findall(r"\b(k\w+) = (\d+)", body)}


def test_python_passes_the_cpp_rule_numbers_and_flag_bits():
    text = RULES_H.read_text()
    python = {n.replace("_", ""): n for n in dir(fused) if n.isupper()}  # ROWWISEADAGRAD: ...
    for enum in ("Rule", "Flag"):
        values = _enum(text, enum)
        assert values, enum
        for cpp, value in values.items():
            name = python.get(cpp[1:].upper())
            assert name is not None, (enum, cpp, "has no constant in fused.py")
            assert getattr(fused, name) == value, (enum, cpp, name, getattr(fused, name))
