"""What the framework callbacks share: the guard they build and check steps
with, the framework check, per-rank event logs, and the LR schedulers a
rollback lowers."""
import importlib
import math
import os
from typing import Any, Dict

import torch

import nanguard
from nanguard import _nanguard
from nanguard._options import GUARD_OPTIONS, check as check_options, unknown_option_error
from nanguard._results import NonFiniteError


#: What the callbacks' ``nanguard/last_cause`` metric means (a logger takes
#: numbers): 0 before the first bad step, else the code of the last bad
#: step's cause (``nanguard._nanguard.cause_code``; 1 also for a bad step
#: with no finding), as the table of docs/integrations.md.
LAST_CAUSE_CODES = {0: "none", **{i + 1: name for i, name in enumerate((
    "unclassified", "log_of_nonpositive", "division_by_zero", "overflow", "fully_masked_softmax", "sqrt_at_zero",
    "inverse_trig_at_bound", "inf_arithmetic", "precision_range", "divergence", "bad_data",
    "masked_infinity_reduced", "constant_in_model"))}}


#: The options of both callbacks: the Guard's but loss_scale (the framework's), and their own log_metrics.
CALLBACK_OPTIONS = tuple(o for o in GUARD_OPTIONS if o != "loss_scale") + ("log_metrics",)


