"""nanguard.Firewall: drop, repair and clip the rows of a batch from Python."""
import math

import pytest
import torch

import nanguard


def batch():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=g)
    x[5, 2] = float("nan")
    x[9, 0] = float("inf")
    return x


def test_drop_removes_the_rows_with_nonfinite_values():
    clean, report = nanguard.Firewall(nonfinite="drop").apply(batch())
    assert report.dropped_rows == [5, 9]
    assert report.rows_in == 32 and report.rows_out == 30
    assert clean.shape == (30, 4) and torch.isfinite(clean).all()
    assert report.columns[2]["nan"] == 1 and report.columns[0]["pos_inf"] == 1
    assert not report.clean()


def test_impute_median_repairs_in_place_of_dropping():
    x = batch()
    clean, report = nanguard.Firewall(nonfinite="impute_median").apply(x)
    assert clean.shape == x.shape and torch.isfinite(clean).all()
    assert report.changed_rows == [5, 9] and report.repaired == 2
    finite = x[:, 2][torch.isfinite(x[:, 2])]
    assert math.isclose(clean[5, 2].item(), finite.median().item(), rel_tol=0, abs_tol=0.5)


def test_fitted_bounds_clip_extreme_outliers():
    g = torch.Generator().manual_seed(4)
    train = torch.randn(2000, 3, generator=g)
    fw = nanguard.Firewall(nonfinite="drop", outliers="clip", rule="three_sigma").fit(train)
    assert fw.fitted
    x = torch.randn(8, 3, generator=g)
    x[2, 1] = 1e6
    clean, report = fw.apply(x)
    assert report.clipped == 1 and report.changed_rows == [2]
    assert clean[2, 1].item() == pytest.approx(fw.upper_bounds[1].item(), rel=1e-6)


def test_raise_names_the_row_and_column():
    with pytest.raises(ValueError, match="row 5"):
        nanguard.Firewall(column_names=["a", "b", "c", "d"]).apply(batch())


def test_bad_policy_names_list_the_valid_ones():
    with pytest.raises(ValueError, match="impute_median"):
        nanguard.Firewall(nonfinite="fix")


def test_impute_median_refuses_a_column_with_no_finite_value():
    # It imputed 0 there, silently: no median exists to impute.
    train = torch.randn(16, 3)
    train[:, 1] = float("nan")
    fw = nanguard.Firewall(nonfinite="impute_median", column_names=["a", "b", "c"])
    with pytest.raises(ValueError, match=r"column 1 \('b'\) has no finite value"):
        fw.fit(train)
    assert not fw.fitted
    with pytest.raises(ValueError, match="has no finite value"):
        nanguard.Firewall(nonfinite="impute_median").apply(train)
    # A label column is never imputed (its rows are dropped): no median needed.
    fw = nanguard.Firewall(nonfinite="impute_median", label_columns=[1]).fit(train)
    clean, report = fw.apply(train)
    assert report.rows_out == 0


@pytest.mark.parametrize("options, message", [
    ({"sigmas": float("nan")}, "sigmas must be a finite number > 0"),
    ({"sigmas": float("inf")}, "sigmas must be a finite number > 0"),
    ({"robust_z": -1.0}, "robust_z must be a finite number > 0"),
    ({"low_quantile": float("nan")}, "low_quantile"),
    ({"high_quantile": 1.5}, "high_quantile"),
    ({"nan_value": float("inf")}, "nan_value must be finite"),
    ({"label_columns": [-1]}, "label_columns holds -1"),
    ({"column_names": ["a", "b", "a"]}, "column_names holds 'a' twice"),
])
def test_bad_options_are_refused_where_they_enter(options, message):
    with pytest.raises(ValueError, match=message):
        nanguard.Firewall(**options)


def test_column_names_must_name_every_column():
    with pytest.raises(ValueError, match="2 column_names for data of 4 columns"):
        nanguard.Firewall(column_names=["a", "b"]).fit(batch())


@pytest.mark.parametrize("options, message", [
    ({"seed": -1}, "seed must be an integer >= 0 but is -1"),
    ({"contamination": float("nan")}, "contamination must be in"),
    ({"n_estimators": 0}, "n_estimators must be at least"),
])
def test_isolation_forest_refuses_bad_options(options, message):
    with pytest.raises(ValueError, match=message):
        nanguard.IsolationForest(**options)
