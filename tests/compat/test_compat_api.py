"""The 0.1.6 API as users call it: constructors (positional order, defaults, string and torch
dtypes), inits, save/load with checks, getNumpyVersion, DataGadget, COM, the MM classes backed
by real memory-mapped files, state_dict, and a checkpoint resumed in a fresh process."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch import nn

import speedtorch_ops as so
from conftest import HAS_CUDA

STORE_DEVICE = "cuda" if HAS_CUDA else "cpu"


def test_variable_transformer_and_index_order():
    sw = so.ModelFactory(nn.Embedding(3, 2), 10, 2, CPUPinn=True)
    pos, neg = sw.variableTransformer(3, 2, 4)
    assert pos.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert neg.tolist() == [[6, 7, 8, 9], [10, 11, 12, 13], [14, 15, 16, 17]]
    assert sw.variableTransformer(2, 3).tolist() == [[0, 1, 2], [3, 4, 5]]
    # Slot i of the batch-sized module holds row ids[i]: positives flattened, then negatives.
    sw.normalDistributionInit(0.0, 1.0)
    ids_pos = np.array([[4, 1], [9, 4]], dtype=np.int32)
    ids_neg = np.array([[0], [7]], dtype=np.int64)
    sw.beforeForwardPass(ids_pos, ids_neg)
    expected = sw.CUPYcorpus[torch.tensor([4, 1, 9, 4, 0, 7])]
    assert torch.equal(sw.model_variable.weight.data.cpu(), expected)


@pytest.mark.parametrize("datatype", ["float32", torch.float32, np.float64, "float16"])
def test_inits_and_dtypes(datatype):
    emb = nn.Embedding(4, 3)
    sw = so.PytorchModelFactory(emb, 50, 3, datatype, "cpu", False)  # positional, as in 0.1.6
    sw.zerosInit()
    table = sw.pytorchGPUVar
    assert table.shape == (50, 3) and not table.any()
    sw.uniformDistributionInit(-0.5, 0.5)
    assert sw.pytorchGPUVar.abs().max() <= 0.5 and sw.pytorchGPUVar.std() > 0.1
    sw.normalDistributionInit(1.0, 0.1)
    assert abs(float(sw.pytorchGPUVar.float().mean()) - 1.0) < 0.1
    sw.customInit(nn.init.constant_, 0.25)
    assert torch.all(sw.pytorchGPUVar == 0.25)
    assert isinstance(sw.getNumpyVersion(), np.ndarray)


def test_save_load_checks_shape_and_dtype(tmp_path):
    sw = so.PytorchModelFactory(nn.Embedding(2, 4), 30, 4, torch.float32, "cpu")
    sw.normalDistributionInit(0, 1)
    saved = sw.getNumpyVersion()
    sw.saveCupy(str(tmp_path / "table"))  # NumPy appends .npy
    sw.saveTorch(str(tmp_path / "table.pt"))
    sw.zerosInit()
    sw.loadCupy(str(tmp_path / "table.npy"))
    assert np.array_equal(sw.getNumpyVersion(), saved)
    sw.zerosInit()
    sw.loadTorch(str(tmp_path / "table.pt"))
    assert np.array_equal(sw.getNumpyVersion(), saved)
    np.save(tmp_path / "wrong.npy", np.zeros((31, 4), np.float32))
    np.save(tmp_path / "wrong_dtype.npy", np.zeros((30, 4), np.float64))
    before = sw.getNumpyVersion()
    with pytest.raises(ValueError, match=r"holds \(31, 4\)"):
        sw.loadCupy(str(tmp_path / "wrong.npy"))
    with pytest.raises(ValueError, match="float64"):
        sw.loadCupy(str(tmp_path / "wrong_dtype.npy"))
    assert np.array_equal(sw.getNumpyVersion(), before), "a failed load changed the table"


def test_optimizer_state_save_load_and_state_dict(tmp_path):
    model = nn.Module()
    model.emb = nn.Embedding(6, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    fac = so.PytorchOptimizerFactory(opt, 20, 3, model, "emb", torch.float32, "cpu")
    assert fac.optVarList == ["exp_avg", "exp_avg_sq"] and fac.optimizerKey == 0
    fac.optInit()
    for t in fac.pytorchGPUVar:
        t.normal_()
    saved = fac.getNumpyVersion()
    assert saved.shape == (2, 20, 3)
    fac.saveCupy(str(tmp_path / "state.npy"))
    state = {k: v.clone() for k, v in zip(["a", "b"], fac.state_dict()["tables"])}
    fac.optInit()
    fac.loadCupy(str(tmp_path / "state.npy"))
    assert np.array_equal(fac.getNumpyVersion(), saved)
    fac.optInit()
    fac.load_state_dict({"tables": [state["a"], state["b"]]})
    assert np.array_equal(fac.getNumpyVersion(), saved)
    with pytest.raises(ValueError, match="tables"):
        fac.load_state_dict({"tables": [state["a"]]})


def test_unsupported_optimizer_and_foreign_parameter():
    model = nn.Module()
    model.emb = nn.Embedding(6, 3)
    with pytest.raises(ValueError, match="not supported"):
        so.PytorchOptimizerFactory(torch.optim.LBFGS(model.parameters()), 20, 3, model, "emb",
                                   deviceType="cpu")
    other = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="does not hold"):
        so.PytorchOptimizerFactory(torch.optim.Adam(other.parameters()), 20, 3, model,
                                   "emb.weight", deviceType="cpu")


def test_out_of_range_ids_raise_and_write_nothing():
    emb = nn.Embedding(3, 2)
    sw = so.PytorchModelFactory(emb, 10, 2, deviceType="cpu")
    sw.normalDistributionInit(0, 1)
    before = sw.getNumpyVersion()
    with pytest.raises(RuntimeError, match="out of range"):
        sw.beforeForwardPass(np.array([1, 10, 2]))
    sw.beforeForwardPass(np.array([1, 2, 3]))
    with pytest.raises(RuntimeError, match="out of range"):
        sw.afterOptimizerStep(np.array([1, -1, 3]))
    assert np.array_equal(sw.getNumpyVersion(), before)


def test_data_gadget_rows_slices_and_insert(tmp_path):
    data = np.random.default_rng().standard_normal((40, 5))  # float64 stays float64
    np.save(tmp_path / "data.npy", data)
    gadget = so.DataGadget(str(tmp_path / "data.npy"), CPUPinn=True)
    gadget.gadgetInit()
    idx = np.array([3, 0, 39, 3])
    rows = gadget.getData(idx)
    assert rows.device.type == STORE_DEVICE and rows.dtype == torch.float64
    assert np.array_equal(rows.cpu().numpy(), data[idx])
    assert np.array_equal(gadget.getData((slice(0, 6), slice(0, 3))).cpu().numpy(), data[:6, :3])
    new = torch.randn(2, 5, dtype=torch.float32, device=STORE_DEVICE)
    gadget.insertData(new, np.array([7, 8]))  # cast to the table's float64
    assert np.allclose(gadget.getNumpyVersion()[7:9], new.cpu().double().numpy())


@pytest.mark.parametrize("kind", ["numpy", "tensor"])
def test_data_gadget_takes_an_in_memory_array(kind):
    """User scripts of 0.1.6's time pass an array instead of a file name: same slicing, and the
    gadget holds its own copy (writes do not reach the caller's array)."""
    data = np.random.default_rng().standard_normal((30, 4)).astype(np.float32)
    given = data.copy() if kind == "numpy" else torch.from_numpy(data.copy())
    gadget = so.DataGadget(given, CPUPinn=True)
    gadget.gadgetInit()
    idx = np.array([5, 29, 5])
    assert np.array_equal(gadget.getData(idx).cpu().numpy(), data[idx])
    assert np.array_equal(gadget.getData(slice(2, 4)).cpu().numpy(), data[2:4])
    gadget.insertData(torch.zeros(1, 4), np.array([5]))
    assert not gadget.getNumpyVersion()[5].any()
    assert np.array_equal(np.asarray(given)[5], data[5])  # the caller's array is untouched


def test_com_classes_allocate(tmp_path):
    com = so.COM(12, CPUPinn=True)
    com.comInit()
    assert com.CUPYCom.shape == (12, 12) and com.CUPYCom.dtype == torch.uint32
    assert not com.getNumpyVersion().any()
    torch_com = so.PytorchCOM(7, torch.int32, deviceType="cpu")
    torch_com.comInit()
    assert torch_com.pytorchGPUVar.shape == (7, 7)


def test_mm_classes_are_backed_by_their_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = nn.Module()
    model.emb = nn.Embedding(4, 3)
    sw = so.ModelFactoryMM(model.emb, 25, 3, "table")
    sw.uniformDistributionInit(-1, 1)
    assert sw.fileName == "table0.memmap.cpy.npy" and os.path.exists(sw.fileName)
    ids = np.array([2, 24, 2, 9])
    sw.beforeForwardPass(ids)
    with torch.no_grad():
        model.emb.weight.add_(1.0)
    expected = sw.getNumpyVersion()
    expected[[2, 24, 9]] += 1.0
    sw.afterOptimizerStep(ids)
    on_disk = np.load(sw.fileName)  # a fresh read of the file sees the writes
    assert np.allclose(on_disk, expected)
    second = so.ModelFactoryMM(model.emb, 25, 3, "table")
    second.zerosInit()
    assert second.fileName == "table1.memmap.cpy.npy"

    opt = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.5)
    ofac = so.OptimizerFactoryMM(opt, 25, 3, model, "emb")
    ofac.optInit()
    assert ofac.fileNames == ["embAdagrad0.memmapsum.cpy.npy"]
    assert np.all(np.load(ofac.fileNames[0]) == 0.5)

    np.save("gadget.npy", np.arange(20, dtype=np.float32).reshape(10, 2))
    gadget = so.DataGadgetMM("gadget.npy")
    gadget.gadgetInit()
    gadget.insertData(torch.full((1, 2), -1.0), np.array([4]))
    assert np.load("gadget.npy")[4].tolist() == [-1.0, -1.0]
    assert gadget.getData(np.array([4, 5])).cpu().tolist() == [[-1.0, -1.0], [10.0, 11.0]]


