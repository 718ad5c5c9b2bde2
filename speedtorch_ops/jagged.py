"""A minimal ``KeyedJaggedTensor`` in TorchRec's convention, so the collections take a jagged
batch with nothing else installed (TorchRec's own class works as it is).

A batch of ``len(keys)`` features, each with ``stride`` samples: ``lengths`` holds the ids
count of every (key, sample), key-major (all samples of ``keys[0]`` first); ``values`` the ids
in that order; ``offsets`` the exclusive prefix sums of ``lengths`` (one more entry);
``weights`` optional per-id weights (per-sample weights of a pooled feature).
"""

from __future__ import annotations

from typing import Dict, List, NamedTuple, Optional, Sequence

import torch
from torch import Tensor

from .keyed import JaggedTensor


class KeyedJaggedTensor:
    """Jagged ids of several features (see the module docstring).

    Args:
        keys: the feature names.
        values: the ids (1-D integers), key by key, sample by sample.
        lengths / offsets: one of them (1-D integers): ids per (key, sample), or their prefix
            sums starting at 0 (``len(keys) * stride + 1`` entries).
        weights: per-id weights (values' length), or None.
        stride: samples per key (default: ``len(lengths) // len(keys)``).
        length_per_key: ids per key (host ints). Given, nothing is read back from a GPU (a CUDA
            graph can capture a step that builds the batch); otherwise computed from the lengths
            on first use (one wait when they are on a GPU). Counts that contradict the lengths
            raise, naming the feature: here for lengths on the host, in the collection's check
            for lengths on a GPU.

    Example::

        kjt = KeyedJaggedTensor.from_lengths_sync(
            ["user", "item"], torch.tensor([4, 7, 7, 1, 2]), torch.tensor([2, 1, 0, 2]))
        # user: samples [4, 7], [7]; item: samples [], [1, 2]
    """

    def __init__(self, keys: Sequence[str], values: Tensor, weights: Optional[Tensor] = None,
                 lengths: Optional[Tensor] = None, offsets: Optional[Tensor] = None,
                 stride: Optional[int] = None, length_per_key: Optional[Sequence[int]] = None):
        self._keys = list(keys)
        if any(not isinstance(k, str) for k in self._keys):
            raise TypeError(f"keys must be strings, got {self._keys!r}")
        if len(set(self._keys)) != len(self._keys):
            raise ValueError(f"keys must be distinct, got {self._keys!r}")
        if not isinstance(values, Tensor) or values.dim() != 1:
            raise ValueError("values must be a 1-D tensor of ids")
        if lengths is None and offsets is None:
            raise ValueError("one of lengths and offsets is required")
        for name, t in (("lengths", lengths), ("offsets", offsets)):
            if t is not None and (not isinstance(t, Tensor) or t.dim() != 1
                                  or t.is_floating_point()):
                raise ValueError(f"{name} must be a 1-D integer tensor")
        if lengths is None:
            if offsets.numel() < 1:
                raise ValueError("offsets must hold at least one entry (0)")
            lengths = offsets[1:] - offsets[:-1]
        if offsets is None:
            offsets = torch.cat([lengths.new_zeros(1), torch.cumsum(lengths, 0)])
        if len(offsets) != len(lengths) + 1:
            raise ValueError(f"offsets must have one entry more than lengths ({len(lengths)}), "
                             f"got {len(offsets)}")
        if offsets.device.type == "cpu" and lengths.device.type == "cpu":  # no wait to check
            if len(offsets) and int(offsets[0]) != 0:
                raise ValueError(f"offsets must start at 0 (the first id of values), got "
                                 f"{int(offsets[0])}")
            if not torch.equal(offsets[1:] - offsets[:-1], lengths.to(offsets.dtype)):
                raise ValueError("lengths and offsets disagree: offsets must be the prefix sums "
                                 "of lengths")
        if stride is None:
            stride = len(lengths) // len(self._keys) if self._keys else 0
        if len(lengths) != stride * len(self._keys):
            raise ValueError(f"lengths must hold stride x len(keys) = {stride} x "
                             f"{len(self._keys)} entries, got {len(lengths)}")
        if weights is not None and (not isinstance(weights, Tensor)
                                    or weights.shape != values.shape):
            raise ValueError(f"weights must have values' shape {tuple(values.shape)}")
        if length_per_key is not None:
            length_per_key = [int(v) for v in length_per_key]
            if len(length_per_key) != len(self._keys) or sum(length_per_key) != len(values):
                raise ValueError(f"length_per_key must hold one count a key summing to "
                                 f"len(values) = {len(values)}, got {length_per_key}")
            if lengths.device.type == "cpu":  # no wait to check; on a GPU the collection does
                sums = lengths.reshape(len(self._keys), stride).sum(1).tolist()
                wrong = per_key_mismatch(self._keys, length_per_key, sums)
                if wrong:
                    raise ValueError(wrong)
        self._values, self._weights = values, weights
        self._lengths, self._offsets = lengths, offsets
        self._stride = int(stride)
        self._length_per_key = length_per_key

    @classmethod
    def from_lengths_sync(cls, keys: Sequence[str], values: Tensor, lengths: Tensor,
                          weights: Optional[Tensor] = None,
                          stride: Optional[int] = None) -> "KeyedJaggedTensor":
        return cls._synced(keys, values, weights, stride, lengths=lengths)

    @classmethod
    def from_offsets_sync(cls, keys: Sequence[str], values: Tensor, offsets: Tensor,
                          weights: Optional[Tensor] = None,
                          stride: Optional[int] = None) -> "KeyedJaggedTensor":
        return cls._synced(keys, values, weights, stride, offsets=offsets)

    @classmethod
    def _synced(cls, keys, values, weights, stride, **jagged) -> "KeyedJaggedTensor":
        """A batch whose ids per key are read now (one wait for lengths on a GPU)."""
        kjt = cls(keys, values, weights, stride=stride, **jagged)
        kjt.length_per_key()
        return kjt

    def keys(self) -> List[str]:
        return self._keys

    def values(self) -> Tensor:
        return self._values

    def lengths(self) -> Tensor:
        return self._lengths

    def offsets(self) -> Tensor:
        return self._offsets

    def weights(self) -> Tensor:
        if self._weights is None:
            raise ValueError("this KeyedJaggedTensor has no weights")
        return self._weights

    def weights_or_none(self) -> Optional[Tensor]:
        return self._weights

    def stride(self) -> int:
        return self._stride

    def length_per_key(self) -> List[int]:
        """Ids per key (host ints; computed once, with one wait for lengths on a GPU)."""
        if self._length_per_key is None:
            per = self._lengths.view(len(self._keys), self._stride).sum(1) if self._keys else \
                self._lengths.new_zeros(0)
            self._length_per_key = [int(v) for v in per.tolist()]
            if sum(self._length_per_key) != len(self._values):
                raise ValueError(f"lengths sum to {sum(self._length_per_key)}, values hold "
                                 f"{len(self._values)} ids")
        return self._length_per_key

    def lengths_or_none(self) -> Tensor:
        return self._lengths

    def offsets_or_none(self) -> Tensor:
        return self._offsets

    def stride_per_key(self) -> List[int]:
        return [self._stride] * len(self._keys)

    def variable_stride_per_key(self) -> bool:
        return False

    def inverse_indices_or_none(self) -> None:
        return None

    def device(self) -> torch.device:
        return self._values.device

    def sync(self) -> "KeyedJaggedTensor":
        self.length_per_key()
        return self

    def offset_per_key(self) -> List[int]:
        """Where each key's ids start in ``values()``, and their end (host ints)."""
        out = [0]
        for n in self.length_per_key():
            out.append(out[-1] + n)
        return out

    def _key_slices(self):
        """(key, its ids' slice of values, its samples' slice of lengths) for each key."""
        ends, s = self.offset_per_key(), self._stride
        for k, key in enumerate(self._keys):
            yield key, slice(ends[k], ends[k + 1]), slice(k * s, (k + 1) * s)

    def to_dict(self) -> Dict[str, JaggedTensor]:
        """Each key's ids as a ``JaggedTensor`` (values, lengths and weights are views)."""
        return {key: self._jagged(ids, samples) for key, ids, samples in self._key_slices()}

    def __getitem__(self, key: str) -> JaggedTensor:
        if key not in self._keys:
            raise KeyError(f"no key {key!r} (keys: {self._keys})")
        return self._jagged(*next(s for s in self._key_slices() if s[0] == key)[1:])

    def _jagged(self, ids: slice, samples: slice) -> JaggedTensor:
        """One key's ids (`ids` of values) and its samples' lengths as a ``JaggedTensor``."""
        weights = self._weights
        return JaggedTensor(self._values[ids], None if weights is None else weights[ids],
                            lengths=self._lengths[samples])

    def _with(self, keys, values, weights, lengths, length_per_key) -> "KeyedJaggedTensor":
        return KeyedJaggedTensor(keys, values, weights, lengths=lengths, stride=self._stride,
                                 length_per_key=length_per_key)

    def split(self, segments: Sequence[int]) -> List["KeyedJaggedTensor"]:
        """Batches of the next ``segments[i]`` keys each, in order."""
        if sum(segments) != len(self._keys) or any(n < 0 for n in segments):
            raise ValueError(f"segments must be counts of keys summing to {len(self._keys)}, "
                             f"got {list(segments)}")
        parts, start = [], 0
        for n in segments:
            parts.append(self.permute(list(range(start, start + n))))
            start += n
        return parts

    def permute(self, indices: Sequence[int]) -> "KeyedJaggedTensor":
        """The keys at `indices`, in that order (each at most once; others left out)."""
        jts, counts = self.to_dict(), self.length_per_key()
        keys = [self._keys[i] for i in indices]
        if not keys:
            return KeyedJaggedTensor.empty(stride=self._stride, device=self.device())
        pick = [jts[k] for k in keys]
        weights = None if self._weights is None else torch.cat([j.weights() for j in pick])
        return self._with(keys, torch.cat([j.values() for j in pick]), weights,
                          torch.cat([j.lengths() for j in pick]), [counts[i] for i in indices])

    @staticmethod
    def concat(kjts: Sequence["KeyedJaggedTensor"]) -> "KeyedJaggedTensor":
        """The keys of every batch of `kjts` (one stride) side by side."""
        kjts = list(kjts)
        if not kjts or len({k.stride() for k in kjts}) != 1:
            raise ValueError("concat: one or more batches of one stride")
        if len({k.weights_or_none() is None for k in kjts}) != 1:
            raise ValueError("concat: every batch weighted, or none")
        weights = None if kjts[0].weights_or_none() is None else torch.cat(
            [k.weights() for k in kjts])
        return kjts[0]._with([key for k in kjts for key in k.keys()],
                             torch.cat([k.values() for k in kjts]), weights,
                             torch.cat([k.lengths() for k in kjts]),
                             [n for k in kjts for n in k.length_per_key()])

    @staticmethod
    def empty(stride: int = 0, device=None, values_dtype=torch.int64,
              lengths_dtype=torch.int64) -> "KeyedJaggedTensor":
        """A batch of no keys."""
        return KeyedJaggedTensor([], torch.empty(0, dtype=values_dtype, device=device),
                                 lengths=torch.empty(0, dtype=lengths_dtype, device=device),
                                 stride=stride, length_per_key=[])

    def to(self, device, non_blocking: bool = False) -> "KeyedJaggedTensor":
        move = (lambda t: None if t is None else t.to(device, non_blocking=non_blocking))
        return self._with(self._keys, move(self._values), move(self._weights),
                          move(self._lengths), self._length_per_key)

    def pin_memory(self) -> "KeyedJaggedTensor":
        pin = (lambda t: None if t is None else t.pin_memory())
        return self._with(self._keys, pin(self._values), pin(self._weights), pin(self._lengths),
                          self._length_per_key)

    def __repr__(self) -> str:
        return (f"KeyedJaggedTensor(keys={self._keys}, stride={self._stride}, "
                f"values={len(self._values)} ids)")


