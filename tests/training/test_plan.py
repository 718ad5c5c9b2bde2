"""A step's ids as the plans take them: `host_ids` turns any integer ids on the host (NumPy,
lists, tensors of any integer dtype and layout) into one flat int64 CPU tensor."""

import numpy as np
import pytest
import torch

from speedtorch_ops.training.plan import host_ids


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64])
def test_host_ids_of_any_integer_tensor_are_flat_int64(dtype):
    # Host tensors convert through NumPy (not torch's thread pool): same values, flat int64,
    # whatever the dtype or layout; an int64 contiguous tensor is used where it is.
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, 100, (6, 9), generator=gen).to(dtype)
    strided = ids.t()  # not contiguous
    out = host_ids(strided, "ids")
    assert out.dtype == torch.int64 and out.shape == (54,)
    assert torch.equal(out, strided.reshape(-1).to(torch.int64))
    if dtype == torch.int64:
        flat = ids.reshape(-1)
        assert host_ids(flat).data_ptr() == flat.data_ptr()
    with pytest.raises(TypeError, match="ids must be integers"):
        host_ids(ids.float(), "ids")


def test_host_ids_of_numpy_and_lists():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, (5, 4)).astype(np.int32)
    assert torch.equal(host_ids(ids), torch.from_numpy(ids.reshape(-1).astype(np.int64)))
    assert torch.equal(host_ids([3, 1, 2]), torch.tensor([3, 1, 2]))
    with pytest.raises(TypeError, match="ids must be integers"):
        host_ids(ids.astype(np.float32))


def test_host_ids_of_a_negated_view_and_a_subclass():
    # A negated view reads as its values; a tensor subclass (here fake) takes torch's path.
    from torch._subclasses.fake_tensor import FakeTensorMode
    assert torch.equal(host_ids(torch._neg_view(torch.tensor([-1, -2, -3]))),
                       torch.tensor([1, 2, 3]))
    with FakeTensorMode():
        out = host_ids(torch.empty(5, 2, dtype=torch.int32))
    assert out.shape == (10,) and out.dtype == torch.int64