def test_readme_example_of_0_1_6_runs_as_written():
    """The usage pattern of SpeedTorch's README and notebooks, unchanged but for the import."""
    import speedtorch_ops as SpeedTorch  # the original was `import SpeedTorch`

    device = "cuda" if HAS_CUDA else "cpu"
    batch_size, pos, neg, total = 8, 2, 3, 300
    model = nn.Module()
    model.u_embeddings = nn.Embedding(batch_size, 16).to(device)
    model.v_embeddings = nn.Embedding(batch_size * (pos + neg), 16).to(device)
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    uEmbeds = SpeedTorch.ModelFactory(model.u_embeddings, total_classes=total, embed_dimension=16,
                                      datatype="float32", CPUPinn=True)
    vEmbeds = SpeedTorch.ModelFactory(model.v_embeddings, total_classes=total, embed_dimension=16,
                                      datatype="float32", CPUPinn=True)
    uEmbeds.uniformDistributionInit(-0.01, 0.01)
    vEmbeds.normalDistributionInit(0, 0.01)
    uAdagrad = SpeedTorch.OptimizerFactory(optimizer, total, 16, model, "u_embeddings", CPUPinn=True)
    vAdagrad = SpeedTorch.OptimizerFactory(optimizer, total, 16, model, "v_embeddings", CPUPinn=True)
    uAdagrad.optInit()
    vAdagrad.optInit()
    pos_u = torch.LongTensor(uEmbeds.variableTransformer(batch_size, 1)).to(device)
    pos_v, neg_v = (torch.LongTensor(x).to(device) for x in vEmbeds.variableTransformer(batch_size, pos, neg))
    before = vEmbeds.getNumpyVersion()
    for _ in range(3):
        labels = np.random.randint(0, total, (batch_size, 1), dtype=np.int32)
        batch = np.random.randint(0, total, (batch_size, pos), dtype=np.int32)
        negs = np.random.randint(0, total, (batch_size, neg), dtype=np.int32)
        uEmbeds.beforeForwardPass(labels)
        vEmbeds.beforeForwardPass(batch, negs)
        uAdagrad.beforeForwardPass(labels)
        vAdagrad.beforeForwardPass(batch, negs)
        optimizer.zero_grad()
        u = model.u_embeddings(pos_u)
        score = (u * model.v_embeddings(pos_v)).sum(-1).sigmoid().log().sum()
        score = score + (-(u * model.v_embeddings(neg_v)).sum(-1)).sigmoid().log().sum()
        (-score).backward()
        optimizer.step()
        uEmbeds.afterOptimizerStep(labels)
        vEmbeds.afterOptimizerStep(batch, negs)
        uAdagrad.afterOptimizerStep(labels)
        vAdagrad.afterOptimizerStep(batch, negs)
    after = vEmbeds.getNumpyVersion()
    touched = np.unique(np.concatenate([batch.ravel(), negs.ravel()]))
    assert not np.allclose(after[touched], before[touched])
    assert (vAdagrad.getNumpyVersion()[0] > 0).any()  # Adagrad's sum grew for touched rows


