"""``nanguard.Guard``: keeps a PyTorch training loop finite.

The guard is the C++ ``nanguard::guard``: its step (checks, policies,
replay, rollback, bundle, event log) runs in C++ and drives the Python
model and optimizer through a training host (``nanguard::training_host``),
so that a Python run behaves, logs and bundles as a C++ one, and
``nanguard report``, ``inspect`` and ``replay`` read it.
"""
from __future__ import annotations

import atexit
import difflib
import functools
import inspect
import json
import os
import sys
import warnings
import weakref
from dataclasses import dataclass, field
from typing import (TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Literal, Mapping, Optional, Sequence,
                    Tuple, TypedDict, TypeVar, Union, cast)

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

from . import _compile, _nanguard
from ._hosts import host_for
from ._trace import Finding, NonFiniteError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from torch.utils.tensorboard import SummaryWriter

    from .tensorboard import StepLogger

#: The guard's policies, from the C++ ``nanguard::policy``.
POLICIES = _nanguard.POLICIES
#: A policy's name (``POLICIES``, checked against it by the tests).
Policy = Literal["auto", "skip", "backoff", "rollback", "abort"]
#: A step's action: "step" (healthy) or the policy that acted ("data": the firewall dropped the batch).
Action = Literal["step", "skip", "backoff", "rollback", "abort", "data"]
#: A replay's verdict ("": no replay).
Verdict = Literal["", "reproduced", "not reproduced", "replay failed", "compiled only"]
#: A file path as the guard's options take it.
PathLike = Union[str, "os.PathLike[str]"]


class NanGuardWarning(UserWarning):
    """What a :class:`Guard` tells its user: one for each step the optimizer
    did not take (the op, the cause, what the guard did and the remedy; the
    same failure again in a few words, "again (3rd time)"), and the summary
    of a run that had one when the guard closes. Silence it with
    ``Guard(verbose=False)`` (or the callbacks' ``verbose=False``), or
    ``warnings.filterwarnings("ignore", category=nanguard.NanGuardWarning)``."""


