"""Bad input to the Python module: each gets a Python exception of the right
type (TypeError, ValueError, OSError) with one clear message, never a C++
backtrace or pybind11's "incompatible function arguments"."""
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard


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
    with pytest.raises(ValueError, match="floating-point tensor.*torch.int64"):
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
    ({"loss_scale": {"init_scael": 2.0}}, TypeError, "loss_scale has no option 'init_scael'; its options are enabled"),
    ({"schedule": {"base_lr": 0.1, "warmup": 5}}, TypeError, "schedule has no option 'warmup'; its options are base_lr"),
    ({"bundle_tags": ["task", "classify"]}, TypeError, "bundle_tags must be a dict of name -> value.*got list"),
    ({"max_bad_steps": 10 ** 30}, ValueError, "max_bad_steps must fit in 64 bits, got 10{30}"),
], ids=["loss_scale_key", "schedule_key", "bundle_tags_list", "max_bad_steps_huge"])
def test_wrong_guard_options_name_the_option(options, error, message):
    with pytest.raises(error, match=message) as e:
        model_and_guard(**options)
    assert "incompatible" not in str(e.value) and "Unable to cast" not in str(e.value)


def test_trace_of_something_not_a_module_is_a_type_error():
    with pytest.raises(TypeError, match="nanguard.trace: model must be an nn.Module .* got str"):
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