RESUME_SCRIPT = textwrap.dedent("""
    import sys, numpy as np, torch
    from torch import nn
    import speedtorch_ops as so
    mode, path, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Module(); model.emb = nn.Embedding(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sw = so.PytorchModelFactory(model.emb, 30, 3, deviceType="cpu")
    of = so.PytorchOptimizerFactory(opt, 30, 3, model, "emb", deviceType="cpu")
    sw.normalDistributionInit(0, 1); of.optInit()
    rng = np.random.default_rng(1)
    batches = [rng.integers(0, 30, 4) for _ in range(6)]
    start = 0
    if mode == "resume":
        ck = torch.load(path)
        sw.load_state_dict(ck["table"]); of.load_state_dict(ck["state"])
        opt.load_state_dict(ck["optimizer"]); start = ck["step"]
    for step in range(start, steps):
        ids = batches[step]
        sw.beforeForwardPass(ids); of.beforeForwardPass(ids)
        opt.zero_grad(); (model.emb(torch.arange(4)) ** 2).sum().backward(); opt.step()
        sw.afterOptimizerStep(ids); of.afterOptimizerStep(ids)
    if mode == "save":
        torch.save({"table": sw.state_dict(), "state": of.state_dict(),
                    "optimizer": opt.state_dict(), "step": steps}, path)
    else:
        np.save(path + ".out.npy", np.concatenate([sw.getNumpyVersion()[None], of.getNumpyVersion()]))
""")


