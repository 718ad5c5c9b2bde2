"""A collection's table configs: ``TableConfig`` (one table: rows, width, pooling, the features
that read it, dtypes) and TorchRec's ``EmbeddingBagConfig`` / ``EmbeddingConfig`` taken as they
are (``from_torchrec``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import torch

from .training.hashed import check_hashed
from .training.table import FLOATING

_POOLING = ("sum", "mean", "none")


@dataclass(frozen=True)
class TableConfig:
    """One table of a collection (TorchRec's ``EmbeddingBagConfig``, in short).

    Args:
        name: the table's name (its ``state_dict`` keys start with it; no ".").
        num_embeddings, embedding_dim: its rows and their width.
        pooling: "sum", "mean" or "none" (every id's row), for HostEmbeddingBagCollection;
            HostEmbeddingCollection never pools.
        feature_names: the batch's keys that look this table up (default: ``[name]``); a
            single string is one feature name (TorchRec's config takes a list only).
        dtype: the table's weights' dtype (default: the collection's).
        state_dtype: its optimizer state's dtype (default: the collection's; None: the
            weights'), as HostEmbedding's ``state_dtype``.
        capacity: a hashed table (``num_embeddings=None``): any int64 id, at most `capacity`
            of them holding a row at once (``training/hashed.py``).
        admit_after: a hashed table's id gets a row once seen this many times (default 1);
            until then it reads zeros and its gradient is dropped (counted as
            ``"not_admitted"`` in ``cache_stats()["tables"]``).
        evict: a full hashed table's choice of the row to free: "lru" (default), "lfu", or a
            function ``(count, last_step) -> score`` (int64 tensors; the lowest goes first).
        on_evict: ``on_evict(table, ids, weights, state)``, handed each evicted row's id,
            weight and optimizer state before its row is reused (None: counted only).

    Example::

        TableConfig("item", 1_000_000, 64, pooling="mean", feature_names=["item", "seen"],
                    dtype=torch.bfloat16)
        TableConfig("user", None, 64, capacity=4_000_000, admit_after=2, evict="lfu")
    """
    name: str
    num_embeddings: Optional[int]
    embedding_dim: int
    pooling: str = "sum"
    feature_names: Sequence[str] = field(default_factory=tuple)
    dtype: Optional[torch.dtype] = None
    state_dtype: Optional[torch.dtype] = None
    capacity: Optional[int] = None
    admit_after: int = 1
    evict: Union[str, Callable] = "lru"
    on_evict: Optional[Callable] = None

    @property
    def hashed(self) -> bool:
        """Whether the table is keyed by any int64 id (built with a capacity)."""
        return self.capacity is not None

    @property
    def rows(self) -> int:
        """The rows the table holds: its num_embeddings, or a hashed table's capacity."""
        return self.capacity if self.hashed else self.num_embeddings

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name or "." in self.name:
            raise ValueError(f"TableConfig.name must be a non-empty string without '.', got "
                             f"{self.name!r}")
        if self.capacity is not None or self.num_embeddings is None:
            if self.num_embeddings is not None:
                raise ValueError(f"TableConfig {self.name!r}: a hashed table (capacity="
                                 f"{self.capacity!r}) takes num_embeddings=None, got "
                                 f"{self.num_embeddings!r}")
            if self.capacity is None:
                raise ValueError(f"TableConfig {self.name!r}: num_embeddings=None needs a "
                                 "capacity (a hashed table)")
            check_hashed(self.name, self.capacity, self.admit_after, self.evict, self.on_evict)
        elif (self.admit_after, self.evict, self.on_evict) != (1, "lru", None):
            raise ValueError(f"TableConfig {self.name!r}: admit_after, evict and on_evict "
                             "apply to a hashed table (num_embeddings=None, capacity=...)")
        keys = ("embedding_dim",) if self.hashed else ("num_embeddings", "embedding_dim")
        for key in keys:
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"TableConfig {self.name!r}: {key} must be a positive int, got "
                                 f"{value!r}")
        pooling = self.pooling
        if not isinstance(pooling, str) and isinstance(getattr(pooling, "value", None), str):
            object.__setattr__(self, "pooling", pooling.value.lower())  # TorchRec's PoolingType
        if self.pooling not in _POOLING:
            raise ValueError(f"TableConfig {self.name!r}: pooling must be one of {_POOLING}, got "
                             f"{self.pooling!r}")
        given = self.feature_names
        # A string is one name: iterating it would make a feature of each of its letters.
        names = (given,) if isinstance(given, str) else tuple(given) or (self.name,)
        if any(not isinstance(f, str) or not f for f in names):
            raise ValueError(f"TableConfig {self.name!r}: feature_names must be non-empty "
                             f"strings, got {self.feature_names!r}")
        object.__setattr__(self, "feature_names", names)
        for key in ("dtype", "state_dtype"):
            value = getattr(self, key)
            if value is not None and value not in FLOATING:
                raise TypeError(f"TableConfig {self.name!r}: {key} must be a floating dtype "
                                f"(float16, bfloat16, float32, float64) or None, got {value!r}")


# TorchRec's config fields that change what a table is, where ours has no such table: a
# config that sets one raises rather than train a plain table in its place.
_TORCHREC_UNSUPPORTED = ("num_embeddings_post_pruning", "need_pos", "input_dim",
                         "total_num_buckets", "use_virtual_table", "virtual_table_eviction_policy",
                         "enable_embedding_update", "stash_weights")
_TORCHREC_DTYPES = {"FP32": torch.float32, "FP16": torch.float16, "BF16": torch.bfloat16}


def from_torchrec(config) -> TableConfig:
    """A TorchRec ``EmbeddingBagConfig`` / ``EmbeddingConfig`` as a ``TableConfig`` (its name,
    rows, width, feature names, pooling (none for an ``EmbeddingConfig``) and float data type);
    its ``init_fn`` is the collection's to apply. A field ours has no table for raises."""
    name = getattr(config, "name", "?")
    for key in _TORCHREC_UNSUPPORTED:
        value = getattr(config, key, None)
        if value not in (None, False):
            raise NotImplementedError(f"table {name!r}: TorchRec's {key}={value!r} has no "
                                      "equivalent here")
    kind = getattr(config.data_type, "value", config.data_type)
    if kind not in _TORCHREC_DTYPES:
        raise TypeError(f"table {name!r}: data_type {config.data_type} is not a float type "
                        f"({', '.join(_TORCHREC_DTYPES)})")
    return TableConfig(name, config.num_embeddings, config.embedding_dim,
                       getattr(config, "pooling", "none"), list(config.feature_names),
                       dtype=_TORCHREC_DTYPES[kind])


def table_configs(tables) -> tuple:
    """(the ``TableConfig`` of each of `tables`, TorchRec's configs converted; {table name:
    init_fn} of those TorchRec configs that carry one). Raises unless every one is a config."""
    given = list(tables)
    configs = [t if isinstance(t, TableConfig) or not hasattr(t, "data_type")
               else from_torchrec(t) for t in given]
    if not configs or any(not isinstance(t, TableConfig) for t in configs):
        raise TypeError("tables must be a non-empty list of speedtorch_ops.TableConfig (or "
                        "TorchRec's EmbeddingBagConfig / EmbeddingConfig)")
    inits = {t.name: t.init_fn for t in given
             if not isinstance(t, TableConfig) and getattr(t, "init_fn", None) is not None}
    return configs, inits


def table_index(tables: Sequence[TableConfig], name: str) -> int:
    """The position of the table called `name` among `tables`; KeyError naming it if none."""
    for k, t in enumerate(tables):
        if t.name == name:
            return k
    raise KeyError(f"no table named {name!r}")
