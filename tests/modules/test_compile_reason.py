"""torch.compile(fullgraph=True) meeting a module's eager methods says why they are eager and
where the docs are, instead of torch's bare "reason: None"."""

import pytest
import torch

import speedtorch_ops as so


@pytest.mark.parametrize("method", ["forward", "step"])
def test_fullgraph_names_the_eager_method_and_the_docs(method):
    torch._dynamo.reset()
    emb = so.HostEmbedding(50, 4, optimizer=torch.optim.SGD, optimizer_kwargs={"lr": 0.1},
                           device="cpu")
    ids = torch.tensor([1, 2, 2])
    if method == "step":
        emb(ids).sum().backward()

    def call(ids):
        if method == "forward":
            return emb(ids).sum()
        emb.step()
        return ids + 1

    compiled = torch.compile(call, fullgraph=True, backend="eager")
    with pytest.raises(Exception, match=rf"modules' {method}\(\) eagerly by design(.|\n)*"
                                        r"docs/compile\.md, 'What stays eager'"):
        compiled(ids)
    torch._dynamo.reset()


def test_the_docs_section_the_reason_names_exists():
    import os
    path = os.path.join(os.path.dirname(__file__), "..", "..", "docs", "compile.md")
    with open(path) as f:
        assert "\n## What stays eager\n" in f.read()