def test_checkpoint_resume_in_a_fresh_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RESUME_SCRIPT)
    ck = str(tmp_path / "ck.pt")
    start = lambda *args: subprocess.Popen([sys.executable, str(script), *args],
                                           cwd=os.path.dirname(__file__))
    straight = start("straight", str(tmp_path / "ref"), "6")  # uninterrupted 6 steps, beside:
    try:
        assert start("save", ck, "3").wait() == 0            # 3 steps, checkpoint
        assert start("resume", ck, "6").wait() == 0          # a fresh process: 3 more
        assert straight.wait() == 0
    finally:
        straight.kill()  # nothing if it ended
    assert np.array_equal(np.load(ck + ".out.npy"), np.load(str(tmp_path / "ref") + ".out.npy"))


def test_factory_methods_refuse_bad_input_and_write_nothing(tmp_path):
    model = nn.Module()
    model.emb = nn.Embedding(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    sw = so.PytorchModelFactory(model.emb, 20, 3, deviceType="cpu")
    of = so.PytorchOptimizerFactory(opt, 20, 3, model, "emb", deviceType="cpu")
    with pytest.raises(RuntimeError, match="no table yet"):
        sw.beforeForwardPass(np.array([1, 2]))
    sw.normalDistributionInit(0, 1)
    of.optInit()
    for t in of.pytorchGPUVar:
        t.normal_()
    table_before, state_before = sw.getNumpyVersion(), of.getNumpyVersion()
    for bad in (np.array([0, 20]), np.array([-1, 3]), np.array([1.5, 2.0])):
        with pytest.raises((RuntimeError, TypeError)):
            sw.beforeForwardPass(bad)
        with pytest.raises((RuntimeError, TypeError)):
            of.beforeForwardPass(bad)
    assert np.array_equal(sw.getNumpyVersion(), table_before)
    assert np.array_equal(of.getNumpyVersion(), state_before)

    np.save(tmp_path / "g.npy", np.arange(12, dtype=np.float32).reshape(6, 2))
    gadget = so.DataGadget(str(tmp_path / "g.npy"), CPUPinn=True)
    gadget.gadgetInit()
    before = gadget.getNumpyVersion()
    with pytest.raises(RuntimeError, match="out of range"):
        gadget.getData(np.array([1, 6]))
    with pytest.raises(RuntimeError, match="out of range"):
        gadget.insertData(torch.zeros(2, 2), np.array([1, 6]))
    with pytest.raises(RuntimeError):
        gadget.insertData(torch.zeros(3, 2), np.array([1, 2]))  # 3 rows for 2 ids
    assert np.array_equal(gadget.getNumpyVersion(), before)


def test_ids_as_torch_tensors_on_any_device(gen):
    """Ids may be NumPy arrays or torch tensors (on the CPU or the GPU)."""
    device = "cuda" if HAS_CUDA else "cpu"
    emb = nn.Embedding(4, 3)
    sw = so.PytorchModelFactory(emb, 20, 3, deviceType="cpu")
    sw.normalDistributionInit(0, 1)
    ids = torch.tensor([3, 19, 3, 0], device=device)
    sw.beforeForwardPass(ids)
    assert torch.equal(emb.weight.data, sw.pytorchGPUVar[ids.cpu()])
    with torch.no_grad():
        emb.weight.add_(1.0)
    expected = sw.getNumpyVersion()
    expected[[3, 19, 0]] += 1.0
    sw.afterOptimizerStep(ids)
    assert np.allclose(sw.getNumpyVersion(), expected)
