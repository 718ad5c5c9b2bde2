"""Pinned-memory helpers: empty_pinned, pin_, load_npy, is_zero_copy_usable."""

import numpy as np
import pytest
import torch

import speedtorch_ops

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64, np.int8, np.bool_])
def test_load_npy_in_chunks_equals_file(tmp_path, dtype):
    rng = np.random.default_rng()
    data = (rng.standard_normal((1003, 7)) * 50).astype(dtype)
    path = tmp_path / "table.npy"
    np.save(path, data)
    # A chunk of a few rows forces many chunk copies.
    table = speedtorch_ops.load_npy(str(path), pin=HAS_CUDA, chunk_bytes=100 * data.itemsize * 7)
    assert table.shape == data.shape and table.is_contiguous()
    assert np.array_equal(table.numpy(), data)
    assert speedtorch_ops.is_zero_copy_usable(table) == HAS_CUDA


def test_load_npy_one_dimensional_and_empty(tmp_path):
    data = np.arange(10, dtype=np.int32)[::-1].copy()
    np.save(tmp_path / "a.npy", data)
    assert np.array_equal(speedtorch_ops.load_npy(str(tmp_path / "a.npy"), pin=False).numpy(), data)
    empty = np.zeros((0, 3), dtype=np.float32)
    np.save(tmp_path / "e.npy", empty)
    assert speedtorch_ops.load_npy(str(tmp_path / "e.npy"), pin=False).shape == (0, 3)


def test_empty_pinned_unpinned_fallback_and_checks():
    t = speedtorch_ops.empty_pinned((5, 3), torch.bfloat16, pin=False)
    assert t.shape == (5, 3) and t.dtype == torch.bfloat16 and not t.is_pinned()
    with pytest.raises(ValueError, match="must be contiguous"):
        speedtorch_ops.pin_(torch.zeros(4, 4).t())


@pytest.mark.skipif(HAS_CUDA, reason="checks the CPU-only error")
def test_pin_without_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="(without CUDA|cannot pin|CUDA)"):
        speedtorch_ops.empty_pinned((4, 4), torch.float32)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_pin_in_place_keeps_data_and_address():
    t = torch.randn(1000, 33)
    ref = t.clone()
    ptr = t.data_ptr()
    assert not speedtorch_ops.is_zero_copy_usable(t)
    speedtorch_ops.pin_(t)
    assert t.data_ptr() == ptr and t.is_pinned() and torch.equal(t, ref)
    assert speedtorch_ops.is_zero_copy_usable(t)
    speedtorch_ops.pin_(t)  # pinning twice is a no-op
    idx = torch.randint(0, 1000, (50,), device="cuda")
    assert torch.equal(speedtorch_ops.pinned_gather(t, idx).cpu(), ref[idx.cpu()])
    view = t[10:20]
    del t
    assert torch.equal(view, ref[10:20])  # the storage outlives the tensor that pinned it
    del view


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_empty_pinned_costs_its_bytes():
    # 300 MiB + a bit: torch's pinned allocator would round this up to 512 MiB.
    shape = (300 * 1024 + 7, 256)
    t = speedtorch_ops.empty_pinned(shape, torch.float32)
    assert t.is_pinned() and t.untyped_storage().nbytes() == shape[0] * shape[1] * 4
