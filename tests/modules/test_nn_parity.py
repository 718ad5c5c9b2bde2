"""HostEmbedding and HostEmbeddingBag against nn.Embedding / nn.EmbeddingBag (float64): nn's
options trained side by side, every bad input of a bag (an error, nothing written, the module
still usable), recovery after an exception mid-step, checkpoints (strict=False, in-place loads
with torch.distributed.checkpoint, its state-dict helpers, safetensors), dtype conversions,
parameter counting and gradient clipping, and torch.compile with changing id counts (a
subprocess: the crash this guards against killed the interpreter). CUDA cases run on the GPU
machine (scripts/gpu_check.sh)."""

import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import speedtorch_ops as so
from conftest import HAS_CUDA

ROWS, DIM = 30, 4
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])


def _init(gen, rows=ROWS):
    return torch.randn(rows, DIM, dtype=torch.float64, generator=gen)


def _ids(gen, shape, rows=ROWS, pad=None):
    ids = torch.randint(0, rows, shape, generator=gen)
    if pad is not None:  # the padding row often, and repeated
        ids = torch.where(torch.rand(shape, generator=gen) < 0.3, torch.tensor(pad % rows), ids)
    return ids


def _train_pair(ours, ref, batches, device, lr=0.1):
    """Train `ours` and the nn module `ref` (SGD, the full table) on the same batches: each
    batch is a tuple of forward arguments. Outputs must agree at every step."""
    opt = torch.optim.SGD(ref.parameters(), lr=lr)
    for args in batches:
        moved = [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]
        out, want = ours(*moved), ref(*args)
        assert torch.allclose(out.detach().cpu(), want.detach(), rtol=1e-12, atol=1e-12)
        target = torch.randn(want.shape, dtype=want.dtype, generator=torch.Generator().manual_seed(
            len(args[0]) + int(args[0].sum())))
        (out * target.to(device)).sum().backward()
        ours.step()
        opt.zero_grad()
        (want * target).sum().backward()
        opt.step()
    assert torch.allclose(ours.weight.cpu(), ref.weight.detach(), rtol=1e-12, atol=1e-12)


EMBEDDING_OPTIONS = [
    {},
    {"padding_idx": 3},
    {"padding_idx": -2},
    {"max_norm": 1.0},
    {"max_norm": 1.5, "norm_type": 1.0},
    {"scale_grad_by_freq": True},
    {"sparse": True},
    {"padding_idx": 0, "max_norm": 2.0, "scale_grad_by_freq": True},
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("options", EMBEDDING_OPTIONS, ids=str)
def test_embedding_options_train_like_nn(device, options, gen):
    init = _init(gen)
    ours = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.SGD,
                                            optimizer_kwargs={"lr": 0.1}, device=device,
                                            **options)
    ref = nn.Embedding.from_pretrained(init.clone(), freeze=False, **options)
    batches = [(_ids(gen, (5, 3), pad=options.get("padding_idx")),) for _ in range(4)]
    _train_pair(ours, ref, batches, device)


