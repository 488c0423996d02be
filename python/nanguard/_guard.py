"""``nanguard.Guard``: keeps a PyTorch training loop finite.

The C++ ``nanguard::guard`` takes C++ modules and optimizers, so the Python
guard orchestrates in Python on the C++ pieces: the sentinel (one fused pass
over every gradient: global and per-parameter norms, non-finite counts,
spikes), the loss scaler (GradScaler semantics), clipping folded into the
unscale write, the tracer for replay localization, and the C++ guard's event
log and bundle writer, so that ``nanguard report``, ``inspect`` and
``replay`` read a Python run as they read a C++ one.
"""
import copy
import json
import math
from collections import deque
from dataclasses import dataclass, field

import torch

from . import _nanguard
from ._trace import Finding, NonFiniteError, trace

POLICIES = ("skip", "backoff", "rollback", "abort")


@dataclass
class StepResult:
    """What one guarded step did (also a line of the JSONL event log).

    ``step`` counts from 1, as the C++ guard's. ``action`` is "step" for a
    healthy step, else the policy that acted ("skip", "backoff", "rollback",
    "abort"). ``finding`` is the replay's :class:`~nanguard.Finding` (or
    None) and ``verdict`` "reproduced" / "not reproduced" / "" (no replay).
    ``nonfinite_params`` lists (name, NaN/Inf count) of the gradients that
    held any, ``top_norms`` (name, norm) of the largest per-parameter
    gradient norms; ``bundle`` is the repro bundle an abort wrote and
    ``rollback_to`` the snapshot a rollback restored (steps done then).
    The finding is diagnosed with the steps before (``finding.cause``,
    ``finding.remedy``); ``remedy`` is what the guard did about a bad step,
    e.g. "skipped the step; loss scale 65536 -> 32768" ("" on a healthy step).
    """

    step: int
    loss: float
    grad_norm: float
    action: str
    skipped: bool
    scale: float
    lr: float
    reason: str = ""
    first_nonfinite_param: str = ""
    finding: object = None
    verdict: str = ""
    spikes: list = field(default_factory=list)
    nonfinite_params: list = field(default_factory=list)
    top_norms: list = field(default_factory=list)
    clip_coef: float = 1.0
    bundle: str = ""
    rollback_to: int = -1
    remedy: str = ""

    def to_dict(self):
        """The result as the event log holds it: the C++ guard's step event
        (``nanguard::step_event``), NaN and Inf as "nan", "inf", "-inf"."""
        d = {"step": self.step, "loss": _num(self.loss), "grad_norm": _num(self.grad_norm),
             "clip_coef": _num(self.clip_coef), "scale": _num(self.scale), "lr": _num(self.lr),
             "skipped": self.skipped, "action": self.action,
             "spikes": [{"series": s, "value": _num(v), "z": _num(z)} for s, v, z in self.spikes],
             "nonfinite_params": [{"name": n, "nonfinite": c} for n, c in self.nonfinite_params],
             "top_norms": [{"name": n, "norm": _num(v)} for n, v in self.top_norms],
             "findings": [json.loads(self.finding.to_json())] if self.finding is not None else []}
        for key, value, unset in (("verdict", self.verdict, ""), ("note", self.reason, ""),
                                  ("bundle", self.bundle, ""), ("rollback_to", self.rollback_to, -1),
                                  ("remedy", self.remedy, "")):
            if value != unset:
                d[key] = value
        return d


def _num(x):
    """A float as the event log writes it: JSON has no NaN or Inf."""
    x = float(x)
    if math.isnan(x):
        return "nan"
    return x if math.isfinite(x) else ("inf" if x > 0 else "-inf")


def _trainable_loss(loss):
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


def _call_of(micro_batch):
    """``(args, kwargs)`` of one micro-batch: a pair as given, a tuple or list
    of arguments, or a single argument."""
    if isinstance(micro_batch, tuple) and len(micro_batch) == 2 and isinstance(micro_batch[1], dict):
        return tuple(micro_batch[0]), micro_batch[1]
    if isinstance(micro_batch, (tuple, list)):
        return tuple(micro_batch), {}
    return (micro_batch,), {}