_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _warn_user(message: str) -> None:
    """Warns ``message`` as a NanGuardWarning attributed to the first frame
    outside nanguard: the user's ``guard.step``, ``close`` or framework call."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: the caller
    while frame is not None and frame.f_code.co_filename.startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, NanGuardWarning, stacklevel=level)


def _end_run(core: Any, verbose: bool) -> Dict[str, Any]:
    """Ends a guard's run: when it had a bad step, warns its summary;
    returns the summary."""
    summary = core.summary()
    if verbose and summary["not_taken"] > 0:
        _warn_user(summary["text"])
    return summary


@dataclass
class StepResult:
    """What one guarded step did: the C++ guard's step event.

    ``step`` counts from 1. ``action`` is "step" for a healthy step, else
    the policy that acted ("skip", "backoff", "rollback", "abort").
    ``reason`` says what made a bad step bad ("non-finite loss",
    "non-finite gradient", "gradient checksum differs on rank(s) 3", ...;
    "" on a healthy step) and ``note`` what else the guard noted
    (which layers moved most before a rollback, ...). ``finding`` is the
    replay's :class:`~nanguard.Finding` (or None), diagnosed with the steps
    before (``finding.cause``, ``finding.remedy``), and ``verdict``
    "reproduced" / "not reproduced" / "compiled only" (a compiled model's
    eager replay is finite, its compiled code is not: ``note`` names the
    stage and kernel) / "replay failed" / "" (no replay). ``nonfinite_params``
    lists (name, NaN/Inf count) of the gradients that held any,
    ``top_norms`` (name, norm) of the largest per-parameter gradient norms;
    ``bundle`` is the repro bundle an abort wrote and ``rollback_to`` the
    snapshot a rollback restored (steps done then); ``remedy`` is what the
    guard did about a bad step, e.g. "skipped the step; loss scale 65536 ->
    32768" ("" on a healthy step). ``to_dict()`` gives the event log's line.
    """

    step: int
    loss: float
    grad_norm: float
    action: Action
    skipped: bool
    scale: float
    lr: float
    reason: str = ""
    first_nonfinite_param: str = ""
    finding: Optional[Finding] = None
    verdict: Verdict = ""
    spikes: List[Tuple[str, float, float]] = field(default_factory=list)
    nonfinite_params: List[Tuple[str, int]] = field(default_factory=list)
    top_norms: List[Tuple[str, float]] = field(default_factory=list)
    clip_coef: float = 1.0
    bundle: str = ""
    rollback_to: int = -1
    remedy: str = ""
    note: str = ""
    rank: int = -1
    nonfinite_ranks: List[int] = field(default_factory=list)
    _event: Optional[_nanguard.StepEvent] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_event(cls, event: _nanguard.StepEvent) -> "StepResult":
        """The result of the C++ step event ``event``."""
        bad = event.nonfinite_params
        findings = event.findings_json
        return cls(step=event.step, loss=event.loss, grad_norm=event.grad_norm, action=cast(Action, event.action),
                   skipped=event.skipped, scale=event.scale, lr=event.lr, reason=event.reason,
                   first_nonfinite_param=bad[0][0] if bad else "",
                   finding=Finding.from_json(findings[0]) if findings else None,
                   verdict=cast(Verdict, event.verdict), spikes=event.spikes, nonfinite_params=bad,
                   top_norms=event.top_norms, clip_coef=event.clip_coef, bundle=event.bundle,
                   rollback_to=event.rollback_to, remedy=event.remedy, note=event.note, rank=event.rank,
                   nonfinite_ranks=event.nonfinite_ranks, _event=event)

    def to_dict(self) -> Dict[str, Any]:
        """The event as the event log holds it (``nanguard::step_event``; NaN
        and Inf as "nan", "inf", "-inf")."""
        return {} if self._event is None else cast(Dict[str, Any], json.loads(self._event.to_json()))


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

#: The front end (``nanguard::front_end``) of the framework a callback tags its
#: guard's bundles with; a Guard of a plain loop is "python".
FRONT_ENDS = {"lightning": "lightning", "transformers": "transformers"}


#: The arguments of LossScaler and WarmupCosine, which loss_scale={...} and schedule={...} hold.
LOSS_SCALE_KEYS = tuple(LossScaleOptions.__annotations__)
SCHEDULE_KEYS = tuple(ScheduleOptions.__annotations__)


def unknown_option_error(where: str, name: str, known: Sequence[str]) -> TypeError:
    """The TypeError for an option ``name`` that is none of ``known``: it
    names it, the closest known name and all of them."""
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return TypeError(f"{where}: unknown option {name!r}{hint} (the options are {', '.join(known)})")


def _known_keys(option: str, given: Mapping[str, Any], keys: Sequence[str]) -> Dict[str, Any]:
    """``given`` (a dict) when each of its keys is one of ``keys``; else a
    TypeError naming the first unknown key."""
    for k in dict(given):
        if k not in keys:
            raise unknown_option_error(f"nanguard.Guard: {option}", k, keys)
    return dict(given)


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


def _trainable_loss(loss: object) -> torch.Tensor:
    """``loss`` when the guard can run backward on it; else a TypeError (not a
    tensor) or a ValueError (a tensor that no gradient flows from)."""
    if not isinstance(loss, torch.Tensor):
        raise TypeError("nanguard.Guard.step: the closure must return the loss tensor, e.g. "
                        f"lambda: F.mse_loss(model(x), y), but it returned {type(loss).__name__}")
    if not loss.is_floating_point() or not loss.requires_grad:
        got = str(loss.dtype) if not loss.is_floating_point() else "a tensor that does not require grad"
        raise ValueError("nanguard.Guard.step: the loss must be a floating-point tensor that depends on the "
                         f"model's trainable parameters, got {got} (computed under torch.no_grad, detached, "
                         "or from frozen parameters?)")
    return loss


def _call_of(micro_batch: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
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


def _positional_parameters(fn: Callable[..., Any]) -> List[inspect.Parameter]:
    """The parameters of ``fn`` that positional arguments fill, in order
    (none for a builtin or a C extension: no signature)."""
    try:
        return [p for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return []


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

    ``verbose`` (default True): every step the optimizer does not take is a
    :class:`NanGuardWarning` naming the op, its cause, what the guard did and
    the remedy (the same failure again: a short "again (3rd time)" line), and
    :meth:`close` warns the run's summary (:meth:`summary`) when there was
    one; distributed, rank 0 warns. False: silent (the results, the event
    log and :meth:`summary` still have it all).

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
        policy: what a bad step gets: ``"auto"`` (the action for the
            diagnosed cause: bad data is skipped and its batch quarantined,
            a divergence or an overflow rolls back, a loss-scale overflow
            backs off, another cause is skipped; docs/guard.md's decision
            table), ``"skip"`` (drop it; an enabled loss
            scaler still backs off), ``"backoff"`` (drop it and back off the
            loss scale), ``"rollback"`` (restore the last snapshot of model
            and optimizer and multiply the LR by ``rollback_lr_factor``) or
            ``"abort"`` (write a repro bundle to ``bundle_dir``, if set, and
            raise :class:`NonFiniteError`, whose ``result`` is the step's
            :class:`StepResult`).
        max_norm: clip the global gradient norm to this (0: no clipping).
        clip_value: clamp gradient elements to ±clip_value after (0: off).
        loss_scale: False (off), True (GradScaler's defaults) or a dict of
            ``LossScaler`` options (``init_scale``, ``growth_factor``, ...).
        replay: replay a bad step under the tracer to name the op.
        trace_every_step: trace every step's forward and backward instead
            (the cost of :func:`nanguard.trace` on every step): a bad step's
            findings come from the step itself.
        event_log: a JSONL file, one C++ step event per step (``nanguard
            report`` and :func:`nanguard.report` turn it into HTML).
        snapshot_every: rollback and auto: snapshot every this many steps
            (auto: less often when a snapshot costs more than 0.2% of the
            steps between), before the optimizer steps on parameters just
            checked finite.
        snapshot_keep: rollback and auto: the newest snapshots kept, and as
            many older ones, one per 10 x snapshot_every steps.
        rollback_lr_factor: rollback and auto: the LR is multiplied by this each time.
        spike_rollback_z: auto: a loss spike of at least this robust
            z-score (and 10x the median loss before) on 3 steps in a row
            rolls back before the NaN (0: off).
        max_bad_steps: aborts after that many bad steps in a row (0: never).
        max_bad_fraction: aborts when more than this fraction of the last
            100 steps (once there are 20) were bad (1: never).
        bundle_dir: where an abort writes its bundle (``nanguard inspect``
            and :func:`nanguard.inspect` read it); its batch is the tensors
            passed to :meth:`step` as arguments.
        spike_window: steps of loss and grad-norm history a spike is judged against.
        spike_threshold: a z-score above this is a spike.
        bundle_tags: name -> value tags a bundle carries, e.g.
            ``{"task": "classify"}`` for ``nanguard replay BUNDLE --model
            scripted.pt``.
        log_top_norms: each event lists this many of the largest
            per-parameter gradient norms.
        schedule: a :class:`WarmupCosine` (or a dict of its arguments) the
            guard applies to every param group at the start of each step,
            times the product of the rollback factors.
        lr_scheduler: a torch LR scheduler (or a list of them) the loop
            steps: a rollback lowers what it computes the LR from (its base
            LRs; OneCycleLR's and CyclicLR's bounds) by the rollback factor
            too, or its next step would undo the rollback's lower LR
            (``lr_schedulers`` holds them).
        tensorboard: a log directory, a ``SummaryWriter`` or a
            :class:`nanguard.tensorboard.StepLogger`: every step's loss, grad
            norm, per-layer norms, loss scale, LR, skips and findings go to
            TensorBoard too.
        distributed: True (torch.distributed's default process group), a
            ``ProcessGroup`` or a :class:`nanguard.Distributed`: data
            parallel on an unwrapped model: the guard averages the gradients
            over the ranks, one small all-reduce a step makes every rank
            take the same decision, and every rank's result names the ranks
            that saw the NaN/Inf (``nonfinite_ranks``).

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
                 trace_every_step: bool = False, event_log: Optional[PathLike] = None, snapshot_every: int = 10,
                 snapshot_keep: int = 2, rollback_lr_factor: float = 0.5, spike_rollback_z: float = 100.0,
                 max_bad_steps: int = 20, max_bad_fraction: float = 0.5,
                 bundle_dir: Optional[PathLike] = None, spike_window: int = 50, spike_threshold: float = 8.0,
                 bundle_tags: Optional[Mapping[str, object]] = None, log_top_norms: int = 5,
                 schedule: Union[_nanguard.WarmupCosine, ScheduleOptions, None] = None,
                 lr_scheduler: Union[LRScheduler, ReduceLROnPlateau, Sequence[Any], None] = None,
                 tensorboard: Union[PathLike, SummaryWriter, StepLogger, None] = None,
                 distributed: Union[bool, ProcessGroup, _nanguard.Distributed, None] = None,
                 verbose: bool = True) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError("nanguard.Guard: model must be the torch.nn.Module the optimizer trains, got "
                            f"{type(model).__name__}")
        if not hasattr(optimizer, "param_groups"):
            raise TypeError("nanguard.Guard: optimizer must be a torch.optim.Optimizer over the model's parameters "
                            f"(one guard per optimizer), e.g. torch.optim.AdamW(model.parameters()), got "
                            f"{type(optimizer).__name__}")
        # The options are checked by the C++ guard (ValueError); the policy first.
        policy = cast(Policy, _nanguard.policy_from_string(policy))
        self.model = model
        self.optimizer = optimizer
        self.policy: Policy = policy
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not any(id(p) in stepped for p in model.parameters() if p.requires_grad):
            raise ValueError("nanguard.Guard: the optimizer holds none of the model's trainable parameters, so "
                             "no step would change the model; build it from this model's parameters, e.g. "
                             "torch.optim.AdamW(model.parameters())")
        if any(p.is_meta for p in model.parameters()):
            raise ValueError("nanguard.Guard: the model's parameters are on the meta device and hold no values; "
                             "materialize them first, e.g. model.to_empty(device='cpu') then initialize them")
        closure = inspect.signature(optimizer.step).parameters.get("closure")
        self._needs_closure = closure is not None and closure.default is inspect.Parameter.empty
        event_log, bundle_dir = _path("event_log", event_log), _path("bundle_dir", bundle_dir)
        if event_log:
            open(event_log, "w", encoding="utf-8").close()  # unwritable: the OSError Python raises
        if bundle_tags is not None and not isinstance(bundle_tags, Mapping):
            raise TypeError("nanguard.Guard: bundle_tags must be a dict of name -> value, e.g. "
                            f"{{'task': 'classify'}}, got {type(bundle_tags).__name__}")
        options = _nanguard.GuardOptions()
        options.policy = policy
        options.max_norm = float(max_norm)
        options.clip_value = float(clip_value)
        options.replay = bool(replay)
        options.trace_every_step = bool(trace_every_step)
        options.log_top_norms = _int64("log_top_norms", log_top_norms)
        options.event_log = event_log
        options.bundle_dir = bundle_dir
        options.bundle_tags = [("front_end", "python")] + [(str(k), str(v)) for k, v in (bundle_tags or {}).items()]
        # The callbacks tag their framework: remedies are written for it.
        options.front_end = FRONT_ENDS.get(str((bundle_tags or {}).get("framework")), "python")
        options.snapshot_every = _int64("snapshot_every", snapshot_every)
        options.snapshot_keep = _int64("snapshot_keep", snapshot_keep)
        options.rollback_lr_factor = float(rollback_lr_factor)
        options.max_bad_steps = _int64("max_bad_steps", max_bad_steps)
        options.max_bad_fraction = float(max_bad_fraction)
        options.spike_rollback_z = float(spike_rollback_z)
        options.spike_window = _int64("spike_window", spike_window)
        options.spike_threshold = float(spike_threshold)
        options.scaler = _loss_scaler(loss_scale)
        options.verbose = False  # Python warns (NanGuardWarning), not C++ on stderr
        options.schedule = _schedule(schedule)
        #: The torch LR schedulers a rollback lowers with the LR (``lr_scheduler``).
        self.lr_schedulers: List[Any] = _schedulers(lr_scheduler)
        self._tensorboard: Optional[StepLogger] = None
        self._own_tensorboard: Optional[StepLogger] = None
        if tensorboard is not None:
            from .tensorboard import StepLogger
            if isinstance(tensorboard, StepLogger):
                self._tensorboard = tensorboard
            else:
                self._tensorboard = self._own_tensorboard = StepLogger(tensorboard)
        _compile.watch_compilation()
        self._host, options.distributed = host_for(model, optimizer, distributed)
        self._core: Optional[_nanguard.GuardCore] = _nanguard.GuardCore(self._host, options)
        self._verbose = bool(verbose) and getattr(options.distributed, "rank", 0) == 0
        # On close(), or when collected.
        self._end = weakref.finalize(self, _end_run, self._core, self._verbose)
        self._summary: Optional[Dict[str, Any]] = None  # after close(): the run's
        _open_guards.add(self)

    # -- the step -------------------------------------------------------------
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
        calls = [_call_of(mb) for mb in micro_batches]
        if not calls:
            raise ValueError("nanguard.Guard.step_accumulated: micro_batches is empty; pass at least one "
                             "(args, kwargs) pair or tuple of arguments")

        def forward(index: int) -> torch.Tensor:
            args, kwargs = calls[index]
            return _trainable_loss(closure(*args, **kwargs))

        named = [named_call_tensors(closure, *call) for call in calls]
        batches = [tensors for tensors, _ in named]
        # Findings name the tensors of each micro-batch by the first's names.
        return self._run(lambda core: core.step_accumulated(batches, forward, named[0][1]))

    def begin_step(self) -> None:
        """Starts one optimizer step when a framework runs forward, backward
        and ``optimizer.step()`` itself (the integrations do): counts it,
        applies the schedule and keeps the RNG state a replay starts from.
        Call it before the first forward of the step, then :meth:`check`."""
        self._active().begin_step()

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
        loss = loss.detach() if isinstance(loss, torch.Tensor) else torch.tensor(float(loss))
        forward = None if replay is None else (lambda _batch: _trainable_loss(replay()))
        return self._run(lambda core: core.check(loss, forward, list(batch), [str(n) for n in names]))

    def _run(self, call: Callable[[_nanguard.GuardCore], _nanguard.StepEvent]) -> StepResult:
        """A StepResult of ``call(core)``; the guard's abort as NonFiniteError.
        A rollback lowers ``lr_schedulers`` by the factor it applied."""
        lr_factor = self._active().lr_factor
        try:
            result = StepResult.from_event(call(self._active()))
        except _nanguard.GuardAbort as abort:
            event = StepResult.from_event(self._active().last_event())
            self._warn()
            raise NonFiniteError(Finding.from_json(abort.args[0]), result=event) from None
        if result.skipped:
            self._warn()
        if self._active().lr_factor != lr_factor:
            lower_scheduler_lrs(self.lr_schedulers, self._active().lr_factor / lr_factor)
        if self._tensorboard is not None:
            self._tensorboard.log(result)
        return result

    def _warn(self) -> None:
        """The last step's warning, as a NanGuardWarning (verbose)."""
        if self._verbose:
            _warn_user(self._active().last_warning)

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
        steps the optimizer took), ``loss_scale``, ``lr``, and ``text``, the
        line a verbose guard warns when it closes after a bad step."""
        if self._core is None:
            return cast(Dict[str, Any], self._summary)
        return self._core.summary()

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

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False


def _int64(name: str, value: int) -> int:
    """``value`` as an int when it fits the C++ option's 64 bits; else a ValueError naming ``name``."""
    v = int(value)
    if not -2 ** 63 <= v < 2 ** 63:
        raise ValueError(f"nanguard.Guard: {name} must fit in 64 bits, got {v}")
    return v


