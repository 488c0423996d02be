"""``nanguard.integrations.lightning.NanGuard``: nanguard for PyTorch
Lightning, as one callback.

    import lightning.pytorch as pl
    from nanguard.integrations.lightning import NanGuard

    trainer = pl.Trainer(callbacks=[NanGuard(policy="rollback", event_log="events.jsonl")])
    trainer.fit(model, loader)

No change to the ``LightningModule``. Through Lightning's own hooks, for
each optimizer step:

- ``on_train_batch_start`` (the first micro-batch of an accumulation
  window): ``Guard.begin_step(trainer.global_step)`` (numbers the step as
  Lightning does, keeps the RNG state a replay starts from); every
  micro-batch's batch is kept for the replay (and, from a loader of
  :func:`nanguard.data.track_indices`, its rows' dataset indices);
- ``on_before_backward``: the micro-batch's loss (Lightning passes it
  divided by ``accumulate_grad_batches``, and scaled under 16-bit AMP: the
  callback unscales it), summed over the window: the step's mean loss;
- ``on_before_optimizer_step`` (all micro-batches done; under AMP after
  Lightning's GradScaler unscaled the gradients, before Lightning's
  gradient clipping): ``Guard.check(loss, replay)``. A bad step is replayed
  (``training_step`` of each micro-batch again, under Lightning's precision
  context, from the step's RNG state) under the tracer, the policy acts and
  the gradients are set to None, so Lightning's ``optimizer.step()`` changes
  nothing. A step whose ``training_step`` returned None for every
  micro-batch (Lightning skips it) is cancelled: not logged or counted.

16-bit AMP with a GradScaler: when the scaler found an Inf/NaN in the
gradients of a step whose loss is finite, at a scale above 1, that is its own
overflow skip: the scaler skips the step and lowers its scale, and nanguard
leaves it to it (counted in ``scaler_skips``, not as a bad step). A
non-finite loss, or non-finite gradients at a scale of 1 or less (no
overflow of the scaling then: the gradients themselves are bad), go to the
guard.

DDP (``strategy="ddp"``): every rank runs the callback, and the guard
runs on DDP's process group (as ``nanguard.Guard`` over a
DistributedDataParallel model): every rank takes the same decision and
replays its own micro-batches without syncing (``no_sync``) under the
tracer, the rank whose own loss or gradients (hooks on the parameters
during the replay) were not finite is the origin, and every rank's result
names that rank, its op and its verdict. Rank 0 writes
``event_log`` and ``bundle_dir``; rank N writes ``<stem>.rankN<suffix>``
beside them.

Logged metrics: a replay calls ``training_step`` again (and again for each
remedy the guard tries on it); what it logs with ``self.log`` goes to a
collection of its own, dropped after the replay, so that the Trainer's
metrics (``callback_metrics``, the progress bar, the logger's
``train_loss``) hold what the step itself logged: a bad step's own
(non-finite) loss, and each healthy step's loss after it. Manual
optimization and more than one optimizer are not supported (a clear
ValueError at ``fit``).
"""
import contextlib
from typing import Any, Optional

import torch

from .._args import boolean
from .._batches import named_batch_tensors
from .._log import warnings_last
from .._options import PathLike, Policy
from .._sample_rows import give_sample_indices
from ._common import CallbackGuard, mean_loss as _mean, require

_pl = require("lightning", " (the `lightning` package: `import lightning.pytorch`)").pytorch


