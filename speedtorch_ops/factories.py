"""The SpeedTorch 0.1.6-compatible classes, built only on the ops (no CuPy).

Same class names, constructor signatures (positional order and defaults), method names and the
attribute names users touch. What is fixed on purpose (see the README's porting guide): modern
optimizers work, the optimizer's parameter is found by identity, duplicate ids lose no update
(the rule is in ``_switch``), indices are bounds-checked, transfers are ordered on the current
stream with no device-wide synchronization, optimizer state can be saved and loaded, loads check
shape and dtype, MM classes are backed by a memory-mapped ``.npy`` file, ``getNumpyVersion``
always returns NumPy, and every class has ``state_dict()`` / ``load_state_dict()``.

Where a store lives: ``CPUPinn=True`` / ``CPUPytorch*`` / ``deviceType='cpu', pinType=True``:
pinned host memory, read and written in place by CUDA kernels (ordinary host memory when the
machine has no GPU); ``CPUPinn=False`` / ``GPUPytorch*`` / ``deviceType='cuda'``: GPU memory;
``deviceType='cpu'``: ordinary host memory; ``*MM``: a memory-mapped ``.npy`` file. The batch
always goes to the device of the model's weight, wherever the store lives.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from . import _switch as sw
from .memory import load_npy


class _TableMethods:
    """Save, load, inspect and checkpoint the table(s) held in attribute ``_attr``."""

    _attr = "CUPYcorpus"
    _rows = None  # the SharedRows of colocated factories (speedtorch_ops.colocate)

    def _settle(self, writing: bool = False) -> None:
        """Colocated factories move rows on a transfer stream: wait for it before the host
        reads or writes the tables."""
        if self._rows is not None:
            self._rows.settle(writing)

    def _tables(self) -> list:
        value = getattr(self, self._attr, None)
        if value is None:
            raise RuntimeError(f"{type(self).__name__} has no table yet: call an init method "
                               "(e.g. zerosInit(), optInit(), comInit(), gadgetInit()) first")
        return value if isinstance(value, list) else [value]

    def _is_list(self) -> bool:
        return isinstance(getattr(self, self._attr, None), list)

    def _stacked(self) -> np.ndarray:
        self._settle()
        tables = [t.detach().cpu().numpy() for t in self._tables()]
        return np.stack(tables) if self._is_list() else tables[0]

    def getNumpyVersion(self) -> np.ndarray:
        """A NumPy copy of the table (of the stacked state tables for optimizer factories)."""
        return np.array(self._stacked(), copy=True)

    def saveCupy(self, saveFileName: str) -> None:
        """Save as NumPy ``.npy`` (NumPy appends ``.npy`` when missing)."""
        np.save(saveFileName, self._stacked())

    def loadCupy(self, loadFileName: str) -> None:
        """Load a ``.npy`` written by saveCupy into the existing store (shape and dtype checked)."""
        self._load_into(torch.from_numpy(np.load(loadFileName, mmap_mode="c")), loadFileName)

    def saveTorch(self, saveFileName: str) -> None:
        self._settle()
        value = getattr(self, self._attr)
        torch.save(value if not isinstance(value, list) else list(value), saveFileName)

    def loadTorch(self, loadFileName: str) -> None:
        loaded = torch.load(loadFileName, map_location="cpu")
        self._load_into(torch.stack(loaded) if isinstance(loaded, list) else loaded, loadFileName)

    def _load_into(self, loaded: Tensor, name: str) -> None:
        self._settle(writing=True)
        tables = self._tables()
        shape = (len(tables), *tables[0].shape) if self._is_list() else tuple(tables[0].shape)
        sw.check_loaded(name, loaded, shape, tables[0].dtype)
        for table, part in zip(tables, loaded if self._is_list() else [loaded]):
            table.copy_(part)

    def getCupyVar(self):
        return getattr(self, self._attr)

    getTorchVar = getCupyVar
    getCupyMM = getCupyVar

    def state_dict(self) -> dict:
        """The store(s), for checkpoints (``torch.save`` keeps pinned tensors as ordinary ones)."""
        self._settle()
        return {"tables": list(self._tables())}

    def load_state_dict(self, state_dict: dict) -> None:
        self._settle(writing=True)
        tables = self._tables()
        loaded = state_dict["tables"]
        if len(loaded) != len(tables):
            raise ValueError(f"checkpoint has {len(loaded)} tables, this store {len(tables)}")
        for i, (table, value) in enumerate(zip(tables, loaded)):
            sw.check_loaded(f"tables[{i}]", value, table.shape, table.dtype)
        for table, value in zip(tables, loaded):
            table.copy_(value)


class _Prefetching:
    """``prefetch`` of the model and optimizer factories."""

    def prefetch(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """(Not in SpeedTorch 0.1.6.) Start loading the rows of the next batch on a transfer
        stream while the current batch trains; a later beforeForwardPass with the same ids takes
        them. Call it right after beforeForwardPass. Colocated factories only
        (``speedtorch_ops.colocate``); rows shared with the current batch are taken from its
        updated rows on the device, so training is the same as without prefetch."""
        if self._rows is None:
            raise RuntimeError(f"{type(self).__name__}.prefetch needs colocated factories: call "
                               "speedtorch_ops.colocate(model_factory, optimizer_factory) first")
        self._rows.prefetch(sw.plan_for(retrievedPosIndexes, retrievedNegIndexes,
                                        self._rows.device))


class _ModelSwitcher(_Prefetching, _TableMethods):
    """One full embedding table; before each step the batch's rows become the weight of the
    batch-sized module ``model_variable``, after the step they are written back."""

    def __init__(self, model_variable, total_classes, embed_dimension, datatype, placement):
        self.model_variable = model_variable
        self.total_classes = total_classes
        self.embed_dimension = embed_dimension
        self.datatype = datatype
        self._dtype = sw.resolve_dtype(datatype)
        self._placement = placement
        self._plan: Optional[sw.Plan] = None
        self._hooked = None

    def _new_table(self) -> Tensor:
        if self._rows is not None:  # colocated: (re)initialize the weight column in place
            return self._rows.column(0).zero_()
        return sw.allocate((self.total_classes, self.embed_dimension), self._dtype, self._placement)

    def zerosInit(self) -> None:
        setattr(self, self._attr, self._new_table())

    def uniformDistributionInit(self, low, high) -> None:
        setattr(self, self._attr, self._new_table().uniform_(low, high))

    def normalDistributionInit(self, mean, stdDev) -> None:
        setattr(self, self._attr, self._new_table().normal_(mean, stdDev))

    def customInit(self, initFunction, *args) -> None:
        table = self._new_table()
        with torch.no_grad():
            initFunction(table, *args)
        setattr(self, self._attr, table)

    def variableTransformer(self, batchSize, posPerBatch, negPerBatch=None):
        return sw.variable_transformer(batchSize, posPerBatch, negPerBatch)

    def _weight(self) -> Tensor:
        return self.model_variable.weight

    def beforeForwardPass(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """Load the batch's rows (positives, then negatives) into the module's weight."""
        weight = self._weight()
        self._plan = sw.plan_for(retrievedPosIndexes, retrievedNegIndexes, weight.device)
        if self._rows is not None:  # the weight and the optimizer state in one transfer
            self._rows.load(self._plan)
        else:
            (table,) = self._tables()
            weight.data = sw.gather(table, self._plan, weight.device, table.dtype)
        if self._hooked is not weight:  # sums duplicate slots' gradients into their owner
            weight.register_hook(self._combine_duplicates)
            self._hooked = weight

    def _combine_duplicates(self, grad):
        return sw.sum_into_owners(grad, self._plan.owner) if self._plan is not None else grad

    def afterOptimizerStep(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """Write the batch's rows back into the table (each row once: its owner slot's value)."""
        plan = sw.plan_for(retrievedPosIndexes, retrievedNegIndexes, self._weight().device)
        if self._rows is not None:
            self._rows.write_back(plan)
            return
        (table,) = self._tables()
        sw.scatter(table, plan, self._weight().data)



class _OptimizerSwitcher(_Prefetching, _TableMethods):
    """The per-row optimizer state of one embedding: a full table per state tensor, swapped in
    and out of ``optimizer.state[weight]`` around each step."""

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype, placement):
        self.given_optimizer = given_optimizer
        self.total_classes = total_classes
        self.embed_dimension = embed_dimension
        self.model = model
        self.variable_name = variable_name
        self.datatype = dtype
        self._dtype = sw.resolve_dtype(dtype)
        self._placement = placement
        path = variable_name[:-len(".weight")] if variable_name.endswith(".weight") else variable_name
        self._param = model.get_submodule(path).weight
        group, self.optimizerKey = sw.find_group(given_optimizer, self._param)
        self._fills, scalars = sw.state_layout(given_optimizer, group)
        sw.init_state(given_optimizer, self._param, group, self._fills, scalars)
        self.optVarList = list(self._fills)
        self._plan: Optional[sw.Plan] = None

    def _new_tables(self) -> list:
        if self._rows is not None:  # colocated: (re)initialize the state columns in place
            return [self._rows.column(1 + k).fill_(self._fills[key])
                    for k, key in enumerate(self.optVarList)]
        shape = (self.total_classes, self.embed_dimension)
        return [sw.allocate(shape, self._dtype, self._placement).fill_(self._fills[k])
                for k in self.optVarList]

    def optInit(self) -> None:
        setattr(self, self._attr, self._new_tables())

    def _swappable(self, device: torch.device) -> bool:
        """One optimizer_state_swap call serves every state tensor: same dtypes, and stores the
        batch's device can exchange rows with."""
        stores = self._tables() if self.optVarList else []
        return all(s.dtype == self._param.dtype and sw.swappable(s, device) for s in stores)

    def beforeForwardPass(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        stores = self._tables() if self.optVarList else []
        state = self.given_optimizer.state[self._param]
        device = self._param.device
        self._plan = sw.plan_for(retrievedPosIndexes, retrievedNegIndexes, device)
        if self._rows is not None:  # the weight and the optimizer state in one transfer
            self._rows.load(self._plan)
            return
        shape = (self._plan.cpu.numel(), self.embed_dimension)
        batch = []
        for key in self.optVarList:
            current = state[key]
            if tuple(current.shape) != shape or current.device != device or (
                    current.dtype != self._param.dtype):
                state[key] = torch.empty(shape, dtype=self._param.dtype, device=device)
            batch.append(state[key])
        if not batch:
            return
        if self._swappable(device):
            sw.swap(stores, batch, self._plan, device, load=True)
        else:
            for store, b in zip(stores, batch):
                b.copy_(sw.gather(store, self._plan, device, b.dtype))

    def afterOptimizerStep(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        device = self._param.device
        if self._rows is not None:
            self._rows.write_back(sw.plan_for(retrievedPosIndexes, retrievedNegIndexes, device))
            return
        if not self.optVarList:
            return
        stores = self._tables()
        state = self.given_optimizer.state[self._param]
        plan = sw.plan_for(retrievedPosIndexes, retrievedNegIndexes, device)
        if self._swappable(device):
            owner = plan.owner.to(device)
            rows = [state[key].detach()[owner] for key in self.optVarList]
            sw.swap(stores, rows, plan, device, load=False)
        else:
            for store, key in zip(stores, self.optVarList):
                sw.scatter(store, plan, state[key])


class _COMBase(_TableMethods):
    """A dense (total_classes x total_classes) co-occurrence table."""

    _attr = "CUPYCom"

    def __init__(self, total_classes, datatype, placement):
        self.total_classes = total_classes
        self.datatype = datatype
        self._dtype = sw.resolve_dtype(datatype)
        self._placement = placement

    def comInit(self, CPUPinn=False) -> None:
        """Allocate the zero table. (As in 0.1.6 the argument is ignored: the constructor's
        placement is used.)"""
        setattr(self, self._attr,
                sw.allocate((self.total_classes, self.total_classes), self._dtype, self._placement))


class _GadgetBase(_TableMethods):
    """Any ``.npy`` array as a store: rows (or slices) out to the compute device and back."""

    def __init__(self, fileName, CPUPinn=False):
        self.fileName = fileName
        self.CPUPinn = CPUPinn

    def _device(self) -> torch.device:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    @staticmethod
    def _is_row_index(indexes) -> bool:
        return isinstance(indexes, (list, np.ndarray, Tensor)) and np.asarray(
            indexes.cpu() if isinstance(indexes, Tensor) else indexes).dtype.kind in "iu"

    def getData(self, indexes, retrievedNegIndexes=None) -> Tensor:
        """Rows ``indexes`` (an integer array; with a second array, positives then negatives) as
        a new tensor on the GPU (CPU without one). Slices and ints give a copy of that part."""
        (table,) = self._tables()
        device = self._device()
        if retrievedNegIndexes is not None:
            indexes = sw.reshaped_retrieval(indexes, retrievedNegIndexes)
        if not self._is_row_index(indexes):
            return table[indexes].to(device)
        return sw.gather(table, sw.Plan(indexes, device), device, table.dtype)

    def insertData(self, dataObject: Tensor, indexes, retrievedNegIndexes=None) -> None:
        """Write ``dataObject`` into rows ``indexes`` (cast to the table's dtype; for repeated
        rows the last one wins) or into a slice."""
        (table,) = self._tables()
        if retrievedNegIndexes is not None:
            indexes = sw.reshaped_retrieval(indexes, retrievedNegIndexes)
        if not self._is_row_index(indexes):
            table[indexes] = dataObject.to(table.device, table.dtype)
            return
        plan = sw.Plan(indexes, dataObject.device)
        rows = dataObject.reshape(plan.cpu.numel(), *table.shape[1:])
        sw.scatter(table, plan, rows, owners=False)


# ---- the CuPy-named family (0.1.6 CUPYLive.py) ---------------------------------------------

def _pin_or_gpu(CPUPinn) -> str:
    return "pinned" if CPUPinn else "cuda"


class ModelFactory(_ModelSwitcher):
    """``ModelFactory(model_variable, total_classes, embed_dimension, datatype='float32',
    CPUPinn=False)``: the table in GPU memory, or pinned host memory with ``CPUPinn=True``."""

    _attr = "CUPYcorpus"

    def __init__(self, model_variable, total_classes, embed_dimension, datatype="float32",
                 CPUPinn=False):
        super().__init__(model_variable, total_classes, embed_dimension, datatype,
                         _pin_or_gpu(CPUPinn))
        self.CPUPinn = CPUPinn


class OptimizerFactory(_OptimizerSwitcher):
    """``OptimizerFactory(given_optimizer, total_classes, embed_dimension, model, variable_name,
    dtype='float32', CPUPinn=False)``: one state table per entry of ``optVarList``."""

    _attr = "CUPYcorpi"

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype="float32", CPUPinn=False):
        super().__init__(given_optimizer, total_classes, embed_dimension, model, variable_name,
                         dtype, _pin_or_gpu(CPUPinn))
        self.CPUPinn = CPUPinn


class COM(_COMBase):
    """``COM(total_classes, datatype='uint32', CPUPinn=False)``."""

    def __init__(self, total_classes, datatype="uint32", CPUPinn=False):
        super().__init__(total_classes, datatype, _pin_or_gpu(CPUPinn))
        self.CPUPinn = CPUPinn


class DataGadget(_GadgetBase):
    """``DataGadget(fileName, CPUPinn=False)``: a ``.npy`` array in GPU or pinned memory."""

    def gadgetInit(self) -> None:
        table = load_npy(self.fileName, pin=self.CPUPinn and torch.cuda.is_available())
        self.CUPYcorpus = table if self.CPUPinn else table.to(sw.cuda_or_raise("DataGadget"))


# ---- the memory-mapped family (0.1.6 CPUCupyPinned.py) --------------------------------------

class ModelFactoryMM(_ModelSwitcher):
    """``ModelFactoryMM(model_variable, total_classes, embed_dimension, diskname='variable',
    datatype='float32', CPUPinn=False)``: the table is the memory-mapped file
    ``{diskname}{n}.memmap.cpy.npy`` (first free n, in the working directory); writes reach it."""

    _attr = "CUPYmemmap"

    def __init__(self, model_variable, total_classes, embed_dimension, diskname="variable",
                 datatype="float32", CPUPinn=False):
        super().__init__(model_variable, total_classes, embed_dimension, datatype, "mmap")
        self.diskname = diskname
        self.CPUPinn = CPUPinn
        self.fileName = None

    def _new_table(self) -> Tensor:
        self.fileName = sw.next_free_name(self.diskname, ".memmap.cpy.npy")
        return sw.mmap_npy(self.fileName, (self.total_classes, self.embed_dimension),
                           self._dtype, self.CPUPinn)


class OptimizerFactoryMM(_OptimizerSwitcher):
    """``OptimizerFactoryMM(given_optimizer, total_classes, embed_dimension, model,
    variable_name, dtype='float32', CPUPinn=False)``: one memory-mapped file per state tensor,
    ``{variable_name}{OptimizerName}{n}.memmap{key}.cpy.npy``."""

    _attr = "CUPYmemmap"

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype="float32", CPUPinn=False):
        super().__init__(given_optimizer, total_classes, embed_dimension, model, variable_name,
                         dtype, "mmap")
        self.CPUPinn = CPUPinn
        self.diskname = variable_name + type(given_optimizer).__name__
        self.fileNames = []

    def _new_tables(self) -> list:
        stem = sw.next_free_name(self.diskname, ".memmap.cpy.npy")[: -len(".memmap.cpy.npy")]
        self.fileNames = [f"{stem}.memmap{key}.cpy.npy" for key in self.optVarList]
        shape = (self.total_classes, self.embed_dimension)
        return [sw.mmap_npy(name, shape, self._dtype, self.CPUPinn).fill_(self._fills[key])
                for name, key in zip(self.fileNames, self.optVarList)]


