"""``nanguard.data``: a fitted :class:`nanguard.Firewall` in a PyTorch input pipeline.

Two wrappers apply the firewall's own policies (``nonfinite="drop" |
"impute_median" | "nan_to_num" | "raise" | "ignore"``, ``outliers="drop" |
"clip" | "raise" | "ignore"``):

- :func:`firewall_collate` checks each collated batch: dropped rows leave
  every tensor of the batch (features and labels alike), repaired rows are
  replaced, a ``raise`` policy raises ``ValueError`` naming the row and
  column. The batch may come out smaller (or empty).
- :class:`FirewallDataset` checks each sample of a map-style dataset as it is
  read. A map-style dataset cannot return "nothing" for an index, so a
  dropped sample becomes the marker :data:`DROPPED` (``policy="skip"``,
  removed by ``FirewallDataset.collate_fn`` or :func:`firewall_collate`,
  which give None for a batch whose samples were all dropped)
  or the next sample the firewall keeps (``policy="resample"``; batches keep
  their size, a few samples are seen twice in an epoch).
- :class:`FirewallIterableDataset` does the same for an iterable (streaming)
  dataset, where a dropped sample is simply not yielded.

Counts. Both keep ``checked`` (rows), ``dropped``, ``changed`` (rows kept
with a value repaired or clipped), ``repaired`` and ``clipped`` (values),
the reasons ``nan``, ``pos_inf``, ``neg_inf``, ``outliers`` (values found)
and ``raised`` as attributes (``counts()`` gives them as a dict). They live
in shared memory, so the checks done in DataLoader worker processes
(``num_workers > 0``, which copy the wrapper) add to the counts the main
process reads. With ``event_log=`` (a path or a ``nanguard._nanguard.EventLog``,
e.g. the Guard's log) each batch or sample in which the firewall found
something adds a data event (``"action": "data"``) to the JSONL log, written
and flushed by the process that checked it (appends of one line each, so
workers and the guard can share a file). An event counts what the firewall
found and did in that batch or sample and names the rows it dropped or
repaired (``dropped_rows``, ``changed_rows``; ``row_index`` says what they
index): dataset indices from :class:`FirewallDataset`, positions in the
stream from :class:`FirewallIterableDataset`, rows of the batch from
:func:`firewall_collate`. Its
``check`` numbers the firewall's checks (its own axis, not the training
steps), and its ``checked`` holds every row the process checked since its
previous event: clean checks add an event of their own every
:data:`CLEAN_ROWS_PER_EVENT` rows, when the process exits and at
``flush()``, so the events add up to every row checked. ``nanguard report``
sums them per source and ``--tensorboard`` plots them as ``data/<count>``.

:func:`track_indices` makes a DataLoader remember the dataset indices of
each batch it yields: a guard's finding that reads a bad batch row names its
dataset index (``Finding.dataset_index``).

:func:`read_csv` reads a numeric CSV file (a header row, then numbers) into a
float64 tensor, on torch's intra-op threads.

NOTE: the firewall (a C++ object) is not picklable: DataLoader workers must
be started by ``fork`` (Linux's default up to Python 3.13; from 3.14 pass
``multiprocessing_context="fork"``), not ``spawn`` or ``forkserver``, which
are refused with a TypeError that says so.
"""
from __future__ import annotations

import json
import multiprocessing
import multiprocessing.util
import os
from collections.abc import Iterable
from typing import Any, Callable, Dict, Iterator, List, Literal, Optional, Union

import torch
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data.dataloader import default_collate

from . import _args, _nanguard
from ._sample_rows import track_indices

#: Where the features are in a sample: None (the sample itself, or element
#: 0 of a tuple or list), an index, or a dict's key.
Field = Union[int, str, None]
#: A file path.
PathLike = Union[str, "os.PathLike[str]"]

__all__ = ["read_csv", "track_indices", "FirewallDataset", "FirewallIterableDataset", "firewall_collate",
           "FirewallCollate", "DROPPED", "FIELDS"]

#: The counts of a wrapper, in the order of the C++ data event (``nanguard::data_counts``).
FIELDS = ("checked", "dropped", "changed", "repaired", "clipped", "nan", "pos_inf", "neg_inf", "outliers", "raised")

#: Rows of clean checks after which a process writes a data event of its own
#: (their ``checked``), so that the log counts the clean rows too.
CLEAN_ROWS_PER_EVENT = 4096


