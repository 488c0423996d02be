"""The options of :class:`nanguard.Guard` and their checks.

The options are written once, in ``_nanguard.GUARD_OPTION_TABLE`` (the
bindings, beside the ``GuardOptions`` properties that carry them to
``nanguard::guard_options``): each row a keyword, its type as Guard's
signature spells it, its default (the C++ one where Python's is the same),
what it does and the ``GuardOptions`` field it sets. From the table come
Guard's docstring (:func:`documented`), its checks (:func:`read`: each
option converted by its type, a wrong one named) and the ``GuardOptions``
it builds (:func:`guard_options`). Guard's signature, which type checkers
read, and the stub spell the options again: python/tests/test_guard_options.py
holds them to the table.
"""
from __future__ import annotations

import difflib
import functools
import inspect
import os
import textwrap
from typing import (Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, TypedDict, TypeVar, Union,
                    cast, get_type_hints)

from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from . import _nanguard
from ._args import boolean, integer, number, path, text, wrong_type
from ._lr_schedulers import schedulers_of
from .tensorboard import StepLogger

#: The guard's policies, from the C++ ``nanguard::policy``.
POLICIES = _nanguard.POLICIES
#: A policy's name (``POLICIES``, checked against it by the tests).
Policy = Literal["auto", "skip", "backoff", "rollback", "abort"]
#: A file path as the guard's options take it.
PathLike = Union[str, "os.PathLike[str]"]


class LossScaleOptions(TypedDict, total=False):
    """``Guard(loss_scale={...})``: the arguments of ``LossScaler``."""

    enabled: bool
    init_scale: float
    growth_factor: float
    backoff_factor: float
    growth_interval: int
    hysteresis: int
    min_scale: float
    max_scale: float


class ScheduleOptions(TypedDict, total=False):
    """``Guard(schedule={...})``: the arguments of ``WarmupCosine`` (base_lr is required)."""

    base_lr: float
    warmup_steps: int
    total_steps: int
    min_lr: float


#: The arguments of LossScaler and WarmupCosine, which loss_scale={...} and schedule={...} hold, and their types.
LOSS_SCALE_KEYS: Dict[str, type] = get_type_hints(LossScaleOptions)
SCHEDULE_KEYS: Dict[str, type] = get_type_hints(ScheduleOptions)

#: The rows of the table, in Guard's signature's order (``name``, ``type``, ``default``, ``doc``, ``field``).
OPTION_TABLE: Tuple[_nanguard.GuardOption, ...] = _nanguard.GUARD_OPTION_TABLE
#: The names of Guard's options (its keyword-only arguments), which the framework callbacks pass through.
GUARD_OPTIONS = tuple(o.name for o in OPTION_TABLE)

#: The front end (``nanguard::front_end``) of the framework a callback tags its
#: guard's bundles with; a Guard of a plain loop is "python".
FRONT_ENDS = {"lightning": "lightning", "transformers": "transformers"}


