"""``nanguard.integrations.transformers.NanGuardCallback``: nanguard for
Hugging Face's ``Trainer``, as one callback.

    from transformers import Trainer
    from nanguard.integrations.transformers import NanGuardCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds,
                      callbacks=[NanGuardCallback(policy="rollback", event_log="events.jsonl")])
    trainer.train()

No change to the model. Through the Trainer's own hooks, for each optimizer
step:

- ``on_step_begin`` (the first micro-batch of a gradient-accumulation
  window): ``Guard.begin_step(state.global_step + 1)`` (numbers the step
  as ``log_history`` does, keeps the RNG state a replay starts from);
- a forward hook on the model (``register_forward_hook(...,
  with_kwargs=True)``), from ``on_step_begin`` to
  ``on_pre_optimizer_step``, keeps each training micro-batch's inputs and its
  ``loss`` output; the step's loss is their mean (their sum when the
  Trainer passed the forward ``num_items_in_batch``: the Trainer's);
- ``on_pre_optimizer_step`` (every micro-batch done; after the Trainer
  unscaled the gradients under fp16 AMP and measured their norm):
  ``Guard.check(loss, replay)``; the guard clips a healthy step by
  ``max_grad_norm`` in the Trainer's stead (below). A bad step is replayed
  (``model(**inputs).loss`` of each micro-batch again, from the step's RNG
  state) under the tracer, the policy acts and the gradients are set to
  None, so the Trainer's ``optimizer.step()`` changes nothing.

A rollback lowers the LR of the optimizer's param groups and the base LRs of
the Trainer's LR scheduler (and of ``lr_scheduler=``) alike (the scheduler
recomputes the LR from them at every step).

fp16 AMP (a GradScaler): when the scaler found an Inf/NaN in the gradients
of a step whose loss is finite, at a scale above 1, that is its own overflow
skip: it skips the step and lowers its scale, and nanguard leaves it to it
(``scaler_skips``). A non-finite loss, or non-finite gradients at a scale of
1 or less, go to the guard.

Distributed (DDP): every rank runs the callback, and the guard runs on
the default process group (as ``nanguard.Guard`` over a
DistributedDataParallel model): every rank takes the same action and
replays its own micro-batches under the tracer, the rank whose own loss or
gradients (hooks on the parameters during the replay, before DDP's
all-reduce) were not finite is the origin, and every rank's result names
that rank, its op and its verdict; rank 0 writes ``event_log`` and ``bundle_dir``, rank N
``<stem>.rankN<suffix>`` beside them.

Clipping: the Trainer would clip by ``max_grad_norm`` (default 1.0) before
the callback sees the gradients, and the event log's ``grad_norm`` would be
the clipped norm (1.0 on every step). So while ``train()`` runs the guard
clips instead, by the same norm after its checks (``max_norm`` when smaller),
with ``TrainingArguments.max_grad_norm`` set to 0 inside each step (from
``on_step_begin`` until the Trainer has clipped, at
``on_pre_optimizer_step``); the event log's ``grad_norm`` is then the norm
before clipping, the one the Trainer logs. Not under DeepSpeed, which clips
in its engine.

Errors: the Trainer has no event for an error that stops ``train()``
(Lightning has ``on_exception``), so the callback holds what it changes
(the forward hook, ``max_grad_norm``) only inside a step: an error between
steps (the data collator's, an evaluation's, a checkpoint's, another
callback's ``on_step_end``) leaves the model and the arguments as the user
made them. An error inside a step (the model's forward or backward) leaves
the hook and ``max_grad_norm = 0`` until the next ``train()`` with the
callback, which gives them back; the guard of a run an error stopped stays
open (its event log written up to the last step) until then, or until the
interpreter exits. An abort closes all of it.

Metrics: every logging step the callback adds ``nanguard/skipped_steps``,
``nanguard/rollbacks``, ``nanguard/last_cause``, ``nanguard/loss_scale``
and ``nanguard/grad_norm`` to the Trainer's logs (its console line and
``state.log_history``; ``log_metrics=False``: not). ``verbose`` (default
True): a :class:`nanguard.NanGuardWarning` per step not taken, and the run's
summary when ``train()`` ends after one.

NOTE: the Trainer measures the norm with ``clip_grad_norm_(..., inf)``,
which multiplies every gradient by the NaN norm of a bad step before the
callback sees them, so the event's per-parameter counts list every
parameter; the replay still names the op that made the first NaN/Inf. The
loss comes from the model's output: with a Trainer whose ``compute_loss``
works outside the model, the gradients alone decide (the event's loss reads
0.0) and the replay runs backward from the sum of the model's first
output (the logits): the ops of the forward are checked both ways, those of
the loss function are not.
"""