BAG_OPTIONS = [
    {},
    {"padding_idx": 3},
    {"include_last_offset": True},
    {"max_norm": 1.0},
    {"scale_grad_by_freq": True},
    {"padding_idx": 1, "include_last_offset": True, "max_norm": 1.5},
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("options", BAG_OPTIONS, ids=str)
def test_bag_options_train_like_nn(device, mode, options, gen):
    if mode == "max" and options.get("scale_grad_by_freq"):
        pytest.skip("nn refuses it (tested below)")
    init = _init(gen)
    ours = so.HostEmbeddingBag.from_pretrained(init, freeze=False, mode=mode,
                                               optimizer=torch.optim.SGD,
                                               optimizer_kwargs={"lr": 0.1}, device=device,
                                               **options)
    scaled = options.get("scale_grad_by_freq", False)
    # nn's CPU EmbeddingBag scales some rows by another row's count: the reference scales each
    # row's gradient by 1 / its count in the batch, as nn.Embedding does.
    ref = nn.EmbeddingBag.from_pretrained(init.clone(), freeze=False, mode=mode,
                                          **{**options, "scale_grad_by_freq": False})
    if scaled:
        counts = {}
        ref.weight.register_hook(lambda g: g / counts["now"].clamp(min=1).unsqueeze(1))
        forward = ref.forward

        def counting(input, *rest):
            counts["now"] = torch.bincount(input.reshape(-1), minlength=ROWS).double()
            return forward(input, *rest)
        ref.forward = counting
    pad = options.get("padding_idx")
    batches = []
    for step in range(4):
        flat = _ids(gen, (12,), pad=pad)
        offsets = torch.tensor([0, 3, 3, 7, 12] if options.get("include_last_offset")
                               else [0, 3, 3, 7])  # an empty bag
        weights = (torch.rand(12, dtype=torch.float64, generator=gen) if mode == "sum"
                   else None)
        batches.append((flat, offsets, weights))
        batches.append((_ids(gen, (3, 4), pad=pad),))  # fixed-length bags
    _train_pair(ours, ref, batches, device)


@pytest.mark.parametrize("device", DEVICES)
def test_padding_row_never_updates(device, gen):
    """Even under weight decay, which moves every touched row: the padding row's gradient is
    zero and it keeps its weight and state."""
    init = _init(gen)
    for cls in (so.HostEmbedding, so.HostEmbeddingBag):
        mod = cls.from_pretrained(init, freeze=False, padding_idx=5, optimizer=torch.optim.AdamW,
                                  optimizer_kwargs={"lr": 0.1, "weight_decay": 0.5},
                                  device=device)
        for _ in range(3):
            ids = torch.tensor([[5, 1, 5], [2, 5, 3]]).to(device)
            mod(ids).pow(2).sum().backward()
            grad = mod.step_parameters()[0].grad
            assert grad is not None and grad.abs().sum() > 0
            mod.step()
        sd = mod.state_dict()
        assert torch.equal(sd["weight"][5], init[5])
        assert torch.all(sd["optimizer.exp_avg"][5] == 0)
        assert not torch.equal(sd["weight"][1], init[1])


def test_nn_option_errors():
    with pytest.raises(ValueError, match="padding_idx"):
        so.HostEmbedding(10, 3, padding_idx=10)
    with pytest.raises(ValueError, match="padding_idx"):
        so.HostEmbedding(10, 3, padding_idx=-11)
    with pytest.raises(ValueError, match="max mode does not support scaling"):
        so.HostEmbeddingBag(10, 3, mode="max", scale_grad_by_freq=True)
    with pytest.raises(ValueError, match="max_norm"):
        so.HostEmbedding(10, 3, max_norm=-1.0)
    with pytest.raises(TypeError, match="sparse"):
        so.HostEmbedding(10, 3, sparse="yes")
    bag = so.HostEmbeddingBag(10, 3, mode="mean", device="cpu")
    with pytest.raises(NotImplementedError, match="per_sample_weights"):
        bag(torch.tensor([1, 2]), torch.tensor([0]), torch.ones(2))
    assert "mode='sum'" in repr(so.HostEmbeddingBag(10, 3, mode="sum", device="cpu"))
    assert "padding_idx=2" in repr(so.HostEmbedding(10, 3, padding_idx=2, device="cpu"))
    emb = so.HostEmbedding(10, 3, padding_idx=4, device="cpu")
    assert torch.all(emb.weight[4] == 0)  # nn's padding row starts at zero


@pytest.mark.parametrize("device", DEVICES)
def test_from_pretrained_freezes_by_default_and_keywords_work(device, gen):
    init = _init(gen)
    frozen = so.HostEmbedding.from_pretrained(init, device=device)
    ref = nn.Embedding.from_pretrained(init.clone())
    ids = _ids(gen, (6,))
    out = frozen(input=ids.to(device))
    assert not out.requires_grad and not ref(ids).requires_grad
    assert torch.equal(out.cpu(), init[ids])
    frozen.step()  # nothing staged, nothing to do
    assert torch.equal(frozen.weight.cpu(), init)
    frozen.requires_grad_(True)
    frozen(ids.to(device)).sum().backward()
    frozen.step()
    assert not torch.equal(frozen.weight.cpu(), init)
    bag = so.HostEmbeddingBag.from_pretrained(init, mode="sum", device=device)
    pooled = bag(input=ids.to(device), offsets=torch.tensor([0, 2]).to(device))
    assert not pooled.requires_grad
    assert torch.allclose(pooled.cpu(), nn.EmbeddingBag.from_pretrained(init, mode="sum")(
        ids, torch.tensor([0, 2])))


# ---- bad input of a bag: an error, nothing written, the module still usable ------------------

BAD_BAGS = {
    "offsets past the end": (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2, 5]), None, "past the end"),
    "negative offset": (torch.tensor([1, 2, 3, 4]), torch.tensor([0, -1]), None, "must not decrease"),
    "decreasing offsets": (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 3, 2]), None, "must not decrease"),
    "first offset not 0": (torch.tensor([1, 2, 3, 4]), torch.tensor([1, 2]), None, r"offsets\[0\] must be 0"),
    "float offsets": (torch.tensor([1, 2, 3, 4]), torch.tensor([0.0, 2.0]), None, "offsets must be integers"),
    "2-D offsets": (torch.tensor([1, 2, 3, 4]), torch.tensor([[0, 2]]), None, "offsets must be 1-D"),
    "offsets with 2-D input": (torch.tensor([[1, 2], [3, 4]]), torch.tensor([0, 1]), None, "offsets must be None"),
    "no offsets for 1-D input": (torch.tensor([1, 2, 3, 4]), None, None, "offsets is required"),
    "3-D input": (torch.tensor([[[1]]]), None, None, "1-D .* or 2-D"),
    "float ids": (torch.tensor([1.0, 2.0]), torch.tensor([0]), None, "integer ids"),
    "weights of another shape": (torch.tensor([1, 2, 3, 4]), torch.tensor([0, 2]), torch.ones(3), "per_sample_weights must have"),
    "id out of range": (torch.tensor([1, 2, 99, 4]), torch.tensor([0, 2]), None, "out of range"),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", sorted(BAD_BAGS))
