"""The demo's embedded data: sentences with planted word clusters, generated from a fixed seed, so
learning is checkable (words of a cluster co-occur; a trained embedding puts them together)."""

from __future__ import annotations

import numpy as np
import torch


class Corpus:
    """Sentences with planted clusters, generated from a fixed seed (the embedded default data)."""

    def __init__(self, vocab: int, cluster_size: int, tokens: int, seed: int = 2019):
        rng = np.random.default_rng(seed)
        self.vocab, self.cluster_size = vocab, cluster_size
        self.cluster = rng.permutation(vocab) // cluster_size  # word -> its cluster
        members = np.argsort(self.cluster, kind="stable").reshape(-1, cluster_size)
        sentence = 12
        topics = rng.integers(0, members.shape[0], tokens // sentence)
        in_cluster = members[topics[:, None], rng.integers(0, cluster_size, (len(topics), sentence))]
        noise = np.minimum(rng.zipf(1.3, (len(topics), sentence)) - 1, vocab - 1)
        self.text = np.where(rng.random((len(topics), sentence)) < 0.8, in_cluster, noise)
        counts = np.bincount(self.text.ravel(), minlength=vocab).astype(np.float64) + 1
        self.negative_weights = torch.from_numpy(counts ** 0.75 / (counts ** 0.75).sum())
        self.rng = rng

    def batch(self, size: int, negatives: int, window: int = 3):
        """(centres (B,1), contexts (B,1), negatives (B,N)) as int32 NumPy arrays."""
        rows = self.rng.integers(0, self.text.shape[0], size)
        cols = self.rng.integers(0, self.text.shape[1], size)
        shift = self.rng.integers(1, window + 1, size) * self.rng.choice([-1, 1], size)
        ctx_cols = np.clip(cols + shift, 0, self.text.shape[1] - 1)
        ctx_cols = np.where(ctx_cols == cols, (cols + 1) % self.text.shape[1], ctx_cols)
        negs = torch.multinomial(self.negative_weights, size * negatives, replacement=True)
        return (self.text[rows, cols].reshape(size, 1).astype(np.int32),
                self.text[rows, ctx_cols].reshape(size, 1).astype(np.int32),
                negs.numpy().reshape(size, negatives).astype(np.int32))
