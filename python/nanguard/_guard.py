"""``nanguard.Guard``: keeps a PyTorch training loop finite.

The guard is the C++ ``nanguard::guard``: its step (checks, policies,
replay, rollback, bundle, event log) runs in C++ and drives the Python
model and optimizer through a training host (``nanguard::training_host``),
so that a Python run behaves, logs and bundles as a C++ one, and
``nanguard report``, ``inspect`` and ``replay`` read it.

:class:`Guard` is the sequence a user drives, each stage in the module of
its concern: build it (its options, checked by ``_options`` from the one
table of them); run a step (``step`` / ``step_accumulated``: the batch
named from the closure's arguments, ``_batches``) or check one a framework
ran (``begin_step`` → ``check``, or ``cancel_step``); the C++ step; then
conclude it (its :class:`StepResult`, ``_results``; a
:class:`NanGuardWarning`; the torch LR schedulers following a rollback,
``_lr_schedulers``; TensorBoard); ``close`` ends the run. Each stage
that warns does its work whole first (``_log.warnings_last``).
"""
from __future__ import annotations

import atexit
import inspect
import logging
import weakref
from types import TracebackType
from typing import (TYPE_CHECKING, Any, Callable, Dict, List, Literal, Mapping, Optional, Sequence, Tuple, Type,
                    Union, cast)

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from . import _compile, _nanguard
from ._args import callable_, integer, items, number, optional, sequence_of, tensor, text
from ._batches import call_of, checked_loss, named_call_tensors, trainable_loss, with_tensors
from ._hosts import host_for
from ._log import Site, hold, tell, user_site, warnings_last
from ._lr_schedulers import follow_rollback
from ._options import (LossScaleOptions, PathLike, Policy, ScheduleOptions, documented, guard_options,
                       keyword_options, read)
from ._results import Finding, NanGuardWarning, NonFiniteError, StepResult
from ._sample_rows import give_sample_indices

#: What a planted fault writes (Guard.inject's ``kind``).
FaultKind = Literal["nan", "inf", "-inf", "bit_flip", "scale"]
FAULT_KINDS = ("nan", "inf", "-inf", "bit_flip", "scale")
#: How often it fires.
FaultMode = Literal["transient", "persistent"]
from .tensorboard import StepLogger

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.utils.tensorboard import SummaryWriter

def _end_run(core: Any, verbose: bool, built_at: Optional[Site]) -> Dict[str, Any]:
    """Ends a guard's run: tells its summary (verbose; a warning after a bad
    step, else an INFO record of the ``nanguard`` logger), attributed to
    the user's frame, else to ``built_at`` (a guard closed at the
    interpreter's exit); returns the summary."""
    summary = core.summary()
    if verbose:
        eventful = summary["not_taken"] > 0 or summary["transient_faults"] > 0
        tell(summary["text"], logging.WARNING if eventful else logging.INFO, fallback=built_at)
    return summary


