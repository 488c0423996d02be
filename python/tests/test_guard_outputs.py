"""A Python run's event log and repro bundle are the C++ guard's: `nanguard
report`, `inspect` and `replay` read them (this build's command, from the
NANGUARD_CLI environment variable that CTest sets)."""
import json
import os
import pickle
import subprocess
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard

CLI = os.environ.get("NANGUARD_CLI", "")
needs_cli = pytest.mark.skipif(not CLI, reason="NANGUARD_CLI is not set (CTest sets it to the built nanguard)")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)))


def data(n=32):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long()


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


def loss_fn(model):
    return lambda x, y: F.cross_entropy(model(x), y)


def logged_steps(tmp_path, nan_at):
    """Guard steps with an event log, the batch of the steps in ``nan_at``
    (1-based) with a NaN: their results and the log's lines."""
    x, y = data()
    bad = x.clone()
    bad[5, 1] = float("nan")
    model = Net()
    log = tmp_path / "events.jsonl"
    with nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0, event_log=log,
                        log_top_norms=2) as g:
        results = [g.step(loss_fn(model), bad if step in nan_at else x, y) for step in range(1, 4)]
    return results, [json.loads(l) for l in log.read_text().splitlines()]


def test_the_event_log_is_the_cpp_schema(tmp_path):
    results, lines = logged_steps(tmp_path, nan_at=(2,))
    assert [l["step"] for l in lines] == [1, 2, 3] == [r.step for r in results]
    assert [l["action"] for l in lines] == ["step", "skip", "step"]
    assert len(lines[0]["top_norms"]) == 2 and lines[0]["top_norms"][0]["norm"] >= lines[0]["top_norms"][1]["norm"]
    assert 0 < lines[0]["clip_coef"] <= 1
    assert lines[1]["loss"] == "nan" and results[1].reason == "non-finite loss"
    assert lines[1]["findings"][0]["op"] == "aten::addmm" and lines[1]["findings"][0]["role"] == "input"


def test_a_step_result_holds_its_event_log_line(tmp_path):
    """A StepResult's fields are read from the C++ step event as it is (no
    JSON on the way): the values of the event log's line, which to_dict()
    is; it pickles under every protocol (a NonFiniteError's result crosses
    processes; protocol 0 aborted the interpreter)."""
    results, lines = logged_steps(tmp_path, nan_at=(2,))
    for r, line in zip(results, lines):
        assert r.to_dict() == line
        for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
            assert pickle.loads(pickle.dumps(r, protocol=protocol)).to_dict() == line
        assert (r.step, r.action, r.skipped, r.reason, r.verdict, r.rank, r.rollback_to) == (
            line["step"], line["action"], line["skipped"], line.get("reason", ""), line.get("verdict", ""),
            line.get("rank", -1), line.get("rollback_to", -1))
        for key in ("loss", "grad_norm", "clip_coef", "scale", "lr"):
            assert str(getattr(r, key)) == str(float(line[key])), key  # "nan" too
        assert r.top_norms == [(t["name"], t["norm"]) for t in line["top_norms"]]
        assert r.nonfinite_params == [(p["name"], p["nonfinite"]) for p in line["nonfinite_params"]]
        assert ([json.loads(r.finding.to_json())] if r.finding else []) == line["findings"]
    assert results[1].finding is not None and results[1].verdict == "reproduced"


@needs_cli
def test_nanguard_report_shows_a_python_runs_findings(tmp_path):
    x, y = data()
    model = Net()
    log = tmp_path / "events.jsonl"
    with nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), event_log=log) as g:
        for step in range(6):
            g.step(lambda: F.cross_entropy(model(x), y) + (torch.sqrt(model.lin.bias - 100).sum() if step == 3 else 0))
    r = cli("report", log, "-o", tmp_path / "report.html")
    assert r.returncode == 0, r.stderr
    html = (tmp_path / "report.html").read_text()
    assert "aten::sqrt" in html
    # nanguard.report: the same page from Python (the command the package carries)
    assert nanguard.report(log, tmp_path / "api.html", title="a python run") == str(tmp_path / "api.html")
    assert "aten::sqrt" in (tmp_path / "api.html").read_text() and "a python run" in (tmp_path / "api.html").read_text()
    # A log with no event among real ones: the command's warning, as a Python warning
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.warns(UserWarning, match=r"^nanguard.report: the event log '.*empty.jsonl' holds no events"):
        nanguard.report([log, tmp_path / "empty.jsonl"], tmp_path / "two.html")


