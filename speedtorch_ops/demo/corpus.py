"""The demo's embedded data: sentences with planted word clusters, generated from a fixed seed, so
learning is checkable (words of a cluster co-occur; a trained embedding puts them together).

Two corpora:
- ``ZipfCorpus`` (the default): word frequencies follow Zipf's law (the word of rank r, which is
  also its id, occurs ~1/(r+1) as often as the most frequent one), as natural text does; a
  cluster is a run of words of neighbouring rank (similar frequency), and a sentence's topic is
  drawn in proportion to its cluster's frequency. The ids a step touches are skewed: a GPU row
  cache of the hot rows serves most of them.
- ``Corpus`` (``--corpus uniform``): clusters of random words drawn uniformly; nothing to cache.
Negatives are drawn from the unigram distribution to the power 0.75, as word2vec does.
"""

from __future__ import annotations

import numpy as np
import torch

SENTENCE = 12


class _Sampling:
    """Batches of (centre, context, negatives) from ``self.text`` (sentences x SENTENCE)."""

    def _finish(self, rng: np.random.Generator) -> None:
        counts = np.bincount(self.text.ravel(), minlength=self.vocab).astype(np.float64) + 1
        self.counts = counts
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

    def judged_words(self, min_count: int = 50) -> np.ndarray:
        """Words seen often enough to have learnt their place (quality is measured on them)."""
        return np.flatnonzero(self.counts - 1 >= min_count)


class Corpus(_Sampling):
    """Near-uniform words: clusters of random words, topics drawn uniformly."""

    def __init__(self, vocab: int, cluster_size: int, tokens: int, seed: int = 2019):
        rng = np.random.default_rng(seed)
        self.vocab, self.cluster_size = vocab, cluster_size
        self.cluster = rng.permutation(vocab) // cluster_size  # word -> its cluster
        members = np.argsort(self.cluster, kind="stable").reshape(-1, cluster_size)
        topics = rng.integers(0, members.shape[0], tokens // SENTENCE)
        picks = rng.integers(0, cluster_size, (len(topics), SENTENCE))
        in_cluster = members[topics[:, None], picks]
        noise = np.minimum(rng.zipf(1.3, (len(topics), SENTENCE)) - 1, vocab - 1)
        self.text = np.where(rng.random((len(topics), SENTENCE)) < 0.8, in_cluster, noise)
        self._finish(rng)


class ZipfCorpus(_Sampling):
    """Zipf-distributed words (id = frequency rank) with planted clusters of neighbouring ranks."""

    def __init__(self, vocab: int, cluster_size: int, tokens: int, seed: int = 2019,
                 exponent: float = 1.0):
        rng = np.random.default_rng(seed)
        self.vocab, self.cluster_size = vocab, cluster_size
        self.cluster = np.arange(vocab) // cluster_size  # word -> its cluster
        weights = 1.0 / np.arange(1, vocab + 1) ** exponent
        cdf = np.cumsum(weights)
        cdf /= cdf[-1]
        clusters = self.cluster[-1] + 1
        cluster_p = np.bincount(self.cluster, weights=weights, minlength=clusters)
        cluster_cdf = np.cumsum(cluster_p) / cluster_p.sum()
        n = tokens // SENTENCE
        topics = np.minimum(np.searchsorted(cluster_cdf, rng.random(n)), clusters - 1)
        first = topics * cluster_size
        size = np.minimum(cluster_size, vocab - first)
        in_cluster = first[:, None] + (rng.random((n, SENTENCE)) * size[:, None]).astype(np.int64)
        noise = np.minimum(np.searchsorted(cdf, rng.random((n, SENTENCE))), vocab - 1)
        self.text = np.where(rng.random((n, SENTENCE)) < 0.8, in_cluster, noise)
        self._finish(rng)


CORPORA = {"zipf": ZipfCorpus, "uniform": Corpus}