class NanGuard(_pl.Callback, CallbackGuard):
    """A Lightning callback that keeps training finite with :class:`nanguard.Guard`.

        trainer = lightning.pytorch.Trainer(
            callbacks=[NanGuard(policy="rollback", event_log="events.jsonl")])

    ``policy``: "auto" (the default), "skip", "rollback", "backoff" or "abort" (as
    :class:`nanguard.Guard`). ``event_log``: the JSONL event log
    (``nanguard report`` reads it); ``bundle_dir``: where an abort writes the
    repro bundle (``nanguard inspect`` reads it). ``max_norm`` (default 0:
    off; Lightning's ``gradient_clip_val`` still clips), and any other
    keyword argument of :class:`nanguard.Guard` (``snapshot_every``,
    ``rollback_lr_factor``, ``max_bad_steps``, ``replay``, ...) pass through,
    except ``loss_scale``: Lightning's precision plugin owns the loss scale.
    A rollback lowers the schedulers of ``trainer.lr_scheduler_configs``
    and those of ``lr_scheduler=`` (the user's own), each once.

    Every ``log_every_n_steps`` optimizer steps (the Trainer's logging
    cadence) the callback logs through ``pl_module.log`` (the Trainer's
    logger, rank 0): ``nanguard/skipped_steps``, ``nanguard/rollbacks``,
    ``nanguard/last_cause``, ``nanguard/loss_scale`` and
    ``nanguard/grad_norm`` (before Lightning's ``gradient_clip_val``
    clipping); ``log_metrics=False`` does not. ``verbose`` (default True): a
    :class:`nanguard.NanGuardWarning` per step not taken, and the run's
    summary when ``fit`` ends after one (:meth:`nanguard.Guard.summary`).

    ``guard`` is the :class:`nanguard.Guard` (closed when ``fit`` ends), ``bad_steps``
    the :class:`nanguard.StepResult` of every step it skipped or rolled back,
    ``last`` the latest result, ``scaler_skips`` the steps Lightning's
    GradScaler skipped on its own. Each ``fit`` with the callback is a run
    of its own: it rewrites ``event_log``, and ``bad_steps``, ``last``,
    ``scaler_skips`` and ``guard.summary()`` describe it alone (give the
    callback another ``event_log`` between fits to keep each run's log).
    """

    def __init__(self, *, policy: Policy = "auto", event_log: Optional[PathLike] = None,
                 bundle_dir: Optional[PathLike] = None, max_norm: float = 0.0, log_metrics: bool = True,
                 **guard_options: Any) -> None:
        CallbackGuard.__init__(self, "NanGuard", "Lightning's (Trainer(precision='16-mixed'))", policy, event_log,
                               bundle_dir, max_norm, guard_options)
        self.log_metrics = boolean("NanGuard", "log_metrics", log_metrics)
        self._window = None  # [(batch, batch_idx)] of the current optimizer step
        self._loss = None

    # -- set up ----------------------------------------------------------------
    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        """Builds the guard over the module and Lightning's optimizer."""
        if not pl_module.automatic_optimization:
            raise ValueError("NanGuard: manual optimization (automatic_optimization = False) is not supported: "
                             "the callback needs Lightning's optimizer step; use nanguard.Guard in your "
                             "training_step instead")
        if len(trainer.optimizers) != 1:
            raise ValueError(f"NanGuard: configure_optimizers returned {len(trainer.optimizers)} optimizers; "
                             "the callback guards exactly one")
        wrapped = trainer.strategy.model
        ddp_group = wrapped.process_group if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) else None
        self.build(pl_module, trainer.optimizers[0], "lightning", trainer.global_rank, trainer.world_size, ddp_group)
        self._window, self._loss = None, None  # a fit that stopped on an error in a window left its micro-batches

    # -- every step ------------------------------------------------------------
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: Any) -> None:
        """Begins an optimizer step at the first micro-batch of its window."""
        if self._window is None:
            self.guard.begin_step(trainer.global_step)  # the guard's step numbers are Lightning's
            self._window, self._loss = [], None
        self._window.append((batch, batch_idx))
        give_sample_indices(self.guard._active(), [named_batch_tensors(batch, "batch")[0]])

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        """Adds the micro-batch's loss (unscaled) to the step's."""
        loss = loss.detach()
        scaler = _scaler(trainer)
        if scaler is not None and scaler.is_enabled():
            loss = loss.float() / scaler.get_scale()
        self._loss = loss if self._loss is None else self._loss + loss

    @warnings_last()  # the step's warning after the callback has recorded and logged the step
    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        """Checks the step; on a bad one, replays it, acts and clears the gradients."""
        if self._window is None:
            return  # no batch began this step (nothing to check against)
        window, loss = self._window, self._loss
        self._window, self._loss = None, None
        if loss is None:
            # No micro-batch ran backward (training_step returned None to skip
            # them all): the user skipped the step, there is nothing to check.
            self.guard.cancel_step()
            return
        CallbackGuard.check(self, loss, lambda: self._replay(trainer, pl_module, window),
                            _named_window(window), _scaler(trainer), optimizer,
                            [c.scheduler for c in trainer.lr_scheduler_configs])
        if self.log_metrics and _logs_this_step(trainer):
            for name, value in self.metrics(_scaler(trainer)).items():
                pl_module.log(name, value, on_step=True, on_epoch=False, rank_zero_only=True)

    def _replay(self, trainer, pl_module, window):
        """The step's loss again: ``training_step`` of each micro-batch under
        Lightning's precision context (autocast), without DDP's sync; their
        mean, as Lightning's accumulation averages them."""
        losses = []
        wrapped = trainer.strategy.model
        no_sync = wrapped.no_sync if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) \
            else contextlib.nullcontext
        with no_sync(), trainer.precision_plugin.train_step_context(), _logs_set_aside(trainer):
            for batch, batch_idx in window:
                out = pl_module.training_step(batch, batch_idx)
                if isinstance(out, dict):
                    out = out.get("loss")
                if out is not None:
                    losses.append(out)
        return _mean(losses)

    def on_fit_end(self, trainer: Any, pl_module: Any) -> None:
        """Closes the event log (and warns the run's summary after a bad step)."""
        if self.guard is not None:
            self.guard.close()

    def on_exception(self, trainer: Any, pl_module: Any, exception: Any) -> None:
        """Closes the event log when training stops on an error (an abort)."""
        with warnings_last(exception):  # the error wins over the summary's warning
            self.on_fit_end(trainer, pl_module)