def test_bad_bag_input_raises_writes_nothing_and_module_stays_usable(device, case, gen):
    flat, offsets, weights, message = BAD_BAGS[case]
    init = _init(gen, rows=10)
    kwargs = dict(freeze=False, mode="sum", optimizer=torch.optim.Adam,
                  optimizer_kwargs={"lr": 0.1})
    bag = so.HostEmbeddingBag.from_pretrained(init, device=device, **kwargs)
    moved = [None if t is None else t.to(device) for t in (flat, offsets, weights)]
    with pytest.raises((ValueError, TypeError, RuntimeError), match=message):
        bag(*moved)
    assert torch.equal(bag.weight.cpu(), init)
    # Usable: a good step trains exactly like a fresh module's first step.
    fresh = so.HostEmbeddingBag.from_pretrained(init, device=device, **kwargs)
    good = (torch.tensor([1, 2, 2, 7]).to(device), torch.tensor([0, 1]).to(device))
    for mod in (bag, fresh):
        mod(*good).pow(2).sum().backward()
        mod.step()
    assert torch.equal(bag.weight, fresh.weight)
    for key, value in fresh.state_dict().items():
        assert torch.equal(bag.state_dict()[key], value), key


@pytest.mark.parametrize("device", DEVICES)
def test_an_exception_mid_step_leaves_the_module_usable(device, gen):
    init = _init(gen)
    kwargs = dict(freeze=False, optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.1},
                  device=device)
    emb, fresh = (so.HostEmbedding.from_pretrained(init, **kwargs) for _ in range(2))
    ids = _ids(gen, (8,)).to(device)
    with pytest.raises(ZeroDivisionError):
        emb(ids)
        1 / 0  # the user's loss fails between the forward and step()
    other = _ids(gen, (6,)).to(device)
    for mod in (emb, fresh):  # the next forward drops the staged rows, writing nothing
        mod(other).pow(2).sum().backward()
        mod.step()
    assert torch.equal(emb.weight, fresh.weight)
    stale = emb(ids)
    emb.discard()  # explicitly
    with pytest.raises(RuntimeError, match="dropped"):
        stale.sum().backward()
    for mod in (emb, fresh):
        mod(ids).sum().backward()
        mod.step()
    for key, value in fresh.state_dict().items():
        assert torch.equal(emb.state_dict()[key], value), key


