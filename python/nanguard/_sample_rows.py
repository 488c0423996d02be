"""Which dataset rows a batch holds: :func:`track_indices` makes a
DataLoader remember the dataset indices of each batch it yields, and the
guard (``Guard.step``, the Lightning callback) gives them to the C++ guard
(``set_sample_indices``), so that a finding that reads a batch tensor names
the dataset index of its bad row (:attr:`Finding.dataset_index`).

A yielded batch is found again by its tensors (the same objects the guard
gets), or, when they were moved (``x.to("cuda")``), by order: the oldest
batch not yet given to a guard. Only the last :data:`KEPT` batches are
remembered, by weak reference: nothing is kept alive.
"""
from __future__ import annotations

import collections
import weakref
from typing import Any, Deque, Dict, Iterator, List, Optional, Sequence, Type

import torch
from torch.utils.data import DataLoader, IterableDataset

from ._args import instance
from ._batches import named_batch_tensors

#: How many yielded batches are remembered (a loader's prefetch stays well within).
KEPT = 64


class _Yielded:
    """One batch a tracked loader yielded: its tensors (weakly) and the dataset index of each row."""

    __slots__ = ("tensors", "indices")

    def __init__(self, tensors: Sequence[torch.Tensor], indices: List[int]) -> None:
        self.tensors = [weakref.ref(t) for t in tensors]
        self.indices = indices

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        return any(ref() is t for ref in self.tensors for t in tensors)


_recent: Deque[_Yielded] = collections.deque(maxlen=KEPT)


def track_indices(loader: DataLoader) -> DataLoader:
    """Makes ``loader`` remember the dataset indices of the rows of each
    batch it yields, and returns it (the same object: Lightning's
    re-instantiation for a distributed sampler keeps it tracked).

        loader = nanguard.data.track_indices(DataLoader(dataset, batch_size=32, shuffle=True))
        for x, y in loader:
            r = guard.step(lambda x, y: loss_fn(model(x), y), x, y)
            if r.finding is not None and r.finding.dataset_index >= 0:
                print("bad sample", r.finding.dataset_index)   # dataset[1024]

    Map-style datasets only (an ``IterableDataset`` has no indices), with
    batches yielded in order (``in_order=True``, the default). A batch whose
    collate function drops rows (``firewall_collate``) no longer matches
    its indices, and is not named.

    Raises:
        TypeError: ``loader`` is not a ``torch.utils.data.DataLoader``.
        ValueError: an ``IterableDataset``, or ``in_order=False``.
    """
    where = "nanguard.data.track_indices"
    instance(where, "loader", loader, DataLoader, "a torch.utils.data.DataLoader")
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(f"{where}: the loader reads an IterableDataset, which has no indices; "
                         "track a map-style dataset (one with __getitem__ and __len__)")
    if getattr(loader, "_nanguard_tracked", False):
        return loader
    if type(loader).__iter__ is not DataLoader.__iter__:
        raise TypeError(f"{where}: {type(loader).__name__} iterates its own way (its own "
                        "__iter__), so the indices of its batches cannot be told; track a plain DataLoader")
    if not getattr(loader, "in_order", True):
        raise ValueError(f"{where}: the loader yields batches out of order (in_order=False), so "
                         "a batch's indices cannot be told; make it with in_order=True (the default)")
    loader.__class__ = _tracked_class(type(loader))
    return loader


_classes: Dict[type, type] = {}


def _tracked_class(base: Type[DataLoader]) -> type:
    """``base`` whose sampler records the indices of each batch as the
    loader's iterator draws them (in the order the batches come back,
    workers prefetching or not), and whose iterator remembers each batch
    with its indices. One class per base; the instance's layout is
    unchanged, so that its class can be swapped."""
    if base not in _classes:
        def __iter__(self: DataLoader) -> Iterator[Any]:
            pending: Deque[List[int]] = collections.deque()
            self.__dict__["_nanguard_pending"] = pending  # the iterator's draws go here (a new epoch: afresh)
            for batch in base.__iter__(self):
                if pending:
                    _remember(batch, pending.popleft())
                yield batch

        def _index_sampler(self: DataLoader) -> Any:
            return _RecordingSampler(base._index_sampler.fget(self), self)

        _classes[base] = type(base.__name__, (base,), {
            "__slots__": (), "__iter__": __iter__, "_index_sampler": property(_index_sampler),
            "__module__": base.__module__, "_nanguard_tracked": True})
    return _classes[base]


class _RecordingSampler:
    """A tracked loader's sampler (or batch sampler) that appends the
    indices of each batch it gives to the loader's queue of the epoch it
    starts (a persistent workers' iterator keeps its sampler from epoch to
    epoch: the queue is looked up at each start)."""

    def __init__(self, sampler: Any, loader: DataLoader) -> None:
        self.sampler, self.loader = sampler, loader

    def __iter__(self) -> Iterator[Any]:
        pending: Optional[Deque[List[int]]] = self.loader.__dict__.get("_nanguard_pending")
        for index in self.sampler:
            if pending is not None:
                pending.append([int(i) for i in index] if isinstance(index, (list, tuple)) else [int(index)])
            yield index

    def __len__(self) -> int:
        return len(self.sampler)


def _remember(batch: Any, indices: List[int]) -> None:
    """Keeps ``batch``'s tensors whose rows are the indices' (not a batch a
    collate function shrank)."""
    tensors = [t for t in named_batch_tensors(batch, "batch")[0] if t.dim() > 0 and t.shape[0] == len(indices)]
    if tensors:
        _recent.append(_Yielded(tensors, indices))


def indices_of(tensors: Sequence[torch.Tensor]) -> Optional[List[int]]:
    """The dataset indices of the rows of the batch whose tensors are
    ``tensors`` (one micro-batch), or None when no tracked loader yielded
    it. Found by its tensors, else by order (the oldest batch of as many
    rows not yet given); it, and the batches before it, are then forgotten."""
    if not _recent or not tensors:
        return None
    rows = next((t.shape[0] for t in tensors if t.dim() > 0), None)
    found = next((k for k, y in enumerate(_recent) if y.holds(tensors)), None)
    if found is None:
        found = next((k for k, y in enumerate(_recent) if len(y.indices) == rows), None)
    if found is None:
        return None
    for _ in range(found):
        _recent.popleft()
    return _recent.popleft().indices


def give_sample_indices(core: Any, micro_batches: Sequence[Sequence[torch.Tensor]]) -> None:
    """Tells the C++ guard ``core`` the dataset indices of each micro-batch's
    tensors that a tracked loader yielded (their findings name the bad
    row's dataset index)."""
    for tensors in micro_batches:
        indices = indices_of(tensors)
        if indices is None:
            continue
        for t in tensors:
            if t.dim() > 0 and t.shape[0] == len(indices):
                core.set_sample_indices(t, indices)
