"""How nanguard tells its user: each line both as a :class:`NanGuardWarning`
and as a record of the ``nanguard`` logger, attributed to the user's code.

Where a line shows (docs/python.md, "Warnings and logging"):

- nothing configured: the warning on stderr, once (the logger stays quiet:
  with no handler, logging's last resort would print the line a second time);
- the warnings silenced as a whole (``python -W ignore``,
  ``PYTHONWARNINGS=ignore``, ``warnings.simplefilter("ignore")``): the
  logger's record, which logging's last resort prints on stderr, once;
- the warnings silenced for nanguard alone (an "ignore" filter whose category
  is :class:`NanGuardWarning`): nothing, unless logging is configured;
- logging configured (``logging.basicConfig``, a handler of the user's on
  the ``nanguard`` logger or above it): the record goes to those handlers,
  and the warning shows as the warnings filters say.

A line is attributed to the first frame of the stack that is the user's:
not nanguard's, torch's, a training framework's (Lightning, Hugging Face's
transformers and accelerate) or the standard library's (weakref, threading,
atexit); with none (a guard collected at the interpreter's exit), to the
place that built the guard (:func:`user_site`).

A warning that a filter made an error (``-W error``) never stops what
nanguard was doing half-way: inside :func:`warnings_last` it is held until
the block has done its work, then raised, unless an error wins over it.
"""
from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import types
import warnings
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ._results import NanGuardWarning

#: The ``nanguard`` logger: each step not taken and the summary of a run
#: that had one at WARNING, a clean run's summary at INFO, and what a
#: ``nanguard.trace`` found at WARNING.
logger = logging.getLogger("nanguard")

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_STDLIB_DIR = os.path.dirname(os.path.abspath(weakref.__file__)) + os.sep
#: The packages whose frames are not the user's (when imported).
_LIBRARIES = ("torch", "lightning", "pytorch_lightning", "lightning_fabric", "transformers", "accelerate")


@dataclass(frozen=True)
class Site:
    """A line of the user's code that a warning is attributed to, and the
    globals of its module while it runs, whose ``__warningregistry__`` the
    warning uses as ``warnings.warn`` would (None: a site kept for later,
    which holds no reference to the module)."""

    filename: str
    lineno: int
    module: str
    module_globals: Optional[Dict[str, Any]] = field(default=None, compare=False)


def _library_dirs() -> Tuple[str, ...]:
    """The directories of nanguard and of the imported libraries whose frames are not the user's."""
    dirs = [_PACKAGE_DIR]
    for name in _LIBRARIES:
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            dirs.append(os.path.dirname(os.path.abspath(file)) + os.sep)
    return tuple(dirs)


def _is_users(filename: str, library_dirs: Tuple[str, ...]) -> bool:
    """Whether a frame of ``filename`` is the user's code."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen ")  # "<string>", "<stdin>": the user's
    filename = os.path.abspath(filename)
    if filename.startswith(library_dirs):
        return False
    in_site_packages = any(f"{os.sep}{d}{os.sep}" in filename for d in ("site-packages", "dist-packages"))
    return in_site_packages or not filename.startswith(_STDLIB_DIR)


def _site(frame: types.FrameType) -> Site:
    """The line ``frame`` runs, with its module's globals."""
    return Site(frame.f_code.co_filename, frame.f_lineno, str(frame.f_globals.get("__name__", "<string>")),
                frame.f_globals)


def _user_frame(frame: Optional[types.FrameType]) -> Optional[types.FrameType]:
    """The first frame of the user's code from ``frame`` up, or None."""
    dirs = _library_dirs()
    while frame is not None and not _is_users(frame.f_code.co_filename, dirs):
        frame = frame.f_back
    return frame


def user_site() -> Optional[Site]:
    """The user's line that called into nanguard (None when no frame is the
    user's), to attribute a later warning to: e.g. where a guard was built."""
    frame = _user_frame(sys._getframe(1))
    return None if frame is None else replace(_site(frame), module_globals=None)