def _path(name: str, value: Optional[PathLike]) -> str:
    """The file path option ``name`` as a str ("" for None); a TypeError for
    anything else: open() takes an int (True too) as a file descriptor, and
    ``event_log=True`` closed the process's stdout."""
    if value is None:
        return ""
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"nanguard.Guard: {name} must be a path (a str or os.PathLike), e.g. "
                        f"{name}='{'train.jsonl' if name == 'event_log' else 'nanguard-bundles'}', "
                        f"got {type(value).__name__}")
    return os.fspath(value)


def _loss_scaler(loss_scale: Union[bool, LossScaleOptions]) -> Optional[_nanguard.LossScaler]:
    """The LossScaler of ``Guard(loss_scale=...)``: None (False), GradScaler's defaults (True) or a dict's options."""
    if not loss_scale:
        return None
    if loss_scale is True:
        return _nanguard.LossScaler()
    if not isinstance(loss_scale, Mapping):
        raise TypeError("nanguard.Guard: loss_scale must be True, False or a dict of LossScaler options, e.g. "
                        f"loss_scale={{'init_scale': 1024.0}}, got {type(loss_scale).__name__}")
    return _nanguard.LossScaler(**_known_keys("loss_scale", cast(LossScaleOptions, loss_scale), LOSS_SCALE_KEYS))


