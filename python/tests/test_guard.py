"""nanguard.Guard: healthy steps, skip, rollback recovery, abort, event log."""
import copy
import json
import math
import os
import signal
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard
from conftest import cuda_only


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.norm(torch.relu(self.lin(x))))


def nan_of(model):
    """A NaN/Inf the model makes (a log of 0 in its forward), to add to a
    loss: a rollback for it cuts the LR, where one for a NaN that comes in
    with the data (``loss * nan`` too) keeps the LR (docs/guard.md)."""
    return torch.log(model.lin.bias.sum() * 0)


def data(n=64):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()


def test_healthy_steps_match_plain_training_with_clipping():
    x, y = data()
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    g = nanguard.Guard(b, ob, max_norm=0.5)
    for _ in range(5):
        oa.zero_grad()
        F.cross_entropy(a(x), y).backward()
        ref = torch.nn.utils.clip_grad_norm_(a.parameters(), 0.5)
        oa.step()
        r = g.step(lambda: F.cross_entropy(b(x), y))
        assert r.action == "step" and not r.skipped
        assert r.grad_norm == pytest.approx(ref.item(), rel=1e-4)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)


def test_skip_localizes_by_replay_and_leaves_parameters_alone(tmp_path):
    x, y = data()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "events.jsonl"
    g = nanguard.Guard(model, opt, policy="skip", event_log=str(log))
    before = [p.detach().clone() for p in model.parameters()]
    r = g.step(lambda: F.cross_entropy(model(x), y) + torch.sqrt(model.lin.bias - 100).sum())
    assert r.skipped and r.action == "skip" and r.reason == "non-finite loss"
    assert r.verdict == "reproduced"
    assert r.finding.op == "aten::sqrt" and r.finding.role == "producer"
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)
    g.close()
    line = json.loads(log.read_text().splitlines()[0])
    assert line["step"] == 1 and r.step == 1
    assert line["action"] == "skip" and line["findings"][0]["op"] == "aten::sqrt"
    assert line["loss"] == "nan" and line["verdict"] == "reproduced"


def test_nonfinite_gradient_names_the_backward_op():
    x, y = data()
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    # sqrt(0) has an infinite derivative: the forward is finite, backward is not.
    r = g.step(lambda: F.cross_entropy(model(x), y) + torch.sqrt(model.lin.bias * 0).sum())
    assert r.reason == "non-finite gradient"
    assert r.first_nonfinite_param == "lin.bias"
    assert r.finding.direction == "backward" and r.finding.node == "SqrtBackward0"


def test_run_recovered_by_rollback():
    """Corrupted batches in the middle of a run make the loss NaN: the guard
    names the op, rolls back to the last good snapshot (bad data: the LR is
    kept), and the run goes on to a lower loss with finite parameters."""
    x, y = data()
    bad = x.clone()
    bad[3, 2] = float("inf")  # inf - inf = NaN inside the first Linear
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    g = nanguard.Guard(model, opt, policy="rollback", snapshot_every=5, rollback_lr_factor=0.5)
    first = F.cross_entropy(model(x), y).item()
    results = [g.step(lambda: F.cross_entropy(model(x), y)) for _ in range(7)]
    results += [g.step(lambda: F.cross_entropy(model(bad), y)) for _ in range(2)]
    results += [g.step(lambda: F.cross_entropy(model(x), y)) for _ in range(30)]
    rolled = [r for r in results if r.action == "rollback"]
    assert len(rolled) == 2 and g.rollbacks == 2
    assert rolled[0].reason == "non-finite loss" and rolled[0].verdict == "reproduced"
    assert rolled[0].finding.module == "lin" and rolled[0].finding.role == "input"
    assert all(math.isfinite(p.detach().sum().item()) for p in model.parameters())
    final = F.cross_entropy(model(x), y).item()
    assert math.isfinite(final) and final < first
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5)  # the data was bad, not the LR


def test_rollback_restores_the_snapshot_exactly():
    x, y = data()
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = nanguard.Guard(model, opt, policy="rollback", snapshot_every=2, rollback_lr_factor=0.5)
    for _ in range(2):
        g.step(lambda: F.cross_entropy(model(x), y))
    snap = {k: v.clone() for k, v in model.state_dict().items()}
    g.step(lambda: F.cross_entropy(model(x), y))
    r = g.step(lambda: F.cross_entropy(model(x), y) + nan_of(model))
    assert r.action == "rollback"
    for k, v in model.state_dict().items():
        assert torch.equal(v, snap[k])
    assert opt.param_groups[0]["lr"] == pytest.approx(5e-3)