# ---- checkpoints ---------------------------------------------------------------------------

class _Model(nn.Module):
    def __init__(self, emb):
        super().__init__()
        self.emb, self.head = emb, nn.Linear(DIM, 1, dtype=torch.float64)

    def forward(self, ids):
        return self.head(self.emb(ids)).pow(2).sum()


def test_load_state_dict_strict_false_loads_what_is_there(gen):
    init = _init(gen)
    model = _Model(so.HostEmbedding(ROWS, DIM, dtype=torch.float64, optimizer=torch.optim.Adam,
                                     device="cpu"))
    plain = nn.Embedding.from_pretrained(init)
    result = model.load_state_dict({"emb.weight": plain.weight}, strict=False)
    assert torch.equal(model.emb.weight, init)
    assert "emb.optimizer.exp_avg" in result.missing_keys
    assert "head.weight" in result.missing_keys and not result.unexpected_keys
    with pytest.raises(RuntimeError, match="Missing key"):
        model.load_state_dict({"emb.weight": plain.weight})
    bad = {"emb.weight": torch.zeros(ROWS + 1, DIM, dtype=torch.float64)}
    with pytest.raises(RuntimeError, match="shape"):
        model.load_state_dict(bad, strict=False)
    assert torch.equal(model.emb.weight, init)  # nothing of the table written


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_momentum_dampening_equals_torch(device, nesterov):
    """torch's first step takes the gradient as the buffer, undamped."""
    kwargs = {"lr": 0.1, "momentum": 0.9, "dampening": 0.0 if nesterov else 0.5,
              "nesterov": nesterov, "weight_decay": 0.01}
    init = torch.ones(6, 3, dtype=torch.float64)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.SGD,
                                           optimizer_kwargs=kwargs, device=device)
    ref = nn.Embedding.from_pretrained(init.clone(), freeze=False)
    opt = torch.optim.SGD(ref.parameters(), **kwargs)
    for step in range(4):
        ids = torch.tensor([5, 0, 1, 2, 3, 4, 2])
        scale = torch.arange(7, dtype=torch.float64).unsqueeze(1) * (step + 1)
        (emb(ids.to(device)) * scale.to(device)).pow(2).sum().backward()
        emb.step()
        opt.zero_grad()
        (ref(ids) * scale).pow(2).sum().backward()
        opt.step()
        assert torch.allclose(emb.weight.cpu(), ref.weight.detach(), rtol=1e-12, atol=1e-12)
    resumed = so.HostEmbedding(6, 3, dtype=torch.float64, optimizer=torch.optim.SGD,
                               optimizer_kwargs=kwargs, device=device)
    resumed.load_state_dict(emb.state_dict())  # its buffer exists: no first step any more
    for mod in (emb, resumed):
        mod(ids.to(device)).sum().backward()
        mod.step()
    assert torch.equal(resumed.weight, emb.weight)


def _steps(model, batches):
    losses = []
    for ids in batches:
        loss = model(ids)
        loss.backward()
        model.emb.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("where", ["cpu"] + (["cuda", "cuda-cache"] if HAS_CUDA else []))