def _named_window(window: Any) -> Any:
    """The tensors of the step's micro-batches and their names: as
    ``training_step(batch, batch_idx)`` sees them (``batch[0]``, or a dict's
    keys)."""
    tensors, names = [], []
    for batch, _ in window:
        t, n = named_batch_tensors(batch, "batch")
        tensors += t
        names += n
    return tensors, names


@contextlib.contextmanager
def _logs_set_aside(trainer):
    """What ``self.log`` writes while a replay runs goes to a collection of
    its own, dropped after it: the Trainer's logged metrics
    (``callback_metrics``, the progress bar, the logger) keep the step's own
    values. Else a replay's ``self.log("train_loss", ...)``, logged from the
    callback's hook, stays in the metrics after the step: the NaN of the
    replay (or a remedy's trial loss) over every healthy step's loss until
    the epoch ends."""
    loop = getattr(trainer.fit_loop, "epoch_loop", None)
    connector = trainer._logger_connector
    if loop is None or not hasattr(loop, "_results"):  # another Lightning: logs as the step's own
        yield
        return
    results, fx = loop._results, connector._current_fx
    loop._results = type(results)(training=True)
    try:
        yield
    finally:
        loop._results, connector._current_fx = results, fx


def _logs_this_step(trainer):
    """Whether the logger writes this optimizer step's metrics (every
    ``log_every_n_steps``, as Lightning's own cadence): a ``self.log`` costs
    about half a millisecond, and one on a step the logger skips is lost."""
    return (trainer.global_step + 1) % max(int(trainer.log_every_n_steps), 1) == 0


def _scaler(trainer):
    """Lightning's GradScaler (16-bit AMP), or None."""
    return getattr(trainer.precision_plugin, "scaler", None)