class COMMM(_COMBase):
    """``COMMM(total_classes, diskname='COM', datatype='uint32', CPUPinn=False)``."""

    def __init__(self, total_classes, diskname="COM", datatype="uint32", CPUPinn=False):
        super().__init__(total_classes, datatype, "mmap")
        self.diskname = diskname
        self.CPUPinn = CPUPinn

    def comInit(self, CPUPinn=False) -> None:
        self.fileName = sw.next_free_name(self.diskname, ".memmap.cpy.npy")
        self.CUPYCom = sw.mmap_npy(self.fileName, (self.total_classes, self.total_classes),
                                   self._dtype, self.CPUPinn)


class DataGadgetMM(_GadgetBase):
    """``DataGadgetMM(fileName, CPUPinn=False)``: the ``.npy`` file itself, memory-mapped
    read-write, as the store."""

    _attr = "CUPYmemmap"

    def gadgetInit(self) -> None:
        self.CUPYmemmap = torch.from_numpy(np.load(self.fileName, mmap_mode="r+"))


# ---- the torch-named families (0.1.6 GPUTorch.py, CPUTorchPinned.py, GenTorch.py) ----------

class _FixedModelFactory(_ModelSwitcher):
    """GPUPytorchModelFactory / CPUPytorchModelFactory: 0.1.6's signature, a fixed placement."""

    def __init__(self, model_variable, total_classes, embed_dimension, datatype=torch.float):
        super().__init__(model_variable, total_classes, embed_dimension, datatype,
                         self._fixed_placement)
        self.dtype = self._dtype


