"""What the compiler made of the CPU kernels, where no result can show it: a read-ahead that the
compiler drops leaves every row correct and only the speed changes (g++ 12 and 13 deleted
__builtin_prefetch behind a lambda, unseen until the build was disassembled)."""

import platform
import re
import shutil
import subprocess

import pytest

import speedtorch_ops._C as ext


def functions_of(disassembly, name):
    """{symbol: body} of the functions whose mangled symbol contains `name` (their OpenMP
    outlined parts included)."""
    bodies, current = {}, None
    for line in disassembly.splitlines():
        head = re.match(r"^[0-9a-f]+ <(.+)>:$", line)
        if head:
            current = head.group(1) if name in head.group(1) else None
            if current:
                bodies[current] = []
        elif current and line.strip():
            bodies[current].append(line)
    return {k: "\n".join(v) for k, v in bodies.items()}


@pytest.mark.skipif(platform.machine() != "x86_64" or shutil.which("objdump") is None,
                    reason="reads x86-64 instructions with objdump")
def test_the_cpu_gather_reads_rows_ahead():
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", ext.__file__],
                         capture_output=True, text=True, check=True).stdout
    gathers = functions_of(out, "gather_rows_cpu")
    assert gathers, "no gather_rows_cpu in the build"
    with_prefetch = [k for k, body in gathers.items() if "prefetcht0" in body]
    # The streaming loop and the copying loop, for int32 and int64 indices, each ask ahead.
    assert len(with_prefetch) >= 4, (
        f"{len(with_prefetch)} of {len(gathers)} gather functions prefetch: {sorted(gathers)}")