def _schedulers_of(kind, opt):
    """A torch LR scheduler of each kind whose next step would set the LR
    from its own values, undoing a rollback's lower LR."""
    if kind == "lambda":  # a linear warmup, as transformers' schedules are
        return torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 10))
    if kind == "one_cycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.2, total_steps=100)
    if kind == "cyclic":
        return torch.optim.lr_scheduler.CyclicLR(opt, base_lr=0.01, max_lr=0.2, step_size_up=5)
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=5)
    return torch.optim.lr_scheduler.SequentialLR(
        opt, [warmup, torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.99 ** i)], milestones=[5])


@pytest.mark.parametrize("kind", ["lambda", "one_cycle", "cyclic", "sequential"])
def test_a_rollback_lowers_the_lr_a_torch_scheduler_sets_next(kind):
    """The scheduler's next step keeps the rollback's factor: the LR is half
    what the same scheduler gives a run without the rollback."""
    x, y = data()
    runs = []
    for guarded in (False, True):
        torch.manual_seed(0)
        model = Net()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        sched = _schedulers_of(kind, opt)
        g = nanguard.Guard(model, opt, policy="rollback", snapshot_every=2, rollback_lr_factor=0.5,
                           lr_scheduler=sched if guarded else None, verbose=False)
        lrs = []
        for i in range(12):
            g.step(lambda: F.cross_entropy(model(x), y) + (nan_of(model) if i == 6 else 0.0))
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
        assert g.rollbacks == 1
        runs.append(lrs)
    unguarded, guarded = runs
    assert guarded[:6] == pytest.approx(unguarded[:6])
    assert guarded[6:] == pytest.approx([lr * 0.5 for lr in unguarded[6:]])


@pytest.mark.parametrize("args", ["no model", "optimizers in a list", "no optimizer"])
def test_a_model_or_optimizer_of_the_wrong_type_is_named(args):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model_arg, opt_arg, named = {"no model": (None, opt, "model must be"),
                                 "optimizers in a list": (model, [opt], "optimizer must be"),
                                 "no optimizer": (model, None, "optimizer must be")}[args]
    with pytest.raises(TypeError, match=named):
        nanguard.Guard(model_arg, opt_arg)


def test_a_negative_log_top_norms_is_refused():
    model = Net()
    with pytest.raises(ValueError, match="log_top_norms must be >= 0"):
        nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), log_top_norms=-1)


def test_lr_scheduler_takes_schedulers_only():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="lr_scheduler must be a torch.optim.lr_scheduler"):
        nanguard.Guard(model, opt, lr_scheduler=0.1)


def test_a_snapshot_restored_twice_keeps_its_optimizer_state():
    """The steps after a rollback update the optimizer's state in place: they
    must not change the snapshot it came from, which a later rollback
    restores again."""
    x, y = data()
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = nanguard.Guard(model, opt, policy="rollback", snapshot_every=3, verbose=False)
    before, rolled = {}, []
    for i, bad in enumerate("0000010000100101", 1):
        before[i] = copy.deepcopy(opt.state_dict()["state"])
        r = g.step(lambda: F.cross_entropy(model(x), y) * (float("nan") if bad == "1" else 1.0))
        if r.action == "rollback":
            rolled.append(r.rollback_to)
            want = before[r.rollback_to + 1]
            for k, state in opt.state_dict()["state"].items():
                assert all(torch.equal(v, want[k][n]) for n, v in state.items()), (r.step, r.rollback_to)
    assert rolled == [3, 10, 13, 10]  # the last restores the snapshot of step 10 a second time


def test_abort_raises_with_the_finding(tmp_path):
    x, y = data()
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="abort",
                       bundle_dir=str(tmp_path / "b"))
    with pytest.raises(nanguard.NonFiniteError, match="aten::log") as e:
        g.step(lambda: torch.log(model(x) * 0).sum())
    assert e.value.finding.op == "aten::log"
    assert (tmp_path / "b" / "step-000001" / "meta.json").exists()
    assert e.value.result.action == "abort" and e.value.result.step == 1
    assert e.value.result.bundle == str(tmp_path / "b" / "step-000001")


