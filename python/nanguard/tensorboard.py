"""``nanguard.tensorboard``: a guarded run's steps in TensorBoard.

``StepLogger`` writes one step of :class:`nanguard.Guard` (its
:class:`~nanguard.StepResult`, or ``StepResult.to_dict()``, or any event of
the JSONL event log) through ``torch.utils.tensorboard.SummaryWriter``::

    from nanguard.tensorboard import StepLogger
    tb = StepLogger("runs/guarded")          # or an existing SummaryWriter
    for x, y in loader:
        tb.log(guard.step(lambda: loss_fn(model(x), y)))
    tb.close()

The tags are those of the C++ writer (``nanguard/tensorboard.h``; ``nanguard
report LOG --tensorboard DIR`` turns any event log into the same files), from
one list in the C++ core:

==========================  ==================================================
``loss``                    the step's loss (NaN/Inf kept)
``grad_norm``               global gradient norm before clipping
``lr``                      learning rate of the first param group
``loss_scale``              loss scale used for the step
``clip_coef``               factor the gradients were clipped by
``skipped``                 1 when the optimizer did not step, else 0
``grad_norm/<parameter>``   the per-parameter norms of ``top_norms``
``nanguard/findings``       text: findings, replay verdict, remedy, note of a
                            bad step (nothing on a healthy step)
``data/<count>``            a data-firewall event (``nanguard.data``): checked,
                            dropped, changed, repaired, clipped, nan, pos_inf,
                            neg_inf, outliers, raised
==========================  ==================================================
"""
from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

from . import _nanguard
from ._args import boolean, number, optional, wrong_type

if TYPE_CHECKING:
    from torch.utils.tensorboard import SummaryWriter

    from ._results import StepResult

#: What StepLogger.log takes: a StepResult, its to_dict() or a line of the event log.
StepEvent = Union["StepResult", Dict[str, Any], str]

__all__ = ["StepLogger", "TEXT_TAG", "step_scalars", "step_text"]

#: The tag of a bad step's text (findings, verdict, remedy, note).
TEXT_TAG = "nanguard/findings"


def _event_json(result):
    """The C++ step event (JSON) of a StepResult, its ``to_dict()`` or a JSON line."""
    if isinstance(result, str):
        return result
    if isinstance(result, dict):
        return json.dumps(_as_logged(result))
    to_dict = getattr(result, "to_dict", None)
    if callable(to_dict):
        return json.dumps(_as_logged(to_dict()))
    raise wrong_type("nanguard.tensorboard", "result", "a nanguard.StepResult, its to_dict() or an event-log line",
                     result)


def _as_logged(value):
    """``value`` with NaN and Inf written as the event log writes them ("nan",
    "inf", "-inf"): json.dumps writes NaN, which is not JSON."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    if isinstance(value, dict):
        return {k: _as_logged(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_as_logged(v) for v in value]
    return value


def step_scalars(result: StepEvent) -> List[Tuple[str, float]]:
    """[(tag, value)] of one step under nanguard's tags (the C++ list)."""
    return _nanguard.tensorboard_scalars(_event_json(result))


def step_text(result: StepEvent) -> str:
    """The Markdown of a step's findings, verdict, remedy and note ("" when none)."""
    return _nanguard.tensorboard_text(_event_json(result))


class StepLogger:
    """Logs guarded steps to TensorBoard under nanguard's tags.

    ``writer``: a log directory (a ``SummaryWriter`` is made for it, and
    closed by :meth:`close`) or a ``torch.utils.tensorboard.SummaryWriter``
    (shared: :meth:`close` only flushes it). ``flush_every_step`` (default
    True) flushes after each step, so a crash loses at most the last step.
    Usable as a context manager.
    """

    def __init__(self, writer: Union[str, "os.PathLike[str]", "SummaryWriter"], flush_every_step: bool = True) -> None:
        if isinstance(writer, (str, os.PathLike)):
            self.writer = _summary_writer(os.fspath(writer))
            self._owned = True
        elif callable(getattr(writer, "add_scalar", None)) and callable(getattr(writer, "_get_file_writer", None)):
            self.writer = writer
            self._owned = False
        else:
            raise wrong_type("nanguard.tensorboard.StepLogger", "writer", "a log directory or a "
                             "torch.utils.tensorboard.SummaryWriter", writer)
        self.flush_every_step = boolean("nanguard.tensorboard.StepLogger", "flush_every_step", flush_every_step)
        self.steps = 0

    def log(self, result: StepEvent, walltime: Optional[float] = None) -> None:
        """Writes one step: a :class:`~nanguard.StepResult`, its ``to_dict()``
        or a line of the event log (its ``step`` is TensorBoard's step; a data
        event's ``check``)."""
        walltime = optional(number, "nanguard.tensorboard.StepLogger.log", "walltime", walltime)
        event = _event_json(result)
        scalars = _nanguard.tensorboard_scalars(event)  # checks the event: a ValueError naming what is wrong
        logged = json.loads(event)
        # A data event is plotted on its own axis: its check's number ("step" in a log written before).
        data = logged.get("data") if logged.get("action") == "data" else None
        step = int(data.get("check", logged.get("step", 0))) if isinstance(data, dict) else int(logged["step"])
        for tag, value in scalars:
            self.writer.add_scalar(tag, value, step, walltime=walltime)
        text = _nanguard.tensorboard_text(event)
        if text:
            self._add_text(text, step, walltime)
        self.steps += 1
        if self.flush_every_step:
            self.writer.flush()

    def _add_text(self, text: str, step: int, walltime: Optional[float]) -> None:
        # SummaryWriter.add_text would name the tag "<tag>/text_summary"; the
        # C++ writer's tag is TEXT_TAG itself.
        from torch.utils.tensorboard.summary import text as text_summary
        summary = text_summary(TEXT_TAG, text)
        summary.value[0].tag = TEXT_TAG
        self.writer._get_file_writer().add_summary(summary, step, walltime)

    @property
    def log_dir(self) -> str:
        """The directory the event files go to."""
        return self.writer.get_logdir()

    def close(self) -> None:
        """Flushes; closes the SummaryWriter when this logger made it."""
        if self._owned:
            self.writer.close()
        else:
            self.writer.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _summary_writer(logdir):
    """A SummaryWriter for ``logdir``, or an error that says how to get one."""
    if os.path.exists(logdir) and not os.path.isdir(logdir):
        raise NotADirectoryError(f"nanguard.tensorboard.StepLogger: '{logdir}' is a file, not a directory; "
                                 "TensorBoard reads a directory of event files: name a new or existing directory")
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:  # torch raises this when the tensorboard package is missing
        raise ImportError("nanguard.tensorboard needs the tensorboard package: pip install tensorboard") from e
    return SummaryWriter(log_dir=logdir)