def per_key_mismatch(keys: Sequence[str], length_per_key: Sequence[int],
                     sums: Sequence[int]) -> Optional[str]:
    """Why ids per key `length_per_key` contradict the lengths' sums per key `sums` (naming the
    first feature that differs), or None."""
    for key, given, counted in zip(keys, length_per_key, sums):
        if given != counted:
            return (f"length_per_key gives feature {key!r} {given} ids, its lengths sum to "
                    f"{counted}")
    return None


class JaggedBatch(NamedTuple):
    """A jagged batch's parts as a collection reads them (see ``read_batch``)."""
    keys: List[str]
    values: Tensor
    lengths: Tensor
    stride: int
    length_per_key: List[int]   # ids per key, host ints: where each key's ids are in values
    weights: Optional[Tensor]   # per-id weights, read only for a weighted collection


def read_batch(features, weighted: Optional[Dict[str, torch.dtype]] = None) -> JaggedBatch:
    """The parts of any jagged batch (this module's ``KeyedJaggedTensor``, TorchRec's, or an
    object with ``keys()``, ``values()``, ``lengths()`` and optionally ``stride()`` and
    ``length_per_key()``), their shapes checked on the host: `values` and `lengths` 1-D,
    ``stride x keys`` lengths, ids per key summing to the values. `weighted` (a weighted
    collection's features that the weights weigh, and their tables' dtypes): the batch's weights
    (``weights_or_none()``, else TorchRec's ``weights()``) are required, one a value, in each
    such table's dtype (nn.EmbeddingBag's rule) or float32 (TorchRec's weights, cast to the
    table's); None: they are not read. Errors name ``features`` and what is wrong. Whether the ids
    per key agree with the lengths needs the lengths' values: the caller checks it where it
    reads them."""
    if not all(callable(getattr(features, name, None)) for name in ("keys", "values", "lengths")):
        raise TypeError("features must be a KeyedJaggedTensor (speedtorch_ops' or TorchRec's) "
                        "or an object with keys(), values() and lengths(), got "
                        f"{type(features).__name__}")
    keys, values, lengths = list(features.keys()), features.values(), features.lengths()
    for name, t in (("values", values), ("lengths", lengths)):
        if not isinstance(t, Tensor) or t.dim() != 1:
            got = f"{t.dim()}-D" if isinstance(t, Tensor) else type(t).__name__
            raise TypeError(f"features: {name}() must be a 1-D tensor, got {got}")
    stride = int(features.stride()) if hasattr(features, "stride") else \
        len(lengths) // max(len(keys), 1)
    if stride < 0 or len(lengths) != stride * len(keys):
        raise ValueError(f"features: lengths must hold stride x keys = {stride} x {len(keys)} "
                         f"entries (keys {keys}), got {len(lengths)}")
    if hasattr(features, "length_per_key"):
        per_key = [int(n) for n in features.length_per_key()]
    else:  # one wait for lengths on a GPU
        per_key = [int(n) for n in lengths.reshape(len(keys), stride).sum(1).tolist()]
    if len(per_key) != len(keys):
        raise ValueError(f"features: length_per_key must hold a count for each of the keys "
                         f"{keys}, got {per_key}")
    if sum(per_key) != len(values):
        raise ValueError(f"features: the lengths of the keys {keys} cover {sum(per_key)} ids "
                         f"({dict(zip(keys, per_key))}), values hold {len(values)}")
    weights = None if weighted is None else _read_weights(features, len(values), weighted)
    return JaggedBatch(keys, values, lengths, stride, per_key, weights)


def _read_weights(features, count: int, weighted: Dict[str, torch.dtype]) -> Tensor:
    """A weighted collection's batch weights, checked (see ``read_batch``)."""
    for name in ("weights_or_none", "weights"):  # TorchRec's weights() raises without any
        if callable(getattr(features, name, None)):
            weights = getattr(features, name)()
            break
    else:
        weights = None
    if weights is None:
        raise ValueError("features: the collection is built with is_weighted=True: the batch "
                         "must carry weights (weights_or_none() or weights())")
    if not isinstance(weights, Tensor) or tuple(weights.shape) != (count,):
        got = tuple(weights.shape) if isinstance(weights, Tensor) else type(weights).__name__
        raise ValueError(f"features: weights must be a tensor of values' shape ({count},), got "
                         f"{got}")
    for feature, dtype in weighted.items():
        if weights.dtype not in (dtype, torch.float32):
            raise TypeError(f"features: the weights of feature {feature!r} must be floating "
                            f"point in its table's dtype {dtype} (as nn.EmbeddingBag) or float32 "
                            f"(TorchRec's), got {weights.dtype}")
    return weights