from typing import Any, Dict, List, Optional

import torch

from .._args import boolean
from .._batches import named_call_tensors
from .._log import warnings_last
from .._options import PathLike, Policy
from .._results import NonFiniteError
from ._common import CallbackGuard, mean_loss as _mean, require

_hf = require("transformers", " (and `accelerate`, which its Trainer needs)")


class NanGuardCallback(_hf.TrainerCallback, CallbackGuard):
    """A Hugging Face ``TrainerCallback`` that keeps training finite with
    :class:`nanguard.Guard`.

        Trainer(model=model, args=args, train_dataset=ds,
                callbacks=[NanGuardCallback(policy="rollback", event_log="events.jsonl")])

    ``policy``: "auto" (the default), "skip", "rollback", "backoff" or "abort" (as
    :class:`nanguard.Guard`; an abort raises :class:`nanguard.NonFiniteError`
    out of ``trainer.train()``). ``event_log``: the JSONL event log
    (``nanguard report`` reads it); ``bundle_dir``: where an abort writes the
    repro bundle (``nanguard inspect`` reads it). ``max_norm`` (default 0:
    off; ``TrainingArguments.max_grad_norm`` still applies, the guard
    clipping by it), and any other
    keyword argument of :class:`nanguard.Guard` pass through, except
    ``loss_scale`` (the Trainer's fp16 GradScaler owns it). A rollback
    lowers the Trainer's ``lr_scheduler`` and those of ``lr_scheduler=``
    (the user's own), each once.

    ``log_metrics``: add the guard's metrics to the Trainer's logs (module
    docstring). The Trainer's ``max_grad_norm`` clipping is done by the guard
    while ``train()`` runs, so that the event log's ``grad_norm`` is the norm
    before clipping.

    ``guard`` is the :class:`nanguard.Guard` (closed when ``train()`` ends),
    ``bad_steps`` the :class:`nanguard.StepResult` of each step skipped or
    rolled back, ``last`` the latest result, ``scaler_skips`` the steps the
    Trainer's GradScaler skipped on its own. Each ``train()`` with the
    callback is a run of its own, as the Trainer's ``state.log_history``
    is: it rewrites ``event_log``, and ``bad_steps``, ``last``,
    ``scaler_skips`` and ``guard.summary()`` describe it alone (give the
    callback another ``event_log`` between runs to keep each run's log).
    """

    def __init__(self, *, policy: Policy = "auto", event_log: Optional[PathLike] = None,
                 bundle_dir: Optional[PathLike] = None, max_norm: float = 0.0, log_metrics: bool = True,
                 **guard_options: Any) -> None:
        CallbackGuard.__init__(self, "NanGuardCallback", "the Trainer's (TrainingArguments(fp16=True))", policy,
                               event_log, bundle_dir, max_norm, guard_options)
        self.log_metrics = boolean("NanGuardCallback", "log_metrics", log_metrics)
        self._own_max_norm = max_norm
        self._trainer_max_grad_norm: Optional[float] = None  # the Trainer's max_grad_norm, which the guard clips by
        self._scaler: Any = None
        self._model = None
        self._hook = None  # the forward hook of the step running now
        self._window = None  # [(args, kwargs)] of the step's micro-batches
        self._losses = []
        # Since the Trainer last logged: how many steps were checked, and the
        # real losses of those the guard skipped.
        self._checked_since_log = 0
        self._skipped_losses: List[float] = []

    # -- set up ----------------------------------------------------------------
    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       **kwargs: Any) -> None:
        """Builds the guard over the model and the Trainer's optimizer (and
        ends the step an error stopped inside the train() before)."""
        if model is None or optimizer is None:
            raise ValueError("NanGuardCallback: the Trainer passed no model or optimizer to on_train_begin; "
                             "add the callback to a transformers.Trainer (Trainer(..., callbacks=[...]))")
        self._end_step(args)
        self._take_over_clipping(args)
        self.build(model, _inner(optimizer), "transformers", *_rank_and_world(), ddp_group=_ddp_group(args))
        self._scaler = getattr(optimizer, "scaler", None)
        self._model = model

    def _take_over_clipping(self, args: Any) -> None:
        """The Trainer clips by ``max_grad_norm`` before the callback sees the
        gradients, so the guard would measure the clipped norm (1.0 on every
        step) and a bad step's NaN norm would reach every gradient. The
        guard clips instead, by the same global norm (the smaller of
        ``max_norm`` and ``max_grad_norm`` when both are set), after its
        checks; the Trainer's ``max_grad_norm`` is 0 inside each step
        (``on_step_begin`` to ``on_pre_optimizer_step``, where the Trainer
        clips; it still logs the norm, measured before the guard's
        clipping). DeepSpeed clips inside its engine: left as it is."""
        self.max_norm = self._own_max_norm
        self._trainer_max_grad_norm = None
        if not args.max_grad_norm or args.max_grad_norm <= 0 or getattr(args, "deepspeed", None):
            return
        self._trainer_max_grad_norm = args.max_grad_norm
        self.max_norm = min(self.max_norm, args.max_grad_norm) if self.max_norm > 0 else args.max_grad_norm

    def on_log(self, args: Any, state: Any, control: Any, logs: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        """Adds the guard's metrics (``nanguard/skipped_steps``, ...) to the
        Trainer's logs: its console line and ``state.log_history``. When every
        step since the last log was skipped, its ``loss`` is their real
        (non-finite) loss: the Trainer's NaN filter would show the mean of
        the steps logged before, 0 right after a log."""
        if logs is None or "loss" not in logs:
            return
        checked, skipped = self._checked_since_log, self._skipped_losses
        self._checked_since_log, self._skipped_losses = 0, []
        if self.guard is None:
            return
        metrics = self.metrics(self._scaler) if self.log_metrics else {}
        if checked and len(skipped) == checked:
            metrics["loss"] = sum(skipped) / len(skipped)
        logs.update(metrics)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def _keep_micro_batch(self, module, args, kwargs, output):
        """Forward hook: keeps a training micro-batch's inputs and loss."""
        if not module.training:
            return
        self._window.append((args, kwargs))
        loss = _loss_of(output)
        if loss is not None:
            self._losses.append(loss.detach())

    # -- every step ------------------------------------------------------------
    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Begins an optimizer step (the first micro-batch of its window):
        hooks the model's forward to keep its micro-batches, and sets the
        Trainer's ``max_grad_norm`` to 0 until the Trainer has clipped (the
        guard clips in its stead). Only a step holds them, so that an error
        that stops ``train()`` between steps (the data collator's, an
        evaluation's, a checkpoint's) leaves neither behind: the Trainer
        has no event for an error."""
        self.guard.begin_step(state.global_step + 1)  # the number log_history gives the step (after it)
        self._window, self._losses = [], []
        self._hook = self._model.register_forward_hook(self._keep_micro_batch, with_kwargs=True)
        if self._trainer_max_grad_norm is not None:
            args.max_grad_norm = 0.0

    def _end_step(self, args: Any) -> None:
        """Removes the step's forward hook and gives the Trainer its
        ``max_grad_norm`` back: the step's micro-batches are done (or an
        error stopped train() inside a step)."""
        if self._hook is None:
            return
        self._hook.remove()
        self._hook = None
        if self._trainer_max_grad_norm is not None:
            args.max_grad_norm = self._trainer_max_grad_norm

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, optimizer: Any = None,
                              lr_scheduler: Any = None, **kwargs: Any) -> None:
        """Checks the step; on a bad one, replays it, acts and clears the gradients."""
        try:
            self._check_step(args, optimizer, lr_scheduler)
        except (NonFiniteError, Warning) as stop:  # an abort, or a warning made an error (-W error)
            with warnings_last(stop):  # train() stops here, with no on_train_end
                self.on_train_end(args, state, control)
            raise

    @warnings_last()  # the step's warning after the callback has recorded the step
    def _check_step(self, args: Any, optimizer: Any, lr_scheduler: Any) -> None:
        self._end_step(args)
        if self._window is None:
            return
        window, losses = self._window, self._losses
        self._window, self._losses = None, []
        # Without a loss from the model (a compute_loss outside it) the event
        # says 0.0 and the gradients alone decide.
        loss = _window_loss(window, losses) if losses else 0.0
        r = CallbackGuard.check(self, loss, lambda: self._replay(window), self._named_window(window),
                                getattr(optimizer, "scaler", None), _inner(optimizer),
                                [getattr(lr_scheduler, "scheduler", lr_scheduler)])
        self._checked_since_log += 1
        if r is not None and r.skipped:
            self._skipped_losses.append(float(r.loss))

    def _named_window(self, window: Any) -> Any:
        """The tensors of the step's micro-batches and their names: the
        keywords and parameter names of the model's forward (``labels``,
        ``inputs_embeds``)."""
        tensors, names = [], []
        for a, k in window:
            t, n = named_call_tensors(self._model.forward, a, k)
            tensors += t
            names += n
        return tensors, names

    def _replay(self, window):
        """The step's loss again: the model's forward on each micro-batch's
        inputs, the mean of their losses."""
        losses = []
        for a, k in window:  # the step's hook is gone: the replay keeps nothing
            out = self._model(*a, **k)
            loss = _loss_of(out)
            if loss is None:
                loss = _surrogate_loss(out)
            if loss is not None:
                losses.append(loss)
        return _window_loss(window, losses)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Closes the event log (warning the run's summary after a bad
        step)."""
        self._end_step(args)  # a callback's should_training_stop can end train() between micro-batches
        if self.guard is not None:
            self.guard.close()


