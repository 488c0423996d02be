"""TensorBoard files of a guarded run, read with tensorboard's own readers
(EventAccumulator, event_file_loader): written from Python by
nanguard.tensorboard.StepLogger, and by the C++ writer of `nanguard report
LOG --tensorboard DIR` from a Python run's event log (this build's command,
from NANGUARD_CLI). Both must give the same tags and values."""
import json
import math
import os
import re
import subprocess

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard
from nanguard.tensorboard import StepLogger

pytest.importorskip("tensorboard", reason="the tensorboard package is not installed (requirements-frameworks.txt)")
from tensorboard.backend.event_processing import event_file_loader  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator  # noqa: E402

CLI = os.environ.get("NANGUARD_CLI", "")
needs_cli = pytest.mark.skipif(not CLI, reason="NANGUARD_CLI is not set (CTest sets it to the built nanguard)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.lin(x)))


def guarded_run(log, steps=6, bad_step=3, logger=None):
    """A Python Guard run whose step `bad_step` has a NaN loss (traced to
    aten::sqrt); every StepResult goes to `logger` too."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=g)
    y = (x[:, 0] > 0).long()
    model = Net()
    results = []
    with nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0, event_log=log,
                        log_top_norms=3) as guard:
        for step in range(1, steps + 1):
            r = guard.step(lambda: F.cross_entropy(model(x), y)
                           + (torch.sqrt(model.lin.bias - 100).sum() if step == bad_step else 0))
            results.append(r)
            if logger is not None:
                logger.log(r)
    return results


def read(logdir):
    """{tag: [(step, value)]} of the scalars and {tag: [(step, text)]} of the
    text summaries, as TensorBoard reads them."""
    acc = EventAccumulator(str(logdir), size_guidance={TENSORS: 0})
    acc.Reload()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}
    texts = {t: [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(t)] for t in acc.Tags()["tensors"]}
    return scalars, texts


def same(a, b):
    return (math.isnan(a) and math.isnan(b)) or a == b


def test_step_logger_writes_nanguards_tags(tmp_path):
    with StepLogger(tmp_path / "tb") as tb:
        results = guarded_run(tmp_path / "events.jsonl", logger=tb)
    scalars, texts = read(tmp_path / "tb")
    for tag in ("loss", "grad_norm", "lr", "loss_scale", "clip_coef", "skipped"):
        assert [s for s, _ in scalars[tag]] == [1, 2, 3, 4, 5, 6], tag
    assert [v for _, v in scalars["skipped"]] == [0, 0, 1, 0, 0, 0]
    assert math.isnan(scalars["loss"][2][1])
    for r, (step, v) in zip(results, scalars["loss"]):
        assert step == r.step and same(v, torch.tensor(r.loss, dtype=torch.float32).item())
    names = {n for n, _ in Net().named_parameters()}
    per_param = {t[len("grad_norm/"):] for t in scalars if t.startswith("grad_norm/")}
    assert per_param and per_param <= names
    first = results[0].top_norms[0]
    assert scalars["grad_norm/" + first[0]][0] == (1, pytest.approx(first[1], rel=1e-6))
    # Text on the bad step only: the finding (the op that made the NaN) and the remedy.
    assert list(texts) == ["nanguard/findings"]
    [(step, text)] = texts["nanguard/findings"]
    assert step == 3
    assert "**step 3: skip**" in text and "aten::sqrt" in text and "- remedy: skipped the step" in text


@needs_cli
def test_cpp_writer_gives_the_same_tags_and_values_for_a_python_run(tmp_path):
    """`nanguard report events.jsonl --tensorboard DIR` (C++) against StepLogger (Python)."""
    log = tmp_path / "events.jsonl"
    with StepLogger(tmp_path / "py") as tb:
        guarded_run(log, logger=tb)
    r = subprocess.run([CLI, "report", str(log), "--tensorboard", str(tmp_path / "cpp")], capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "wrote " in r.stdout and "events.out.tfevents." in r.stdout
    py_scalars, py_texts = read(tmp_path / "py")
    cpp_scalars, cpp_texts = read(tmp_path / "cpp")
    assert sorted(cpp_scalars) == sorted(py_scalars)
    for tag, values in py_scalars.items():
        assert [s for s, _ in cpp_scalars[tag]] == [s for s, _ in values], tag
        assert all(same(a, b) for (_, a), (_, b) in zip(cpp_scalars[tag], values)), tag
    assert cpp_texts == py_texts
    # The raw file: TensorFlow's name, the file_version record first.
    [name] = os.listdir(tmp_path / "cpp")
    assert name.startswith("events.out.tfevents.")
    events = list(event_file_loader.EventFileLoader(str(tmp_path / "cpp" / name)).Load())
    assert events[0].file_version == "brain.Event:2"
    assert events[1].step == 1 and events[1].wall_time > 1.7e9


def test_step_logger_takes_a_dict_a_json_line_or_a_summary_writer(tmp_path):
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(str(tmp_path / "tb"))
    event = {"step": 7, "loss": "inf", "grad_norm": 2.5, "scale": 8.0, "lr": 0.5, "skipped": True,
             "action": "backoff", "top_norms": [{"name": "w", "norm": 2.0}], "note": "non-finite loss"}
    logger = StepLogger(writer)
    logger.log(event)
    logger.log(json.dumps(dict(event, step=8, loss=1.0, skipped=False, action="step", note="")))
    logger.log({"step": 2, "action": "data", "data": {"source": "firewall_collate", "checked": 16, "dropped": 1}})
    logger.log({"action": "data", "data": {"source": "firewall_collate", "check": 5, "checked": 8, "dropped": 0}})
    logger.close()  # a writer it did not make: flushed, left open
    writer.add_scalar("mine", 1.0, 1)
    writer.close()
    scalars, texts = read(tmp_path / "tb")
    assert scalars["loss"] == [(7, math.inf), (8, 1.0)]
    assert scalars["loss_scale"] == [(7, 8.0), (8, 8.0)]
    assert scalars["grad_norm/w"] == [(7, 2.0), (8, 2.0)]
    assert scalars["data/checked"] == [(2, 16.0), (5, 8.0)] and scalars["data/dropped"] == [(2, 1.0), (5, 0.0)]
    assert "mine" in scalars
    [(step, text)] = texts["nanguard/findings"]
    assert step == 7 and "- note: non-finite loss" in text and "- loss = inf" in text
    assert logger.log_dir == str(tmp_path / "tb")


def test_step_logger_refuses_what_it_cannot_write(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(NotADirectoryError, match="'.*afile' is a file, not a directory"):
        StepLogger(afile)
    with pytest.raises(TypeError, match="writer must be a log directory or a torch.utils.tensorboard.SummaryWriter, got 42 \\(int\\)"):
        StepLogger(42)
    logger = StepLogger(tmp_path / "tb")
    with pytest.raises(TypeError, match="result must be a nanguard.StepResult"):
        logger.log(3.5)
    with pytest.raises(ValueError, match="action \"data\" without the \"data\" counts"):
        logger.log({"step": 1, "action": "data"})
    with pytest.raises(ValueError, match="nanguard::step_event_from_json: 'step' is missing"):
        logger.log({"loss": 1.0})
    logger.close()


def test_step_logger_takes_a_dict_with_nan_and_inf(tmp_path):
    logger = StepLogger(tmp_path / "tb")
    logger.log({"step": 1, "loss": float("nan"), "grad_norm": float("inf"), "action": "skip", "skipped": True})
    logger.close()
    scalars, _ = read(tmp_path / "tb")
    assert math.isnan(scalars["loss"][0][1]) and scalars["grad_norm"] == [(1, math.inf)]


def test_the_guard_logs_every_step_to_tensorboard_itself(tmp_path):
    """Guard(tensorboard=DIR) writes what a StepLogger fed each StepResult
    writes: the same tags, steps and values."""
    run_by_hand(tmp_path / "by_hand")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 4, generator=g)
    y = (x[:, 0] > 0).long()
    torch.manual_seed(0)  # the model of run_by_hand
    model = Net()
    with nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), max_norm=1.0, log_top_norms=3,
                        tensorboard=str(tmp_path / "by_guard")) as guard:
        for step in range(1, 7):
            guard.step(lambda: F.cross_entropy(model(x), y)
                       + (torch.sqrt(model.lin.bias - 100).sum() if step == 3 else 0))
    by_hand, by_guard = read(tmp_path / "by_hand"), read(tmp_path / "by_guard")
    assert by_guard[0].keys() == by_hand[0].keys() and "skipped" in by_guard[0]
    for tag, points in by_hand[0].items():
        assert [s for s, _ in by_guard[0][tag]] == [s for s, _ in points], tag
        assert all(same(a, b) for (_, a), (_, b) in zip(by_guard[0][tag], points)), tag
    # The texts agree but for the line each finding names (each run's own lambda).
    assert unsourced(by_guard[1]) == unsourced(by_hand[1])


def unsourced(texts):
    """Text points with the findings' source lines ("test_tensorboard.py:50 (<lambda>): ") taken out."""
    return {tag: [(s, re.sub(r"\S+\.py:\d+ \([^)]*\): ", "", t)) for s, t in points] for tag, points in texts.items()}


def run_by_hand(logdir):
    torch.manual_seed(0)
    with StepLogger(str(logdir)) as tb:
        guarded_run(None, logger=tb)
