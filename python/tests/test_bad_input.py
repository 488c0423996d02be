"""Bad input to the Python module: each gets a Python exception of the right
type (TypeError, ValueError, OSError) with one clear message, never a C++
backtrace or pybind11's "incompatible function arguments"."""
import inspect
import json
import subprocess
import sys
import typing
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard
import nanguard.data


def model_and_guard(**options):
    model = nn.Linear(4, 1)
    return model, nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), **options)


def batch():
    g = torch.Generator().manual_seed(3)
    return torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)


@pytest.mark.parametrize("returned", [1.5, None, (1.0,)], ids=["float", "None", "tuple"])
def test_a_closure_that_returns_no_tensor_is_a_type_error(returned):
    _, guard = model_and_guard()
    with pytest.raises(TypeError, match="the closure must return the loss tensor") as e:
        guard.step(lambda: returned)
    assert type(returned).__name__ in str(e.value)
    assert "incompatible function arguments" not in str(e.value)


def test_a_loss_without_gradient_is_a_value_error():
    model, guard = model_and_guard()
    x, y = batch()

    def no_grad_loss():
        with torch.no_grad():
            return F.mse_loss(model(x), y)

    with pytest.raises(ValueError, match="depends on the model's trainable parameters.*does not require grad"):
        guard.step(no_grad_loss)
    with pytest.raises(TypeError, match="a floating-point one.*returned torch.int64"):
        guard.step(lambda: model(x).argmax())
    # The guard is still usable with a right closure.
    assert guard.step(lambda: F.mse_loss(model(x), y)).action == "step"


@pytest.mark.parametrize("tensor, error", [(torch.ones(3, dtype=torch.int32), TypeError),
                                           (torch.empty(3, device="meta"), ValueError)])
def test_cxx_errors_carry_no_backtrace(tensor, error):
    with pytest.raises(error) as e:
        nanguard.census(tensor)
    text = str(e.value)
    assert "Exception raised from" not in text and "frame #" not in text, text


def test_an_unwritable_event_log_is_an_os_error(tmp_path):
    with pytest.raises(OSError):
        model_and_guard(event_log=str(tmp_path / "missing" / "train.jsonl"))


