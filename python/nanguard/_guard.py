"""``nanguard.Guard``: keeps a PyTorch training loop finite.

The C++ ``nanguard::guard`` takes C++ modules and optimizers, so the Python
guard orchestrates in Python on the C++ pieces: the sentinel (one fused pass
over every gradient: global and per-parameter norms, non-finite counts,
spikes), the loss scaler (GradScaler semantics), clipping folded into the
unscale write, and the tracer for replay localization.
"""
import copy
import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

from . import _nanguard
from ._trace import NonFiniteError, trace

POLICIES = ("skip", "backoff", "rollback", "abort")


@dataclass
class StepResult:
    """What one guarded step did (also a line of the JSONL event log).

    ``action`` is "step" for a healthy step, else the policy that acted
    ("skip", "backoff", "rollback", "abort"). ``finding`` is the replay's
    :class:`~nanguard.Finding` (or None) and ``verdict`` "reproduced" /
    "not reproduced" / "" (no replay).
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

    def to_dict(self):
        """The result as a JSON-ready dict (NaN/Inf as strings)."""
        def num(x):
            return x if math.isfinite(x) else str(x)
        return {"step": self.step, "loss": num(self.loss), "grad_norm": num(self.grad_norm),
                "action": self.action, "skipped": self.skipped, "scale": self.scale,
                "lr": self.lr, "reason": self.reason,
                "first_nonfinite_param": self.first_nonfinite_param,
                "finding": json.loads(self.finding.to_json()) if self.finding is not None else None,
                "verdict": self.verdict,
                "spikes": [{"series": s, "value": num(v), "z": z} for s, v, z in self.spikes]}


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
      :class:`NonFiniteError`.

    ``loss_scale``: False (off, default), True (GradScaler defaults) or a
    dict of ``LossScaler`` options (init_scale, growth_factor, ...).
    ``max_bad_steps`` > 0 aborts after that many bad steps in a row.

    NOTE: the closure must depend only on the batch, the parameters and the
    RNG, so that a replay repeats it. Replays restore the CPU RNG.
    """

    def __init__(self, model, optimizer, policy="skip", max_norm=0.0, clip_value=0.0,
                 loss_scale=False, replay=True, event_log=None, snapshot_every=100,
                 snapshot_keep=2, rollback_lr_factor=0.5, max_bad_steps=0, bundle_dir=None,
                 spike_window=50, spike_threshold=8.0):
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
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
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
        self._snapshots = []
        self._log = None
        if event_log:
            self._log = open(event_log, "w", encoding="utf-8")
        if policy == "rollback":
            self._snapshot()  # until the first good step

    # -- the step -------------------------------------------------------------
    def step(self, closure, *args, **kwargs):
        """Runs one guarded step: ``loss = closure(*args, **kwargs)`` then the
        checks, backward, clipping and ``optimizer.step()`` or the policy.
        Returns a :class:`StepResult`."""
        step = self.steps
        self.steps += 1
        rng = _rng_states()
        self.optimizer.zero_grad(set_to_none=True)
        loss = _trainable_loss(closure(*args, **kwargs))
        finite_loss, loss_value = self.sentinel.check_loss(loss)
        norm, reason, bad_param = float("nan"), "", ""
        if finite_loss:
            self.scaler.scale(loss).backward()
            report = self.sentinel.inspect_grads(self.scaler.inv_scale())
            norm = report.total_norm
            if not report.finite():
                reason, bad_param = "non-finite gradient", report.first_nonfinite_name
        else:
            reason = "non-finite loss"
        if not reason:
            if self.policy == "rollback" and step % self.snapshot_every == 0:
                self._snapshot()  # parameters this step just showed finite
            factor = self.scaler.inv_scale() * _nanguard.clip_coefficient(norm, self.max_norm)
            self.sentinel.apply_factor_(factor)
            if self.clip_value > 0:
                torch.nn.utils.clip_grad_value_(self._params, self.clip_value)
            self.optimizer.step()
            self.scaler.update(False)
            self._bad_in_a_row = 0
            spikes = self.sentinel.observe(loss_value, norm)
            return self._emit(StepResult(step, loss_value, norm, "step", False, self.scaler.get_scale(),
                                         self._lr(), spikes=spikes))

        # A bad step: nothing is stepped. Localize, then act.
        self.skipped += 1
        self._bad_in_a_row += 1
        finding, verdict = None, ""
        if self.replay:
            finding, verdict = self._replay(step, rng, closure, args, kwargs)
        self.optimizer.zero_grad(set_to_none=True)
        action = self.policy
        if self.max_bad_steps and self._bad_in_a_row >= self.max_bad_steps:
            action = "abort"
        if self.scaler.enabled:
            self.scaler.update(True)  # every policy backs an enabled scaler off
        if action == "rollback":
            self._rollback()
        result = self._emit(StepResult(step, loss_value, norm, action, True, self.scaler.get_scale(),
                                       self._lr(), reason, bad_param, finding, verdict))
        if action == "abort":
            self._bundle(step, rng, args, kwargs, finding)
            if finding is None:
                raise NonFiniteError(f"step {step}: {reason}" + (f" in {bad_param}" if bad_param else "")
                                     + " (replay did not name an op)")
            raise NonFiniteError(finding)
        return result

    def _replay(self, step, rng, closure, args, kwargs):
        """Re-runs the step under the tracer from the step's RNG state."""
        state = _rng_states()
        self.optimizer.zero_grad(set_to_none=True)
        _set_rng_states(rng)
        try:
            with trace(self.model, step=step, inside_kernels=True) as t:
                loss = closure(*args, **kwargs)
                # (not torch.isfinite: it compares with a wrapped +inf scalar,
                # whose conversion the tracer would report)
                if not _nanguard.has_nonfinite(loss.detach()):
                    self.scaler.scale(loss).backward()
        finally:
            _set_rng_states(state)
        f = t.findings
        return (f[0], "reproduced") if f else (None, "not reproduced")

    # -- snapshots and rollback ----------------------------------------------
    def _snapshot(self):
        snap = (copy.deepcopy(self.model.state_dict()), copy.deepcopy(self.optimizer.state_dict()))
        self._snapshots.append(snap)
        del self._snapshots[:-self.snapshot_keep]

    def _rollback(self):
        lrs = [g["lr"] for g in self.optimizer.param_groups]
        model_state, opt_state = self._snapshots[-1]
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(opt_state)
        self.rollbacks += 1
        self.lr_factor *= self.rollback_lr_factor
        for g, lr in zip(self.optimizer.param_groups, lrs):  # the LR goes on from where it was
            g["lr"] = lr * self.rollback_lr_factor
        self.sentinel.reset_spikes()

    def _lr(self):
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer.param_groups else 0.0

    # -- outputs ----------------------------------------------------------------
    def _emit(self, result):
        if self._log is not None:
            d = result.to_dict()
            d["time"] = time.time()
            self._log.write(json.dumps(d) + "\n")
            self._log.flush()
        return result

    def _bundle(self, step, rng, args, kwargs, finding):
        if not self.bundle_dir:
            return
        os.makedirs(self.bundle_dir, exist_ok=True)
        path = os.path.join(self.bundle_dir, f"step-{step}.pt")
        tmp = f"{path}.tmp-{os.getpid()}"  # renamed into place: never a half-written bundle
        try:
            torch.save({"step": step, "rng_state": rng[0], "cuda_rng_state": rng[1], "args": args, "kwargs": kwargs,
                        "model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                        "finding": finding.to_dict() if finding is not None else None}, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def close(self):
        """Closes the event log."""
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