def _rng_states():
    """The CPU generator's state and, once CUDA is in use, each CUDA
    device's: a replay draws the same dropout masks on either."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [])


def _set_rng_states(states):
    cpu, cuda = states
    torch.set_rng_state(cpu)
    if cuda:
        torch.cuda.set_rng_state_all(cuda)


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
    the NaN/Inf, then applies ``policy``:

    - ``"skip"``: drop the step (an enabled loss scaler still backs off);
    - ``"backoff"``: drop the step and back off the loss scale;
    - ``"rollback"``: restore the last snapshot of model and optimizer
      (taken every ``snapshot_every`` steps, before the optimizer steps on
      parameters whose loss and gradients were just checked finite) and
      multiply the LR by
      ``rollback_lr_factor``;
    - ``"abort"``: write a repro bundle to ``bundle_dir`` (if set) and raise
      :class:`NonFiniteError`. The bundle is the C++ guard's directory
      (``nanguard inspect`` reads it); it holds the tensors passed to
      ``step`` as arguments as its batch, so ``guard.step(loss_fn, x, y)``
      with ``bundle_tags={"task": "classify"}`` lets ``nanguard replay
      BUNDLE --model scripted.pt`` run it again on a TorchScript copy of the
      model.

    ``loss_scale``: False (off, default), True (GradScaler defaults) or a
    dict of ``LossScaler`` options (init_scale, growth_factor, ...).
    ``max_bad_steps`` > 0 aborts after that many bad steps in a row.
    ``schedule``: a :class:`WarmupCosine` (or a dict of its arguments) the
    guard applies to every param group at the start of each step, times the
    product of the rollback factors, as the C++ guard does.
    ``event_log``: a JSONL file, one C++ step event per step (``nanguard
    report`` turns it into HTML); ``log_top_norms`` per-parameter gradient
    norms go into each event.

    NOTE: the closure must depend only on the batch, the parameters and the
    RNG, so that a replay repeats it. Replays restore the CPU RNG.
    """

    def __init__(self, model, optimizer, policy="skip", max_norm=0.0, clip_value=0.0,
                 loss_scale=False, replay=True, event_log=None, snapshot_every=100,
                 snapshot_keep=2, rollback_lr_factor=0.5, max_bad_steps=0, bundle_dir=None,
                 spike_window=50, spike_threshold=8.0, bundle_tags=None, log_top_norms=5, schedule=None):
        if policy not in POLICIES:
            raise ValueError(f"nanguard.Guard: policy must be one of {POLICIES}, got {policy!r}")
        if not (math.isfinite(max_norm) and max_norm >= 0 and math.isfinite(clip_value) and clip_value >= 0):
            raise ValueError("nanguard.Guard: max_norm and clip_value must be finite and >= 0 (0: off), got "
                             f"{max_norm}, {clip_value}")
        if snapshot_every < 1 or snapshot_keep < 1:
            raise ValueError("nanguard.Guard: snapshot_every and snapshot_keep must be >= 1, got "
                             f"{snapshot_every}, {snapshot_keep}")
        if not 0 < rollback_lr_factor <= 1:
            raise ValueError(f"nanguard.Guard: rollback_lr_factor must be in (0, 1], got {rollback_lr_factor}")
        self.model = model
        self.optimizer = optimizer
        self.policy = policy
        self.max_norm = float(max_norm)
        self.clip_value = float(clip_value)
        self.replay = replay
        self.snapshot_every = int(snapshot_every)
        self.snapshot_keep = int(snapshot_keep)
        self.rollback_lr_factor = float(rollback_lr_factor)
        self.max_bad_steps = int(max_bad_steps)
        self.bundle_dir = bundle_dir
        self.bundle_tags = {str(k): str(v) for k, v in (bundle_tags or {}).items()}
        self.log_top_norms = int(log_top_norms)
        self.schedule = _nanguard.WarmupCosine(**schedule) if isinstance(schedule, dict) else schedule
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._named = named
        self._params = [p for _, p in named]
        stepped = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not any(id(p) in stepped for p in self._params):
            raise ValueError("nanguard.Guard: the optimizer holds none of the model's trainable parameters, so "
                             "no step would change the model; build it from this model's parameters, e.g. "
                             "torch.optim.AdamW(model.parameters())")
        self.sentinel = _nanguard.Sentinel(named, window=spike_window, threshold=spike_threshold,
                                           min_samples=min(10, spike_window))
        opts = {} if loss_scale in (True, False, None) else dict(loss_scale)
        self.scaler = _nanguard.LossScaler(enabled=bool(loss_scale), **opts)
        self.steps = 0
        self.skipped = 0
        self.rollbacks = 0
        self.lr_factor = 1.0
        self._bad_in_a_row = 0
        # Losses and grad norms of the last finite steps: what a bad step's
        # diagnosis reads as the steps before.
        self._losses = deque(maxlen=spike_window)
        self._grad_norms = deque(maxlen=spike_window)
        self._snapshots = []  # (steps done, model state, optimizer state)
        self._started = None  # (step, RNG states, scale, LR) of the step begun
        self._log = None
        if event_log:
            open(event_log, "w", encoding="utf-8").close()  # truncated; unwritable: the OSError Python raises
            self._log = _nanguard.EventLog(str(event_log), False)
        if policy == "rollback":
            self._snapshot()  # until the first good step

    # -- the step -------------------------------------------------------------
    def step(self, closure, *args, **kwargs):
        """Runs one guarded step: ``loss = closure(*args, **kwargs)`` then the
        checks, backward, clipping and ``optimizer.step()`` or the policy.
        Returns a :class:`StepResult`."""
        return self.step_accumulated(closure, [(args, kwargs)])

    def step_accumulated(self, closure, micro_batches):
        """One guarded optimizer step over several micro-batches (gradient
        accumulation): ``closure(*args, **kwargs)`` for each ``(args,
        kwargs)`` pair of ``micro_batches`` (or each tuple of arguments), its
        loss divided by their number before backward; the checks run once,
        over the accumulated gradients. The step's loss is the mean of the
        micro-batches' losses; a replay runs them all again.

            guard.step_accumulated(lambda x, y: F.cross_entropy(model(x), y),
                                   [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])
        """
        calls = [_call_of(mb) for mb in micro_batches]
        if not calls:
            raise ValueError("nanguard.Guard.step_accumulated: micro_batches is empty; pass at least one "
                             "(args, kwargs) pair or tuple of arguments")
        self.begin_step()
        self.optimizer.zero_grad(set_to_none=True)
        run = lambda: self._forward_backward(closure, calls)
        losses = run()
        loss_value = losses[-1] if not math.isfinite(losses[-1]) else sum(losses) / len(losses)
        batch = [a for args, kwargs in calls for a in list(args) + list(kwargs.values())
                 if isinstance(a, torch.Tensor)]
        return self._settle(loss_value, run, batch, steps_optimizer=True)

    def _forward_backward(self, closure, calls):
        """Forward and (scaled) backward of each micro-batch, the loss checked
        before its backward; returns the losses, up to the first non-finite."""
        losses = []
        for args, kwargs in calls:
            loss = _trainable_loss(closure(*args, **kwargs))
            finite, value = self.sentinel.check_loss(loss)
            losses.append(value)
            if not finite:
                break
            self.scaler.scale(loss / len(calls)).backward()
        return losses

    def begin_step(self):
        """Starts one optimizer step when a framework runs forward, backward
        and ``optimizer.step()`` itself (the integrations do): counts it,
        applies the schedule and keeps the RNG state a replay starts from.
        Call it before the first forward of the step, then :meth:`check`."""
        self.steps += 1
        if self.schedule is not None:
            self._set_lr(self.schedule.lr(self.steps - 1) * self.lr_factor)
        self._started = (self.steps, _rng_states(), self.scaler.get_scale(), self._lr())

    def check(self, loss, replay=None, batch=()):
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
        ``batch`` the tensors an abort's bundle keeps. Returns a
        :class:`StepResult`."""
        if self._started is None:
            raise RuntimeError("nanguard.Guard.check: no step was begun; call guard.begin_step() before the "
                               "step's first forward")
        if not isinstance(loss, torch.Tensor):
            loss = torch.tensor(float(loss))
        _, loss_value = self.sentinel.check_loss(loss.detach())
        run = None if replay is None else lambda: self._backward_if_finite(replay())
        return self._settle(loss_value, run, list(batch), steps_optimizer=False)

    def _backward_if_finite(self, loss):
        if self.sentinel.check_loss(_trainable_loss(loss))[0]:
            self.scaler.scale(loss).backward()

    def _settle(self, loss_value, run, batch, steps_optimizer):
        """The checks over the gradients and what follows: clip and step (when
        ``steps_optimizer``), or localize (``run()`` runs the step's forward
        and backward again, under the tracer) and apply the policy."""
        step, rng, scale, lr = self._started
        self._started = None
        norm, reason, bad_param, report = float("nan"), "", "", None
        if math.isfinite(loss_value):
            report = self.sentinel.inspect_grads(self.scaler.inv_scale())
            norm = report.total_norm
            if not report.finite():
                reason, bad_param = "non-finite gradient", report.first_nonfinite_name
        else:
            reason = "non-finite loss"
        per_parameter = self._per_parameter(report)
        if not reason:
            if self.policy == "rollback" and (step - 1) % self.snapshot_every == 0:
                self._snapshot()  # parameters this step just showed finite
            clip_coef = _nanguard.clip_coefficient(norm, self.max_norm)
            self.sentinel.apply_factor_(self.scaler.inv_scale() * clip_coef)
            if self.clip_value > 0:
                torch.nn.utils.clip_grad_value_(self._params, self.clip_value)
            if steps_optimizer:
                self.optimizer.step()
            self.scaler.update(False)
            self._bad_in_a_row = 0
            self._losses.append(loss_value)
            self._grad_norms.append(norm)
            spikes = self.sentinel.observe(loss_value, norm)
            return self._emit(StepResult(step, loss_value, norm, "step", False, scale, lr, spikes=spikes,
                                         clip_coef=clip_coef, **per_parameter))

        # A bad step: nothing is stepped. Localize, then act.
        self.skipped += 1
        self._bad_in_a_row += 1
        finding, verdict = None, ""
        if self.replay and run is not None:
            finding, verdict = self._replay(step, rng, run)
        if finding is not None:
            finding = self._diagnose(finding, loss_value)
        self.optimizer.zero_grad(set_to_none=True)
        action = self.policy
        if self.max_bad_steps and self._bad_in_a_row >= self.max_bad_steps:
            action = "abort"
        if self.scaler.enabled:
            self.scaler.update(True)  # every policy backs an enabled scaler off
        result = StepResult(step, loss_value, norm, action, True, scale, lr, reason, bad_param, finding, verdict,
                            **per_parameter)
        if action == "rollback":
            result.rollback_to = self._rollback()
        if action == "abort":
            result.bundle = self._bundle(result, rng, batch)
        result.remedy = self._applied_remedy(result)
        self._emit(result)
        if action == "abort":
            if finding is None:
                raise NonFiniteError(f"step {step}: {reason}" + (f" in {bad_param}" if bad_param else "")
                                     + " (replay did not name an op)")
            raise NonFiniteError(finding)
        return result

    def _per_parameter(self, report):
        """The event's per-parameter fields from the sentinel's report."""
        if report is None:
            return {}
        names = self.sentinel.names
        bad = [(n, c) for n, c in zip(names, report.nonfinite_counts) if c > 0]
        key = lambda item: math.inf if math.isnan(item[1]) else item[1]  # NaN first, as the C++ guard
        top = sorted(zip(names, report.norms), key=key, reverse=True)[:max(self.log_top_norms, 0)]
        return {"nonfinite_params": bad, "top_norms": top}

    def _diagnose(self, finding, loss_value):
        """The finding diagnosed again with the steps before (a finite loss of
        this step last: its gradients were the bad ones)."""
        losses = list(self._losses) + ([loss_value] if math.isfinite(loss_value) else [])
        return Finding(_nanguard.diagnose_finding(finding.to_json(), losses, list(self._grad_norms), self._lr(),
                                                  self.scaler.get_scale(), []))

    def _applied_remedy(self, result):
        """What the guard did about the bad step of ``result``, as the C++
        guard's events say it."""
        if result.action == "abort":
            return "stopped training" + (f"; repro bundle in {result.bundle}" if result.bundle else "")
        if result.action == "rollback":
            done = f"rolled back to the snapshot of step {result.rollback_to}"
        else:
            done = "skipped the step"
        if self._lr() != result.lr:
            done += f"; lr {result.lr:.6g} -> {self._lr():.6g}"
        if self.scaler.get_scale() != result.scale:
            done += f"; loss scale {result.scale:.6g} -> {self.scaler.get_scale():.6g}"
        return done

    def _replay(self, step, rng, run):
        """Re-runs the step (``run()``: forward and backward) under the tracer
        from the step's RNG state."""
        state = _rng_states()
        self.optimizer.zero_grad(set_to_none=True)
        _set_rng_states(rng)
        try:
            with trace(self.model, step=step, inside_kernels=True) as t:
                run()
        finally:
            _set_rng_states(state)
        f = t.findings
        return (f[0], "reproduced") if f else (None, "not reproduced")

    # -- snapshots and rollback ----------------------------------------------
    def _snapshot(self):
        steps_done = max(self.steps - 1, 0)  # taken before this step's update
        snap = (steps_done, copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict()))
        self._snapshots.append(snap)
        del self._snapshots[:-self.snapshot_keep]

    def _rollback(self):
        """Restores the newest snapshot, lowers the LR; returns the snapshot's step."""
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        steps_done, model_state, opt_state = self._snapshots[-1]
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(opt_state)
        self.rollbacks += 1
        self.lr_factor *= self.rollback_lr_factor
        if self.schedule is not None:
            self._set_lr(self.schedule.lr(self.steps - 1) * self.lr_factor)
        else:
            for g, lr in zip(self.optimizer.param_groups, lrs):  # the LR goes on from where it was
                g["lr"] = lr * self.rollback_lr_factor
        self.sentinel.reset_spikes()
        return steps_done

    def _set_lr(self, lr):
        for g in self.optimizer.param_groups:
            g["lr"] = lr

    def _lr(self):
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer.param_groups else 0.0

    # -- outputs ----------------------------------------------------------------
    def _emit(self, result):
        if self._log is not None:
            self._log.write(json.dumps(result.to_dict()))  # checked and flushed by the C++ writer
        return result

    def _bundle(self, result, rng, batch):
        """Writes the repro bundle of a bad step (the C++ guard's directory,
        atomically); returns its path, or "" without ``bundle_dir``. The
        tensors among the step's arguments are its batch; the parameters
        are as the step found them (nothing was stepped)."""
        if not self.bundle_dir:
            return ""
        finding = result.finding.to_json() if result.finding is not None else ""
        cpu_rng, cuda_rngs = rng
        # On the CPU: a bundle loads on any machine.
        return _nanguard.write_bundle(str(self.bundle_dir), result.step, result.lr, result.scale, result.loss,
                                      "abort", result.verdict, finding, [b.detach().cpu() for b in batch], cpu_rng,
                                      [(n, p.detach().cpu()) for n, p in self._named],
                                      {"front_end": "python", **self.bundle_tags}, list(cuda_rngs))

    def close(self):
        """Closes the event log."""
        self._log = None  # the C++ writer closes the file

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
