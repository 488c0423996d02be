"""A training loop on nanguard's public API, type-checked by the
python_typing test with `mypy --strict` (and run by test_typing.py): every
call below must type-check against the package's annotations and the
extension's stub (_nanguard.pyi)."""
from __future__ import annotations

import os
import sys
import tempfile
from typing import List, Optional

import torch
import torch.nn.functional as F

import nanguard
from nanguard import Finding, Guard, NonFiniteError, StepResult


def train(directory: str) -> List[StepResult]:
    """Four steps of a small regression, the third with a NaN batch; the
    results of the steps."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    results: List[StepResult] = []
    with Guard(model, optimizer, policy="skip", max_norm=1.0, loss_scale={"init_scale": 1024.0},
               schedule={"base_lr": 0.1, "warmup_steps": 2}, event_log=os.path.join(directory, "events.jsonl"),
               bundle_tags={"task": "regress"}) as guard:
        for step in range(4):
            x = torch.randn(16, 4)
            if step == 2:
                x[0, 1] = float("nan")
            y = x.sum(dim=1, keepdim=True)
            results.append(guard.step(lambda a, b: F.mse_loss(model(a), b), x, y))
        assert guard.steps == 4 and guard.skipped == 1
    return results


def describe(result: StepResult) -> str:
    """One line about a step: its action, and where a NaN/Inf was born."""
    finding: Optional[Finding] = result.finding
    if finding is None:
        return f"step {result.step}: {result.action} (loss {result.loss:.3f})"
    fix: Optional[nanguard.RemedyCheck] = finding.verified_remedy
    verified = f"; verified: {fix.applied} (loss {fix.loss:.3g})" if fix is not None else ""
    return f"step {result.step}: {result.action}, {finding.op} in {finding.module or '?'} ({finding.cause}){verified}"


def trace_one() -> Optional[Finding]:
    """The first op of a traced forward and backward that made a NaN."""
    model = torch.nn.Linear(3, 1)
    with nanguard.trace(model, max_findings=1) as t:
        model(torch.tensor([[1.0, 0.0, -1.0]]).log()).sum().backward()
    return t.findings[0] if t.found else None


def main() -> int:
    stats: nanguard.TensorStats = nanguard.census(torch.tensor([1.0, float("nan")]))
    assert stats.nan == 1 and nanguard.has_nonfinite(torch.tensor([float("inf")]))
    with tempfile.TemporaryDirectory() as directory:
        results = train(directory)
        for r in results:
            print(describe(r))
        page: str = nanguard.report(os.path.join(directory, "events.jsonl"), os.path.join(directory, "r.html"))
        assert os.path.getsize(page) > 0
    found = trace_one()
    try:
        if found is not None:
            raise NonFiniteError(found)
    except NonFiniteError as e:
        print(f"trace: {e.finding.op} ({e.finding.role})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