def test_trace_every_step_names_the_op_without_a_replay():
    x, y = data()
    model = Net()
    # verify_remedies off: its checks run the step again with the remedy (test_remedy_checks.py).
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), trace_every_step=True,
                       verify_remedies=False)
    runs = []

    def loss():
        runs.append(1)
        return torch.log(model(x) * 0).sum()

    r = g.step(loss)
    assert r.skipped and len(runs) == 1, "the step's own trace named the op: no replay"
    assert r.finding.op == "aten::log" and r.verdict == ""
    assert g.step(lambda: F.cross_entropy(model(x), y)).action == "step"


def test_loss_scaler_backs_off():
    x, y = data()
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="backoff",
                       loss_scale={"init_scale": 2.0 ** 24}, replay=False)
    r = g.step(lambda: F.cross_entropy(model(x), y) * 1e32)  # x 2^24 overflows float32
    # r.scale is the scale the step used (as the C++ guard's events); the scaler then backed off.
    assert r.skipped and r.action == "backoff" and r.scale == 2.0 ** 24
    assert g.scaler.get_scale() == 2.0 ** 23
    while r.skipped:
        r = g.step(lambda: F.cross_entropy(model(x), y) * 1e32)
    assert r.action == "step" and r.scale < 2.0 ** 21


def test_the_enum_names_come_from_cpp():
    """POLICIES, the actions and the verdicts are the C++ enums' names; an
    unknown policy is refused by C++'s policy_from_string, listing them."""
    assert nanguard.POLICIES == ("auto", "skip", "backoff", "rollback", "abort")
    assert nanguard._nanguard.ACTIONS == ("step", "skip", "backoff", "rollback", "abort", "data")
    assert nanguard._nanguard.VERDICTS == ("", "reproduced", "not reproduced", "replay failed", "compiled only")
    with pytest.raises(ValueError, match="policy must be one of 'auto', 'skip', 'backoff', 'rollback', 'abort' but is 'ignore'"):
        nanguard._nanguard.policy_from_string("ignore")


def test_a_bundle_keeps_every_tensor_of_the_call_in_order():
    """One walker picks a batch's tensors (the Guard's and the callbacks'):
    tensors in tuples, lists and dicts, nested, in order."""
    from nanguard._batches import batch_tensors
    a, b, c, d = (torch.full((1,), float(i)) for i in range(4))
    assert [t.item() for t in batch_tensors(((a, [b, 7]), {"x": {"y": c}, "n": None, "z": d}))] == [0, 1, 2, 3]


def test_bad_options_are_clear_errors():
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="policy must be one of"):
        nanguard.Guard(model, opt, policy="ignore")
    with pytest.raises(ValueError, match="rollback_lr_factor"):
        nanguard.Guard(model, opt, rollback_lr_factor=2)
    for bad in ({"max_norm": float("nan")}, {"clip_value": float("nan")}, {"max_norm": float("inf")},
                {"clip_value": -1}):
        with pytest.raises(ValueError, match="must be finite and >= 0"):
            nanguard.Guard(model, opt, **bad)
    other = torch.optim.SGD(Net().parameters(), lr=0.1)
    with pytest.raises(ValueError, match="the optimizer holds none of the model's trainable parameters"):
        nanguard.Guard(model, other)


@pytest.mark.parametrize("option, value, message", [
    ("loss_scale", 65536.0, r"loss_scale must be True, False or a dict of LossScaler options, e\.g\..*got 65536\.0 \(float\)"),
    ("loss_scale", "yes", r"loss_scale must be True, False or a dict .*got 'yes' \(str\)"),
    ("schedule", 0.1, r"schedule must be a nanguard\.WarmupCosine or a dict of its arguments, e\.g\..*got 0\.1 \(float\)"),
    ("schedule", "lambda_lr", r"schedule must be .*got a LambdaLR; a torch\.optim\.lr_scheduler goes to "
                              r"lr_scheduler= instead, e\.g\. nanguard\.Guard\(model, opt, lr_scheduler=sched\): it "
                              r"stays in the loop, which calls its step\(\) after guard\.step"),
    ("schedule", "plateau", r"got a ReduceLROnPlateau; a torch\.optim\.lr_scheduler goes to lr_scheduler= instead"),
    ("schedule", {"warmup_steps": 3}, r"schedule needs base_lr, e\.g\. schedule=\{'base_lr'"),
])
def test_a_loss_scale_or_schedule_of_the_wrong_type_names_the_option(option, value, message):
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    if value == "lambda_lr":
        value = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    if value == "plateau":
        value = torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
    with pytest.raises(TypeError, match=message):
        nanguard.Guard(model, opt, **{option: value})