def unknown_option_error(where: str, name: str, known: Sequence[str]) -> TypeError:
    """The TypeError for an option ``name`` that is none of ``known``: it
    names it, the closest known name and all of them."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"{where}: unknown option {name!r}{hint} (the options are {', '.join(known)})")


_F = TypeVar("_F", bound=Callable[..., Any])


def keyword_options(where: str) -> Callable[[_F], _F]:
    """Decorates a constructor whose options are keyword-only: a misspelled
    option is a TypeError that names it and the closest option (Python's
    own names only the word), and options passed by position a TypeError
    that says to name them."""

    def decorate(init: _F) -> _F:
        params = inspect.signature(init).parameters
        options = [n for n, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY]
        positional = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

        @functools.wraps(init)
        def checked(*args: Any, **kwargs: Any) -> Any:
            if len(args) > len(positional):
                raise TypeError(f"{where}: the options are keyword-only: name them, e.g. {where}(..., "
                                f"policy='rollback', max_norm=1.0) (got {len(args) - len(positional)} more "
                                "positional argument(s))")
            if not takes_any:
                for name in kwargs:
                    if name not in params:
                        raise unknown_option_error(where, name, options)
            return init(*args, **kwargs)

        return cast(_F, checked)

    return decorate


# -- the checks, one per type of the table ---------------------------------------
#: The check of each type a TypedDict of options (loss_scale, schedule) holds.
_KEY_CHECKS: Dict[type, Callable[[str, str, Any], Any]] = {float: number, int: integer, bool: boolean}


def _known_keys(option: str, given: Mapping[str, Any], keys: Mapping[str, type]) -> Dict[str, Any]:
    """``given`` (a dict) when each of its keys is one of ``keys`` (a
    TypedDict's annotations), its value checked by the key's type; else a
    TypeError naming the first unknown key, or the wrong value."""
    for k in dict(given):
        if k not in keys:
            raise unknown_option_error(f"nanguard.Guard: {option}", k, list(keys))
    return {k: _KEY_CHECKS[keys[k]]("nanguard.Guard", f"{option}[{k!r}]", v) for k, v in given.items()}


def _float(name: str, value: Any) -> float:
    return number("nanguard.Guard", name, value)


def _bool(name: str, value: Any) -> bool:
    return boolean("nanguard.Guard", name, value)


def _int64(name: str, value: Any) -> int:
    """``value`` as an int when it fits the C++ option's 64 bits; else a ValueError naming ``name``."""
    v = integer("nanguard.Guard", name, value)
    if not -2 ** 63 <= v < 2 ** 63:
        raise ValueError(f"nanguard.Guard: {name} must fit in 64 bits, got {v}")
    return v


def _path(name: str, value: Optional[PathLike]) -> str:
    """The file path option ``name`` as a str ("" for None); a TypeError for
    anything else: open() takes an int (True too) as a file descriptor, and
    ``event_log=True`` closed the process's stdout."""
    example = "train.jsonl" if name == "event_log" else "nanguard-bundles"
    return "" if value is None else path("nanguard.Guard", name, value,
                                         f"a path (a str or os.PathLike), e.g. {name}='{example}'")


def _policy(name: str, value: Any) -> Policy:
    """The policy's name; a ValueError listing the policies for another."""
    return cast(Policy, _nanguard.policy_from_string(text("nanguard.Guard", name, value)))


def _loss_scaler(name: str, loss_scale: Union[bool, LossScaleOptions]) -> Optional[_nanguard.LossScaler]:
    """The LossScaler of ``Guard(loss_scale=...)``: None (False), GradScaler's defaults (True) or a dict's options."""
    if not isinstance(loss_scale, (bool, Mapping)):
        raise wrong_type("nanguard.Guard", name, "True, False or a dict of LossScaler options, e.g. "
                         "loss_scale={'init_scale': 1024.0}", loss_scale)
    if not loss_scale:  # False or {}
        return None
    if loss_scale is True:
        return _nanguard.LossScaler()
    return _nanguard.LossScaler(**_known_keys("loss_scale", cast(LossScaleOptions, loss_scale), LOSS_SCALE_KEYS))


def _schedule(name: str,
              schedule: Union[_nanguard.WarmupCosine, ScheduleOptions, None]) -> Optional[_nanguard.WarmupCosine]:
    """The WarmupCosine of ``Guard(schedule=...)``: as given, or of a dict's
    arguments; a TypeError naming the option for anything else, and for a
    torch.optim.lr_scheduler the option that takes it (``lr_scheduler``:
    the loop steps it, not the guard)."""
    if schedule is None or isinstance(schedule, _nanguard.WarmupCosine):
        return schedule
    if not isinstance(schedule, Mapping):
        torch_scheduler = ("; a torch.optim.lr_scheduler goes to lr_scheduler= instead, e.g. "
                           "nanguard.Guard(model, opt, lr_scheduler=sched): it stays in the loop, which calls its "
                           "step() after guard.step, and a rollback lowers it with the LR"
                           if isinstance(schedule, (LRScheduler, ReduceLROnPlateau)) else "")
        raise TypeError(str(wrong_type("nanguard.Guard", name, "a nanguard.WarmupCosine or a dict of its arguments, "
                                       "e.g. schedule={'base_lr': 1e-3, 'warmup_steps': 100}", schedule))
                        + torch_scheduler)
    options = _known_keys("schedule", schedule, SCHEDULE_KEYS)
    if "base_lr" not in options:
        raise TypeError("nanguard.Guard: schedule needs base_lr, e.g. schedule={'base_lr': 1e-3, "
                        f"'warmup_steps': 100}}, got {options}")
    return _nanguard.WarmupCosine(**options)


def _bundle_tags(name: str, tags: Optional[Mapping[str, object]]) -> List[Tuple[str, str]]:
    """The (name, value) tags of a bundle: ``front_end`` "python", then the
    dict's, as strings; a TypeError for anything but a dict."""
    if tags is not None and not isinstance(tags, Mapping):
        raise wrong_type("nanguard.Guard", name, "a dict of name -> value, e.g. {'task': 'classify'}", tags)
    return [("front_end", "python")] + [(str(k), str(v)) for k, v in (tags or {}).items()]


def _tensorboard(name: str, value: Any) -> Any:
    """A log directory, a SummaryWriter (anything with ``add_scalar``) or a StepLogger, as given."""
    if value is None or isinstance(value, (str, os.PathLike, StepLogger)) or hasattr(value, "add_scalar"):
        return value
    raise wrong_type("nanguard.Guard", name, "a log directory, a torch.utils.tensorboard.SummaryWriter or a "
                     "nanguard.tensorboard.StepLogger", value)


def _as_given(name: str, value: Any) -> Any:
    """An option the Guard checks where it uses it (distributed: against the model's wrapper)."""
    return value


#: The check of each type of the table: (name, value) -> what GuardOptions's field (or the Guard) takes.
CHECKS: Dict[str, Callable[[str, Any], Any]] = {
    "Policy": _policy,
    "float": _float,
    "int": _int64,
    "bool": _bool,
    "Optional[PathLike]": _path,
    "Union[bool, LossScaleOptions]": _loss_scaler,
    "Union[_nanguard.WarmupCosine, ScheduleOptions, None]": _schedule,
    "Optional[Mapping[str, object]]": _bundle_tags,
    "Union[LRScheduler, ReduceLROnPlateau, Sequence[Any], None]": schedulers_of,
    "Union[PathLike, SummaryWriter, StepLogger, None]": _tensorboard,
    "Union[bool, ProcessGroup, _nanguard.Distributed, None]": _as_given,
}


def check(options: Mapping[str, Any]) -> None:
    """Checks each of ``options`` (some of Guard's, by name) as :func:`read`
    does: the framework callbacks' options, before the Guard is built."""
    types = {o.name: o.type for o in OPTION_TABLE}
    for name, value in options.items():
        CHECKS[types[name]](name, value)


def read(arguments: Mapping[str, Any]) -> Dict[str, Any]:
    """Guard's options among ``arguments`` (its ``locals()``: every option,
    given or default), each checked and converted by its type: a TypeError
    or ValueError that names the option for a wrong one."""
    return {o.name: CHECKS[o.type](o.name, arguments[o.name]) for o in OPTION_TABLE}


def guard_options(values: Mapping[str, Any], **fields: Any) -> _nanguard.GuardOptions:
    """The GuardOptions of the options :func:`read` gave: each one's field,
    and ``fields`` (those the Guard sets itself: ``distributed``, ...). The
    front end a remedy is written for is the ``framework`` tag's (a
    callback's), else Python."""
    front_end = FRONT_ENDS.get(dict(values["bundle_tags"]).get("framework", ""), "python")
    return _nanguard.GuardOptions(**{o.field: values[o.name] for o in OPTION_TABLE if o.field},
                                  front_end=front_end, **fields)


def documented(cls: _F) -> _F:
    """Puts the table's docs in ``cls``'s docstring, where it says
    ``{options}``: one Args entry per option, as its signature lists them."""
    body_indent = " " * 12
    entries = [textwrap.fill(f"{o.name}: {o.doc}", width=80, initial_indent=" " * 8,
                             subsequent_indent=body_indent, break_on_hyphens=False) for o in OPTION_TABLE]
    cls.__doc__ = (cls.__doc__ or "").replace(" " * 8 + "{options}", "\n".join(entries))
    return cls