@needs_cli
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_nanguard_inspect_and_replay_read_a_python_bundle(tmp_path):
    x, y = data()
    bad = x.clone()
    bad[7, 2] = float("inf")
    model = Net()
    scripted = tmp_path / "net.pt"
    torch.jit.script(model).save(str(scripted))
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="abort",
                       bundle_dir=tmp_path / "bundles", bundle_tags={"task": "classify"})
    g.step(loss_fn(model), x, y)
    with pytest.raises(nanguard.NonFiniteError):
        g.step(loss_fn(model), bad, y)
    bundle = tmp_path / "bundles" / "step-000002"
    assert (bundle / "meta.json").exists()

    r = cli("inspect", bundle)
    assert r.returncode == 0, r.stderr
    assert "aten::addmm" in r.stdout and "batch[0]" in r.stdout
    assert nanguard.inspect(bundle) == r.stdout

    r = cli("replay", bundle, "--model", scripted)
    assert r.returncode == 3, r.stdout + r.stderr  # reproduced: exit 3, as for any non-finite result
    assert "reproduced" in r.stdout and "aten::addmm" in r.stdout
    assert "matches the bundle's finding" in r.stdout


@needs_cli
def test_report_and_inspect_from_python_refuse_what_they_cannot_read(tmp_path):
    """nanguard.report and nanguard.inspect: a missing file is a
    FileNotFoundError, a malformed one a ValueError with the command's
    message (file and line), not a CalledProcessError."""
    with pytest.raises(FileNotFoundError, match="nanguard.report: no event log at .*missing.jsonl"):
        nanguard.report(tmp_path / "missing.jsonl", tmp_path / "r.html")
    (tmp_path / "bad.jsonl").write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ValueError, match=r"^nanguard.report: /.*bad.jsonl:1: not a step event"):
        nanguard.report([tmp_path / "bad.jsonl"], tmp_path / "r.html")
    with pytest.raises(FileNotFoundError, match="nanguard.inspect: no bundle at"):
        nanguard.inspect(tmp_path / "no-bundle")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="nanguard.inspect: "):
        nanguard.inspect(tmp_path / "empty")


@needs_cli
def test_report_and_inspect_take_files_whose_names_begin_with_a_dash(tmp_path, monkeypatch):
    """A relative name such as "-run.jsonl" is a file, not an option of the command."""
    x, y = data()
    bad = x.clone()
    bad[7, 2] = float("inf")
    model = Net()
    monkeypatch.chdir(tmp_path)
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="abort", event_log="-run.jsonl",
                       bundle_dir="-bundles")
    g.step(loss_fn(model), x, y)
    with pytest.raises(nanguard.NonFiniteError):
        g.step(loss_fn(model), bad, y)
    g.close()
    assert nanguard.report(["-run.jsonl", "-run.jsonl"], "-report.html") == "-report.html"
    assert "aten::addmm" in (tmp_path / "-report.html").read_text()
    assert "aten::addmm" in nanguard.inspect("-bundles/step-000002")
    os.rename("-bundles/step-000002", "-step")
    assert "aten::addmm" in nanguard.inspect("-step")


def abort_without_bundle(tmp_path):
    """A guard that aborts on its first step, its bundle_dir under a file; and that step."""
    x, y = data()
    bad = x.clone()
    bad[7, 2] = float("inf")
    (tmp_path / "afile").write_text("x")
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="abort", verbose=False,
                       bundle_dir=tmp_path / "afile" / "bundles")
    return lambda: g.step(loss_fn(model), bad, y)


def test_an_abort_that_could_not_write_its_bundle_says_so(tmp_path):
    step = abort_without_bundle(tmp_path)
    with pytest.raises(nanguard.NonFiniteError, match=r"; note: no repro bundle: .*afile/bundles.*Not a directory") \
            as e:
        step()
    assert e.value.result.bundle == ""


def test_the_cores_warning_is_a_python_warning_not_a_raw_cpp_line(tmp_path, capfd):
    """The C++ guard's TORCH_WARN (no repro bundle) reaches Python as a
    UserWarning that pytest.warns catches; stderr holds no "[W ...]" line."""
    step = abort_without_bundle(tmp_path)
    with pytest.warns(UserWarning, match=r"nanguard::guard: step 1: no repro bundle: .*afile/bundles.*Not a "
                                         r"directory") as caught:
        with pytest.raises(nanguard.NonFiniteError):
            step()
    assert not any(isinstance(w.message, nanguard.NanGuardWarning) for w in caught)  # verbose=False
    err = capfd.readouterr().err
    assert "Warning: nanguard::guard" not in err and "no repro bundle" not in err, err


def test_a_warnings_filter_that_makes_the_cores_warning_an_error_keeps_the_abort(tmp_path, capfd):
    """Under warnings.simplefilter("error") the step still raises its
    NonFiniteError (the warning turned error is printed, not raised over it)."""
    step = abort_without_bundle(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(nanguard.NonFiniteError, match="no repro bundle"):
            step()
    assert "no repro bundle" in capfd.readouterr().err