def read_csv(path: PathLike, delimiter: str = ",") -> "tuple[List[str], torch.Tensor]":
    """Reads a numeric CSV file with a header row into a float64 tensor.

    A missing value may be an empty cell, NA, N/A, NaN, null or None (read as
    NaN); inf, +inf, -inf and Infinity are read as ±Inf; quoted fields are
    understood. The file is parsed in pieces on ``torch.get_num_threads()``
    threads, faster than pandas' ``read_csv`` (docs/performance.md).

    Args:
        path: the file (``str`` or ``os.PathLike``).
        delimiter: the field separator, one character.

    Returns:
        ``(columns, data)``: the header's column names and a ``[rows, columns]``
        float64 tensor.

    Raises:
        OSError: the file cannot be opened.
        TypeError: ``delimiter`` is not a one-character string.
        ValueError: ``delimiter`` is not ASCII; the file is empty, a row is
            ragged or a cell is not a number (the message names the line and
            the column).
    """
    path = _args.path("nanguard.data.read_csv", "path", path)
    if not isinstance(delimiter, str) or len(delimiter) != 1:
        raise TypeError(f"nanguard.data.read_csv: delimiter must be one character such as ',' or ';' "
                        f"but is {delimiter!r}")
    if not delimiter.isascii():  # the reader splits on one byte: 'é' became byte 0xE9, never found in UTF-8
        raise ValueError(f"nanguard.data.read_csv: delimiter must be an ASCII character such as ',', ';' or "
                         f"'\\t' but is {delimiter!r}; convert the file's delimiter first")
    with open(path, "rb"):  # the OSError Python users expect, with the path and errno
        pass
    columns, data = _nanguard.read_csv(path, delimiter)
    return list(columns), data


class _Dropped:
    """The marker a FirewallDataset returns for a sample the firewall dropped."""

    def __repr__(self):
        return "nanguard.data.DROPPED"

    def __reduce__(self):  # one marker in every process
        return "DROPPED"


#: What ``FirewallDataset[i]`` returns for a dropped sample (``policy="skip"``).
DROPPED = _Dropped()


class _Counts:
    """Counts in shared memory (a lock-guarded int64 array), so that DataLoader
    workers, which get a copy of the wrapper, add to the same numbers."""

    def __init__(self):
        # One more slot: the sequence number of the data events.
        self._array = multiprocessing.Array("q", len(FIELDS) + 1)

    def add(self, counts):
        """Adds ``counts`` (a dict over FIELDS); returns the event number."""
        with self._array.get_lock():
            for i, name in enumerate(FIELDS):
                self._array[i] += int(counts.get(name, 0))
            self._array[len(FIELDS)] += 1
            return self._array[len(FIELDS)]

    def as_dict(self):
        with self._array.get_lock():
            return {name: int(self._array[i]) for i, name in enumerate(FIELDS)}

    def reset(self):
        with self._array.get_lock():
            for i in range(len(FIELDS) + 1):
                self._array[i] = 0


class _EventWriter:
    """Writes data events to an event log from whichever process checks; each
    process opens the file itself (by path, in append mode)."""

    def __init__(self, event_log):
        if event_log is None:
            self.path = None
        elif isinstance(event_log, _nanguard.EventLog):
            self.path = event_log.path
        elif isinstance(event_log, (str, os.PathLike)):
            self.path = os.fspath(event_log)
            open(self.path, "a", encoding="utf-8").close()  # unwritable: the OSError, here and now
        else:
            raise TypeError("nanguard.data: event_log must be a path or a nanguard._nanguard.EventLog, got "
                            f"{type(event_log).__name__}")
        self._log, self._pid = None, None

    def write(self, number, source, counts, rows=None):
        """One data event: check ``number`` of ``source``, its ``counts``, and
        ``rows`` (dropped, changed, "dataset" or "batch") when it names rows."""
        if self.path is None:
            return
        if self._pid != os.getpid():  # a worker's copy: its own handle
            self._log, self._pid = _nanguard.EventLog(self.path, False), os.getpid()
        data = {"source": source, "check": int(number), **{k: int(counts.get(k, 0)) for k in FIELDS}}
        if rows is not None:
            dropped, changed, index = rows
            data.update(dropped_rows=[int(r) for r in dropped], changed_rows=[int(r) for r in changed],
                        row_index=index)
        self._log.write(json.dumps({"action": "data", "data": data}))

    def __getstate__(self):
        return {"path": self.path, "_log": None, "_pid": None}


def _report_counts(report):
    """The counts of one FirewallReport."""
    columns = report.columns
    return {"checked": report.rows_in, "dropped": len(report.dropped_rows), "changed": len(report.changed_rows),
            "repaired": report.repaired, "clipped": report.clipped, "outliers": report.outliers,
            "nan": sum(c["nan"] for c in columns), "pos_inf": sum(c["pos_inf"] for c in columns),
            "neg_inf": sum(c["neg_inf"] for c in columns)}


