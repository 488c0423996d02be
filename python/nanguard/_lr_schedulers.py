"""The torch LR schedulers a loop steps beside a :class:`nanguard.Guard`
(``Guard(lr_scheduler=...)``), lowered with the LR when the guard rolls
back: the C++ guard multiplies the param groups' LRs by its rollback
factor, and a scheduler that computes the LR from values of its own would
set it back at its next step."""
from __future__ import annotations

from typing import Any, Iterable, List, Sequence, Union

import torch
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau


def schedulers_of(name: str, lr_scheduler: Union[LRScheduler, ReduceLROnPlateau, Sequence[Any], None]) -> List[Any]:
    """The schedulers of the option ``name`` (``lr_scheduler``) as a list; a
    TypeError naming the option for anything else."""
    given = [] if lr_scheduler is None else (list(lr_scheduler) if isinstance(lr_scheduler, (list, tuple))
                                             else [lr_scheduler])
    for s in given:
        if not isinstance(s, (LRScheduler, ReduceLROnPlateau)):
            raise TypeError(f"nanguard.Guard: {name} must be a torch.optim.lr_scheduler scheduler or a list of "
                            f"them, e.g. {name}=LambdaLR(opt, warmup), got {type(s).__name__}")
    return given


def follow_rollback(schedulers: Iterable[Any], lr_factor_before: float, lr_factor: float) -> None:
    """Lowers ``schedulers`` by what a step changed the guard's LR factor by
    (``lr_factor / lr_factor_before``: a rollback's factor); nothing when
    the step did not roll back."""
    if lr_factor != lr_factor_before:
        lower_scheduler_lrs(schedulers, lr_factor / lr_factor_before)


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