@pytest.mark.parametrize("option", ["event_log", "bundle_dir"])
@pytest.mark.parametrize("value", [True, 1, 2])
def test_a_path_option_that_is_no_path_is_a_type_error(option, value, capfd):
    """open() takes an int (True too) as a file descriptor: event_log=True
    must not open and close the process's stdout."""
    model = Net()
    with pytest.raises(TypeError, match=f"{option} must be a path .*e.g. {option}='.*got .* \\((bool|int)\\)"):
        nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), **{option: value})
    os.fstat(1), os.fstat(2)  # still open
    print("stdout still works")
    assert capfd.readouterr().out == "stdout still works\n"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda_only)])
def test_steps_skips_and_names_the_same_on_each_device(device):
    x, y = (t.to(device) for t in data())
    model = Net().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = nanguard.Guard(model, opt, max_norm=1.0)
    r = g.step(lambda: F.cross_entropy(model(x), y))
    assert r.action == "step" and math.isfinite(r.grad_norm) and r.grad_norm > 0
    # Forward-born: sqrt of a negative bias.
    r = g.step(lambda: F.cross_entropy(model(x), y) + torch.sqrt(model.lin.bias - 100).sum())
    assert r.skipped and r.reason == "non-finite loss" and r.verdict == "reproduced"
    assert (r.finding.op, r.finding.direction, r.finding.role) == ("aten::sqrt", "forward", "producer")
    # Backward-born (on CUDA, autograd runs it on its device thread): d sqrt(0) = inf.
    r = g.step(lambda: F.cross_entropy(model(x), y) + torch.sqrt(model.lin.bias * 0).sum())
    assert r.skipped and r.reason == "non-finite gradient" and r.first_nonfinite_param == "lin.bias"
    assert (r.finding.direction, r.finding.node, r.finding.role) == ("backward", "SqrtBackward0", "producer")


def test_schedule_sets_the_lr_every_step_and_rollback_lowers_it():
    x, y = data()
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=123.0)  # overwritten by the schedule from step 1
    schedule = nanguard.WarmupCosine(0.1, warmup_steps=4, total_steps=20, min_lr=0.01)
    g = nanguard.Guard(model, opt, policy="rollback", snapshot_every=2, schedule=schedule)
    lrs = [g.step(lambda: F.cross_entropy(model(x), y)).lr for _ in range(6)]
    assert lrs == pytest.approx([schedule.lr(s) for s in range(6)])
    assert lrs[:4] == pytest.approx([0.025, 0.05, 0.075, 0.1])  # linear warmup
    r = g.step(lambda: F.cross_entropy(model(x), y) + nan_of(model))
    assert r.action == "rollback"
    assert opt.param_groups[0]["lr"] == pytest.approx(schedule.lr(6) * 0.5)
    r = g.step(lambda: F.cross_entropy(model(x), y))
    assert r.lr == pytest.approx(schedule.lr(7) * 0.5)  # the schedule goes on, times the rollback factor


def test_a_schedule_of_bad_options_is_a_clear_error():
    with pytest.raises(Exception, match="warmup_steps < total_steps"):
        nanguard.WarmupCosine(0.1, warmup_steps=10, total_steps=5)
    model = Net()
    with pytest.raises(Exception, match="base_lr must be finite and positive"):
        nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), schedule={"base_lr": -1.0})


def nan_first_step(model, x, y, then):
    """A closure whose first call makes a NaN loss and whose later calls (the
    replay) run ``then()``."""
    calls = []

    def closure():
        calls.append(1)
        if len(calls) > 1:
            then()
        return F.cross_entropy(model(x), y) * float("nan")

    return closure, calls


def send_sigint():
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # the handler raises KeyboardInterrupt here


def raise_(error):
    def run():
        raise error

    return run


@pytest.mark.parametrize("interrupt, expected", [(send_sigint, KeyboardInterrupt),
                                                 (raise_(KeyboardInterrupt()), KeyboardInterrupt),
                                                 (raise_(SystemExit(3)), SystemExit)],
                         ids=["SIGINT", "KeyboardInterrupt", "SystemExit"])
def test_an_interrupt_during_a_replay_reaches_the_caller(interrupt, expected):
    model = Net()
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()
    closure, calls = nan_first_step(model, x, y, interrupt)
    with pytest.raises(expected):
        guard.step(closure)
    assert len(calls) == 2  # the replay ran, and its interrupt was not noted as "replay failed"


