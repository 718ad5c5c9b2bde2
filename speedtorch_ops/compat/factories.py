"""The SpeedTorch 0.1.6-compatible classes, built only on the ops (no CuPy).

Same class names, constructor signatures (positional order and defaults), method names and the
attribute names users touch. What is fixed on purpose (see docs/porting.md): modern
optimizers work, the optimizer's parameter is found by identity, duplicate ids lose no update
(the rule is in ``training.plan``), indices are bounds-checked, transfers are ordered on the current
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

from typing import List, Optional

import numpy as np
import torch
from torch import Tensor

from .. import io
from ..io import load_npy
from ..memory import RANDOM_FILLS, empty_pinned, fill_random_, initialize_
from ..training import optim_state
from ..training.placement import (allocate, check_loaded, cuda_or_raise, mmap_npy,
                                  next_free_name, resolve_dtype)
from ..training.plan import Plan, reshaped_retrieval, sum_into_owners
from ..training.stores import RowStore, SeparateTables


class _TableMethods:
    """Save, load, inspect and checkpoint the table(s) of a class, held by its row store and
    shown as the attribute named by ``_attr`` (a single table, or a list for optimizer state)."""

    _attr = "CUPYcorpus"
    _listed = False  # the attribute is a list of tables (one per optimizer-state tensor)

    def __init_subclass__(cls, **kwargs):
        # The table attribute users touch (``CUPYcorpus``, ``CUPYcorpi``, ``pytorchGPUVar``,
        # ...) reads through the store, so it stays right when ``colocate`` swaps the store.
        super().__init_subclass__(**kwargs)
        if not isinstance(getattr(cls, cls._attr, None), property):
            setattr(cls, cls._attr, property(cls._public, cls._adopt))

    store: Optional[RowStore] = None  # where the tables live (see colocate)
    _parts: List[int] = []  # the parts of the store that are this object's tables

    def use_store(self, store: RowStore, parts: List[int]) -> None:
        """Keep the tables in `store`, as its parts `parts` (colocate shares one store)."""
        self.store, self._parts = store, list(parts)

    def _store_device(self) -> torch.device:
        return torch.device("cpu")

    def _adopt(self, value) -> None:
        """Tables given by the user (or an init method) become a store of separate tables."""
        tables = list(value) if isinstance(value, (list, tuple)) else [value]
        self.use_store(SeparateTables(tables, self._store_device(), self._batch_dtype()),
                        list(range(len(tables))))

    def _batch_dtype(self) -> Optional[torch.dtype]:
        return None

    def _public(self):
        if self.store is None:
            return None
        tables = self.store.tables()
        mine = [tables[k] for k in self._parts]
        return mine if self._listed else mine[0]

    def _settle(self, writing: bool = False) -> None:
        """Wait for the store's own transfers before the host reads (or writes) the tables."""
        if self.store is not None:
            self.store.settle(writing)

    def tables(self) -> list:
        """This object's tables, as its store holds them now."""
        if self.store is None:
            raise RuntimeError(f"{type(self).__name__} has no table yet: call an init method "
                               "(e.g. zerosInit(), optInit(), comInit(), gadgetInit()) first")
        tables = self.store.tables()
        return [tables[k] for k in self._parts]

    def _stacked(self) -> np.ndarray:
        self._settle()
        tables = [t.detach().cpu().numpy() for t in self.tables()]
        return np.stack(tables) if self._listed else tables[0]

    def getNumpyVersion(self) -> np.ndarray:
        """A NumPy copy of the table (of the stacked state tables for optimizer factories)."""
        return np.array(self._stacked(), copy=True)

    def saveCupy(self, saveFileName: str) -> None:
        """Save as NumPy ``.npy`` (``.npy`` appended when missing, as NumPy does): streamed from
        the tables (no second copy in memory) and atomic (a killed save leaves the old file)."""
        name = str(saveFileName)
        self._settle()
        tables = self.tables()
        io.save_npy(tables if self._listed else tables[0],
                    name if name.endswith(".npy") else name + ".npy")

    def loadCupy(self, loadFileName: str) -> None:
        """Load a ``.npy`` written by saveCupy into the existing store (shape and dtype checked),
        read through a memory map (no second copy of the table in memory)."""
        loaded = torch.from_numpy(np.load(loadFileName, mmap_mode="c"))
        self._load_into(list(loaded) if self._listed else [loaded], loadFileName)

    def saveTorch(self, saveFileName: str) -> None:
        """``torch.save`` of the table (of the list of state tables), atomic."""
        self._settle()
        tables = self.tables()
        io.save_checkpoint(list(tables) if self._listed else tables[0], saveFileName)

    def loadTorch(self, loadFileName: str) -> None:
        """Load a saveTorch file into the existing store, memory-mapped (no second copy)."""
        loaded = io.load_checkpoint(loadFileName)
        if isinstance(loaded, Tensor) and self._listed and loaded.dim() == 3:
            loaded = list(loaded)  # a stacked save
        self._load_into(list(loaded) if isinstance(loaded, (list, tuple)) else [loaded],
                        loadFileName)

    def _load_into(self, loaded: list, name: str) -> None:
        """Copy `loaded` (one tensor per table) into the tables; every shape and dtype is checked
        before anything is written."""
        self._settle(writing=True)
        tables = self.tables()
        shape = (len(tables), *tables[0].shape) if self._listed else tuple(tables[0].shape)
        if self._listed:
            got = (len(loaded), *loaded[0].shape) if loaded else (0,)
        else:
            got = tuple(loaded[0].shape)
        dtypes = {t.dtype for t in loaded}
        check_loaded(name, got, dtypes.pop() if len(dtypes) == 1 else dtypes, shape,
                     tables[0].dtype)
        for table, part in zip(tables, loaded):
            table.copy_(part)

    def getCupyVar(self):
        return getattr(self, self._attr)

    getTorchVar = getCupyVar
    getCupyMM = getCupyVar

    def state_dict(self) -> dict:
        """The store(s), for checkpoints (``torch.save`` keeps pinned tensors as ordinary ones)."""
        self._settle()
        return {"tables": list(self.tables())}

    def load_state_dict(self, state_dict: dict) -> None:
        self._settle(writing=True)
        tables = self.tables()
        loaded = state_dict["tables"]
        if len(loaded) != len(tables):
            raise ValueError(f"checkpoint has {len(loaded)} tables, this store {len(tables)}")
        for i, (table, value) in enumerate(zip(tables, loaded)):
            check_loaded(f"tables[{i}]", value.shape, value.dtype, table.shape, table.dtype)
        for table, value in zip(tables, loaded):
            table.copy_(value)


