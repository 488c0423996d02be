"""Callbacks that guard a training run driven by a framework, with one line
and no change to the user's model:

- :class:`nanguard.integrations.lightning.NanGuard` for PyTorch Lightning's
  ``Trainer(callbacks=[...])``;
- :class:`nanguard.integrations.transformers.NanGuardCallback` for Hugging
  Face's ``Trainer(callbacks=[...])``.

Each runs :class:`nanguard.Guard`'s sentinel after every backward (through
``Guard.begin_step`` and ``Guard.check``), skips or rolls back a bad step
per the policy, replays it under the tracer to name the op, and writes the
event log and bundle of a plain run (``nanguard report`` / ``inspect``).
The framework is imported only when its submodule is.

:data:`LAST_CAUSE_CODES` maps the number both log as ``nanguard/last_cause``
to the cause's name (0: "none", before the first bad step).
"""
from ._common import LAST_CAUSE_CODES

__all__ = ["LAST_CAUSE_CODES"]