# The Args entries of the options ({options}) come from their table (_options.documented).
@documented
class Guard:
    """Guards the training steps of ``model`` stepped by ``optimizer``.

        guard = nanguard.Guard(model, opt, policy="rollback", max_norm=1.0,
                               event_log="train.jsonl")
        for x, y in loader:
            r = guard.step(lambda: F.cross_entropy(model(x), y))
            if r.skipped:
                print(r.step, r.action, r.finding)

    Each step: zero grads, ``loss = closure()`` (forward only: the guard
    runs backward), loss check, (scaled) backward, one sentinel pass over the
    gradients, unscale + clip by norm in one write, optional clip by value,
    ``optimizer.step()``. When the loss or a gradient is not finite the
    optimizer does not step: the guard replays the step (same parameters,
    same RNG state) under :func:`nanguard.trace` to name the op that made
    the NaN/Inf, then applies ``policy``.

    ``model`` may be compiled (``torch.compile(model)`` or
    ``model.compile()``): healthy steps run the compiled code as it is; a
    replay (and ``trace_every_step``) runs it eagerly, so the finding names
    the op and module as for the eager model (``fc1``, not
    ``_orig_mod.fc1``). When that eager replay stays finite, the guard runs
    the step under each stage of the compiler (aot_eager, then the compiled
    code with Inductor's kernels checked): ``verdict`` "compiled only", and
    ``note`` names the stage and the fused kernel (docs/compile.md).

    A ``DistributedDataParallel`` model or an FSDP2 (``fully_shard``) one is
    distributed on its own process group without asking (``distributed``
    None, True or that group): the model reduces the gradients, the guard
    names the rank whose own loss or gradients were not finite before that
    (hooks on the parameters), and a replay runs on every rank. Building
    the guard is then a collective (it checks that every rank guards as
    many parameters).

    Args:
        model: the module whose parameters the optimizer steps.
        optimizer: a first-order ``torch.optim`` optimizer over (some of)
            ``model``'s parameters.
        {options}

    Raises:
        TypeError: a model that is no ``torch.nn.Module``, an optimizer
            that is no ``torch.optim.Optimizer``, an unknown option (named,
            with the closest one), an option passed by position, or a value
            of the wrong type.
        ValueError: a value the C++ guard refuses (named), an optimizer that
            holds none of the model's trainable parameters, or a model on
            the meta device.
        OSError: ``event_log`` cannot be written.

    NOTE: the closure must depend only on the batch, the parameters and the
    RNG, so that a replay repeats it. Replays restore the CPU RNG.
    """


    @keyword_options("nanguard.Guard")
    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, policy: Policy = "auto",
                 max_norm: float = 0.0, clip_value: float = 0.0,
                 loss_scale: Union[bool, LossScaleOptions] = False, replay: bool = True,
                 trace_every_step: bool = False, replay_spikes: bool = True, audit_every: int = 0,
                 verify_remedies: bool = True, auto_fix: bool = False,
                 event_log: Optional[PathLike] = None, snapshot_every: int = 10,
                 snapshot_keep: int = 2, snapshot_memory_mb: float = 0.0, rollback_lr_factor: float = 0.5,
                 spike_rollback_z: float = 100.0,
                 max_bad_steps: int = 20, max_bad_fraction: float = 0.5,
                 bundle_dir: Optional[PathLike] = None, spike_window: int = 50, spike_threshold: float = 8.0,
                 bundle_tags: Optional[Mapping[str, object]] = None, log_top_norms: int = 5,
                 schedule: Union[_nanguard.WarmupCosine, ScheduleOptions, None] = None,
                 lr_scheduler: Union[LRScheduler, ReduceLROnPlateau, Sequence[Any], None] = None,
                 tensorboard: Union[PathLike, SummaryWriter, StepLogger, None] = None,
                 distributed: Union[bool, ProcessGroup, _nanguard.Distributed, None] = None,
                 verbose: bool = True) -> None:
        _check_types(model, optimizer)
        # The signature's options, each checked by its type (the table's).
        options = read(locals())
        _check_parameters(model, optimizer)
        self.model = model
        self.optimizer = optimizer
        self.policy: Policy = options["policy"]
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        self._needs_closure = closure is not None and closure.default is inspect.Parameter.empty
        if options["event_log"]:
            open(options["event_log"], "w", encoding="utf-8").close()  # unwritable: the OSError Python raises
        #: The torch LR schedulers a rollback lowers with the LR (``lr_scheduler``).
        self.lr_schedulers: List[Any] = _own_schedulers(options["lr_scheduler"], optimizer)
        self._tensorboard, self._own_tensorboard = _step_logger(options["tensorboard"])
        _compile.watch_compilation()
        self._host, group = host_for(model, optimizer, distributed)
        # Python warns (NanGuardWarning), not C++ on stderr.
        self._core: Optional[_nanguard.GuardCore] = _nanguard.GuardCore(
            self._host, guard_options(options, distributed=group, verbose=False))
        self._verbose = options["verbose"] and getattr(group, "rank", 0) == 0
        # On close(), or when collected; its summary falls back on where the guard was built (at exit).
        self._end = weakref.finalize(self, _end_run, self._core, self._verbose, user_site())
        self._summary: Optional[Dict[str, Any]] = None  # after close(): the run's
        self._concluded: Optional[int] = None  # the number of the last step Python concluded
        _open_guards.add(self)

    # -- a step the guard runs: step -> step_accumulated -> the C++ step ----------
    def step(self, closure: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> StepResult:
        """Runs one guarded step: ``loss = closure(*args, **kwargs)`` then the
        checks, backward, clipping and ``optimizer.step()`` or the policy.

        Args:
            closure: the forward pass: returns the scalar loss tensor (the
                guard runs backward; the closure must not).
            *args: the closure's arguments (the tensors among them are the
                batch a bundle keeps and a finding names).
            **kwargs: its keyword arguments.

        Returns:
            The step's :class:`StepResult` (also the event log's line).

        Raises:
            NonFiniteError: policy "abort" (or ``max_bad_steps``) on a bad step.
            TypeError: the closure returned no tensor, or the optimizer needs
                a closure of its own (LBFGS).
            ValueError: the loss depends on no trainable parameter.
        """
        return self.step_accumulated(closure, [(args, kwargs)])

    def step_accumulated(self, closure: Callable[..., torch.Tensor], micro_batches: Sequence[Any]) -> StepResult:
        """One guarded optimizer step over several micro-batches (gradient
        accumulation): ``closure(*args, **kwargs)`` for each ``(args,
        kwargs)`` pair of ``micro_batches`` (or each tuple of arguments), its
        loss divided by their number before backward; the checks run once,
        over the accumulated gradients. The step's loss is the mean of the
        micro-batches' losses; a replay runs them all again.

            guard.step_accumulated(lambda x, y: F.cross_entropy(model(x), y),
                                   [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])
        """
        if self._needs_closure:  # LBFGS: a framework that steps it itself can still check() its steps
            raise TypeError(f"nanguard.Guard.step: {type(self.optimizer).__name__}.step needs a closure (it "
                            "evaluates the loss several times per step), and the guard steps once on the gradients "
                            "it checked: use a first-order optimizer such as torch.optim.SGD or AdamW")
        callable_("nanguard.Guard.step", "closure", closure, "the forward: a callable that returns the loss tensor")
        calls = [call_of(mb) for mb in items("nanguard.Guard.step_accumulated", "micro_batches", micro_batches,
                                             "a list of (args, kwargs) pairs or tuples of arguments")]
        if not calls:
            raise ValueError("nanguard.Guard.step_accumulated: micro_batches is empty; pass at least one "
                             "(args, kwargs) pair or tuple of arguments")

        def forward(index: int, tensors: List[torch.Tensor]) -> torch.Tensor:
            # Micro-batch `index`, or (another batch: the batch without its
            # NaN/Inf rows, another rank's) its call with those tensors.
            args, kwargs = calls[index]
            if any(t is not own for t, own in zip(tensors, batches[index])) or len(tensors) != len(batches[index]):
                args, kwargs = with_tensors(args, kwargs, tensors)
            return trainable_loss(closure(*args, **kwargs))

        named = [named_call_tensors(closure, *call) for call in calls]
        batches = [tensors for tensors, _ in named]
        give_sample_indices(self._active(), batches)  # from a loader of nanguard.data.track_indices
        # Findings name the tensors of each micro-batch by the first's names.
        return self._run(lambda core: core.step_accumulated(batches, forward, named[0][1]))

    # -- a step a framework runs: begin_step -> check (or cancel_step) ------------
    def begin_step(self, step: Optional[int] = None) -> None:
        """Starts one optimizer step when a framework runs forward, backward
        and ``optimizer.step()`` itself (the integrations do): counts it,
        applies the schedule and keeps the RNG state a replay starts from.
        Call it before the first forward of the step, then :meth:`check`.

        ``step``: the number the framework knows the step by (its step
        counter, e.g. Lightning's ``trainer.global_step``): the event log,
        findings and warnings use it from then on, and the initial weights
        are the number before the first step's. None (the default): one
        above the last step's, from 1. A ValueError when it is negative or
        not above the last step's."""
        self._active().begin_step(optional(integer, "nanguard.Guard.begin_step", "step", step, minimum=0))

    def cancel_step(self) -> None:
        """Drops the step :meth:`begin_step` started when the framework
        skipped it (Lightning's ``training_step`` returned None for every
        micro-batch): nothing is checked or logged, and the step is not
        counted."""
        self._active().cancel_step()

    def check(self, loss: Union[torch.Tensor, float], replay: Optional[Callable[[], torch.Tensor]] = None,
              batch: Sequence[torch.Tensor] = (), names: Sequence[str] = ()) -> StepResult:
        """Checks a step a framework ran: after backward (of every
        micro-batch) and before its ``optimizer.step()``, with the unscaled
        gradients in ``p.grad``. One sentinel pass over them and the loss
        check; a healthy step is clipped by ``max_norm`` and logged, and the
        caller's optimizer steps. On a bad step ``replay()`` (a callable that
        runs the forward again and returns the loss; the guard runs backward)
        is traced from :meth:`begin_step`'s RNG state to name the op, the
        policy acts, and the gradients are set to None so that the coming
        ``optimizer.step()`` changes nothing (abort raises
        :class:`NonFiniteError`). ``loss`` is a tensor or a number;
        ``batch`` the tensors an abort's bundle keeps, ``names`` what findings
        call them (``names[i]`` names ``batch[i]``: "labels", "x"; else
        "batch[i]"). Returns a :class:`StepResult`. A finite ``loss`` with no
        gradient written since :meth:`begin_step` (no backward) is a
        ValueError."""
        where = "nanguard.Guard.check"
        loss = checked_loss(where, loss)
        optional(callable_, where, "replay", replay, "None or a callable that runs the forward again and returns "
                                                     "the loss")
        tensors = sequence_of(tensor, where, "batch", batch, "a list of tensors")
        names = sequence_of(text, where, "names", names, "a list of str")
        forward = None if replay is None else (lambda _batch: trainable_loss(replay()))
        return self._run(lambda core: core.check(loss, forward, tensors, names))

    # -- a planted fault -----------------------------------------------------------
    def inject(self, op: str, *, step: int, kind: FaultKind = "nan", mode: FaultMode = "transient",
               direction: Literal["forward", "backward"] = "forward", rank: int = -1, occurrence: int = 0,
               element: int = 0, bit: int = 30, factor: float = 1e6) -> None:
        """Plants a fault in this guard's steps, to test what it detects and
        how it classifies it (docs/hardware-or-software.md): at step
        ``step`` (its number), ``kind`` ("nan", "inf", "-inf", "bit_flip" of
        bit ``bit``, "scale" by ``factor``) is written into element
        ``element`` of the output of call ``occurrence`` of ATen op ``op``
        ("aten::addmm") in ``direction``, on rank ``rank`` (-1: every
        rank), once ("transient": a replay of the step runs clean) or on
        every call from that step on ("persistent": a replay reproduces it).
        The step's event says so in its note ("injected: ..."). It replaces
        a fault planted before; the environment variable ``NANGUARD_INJECT``
        ("op=aten::addmm,step=5,kind=nan") plants one when a guard is made.

            guard.inject("aten::addmm", step=5, kind="bit_flip", bit=30, mode="persistent")

        A ValueError names an op PyTorch does not know, a rank outside the
        guard's group or a step that has passed."""
        where = "nanguard.Guard.inject"
        fields = {"op": text(where, "op", op), "step": integer(where, "step", step, minimum=0),
                  "kind": text(where, "kind", kind, choices=FAULT_KINDS),
                  "mode": text(where, "mode", mode, choices=("transient", "persistent")),
                  "direction": text(where, "direction", direction, choices=("forward", "backward")),
                  "rank": integer(where, "rank", rank, minimum=-1),
                  "occurrence": integer(where, "occurrence", occurrence, minimum=0),
                  "element": integer(where, "element", element, minimum=0),
                  "bit": integer(where, "bit", bit, minimum=0), "factor": repr(number(where, "factor", factor))}
        self._active().inject(",".join(f"{k}={v}" for k, v in fields.items()))

    # -- the C++ step, then its conclusion -----------------------------------------
    @warnings_last()
    def _run(self, call: Callable[[_nanguard.GuardCore], _nanguard.StepEvent]) -> StepResult:
        """The C++ step ``call(core)``, concluded; the guard's abort as NonFiniteError."""
        core = self._active()
        lr_factor = core.lr_factor
        try:
            event = call(core)
        except _nanguard.GuardAbort as abort:
            raise self._aborted(abort.args[0]) from None
        except Warning as warning:
            # A C++ warning that a filter made an error once the step had ended
            # (python_warnings in python/src) waits for its conclusion; one
            # from the closure or the optimizer has ended no step.
            ended = self._unconcluded(core)
            if ended is None:
                raise
            hold(warning)
            event = ended
        return self._conclude(event, lr_factor)

    def _unconcluded(self, core: _nanguard.GuardCore) -> Optional[_nanguard.StepEvent]:
        """The event of the last step the C++ guard ended, unless Python has concluded it."""
        if core.summary()["steps"] == 0:
            return None
        event = core.last_event()
        return None if event.step == self._concluded else event

    def _conclude(self, event: _nanguard.StepEvent, lr_factor_before: float) -> StepResult:
        """What Python adds to a step's event: its StepResult, the warning of
        a step not taken, the LR schedulers lowered with a rollback's LR, and
        its TensorBoard scalars."""
        result = StepResult.from_event(event)
        self._concluded = result.step
        self._warn()  # a step not taken, or the first step of a forecast
        follow_rollback(self.lr_schedulers, lr_factor_before, self._active().lr_factor)
        if self._tensorboard is not None:
            self._tensorboard.log(result)
        return result

    def _aborted(self, finding_json: str) -> NonFiniteError:
        """The NonFiniteError of an abort (its finding's JSON), with the step's result; warned."""
        result = StepResult.from_event(self._active().last_event())
        self._concluded = result.step
        self._warn()
        return NonFiniteError(Finding.from_json(finding_json), result=result)

    def _warn(self) -> None:
        """The last step's warning, if it has one, as a NanGuardWarning (verbose)."""
        if self._verbose and self._active().last_warning:
            tell(self._active().last_warning)

    def _active(self) -> _nanguard.GuardCore:
        if self._core is None:
            raise RuntimeError("nanguard.Guard: the guard is closed")
        return self._core

    # -- state ------------------------------------------------------------------
    @property
    def steps(self) -> int:
        """Steps run so far."""
        return self._active().steps

    @property
    def skipped(self) -> int:
        """Steps the optimizer did not take."""
        return self._active().skipped

    @property
    def rollbacks(self) -> int:
        """Rollbacks so far."""
        return self._active().rollbacks

    @property
    def lr_factor(self) -> float:
        """The product of the rollback LR factors so far."""
        return self._active().lr_factor

    @property
    def scaler(self) -> _nanguard.LossScaler:
        """The loss scaler (``get_scale()``, ``enabled``, ...)."""
        return self._active().scaler

    @property
    def sentinel(self) -> _nanguard.Sentinel:
        """The sentinel (its spike windows, parameter names)."""
        return self._active().sentinel

    def summary(self) -> Dict[str, Any]:
        """What the run did so far (after :meth:`close`: the whole run), a dict:
        ``steps``, ``not_taken`` (bad steps: skipped, rolled back or stopped),
        ``rolled_back``, ``last_bad_step``, ``last_cause`` (the finding's cause
        or the step's reason), ``last_rollback_to`` and ``ended_on_snapshot``
        (0: the initial weights; -1: none), ``aborted``, ``first_step`` /
        ``first_loss`` and ``final_step`` / ``final_loss`` (the first and last
        steps the optimizer took), ``loss_scale``, ``lr`` and ``first_lr`` (of
        the last and the first step), ``auto_fix`` and ``auto_fix_since`` (the
        op rewrite ``auto_fix`` keeps in force and the step from which; "" and
        -1: none), ``status`` (how the run ended:
        "finite", "recovered", "unrecovered", "nonfinite" or "empty", as
        ``nanguard report`` shows it), and ``text``, the line a verbose guard
        warns when it closes after a bad step."""
        if self._core is None:
            return cast(Dict[str, Any], self._summary)
        return self._core.summary()

    @warnings_last()  # closed whole, its summary kept, before the summary's warning
    def close(self) -> None:
        """Closes the event log (and the TensorBoard logger it made) and lets
        go of the process group (distributed); the guard steps no more. When a step was not taken it
        warns the run's summary (verbose). Garbage collection and the
        interpreter's exit close a guard too."""
        if self._core is not None:
            self._summary = self._end()
        self._core = None
        if self._own_tensorboard is not None:
            self._own_tensorboard.close()
            self._own_tensorboard = None

    def __enter__(self) -> "Guard":
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Literal[False]:
        with warnings_last(exc):  # the block's error wins over the summary's warning
            self.close()
        return False


def _check_types(model: Any, optimizer: Any) -> None:
    """A TypeError unless ``model`` is a module and ``optimizer`` an optimizer."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError("nanguard.Guard: model must be the torch.nn.Module the optimizer trains, got "
                        f"{type(model).__name__}")
    if not hasattr(optimizer, "param_groups"):
        raise TypeError("nanguard.Guard: optimizer must be a torch.optim.Optimizer over the model's parameters "
                        f"(one guard per optimizer), e.g. torch.optim.AdamW(model.parameters()), got "
                        f"{type(optimizer).__name__}")


def _check_parameters(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A ValueError unless ``optimizer`` steps some of ``model``'s trainable
    parameters, and they hold values (not on the meta device)."""
    stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
    if not any(id(p) in stepped for p in model.parameters() if p.requires_grad):
        raise ValueError("nanguard.Guard: the optimizer holds none of the model's trainable parameters, so "
                         "no step would change the model; build it from this model's parameters, e.g. "
                         "torch.optim.AdamW(model.parameters())")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("nanguard.Guard: the model's parameters are on the meta device and hold no values; "
                         "materialize them first, e.g. model.to_empty(device='cpu') then initialize them")


def _own_schedulers(schedulers: List[Any], optimizer: torch.optim.Optimizer) -> List[Any]:
    """``schedulers``, each of which must schedule ``optimizer``: a rollback
    lowers them, and lowering another run's schedule would cut its LR."""
    for s in schedulers:
        if getattr(s, "optimizer", optimizer) is not optimizer:
            raise ValueError(f"nanguard.Guard: lr_scheduler {type(s).__name__} schedules another optimizer "
                             f"({type(s.optimizer).__name__} at {id(s.optimizer):#x}), not this guard's; give the "
                             "schedulers of the optimizer the guard steps")
    return schedulers


def _step_logger(tensorboard: Union[PathLike, SummaryWriter, StepLogger, None]
                 ) -> Tuple[Optional[StepLogger], Optional[StepLogger]]:
    """The StepLogger of ``Guard(tensorboard=...)``, and again when the
    guard made it (and closes it)."""
    if tensorboard is None or isinstance(tensorboard, StepLogger):
        return tensorboard, None
    logger = StepLogger(tensorboard)
    return logger, logger


#: The guards not closed yet: closed at exit, before the interpreter tears
#: down torch.distributed (a process group a guard kept alive past
#: destroy_process_group, destroyed during the interpreter's teardown,
#: aborted the process: "terminate called without an active exception").
_open_guards: "weakref.WeakSet[Guard]" = weakref.WeakSet()


@atexit.register
@warnings_last()  # every guard closes
def _close_open_guards() -> None:
    for guard in list(_open_guards):
        guard.close()