class _Switcher(_TableMethods):
    """What the model and optimizer factories share: a batch's plan from the store, and
    ``prefetch``."""

    _plan: Optional[Plan] = None

    def _plan_for(self, pos, neg) -> Plan:
        if self.store is None:
            self.tables()  # raises: no table yet
        return self.store.plan_for(reshaped_retrieval(pos, neg))

    def prefetch(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """(Not in SpeedTorch 0.1.6.) Start loading the rows of the next batch on a transfer
        stream while the current batch trains; a later beforeForwardPass with the same ids takes
        them. Call it right after beforeForwardPass. Colocated factories only
        (``speedtorch_ops.colocate``); rows shared with the current batch are taken from its
        updated rows on the device, so training is the same as without prefetch."""
        plan = self._plan_for(retrievedPosIndexes, retrievedNegIndexes)  # raises without a table
        self.store.prefetch(plan)


class _ModelSwitcher(_Switcher):
    """One full embedding table; before each step the batch's rows become the weight of the
    batch-sized module ``model_variable``, after the step they are written back."""

    def __init__(self, model_variable, total_classes, embed_dimension, datatype, placement):
        self.model_variable = model_variable
        self.total_classes = total_classes
        self.embed_dimension = embed_dimension
        self.datatype = datatype
        self.table_dtype = resolve_dtype(datatype)
        self.placement = placement
        self._hooked = None

    def _store_device(self) -> torch.device:
        return self.model_weight().device

    def _new_table(self) -> Optional[Tensor]:
        """A new table, or None to re-initialise the store's own in place (colocated factories
        share it)."""
        if self.store is not None:
            return None
        return allocate((self.total_classes, self.embed_dimension), self.table_dtype, self.placement)

    def _initialise(self, fill) -> None:
        """``fill(chunk)`` in place (a tuple ``(distribution, a, b)``: random numbers, drawn on
        all CPU threads by ``fill_random_`` where the table is in host memory)."""
        random = fill if isinstance(fill, tuple) else None
        if random is not None:
            distribution, a, b = random
            fill = lambda t: getattr(t, RANDOM_FILLS[distribution])(a, b)  # noqa: E731
        table = self._new_table()
        if table is None:
            self._settle(writing=True)
            (table,) = self.tables()
        else:
            self._adopt(table)
        with torch.no_grad():
            if random is not None and table.device.type == "cpu":
                fill_random_(table, *random)
            elif table.is_contiguous():  # in chunks, with a progress bar for large tables
                initialize_(table, fill)
            else:
                fill(table)

    def zerosInit(self) -> None:
        self._initialise(lambda t: t.zero_())

    def uniformDistributionInit(self, low, high) -> None:
        self._initialise(("uniform", low, high))

    def normalDistributionInit(self, mean, stdDev) -> None:
        self._initialise(("normal", mean, stdDev))

    def customInit(self, initFunction, *args) -> None:
        self._initialise(lambda t: initFunction(t, *args))

    def variableTransformer(self, batchSize, posPerBatch, negPerBatch=None):
        """Slot numbers for the model's inputs: slot i of the batch-sized module holds row
        ids[i] (positives flattened, then negatives)."""
        pos = np.arange(batchSize * posPerBatch).reshape(batchSize, posPerBatch)
        if negPerBatch is None:
            return pos
        start = batchSize * posPerBatch
        return pos, np.arange(start, start + batchSize * negPerBatch).reshape(batchSize,
                                                                                negPerBatch)

    def model_weight(self) -> Tensor:
        """The weight of the model's embedding, which a batch's rows become."""
        return self.model_variable.weight

    def beforeForwardPass(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """Load the batch's rows (positives, then negatives) into the module's weight."""
        weight = self.model_weight()
        self._plan = self._plan_for(retrievedPosIndexes, retrievedNegIndexes)
        weight.data = self.store.load(self._plan)[self._parts[0]]
        if self._hooked is not weight:  # sums duplicate slots' gradients into their owner
            weight.register_hook(self._combine_duplicates)
            self._hooked = weight

    def _combine_duplicates(self, grad):
        return sum_into_owners(grad, self._plan.owner) if self._plan is not None else grad

    def afterOptimizerStep(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        """Write the batch's rows back into the table (each row once: its owner slot's value)."""
        plan = self._plan_for(retrievedPosIndexes, retrievedNegIndexes)
        self.store.write_back(plan, [self.model_weight().data])


class _OptimizerSwitcher(_Switcher):
    """The per-row optimizer state of one embedding: a full table per state tensor, swapped in
    and out of ``optimizer.state[weight]`` around each step."""

    _listed = True

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype, placement):
        self.given_optimizer = given_optimizer
        self.total_classes = total_classes
        self.embed_dimension = embed_dimension
        self.model = model
        self.variable_name = variable_name
        self.datatype = dtype
        self.table_dtype = resolve_dtype(dtype)
        self.placement = placement
        path = (variable_name[:-len(".weight")] if variable_name.endswith(".weight")
                else variable_name)
        self.param = model.get_submodule(path).weight
        group, self.optimizerKey = optim_state.find_group(given_optimizer, self.param)
        if optim_state.row_state_keys(given_optimizer):
            raise ValueError(f"given_optimizer: {type(given_optimizer).__name__} keeps one value "
                             "per row; the factories keep per-element state tables. Use it "
                             "with speedtorch_ops.HostEmbedding")
        self.fills, scalars = optim_state.state_layout(given_optimizer, group)
        optim_state.init_state(given_optimizer, self.param, group, self.fills, scalars)
        self.optVarList = list(self.fills)

    def _store_device(self) -> torch.device:
        return self.param.device

    def _batch_dtype(self) -> Optional[torch.dtype]:
        return self.param.dtype  # the optimizer's state follows its parameter

    def _new_tables(self) -> Optional[list]:
        """New tables, or None to re-initialise the store's own in place."""
        if self.store is not None:
            return None
        shape = (self.total_classes, self.embed_dimension)
        return [allocate(shape, self.table_dtype, self.placement) for _ in self.optVarList]

    def optInit(self) -> None:
        tables = self._new_tables()
        if tables is None:
            self._settle(writing=True)
            tables = self.tables()
        else:
            self._adopt(tables)
        for table, key in zip(tables, self.optVarList):
            table.fill_(self.fills[key])

    def beforeForwardPass(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        if not self.optVarList:  # a stateless optimizer (plain SGD): nothing to move
            return
        plan = self._plan_for(retrievedPosIndexes, retrievedNegIndexes)
        state = self.given_optimizer.state[self.param]
        rows = self.store.load(plan, out=[state[key] for key in self.optVarList])
        for key, part in zip(self.optVarList, self._parts):
            state[key] = rows[part]

    def afterOptimizerStep(self, retrievedPosIndexes, retrievedNegIndexes=None) -> None:
        if not self.optVarList:
            return
        plan = self._plan_for(retrievedPosIndexes, retrievedNegIndexes)
        state = self.given_optimizer.state[self.param]
        self.store.write_back(plan, [state[key] for key in self.optVarList])


class _COMBase(_TableMethods):
    """A dense (total_classes x total_classes) co-occurrence table."""

    _attr = "CUPYCom"

    def __init__(self, total_classes, datatype, placement):
        self.total_classes = total_classes
        self.datatype = datatype
        self.table_dtype = resolve_dtype(datatype)
        self.placement = placement

    def _new_table(self) -> Tensor:
        return allocate((self.total_classes, self.total_classes), self.table_dtype, self.placement)

    def comInit(self, CPUPinn=False) -> None:
        """Allocate the zero table. (As in 0.1.6 the argument is ignored: the constructor's
        placement is used.)"""
        self._adopt(self._new_table())


class _GadgetBase(_TableMethods):
    """An array as a store: rows (or slices) out to the compute device and back. ``fileName``
    is a ``.npy`` file's name or (not in 0.1.6, but user scripts of its time pass one) an
    in-memory array or tensor."""

    def __init__(self, fileName, CPUPinn=False):
        self.fileName = fileName
        self.CPUPinn = CPUPinn

    def _store_device(self) -> torch.device:
        return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    @staticmethod
    def _is_row_index(indexes) -> bool:
        return isinstance(indexes, (list, np.ndarray, Tensor)) and np.asarray(
            indexes.cpu() if isinstance(indexes, Tensor) else indexes).dtype.kind in "iu"

    def getData(self, indexes, retrievedNegIndexes=None) -> Tensor:
        """Rows ``indexes`` (an integer array; with a second array, positives then negatives) as
        a new tensor on the GPU (CPU without one). Slices and ints give a copy of that part."""
        (table,) = self.tables()
        if retrievedNegIndexes is not None:
            indexes = reshaped_retrieval(indexes, retrievedNegIndexes)
        if not self._is_row_index(indexes):
            return table[indexes].to(self.store.device)
        (rows,) = self.store.load(self.store.plan_for(indexes))
        return rows

    def insertData(self, dataObject: Tensor, indexes, retrievedNegIndexes=None) -> None:
        """Write ``dataObject`` into rows ``indexes`` (cast to the table's dtype; for repeated
        rows the last one wins) or into a slice."""
        (table,) = self.tables()
        if retrievedNegIndexes is not None:
            indexes = reshaped_retrieval(indexes, retrievedNegIndexes)
        if not self._is_row_index(indexes):
            table[indexes] = dataObject.to(table.device, table.dtype)
            return
        plan = self.store.plan_for(indexes)
        rows = torch.as_tensor(dataObject).reshape(len(plan), *table.shape[1:])
        self.store.write_back(plan, [rows], owners=False)

    def _source(self) -> Tensor:
        """The gadget's data: the file (memory-mapped, copied in chunks) or the given array."""
        if isinstance(self.fileName, (str, bytes)) or hasattr(self.fileName, "__fspath__"):
            return load_npy(self.fileName, pin=self.CPUPinn and torch.cuda.is_available())
        data = torch.as_tensor(self.fileName)
        table = empty_pinned(data.shape, data.dtype, pin=self.CPUPinn and torch.cuda.is_available())
        return table.copy_(data)


# ---- the CuPy-named family (0.1.6 CUPYLive.py) ---------------------------------------------

def _pin_or_gpu(CPUPinn) -> str:
    return "pinned" if CPUPinn else "cuda"


class ModelFactory(_ModelSwitcher):
    """``ModelFactory(model_variable, total_classes, embed_dimension, datatype='float32',
    CPUPinn=False)``: the table in GPU memory, or pinned host memory with ``CPUPinn=True``.

    Args:
        model_variable: the batch-sized ``nn.Embedding`` module whose weight holds a batch's rows.
        total_classes, embed_dimension: the full table's rows and columns.
        datatype: the table's dtype, a name (``'float32'``) or a ``torch.dtype``.
        CPUPinn: pinned host memory (ordinary host memory without a GPU), not GPU memory.

    Example::

        model = torch.nn.ModuleDict({"u": torch.nn.Embedding(2, 64)})  # batch-sized
        mf = ModelFactory(model.u, total_classes=1000, embed_dimension=64, CPUPinn=True)
        mf.uniformDistributionInit(-0.1, 0.1); mf.beforeForwardPass(np.array([[3, 7]]))
    """

    _attr = "CUPYcorpus"

    def __init__(self, model_variable, total_classes, embed_dimension, datatype="float32",
                 CPUPinn=False):
        super().__init__(model_variable, total_classes, embed_dimension, datatype,
                         _pin_or_gpu(CPUPinn))
        self.CPUPinn = CPUPinn


class OptimizerFactory(_OptimizerSwitcher):
    """``OptimizerFactory(given_optimizer, total_classes, embed_dimension, model, variable_name,
    dtype='float32', CPUPinn=False)``: one state table per entry of ``optVarList``.

    Args:
        given_optimizer: a torch optimizer holding the embedding's weight.
        model, variable_name: the model, its embedding's name in it (``'u'`` or ``'u.weight'``).
        total_classes, embed_dimension, dtype, CPUPinn: as ModelFactory's, for the state tables.

    Example::

        opt = torch.optim.Adam(model.parameters())  # state tables: exp_avg, exp_avg_sq
        of = OptimizerFactory(opt, 1000, 64, model, "u", CPUPinn=True); of.optInit()
    """

    _attr = "CUPYcorpi"

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype="float32", CPUPinn=False):
        super().__init__(given_optimizer, total_classes, embed_dimension, model, variable_name,
                         dtype, _pin_or_gpu(CPUPinn))
        self.CPUPinn = CPUPinn


class COM(_COMBase):
    """``COM(total_classes, datatype='uint32', CPUPinn=False)``. Args: ``total_classes``: the
    square table's side; ``datatype``: its dtype; ``CPUPinn``: as ModelFactory's. Example::

        com = COM(1000, CPUPinn=True); com.comInit()  # com.CUPYCom: (1000, 1000) zeros
    """

    def __init__(self, total_classes, datatype="uint32", CPUPinn=False):
        super().__init__(total_classes, datatype, _pin_or_gpu(CPUPinn))
        self.CPUPinn = CPUPinn


class DataGadget(_GadgetBase):
    """``DataGadget(fileName, CPUPinn=False)``: a ``.npy`` array in GPU or pinned memory.
    Args: ``fileName``: the file (or an array or tensor); ``CPUPinn``: as ModelFactory's. Example::

        g = DataGadget(np.ones((9, 8), "f4"), CPUPinn=True); g.gadgetInit(); g.getData([5, 2])
    """

    def gadgetInit(self) -> None:
        table = self._source()
        self._adopt(table if self.CPUPinn else table.to(cuda_or_raise("DataGadget")))


# ---- the memory-mapped family (0.1.6 CPUCupyPinned.py) --------------------------------------

class ModelFactoryMM(_ModelSwitcher):
    """``ModelFactoryMM(model_variable, total_classes, embed_dimension, diskname='variable',
    datatype='float32', CPUPinn=False)``: the table is the memory-mapped file
    ``{diskname}{n}.memmap.cpy.npy`` (first free n, in the working directory); writes reach it.
    Args: as ModelFactory's; ``diskname``: the file's stem; ``CPUPinn``: page-lock it. Example::

        mf = ModelFactoryMM(model.u, 1000, 64, "emb"); mf.zerosInit()  # emb0.memmap.cpy.npy
    """

    _attr = "CUPYmemmap"

    def __init__(self, model_variable, total_classes, embed_dimension, diskname="variable",
                 datatype="float32", CPUPinn=False):
        super().__init__(model_variable, total_classes, embed_dimension, datatype, "mmap")
        self.diskname = diskname
        self.CPUPinn = CPUPinn
        self.fileName = None

    def _new_table(self) -> Tensor:
        """A new file at every init method (as in 0.1.6)."""
        self.fileName = next_free_name(self.diskname, ".memmap.cpy.npy")
        return mmap_npy(self.fileName, (self.total_classes, self.embed_dimension),
                           self.table_dtype, self.CPUPinn)


class OptimizerFactoryMM(_OptimizerSwitcher):
    """``OptimizerFactoryMM(given_optimizer, total_classes, embed_dimension, model,
    variable_name, dtype='float32', CPUPinn=False)``: one memory-mapped file per state tensor,
    ``{variable_name}{OptimizerName}{n}.memmap{key}.cpy.npy``. Args: as OptimizerFactory's
    (``CPUPinn`` as ModelFactoryMM's). Example::

        of = OptimizerFactoryMM(opt, 1000, 64, model, "u"); of.optInit()  # uAdam0.memmap...
    """

    _attr = "CUPYmemmap"

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype="float32", CPUPinn=False):
        super().__init__(given_optimizer, total_classes, embed_dimension, model, variable_name,
                         dtype, "mmap")
        self.CPUPinn = CPUPinn
        self.diskname = variable_name + type(given_optimizer).__name__
        self.fileNames = []

    def _new_tables(self) -> list:
        stem = next_free_name(self.diskname, ".memmap.cpy.npy")[: -len(".memmap.cpy.npy")]
        self.fileNames = [f"{stem}.memmap{key}.cpy.npy" for key in self.optVarList]
        shape = (self.total_classes, self.embed_dimension)
        return [mmap_npy(name, shape, self.table_dtype, self.CPUPinn)
                for name in self.fileNames]


class COMMM(_COMBase):
    """``COMMM(total_classes, diskname='COM', datatype='uint32', CPUPinn=False)``.
    Args: as COM's; ``diskname``, ``CPUPinn``: as ModelFactoryMM's. Example::

        com = COMMM(100, "cooc"); com.comInit()  # cooc0.memmap.cpy.npy
    """

    def __init__(self, total_classes, diskname="COM", datatype="uint32", CPUPinn=False):
        super().__init__(total_classes, datatype, "mmap")
        self.diskname = diskname
        self.CPUPinn = CPUPinn

    def _new_table(self) -> Tensor:
        self.fileName = next_free_name(self.diskname, ".memmap.cpy.npy")
        return mmap_npy(self.fileName, (self.total_classes, self.total_classes), self.table_dtype,
                        self.CPUPinn)


class DataGadgetMM(_GadgetBase):
    """``DataGadgetMM(fileName, CPUPinn=False)``: the ``.npy`` file itself, memory-mapped
    read-write, as the store. Args: ``fileName``: that file; ``CPUPinn``: unused. Example::

        np.save("d.npy", np.ones((9, 8), "f4")); g = DataGadgetMM("d.npy"); g.gadgetInit()
    """

    _attr = "CUPYmemmap"

    def gadgetInit(self) -> None:
        self._adopt(torch.from_numpy(np.load(self.fileName, mmap_mode="r+")))


# ---- the torch-named families (0.1.6 GPUTorch.py, CPUTorchPinned.py, GenTorch.py) ----------

class _FixedModelFactory(_ModelSwitcher):
    """GPUPytorchModelFactory / CPUPytorchModelFactory: 0.1.6's signature, a fixed placement."""

    def __init__(self, model_variable, total_classes, embed_dimension, datatype=torch.float):
        super().__init__(model_variable, total_classes, embed_dimension, datatype,
                         self._fixed_placement)
        self.dtype = self.table_dtype


class _FixedOptimizerFactory(_OptimizerSwitcher):
    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype=torch.float):
        super().__init__(given_optimizer, total_classes, embed_dimension, model, variable_name,
                         dtype, self._fixed_placement)
        self.dtype = self.table_dtype


