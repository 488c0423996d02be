"""What nanguard tells its user goes through ``warnings`` and the
``nanguard`` logger, each line shown once whatever the user configured,
attributed to the user's line: a script run in a fresh interpreter (the
warnings filters and logging as a user's script has them, which pytest's
own would hide) for each setup."""
import logging
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import nanguard
from test_guard_warnings import LogHead, run

SCRIPT = textwrap.dedent('''\
    import logging, sys, warnings
    import torch, nanguard
    setup = sys.argv[1]
    if setup == "basicConfig":
        logging.basicConfig(stream=sys.stdout, format="%(name)s %(levelname)s %(filename)s:%(lineno)d %(message)s")
    if setup == "filter_nanguard":
        warnings.filterwarnings("ignore", category=nanguard.NanGuardWarning)
    model = torch.nn.Linear(4, 1)
    x = torch.randn(8, 4)
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=setup != "quiet")  # line 10
    for w in (1.0, 0.0, 1.0):
        guard.step(lambda: -torch.log(torch.sigmoid(model(x)) * w).mean())  # line 12
    with nanguard.trace(model, warn=setup != "quiet"):  # line 13
        torch.log(model(x) - 100.0)
    print("done")
''')

STEP = "nanguard: step 2: -inf from aten::log"
SUMMARY = "nanguard: 3 steps, 1 not taken"
TRACE = "nanguard: trace found a non-finite value: "  # then the finding, the line of its op first


def run_script(tmp_path, setup, *flags, env=None):
    """Runs the script with ``setup``; returns its stdout and stderr."""
    path = tmp_path / "train.py"
    path.write_text(SCRIPT)
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"}
    done = subprocess.run([sys.executable, *flags, str(path), setup], capture_output=True, text=True, timeout=120,
                          env={**environ, "PYTHONPATH": os.pathsep.join(sys.path), **(env or {})}, cwd=tmp_path)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr
    return done.stdout, done.stderr


def test_by_default_each_line_shows_once_as_a_warning_at_the_users_line(tmp_path):
    _, err = run_script(tmp_path, "default")
    for line in (STEP, SUMMARY, TRACE):
        assert err.count(line) == 1, err
    assert f"train.py:12: NanGuardWarning: {STEP}" in err
    assert f"train.py:13: NanGuardWarning: {TRACE}" in err
    assert f"{tmp_path / 'train.py'}:14 (<module>): step 0 forward aten::log: producer" in err
    # The guard is closed at the interpreter's exit: attributed to where it was built.
    assert f"train.py:10: NanGuardWarning: {SUMMARY}" in err
    assert "weakref.py" not in err


@pytest.mark.parametrize("how", ["-W ignore", "PYTHONWARNINGS=ignore"])
def test_with_the_warnings_ignored_each_line_still_shows_once_through_logging(tmp_path, how):
    flags, env = (["-W", "ignore"], None) if how.startswith("-W") else ([], {"PYTHONWARNINGS": "ignore"})
    _, err = run_script(tmp_path, "default", *flags, env=env)
    for line in (STEP, SUMMARY, TRACE):
        assert err.count(line) == 1, err
    assert "NanGuardWarning" not in err
    # Logging's last resort prints the message alone: the step's line names the op's line itself.
    assert f"{STEP} (forward) at {tmp_path / 'train.py'}:12 (<lambda>) [log_of_nonpositive]" in err, err


def test_configured_logging_gets_the_records_at_the_users_line(tmp_path):
    out, err = run_script(tmp_path, "basicConfig")
    assert f"nanguard WARNING train.py:12 {STEP}" in out
    assert f"nanguard WARNING train.py:13 {TRACE}" in out
    assert f"nanguard WARNING train.py:10 {SUMMARY}" in out
    assert err.count(STEP) == 1, err  # the warning as well, where warnings show


@pytest.mark.parametrize("setup", ["quiet", "filter_nanguard"])
def test_verbose_false_or_a_filter_for_nanguards_warnings_tells_nothing(tmp_path, setup):
    _, err = run_script(tmp_path, setup)
    assert "nanguard:" not in err, err


def test_the_logger_gets_each_warning_and_a_clean_runs_summary_at_info(caplog):
    with caplog.at_level(logging.INFO, logger="nanguard"):
        run({3})
        run(set())
    records = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "nanguard"]
    expected = [("WARNING", "nanguard: step 3: "), ("WARNING", "nanguard: 6 steps, 1 not taken"),
                ("INFO", "nanguard: 6 steps, all taken")]
    assert len(records) == 3 and all(level == want_level and message.startswith(want)
                                     for (level, message), (want_level, want) in zip(records, expected)), records
    assert {r.filename for r in caplog.records if r.name == "nanguard"} == {"test_guard_warnings.py"}


def test_the_step_and_close_warnings_name_the_users_file():
    model = LogHead()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
        g.step(model, torch.randn(8, 4), torch.zeros(8, 1))
        g.close()
    assert [os.path.basename(w.filename) for w in caught] == ["test_logging.py"] * 2, [str(w) for w in caught]


def test_a_trace_warns_its_first_finding_at_the_with_unless_told_not_to():
    x = torch.tensor([1.0, -1.0])
    with pytest.warns(nanguard.NanGuardWarning, match=r"(?s)aten::log.*\n  cause: log_of_nonpositive.*\n  remedy:"):
        with nanguard.trace():
            torch.log(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with nanguard.trace(warn=False) as t:
            torch.log(x)
        with pytest.raises(nanguard.NonFiniteError):  # raise_on_finding: the error, no warning
            with nanguard.trace(raise_on_finding=True):
                torch.log(x)
    assert t.findings[0].op == "aten::log"


def test_str_of_a_finding_ends_with_its_cause_and_remedy_and_repr_stays_one_line():
    with nanguard.trace(warn=False) as t:
        torch.log(torch.tensor([-1.0]))
    f = t.findings[0]
    line, cause, remedy = str(f).split("\n")
    assert line == f.summary() and line.startswith(f"{__file__}:{f.line} (test_str_of_a_finding_ends_with_its_cause_and_remedy_and_repr_stays_one_line): step 0 forward aten::log: producer")
    assert cause == f"  cause: log_of_nonpositive (high confidence): {f.evidence}"
    assert remedy == f"  remedy: {f.remedy}"
    assert repr(f) == f"<nanguard.Finding {f.summary()}>"
