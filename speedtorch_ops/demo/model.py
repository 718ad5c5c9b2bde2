"""The demo's model (skip-gram with negative sampling over batch-sized embeddings) and its
quality score (nearest-neighbour precision against the planted clusters)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn


class SkipGram(nn.Module):
    """Batch-sized embeddings: called with slot numbers (variableTransformer), not word ids.

    The lookups use ``index_select`` on the embeddings' weights: its backward adds into the
    gradient without reading anything back to the host, while nn.Embedding's dense CUDA backward
    waits for the GPU once per call (a count read back), which would stop the host from queueing
    the next step's transfers ahead. Same values, same gradients."""

    def __init__(self, u_rows: int, v_rows: int, dim: int, sparse: bool = False):
        super().__init__()
        self.u_embeddings = nn.Embedding(u_rows, dim, sparse=sparse)
        self.v_embeddings = nn.Embedding(v_rows, dim, sparse=sparse)

    @staticmethod
    def _lookup(embedding: nn.Embedding, slots: Tensor) -> Tensor:
        if embedding.sparse:
            return embedding(slots)
        return embedding.weight.index_select(0, slots.reshape(-1)).view(*slots.shape, -1)

    def forward(self, centre, context, negatives):
        return skipgram_loss(self._lookup(self.u_embeddings, centre),
                             self._lookup(self.v_embeddings, context),
                             self._lookup(self.v_embeddings, negatives))


def skipgram_loss(u: Tensor, context: Tensor, negatives: Tensor) -> Tensor:
    """Negative sampling's loss from the centre rows u (B, 1, D), the context rows (B, 1, D) and
    the negatives' rows (B, N, D)."""
    pos = (u * context).sum(-1)                                          # (B, 1)
    neg = (u * negatives).sum(-1)                                        # (B, N)
    return -(nn.functional.logsigmoid(pos).mean() + nn.functional.logsigmoid(-neg).sum(1).mean())


def neighbour_precision(table: torch.Tensor, cluster: np.ndarray, candidates: np.ndarray,
                        sample: int = 1000, k: int = 5, seed: int = 0) -> float:
    """Share of the k nearest neighbours (cosine, among all words) of `sample` words drawn from
    `candidates` that share their cluster."""
    rng = np.random.default_rng(seed)
    words = rng.choice(candidates, min(sample, len(candidates)), replace=False)
    emb = torch.nn.functional.normalize(table.float(), dim=1)
    hits = 0
    for chunk in np.array_split(words, max(1, len(words) // 256)):
        sims = emb[torch.from_numpy(chunk)] @ emb.T
        sims[torch.arange(len(chunk)), torch.from_numpy(chunk)] = -2  # not itself
        top = sims.topk(k, dim=1).indices.numpy()
        hits += (cluster[top] == cluster[chunk][:, None]).sum()
    return hits / (len(words) * k)
