"""Every finding says its likely cause and the fix (``Finding.cause``,
``evidence``, ``remedy``, ``confidence``); the guard's results say the remedy
it applied."""
import json

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard


def only_finding(t):
    assert len(t.findings) == 1, t.findings
    return t.findings[0]


def test_log_of_an_underflowed_softmax_says_use_log_softmax():
    head = nn.Linear(4, 3)
    with torch.no_grad():
        head.weight.zero_()
        head.weight[:, 0] = torch.tensor([200.0, -200.0, 0.0])
    x, y = torch.ones(8, 4), torch.zeros(8, dtype=torch.long)
    with nanguard.trace(head) as t:
        F.nll_loss(torch.log(torch.softmax(head(x), 1)), y).backward()
    f = only_finding(t)
    assert f.cause == "log_of_nonpositive" and f.confidence == "high"
    assert "log of 0: 16 of 24 inputs are exactly 0" in f.evidence
    assert "torch.log_softmax(x, -1)" in f.remedy
    assert f.to_dict()["diagnosis"]["cause"] == "log_of_nonpositive"
    assert "cause:     log_of_nonpositive (high confidence)" in f.to_text()

    head.zero_grad()
    loss = F.nll_loss(torch.log_softmax(head(x), 1), y)  # the remedy
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(head.weight.grad).all()


def test_a_fully_masked_attention_row_says_handle_it():
    scores = torch.randn(4, 4, requires_grad=True)
    mask = torch.zeros(4, 4, dtype=torch.bool)
    mask[1] = True
    with nanguard.trace() as t:
        torch.softmax(scores.masked_fill(mask, float("-inf")), -1).sum().backward()
    f = only_finding(t)
    assert f.cause == "fully_masked_softmax"
    assert "scores.masked_fill(mask, torch.finfo(scores.dtype).min).softmax(-1)" in f.remedy
    assert "p.masked_fill(mask.all(-1, keepdim=True), 0.0)" in f.remedy

    scores.grad = None
    p = scores.masked_fill(mask, torch.finfo(scores.dtype).min).softmax(-1)
    p = p.masked_fill(mask.all(-1, keepdim=True), 0.0)
    p.sum().backward()
    assert torch.isfinite(p).all() and torch.isfinite(scores.grad).all()


def test_a_nan_in_the_input_is_bad_data():
    model = nn.Linear(3, 2)
    x = torch.randn(5, 3)
    x[2, 0] = float("nan")
    with nanguard.trace(model) as t:
        model(x).sum().backward()
    f = only_finding(t)
    assert f.role == "input" and f.cause == "bad_data"
    assert "the first in row 2" in f.evidence
    assert 'nanguard.Firewall(nonfinite="drop")' in f.remedy


def test_what_no_class_fits_is_unclassified():
    with nanguard.trace() as t:
        torch.sqrt(torch.tensor([4.0, -1.0]))
    f = only_finding(t)
    assert f.cause == "unclassified" and f.confidence == "low"
    assert "min -1 max 4" in f.evidence


def test_the_guard_diagnoses_with_its_history_and_says_what_it_did(tmp_path):
    # Linear regression at a sane LR, then an LR far above 2 / lambda_max:
    # the loss grows step by step until it overflows.
    torch.manual_seed(1)
    model = nn.Linear(8, 1)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "events.jsonl"
    # spike_rollback_z=0: no rollback of the runaway loss before it overflows
    # (the rescue of a diverging run, docs/guard.md), so that a NaN comes.
    g = nanguard.Guard(model, opt, policy="rollback", snapshot_every=10, event_log=str(log), spike_rollback_z=0)
    r = None
    for step in range(300):
        if step == 30:
            for group in opt.param_groups:
                group["lr"] = 1.5
        r = g.step(lambda: (model(x) - y).pow(2).mean())
        if r.skipped:
            break
    g.close()
    assert r.skipped and r.action == "rollback"
    assert r.finding is not None and r.finding.cause == "divergence", r.finding.evidence
    assert "max_norm=1.0" in r.finding.remedy
    assert r.remedy == f"rolled back to the snapshot of step {r.rollback_to}; lr 1.5 -> 0.75"
    line = json.loads(log.read_text().splitlines()[-1])
    assert line["remedy"] == r.remedy and line["findings"][0]["diagnosis"]["cause"] == "divergence"


def test_the_guard_names_the_closures_arguments_and_dict_keys():
    """A NaN in the labels: the finding names the closure's argument (``y``),
    or the batch dict's key, not a position; the remedy is the Python one
    (a firewall in the DataLoader), with no CSV to scan."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    y[5, 0] = float("nan")
    g = nanguard.Guard(model, opt, policy="skip")  # (auto would quarantine the batch: its second step is the same)
    r = g.step(lambda x, y: F.mse_loss(model(x), y), x, y)
    assert r.skipped and r.finding is not None
    assert r.finding.culprit.startswith("y") and r.finding.cause == "bad_data", r.finding
    assert "came in with y" in r.finding.evidence, r.finding.evidence
    assert "nanguard.data.firewall_collate(" in r.finding.remedy, r.finding.remedy
    assert "nanguard scan" not in r.finding.remedy and "C++" not in r.finding.remedy, r.finding.remedy
    r = g.step(lambda batch: F.mse_loss(model(batch["features"]), batch["labels"]), {"features": x, "labels": y})
    assert r.finding.culprit.startswith("labels") and r.finding.cause == "bad_data", r.finding
    g.close()
