"""Run by test_nn_parity.py in a subprocess (a crash must fail the test, not the test runner):
a model that calls a HostEmbedding and a HostEmbeddingBag, compiled with Inductor, trained with
id counts that change every step, against the same model run eagerly. Prints "equal" when every
loss, weight and state matches, and exits 0.

    python compile_worker.py DEVICE DYNAMIC [DYNAMIC ...]   # DYNAMIC: none | true

Several DYNAMIC modes run one after another in this one process (one import of torch and
Inductor), each from a reset of Dynamo's caches.
"""

import sys

import torch

import speedtorch_ops as so

ROWS, DIM, STEPS = 100_000, 64, 4  # tracing the staging crashed at this size


def run(device: str, compiled: bool, dynamic, init: torch.Tensor):
    torch.manual_seed(0)
    emb = so.HostEmbedding(ROWS, DIM, _weight=init, optimizer=torch.optim.Adam,
                           optimizer_kwargs={"lr": 0.01}, device=device)
    bag = so.HostEmbeddingBag(1000, DIM, mode="sum", _weight=init[:1000],
                              optimizer=torch.optim.Adam, device=device)
    head = torch.nn.Linear(DIM, 1, dtype=init.dtype, device=device)
    dense = torch.optim.SGD(head.parameters(), lr=0.01)

    def model(ids, flat, offsets):
        return head(emb(ids)).pow(2).mean() + head(bag(flat, offsets)).pow(2).mean()

    if compiled:
        model = torch.compile(model, dynamic=dynamic)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(STEPS):
        ids = torch.randint(0, ROWS, (20_000 + 1_000 * step,), generator=gen).to(device)
        flat = torch.randint(0, 1000, (300 + 17 * step,), generator=gen).to(device)
        offsets = torch.arange(0, flat.numel(), 3).to(device)
        loss = model(ids, flat, offsets)
        loss.backward()
        emb.step(), bag.step(), dense.step()
        dense.zero_grad()
        losses.append(loss.item())
    return losses, emb.state_dict(), bag.state_dict(), head.state_dict()


def main() -> None:
    device = sys.argv[1]
    init = torch.randn(ROWS, DIM, generator=torch.Generator().manual_seed(2))
    eager = run(device, False, None, init)
    for mode in sys.argv[2:]:
        torch._dynamo.reset()  # each mode compiles from nothing
        compiled = run(device, True, {"none": None, "true": True}[mode], init)
        assert len(eager[0]) == len(compiled[0]) == STEPS
        for a, b in zip(eager[0], compiled[0]):
            assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (mode, eager[0], compiled[0])
        for sd_a, sd_b in zip(eager[1:], compiled[1:]):
            for key in sd_a:
                assert torch.allclose(sd_a[key].float(), sd_b[key].float(), rtol=1e-5,
                                      atol=1e-6), (mode, key)
        print(f"equal ({mode})")


if __name__ == "__main__":
    main()