def _schedule(schedule: Union[_nanguard.WarmupCosine, ScheduleOptions, None]) -> Optional[_nanguard.WarmupCosine]:
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
        raise TypeError("nanguard.Guard: schedule must be a nanguard.WarmupCosine or a dict of its arguments, e.g. "
                        f"schedule={{'base_lr': 1e-3, 'warmup_steps': 100}}, got {type(schedule).__name__}"
                        + torch_scheduler)
    options = _known_keys("schedule", schedule, SCHEDULE_KEYS)
    if "base_lr" not in options:
        raise TypeError("nanguard.Guard: schedule needs base_lr, e.g. schedule={'base_lr': 1e-3, "
                        f"'warmup_steps': 100}}, got {options}")
    return _nanguard.WarmupCosine(**options)


def _schedulers(lr_scheduler: Union[LRScheduler, ReduceLROnPlateau, Sequence[Any], None]) -> List[Any]:
    """The schedulers of ``Guard(lr_scheduler=...)`` as a list; a TypeError
    naming the option for anything else."""
    given = [] if lr_scheduler is None else (list(lr_scheduler) if isinstance(lr_scheduler, (list, tuple))
                                             else [lr_scheduler])
    for s in given:
        if not isinstance(s, (LRScheduler, ReduceLROnPlateau)):
            raise TypeError("nanguard.Guard: lr_scheduler must be a torch.optim.lr_scheduler scheduler or a list of "
                            f"them, e.g. lr_scheduler=LambdaLR(opt, warmup), got {type(s).__name__}")
    return given