class _FixedCOM(_COMBase):
    def __init__(self, total_classes, datatype=torch.int32):
        super().__init__(total_classes, datatype, self._fixed_placement)


class GPUPytorchModelFactory(_FixedModelFactory):
    """In GPU memory. Args: as PytorchModelFactory's without deviceType, pinType. Example::

        mf = GPUPytorchModelFactory(model.u, 1000, 64, torch.float32)  # init methods need a GPU
    """
    _attr, _fixed_placement = "pytorchGPUVar", "cuda"


class GPUPytorchOptimizerFactory(_FixedOptimizerFactory):
    """In GPU memory. Args: as PytorchOptimizerFactory's without deviceType, pinType. Example::

        of = GPUPytorchOptimizerFactory(opt, 1000, 64, model, "u")  # optInit needs a GPU
    """
    _attr, _fixed_placement = "pytorchGPUVar", "cuda"


class GPUPytorchCOM(_FixedCOM):
    """In GPU memory. Args: as PytorchCOM's without deviceType, pinType. Example::

        com = GPUPytorchCOM(1000, torch.int32)  # comInit needs a GPU
    """
    _attr, _fixed_placement = "pytorchGPUVar", "cuda"


class CPUPytorchModelFactory(_FixedModelFactory):
    """In pinned host memory. Args: as GPUPytorchModelFactory's. Example::

        mf = CPUPytorchModelFactory(model.u, 1000, 64); mf.normalDistributionInit(0.0, 0.1)
    """
    _attr, _fixed_placement = "pytorchCPUVar", "pinned"


