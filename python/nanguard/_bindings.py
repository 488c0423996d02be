"""The extension's classes that take options, with their arguments checked
by name: pybind11's own error for a wrong one lists the signature and what
was given, without saying which argument is wrong. Each is the extension's
class (``isinstance`` of it holds) with the same signature and defaults
(python/tests/test_argument_matrix.py holds them to the extension's)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence, Tuple

import torch

from . import _nanguard
from ._args import boolean, instance, integer, number, sequence_of, tensor, text

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup


class Firewall(_nanguard.Firewall):
    __doc__ = _nanguard.Firewall.__doc__

    def __init__(self, nonfinite: str = "raise", outliers: str = "ignore", rule: str = "quantile_range",
                 low_quantile: float = 0.001, high_quantile: float = 0.999, sigmas: float = 3.0,
                 robust_z: float = 5.0, nan_value: float = 0.0, label_columns: Sequence[int] = (),
                 column_names: Sequence[str] = ()) -> None:
        w = "nanguard.Firewall"
        super().__init__(text(w, "nonfinite", nonfinite), text(w, "outliers", outliers), text(w, "rule", rule),
                         number(w, "low_quantile", low_quantile), number(w, "high_quantile", high_quantile),
                         number(w, "sigmas", sigmas), number(w, "robust_z", robust_z),
                         number(w, "nan_value", nan_value), sequence_of(integer, w, "label_columns", label_columns),
                         sequence_of(text, w, "column_names", column_names))

    def fit(self, data: torch.Tensor) -> _nanguard.Firewall:
        return super().fit(tensor("nanguard.Firewall.fit", "data", data))

    def apply(self, batch: torch.Tensor) -> Tuple[torch.Tensor, _nanguard.FirewallReport]:
        return super().apply(tensor("nanguard.Firewall.apply", "batch", batch))


class IsolationForest(_nanguard.IsolationForest):
    __doc__ = _nanguard.IsolationForest.__doc__

    def __init__(self, n_estimators: int = 100, max_samples: int = 256, contamination: float = 0.0,
                 seed: int = 0) -> None:
        w = "nanguard.IsolationForest"
        super().__init__(integer(w, "n_estimators", n_estimators), integer(w, "max_samples", max_samples),
                         number(w, "contamination", contamination), integer(w, "seed", seed))

    def fit(self, x: torch.Tensor) -> _nanguard.IsolationForest:
        return super().fit(tensor("nanguard.IsolationForest.fit", "x", x))

    def score_samples(self, x: torch.Tensor) -> torch.Tensor:
        return super().score_samples(tensor("nanguard.IsolationForest.score_samples", "x", x))

    def decision_function(self, x: torch.Tensor) -> torch.Tensor:
        return super().decision_function(tensor("nanguard.IsolationForest.decision_function", "x", x))

    def predict(self, x: torch.Tensor) -> torch.Tensor:
        return super().predict(tensor("nanguard.IsolationForest.predict", "x", x))


class WarmupCosine(_nanguard.WarmupCosine):
    __doc__ = _nanguard.WarmupCosine.__doc__

    def __init__(self, base_lr: float, warmup_steps: int = 0, total_steps: int = 1000, min_lr: float = 0.0) -> None:
        w = "nanguard.WarmupCosine"
        super().__init__(number(w, "base_lr", base_lr), integer(w, "warmup_steps", warmup_steps),
                         integer(w, "total_steps", total_steps), number(w, "min_lr", min_lr))

    def lr(self, step: int) -> float:
        return super().lr(integer("nanguard.WarmupCosine.lr", "step", step))


class Distributed(_nanguard.Distributed):
    __doc__ = _nanguard.Distributed.__doc__

    def __init__(self, process_group: ProcessGroup, average_gradients: bool = True, backward: str = "none") -> None:
        import torch.distributed as dist
        w = "nanguard.Distributed"
        super().__init__(instance(w, "process_group", process_group, dist.ProcessGroup,
                                  "a torch.distributed ProcessGroup"),
                         boolean(w, "average_gradients", average_gradients), text(w, "backward", backward))
