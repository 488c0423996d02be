"""The batch of a guarded step, from the closure's call arguments: the
calls of the micro-batches, the tensors they hold in order (what an
abort's bundle keeps) and the names findings give them (the closure's
parameter, a dict's key), and the loss a closure must return."""
from __future__ import annotations

import inspect
import numbers
from typing import Any, Callable, Dict, List, Mapping, Sequence, Tuple

import torch

from ._args import shown


def trainable_loss(loss: object) -> torch.Tensor:
    """``loss`` when the guard can run backward on it; else a TypeError (not a
    floating-point tensor) or a ValueError (a tensor that no gradient flows from)."""
    if not isinstance(loss, torch.Tensor) or not loss.is_floating_point():
        got = str(loss.dtype) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError("nanguard.Guard.step: the closure must return the loss tensor, a floating-point one, e.g. "
                        f"lambda: F.mse_loss(model(x), y), but it returned {got}")
    if not loss.requires_grad:
        raise ValueError("nanguard.Guard.step: the loss must be a floating-point tensor that depends on the "
                         "model's trainable parameters, got a tensor that does not require grad (computed under "
                         "torch.no_grad, detached, or from frozen parameters?)")
    return loss


def checked_loss(where: str, loss: object) -> torch.Tensor:
    """The loss a framework hands ``Guard.check``: a floating-point tensor
    (detached) or a real number; else a TypeError naming ``loss``."""
    if isinstance(loss, torch.Tensor) and loss.is_floating_point():
        return loss.detach()
    if isinstance(loss, numbers.Real) and not isinstance(loss, bool):
        return torch.tensor(float(loss))
    got = f"a tensor of {loss.dtype}" if isinstance(loss, torch.Tensor) else shown(loss)
    raise TypeError(f"{where}: loss must be a floating-point tensor or a number, got {got}")


def call_of(micro_batch: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``(args, kwargs)`` of one micro-batch: a pair as given (its args a
    tuple or list), a tuple or list of arguments, or a single argument. So
    ``(x, {"w": 1.0})`` is two arguments, as ``step(closure, x, {"w": 1.0})``
    passes them, not the rows of ``x`` as arguments."""
    if (isinstance(micro_batch, tuple) and len(micro_batch) == 2 and isinstance(micro_batch[0], (tuple, list))
            and isinstance(micro_batch[1], dict)):
        return tuple(micro_batch[0]), micro_batch[1]
    if isinstance(micro_batch, (tuple, list)):
        return tuple(micro_batch), {}
    return (micro_batch,), {}


def batch_tensors(values: Any) -> List[torch.Tensor]:
    """The tensors in ``values`` (tensors, tuples, lists, dicts, nested), in
    order: the batch the guard names in findings and an abort's bundle
    keeps."""
    return named_batch_tensors(values)[0]


def named_batch_tensors(values: Any, name: str = "batch") -> Tuple[List[torch.Tensor], List[str]]:
    """``(tensors, names)``: the tensors of :func:`batch_tensors` and the
    names findings give them. A tensor under a dict key is named by the key
    (``labels``, ``inputs_embeds``), one inside a tuple or list by its
    position under its parent's name (``batch[0]``, ``x[1]``); ``name``
    names ``values`` itself."""
    tensors: List[torch.Tensor] = []
    names: List[str] = []

    def walk(v: Any, path: str) -> None:
        if isinstance(v, torch.Tensor):
            tensors.append(v)
            names.append(path)
        elif isinstance(v, dict):
            for k, x in v.items():
                walk(x, str(k))
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(x, f"{path}[{i}]")

    walk(values, name)
    return tensors, names


def named_call_tensors(fn: Callable[..., Any], args: Sequence[Any],
                       kwargs: Mapping[str, Any]) -> Tuple[List[torch.Tensor], List[str]]:
    """``(tensors, names)`` of a call ``fn(*args, **kwargs)``: positional
    arguments named by ``fn``'s parameters where its signature says them
    (``x``, ``y``), keyword arguments by their keywords, what they hold as
    in :func:`named_batch_tensors`."""
    # Read only for positional arguments: inspect.signature costs more than
    # the rest, and a Trainer calls model(**inputs), by keywords, every step.
    params = _positional_parameters(fn) if args else []
    tensors: List[torch.Tensor] = []
    names: List[str] = []
    for i, a in enumerate(args):
        t, n = named_batch_tensors(a, params[i].name if i < len(params) else f"args[{i}]")
        tensors += t
        names += n
    for k, v in kwargs.items():
        t, n = named_batch_tensors(v, str(k))
        tensors += t
        names += n
    return tensors, names


def with_tensors(args: Sequence[Any], kwargs: Mapping[str, Any],
                 tensors: Sequence[torch.Tensor]) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """The call ``(args, kwargs)`` with its tensors, in the order of
    :func:`named_call_tensors`, replaced by ``tensors``: the same step on
    another batch of the same structure (the batch without its NaN/Inf rows,
    or another rank's micro-batch). A ValueError when the counts differ."""
    given = iter(tensors)

    def rebuilt(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return next(given)
        if isinstance(v, dict):
            return {k: rebuilt(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            items = [rebuilt(x) for x in v]
            return type(v)(*items) if hasattr(v, "_fields") else type(v)(items)
        return v

    wanted = len(batch_tensors([list(args), dict(kwargs)]))
    if wanted != len(tensors):
        raise ValueError(f"nanguard: a batch of {len(tensors)} tensors for a call that takes {wanted}")
    return tuple(rebuilt(a) for a in args), {k: rebuilt(v) for k, v in kwargs.items()}


def _positional_parameters(fn: Callable[..., Any]) -> List[inspect.Parameter]:
    """The parameters of ``fn`` that positional arguments fill, in order
    (none for a builtin or a C extension: no signature)."""
    try:
        return [p for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []
