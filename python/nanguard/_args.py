"""The checks of the public API's arguments, one per kind of argument.

Each takes where the call is (``"nanguard.Guard"``), the argument's name and
its value, and returns the value as the call uses it, or raises a TypeError
(a wrong type) or ValueError (a wrong value) that says what was given, which
argument and what it takes:
``nanguard.Guard: snapshot_every must be an int >= 1, got 2.7 (float)``.

The types are strict, as the C++ options they reach are: an int argument
takes no float (2.7 is not truncated) and no bool; a bool argument takes a
bool (``numpy.bool_`` too), not 0 or "yes"; a list takes no str or tensor,
which would be iterated as characters or rows.
"""
from __future__ import annotations

import numbers
import operator
import os
import reprlib
from collections.abc import Iterable, Mapping
from typing import Any, Callable, List, Optional, Sequence, Tuple, Type, TypeVar, Union

import torch

try:
    from numpy import bool_ as _numpy_bool
except ImportError:  # numpy is optional to torch
    _numpy_bool = bool
#: What a bool argument takes.
_BOOLS = (bool, _numpy_bool)

_T = TypeVar("_T")
_short = reprlib.Repr()
_short.maxstring = _short.maxother = 40


def shown(value: Any) -> str:
    """``value`` as a message shows it: a scalar with its type, else the type."""
    if value is None:
        return "None"
    if isinstance(value, (bool, numbers.Number, str, bytes)):
        return f"{_short.repr(value)} ({type(value).__name__})"
    return f"a {type(value).__name__}"


def wrong_type(where: str, name: str, expected: str, value: Any) -> TypeError:
    return TypeError(f"{where}: {name} must be {expected}, got {shown(value)}")


def wrong_value(where: str, name: str, expected: str, value: Any) -> ValueError:
    return ValueError(f"{where}: {name} must be {expected}, got {shown(value)}")


def _at_least(where: str, name: str, kind: str, value: _T, minimum: Optional[float]) -> _T:
    if minimum is not None and not value >= minimum:  # type: ignore[operator]
        raise wrong_value(where, name, f"{kind} >= {minimum:g}", value)
    return value


def boolean(where: str, name: str, value: Any) -> bool:
    """``value`` as a bool: True or False (or a numpy bool), not 1 or "yes"."""
    if not isinstance(value, _BOOLS):
        raise wrong_type(where, name, "True or False", value)
    return bool(value)


def integer(where: str, name: str, value: Any, *, minimum: Optional[int] = None) -> int:
    """``value`` as an int (anything with ``__index__``: a numpy or 0-dim
    integer tensor too), not a float or a bool; >= ``minimum``."""
    kind = "an int" if minimum is None else f"an int >= {minimum}"
    if isinstance(value, _BOOLS):
        raise wrong_type(where, name, kind, value)
    try:
        index = operator.index(value)
    except TypeError:
        raise wrong_type(where, name, kind, value) from None
    return _at_least(where, name, "an int", index, minimum)


def number(where: str, name: str, value: Any, *, minimum: Optional[float] = None) -> float:
    """``value`` as a float: an int or float (numpy's too), not a bool,
    str or tensor; >= ``minimum``."""
    kind = "a number" if minimum is None else f"a number >= {minimum:g}"
    if isinstance(value, _BOOLS) or not isinstance(value, numbers.Real):
        raise wrong_type(where, name, kind, value)
    return _at_least(where, name, "a number", float(value), minimum)


def text(where: str, name: str, value: Any, *, choices: Sequence[str] = ()) -> str:
    """``value`` as a str, one of ``choices`` when given."""
    expected = f"one of {', '.join(map(repr, choices))}" if choices else "a str"
    if not isinstance(value, str):
        raise wrong_type(where, name, expected, value)
    if choices and value not in choices:
        raise wrong_value(where, name, expected, value)
    return value


def path(where: str, name: str, value: Any, what: str = "a path (a str or os.PathLike)") -> str:
    """``value`` (a str or os.PathLike) as a str."""
    if not isinstance(value, (str, os.PathLike)):
        raise wrong_type(where, name, what, value)
    return os.fspath(value)


def tensor(where: str, name: str, value: Any) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise wrong_type(where, name, "a torch.Tensor", value)
    return value


def callable_(where: str, name: str, value: Any, what: str = "a callable") -> Callable[..., Any]:
    if not callable(value):
        raise wrong_type(where, name, what, value)
    return value  # type: ignore[no-any-return]


def instance(where: str, name: str, value: Any, cls: Union[Type[_T], Tuple[type, ...]], what: str) -> _T:
    """``value`` when it is a ``cls`` (``what`` names it in the message)."""
    if not isinstance(value, cls):
        raise wrong_type(where, name, what, value)
    return value  # type: ignore[return-value]


def optional(check: Callable[..., _T], where: str, name: str, value: Any, *args: Any, **kwargs: Any) -> Optional[_T]:
    """None, or what ``check`` makes of ``value``."""
    return None if value is None else check(where, name, value, *args, **kwargs)


def items(where: str, name: str, value: Any, what: str = "a list") -> List[Any]:
    """``value`` (a list, tuple or other iterable; not a str, bytes, dict or
    tensor, which would be iterated as characters, keys or rows) as a list."""
    if isinstance(value, (str, bytes, Mapping, torch.Tensor)) or not isinstance(value, Iterable):
        raise wrong_type(where, name, what, value)
    return list(value)


def sequence_of(check: Callable[[str, str, Any], _T], where: str, name: str, value: Any,
                what: str = "a list") -> List[_T]:
    """:func:`items` of ``value``, each checked by ``check`` and named ``name[i]``."""
    return [check(where, f"{name}[{i}]", item) for i, item in enumerate(items(where, name, value, what))]
