"""nanguard: find where a NaN or Inf is born in PyTorch training, and keep
training finite.

The heavy lifting is nanguard's C++ core (the ``_nanguard`` extension, on the
same LibTorch as ``torch``); tensors cross without copies.

>>> import torch, nanguard
>>> nanguard.census(torch.tensor([1.0, float("nan")])).nan
1
>>> with nanguard.trace(model) as t:          # doctest: +SKIP
...     loss = loss_fn(model(x), y)
...     loss.backward()
>>> print(t.findings[0])                        # doctest: +SKIP
step 0 forward aten::div in norm: producer, output 0 [0] = nan
"""
import os
from typing import List, Sequence

import torch  # noqa: F401  (loads LibTorch before the extension)

from . import _args, _bindings, _dtensor, _nanguard
from ._results import Finding, NanGuardWarning, NonFiniteError, RemedyCheck, StepResult
from ._trace import AllowRule, Trace, trace
from ._options import POLICIES
from ._guard import Guard
from ._cli import inspect, report
from . import data, tensorboard  # noqa: E402  (nanguard.data, nanguard.tensorboard)

# A finding's source line is the user's: the innermost frame outside torch and nanguard.
_nanguard.set_library_paths([os.path.dirname(torch.__file__), os.path.dirname(__file__)])

#: nanguard's version (the C++ core's: one number for the library, the CLI and the module).
__version__ = _nanguard.__version__

__all__ = [
    "census", "has_nonfinite", "census_many", "check_many", "RecordVerdict", "mark_written", "TensorStats", "trace", "Trace", "Finding",
    "RemedyCheck", "NonFiniteError", "AllowRule", "Guard", "NanGuardWarning", "StepResult", "POLICIES", "IsolationForest",
    "Firewall", "FirewallReport", "WarmupCosine", "Distributed", "report", "inspect",
]

#: ``nanguard::distributed`` over a torch.distributed process group, for
#: ``Guard(distributed=...)``: ``Distributed(process_group,
#: average_gradients=True, backward="none")`` (``backward="all_reduce"``:
#: the model is the module inside a framework's DistributedDataParallel);
#: ``rank``, ``world_size``, ``backward``.
Distributed = _bindings.Distributed

#: One-pass statistics of a tensor (``nanguard::tensor_stats``).
TensorStats = _nanguard.TensorStats

#: What ``check_many`` found: tensors, nan, pos_inf, neg_inf, nonfinite,
#: first_tensor (position in the list, -1 if none), first_index, first_value,
#: all_finite() (``nanguard::record_verdict``).
RecordVerdict = _nanguard.RecordVerdict

#: ``nanguard::isolation_forest``: ``IsolationForest(n_estimators=100,
#: max_samples=256, contamination=0.0, seed=0).fit(x).score_samples(x)``
#: gives scikit-learn's scores per row of a finite [rows, features] tensor.
IsolationForest = _bindings.IsolationForest

#: ``nanguard::warmup_cosine``: ``WarmupCosine(base_lr, warmup_steps=0,
#: total_steps=1000, min_lr=0.0).lr(step)``, linear warmup then cosine
#: annealing; ``nanguard.Guard(..., schedule=...)`` applies it every step.
WarmupCosine = _bindings.WarmupCosine

#: ``nanguard::firewall`` on [batch, features] tensors:
#: ``Firewall(nonfinite="drop"|"impute_median"|"nan_to_num"|"raise"|"ignore",
#: outliers="ignore"|"clip"|"drop"|"raise", rule="quantile_range"|
#: "three_sigma"|"robust_z", ...)``; ``fw.fit(train_x)`` (needed for the
#: outlier policies), then ``clean, report = fw.apply(batch)``.
Firewall = _bindings.Firewall

#: What ``Firewall.apply`` found and did: rows_in, rows_out, dropped_rows,
#: changed_rows, columns (per-feature counts), nonfinite, outliers, clean().
FirewallReport = _nanguard.FirewallReport


def census(tensor: torch.Tensor, local: bool = False) -> TensorStats:
    """Statistics of ``tensor`` in one vectorised pass.

    A DTensor (``torch.distributed.tensor``, e.g. an FSDP2 parameter or
    gradient) answers for the global tensor: each rank's census of its shard,
    gathered over the mesh (counts summed, min/max over the ranks, the first
    non-finite element by its global index). It is a collective: every rank
    of the mesh calls it.

    Args:
        tensor: a floating-point tensor, on any device.
        local: a DTensor's census of this rank's shard only.

    Returns:
        A ``TensorStats``: numel, nan, pos_inf, neg_inf, finite, zeros,
        subnormal, min, max, mean, std, l2_norm, absmax, fp16_overflow,
        fp16_underflow, bf16_overflow, first_nonfinite_index,
        first_nonfinite_value; ``.to_dict()`` gives them all.

    Raises:
        TypeError: ``tensor`` is not a tensor, or an integer, bool, complex
            or float8 tensor (for a complex one, take the census of
            ``torch.view_as_real(t)``).
        ValueError: a sparse or meta tensor, which holds no values to read.
    """
    tensor = _args.tensor("nanguard.census", "tensor", tensor)
    local = _args.boolean("nanguard.census", "local", local)
    if _dtensor.is_dtensor(tensor):
        return _nanguard.census(tensor.to_local().detach()) if local else _dtensor.census_many([tensor])[0]
    return _nanguard.census(_readable(tensor))