def test_a_full_disk_ends_the_event_log_on_a_whole_line(tmp_path):
    log = tmp_path / "train.jsonl"
    script = textwrap.dedent(f"""
        import resource, torch, torch.nn as nn, torch.nn.functional as F, nanguard
        model = nn.Linear(4, 1)
        guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), event_log={str(log)!r})
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))  # Python ignores SIGXFSZ: writes fail with EFBIG
        for _ in range(50):
            try:
                guard.step(lambda: F.mse_loss(model(x), y))
            except OSError as e:
                print(e)
                break
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "nanguard::event_log: writing to" in run.stdout, run.stderr
    assert "was already taken or skipped (do not run it again)" in run.stdout
    lines = log.read_text().splitlines(keepends=True)
    assert lines and all(line.endswith("\n") for line in lines)
    assert [json.loads(line)["step"] for line in lines] == list(range(1, len(lines) + 1))


@pytest.mark.parametrize("options, error, message", [
    ({"loss_scale": {"init_scael": 2.0}}, TypeError,
     r"loss_scale: unknown option 'init_scael'; did you mean 'init_scale'\? \(the options are enabled"),
    ({"schedule": {"base_lr": 0.1, "warmup": 5}}, TypeError,
     r"schedule: unknown option 'warmup'; did you mean 'warmup_steps'\? \(the options are base_lr"),
    ({"bundle_tags": ["task", "classify"]}, TypeError, "bundle_tags must be a dict of name -> value.*got a list"),
    ({"max_bad_steps": 10 ** 30}, ValueError, "max_bad_steps must fit in 64 bits, got 10{30}"),
    ({"max_nrom": 1.0}, TypeError, r"nanguard.Guard: unknown option 'max_nrom'; did you mean 'max_norm'\? "
                                   r"\(the options are policy, max_norm, "),
    ({"sceduler": {}}, TypeError, r"unknown option 'sceduler'; did you mean 'schedule'\?"),
    ({"max_norm": "big"}, TypeError, r"nanguard.Guard: max_norm must be a number, got 'big' \(str\)"),
    ({"snapshot_every": 2.7}, TypeError, r"nanguard.Guard: snapshot_every must be an int, got 2.7 \(float\)"),
    ({"replay": "no"}, TypeError, r"nanguard.Guard: replay must be True or False, got 'no' \(str\)"),
    ({"loss_scale": {"init_scale": "big"}}, TypeError, r"loss_scale\['init_scale'\] must be a number, got 'big'"),
], ids=["loss_scale_key", "schedule_key", "bundle_tags_list", "max_bad_steps_huge", "option_typo", "option_typo2",
        "option_type", "int_option_float", "bool_option_str", "loss_scale_value"])
def test_wrong_guard_options_name_the_option(options, error, message):
    with pytest.raises(error, match=message) as e:
        model_and_guard(**options)
    assert "incompatible" not in str(e.value) and "Unable to cast" not in str(e.value)


def test_guard_options_are_keyword_only():
    """As torch.optim's: Guard(model, optimizer, *, policy=...). Options
    passed by position are a TypeError that says to name them."""
    model = torch.nn.Linear(2, 1)
    with pytest.raises(TypeError, match=r"nanguard.Guard: the options are keyword-only: name them, e.g. "
                                        r"nanguard.Guard\(\.\.\., policy='rollback'"):
        nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), "rollback")
    g = nanguard.Guard(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), policy="rollback")
    assert g.policy == "rollback"
    params = inspect.signature(nanguard.Guard).parameters
    assert [p.name for p in params.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY] == ["model", "optimizer"]


def test_the_policy_and_action_types_are_the_cpp_names():
    """Policy and Action (typing.Literal, what an IDE and mypy check) list
    the C++ enums' names."""
    from nanguard._options import Policy
    from nanguard._results import Action
    assert typing.get_args(Policy) == nanguard.POLICIES
    assert typing.get_args(Action) == nanguard._nanguard.ACTIONS


def test_the_options_reach_cpp_typed():
    """GuardOptions, the one path from Guard's arguments to the C++
    guard_options: a misspelled field is an AttributeError, a wrong type a
    TypeError, and each field reads back what was set."""
    o = nanguard._nanguard.GuardOptions()
    with pytest.raises(AttributeError):
        o.max_nrom = 1.0
    with pytest.raises(TypeError):
        o.max_norm = "1.0"
    o.spike_window, o.policy, o.scaler = 7, "backoff", nanguard._nanguard.LossScaler(init_scale=8.0)
    o.bundle_tags = [("task", "classify")]
    assert (o.spike_window, o.policy, o.scaler.get_scale(), o.bundle_tags) == (7, "backoff", 8.0,
                                                                              [("task", "classify")])
    assert o.schedule is None and o.distributed is None


def test_trace_of_something_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="nanguard.trace: model must be an nn.Module .* got 'model' \\(str\\)"):
        nanguard.trace("model")


def test_a_model_on_the_meta_device_is_a_value_error():
    model = nn.Linear(4, 1, device="meta")
    with pytest.raises(ValueError, match="on the meta device and hold no values; materialize them first"):
        nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_an_optimizer_that_needs_a_closure_is_a_type_error():
    model = nn.Linear(4, 1)
    guard = nanguard.Guard(model, torch.optim.LBFGS(model.parameters()))
    x, y = batch()
    with pytest.raises(TypeError, match=r"Guard.step: LBFGS.step needs a closure .* use a first-order optimizer"):
        guard.step(lambda: F.mse_loss(model(x), y))


