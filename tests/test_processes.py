"""Processes: importing speedtorch_ops leaves CUDA alone; DataLoader workers (fork and spawn) run
in a program holding pinned tables (and what handing a table to spawned workers costs); a forked
child can still use CUDA. Each case runs as its own
program. On the GPU machine the tables are pinned and the parent has used CUDA before it forks."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HAS_CUDA = torch.cuda.is_available()


def run_program(tmp_path, source, *args, timeout=300):
    # A file, not `python -c`: spawned workers re-import the main module to find the dataset.
    script = tmp_path / "program.py"
    script.write_text(textwrap.dedent(source))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, str(script), *map(str, args)], capture_output=True,
                       text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout


def test_import_does_not_initialise_cuda(tmp_path):
    """Nor import Dynamo (seconds of every process, spawned DataLoader workers too): the modules
    wrap their eager methods in torch.compiler.disable at their first instance."""
    out = run_program(tmp_path, """
        import sys
        import torch
        import speedtorch_ops
        import speedtorch_ops.distributed, speedtorch_ops.io, speedtorch_ops.memory
        import speedtorch_ops.ops
        assert not torch.cuda.is_initialized()
        assert "torch._dynamo" not in sys.modules
        emb = speedtorch_ops.HostEmbedding(10, 4, device="cpu")
        assert getattr(type(emb).forward, "_torchdynamo_disable", False)
        print("OK", speedtorch_ops.__file__)
    """)
    assert out.startswith("OK " + REPO)


LOADER = """
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    import speedtorch_ops

    ROWS, DIM = 1000, 8


    class Ids(Dataset):
        '''Each item: 16 ids, and the table's rows for them when the dataset holds the table.'''

        def __init__(self, table=None):
            self.table = table

        def __len__(self):
            return 64

        def __getitem__(self, i):
            # A worker never touches CUDA (in a forked child it could not).
            assert not torch.cuda.is_initialized()
            ids = torch.randint(0, ROWS, (16,), generator=torch.Generator().manual_seed(i))
            if self.table is None:
                return ids, torch.empty(0)
            return ids, speedtorch_ops.pinned_gather(self.table, ids)  # CPU ids: CPU gather


    def main(context, read_in_worker):
        cuda = torch.cuda.is_available()
        table = speedtorch_ops.empty_pinned((ROWS, DIM), pin=cuda)
        table.copy_(torch.arange(ROWS * DIM, dtype=torch.float32).reshape(ROWS, DIM))
        expected = table.clone()
        device = "cuda" if cuda else "cpu"
        # The parent has used CUDA (and the pinned table) before the workers start.
        speedtorch_ops.pinned_gather(table, torch.arange(5, device=device))
        if context == "spawn" and read_in_worker:
            # Spawned workers get the dataset pickled, and torch pickles a CPU tensor by moving
            # its storage into shared memory: the table is copied there and is no longer pinned,
            # so the parent can only gather on the CPU afterwards.
            device = "cpu"
        # Persistent workers: the second epoch reuses them (a spawned worker imports torch).
        loader = DataLoader(Ids(table if read_in_worker else None), batch_size=4, num_workers=2,
                            multiprocessing_context=context, timeout=120,
                            persistent_workers=True)
        seen = 0
        for epoch in range(2):
            for ids, rows in loader:
                ids = ids.reshape(-1)
                got = speedtorch_ops.pinned_gather(table, ids.to(device)).cpu()
                assert torch.equal(got, expected[ids])
                if read_in_worker:
                    assert torch.equal(rows.reshape(-1, DIM), expected[ids])
                seen += ids.numel()
        print("OK", seen, table.is_pinned(), table.is_shared())


    if __name__ == "__main__":
        main(sys.argv[1], sys.argv[2] == "1")
"""


@pytest.mark.parametrize("context,read_in_worker", [("fork", False), ("spawn", False),
                                                    ("fork", True)],
                         ids=["fork-ids", "spawn-ids", "fork-rows"])
def test_dataloader_workers_beside_pinned_tables(tmp_path, context, read_in_worker):
    """Workers make ids (and, forked, read rows of the parent's table in place); the parent
    gathers. The table stays where it is, pinned on a GPU machine."""
    out = run_program(tmp_path, LOADER, context, int(read_in_worker))
    assert out.split() == ["OK", str(2 * 64 * 16), str(HAS_CUDA), "False"]


def test_spawned_workers_given_the_table_move_it_to_shared_memory(tmp_path):
    """The hazard the docs warn of: a dataset holding the table, with spawned workers, has torch
    copy the whole table into shared memory (twice its memory for a moment; unpinned after)."""
    out = run_program(tmp_path, LOADER, "spawn", 1)
    assert out.split() == ["OK", str(2 * 64 * 16), "False", "True"]


FORKED_CHILD = """
    import multiprocessing as mp
    import os
    import sys
    import torch
    import speedtorch_ops
    from speedtorch_ops import io


    def child(queue):
        # Nothing the parent did below touched CUDA, so a forked child may still start it.
        ok = not torch.cuda.is_initialized()
        if torch.cuda.is_available():
            table = speedtorch_ops.empty_pinned((100, 4)).copy_(torch.ones(100, 4))
            ok = ok and bool(speedtorch_ops.pinned_gather(table, torch.arange(3, device="cuda"))
                             .eq(1).all())
        queue.put(ok)


    if __name__ == "__main__":
        # CPU-side use of the package in the parent: tables, ops, saving and loading.
        table = speedtorch_ops.empty_pinned((100, 4), pin=False).copy_(torch.randn(100, 4))
        speedtorch_ops.pinned_gather(table, torch.arange(3))
        path = os.path.join(sys.argv[1], "t.npy")
        io.save_npy(table, path)
        io.load_npy(path, out=table)
        assert not torch.cuda.is_initialized()
        ctx = mp.get_context("fork")
        queue = ctx.Queue()
        p = ctx.Process(target=child, args=(queue,))
        p.start()
        ok = queue.get(timeout=120)
        p.join(timeout=60)
        print("OK" if ok and p.exitcode == 0 else f"FAILED {ok} {p.exitcode}")
"""


def test_forked_child_can_use_cuda_after_cpu_work_in_the_parent(tmp_path):
    assert run_program(tmp_path, FORKED_CHILD, tmp_path).split() == ["OK"]