def _filter_for(message: str, site: Site) -> Tuple[str, Any]:
    """The action of the warnings filter that matches a NanGuardWarning of
    ``message`` at ``site``, and that filter's category (Warning when none
    matches: the default action)."""
    for action, text, category, module, lineno in warnings.filters:
        if (text is None or text.match(message)) and issubclass(NanGuardWarning, category) \
                and (module is None or module.match(site.module)) and lineno in (0, site.lineno):
            return action, category
    return str(getattr(warnings, "defaultaction", "default")), Warning


def _log_too(message: str, site: Site) -> bool:
    """Whether the logger's record goes out as well as the warning: when
    logging has a handler for it, or when a filter for every warning hides
    the warning (logging's last resort then prints the record); not when
    nanguard's warnings alone are silenced, or the warning shows with no
    handler (the last resort would print it twice)."""
    if logger.hasHandlers():
        return True
    action, category = _filter_for(message, site)
    return action == "ignore" and not (isinstance(category, type) and issubclass(category, NanGuardWarning))


def tell(message: str, level: int = logging.WARNING, fallback: Optional[Site] = None) -> None:
    """Tells the user ``message``: at WARNING, a NanGuardWarning (and a
    record of the ``nanguard`` logger, as the module docstring says), both
    attributed to the user's frame (else ``fallback``, else the caller's);
    below WARNING, a record only."""
    frame = _user_frame(sys._getframe(1))
    site = _site(frame) if frame is not None else fallback or _site(sys._getframe(1))
    if logger.isEnabledFor(level) and (level < logging.WARNING or _log_too(message, site)):
        logger.handle(logger.makeRecord(logger.name, level, site.filename, site.lineno, message, (), None))
    if level >= logging.WARNING:
        registry = None if site.module_globals is None else site.module_globals.setdefault("__warningregistry__", {})
        # No module_globals: warn_explicit would ask the module's loader for its source, which `python -c`
        # code has not (an ImportError); the warning's line is read from the file, as warnings.warn does.
        try:
            warnings.warn_explicit(message, NanGuardWarning, site.filename, site.lineno, module=site.module,
                                   registry=registry)
        except Warning as error:  # a filter made it an error (-W error)
            hold(error)


#: The warnings made errors that the outermost :func:`warnings_last` block holds (None: outside one).
_held: "contextvars.ContextVar[Optional[List[Warning]]]" = contextvars.ContextVar("nanguard_held", default=None)


def hold(error: Warning) -> None:
    """Holds ``error``, a warning that a filter made an error, until the
    :func:`warnings_last` block around ends; outside one, raises it."""
    held = _held.get()
    if held is None:
        raise error
    held.append(error)


@contextlib.contextmanager
def warnings_last(in_flight: Optional[BaseException] = None) -> Iterator[None]:
    """Runs a block of nanguard's work with the warnings that filters made
    errors held (:func:`hold`, as :func:`tell` does) until it has ended, so
    that none stops the work half-way. Then an error wins over them, each
    held warning a note of it: the block's own, or ``in_flight`` (one
    already on its way up, e.g. to an ``__exit__``); else the first held
    warning is raised, the others its notes. A block inside another holds
    for the outer one, unless it has an error in flight."""
    if in_flight is None and _held.get() is not None:
        yield
        return
    held: List[Warning] = []
    token = _held.set(held)
    try:
        yield
    except BaseException as error:
        _add_notes(error, held)
        raise
    finally:
        _held.reset(token)
    if in_flight is not None:
        _add_notes(in_flight, held)
    elif held:
        _add_notes(held[0], held[1:])
        raise held[0]


def _add_notes(error: BaseException, warnings_made_errors: List[Warning]) -> None:
    """Each of the warnings as a note of ``error``, which wins over them."""
    for warning in warnings_made_errors:
        error.add_note(f"{type(warning).__name__}: {warning}")