def test_check_without_a_backward_says_to_call_backward():
    # It was logged as a healthy step with grad norm 0 (#41).
    model, guard = model_and_guard()
    x, y = batch()
    guard.begin_step()
    loss = F.mse_loss(model(x), y)
    with pytest.raises(ValueError, match=r"no backward wrote a gradient since begin_step\(\); call loss.backward\(\) "
                                         r"before check\(loss\)"):
        guard.check(loss)
    assert guard.steps == 0  # refused, not counted: begin it again
    guard.begin_step()
    loss.backward()
    r = guard.check(loss)
    assert (r.step, r.action) == (1, "step") and r.grad_norm > 0
    guard.begin_step()
    guard.cancel_step()  # a step the framework skipped: not counted
    assert guard.steps == 1


def one_column_csv(tmp_path):
    (tmp_path / "a.csv").write_text("a;b\n1;2\n")
    return str(tmp_path / "a.csv")


#: Bad input whose error names a fix, and the fix's Python spelling.
FIXES = [
    (lambda tmp: nanguard.census(torch.arange(3)), TypeError, "convert with x.float() to measure them anyway"),
    (lambda tmp: nanguard.census(torch.zeros(3, dtype=torch.complex64)), TypeError, "parts, torch.view_as_real(x)"),
    (lambda tmp: nanguard.check_many([torch.arange(3)]), TypeError, "checked as torch.view_as_real(x)"),
    (lambda tmp: nanguard.Firewall().fit(torch.randn(10, 2)).apply(torch.tensor([[1.0, float("nan")]])), ValueError,
     'e.g. nanguard.Firewall(nonfinite="impute_median")'),
    (lambda tmp: nanguard.Firewall().fit(torch.arange(10).reshape(5, 2)), TypeError, "convert it with x.float()"),
    (lambda tmp: nanguard.IsolationForest().fit(torch.arange(10).reshape(5, 2)), TypeError,
     "convert it with x.double()"),
    (lambda tmp: model_and_guard(spike_window=2), ValueError, "window must be at least 3 but is 2; set spike_window=50"),
    (lambda tmp: nanguard.data.read_csv(one_column_csv(tmp)), ValueError,
     "read it with that delimiter (read_csv(path, delimiter=';'))"),
]


@pytest.mark.parametrize("call, error, fix", FIXES, ids=["census_int", "census_complex", "check_many_int",
                                                        "firewall_raise", "firewall_int", "isolation_forest_int",
                                                        "spike_window", "csv_delimiter"])
def test_an_error_names_the_python_spelling_of_its_fix(tmp_path, call, error, fix):
    """What the C++ core's messages tell a Python user to write is Python
    (x.float(), not x.to(at::kFloat); Firewall(...), not firewall_options())."""
    with pytest.raises(error) as e:
        call(tmp_path)
    message = str(e.value)
    assert fix in message, message
    for cpp in ("at::", "torch::", "_options()", "C++"):
        assert cpp not in message, message


def test_a_trace_on_its_own_gives_python_remedies():
    """A tracer that knows no front end (nanguard.trace) writes its
    remedies for Python, the process's language, not C++ and Python both."""
    class Overflow(nn.Module):
        def forward(self, x):
            return torch.exp(x * 1000) - torch.exp(x * 1000)

    model = Overflow()
    with nanguard.trace(model) as t:
        model(torch.ones(3))
    remedy = t.findings[0].remedy
    assert "`torch.exp(x.clamp(max=80))`" in remedy and "`nanguard.Guard(model, opt, max_norm=1.0)`" in remedy, remedy
    assert "C++" not in remedy and "torch::" not in remedy and "_options()" not in remedy, remedy


def test_an_lr_scheduler_of_another_optimizer_is_refused():
    """A rollback lowers the guard's schedulers: another run's would have its
    LR cut by this guard's rollbacks (#60)."""
    model, other = nn.Linear(2, 1), nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    foreign = torch.optim.lr_scheduler.StepLR(torch.optim.SGD(other.parameters(), lr=0.1), 10)
    with pytest.raises(ValueError, match="lr_scheduler StepLR schedules another optimizer .* not this guard's"):
        nanguard.Guard(model, opt, lr_scheduler=foreign)
    own = torch.optim.lr_scheduler.StepLR(opt, 10)
    nanguard.Guard(model, opt, lr_scheduler=[own], verbose=False).close()
