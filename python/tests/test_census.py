"""nanguard.census and has_nonfinite from Python."""
import math

import pytest
import torch

import nanguard

FIELDS = ["numel", "nan", "pos_inf", "neg_inf", "finite", "zeros", "subnormal", "min", "max",
          "mean", "std", "l2_norm", "absmax", "fp16_overflow", "fp16_underflow", "bf16_overflow",
          "first_nonfinite_index", "first_nonfinite_value"]


def test_census_counts_every_kind():
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0, 1e5, 1e-8])
    s = nanguard.census(t)
    assert (s.numel, s.nan, s.pos_inf, s.neg_inf, s.finite, s.zeros) == (7, 1, 1, 1, 4, 1)
    assert s.fp16_overflow == 1 and s.fp16_underflow == 1
    assert s.first_nonfinite_index == 1 and math.isnan(s.first_nonfinite_value)
    assert s.max == pytest.approx(1e5)
    assert set(s.to_dict()) == set(FIELDS)
    assert "nan=1" in str(s)


def test_census_matches_torch_on_views():
    x = torch.randn(64, 33)[:, ::2]
    s = nanguard.census(x)
    assert s.mean == pytest.approx(x.mean().item(), abs=1e-5)
    assert s.std == pytest.approx(x.std(unbiased=False).item(), rel=1e-4)
    assert s.all_finite() and s.nonfinite == 0


def test_has_nonfinite():
    assert not nanguard.has_nonfinite(torch.ones(1000))
    x = torch.ones(1000)
    x[999] = float("inf")
    assert nanguard.has_nonfinite(x)
    assert not nanguard.has_nonfinite(torch.arange(5))  # integers are always finite


def test_census_errors_are_python_exceptions():
    with pytest.raises(ValueError, match="float32"):
        nanguard.census(torch.arange(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        nanguard.census([1.0, 2.0])


def test_census_does_not_copy_grad_tensors():
    w = torch.randn(10, requires_grad=True)
    assert nanguard.census(w * 2).numel == 10


def test_isolation_forest_scores_the_outlier_lowest():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 4, generator=g, dtype=torch.float64)
    x[17] = 8.0
    forest = nanguard.IsolationForest(n_estimators=50, seed=1).fit(x)
    assert forest.fitted and forest.features == 4
    scores = forest.score_samples(x)
    assert scores.shape == (500,) and scores.dtype == torch.float64
    assert int(scores.argmin()) == 17
    assert int(forest.predict(x)[17]) == -1
    with pytest.raises(ValueError):
        nanguard.IsolationForest(n_estimators=0)