def _inner(optimizer):
    """The torch optimizer inside accelerate's wrapper (or ``optimizer``)."""
    return getattr(optimizer, "optimizer", optimizer)


def _window_loss(window, losses):
    """The step's loss from its micro-batches' model ``losses``, as the
    Trainer sums it: when it passed the forward ``num_items_in_batch`` (the
    items of the whole window: a causal LM's loss is then each micro-batch's
    share of the window's mean), their sum; else their mean."""
    if losses and any(k.get("num_items_in_batch") is not None for _, k in window):
        return torch.stack([l.float() for l in losses]).sum()
    return _mean(losses)


def _loss_of(output):
    """The ``loss`` of a model output (a ModelOutput, dict or tuple whose
    first item is the loss when labels were given), or None."""
    if isinstance(output, dict):  # ModelOutput is a dict
        loss = output.get("loss")
    elif isinstance(output, (tuple, list)) and output:
        loss = output[0]
    else:
        loss = getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _surrogate_loss(output):
    """For a replay whose model gave no loss (the Trainer computes it outside
    the model): the sum of the first floating-point output (the logits), so
    that the replay's backward runs through every op of the forward."""
    values = output.values() if isinstance(output, dict) else output if isinstance(output, (tuple, list)) \
        else [output]
    for v in values:
        if isinstance(v, torch.Tensor) and v.is_floating_point() and v.requires_grad:
            return v.float().sum()
    return None


def _ddp_group(args):
    """The process group of the Trainer's DistributedDataParallel, or None."""
    from transformers.training_args import ParallelMode
    return torch.distributed.group.WORLD if args.parallel_mode == ParallelMode.DISTRIBUTED else None


def _rank_and_world():
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1
