"""Under ``-W error`` (``warnings.simplefilter("error")``, pytest's
``filterwarnings = error``) nanguard does what it does without it
(docs/python.md, "Warnings and logging"): each scenario runs with the
warnings shown, then made errors, and both runs must raise the same errors,
tell the same lines (a warning made an error is raised once the work is
done, or is a note of the error that wins over it) and end in the same
state: the LR and the scheduler's, the guard closed, its summary, the
bundle, the event log, the logger's records."""
import json
import logging
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

import nanguard


class LogHead(nn.Module):
    """-log(sigmoid(lin(x)) * w): w = 0 takes the log of 0."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x, w):
        return -torch.log(torch.sigmoid(self.lin(x)) * w).mean()


X = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))


def model_and_optimizer():
    torch.manual_seed(0)
    model = LogHead()
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def train(call, guard, model, bad, steps, sched=None):
    """``steps`` guarded steps of ``model`` (w = 0 at the steps in ``bad``), each through ``call``."""
    for i in range(1, steps + 1):
        call(lambda: guard.step(model, X, torch.zeros(8, 1) if i in bad else torch.ones(8, 1)))
        if sched is not None:
            sched.step()


def ended(guard, event_log=None):
    """What is left of a guard's run: closed, its summary, its event log's actions."""
    try:
        state = {"closed": guard.steps < 0}
    except RuntimeError:  # "the guard is closed"
        state = {"closed": True}
    state["summary"] = json.dumps(guard.summary(), sort_keys=True)
    if event_log:
        with open(event_log) as lines:
            state["log"] = [json.loads(line)["action"] for line in lines]
    return state


def outcome(fn, record):
    """Calls ``fn``; records what came of it, (the error it raised, the lines
    told: each warning shown, raised, or a note of the error), the same
    whether the warnings show or are errors; returns the error."""
    with warnings.catch_warnings(record=True) as shown:
        try:
            fn()
            error = None
        except Exception as e:  # noqa: BLE001 - each is compared
            error = e
    told = [f"{w.category.__name__}: {w.message}" for w in shown]
    if isinstance(error, Warning):
        told.append(f"{type(error).__name__}: {error}")
    told += getattr(error, "__notes__", [])
    record.append((None if error is None or isinstance(error, Warning) else type(error).__name__, told))
    return error


def run_in(directory, scenario):
    """``scenario(call)`` in ``directory`` (so that its files, and the
    lines naming them, are alike in every run): its calls and state."""
    calls = []
    os.makedirs(directory)
    cwd = os.getcwd()
    os.chdir(directory)
    try:
        return calls, scenario(lambda fn: outcome(fn, calls))
    finally:
        os.chdir(cwd)


def shown_then_raised(scenario, tmp_path, category=Warning):
    """Runs ``scenario(call)`` with the warnings of ``category`` shown, then
    made errors (the others ignored); asserts that both runs told, raised
    and returned the same; returns the first run's calls and state."""
    runs = []
    for action in ("always", "error"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            warnings.filterwarnings(action, category=category)
            runs.append(run_in(tmp_path / action, scenario))
    assert runs[1] == runs[0]
    return runs[0]


# -- the scenarios (also run by `python -W error` below) ----------------------
def abort(call):
    model, opt = model_and_optimizer()
    guard = nanguard.Guard(model, opt, policy="abort", bundle_dir="bundles", event_log="events.jsonl")
    train(call, guard, model, {2}, 2)
    bundle = os.path.join("bundles", "step-000002")
    call(guard.close)
    call(guard.close)
    return {"written": os.path.isdir(bundle), **ended(guard, "events.jsonl")}


def rollback(call):
    model, opt = model_and_optimizer()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)  # sets the LR from base_lrs at each step()
    guard = nanguard.Guard(model, opt, policy="rollback", snapshot_every=1, lr_scheduler=sched,
                           event_log="events.jsonl")
    train(call, guard, model, {3}, 5, sched)
    call(guard.close)
    return {"lr": opt.param_groups[0]["lr"], "last_lr": sched.get_last_lr(), "base_lrs": sched.base_lrs,
            "weights": model.lin.weight.tolist(), **ended(guard, "events.jsonl")}


def skip(call):
    model, opt = model_and_optimizer()
    guard = nanguard.Guard(model, opt, policy="skip")
    train(call, guard, model, {2, 3}, 4)
    state = {"skipped": guard.skipped, "weights": model.lin.weight.tolist()}
    call(guard.close)
    return {**state, **ended(guard)}


def test_an_abort_raises_nonfinite_error_with_its_bundle_and_the_warning_as_a_note(tmp_path):
    calls, state = shown_then_raised(abort, tmp_path)
    assert [error for error, _ in calls] == [None, "NonFiniteError", None, None]
    assert "stopped training" in calls[1][1][0] and "stopped at step 2 (abort)" in calls[2][1][0]
    assert calls[3][1] == []  # a second close tells nothing
    assert state["written"] and state["closed"] and state["log"] == ["step", "abort"]


def test_a_rollback_lowers_the_lr_scheduler_before_its_warning(tmp_path):
    calls, state = shown_then_raised(rollback, tmp_path)
    assert "rolled back to the snapshot of step 2" in calls[2][1][0]
    assert state["lr"] == state["last_lr"][0] == state["base_lrs"][0] == pytest.approx(0.05)
    assert state["log"] == ["step", "step", "rollback", "step", "step"] and state["closed"]


def test_a_skipped_step_is_skipped_and_counted_before_its_warning(tmp_path):
    calls, state = shown_then_raised(skip, tmp_path)
    assert [len(told) for _, told in calls] == [0, 1, 1, 0, 1]
    assert state["skipped"] == 2 and state["closed"] and '"not_taken": 2' in state["summary"]