class CPUPytorchOptimizerFactory(_FixedOptimizerFactory):
    """In pinned host memory. Args: as GPUPytorchOptimizerFactory's. Example::

        of = CPUPytorchOptimizerFactory(opt, 1000, 64, model, "u"); of.optInit()
    """
    _attr, _fixed_placement = "pytorchCPUVar", "pinned"


class CPUPytorchCOM(_FixedCOM):
    """In pinned host memory. Args: as GPUPytorchCOM's. Example::

        com = CPUPytorchCOM(1000); com.comInit()
    """
    _attr, _fixed_placement = "pytorchCPUVar", "pinned"


def _torch_placement(deviceType, pinType) -> str:
    if str(deviceType).startswith("cuda"):
        if pinType:
            raise ValueError("pinType=True needs deviceType='cpu': only host memory can be pinned")
        return "cuda"
    return "pinned" if pinType else "cpu"


class PytorchModelFactory(_ModelSwitcher):
    """The table in ``deviceType``'s memory. Args: as ModelFactory's (no ``CPUPinn``);
    ``deviceType``: ``'cuda'`` or ``'cpu'``; ``pinType``: pinned (``'cpu'`` only). Example::

        mf = PytorchModelFactory(model.u, 1000, 64, deviceType="cpu", pinType=True)
    """
    _attr = "pytorchGPUVar"

    def __init__(self, model_variable, total_classes, embed_dimension, datatype=torch.float,
                 deviceType="cuda", pinType=False):
        super().__init__(model_variable, total_classes, embed_dimension, datatype,
                         _torch_placement(deviceType, pinType))
        self.dtype, self.deviceType, self.pinType = self.table_dtype, deviceType, pinType


