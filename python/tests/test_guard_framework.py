"""nanguard.Guard driven by a framework (begin_step / check) and gradient
accumulation (step_accumulated)."""
import math

import pytest
import torch
import torch.nn.functional as F

import nanguard
from test_guard import Net, data


def test_check_lets_a_healthy_step_through_clipped():
    x, y = data()
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    oa = torch.optim.SGD(a.parameters(), lr=0.1)
    ob = torch.optim.SGD(b.parameters(), lr=0.1)
    g = nanguard.Guard(b, ob, max_norm=0.5)
    for _ in range(3):
        oa.zero_grad()
        F.cross_entropy(a(x), y).backward()
        torch.nn.utils.clip_grad_norm_(a.parameters(), 0.5)
        oa.step()
        # what a framework does, with the guard's two calls
        g.begin_step()
        ob.zero_grad()
        loss = F.cross_entropy(b(x), y)
        loss.backward()
        r = g.check(loss, replay=lambda: F.cross_entropy(b(x), y))
        assert not r.skipped and r.action == "step" and r.loss == pytest.approx(loss.item())
        ob.step()
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)
    assert g.steps == 3 and g.skipped == 0


def test_check_of_a_bad_step_names_the_op_and_empties_the_optimizers_step():
    x, y = data()
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    g = nanguard.Guard(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    forward = lambda: F.cross_entropy(model(x), y) + torch.sqrt(model.lin.bias * 0).sum()
    g.begin_step()
    loss = forward()
    loss.backward()
    r = g.check(loss.item(), replay=forward)
    assert r.skipped and r.reason == "non-finite gradient" and r.verdict == "reproduced"
    assert r.finding.node == "SqrtBackward0"
    assert all(p.grad is None for p in model.parameters())
    opt.step()  # the framework's step: nothing to do
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_check_without_begin_step_is_a_clear_error():
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="no step was begun; call begin_step"):
        g.check(1.0)


def test_accumulated_step_equals_one_step_on_the_whole_batch():
    x, y = data(32)
    a, b = Net(), Net()
    b.load_state_dict(a.state_dict())
    ga = nanguard.Guard(a, torch.optim.SGD(a.parameters(), lr=0.1), max_norm=0.5)
    gb = nanguard.Guard(b, torch.optim.SGD(b.parameters(), lr=0.1), max_norm=0.5)
    whole = ga.step(lambda: F.cross_entropy(a(x), y))
    parts = gb.step_accumulated(lambda xs, ys: F.cross_entropy(b(xs), ys),
                                [(x[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])
    assert parts.step == 1 and not parts.skipped
    assert parts.grad_norm == pytest.approx(whole.grad_norm, rel=1e-4)
    assert parts.loss == pytest.approx(whole.loss, rel=1e-4)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.allclose(pa, pb, atol=1e-5)


def test_a_bad_micro_batch_skips_the_whole_step_and_is_named():
    x, y = data(32)
    bad = x.clone()
    bad[20, 1] = float("inf")  # in the third micro-batch
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    r = g.step_accumulated(lambda xs, ys: F.cross_entropy(model(xs), ys),
                           [(bad[i:i + 8], y[i:i + 8]) for i in range(0, 32, 8)])
    assert r.skipped and r.reason == "non-finite loss" and not math.isfinite(r.loss)
    assert r.finding is not None and r.finding.module == "lin"
    for p, q in zip(model.parameters(), before):
        assert torch.equal(p, q)


def test_a_micro_batch_of_a_tensor_and_a_dict_is_two_arguments():
    """(x, {...}) is the closure's two arguments, as step() passes them; only
    a pair whose first item is a tuple or list is (args, kwargs): a tensor
    there is not split into its rows."""
    x, y = data(32)
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []

    def loss(xs, options):
        seen.append((xs.shape, options))
        return F.cross_entropy(model(xs), y[:8]) * options["weight"]

    r = g.step_accumulated(loss, [(x[i:i + 8], {"weight": 0.5}) for i in range(0, 32, 8)])
    assert r.action == "step" and seen == [((8, 4), {"weight": 0.5})] * 4
    r = g.step_accumulated(lambda xs, ys: F.cross_entropy(model(xs), ys), [((x[:8],), {"ys": y[:8]})])
    assert r.action == "step"  # an (args, kwargs) pair


def test_micro_batches_of_the_same_tensors_run_with_their_own_arguments():
    """Micro-batches that hold the same tensors (here x, with another
    weight each, and none at all) run with their own arguments, in the step
    and in its replay: the guard runs the caller's micro-batches by
    reference, and the bindings find each by its address."""
    x, y = data(8)
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    seen = []

    def loss(xs, weight):
        seen.append(weight)
        return F.cross_entropy(model(xs), y) * weight

    one = F.cross_entropy(model(x), y).item()
    r = g.step_accumulated(loss, [(x, 1.0), (x, 3.0)])
    assert r.action == "step" and seen == [1.0, 3.0] and r.loss == pytest.approx(2 * one, rel=1e-5)
    seen.clear()
    r = g.step_accumulated(lambda weight: loss(x, weight) * float("nan") if weight == 2.0 else loss(x, weight),
                           [(1.0,), (2.0,), (3.0,)])
    assert r.skipped and r.verdict == "reproduced"
    # The step up to its bad micro-batch, then its replay from the first one up to the same.
    assert seen == [1.0, 2.0, 1.0, 2.0]


def test_step_accumulated_of_nothing_is_a_clear_error():
    model = Net()
    g = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="micro_batches is empty"):
        g.step_accumulated(lambda: None, [])


def test_a_call_by_keywords_is_named_without_reading_the_signature(monkeypatch):
    """A Trainer calls model(**inputs) every step: the call's tensors are
    named by their keywords, and the function's signature (costly, for each
    micro-batch) is read only to name positional arguments."""
    from nanguard import _batches

    def forward(inputs, labels=None):
        return inputs

    x, y = data()
    read = []
    signature = _batches.inspect.signature
    monkeypatch.setattr(_batches.inspect, "signature", lambda fn: read.append(fn) or signature(fn))
    tensors, names = _batches.named_call_tensors(forward, (), {"inputs": x, "labels": y})
    assert names == ["inputs", "labels"] and tensors[0] is x and tensors[1] is y and read == []
    tensors, names = _batches.named_call_tensors(forward, (x,), {"labels": y})
    assert names == ["inputs", "labels"] and tensors[0] is x and read == [forward]
