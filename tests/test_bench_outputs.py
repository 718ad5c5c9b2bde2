"""The bench scripts write, by default, into bench/out (ignored by git), never into the tracked
bench/results: a run leaves no untracked file; an explicit --out still writes where it says."""

import ast
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
SCRIPTS = sorted(f for f in os.listdir(BENCH) if f.endswith(".py"))


def _string_defaults(path):
    """Every string constant that an argparse ``default=`` or ``os.environ.get`` fallback or a
    ``sys.argv`` fallback (``x if len(sys.argv) > n else "..."``) gives in `path`."""
    tree = ast.parse(open(path).read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg == "default" and isinstance(kw.value, ast.Constant) and \
                        isinstance(kw.value.value, str):
                    yield node.lineno, kw.value.value
            if isinstance(node.func, ast.Attribute) and node.func.attr == "get" and \
                    len(node.args) == 2 and isinstance(node.args[1], ast.Constant):
                yield node.lineno, node.args[1].value
        elif isinstance(node, ast.IfExp) and isinstance(node.orelse, ast.Constant) and \
                "argv" in ast.unparse(node.test):
            yield node.lineno, node.orelse.value


@pytest.mark.parametrize("script", SCRIPTS)
def test_default_outputs_go_to_the_ignored_folder(script):
    paths = [(line, value) for line, value in _string_defaults(os.path.join(BENCH, script))
             if isinstance(value, str) and ("bench/" in value or value in (".", "./"))]
    wrong = [(line, value) for line, value in paths if not value.startswith("bench/out")]
    assert not wrong, f"bench/{script}: default output paths outside bench/out: {wrong}"


def test_the_default_output_folder_is_ignored_and_results_is_tracked():
    ignored = subprocess.run(["git", "check-ignore", "-q", "bench/out/x.json"], cwd=ROOT)
    if ignored.returncode == 128:
        pytest.skip("not a git checkout")
    assert ignored.returncode == 0
    assert subprocess.run(["git", "check-ignore", "-q", "bench/results/x.json"],
                          cwd=ROOT).returncode == 1
