"""The collections' outputs in TorchRec's types, so a TorchRec user's code reads them unchanged:
``KeyedTensor`` (a pooled collection's features side by side, ``(batch, sum of dims)``) and
``JaggedTensor`` (an unpooled feature's rows with the lengths of its samples).

Both follow TorchRec's method names. What differs: a ``KeyedTensor`` made by a collection keeps
each feature's ``(batch, dim)`` tensor and builds ``values()`` (one concatenation, made once)
only when asked, so ``kt["f"]`` and ``to_dict()`` copy nothing; a feature's tensor and
``values()`` are then distinct tensors, not views of one another.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import torch
from torch import Tensor


class KeyedTensor:
    """Dense tensors of several keys side by side along ``key_dim`` (TorchRec's KeyedTensor).

    Args:
        keys: the keys (feature names), in order.
        length_per_key: each key's width along ``key_dim``.
        values: the tensor holding them all.
        key_dim: the dimension the keys lie along (1: ``(batch, sum of widths)``).

    Example::

        kt = KeyedTensor.from_tensor_list(["user", "item"], [torch.ones(2, 4), torch.zeros(2, 8)])
        kt.values().shape      # (2, 12)
        kt["item"].shape       # (2, 8)
        kt.offset_per_key()    # [0, 4, 12]
    """

    def __init__(self, keys: Sequence[str], length_per_key: Sequence[int], values: Tensor,
                 key_dim: int = 1):
        self._keys = list(keys)
        self._lengths = [int(n) for n in length_per_key]
        if len(self._lengths) != len(self._keys):
            raise ValueError(f"length_per_key has {len(self._lengths)} entries for "
                             f"{len(self._keys)} keys")
        if not isinstance(values, Tensor) or values.shape[key_dim] != sum(self._lengths):
            raise ValueError(f"values must be a tensor of size {sum(self._lengths)} along "
                             f"key_dim={key_dim}")
        self._values: Optional[Tensor] = values
        self._parts: Optional[List[Tensor]] = None
        self._key_dim = key_dim

    @classmethod
    def from_tensor_list(cls, keys: Sequence[str], tensors: Sequence[Tensor], key_dim: int = 1,
                         cat_dim: int = 1) -> "KeyedTensor":
        """The tensors of ``keys`` side by side along ``cat_dim`` (the key dimension); the
        concatenation is made when ``values()`` is first called."""
        keys, tensors = list(keys), list(tensors)
        if len(keys) != len(tensors):
            raise ValueError(f"{len(tensors)} tensors for {len(keys)} keys")
        if key_dim != cat_dim:
            raise ValueError(f"key_dim ({key_dim}) and cat_dim ({cat_dim}) must agree")
        kt = cls.__new__(cls)
        kt._keys, kt._key_dim = keys, key_dim
        kt._lengths = [t.shape[key_dim] for t in tensors]
        kt._values, kt._parts = None, tensors
        return kt

    def keys(self) -> List[str]:
        return self._keys

    def key_dim(self) -> int:
        return self._key_dim

    def length_per_key(self) -> List[int]:
        return self._lengths

    def offset_per_key(self) -> List[int]:
        out = [0]
        for n in self._lengths:
            out.append(out[-1] + n)
        return out

    def values(self) -> Tensor:
        if self._values is None:
            parts = self._parts
            self._values = parts[0] if len(parts) == 1 else torch.cat(parts, self._key_dim)
        return self._values

    def __getitem__(self, key: str) -> Tensor:
        try:
            k = self._keys.index(key)
        except ValueError:
            raise KeyError(f"no key {key!r} (keys: {self._keys})") from None
        if self._parts is not None:
            return self._parts[k]
        start = sum(self._lengths[:k])
        return self._values.narrow(self._key_dim, start, self._lengths[k])

    def to_dict(self) -> Dict[str, Tensor]:
        return {key: self[key] for key in self._keys}

    def __iter__(self):
        raise TypeError("a KeyedTensor is not iterable: keys(), values() (the (batch, sum of "
                        "dims) tensor) or to_dict()")

    @staticmethod
    def regroup(keyed_tensors: Sequence["KeyedTensor"], groups: Sequence[Sequence[str]]
                ) -> List[Tensor]:
        """One tensor per group of keys: the keys' tensors (from any of `keyed_tensors`) side
        by side along their key dimension, in the group's order."""
        if not keyed_tensors:
            raise ValueError("regroup: no keyed tensors")
        found: Dict[str, Tensor] = {}
        for kt in keyed_tensors:
            found.update(kt.to_dict())
        dim = keyed_tensors[0].key_dim()
        out = []
        for group in groups:
            missing = [k for k in group if k not in found]
            if missing:
                raise KeyError(f"regroup: no keyed tensor holds {missing}")
            out.append(torch.cat([found[k] for k in group], dim))
        return out

    @staticmethod
    def regroup_as_dict(keyed_tensors: Sequence["KeyedTensor"],
                        groups: Sequence[Sequence[str]], keys: Sequence[str]
                        ) -> Dict[str, Tensor]:
        """``regroup``'s tensors by the names in `keys` (one a group)."""
        if len(keys) != len(groups):
            raise ValueError(f"{len(keys)} names for {len(groups)} groups")
        return dict(zip(keys, KeyedTensor.regroup(keyed_tensors, groups)))

    def __repr__(self) -> str:
        return (f"KeyedTensor(keys={self._keys}, length_per_key={self._lengths}, "
                f"key_dim={self._key_dim})")


class JaggedTensor:
    """Rows of a batch's samples, each sample a run of them (TorchRec's JaggedTensor).

    Args:
        values: the rows, sample by sample (first dimension: every id of the batch).
        lengths / offsets: one of them, or both: rows per sample, or their prefix sums
            starting at 0 (one more entry).
        weights: per-row weights, or None.

    Example::

        jt = JaggedTensor(torch.arange(6.).view(3, 2), lengths=torch.tensor([2, 0, 1]))
        jt.to_dense()   # [rows 0-1, no rows, row 2]
    """

    def __init__(self, values: Tensor, weights: Optional[Tensor] = None,
                 lengths: Optional[Tensor] = None, offsets: Optional[Tensor] = None):
        if lengths is None and offsets is None:
            raise ValueError("one of lengths and offsets is required")
        self._values, self._weights = values, weights
        self._lengths, self._offsets = lengths, offsets

    def values(self) -> Tensor:
        return self._values

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError("this JaggedTensor has no weights (weights_or_none())")
        return self._weights

    def weights_or_none(self) -> Optional[Tensor]:
        return self._weights

    def lengths(self) -> Tensor:
        if self._lengths is None:
            self._lengths = self._offsets[1:] - self._offsets[:-1]
        return self._lengths

    def lengths_or_none(self) -> Optional[Tensor]:
        return self._lengths

    def offsets(self) -> Tensor:
        if self._offsets is None:
            lengths = self._lengths
            self._offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        return self._offsets

    def offsets_or_none(self) -> Optional[Tensor]:
        return self._offsets

    def to_dense(self) -> List[Tensor]:
        """Each sample's rows (a list of tensors; waits for lengths on a GPU)."""
        return list(torch.split(self._values, self.lengths().tolist()))

    def to_padded_dense(self, desired_length: Optional[int] = None,
                        padding_value: float = 0.0) -> Tensor:
        """``(samples, length, *row)``: each sample's rows, cut or padded to `desired_length`
        (default: the longest sample) with `padding_value`."""
        rows = self.to_dense()
        length = desired_length if desired_length is not None else max(
            (r.shape[0] for r in rows), default=0)
        out = self._values.new_full((len(rows), length, *self._values.shape[1:]), padding_value)
        for i, r in enumerate(rows):
            n = min(length, r.shape[0])
            out[i, :n] = r[:n]
        return out

    def to(self, device, non_blocking: bool = False) -> "JaggedTensor":
        move = (lambda t: None if t is None else t.to(device, non_blocking=non_blocking))
        return JaggedTensor(move(self._values), move(self._weights), move(self._lengths),
                            move(self._offsets))

    def __repr__(self) -> str:
        return f"JaggedTensor(values={tuple(self._values.shape)}, samples={self.lengths().numel()})"


def collection_outputs(features, rows: Dict[str, Tensor], lengths: Tensor, stride: int,
                       at: dict):
    """A collection's forward result from each feature's output `rows` (``features``: each
    with ``name`` and ``pooling``, in output order): every feature pooled, one
    ``KeyedTensor`` (an EmbeddingBagCollection's); otherwise a dict by feature (an
    EmbeddingCollection's), an unpooled feature a ``JaggedTensor`` of its rows with its
    samples' lengths (the batch's `lengths`, key-major, ``stride`` a key; ``at[name].key``:
    each feature's key index), a pooled one its ``(stride, dim)`` tensor."""
    names = [f.name for f in features]
    if all(f.pooling != "none" for f in features):
        return KeyedTensor.from_tensor_list(names, [rows[n] for n in names])
    out: Dict[str, object] = {}
    for f in features:
        if f.pooling == "none":
            key = at[f.name].key
            out[f.name] = JaggedTensor(rows[f.name],
                                       lengths=lengths[key * stride:(key + 1) * stride])
        else:
            out[f.name] = rows[f.name]
    return out
