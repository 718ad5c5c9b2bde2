"""ShardedHostEmbedding(Bag) on 1 to 4 processes against one process training on the
concatenated batches (sharded_workers.py). gloo on the CPU in CI; the NCCL variants need two
GPUs (the 2-GPU machine: NCCL_NVLS_ENABLE=0 python -m pytest tests/distributed)."""

import secrets

import pytest

import sharded_workers as w
from dist_launch import BACKENDS, run_checkpoint_schedule, run_ranks
from speedtorch_ops.distributed import ShardedHostEmbedding


@pytest.fixture
def seed():
    """A fresh seed per test; assertion messages print it so a failure can be replayed."""
    return secrets.randbelow(2**20)


def worlds(backend, cpu_worlds):
    return cpu_worlds if backend == "gloo" else [2]


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_equals_one_process(backend, seed):
    """SGD with momentum, Adam, AdamW, Adagrad and RMSprop on 2, 3 and 4 ranks: a hot id on
    every rank, an empty batch on one rank, 37 rows (divisible by none), dim 5."""
    for world in worlds(backend, [2, 3, 4]):
        run_ranks(w.train_like_one_process, world, seed, sorted(w.OPTIMIZERS), backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bfloat16_shards_track_float64(backend, seed):
    """With the state in bfloat16 (the table's dtype) and in float32 (state_dtype)."""
    for world in worlds(backend, [2, 3]):
        run_ranks(w.bfloat16_tracks_float64, world, seed, backend=backend)
    run_ranks(w.bfloat16_tracks_float64, 2, seed, "float32", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_scale_and_a_route_group(backend, seed):
    """grad_scale=1/world equals the reference on the loss scaled by 1/world; the ids on a
    gloo group of their own (what NCCL groups get) change nothing."""
    run_ranks(w.train_like_one_process, 2, seed, ["SGD-momentum", "Adagrad"], 0.5, True,
              backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bag_and_several_id_tensors(backend, seed, tmp_path):
    run_ranks(w.bag_like_one_process, 3 if backend == "gloo" else 2, seed, str(tmp_path),
              backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_dict_routes_its_tables_together(backend, seed):
    """ShardedEmbeddingDict: an embedding and a bag of other sizes, one exchange per
    phase for both, equal to the single-process modules; one rank (no exchange) on gloo too."""
    for world in worlds(backend, [1, 2, 3]):
        run_ranks(w.dict_like_one_process, world, seed, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_id_on_one_rank_raises_on_all(backend, seed):
    run_ranks(w.bad_ids_raise_everywhere, 3 if backend == "gloo" else 2, seed, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_checkpoint_at_other_world_sizes(backend, seed, tmp_path):
    """Save at 2, load at 3, continue, save, load at 1 (NCCL: 2 -> 1 -> 2), each step equal to
    the uninterrupted reference; the first checkpoint loads into the single-process module."""
    schedule = (2, 2, 3, 3, 1) if backend == "gloo" else (2, 2, 1, 1, 2)
    first, _ = run_checkpoint_schedule(w.checkpoint_phase, seed, schedule, tmp_path, backend)
    w.load_into_single_process(first, seed, schedule, range(2, 4))


def test_needs_a_process_group():
    with pytest.raises(RuntimeError, match="init_process_group"):
        ShardedHostEmbedding(10, 4)


def test_reads_checkpoints_that_list_part_names(tmp_path):
    """Shard files written before rows could pack per-row state list one name per part; they
    still load (full_state_dict), with the world size's interleaving undone."""
    import json

    import torch
    from speedtorch_ops.distributed import full_state_dict
    table = torch.randn(5, 3, 4, dtype=torch.float64)  # 5 rows; weight, exp_avg, exp_avg_sq
    names = ["weight", "optimizer.exp_avg", "optimizer.exp_avg_sq"]
    for rank in range(2):
        torch.save({"rows": table[rank::2].clone(), "parts": names,
                    "scalars": {"optimizer.step": torch.tensor(3.0)}},
                   tmp_path / f"shard-{rank:05d}-of-00002.pt")
    (tmp_path / "meta.json").write_text(json.dumps(
        {"format": 1, "partition": "cyclic", "world_size": 2, "num_embeddings": 5}))
    sd = full_state_dict(str(tmp_path))
    for k, name in enumerate(names):
        assert torch.equal(sd[name], table[:, k]), name
    assert float(sd["optimizer.step"]) == 3.0