def test_a_with_block_keeps_its_error_and_closes_the_guard(tmp_path):
    def scenario(call):
        model, opt = model_and_optimizer()
        guard = nanguard.Guard(model, opt, policy="abort")

        def run():
            with guard:
                guard.step(model, X, torch.zeros(8, 1))

        call(run)
        call(guard.close)
        return ended(guard)

    calls, state = shown_then_raised(scenario, tmp_path)
    assert calls[0][0] == "NonFiniteError" and len(calls[0][1]) == 2  # the step's warning and the summary's
    assert calls[1] == (None, []) and state["closed"]


def test_the_guards_cxx_warning_waits_for_the_step(tmp_path):
    def scenario(call):
        model, opt = model_and_optimizer()
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0)
        guard = nanguard.Guard(model, opt, policy="rollback", snapshot_memory_mb=1e-6, lr_scheduler=sched)
        train(call, guard, model, {2}, 3, sched)
        state = {"steps": guard.steps, "skipped": guard.skipped, "lr": sched.get_last_lr()}
        call(guard.close)
        return {**state, **ended(guard)}

    calls, state = shown_then_raised(scenario, tmp_path)
    assert calls[0][1][0].startswith("UserWarning: nanguard::guard: step 0: no snapshot taken")
    assert (state["steps"], state["skipped"], state["lr"]) == (3, 1, [0.1])


def test_trace_tells_at_exit_and_a_blocks_error_wins(tmp_path):
    def scenario(call):
        model = LogHead()
        traces = [nanguard.trace(model), nanguard.trace(model)]

        def clean_exit():
            with traces[0]:
                model(X, torch.zeros(8, 1))

        def error_exit():
            with traces[1]:
                model(X, torch.zeros(8, 1))
                raise KeyError("the block's own")

        call(clean_exit)
        call(error_exit)
        return {"findings": [str(f) for t in traces for f in t.findings]}

    calls, state = shown_then_raised(scenario, tmp_path)
    assert [error for error, _ in calls] == [None, "KeyError"]
    assert all(len(told) == 1 and "trace found a non-finite value" in told[0] for _, told in calls)
    assert len(state["findings"]) == 2


def test_the_logger_records_the_same_lines(tmp_path):
    def scenario(call):
        records = []
        handler = logging.Handler()
        handler.emit = lambda record: records.append((record.levelname, record.getMessage()))
        logger = logging.getLogger("nanguard")
        logger.addHandler(handler)
        try:
            return {**skip(call), "records": records}
        finally:
            logger.removeHandler(handler)

    _, state = shown_then_raised(scenario, tmp_path)
    assert [level for level, _ in state["records"]] == ["WARNING"] * 3


def test_the_lightning_callback_records_the_step_and_an_abort_stays_nonfinite_error(tmp_path):
    pytest.importorskip("lightning")
    from nanguard.integrations.lightning import NanGuard
    from test_integrations_lightning import Classifier, fit

    def scenario(policy, steps):
        def run(call):
            callback = NanGuard(policy=policy, bundle_dir="bundles")
            torch.manual_seed(0)
            model = Classifier(log0_at=steps - 1)  # the last step is bad
            call(lambda: fit(model, [callback], steps=steps))
            return {"bad_steps": [r.step for r in callback.bad_steps], "last": callback.last.action,
                    "weights": model.head.weight.tolist(), "bundle": os.path.isdir("bundles"),
                    **ended(callback.guard)}
        return run

    # Lightning's own warnings would stop the fit under "error": only nanguard's are made errors here.
    calls, state = shown_then_raised(scenario("skip", 3), tmp_path / "skip", nanguard.NanGuardWarning)
    assert calls[0][0] is None and len(calls[0][1]) == 2  # the step's warning and the summary's
    assert state["bad_steps"] == [2] and state["last"] == "skip" and state["closed"]
    calls, state = shown_then_raised(scenario("abort", 2), tmp_path / "abort", nanguard.NanGuardWarning)
    assert calls[0][0] == "NonFiniteError" and len(calls[0][1]) == 2
    assert state["bad_steps"] == [1] and state["last"] == "abort" and state["bundle"] and state["closed"]


SUBPROCESS = """
import json, os, sys
sys.path.insert(0, {tests!r})
from test_warnings_as_errors import abort, rollback, run_in
print(json.dumps([run_in(os.path.join(sys.argv[1], s.__name__), s) for s in (abort, rollback)]))
"""


def test_python_dash_w_error_behaves_as_without_it(tmp_path):
    """The interpreter's own flag, with nanguard imported under it."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = [run_in(tmp_path / "shown" / s.__name__, s) for s in (abort, rollback)]
    done = subprocess.run([sys.executable, "-W", "error", "-c",
                           SUBPROCESS.format(tests=os.path.dirname(os.path.abspath(__file__))), str(tmp_path / "w")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == json.loads(json.dumps(shown))


def test_the_transformers_callback_records_the_step_and_closes_the_guard(tmp_path):
    pytest.importorskip("transformers")
    from nanguard.integrations.transformers import NanGuardCallback
    from test_integrations_transformers import Plant, tiny_bert, train

    def scenario(call):
        callback = NanGuardCallback(policy="skip")
        model = tiny_bert()
        call(lambda: train(tmp_path, model, [callback, Plant(model, log0_at=1)], steps=2))
        return {"bad_steps": [r.step for r in callback.bad_steps], "weights": model.classifier.weight.tolist(),
                **ended(callback.guard)}

    calls, state = shown_then_raised(scenario, tmp_path, nanguard.NanGuardWarning)
    assert calls[0][0] is None and len(calls[0][1]) == 2  # the step's warning and the summary's
    assert state["bad_steps"] == [2] and state["closed"]