def has_nonfinite(tensor: torch.Tensor, local: bool = False) -> bool:
    """True when ``tensor`` holds a NaN or an Inf (stops at the first one).

    Integer and bool tensors are always finite; complex tensors are checked
    through their real and imaginary parts. Raises ``ValueError`` for sparse
    or meta tensors. A DTensor answers for the global tensor (a collective:
    every rank of its mesh calls it), or for this rank's shard with
    ``local=True``.
    """
    tensor = _args.tensor("nanguard.has_nonfinite", "tensor", tensor)
    local = _args.boolean("nanguard.has_nonfinite", "local", local)
    if _dtensor.is_dtensor(tensor):
        return _nanguard.has_nonfinite(tensor.to_local().detach()) if local else _dtensor.has_nonfinite(tensor)
    return _nanguard.has_nonfinite(_readable(tensor))


def _readable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s values as the C++ core reads them: from memory, in logical order.

    The core reads the raw elements of a strided tensor, so what torch keeps
    aside is applied first: a negative view's sign bit (``z.conj().imag``:
    its memory holds the values negated) and a complex conjugate view's
    (``z.conj()``, whose real view torch refuses; the conjugate changes no
    value's finiteness, and the census takes no complex tensor). A jagged
    nested tensor's buffer may hold elements it does not show, or hold them
    in another order (a transposed one): its components are read in a copy.
    """
    tensor = tensor.detach()
    if tensor.is_nested and tensor.layout == torch.jagged:
        tensor = torch.cat([component.reshape(-1) for component in tensor.unbind()])
    if tensor.is_conj():
        tensor = tensor.conj()
    return tensor.resolve_neg()


def census_many(tensors: Sequence[torch.Tensor], local: bool = False) -> List[TensorStats]:
    """The census of every tensor of the list, as a list of ``TensorStats``.

    On CUDA the tensors are read many per kernel launch, in one pass each,
    with one host sync for the whole list (per-parameter gradient norms cost
    one sync, not one per parameter). Same errors as ``census``. DTensors
    answer for their global tensors, with one all-gather for all of those
    that share a mesh and placements (every rank calls it with the same
    list), or for the local shards with ``local=True``.
    """
    tensors = [_readable(t) for t in _args.sequence_of(_args.tensor, "nanguard.census_many", "tensors", tensors,
                                                       "a list of tensors")]
    if _args.boolean("nanguard.census_many", "local", local):
        tensors = [t.to_local() if _dtensor.is_dtensor(t) else t for t in tensors]
    sharded = [t for t in tensors if _dtensor.is_dtensor(t)]
    if not sharded:
        return _nanguard.census_many(tensors)
    plain = iter(_nanguard.census_many([t for t in tensors if not _dtensor.is_dtensor(t)]))
    whole = iter(_dtensor.census_many(sharded))
    return [next(whole) if _dtensor.is_dtensor(t) else next(plain) for t in tensors]


def check_many(tensors: Sequence[torch.Tensor], local: bool = False) -> RecordVerdict:
    """Whether any tensor of the list holds a NaN or an Inf, as a ``RecordVerdict``
    naming the first such tensor (by position), element and value; one host
    sync for the whole list on CUDA. DTensors answer for their global
    tensors (the element by its global index; a collective, as
    ``census_many``: every rank calls it with the same list), or for the
    local shards with ``local=True``."""
    tensors = [_readable(t) for t in _args.sequence_of(_args.tensor, "nanguard.check_many", "tensors", tensors,
                                                       "a list of tensors")]
    if _args.boolean("nanguard.check_many", "local", local):
        tensors = [t.to_local() if _dtensor.is_dtensor(t) else t for t in tensors]
    if any(_dtensor.is_dtensor(t) for t in tensors):
        return _dtensor.check_many(tensors)
    return _nanguard.check_many(tensors)


def mark_written(tensor: torch.Tensor) -> None:
    """Tells a live ``trace`` that ``tensor`` changed outside a recorded op.

    Call it after writing a tensor behind PyTorch's back within a traced
    step: writes through ``tensor.numpy()``, a raw pointer or a custom
    kernel the dispatcher does not see. Otherwise the tracer may trust the
    finite range it saw before the write. Bumps the tensor's version, as an
    in-place op does. (``torch.distributed`` collectives need no call: the
    tracer sees each ``c10d::`` op and marks its tensors itself, as their
    backend writes them later without a version bump.)
    """
    _nanguard.mark_written(_args.tensor("nanguard.mark_written", "tensor", tensor))