@pytest.mark.parametrize("optimizer", [torch.optim.Adam, torch.optim.SparseAdam])
def test_dcp_in_place_load_restores_every_value(where, optimizer, gen, tmp_path):
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    init = _init(gen)
    device = where.split("-")[0]
    cache = ROWS * 8 + 6 * init[0].nbytes * 3 if where.endswith("cache") else 0
    def build():
        torch.manual_seed(0)
        model = _Model(so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=optimizer,
                                                        optimizer_kwargs={"lr": 0.05},
                                                        device=device, cache_bytes=cache))
        return model.to(device)

    batches = [_ids(gen, (9,)).to(device) for _ in range(6)]
    model, plain = build(), build()
    _steps(model, batches[:2])
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path))
    after = _steps(model, batches[2:])
    tol = 0 if device == "cpu" else 1e-9
    close = lambda a, b: all(abs(x - y) <= tol * max(1.0, abs(x)) for x, y in zip(a, b))  # noqa
    # Saving changed nothing: a model that never saved trains the same.
    assert close(after, _steps(plain, batches)[2:]), after
    want = {k: v.clone() for k, v in model.state_dict().items()}
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=str(tmp_path))  # in place: the live tables and scalars
    if cache:
        model.load_state_dict(sd)  # DCP's recipe: drops the cached copies
    got = _steps(model, batches[2:])
    assert close(got, after), (got, after)
    for key, value in model.state_dict().items():
        assert torch.allclose(value, want[key], rtol=tol, atol=tol), key


def test_dcp_state_dict_helpers_work_on_a_model_with_tables(gen):
    helpers = pytest.importorskip("torch.distributed.checkpoint.state_dict")
    init = _init(gen)
    model = _Model(so.HostEmbedding.from_pretrained(init, freeze=False,
                                                    optimizer=torch.optim.Adam, device="cpu"))
    dense = torch.optim.Adam(model.head.parameters())
    _steps(model, [_ids(gen, (9,))])
    dense.step()
    sd = helpers.get_model_state_dict(model)
    assert set(sd) == set(model.state_dict())
    model_sd, optim_sd = helpers.get_state_dict(model, dense)
    assert torch.equal(model_sd["emb.optimizer.exp_avg"], model.emb.state_dict()["optimizer.exp_avg"])
    other = _Model(so.HostEmbedding(ROWS, DIM, dtype=torch.float64, optimizer=torch.optim.Adam,
                                    device="cpu"))
    helpers.set_model_state_dict(other, {k: v.clone() for k, v in sd.items()})
    for key, value in model.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


def test_load_safetensors_fills_a_module_in_place(gen, tmp_path):
    init = _init(gen)
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.Adam,
                                           device="cpu")
    emb(_ids(gen, (9,))).pow(2).sum().backward()
    emb.step()
    saved = {k: v.clone() for k, v in emb.state_dict().items()}
    so.io.save_safetensors(emb.state_dict(), tmp_path / "emb.safetensors")
    other = so.HostEmbedding(ROWS, DIM, dtype=torch.float64, optimizer=torch.optim.Adam,
                             device="cpu")
    so.io.load_safetensors(tmp_path / "emb.safetensors", out=other.state_dict())
    for key, value in saved.items():
        assert torch.equal(other.state_dict()[key], value), key


# ---- conversions, counting, clipping -------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_dtype_conversions_convert_the_table_and_state(device, gen):
    init = _init(gen).float()
    emb = so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.Adam,
                                           optimizer_kwargs={"lr": 0.1}, device=device)
    ids = _ids(gen, (7,)).to(device)
    emb(ids).sum().backward()
    emb.step()
    before = emb.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    model = _Model(emb).double()
    assert emb.dtype == torch.float64 and emb.weight.dtype == torch.float64
    for key, value in emb.state_dict().items():
        assert value.dtype == (torch.float64 if value.dim() else before[key].dtype), key
        assert torch.equal(value.cpu(), before[key].cpu().to(value.dtype)), key
    assert emb(ids).dtype == torch.float64
    emb.discard()
    model.float()
    assert emb.dtype == torch.float32 and torch.equal(emb.weight, before["weight"].cpu())
    emb.half()
    assert emb.weight.dtype == torch.float16
    emb.to(torch.bfloat16)
    assert emb.weight.dtype == torch.bfloat16
    emb(ids).float().sum().backward()
    emb.step()  # trains after conversions; the step count carried over
    assert int(emb.state_dict()["optimizer.step"]) == 2


