"""scripts/test.sh's pytest summary: skips counted by reason, a line each (tests/conftest.py's
pytest_terminal_summary), unless -r asks for each skip."""

import os
import shutil
import subprocess
import sys
import textwrap

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def run_pytest(tmp_path, *flags):
    shutil.copy(os.path.join(HERE, "conftest.py"), tmp_path / "conftest.py")
    (tmp_path / "test_skips.py").write_text(textwrap.dedent("""
        import pytest

        @pytest.mark.parametrize("i", range(3))
        def test_gpu(i):
            pytest.skip("needs a CUDA GPU")

        @pytest.mark.skipif(True, reason="another reason")
        def test_other():
            pass

        def test_passes():
            pass
        """))
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           *flags, str(tmp_path)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_skips_are_counted_by_reason_when_r_leaves_them_out(tmp_path):
    out = run_pytest(tmp_path, "-ra", "-rfExX")  # the project's addopts, then scripts/test.sh's
    assert "skipped, by reason" in out, out
    lines = [line.strip() for line in out.splitlines()]
    assert "3 needs a CUDA GPU" in lines and "1 another reason" in lines, out
    assert "SKIPPED [" not in out, out


def test_r_that_lists_skips_lists_them_as_pytest_does(tmp_path):
    out = run_pytest(tmp_path, "-ra")  # plain pytest in this repository
    assert "SKIPPED [3]" in out and "skipped, by reason" not in out, out
