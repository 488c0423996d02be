"""Verified remedies: a guard replays a bad step with its diagnosis's remedy
applied (Finding.remedy_checks, Finding.verified_remedy), and with
auto_fix=True keeps the verified op rewrite for the rest of the run."""
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn

import nanguard


def constant_column_run(steps=4, **options):
    """``steps`` guarded steps of a loss that divides by each input column's
    std, one column constant (std 0: a division by zero); the results, the
    guard's summary and the warnings it gave."""
    torch.manual_seed(0)
    model = nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(16, 3)
    x[:, 1] = 1.0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with nanguard.Guard(model, opt, policy="skip", max_norm=1.0, **options) as guard:
            results = [guard.step(lambda x: (model(x) / x.std(0)).pow(2).mean(), x) for _ in range(steps)]
            summary = guard.summary()
    return results, summary, [str(w.message) for w in caught if issubclass(w.category, nanguard.NanGuardWarning)]


def test_the_bad_step_carries_its_verified_remedy():
    results, summary, said = constant_column_run(steps=2)
    first = results[0]
    assert first.skipped and first.finding.op == "aten::div" and first.finding.cause == "division_by_zero"
    check = first.finding.remedy_checks[0]
    assert isinstance(check, nanguard.RemedyCheck)
    assert (check.remedy, check.result) == ("denominator_eps", "finite")
    assert "aten::div" in check.applied and math.isfinite(check.loss)
    assert first.finding.verified_remedy == check
    assert str(check).startswith("verified finite: " + check.applied)
    assert "verified:  verified finite: " in first.finding.to_text()
    assert first.finding.to_dict()["remedy_checks"][0]["result"] == "finite"
    # The remedy held inside the replay only: the next step divides by zero again.
    assert results[1].skipped and not results[1].auto_fix and summary["auto_fix"] == ""
    assert "[verified on this step: " + check.applied in said[0]


def test_verify_remedies_false_tries_none():
    results, _, _ = constant_column_run(steps=1, verify_remedies=False)
    assert results[0].finding.remedy_checks == [] and results[0].finding.verified_remedy is None


def test_auto_fix_keeps_the_verified_rewrite_for_the_later_steps(tmp_path):
    log = tmp_path / "events.jsonl"
    results, summary, said = constant_column_run(auto_fix=True, event_log=str(log))
    assert results[0].skipped and results[0].finding.verified_remedy is not None
    for r in results[1:]:
        assert r.action == "step" and math.isfinite(r.loss), r
        assert "aten::div" in r.auto_fix
    assert "aten::div" in summary["auto_fix"] and summary["auto_fix_since"] == 1
    assert "auto_fix kept " + summary["auto_fix"] in summary["text"]
    assert "auto_fix in force: " + summary["auto_fix"] in said[0]
    assert all(json.loads(line)["auto_fix"] == summary["auto_fix"] for line in log.read_text().splitlines())


def test_auto_fix_needs_verify_remedies():
    with pytest.raises(ValueError, match="auto_fix keeps a verified remedy, but verify_remedies is false"):
        constant_column_run(steps=1, auto_fix=True, verify_remedies=False)


def test_a_finding_without_checks_reads_as_before():
    """A finding written before remedies were checked (no "remedy_checks")."""
    results, _, _ = constant_column_run(steps=1)
    d = json.loads(results[0].finding.to_json())
    del d["remedy_checks"]
    old = nanguard.Finding.from_json(json.dumps(d))
    assert old.remedy_checks == [] and old.verified_remedy is None and old.op == "aten::div"


def nan_row_batch():
    torch.manual_seed(0)
    model = nn.Linear(3, 1)
    x = torch.randn(8, 3)
    x[2, 0] = float("nan")
    return model, torch.optim.SGD(model.parameters(), lr=0.01), x


def test_a_python_closure_runs_the_batch_without_its_nan_rows():
    """Bad data's remedy, the batch without its NaN rows, is checked through
    Python's closure: the guard puts the kept rows into the closure's
    arguments, in their structure (a tuple, a dict's key)."""
    model, opt, x = nan_row_batch()
    with nanguard.Guard(model, opt, policy="skip", verbose=False) as guard:
        r = guard.step(lambda batch, scale: model(batch["x"]).pow(2).mean() * scale, {"x": x}, 2.0)
    assert r.finding.cause == "bad_data"
    check = r.finding.remedy_checks[0]
    assert (check.remedy, check.result) == ("skip_rows", "finite"), check
    assert check.loss == pytest.approx(float(model(torch.cat([x[:2], x[3:]])).pow(2).mean() * 2.0))


def test_a_framework_replay_runs_no_batch_but_its_own():
    """guard.check's replay() ignores the batch it would be given: the check
    is not checkable, never a "still non-finite" of the whole batch again."""
    model, opt, x = nan_row_batch()
    with nanguard.Guard(model, opt, policy="skip", verbose=False) as guard:
        guard.begin_step()
        loss = model(x).pow(2).mean()
        loss.backward()
        r = guard.check(loss, replay=lambda: model(x).pow(2).mean(), batch=[x], names=["x"])
    assert r.skipped and r.finding.cause == "bad_data"
    check = r.finding.remedy_checks[0]
    assert check.result == "not_checkable" and "replay() runs the step's own batch only" in check.detail
