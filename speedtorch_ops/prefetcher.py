"""``Prefetcher``: a data loader's batches for a collection, each one prepared while the step
before it runs."""

from __future__ import annotations

from typing import Iterable, Iterator

_END = object()


class Prefetcher:
    """The batches of `loader`, in order, for a training loop over `collection`: it reads one
    batch ahead and names it to the collection (``prepare_next``), whose ``step()`` then checks
    that batch, lays its ids out on the device and starts loading its rows once its own update
    is queued. A loop that waits for each step (a loss printed) thus waits for the GPU while
    the host has already done the next step's host work. Batches it hands out are the loader's
    own objects; nothing is copied or changed.

    Args:
        loader: any iterable of batches (a ``DataLoader`` with ``pin_memory=True`` is the
            common case; a batch is what the collection's forward takes).
        collection: the ``HostEmbeddingBagCollection`` / ``HostEmbeddingCollection`` the
            batches go to.

    Example::

        loader = DataLoader(dataset, batch_size=None, pin_memory=True, num_workers=2)
        for kjt in so.Prefetcher(loader, ebc):
            loss = model(ebc(kjt)).sum()
            loss.backward(); ebc.step()
            print(loss.item())
    """

    def __init__(self, loader: Iterable, collection):
        if not callable(getattr(collection, "prepare_next", None)):
            raise TypeError(f"collection: a collection with prepare_next() "
                            f"(HostEmbeddingBagCollection, HostEmbeddingCollection), got "
                            f"{type(collection).__name__}")
        self.loader, self.collection = loader, collection

    def __iter__(self) -> Iterator:
        batches = iter(self.loader)
        ahead = next(batches, _END)
        while ahead is not _END:
            batch, ahead = ahead, next(batches, _END)
            if ahead is not _END:
                self.collection.prepare_next(ahead)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)