class _PendingRows:
    """Rows a process checked since its last data event, and the number of its
    last check."""

    def __init__(self, events, source):
        self.events, self.source, self.rows, self.check = events, source, 0, 0

    def flush(self):
        if self.rows:
            self.events.write(self.check, self.source, {"checked": self.rows})
            self.rows = 0


class _Checked:
    """What both wrappers share: the firewall, the counts, the event log."""

    def _setup(self, firewall, field, event_log, source):
        where = f"nanguard.data.{source}"
        self.firewall = _args.instance(where, "firewall", firewall, _nanguard.Firewall, "a nanguard.Firewall")
        if field is not None and (isinstance(field, bool) or not isinstance(field, (int, str))):
            raise _args.wrong_type(where, "field", "None, an index or a dict's key (an int or a str)", field)
        self.field = field
        self._counts = _Counts()
        self._events = _EventWriter(event_log)
        self._source = source

    def _apply(self, x, rows):
        """(clean, report) of ``x``; a raise policy's ValueError counted, logged and raised."""
        try:
            return self.firewall.apply(x)
        except ValueError as e:
            if "under a raise policy" in str(e):  # not a wrong dtype or shape
                self._record({"checked": rows, "raised": 1}, always=True)
            raise

    def _record(self, counts, always=False, rows=None):
        """Adds ``counts`` (and ``rows``: dropped, changed, what they index);
        logs a data event when the firewall found something, or after
        CLEAN_ROWS_PER_EVENT clean rows, whose ``checked`` holds the rows this
        process checked since its previous event."""
        number = self._counts.add(counts)
        pending = self._pending_rows()
        pending.rows += int(counts.get("checked", 0))
        pending.check = number
        found = any(counts.get(k, 0) for k in FIELDS if k != "checked")
        if always or found or pending.rows >= CLEAN_ROWS_PER_EVENT:
            self._events.write(number, self._source, {**counts, "checked": pending.rows}, rows if found else None)
            pending.rows = 0

    def _pending_rows(self):
        """This process's rows checked since its last event (a worker's copy
        starts its own), written when the process ends or the wrapper goes."""
        if getattr(self, "_pending_pid", None) != os.getpid():
            self._pending_pid, self._pending = os.getpid(), _PendingRows(self._events, self._source)
            multiprocessing.util.Finalize(self, self._pending.flush, exitpriority=10)
        return self._pending

    def flush(self):
        """Writes a data event for the rows this process checked since its
        previous one, if any (DataLoader workers do it when they exit)."""
        self._pending_rows().flush()

    def __getstate__(self):
        # What a "spawn" (or "forkserver") DataLoader worker would need: the
        # C++ Firewall has no pickled form. Said here, not as pybind11's
        # "cannot pickle" about an object the user never pickled.
        raise TypeError(f"nanguard.data.{self._source}: the nanguard.Firewall it holds cannot be pickled, so "
                        "DataLoader workers cannot be started by 'spawn' or 'forkserver'; use "
                        "multiprocessing_context='fork' (Linux's default) or num_workers=0")

    def counts(self) -> Dict[str, int]:
        """Every count as a dict (all processes together)."""
        return self._counts.as_dict()

    def reset_counts(self) -> None:
        """Sets every count to 0 (e.g. at the start of an epoch)."""
        self._counts.reset()


def _count_property(name):
    return property(lambda self: self._counts.as_dict()[name], doc=f"The '{name}' count (all processes).")


for _name in FIELDS:
    setattr(_Checked, _name, _count_property(_name))


# ---------------------------------------------------------------- selecting the features
def _get(sample, field, who):
    """The tensor the firewall checks in ``sample``: the sample itself when it
    is a tensor, else ``sample[field]`` (field 0 by default for tuples and lists)."""
    if isinstance(sample, torch.Tensor) and field is None:
        return sample
    if field is None:
        if isinstance(sample, (tuple, list)):
            field = 0
        else:
            raise TypeError(f"nanguard.data.{who}: a {type(sample).__name__} sample needs field=, the key of "
                            "the features tensor the firewall checks (e.g. field='x')")
    try:
        x = sample[field]
    except (KeyError, IndexError):
        fields = list(sample.keys()) if hasattr(sample, "keys") else list(range(len(sample)))
        raise ValueError(f"nanguard.data.{who}: the sample has no field {field!r} (its fields: {fields}); pass "
                         "field= naming the features tensor") from None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"nanguard.data.{who}: the field {field!r} of the sample is a {type(x).__name__}, "
                        "not the features tensor; pass field= naming it")
    return x


