"""What the framework callbacks share: the framework check, per-rank event
logs, and keeping an LR scheduler in step with a rollback."""
import importlib
import os

import torch


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


def lower_scheduler_lrs(schedulers, factor):
    """Multiplies the base LRs of torch LR schedulers by ``factor``: a
    rollback lowers each param group's LR, and a scheduler that recomputes
    the LR from its base LRs at its next step would undo that."""
    for s in schedulers:
        if s is not None and hasattr(s, "base_lrs"):
            s.base_lrs = [lr * factor for lr in s.base_lrs]


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
