"""Builds speedtorch_ops._C: the CPU kernels always, the CUDA kernels when torch has CUDA and a
CUDA toolkit is found (not when a GPU happens to be visible). SPEEDTORCH_OPS_CPU_ONLY=1 forces a
CPU-only build. Build with `pip install --no-build-isolation -e .` against the installed torch.

The object files stay in build/ext-<python> (SPEEDTORCH_OPS_BUILD_DIR to put them elsewhere)
instead of a temporary directory, so a second build (another `pip install -e .`, or
`setup.py build_ext --inplace`) recompiles with ninja only the sources whose own text, headers or
compile command changed, then links."""

import glob
import os
import sys

import torch
from setuptools import find_packages, setup
from torch.utils import cpp_extension

HERE = os.path.dirname(os.path.abspath(__file__))


def sources(*groups):
    """The paths of csrc/sources.txt in `groups` (CMakeLists.txt reads the same list)."""
    with open(os.path.join(HERE, "csrc", "sources.txt")) as f:
        rows = [line.split() for line in f if line.strip() and not line.startswith("#")]
    unlisted = sorted(
        set(os.path.relpath(p, HERE) for ext in ("cpp", "cu")
            for p in glob.glob(os.path.join(HERE, "csrc", "**", f"*.{ext}"), recursive=True))
        - {path for _, path in rows})
    if unlisted:
        raise SystemExit(f"csrc/sources.txt does not list {unlisted}: add each to its group")
    return [path for group, path in rows if group in groups]


def with_cuda():
    if os.environ.get("SPEEDTORCH_OPS_CPU_ONLY", "0") not in ("", "0"):
        return False
    return torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None


def extension():
    cpp = sources("module", "cpu")
    # -g0: Python's own build flags, which torch's builder passes on, ask for debug info, and
    # for the dispatch templates of the CPU kernels that is most of their compile
    # (docs/decisions.md, "The test command's time"). Drop it here to debug the extension.
    # -fno-math-errno: sqrt need not set errno, so the CPU update's element loops (Adagrad's,
    # Adam's) vectorize; nothing here reads errno.
    cxx = ["-O3", "-std=c++17", "-fopenmp", "-g0", "-fno-math-errno"]
    # Torch passes no-half-operator flags to nvcc; the kernels convert explicitly.
    nvcc = ["-O3", "-std=c++17", "--use_fast_math", "-lineinfo"]
    include = [os.path.join(HERE, "csrc")]  # includes name their folder: "common/checks.h"
    if not with_cuda():
        return cpp_extension.CppExtension(
            "speedtorch_ops._C", cpp, include_dirs=include,
            extra_compile_args={"cxx": cxx}, extra_link_args=["-fopenmp"], py_limited_api=False)
    # Only the architecture we run on (sm_90, Hopper) plus PTX, unless the caller says otherwise.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0+PTX")
    define = ["-DSPEEDTORCH_OPS_WITH_CUDA"]
    return cpp_extension.CUDAExtension(
        "speedtorch_ops._C", cpp + sources("cuda-host", "cuda"),
        include_dirs=include,
        extra_compile_args={"cxx": cxx + define, "nvcc": nvcc + define},
        extra_link_args=["-fopenmp"])


class BuildExt(cpp_extension.BuildExtension.with_options(use_ninja=True)):
    """torch's ninja build, its objects kept between builds (an editable install would otherwise
    compile every source again in a new temporary directory). Ninja's log and the compilers'
    dependency files decide what to recompile: a changed source, header or flag."""

    def finalize_options(self):
        super().finalize_options()
        self.build_temp = os.environ.get("SPEEDTORCH_OPS_BUILD_DIR") or os.path.join(
            HERE, "build", f"ext-{sys.implementation.cache_tag}")


setup(
    packages=find_packages(include=["speedtorch_ops", "speedtorch_ops.*"]),
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExt},
)