def test_cache_bytes_on_the_cpu_warns():
    with pytest.warns(UserWarning, match="cache_bytes"):
        so.HostEmbedding(10, 3, device="cpu", cache_bytes=1 << 20)


def _poison(shape, device):
    """Hand the allocator blocks of `shape` (float64) filled with NaN, so a gradient row that
    is left unwritten reads NaN rather than whatever zeros a block happened to hold."""
    if torch.device(device).type == "cuda":
        blocks = [torch.full(shape, float("nan"), dtype=torch.float64, device=device)
                  for _ in range(8)]
        del blocks


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("cached", [False, True])
@pytest.mark.parametrize("when", ["after", "before", "autograd"])
def test_parameter_count_and_gradient_clipping_see_the_tables(device, cached, when, gen):
    """The clip sees the whole step gradient: on a GPU the fused step's lookup leaves the
    gradient's rows past the distinct ids unwritten, and asking for the table's gradient
    (step_parameters()) after the backward zeroes them, before it (`before`: the clip's
    parameter list built first; `autograd`: torch.autograd.grad, which never fills .grad) has
    the backward write them; with a cache, the rows read in their slots."""
    if cached and device == "cpu":
        pytest.skip("the row cache needs a GPU (GPU machine)")
    init = _init(gen)
    extra = {"cache_bytes": 1 << 20} if cached else {}
    ours = _Model(so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.SGD,
                                                   optimizer_kwargs={"lr": 0.1},
                                                   device=device, **extra)).to(device)
    ref = _Model(nn.Embedding.from_pretrained(init.clone(), freeze=False))
    ref.head.load_state_dict(ours.head.state_dict())
    assert so.count_parameters(ours) == sum(p.numel() for p in ref.parameters())
    ours.emb.requires_grad_(False)
    assert so.count_parameters(ours, trainable=True) == sum(p.numel() for p in ref.head.parameters())
    ours.emb.requires_grad_(True)
    dense = torch.optim.SGD(ours.head.parameters(), lr=0.1)
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ids = _ids(gen, (11,))
    ids[:4] = ids[4]  # repeats: the step's gradient has rows past its distinct ids
    loss = ours(ids.to(device))
    ref(ids).backward()
    if when == "autograd":
        (g,) = torch.autograd.grad(loss, ours.emb.step_parameters(), retain_graph=True)
        assert torch.allclose(g.norm().cpu(), ref.emb.weight.grad.norm(), rtol=1e-12)
    params = list(ours.parameters()) + ours.emb.step_parameters() if when == "before" else None
    _poison((11, DIM), device)
    loss.backward()
    norm = (torch.nn.utils.clip_grad_norm_(params, 0.5) if params is not None
            else so.clip_grad_norm_(ours, 0.5))
    want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert torch.allclose(norm.cpu(), want, rtol=1e-12)
    ours.emb.step()
    dense.step()
    opt.step()
    assert torch.allclose(ours.emb.weight.cpu(), ref.emb.weight.detach(), rtol=1e-12, atol=1e-12)
    assert torch.allclose(ours.head.weight.cpu(), ref.head.weight.detach(), rtol=1e-12)


