"""Methods that run eagerly under ``torch.compile``: what moves rows reads host state (ids,
counts), mutates views of one staging buffer and keeps Python state between calls, none of which
Dynamo can trace soundly; the model around them compiles."""

from __future__ import annotations

import torch

_EAGER = "_speedtorch_ops_eager"


def eager(fn):
    """Mark method `fn` to run eagerly under torch.compile: what moves rows reads host state
    (ids, counts), mutates views of one staging buffer and keeps Python state between calls,
    none of which Dynamo can trace soundly. ``compile_eagerly`` wraps it in
    ``torch.compiler.disable`` when its class makes its first instance."""
    setattr(fn, _EAGER, True)
    return fn


def _reason(fn) -> str:
    """What ``torch.compile(fullgraph=True)`` reports when it meets `fn`: why it runs eagerly
    and what to do instead."""
    return (f"speedtorch_ops runs its modules' {fn.__name__}() eagerly by design: it moves rows "
            "by host state (ids, counts) that Dynamo cannot trace. fullgraph=True cannot hold "
            "it: compile without fullgraph (the model around it compiles, with a graph break "
            "here), or compile the code between its calls. See docs/compile.md, 'What stays "
            "eager'")


def compile_eagerly(cls: type) -> None:
    """Wrap the ``eager`` methods of `cls` and its bases in ``torch.compiler.disable``, once:
    at a class's first instance (which comes before anything can compile a call of it), not
    at import, since ``torch.compiler.disable`` imports Dynamo, seconds of every process that
    imports the package (spawned DataLoader workers too)."""
    if cls.__dict__.get("_compile_eagerly_done"):
        return
    for klass in cls.__mro__:
        for name, value in list(vars(klass).items()):
            if getattr(value, _EAGER, None) is True:
                wrapped = torch.compiler.disable(value, recursive=True, reason=_reason(value))
                setattr(wrapped, _EAGER, "wrapped")
                setattr(klass, name, wrapped)
    cls._compile_eagerly_done = True