def require(package, extra_hint=""):
    """Imports ``package`` or raises an ImportError saying how to install it."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise ImportError(f"nanguard.integrations: the {package!r} package is not installed ({e}); "
                          f"`make setup` (scripts/setup-python) installs the versions nanguard is tested with "
                          f"(python/requirements-frameworks.txt), or `pip install {package}`{extra_hint}") from e


def per_rank_path(path, rank, world_size):
    """``path`` for rank 0 (or a single process); ``stem.rankN.suffix`` for
    the other ranks of a distributed run, so that no two processes write one
    file."""
    if path is None or world_size <= 1 or rank == 0:
        return path
    stem, suffix = os.path.splitext(str(path))
    return f"{stem}.rank{rank}{suffix}"


def found_inf(scaler, optimizer):
    """Whether ``scaler`` (a torch GradScaler that has unscaled
    ``optimizer``'s gradients this step) found an Inf or NaN in them; None
    when it has not unscaled them (or is off)."""
    if scaler is None or not scaler.is_enabled():
        return None
    per_device = scaler._per_optimizer_states.get(id(optimizer), {}).get("found_inf_per_device")
    if not per_device:
        return None
    return any(float(v.item()) > 0 for v in per_device.values())


def mean_loss(losses):
    """The loss a replay hands the guard: the mean of its micro-batches'
    losses (one backward over all of them). Without any (a model that gave
    no loss), a zero that requires grad: the forward ran under the tracer,
    and there is nothing to run backward on."""
    if not losses:
        return torch.zeros((), requires_grad=True)
    return losses[0] if len(losses) == 1 else torch.stack([l.float() for l in losses]).mean()


class CallbackGuard:
    """The guard of a framework callback and what it did: ``guard`` (the
    :class:`nanguard.Guard`, built at the start of training), ``bad_steps``
    (the :class:`nanguard.StepResult` of every step it skipped, rolled
    back or aborted), ``last`` (the latest result) and ``scaler_skips`` (the steps the
    framework's GradScaler skipped on its own).

    Each training run (``fit()``, ``train()``) is a run of its own, as the
    event log is: its start rewrites ``event_log`` and empties
    ``bad_steps``, ``last`` and ``scaler_skips``, so that they, the log and
    ``guard.summary()`` all describe the latest run.

    ``name`` and ``scaler_owner`` word the errors: the framework manages
    the loss scale, so ``loss_scale=`` is refused."""

    def __init__(self, name, scaler_owner, policy, event_log, bundle_dir, max_norm, guard_options):
        if "loss_scale" in guard_options:
            raise ValueError(f"{name}: loss_scale is {scaler_owner} to manage (it uses a GradScaler, which the "
                             "callback reads); drop loss_scale=")
        for option in guard_options:
            if option not in CALLBACK_OPTIONS:
                raise unknown_option_error(name, option, CALLBACK_OPTIONS)
        check_options(dict(guard_options, policy=policy, event_log=event_log, bundle_dir=bundle_dir, max_norm=max_norm))
        self.policy = _nanguard.policy_from_string(policy)
        self.event_log = event_log
        self.bundle_dir = bundle_dir
        self.max_norm = max_norm
        self.guard_options = guard_options
        self.guard = None
        self._own_schedulers = []  # the user's lr_scheduler=, as the guard read it
        self.bad_steps = []
        self.last = None
        self.scaler_skips = 0

    def build(self, model, optimizer, framework, rank, world_size, ddp_group=None):
        """The guard over ``model`` and ``optimizer`` on this rank: rank 0
        writes ``event_log`` and ``bundle_dir``, rank N beside them.
        ``ddp_group``: the process group of the framework's
        DistributedDataParallel around ``model`` (every rank then agrees on
        each step, and the rank a NaN/Inf came from is named). A run of
        its own: what the callback kept of the run before is forgotten
        (its guard closed, when an error stopped it)."""
        if self.guard is not None:
            self.guard.close()
        self.bad_steps, self.last, self.scaler_skips = [], None, 0
        options = dict(self.guard_options)
        if ddp_group is not None:
            options["distributed"] = nanguard.Distributed(ddp_group, backward="all_reduce")
        tags = {"framework": framework, **(options.pop("bundle_tags", None) or {})}
        if world_size > 1:
            tags["rank"] = str(rank)
        self.guard = nanguard.Guard(model, optimizer, policy=self.policy, max_norm=self.max_norm,
                                    event_log=per_rank_path(self.event_log, rank, world_size),
                                    bundle_dir=per_rank_path(self.bundle_dir, rank, world_size), bundle_tags=tags,
                                    **options)
        self._own_schedulers = list(self.guard.lr_schedulers)

    def metrics(self, scaler: Any = None) -> Dict[str, float]:
        """What the callbacks log in the framework's own logs, as numbers:
        ``nanguard/skipped_steps`` (steps not taken so far: skipped, rolled
        back), ``nanguard/rollbacks``, ``nanguard/last_cause`` (0 before the
        first bad step, else :func:`nanguard._nanguard.cause_code` of its
        cause: 1 + its position in docs/diagnosis.md's classes, 1 for
        unclassified; :data:`LAST_CAUSE_CODES` names each), ``nanguard/loss_scale`` (the framework's GradScaler's
        scale, else the guard's) and ``nanguard/grad_norm`` (the last step's
        global norm before clipping; NaN for a bad step)."""
        last_bad = self.bad_steps[-1] if self.bad_steps else None
        cause = "unclassified" if last_bad is None or last_bad.finding is None else last_bad.finding.cause
        out = {"nanguard/skipped_steps": float(self.guard.skipped),
               "nanguard/rollbacks": float(self.guard.rollbacks),
               "nanguard/last_cause": float(0 if last_bad is None else _nanguard.cause_code(cause)),
               "nanguard/loss_scale": float(scaler.get_scale() if scaler is not None and scaler.is_enabled()
                                            else self.guard.scaler.get_scale())}
        if self.last is not None:
            out["nanguard/grad_norm"] = float(self.last.grad_norm)
        return out

    def check(self, loss, replay, named_batch, scaler, optimizer, schedulers):
        """Checks the step the guard began (``named_batch``: the step's
        tensors and their names); returns its result, or None when
        the framework's GradScaler skips it on its own (an overflow of the
        scaling: an Inf/NaN in the gradients of a finite loss at a scale
        above 1). A rollback lowers the user's ``lr_scheduler=`` and the
        framework's ``schedulers`` with the LR (the guard's
        ``lr_schedulers``: each once, when the user named the framework's
        too)."""
        if found_inf(scaler, optimizer) and math.isfinite(float(loss)) and scaler.get_scale() > 1.0:
            self.scaler_skips += 1  # the GradScaler's own overflow: it skips the step and lowers the scale
            return None
        self.guard.lr_schedulers = self._own_schedulers + [
            s for s in schedulers if s is not None and not any(s is own for own in self._own_schedulers)]
        batch, names = named_batch
        try:
            r = self.guard.check(loss, replay=replay, batch=batch, names=names)
        except NonFiniteError as abort:  # the aborted step is the last one, and a bad one
            if abort.result is not None:
                self.last = abort.result
                self.bad_steps.append(abort.result)
            raise
        self.last = r
        if r.skipped:
            self.bad_steps.append(r)
        return r