def _put(sample, field, x):
    """``sample`` with its features tensor replaced by ``x``."""
    if isinstance(sample, torch.Tensor) and field is None:
        return x
    field = 0 if field is None else field
    if isinstance(sample, tuple):
        return type(sample)(*[x if i == field else v for i, v in enumerate(sample)]) if hasattr(sample, "_fields") \
            else tuple(x if i == field else v for i, v in enumerate(sample))
    if isinstance(sample, list):
        return [x if i == field else v for i, v in enumerate(sample)]
    out = dict(sample) if not hasattr(sample, "copy") else sample.copy()
    out[field] = x
    return out


def _keep_rows(value, keep, rows):
    """Every tensor (or list) of ``value`` with ``rows`` rows, reduced to the rows in ``keep``."""
    if isinstance(value, torch.Tensor):
        return value.index_select(0, keep.to(value.device)) if value.dim() > 0 and value.shape[0] == rows else value
    if isinstance(value, tuple):
        items = [_keep_rows(v, keep, rows) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        if len(value) == rows and not any(isinstance(v, (torch.Tensor, list, tuple, dict)) for v in value):
            return [value[i] for i in keep.tolist()]
        return [_keep_rows(v, keep, rows) for v in value]
    if isinstance(value, dict):
        return type(value)((k, _keep_rows(v, keep, rows)) for k, v in value.items())
    return value


# ---------------------------------------------------------------- the collate function
class FirewallCollate(_Checked):
    """A collate function that applies a fitted Firewall to each batch; made by
    :func:`firewall_collate`. Counts as attributes (``checked``, ``dropped``,
    ...; see the module's doc)."""

    def __init__(self, firewall: _nanguard.Firewall, collate_fn: Callable[[List[Any]], Any] = default_collate,
                 field: Field = None, event_log: Optional[PathLike] = None) -> None:
        self._setup(firewall, field, event_log, "firewall_collate")
        self.collate_fn = _args.callable_("nanguard.data.firewall_collate", "collate_fn", collate_fn)

    def __call__(self, samples: List[Any]) -> Any:
        samples = [s for s in samples if s is not DROPPED]
        if not samples:
            return None  # every sample of the batch was dropped by a FirewallDataset
        batch = self.collate_fn(samples)
        x = _get(batch, self.field, "firewall_collate")
        if x.dim() != 2:
            raise ValueError(f"nanguard.data.firewall_collate: the Firewall checks [batch, features] tensors; the "
                             f"collated features have shape {list(x.shape)}; flatten them in collate_fn= or "
                             "pass field= naming the [batch, features] tensor")
        rows = x.shape[0]
        clean, report = self._apply(x, rows)
        self._record(_report_counts(report), rows=(report.dropped_rows, report.changed_rows, "batch"))
        if report.dropped_rows:
            dropped = set(report.dropped_rows)
            keep = torch.tensor([i for i in range(rows) if i not in dropped], dtype=torch.long)
            batch = _keep_rows(batch, keep, rows)
        return _put(batch, self.field, clean)


def firewall_collate(firewall: _nanguard.Firewall, collate_fn: Callable[[List[Any]], Any] = default_collate,
                     field: Field = None, event_log: Optional[PathLike] = None) -> FirewallCollate:
    """A DataLoader ``collate_fn`` that collates with ``collate_fn`` then applies
    the fitted ``firewall`` to the batch's features: ``batch`` itself when it
    is a tensor, else ``batch[field]`` (field 0 for a tuple or list, e.g.
    ``(x, y)`` from a TensorDataset), a [batch, features] tensor. Rows the
    firewall drops leave every tensor of the batch whose first dimension is
    the batch (labels too); :data:`DROPPED` samples are left out first.

        fw = nanguard.Firewall(nonfinite="drop").fit(train_x)
        collate = nanguard.data.firewall_collate(fw, event_log="data.jsonl")
        loader = DataLoader(dataset, batch_size=32, collate_fn=collate, num_workers=2)
        ...
        print(collate.checked, collate.dropped, collate.counts())

    Returns a :class:`FirewallCollate` (counts as attributes).
    """
    return FirewallCollate(firewall, collate_fn, field, event_log)


# ---------------------------------------------------------------- the dataset wrapper
class FirewallDataset(_Checked, Dataset):
    """A map-style dataset whose samples pass a fitted Firewall as they are read.

        ds = nanguard.data.FirewallDataset(TensorDataset(x, y), fw)
        loader = DataLoader(ds, batch_size=32, collate_fn=ds.collate_fn, num_workers=2)

    Each sample's features (the sample when it is a tensor, else
    ``sample[field]``, field 0 for tuples and lists) is a [features] tensor,
    checked as a batch of one row. ``policy`` says what a dropped sample
    becomes: ``"skip"`` (default) the marker :data:`DROPPED`, which
    ``self.collate_fn`` (default_collate without the markers) and
    :func:`firewall_collate` leave out; ``"resample"`` the next sample (by
    index, wrapping around) that the firewall keeps, so that batches keep
    their size; an error when none is left. Counts as attributes.
    """

    POLICIES = ("skip", "resample")

    def __init__(self, dataset: Any, firewall: _nanguard.Firewall, policy: Optional[Literal["skip", "resample"]] = None,
                 field: Field = None, event_log: Optional[PathLike] = None) -> None:
        policy = "skip" if policy is None else _args.text("nanguard.data.FirewallDataset", "policy", policy)
        if policy not in self.POLICIES:
            raise ValueError(f"nanguard.data.FirewallDataset: policy must be one of {self.POLICIES} (what a "
                             f"dropped sample becomes), got {policy!r}; the firewall's own policies say what "
                             "is dropped, repaired or raised")
        self._setup(firewall, field, event_log, "FirewallDataset")
        if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")) or isinstance(dataset, (str, bytes)):
            raise _args.wrong_type("nanguard.data.FirewallDataset", "dataset", "a map-style dataset (with __getitem__ "
                                   "and __len__; FirewallIterableDataset takes a stream)", dataset)
        self.dataset = dataset
        self.policy = policy

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        sample = self._checked(index)
        if sample is not DROPPED or self.policy == "skip":
            return sample
        n = len(self.dataset)
        for step in range(1, n):
            sample = self._checked((index + step) % n)
            if sample is not DROPPED:
                return sample
        raise ValueError(f"nanguard.data.FirewallDataset: the firewall dropped every one of the {n} samples; "
                         "check the data (nanguard scan) or the firewall's policies")

    def _checked(self, index):
        return _check_sample(self, self.dataset[index], index, "dataset")

    @staticmethod
    def collate_fn(samples):
        """default_collate of the samples that were not dropped; None when the
        firewall dropped them all (skip that batch: ``if batch is None: continue``)."""
        samples = [s for s in samples if s is not DROPPED]
        return default_collate(samples) if samples else None


def _check_sample(wrapper, sample, index, row_index):
    """``sample`` after the wrapper's firewall (a [features] tensor checked as
    one row): as it was, with its features repaired, or DROPPED. ``index``
    names it in the data events, as ``row_index`` says ("dataset", "stream")."""
    x = _get(sample, wrapper.field, wrapper._source)
    if x.dim() != 1:
        raise ValueError(f"nanguard.data.{wrapper._source}: sample {index}'s features have shape {list(x.shape)}; "
                         "the firewall checks a sample as one row of [features]: use firewall_collate for "
                         "samples of another shape")
    clean, report = wrapper._apply(x.unsqueeze(0), 1)
    wrapper._record(_report_counts(report), rows=([index] if report.dropped_rows else [],
                                                  [index] if report.changed_rows else [], row_index))
    if report.rows_out == 0:
        return DROPPED
    return _put(sample, wrapper.field, clean[0]) if report.changed_rows else sample


class FirewallIterableDataset(_Checked, IterableDataset):
    """An iterable (streaming) dataset whose samples pass a fitted Firewall:
    dropped samples are not yielded, repaired ones are, with their features
    replaced; a raise policy raises ``ValueError``.

        ds = nanguard.data.FirewallIterableDataset(stream, fw)
        loader = DataLoader(ds, batch_size=32, num_workers=2)

    Features as for :class:`FirewallDataset` (``field``); counts as
    attributes, kept across DataLoader workers. Each worker iterates
    ``dataset`` as the DataLoader gives it (shard it there, with
    ``torch.utils.data.get_worker_info()``, as for any IterableDataset).
    """

    def __init__(self, dataset: Any, firewall: _nanguard.Firewall, field: Field = None,
                 event_log: Optional[PathLike] = None) -> None:
        self._setup(firewall, field, event_log, "FirewallIterableDataset")
        if not isinstance(dataset, Iterable) or isinstance(dataset, (str, bytes, torch.Tensor)):
            raise _args.wrong_type("nanguard.data.FirewallIterableDataset", "dataset", "an iterable of samples "
                                   "(an IterableDataset, a generator)", dataset)
        self.dataset = dataset

    def __iter__(self) -> Iterator[Any]:
        for index, sample in enumerate(self.dataset):
            sample = _check_sample(self, sample, index, "stream")
            if sample is not DROPPED:
                yield sample
