"""The rules of csrc/README.md that no build checks: every include names its folder from csrc/,
common/ includes no feature, and the torch-free namespaces stay free of torch (transitively).
That no folder includes one that includes it back is scripts/check_house.py's to count."""

import pathlib
import re

import pytest

CSRC = pathlib.Path(__file__).resolve().parents[1] / "csrc"
SOURCES = sorted(p for p in CSRC.rglob("*") if p.suffix in (".h", ".cpp", ".cu", ".cuh"))
QUOTED = re.compile(r'^#include "([^"]+)"', re.M)
SYSTEM = re.compile(r"^#include <([^>]+)>", re.M)
TORCH = ("ATen/", "torch/", "c10/")


def _rel(path: pathlib.Path) -> str:
    return path.relative_to(CSRC).as_posix()


def _quoted(path: pathlib.Path) -> list:
    return QUOTED.findall(path.read_text())


def _system_closure(rel: str, seen=None) -> set:
    """The <...> headers `rel` includes, itself or through its quoted includes."""
    seen = set() if seen is None else seen
    if rel in seen:
        return set()
    seen.add(rel)
    text = (CSRC / rel).read_text()
    found = set(SYSTEM.findall(text))
    for inc in QUOTED.findall(text):
        found |= _system_closure(inc, seen)
    return found


def test_every_include_names_an_existing_file_from_csrc():
    for path in SOURCES:
        for inc in _quoted(path):
            assert (CSRC / inc).is_file() and ".." not in inc, (_rel(path), inc)


def test_common_includes_no_feature():
    for path in SOURCES:
        if _rel(path).startswith("common/"):
            assert all(inc.startswith("common/") for inc in _quoted(path)), _rel(path)


def _in_namespace(path: pathlib.Path, name: str) -> bool:
    return re.search(r"^namespace speedtorch_ops::%s \{" % name, path.read_text(), re.M) is not None


@pytest.mark.parametrize("namespace,banned", [
    ("kernels", TORCH), ("route", TORCH + ("cuda",)), ("hybrid", TORCH + ("cuda",)),
    ("optim", TORCH)])
def test_torch_free_namespaces_include_no_torch(namespace, banned):
    files = [p for p in SOURCES if _in_namespace(p, namespace)]
    assert files, namespace
    for path in files:
        if path.name == "rounding_aten.h":  # named for the one exception
            continue
        bad = sorted(h for h in _system_closure(_rel(path)) if h.startswith(banned))
        assert not bad, (_rel(path), bad)