def lower_scheduler_lrs(schedulers: Iterable[Any], factor: float) -> None:
    """Multiplies what torch LR schedulers compute each param group's LR
    from by ``factor``: a rollback lowers the LR, and LambdaLR (a warmup),
    OneCycleLR or CyclicLR would set it from their own values at their next
    step. Schedulers that go on from the current LR (StepLR,
    CosineAnnealingLR, ReduceLROnPlateau) keep it lowered anyway."""
    for s in schedulers:
        lower_scheduler_lrs(getattr(s, "_schedulers", ()), factor)  # SequentialLR, ChainedScheduler
        for bounds in ("base_lrs", "max_lrs"):  # max_lrs: CyclicLR's peaks
            if hasattr(s, bounds):
                setattr(s, bounds, [lr * factor for lr in getattr(s, bounds)])
        if isinstance(s, torch.optim.lr_scheduler.OneCycleLR):  # its bounds live in the param groups
            for group in s.optimizer.param_groups:
                for bound in ("initial_lr", "max_lr", "min_lr"):
                    group[bound] *= factor


#: The names of Guard's options (its keyword-only arguments), which the framework callbacks pass through.
GUARD_OPTIONS = tuple(n for n, p in inspect.signature(Guard.__init__).parameters.items()
                      if p.kind is inspect.Parameter.KEYWORD_ONLY)

#: The guards not closed yet: closed at exit, before the interpreter tears
#: down torch.distributed (a process group a guard kept alive past
#: destroy_process_group, destroyed during the interpreter's teardown,
#: aborted the process: "terminate called without an active exception").
_open_guards: "weakref.WeakSet[Guard]" = weakref.WeakSet()


@atexit.register
def _close_open_guards() -> None:
    for guard in list(_open_guards):
        guard.close()
