"""Usage mistakes of speedtorch_ops.io answered by a sentence naming the argument and the fix:
NumPy's argument order given to the savers, and pinning asked for where it cannot happen."""

import os
import warnings

import numpy as np
import pytest
import torch

import speedtorch_ops as so
from speedtorch_ops import io

from conftest import HAS_CUDA


@pytest.mark.parametrize("as_path", [str, os.fspath, lambda p: p], ids=["str", "fspath", "Path"])
def test_save_npy_in_numpys_argument_order_says_the_order(tmp_path, gen, as_path):
    table = torch.randn(5, 3, generator=gen)
    path = tmp_path / "t.npy"
    with pytest.raises(TypeError, match=r"save_npy\(table, path\).*np.save takes the path first"):
        io.save_npy(as_path(path), table)
    assert os.listdir(tmp_path) == []  # nothing written, not even a temporary file
    io.save_npy(table, as_path(path))  # the right order still works
    assert np.array_equal(np.load(path), table.numpy())


def test_save_npy_of_a_numpy_array_names_the_argument(tmp_path):
    with pytest.raises(TypeError, match="save_npy: table must be a tensor.*ndarray"):
        io.save_npy(np.zeros(3), tmp_path / "a.npy")
    assert os.listdir(tmp_path) == []


def test_save_safetensors_with_the_path_first_says_the_order(tmp_path, gen):
    tensors = {"a": torch.randn(4, generator=gen)}
    with pytest.raises(TypeError, match=r"save_safetensors\(tensors, path\)"):
        io.save_safetensors(tmp_path / "t.st", tensors)
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(HAS_CUDA, reason="the fallback is for machines without a CUDA device")
@pytest.mark.parametrize("fmt", ["npy", "safetensors"])
def test_load_with_the_default_pin_on_a_machine_without_a_gpu_loads_and_warns(tmp_path, gen, fmt):
    table = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    path = tmp_path / f"t.{fmt}"
    if fmt == "npy":
        io.save_npy(table, path)
        load = lambda **kw: io.load_npy(path, **kw)  # noqa: E731
    else:
        io.save_safetensors({"t": table}, path)
        load = lambda **kw: io.load_safetensors(path, **kw)["t"]  # noqa: E731
    with pytest.warns(UserWarning, match=f"load_{fmt}: no CUDA device.*pin=False"):
        loaded = load()
    assert torch.equal(loaded, table) and not loaded.is_pinned()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # pin=False: no warning
        assert torch.equal(load(pin=False), table)


# Whether this extension was built with its CUDA kernels (CI builds them on a machine without
# a GPU): such a build pins through the CUDA runtime, which fails otherwise here.
BUILT_WITH_CUDA = torch._C._dispatch_has_kernel_for_dispatch_key("speedtorch_ops::pinned_gather",
                                                                 "CUDA")


@pytest.mark.skipif(HAS_CUDA or BUILT_WITH_CUDA,
                    reason="needs a build that cannot pin (built without CUDA)")
def test_load_npy_with_a_gpu_but_a_build_without_cuda_raises_naming_pin_false(tmp_path,
                                                                             monkeypatch):
    # This machine's build has no CUDA; a GPU is made to appear, so the real pinning op refuses.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "init", lambda: None)
    io.save_npy(torch.arange(6.0), tmp_path / "t.npy")
    with pytest.raises(RuntimeError, match="load_npy: pin=True.*built without CUDA.*pin=False"):
        so.load_npy(tmp_path / "t.npy")