class PytorchOptimizerFactory(_OptimizerSwitcher):
    """The state tables in ``deviceType``'s memory. Args: as OptimizerFactory's (no
    ``CPUPinn``); ``deviceType``, ``pinType``: as PytorchModelFactory's. Example::

        of = PytorchOptimizerFactory(opt, 1000, 64, model, "u", deviceType="cpu")
    """
    _attr = "pytorchGPUVar"

    def __init__(self, given_optimizer, total_classes, embed_dimension, model, variable_name,
                 dtype=torch.float, deviceType="cuda", pinType=False):
        super().__init__(given_optimizer, total_classes, embed_dimension, model, variable_name,
                         dtype, _torch_placement(deviceType, pinType))
        self.dtype, self.deviceType, self.pinType = self.table_dtype, deviceType, pinType


class PytorchCOM(_COMBase):
    """The table in ``deviceType``'s memory. Args: as COM's (no ``CPUPinn``); ``deviceType``,
    ``pinType``: as PytorchModelFactory's. Example::

        com = PytorchCOM(1000, torch.int32, deviceType="cpu"); com.comInit()
    """
    _attr = "pytorchGPUVar"

    def __init__(self, total_classes, datatype=torch.int32, deviceType="cuda", pinType=False):
        super().__init__(total_classes, datatype, _torch_placement(deviceType, pinType))
        self.deviceType, self.pinType = deviceType, pinType