def test_an_interrupt_in_check_s_replay_reaches_the_caller():
    model = Net()
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()
    guard.begin_step()
    loss = F.cross_entropy(model(x), y) * float("nan")
    loss.backward()
    with pytest.raises(KeyboardInterrupt):
        guard.check(loss, replay=raise_(KeyboardInterrupt()))


@pytest.mark.parametrize("retain_graph", [False, True])
def test_a_closure_that_runs_backward_itself_is_refused(retain_graph):
    model = Net()
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()
    before = [p.detach().clone() for p in model.parameters()]

    def closure():
        loss = F.cross_entropy(model(x), y)
        loss.backward(retain_graph=retain_graph)
        return loss

    with pytest.raises(ValueError, match=r"the step function ran backward\(\) itself.*the guard runs backward"):
        guard.step(closure)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # no step at twice the gradient


def test_a_step_whose_closure_raises_is_not_counted(tmp_path):
    """The closure's error propagates and no step was taken: the next step
    takes its number (the count, the summary and the event log agree) and
    its trace is gone."""
    x, y = data()
    model = Net()
    log = tmp_path / "events.jsonl"
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), event_log=str(log),
                           trace_every_step=True)

    def failing():
        model(x)
        raise KeyError("no such column")

    guard.step(lambda: F.cross_entropy(model(x), y))
    with pytest.raises(KeyError, match="no such column"):
        guard.step(failing)
    assert guard.steps == 1
    with nanguard.trace() as t:  # the raised step's live trace no longer holds this thread
        torch.log(torch.zeros(1))
    assert t.found
    guard.step(lambda: F.cross_entropy(model(x), y))
    assert guard.steps == 2 and guard.summary()["steps"] == 2
    guard.close()
    steps = [json.loads(line)["step"] for line in log.read_text().splitlines() if '"step"' in line]
    assert sorted(set(steps)) == [1, 2]


def test_a_step_from_inside_the_guard_s_step_is_refused():
    model = Net()
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = data()

    def closure():
        guard.step(lambda: F.cross_entropy(model(x), y))
        return F.cross_entropy(model(x), y)

    with pytest.raises(ValueError, match="step: called from inside the step the guard is running"):
        guard.step(closure)
    assert guard.steps == 0  # the step whose closure raised is not counted
    guard.step(lambda: F.cross_entropy(model(x), y))  # the guard goes on
    assert guard.steps == 1


def test_a_diverging_run_is_forecast_and_warned_before_its_first_nonfinite_step():
    """An LR far too high: the loss grows ~x3 a step. The guard's forecast
    (StepResult.forecast) and its warning come 3 steps or more before the
    first non-finite step (policy skip: nothing acts on it)."""
    torch.manual_seed(3)
    model = nn.Linear(8, 1)
    x = torch.randn(64, 8)
    y = x @ torch.randn(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.5)
    g = nanguard.Guard(model, opt, policy="skip")
    results = []
    with pytest.warns(nanguard.NanGuardWarning, match=r"leaves the range 3\.40282e\+38 in about \d+ steps"):
        while len(results) < 300 and not (results and results[-1].skipped):
            results.append(g.step(lambda: F.mse_loss(model(x), y)))
    forecast = next(r.step for r in results if r.forecast)
    nonfinite = next(r.step for r in results if r.skipped)
    assert nonfinite - forecast >= 3
    assert results[forecast - 1].forecast.startswith("the loss (")
    assert results[forecast - 1].to_dict()["forecast"]["steps_left"] >= 3


def test_a_run_diverging_from_its_first_step_is_rescued_at_defaults():
    """SGD at 100x a stable LR from the first step, under the defaults: the
    guard rolls back to the initial weights with an escalating LR cut, the
    torch LR scheduler follows every cut, and the run ends recovered."""
    torch.manual_seed(6)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
    x = torch.randn(256, 8) * 30
    y = x @ torch.randn(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=3.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1000, gamma=0.5)
    g = nanguard.Guard(model, opt, lr_scheduler=sched, verbose=False)
    first = F.mse_loss(model(x), y).item()
    for i in range(300):
        g.step(lambda: F.mse_loss(model(x[32 * (i % 8):32 * (i % 8 + 1)]), y[32 * (i % 8):32 * (i % 8 + 1)]))
        sched.step()
    final = F.mse_loss(model(x), y).item()
    assert math.isfinite(final) and final < 0.5 * first
    assert g.rollbacks >= 1
    assert opt.param_groups[0]["lr"] == pytest.approx(3.0 * g.lr_factor)
    assert g.summary()["status"] == "recovered"