class _FixedOptimizerFactory(_OptimizerSwitcher):
    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype=torch.float):
        super().__init__(given_optimizer, total_classes, embed_dimension, model, variable_name,
                         dtype, self._fixed_placement)
        self.dtype = self._dtype


class _FixedCOM(_COMBase):
    def __init__(self, total_classes, datatype=torch.int32):
        super().__init__(total_classes, datatype, self._fixed_placement)


class GPUPytorchModelFactory(_FixedModelFactory):
    _attr, _fixed_placement = "pytorchGPUVar", "cuda"


class GPUPytorchOptimizerFactory(_FixedOptimizerFactory):
    _attr, _fixed_placement = "pytorchGPUVar", "cuda"


class GPUPytorchCOM(_FixedCOM):
    _attr, _fixed_placement = "pytorchGPUVar", "cuda"


class CPUPytorchModelFactory(_FixedModelFactory):
    _attr, _fixed_placement = "pytorchCPUVar", "pinned"


class CPUPytorchOptimizerFactory(_FixedOptimizerFactory):
    _attr, _fixed_placement = "pytorchCPUVar", "pinned"


class CPUPytorchCOM(_FixedCOM):
    _attr, _fixed_placement = "pytorchCPUVar", "pinned"


def _torch_placement(deviceType, pinType) -> str:
    if str(deviceType).startswith("cuda"):
        if pinType:
            raise ValueError("pinType=True needs deviceType='cpu': only host memory can be pinned")
        return "cuda"
    return "pinned" if pinType else "cpu"


class PytorchModelFactory(_ModelSwitcher):
    _attr = "pytorchGPUVar"

    def __init__(self, model_variable, total_classes, embed_dimension, datatype=torch.float,
                 deviceType="cuda", pinType=False):
        super().__init__(model_variable, total_classes, embed_dimension, datatype,
                         _torch_placement(deviceType, pinType))
        self.dtype, self.deviceType, self.pinType = self._dtype, deviceType, pinType


class PytorchOptimizerFactory(_OptimizerSwitcher):
    _attr = "pytorchGPUVar"

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype=torch.float, deviceType="cuda", pinType=False):
        super().__init__(given_optimizer, total_classes, embed_dimension, model, variable_name,
                         dtype, _torch_placement(deviceType, pinType))
        self.dtype, self.deviceType, self.pinType = self._dtype, deviceType, pinType


class PytorchCOM(_COMBase):
    _attr = "pytorchGPUVar"

    def __init__(self, total_classes, datatype=torch.int32, deviceType="cuda", pinType=False):
        super().__init__(total_classes, datatype, _torch_placement(deviceType, pinType))
        self.deviceType, self.pinType = deviceType, pinType
