"""speedtorch_ops: zero-copy indexed row transfers between pinned host memory and the GPU.

Layers, data flowing down: the SpeedTorch-compatible classes (``compat``) -> row stores and a
step's plan (``training``) -> typed wrappers, fakes and autograd (``ops``) ->
``torch.ops.speedtorch_ops`` (the C++/CUDA kernels). ``memory`` holds the pinned-memory helpers,
``io`` streamed and atomic saves and loads of tables, ``modules`` HostEmbedding and
HostEmbeddingBag, ``optim`` RowWiseAdagrad and PartialRowWiseAdam, ``capture`` a whole
training step in a CUDA graph,
``distributed`` (imported on its own: ``import speedtorch_ops.distributed``) the modules split by
rows across a torch.distributed group, ``demo`` the main job (``python -m speedtorch_ops.demo``).
"""

import torch

try:
    from . import _C  # noqa: F401  (loads the library; its TORCH_LIBRARY registers the ops)
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(
        f"speedtorch_ops._C could not be loaded with torch {torch.__version__} "
        f"(CUDA {torch.version.cuda}): {e}. The extension must be built against the installed "
        "torch: run `pip install --no-build-isolation -e .` in the source tree."
    ) from e

from .modules import HostEmbedding, HostEmbeddingBag, clip_grad_norm_, count_parameters
from .capture import CapturedStep
from .collection import HostEmbeddingBagCollection, HostEmbeddingCollection
from .prefetcher import Prefetcher
from .table_config import TableConfig
from .jagged import KeyedJaggedTensor
from .keyed import JaggedTensor, KeyedTensor
from . import optim
from .optim import PartialRowWiseAdam, RowWiseAdagrad
from . import io
from .io import load_npy
from .memory import empty_pinned, fill_random_, initialize_, is_zero_copy_usable, pin_, unpin_
from .ops import (inductor_options, optimizer_state_swap, pinned_gather, pinned_gather_into,
                  pinned_scatter, set_transfer_sm_limit, sync_bounds_check, transfer_sm_limit)
from . import compat
from .compat import (COM, COMMM, CPUPytorchCOM, CPUPytorchModelFactory,
                     CPUPytorchOptimizerFactory, DataGadget, DataGadgetMM, GPUPytorchCOM,
                     GPUPytorchModelFactory, GPUPytorchOptimizerFactory, ModelFactory,
                     ModelFactoryMM, OptimizerFactory, OptimizerFactoryMM, PytorchCOM,
                     PytorchModelFactory, PytorchOptimizerFactory, colocate)

__all__ = [
    "pinned_gather",
    "pinned_gather_into",
    "pinned_scatter",
    "optimizer_state_swap",
    "sync_bounds_check",
    "set_transfer_sm_limit",
    "transfer_sm_limit",
    "inductor_options",
    "empty_pinned",
    "pin_",
    "unpin_",
    "initialize_",
    "fill_random_",
    "io",
    "load_npy",
    "is_zero_copy_usable",
    "HostEmbedding",
    "HostEmbeddingBag",
    "count_parameters",
    "clip_grad_norm_",
    "CapturedStep",
    "HostEmbeddingBagCollection",
    "HostEmbeddingCollection",
    "Prefetcher",
    "TableConfig",
    "KeyedJaggedTensor",
    "KeyedTensor",
    "JaggedTensor",
    "optim",
    "PartialRowWiseAdam",
    "RowWiseAdagrad",
    *compat.__all__,  # the SpeedTorch-compatible classes and colocate
]
