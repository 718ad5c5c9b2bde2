"""The SpeedTorch 0.1.6-compatible classes, each holding a row store (``speedtorch_ops.training``)
and delegating the movement of a batch's rows to it."""

from .colocate import colocate
from .factories import (COM, COMMM, CPUPytorchCOM, CPUPytorchModelFactory,
                        CPUPytorchOptimizerFactory, DataGadget, DataGadgetMM, GPUPytorchCOM,
                        GPUPytorchModelFactory, GPUPytorchOptimizerFactory, ModelFactory,
                        ModelFactoryMM, OptimizerFactory, OptimizerFactoryMM, PytorchCOM,
                        PytorchModelFactory, PytorchOptimizerFactory)

__all__ = [
    "colocate",
    "ModelFactory", "OptimizerFactory", "COM", "DataGadget",
    "ModelFactoryMM", "OptimizerFactoryMM", "COMMM", "DataGadgetMM",
    "GPUPytorchModelFactory", "GPUPytorchOptimizerFactory", "GPUPytorchCOM",
    "CPUPytorchModelFactory", "CPUPytorchOptimizerFactory", "CPUPytorchCOM",
    "PytorchModelFactory", "PytorchOptimizerFactory", "PytorchCOM",
]
