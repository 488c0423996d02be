"""What nanguard.Guard tells its user: a NanGuardWarning for each step the
optimizer did not take (short for a repeat of the same failure), the run's
summary when it closes after one, silence with verbose=False, and
summary()."""
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard


class LogHead(nn.Module):
    """-log(sigmoid(lin(x)) * w): w = 0 takes the log of 0 in ``head``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, w):
        return -torch.log(torch.sigmoid(self.lin(x)) * w).mean()


def run(steps_bad, steps=6, **options):
    """Trains LogHead for ``steps``, w = 0 at ``steps_bad``; returns the
    guard (closed) and the NanGuardWarnings' messages."""
    torch.manual_seed(0)
    model = LogHead()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = nanguard.Guard(model, opt, **options)
        for i in range(1, steps + 1):
            g.step(model, x, torch.zeros(8, 1) if i in steps_bad else torch.ones(8, 1))
        g.close()
    return g, [str(w.message) for w in caught if issubclass(w.category, nanguard.NanGuardWarning)]


def test_each_bad_step_warns_once_and_the_close_sums_up_the_run():
    g, messages = run({3, 4, 5})
    assert len(messages) == 4, messages
    first, second, third, summary = messages
    assert first.startswith("nanguard: step 3: ")
    for part in ("aten::log", "(forward)", "[log_of_nonpositive]", ": skipped the step", "; remedy: "):
        assert part in first
    assert second.startswith("nanguard: step 4: ") and "again (2nd time): skipped the step" in second
    assert "remedy" not in second
    assert "again (3rd time)" in third
    assert summary.startswith("nanguard: 6 steps, 3 not taken (3 skipped); last bad step 5 [log_of_nonpositive]; "
                              "loss ")
    s = g.summary()
    assert (s["steps"], s["not_taken"], s["rolled_back"], s["last_bad_step"], s["last_cause"]) == \
        (6, 3, 0, 5, "log_of_nonpositive")
    assert (s["first_step"], s["final_step"]) == (1, 6) and s["final_loss"] < s["first_loss"]
    assert s["text"] == summary


def test_a_rollback_warns_where_it_went_back_to():
    _, messages = run({3}, policy="rollback", snapshot_every=1)
    assert "rolled back to the snapshot of step 2" in messages[0], messages
    assert "1 rolled back" in messages[-1]


def test_an_abort_warns_and_its_error_carries_the_cause_and_remedy():
    torch.manual_seed(0)
    model = LogHead()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="abort")
    with pytest.warns(nanguard.NanGuardWarning, match=r"step 1: .*\[log_of_nonpositive\]: stopped training"):
        with pytest.raises(nanguard.NonFiniteError, match=r"log_of_nonpositive.*remedy: ") as err:
            g.step(model, torch.randn(8, 4), torch.zeros(8, 1))
    assert err.value.result.action == "abort"
    with pytest.warns(nanguard.NanGuardWarning, match=r"stopped at step 1 \(abort\)"):
        g.close()


def test_verbose_false_is_silent_and_the_summary_still_knows():
    g, messages = run({2}, verbose=False)
    assert messages == []
    assert g.summary()["not_taken"] == 1


def test_a_clean_run_warns_nothing():
    g, messages = run(set())
    assert messages == []
    assert g.summary()["text"].startswith("nanguard: 6 steps, all taken; loss ")


def test_the_warning_is_a_user_warning_that_a_filter_silences():
    assert issubclass(nanguard.NanGuardWarning, UserWarning)
    torch.manual_seed(0)
    model = LogHead()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=nanguard.NanGuardWarning)
        with nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1)) as g:
            g.step(model, torch.randn(8, 4), torch.zeros(8, 1))
    assert caught == []