# ---- torch.compile ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_compiled_model_with_changing_id_counts_trains_like_eager(device):
    """A model holding tables, compiled with Inductor (dynamic=None, then dynamic=True), trained
    with a new id count every step (tracing the staging read past its buffer and crashed). A
    subprocess: a crash fails here."""
    worker = os.path.join(os.path.dirname(__file__), "compile_worker.py")
    run = subprocess.run([sys.executable, worker, device, "none", "true"], capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, (run.returncode, run.stderr[-3000:])
    assert "equal (none)" in run.stdout and "equal (true)" in run.stdout, run.stdout


@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need a CUDA GPU (scripts/gpu_check.sh)")
@pytest.mark.parametrize("mode", ["sum", "max"])
@pytest.mark.parametrize("slots", [0, 9])
def test_captured_bag_steps_with_padding_train_like_eager(mode, slots, gen):
    """The options keep a step free of host waits: a bag step with padding_idx, max_norm and
    a row cache that evicts, captured in a CUDA graph, trains like eager steps."""
    init = _init(gen)

    def build(bounds_check):
        bag = so.HostEmbeddingBag.from_pretrained(
            init, freeze=False, mode=mode, padding_idx=2, max_norm=2.5,
            optimizer=torch.optim.Adam, optimizer_kwargs={"lr": 0.05, "capturable": True},
            device="cuda", bounds_check=bounds_check,
            cache_bytes=ROWS * 8 + slots * init[0].nbytes * 3 if slots else 0)

        def train_step(ids):
            loss = bag(ids).pow(2).sum()
            loss.backward()
            bag.step()
            return loss.detach()
        return bag, train_step

    bag_e, eager = build("raise")
    bag_g, graphed = build("prechecked")
    captured = so.CapturedStep(graphed, rows=(ROWS,), warmup=2)
    for _ in range(8):
        ids = _ids(gen, (6, 3), pad=2)
        e, g = float(eager(ids.cuda())), float(captured(ids))
        assert abs(e - g) <= 1e-10 * max(1.0, abs(e))
    assert captured.graph is not None
    for key, value in bag_e.state_dict().items():
        assert torch.allclose(bag_g.state_dict()[key].to(value.device), value, rtol=1e-10,
                              atol=1e-12), key


def test_sgd_first_step_state_travels_with_checkpoints(gen, tmp_path):
    """Whether SGD's first step ran is state: an in-place load resumes exactly, and a checkpoint
    taken before any step still takes the first step undamped (as torch would)."""
    kwargs = {"lr": 0.1, "momentum": 0.9, "dampening": 0.5}
    init = _init(gen)
    batches = [_ids(gen, (9,)) for _ in range(4)]

    def make():
        return so.HostEmbedding.from_pretrained(init, freeze=False, optimizer=torch.optim.SGD,
                                                optimizer_kwargs=kwargs, device="cpu")

    def train(mod, ids_list):
        for ids in ids_list:
            mod(ids).pow(2).sum().backward()
            mod.step()

    whole, part = make(), make()
    train(whole, batches)
    train(part, batches[:2])
    so.io.save_safetensors(part.state_dict(), tmp_path / "part.safetensors")
    resumed = make()
    so.io.load_safetensors(tmp_path / "part.safetensors", out=resumed.state_dict())
    train(resumed, batches[2:])
    assert torch.equal(resumed.weight, whole.weight)

    early = make().state_dict()  # before any step
    fresh, reloaded = make(), make()
    reloaded.load_state_dict({k: v.clone() for k, v in early.items()})
    train(fresh, batches[:2])
    train(reloaded, batches[:2])
    assert torch.equal(fresh.weight, reloaded.weight)


def test_sgd_momentum_step_without_backward_changes_nothing():
    emb = so.HostEmbedding(10, 3, dtype=torch.float64, optimizer=torch.optim.SGD,
                           optimizer_kwargs={"lr": 0.1, "momentum": 0.9}, device="cpu")
    before = {k: v.clone() for k, v in emb.state_dict().items()}
    emb(torch.tensor([1, 2]))
    emb.step()  # no backward: torch's SGD skips a parameter without a gradient
    for key, value in emb.state_dict().items():
        assert torch.equal(value, before[key]), key
    emb(torch.tensor([1, 2])).sum().backward()
    emb.step()
    assert not torch.equal(emb.weight, before["weight"])


def test_load_state_dict_reports_stray_keys_and_refuses_non_tensor_tables():
    emb = so.HostEmbedding(10, 3, optimizer=torch.optim.Adam, device="cpu")
    sd = {k: v.clone() for k, v in emb.state_dict().items()}
    with pytest.raises(RuntimeError, match="Unexpected key.*bogus"):
        emb.load_state_dict({**sd, "bogus": torch.zeros(1)})
    before = emb.weight.clone()
    with pytest.raises(RuntimeError, match="optimizer.exp_avg"):
        emb.load_state_dict({**sd, "optimizer.exp_avg": 5})
    assert torch.equal(emb.weight, before)
