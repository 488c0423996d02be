"""torch.compile (real Inductor on the CPU): a compiled model is traced and
guarded as its eager self, a NaN only the compiled code makes gets the
verdict "compiled only" with its kernel, and nothing nanguard does
recompiles or breaks the graph.

Compiling is slow on a small machine (seconds per graph): the tests share
one compiled model (module-scoped fixtures), whose input selects the fault.
"""
import copy
import json
import math
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch._dynamo.utils import counters
from torch._inductor.lowering import make_pointwise, register_lowering
from torch._inductor.virtualized import ops
from torch.utils._triton import has_triton

import nanguard
from conftest import cuda_only
from nanguard import _compile


@torch.library.custom_op("nanguard_test::clamped_log", mutates_args=())
def clamped_log(x: torch.Tensor) -> torch.Tensor:
    """log(max(x, 1e-30)): finite for x >= 0 in eager code."""
    return torch.log(x.clamp_min(1e-30))


@clamped_log.register_fake
def _(x):
    return torch.empty_like(x)


def _clamped_log_backward(ctx, grad):
    (x,) = ctx.saved_tensors
    return grad / x.clamp_min(1e-30)


clamped_log.register_autograd(_clamped_log_backward,
                              setup_context=lambda ctx, inputs, output: ctx.save_for_backward(inputs[0]))

# Inductor's lowering forgets the clamp: log(0) = -inf in the compiled code
# only (a NaN that only the compiler makes).
register_lowering(torch.ops.nanguard_test.clamped_log.default)(make_pointwise(lambda v: ops.log(v)))


class Norm(nn.Module):
    """0/0 = NaN when a row is constant."""

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class LogProb(nn.Module):
    """log(softmax(x)): log(0) = -inf when a logit gap underflows softmax."""

    def forward(self, x):
        return torch.log(torch.softmax(x, -1))


class Expo(nn.Module):
    """exp(x): overflows float32 above ~88."""

    def forward(self, x):
        return torch.exp(x)


class SafeLog(nn.Module):
    def forward(self, x):
        return clamped_log(x.abs())


class Net(nn.Module):
    """Four branches over four slices of the input, each with its fault."""

    def __init__(self):
        super().__init__()
        self.norm, self.log_prob, self.expo, self.safe_log = Norm(), LogProb(), Expo(), SafeLog()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        a, b, c, d = x.split(4, dim=1)
        return self.head(torch.cat([self.norm(a), self.log_prob(b), self.expo(c), self.safe_log(d)], 1))


BATCH = 8


def batch(fault=None):
    """A batch of 8 x 16 features (finite unless `fault` is "nan_batch")."""
    x = torch.randn(BATCH, 16, generator=torch.Generator().manual_seed(3)) * 0.5
    y = torch.arange(BATCH) % 3
    if fault == "zero_std":
        x[2, 0:4] = 1.0  # a constant row: std 0
    elif fault == "log_zero":
        x[2, 4:8] = torch.tensor([200.0, 0.0, 0.0, 0.0])  # softmax underflows to 0
    elif fault == "overflow":
        x[2, 8] = 100.0  # exp(100) = inf in float32
    elif fault == "nan_batch":
        x[2, 3] = float("nan")
    elif fault == "compiled_only":
        x[2, 12] = 0.0  # clamped in eager code, log(0) in the compiled one
    return x, y


@pytest.fixture(scope="module")
def models():
    """(eager, compiled): two models with the same weights; the compiled one
    compiled (forward and backward) before the tests."""
    torch.manual_seed(0)
    eager = Net()
    compiled = torch.compile(copy.deepcopy(eager))
    x, y = batch()
    F.cross_entropy(compiled(x), y).backward()
    compiled.zero_grad(set_to_none=True)
    return eager, compiled


def guard_step(model, fault, **options):
    """One step of a new guard over `model` on the batch with `fault` (lr 0:
    the weights stay those the tests share)."""
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.0), **options)
    return guard.step(lambda x, y: F.cross_entropy(model(x), y), *batch(fault))


def graphs_compiled():
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


@pytest.mark.parametrize("fault,op,module", [
    ("zero_std", "aten::div", "norm"),
    ("log_zero", "aten::log", "log_prob"),
    ("overflow", "aten::exp", "expo"),
    ("nan_batch", None, None)])
def test_a_guarded_compiled_model_names_each_fault_as_the_eager_model(models, fault, op, module):
    eager, compiled = models
    before = graphs_compiled()
    want, got = guard_step(eager, fault), guard_step(compiled, fault)
    assert got.skipped and got.verdict == "reproduced"
    assert (got.finding.op, got.finding.module, got.finding.role, got.finding.cause) == \
        (want.finding.op, want.finding.module, want.finding.role, want.finding.cause)
    assert op is None or (want.finding.op, want.finding.module) == (op, module)
    assert "_orig_mod" not in got.finding.to_json() and "_orig_mod" not in got.first_nonfinite_param
    if fault == "nan_batch":
        assert got.finding.cause == "bad_data" and got.finding.culprit.startswith("x")
    else:
        assert got.finding.role == "producer" and got.finding.cause != "bad_data"
    assert graphs_compiled() == before  # the eager replay compiled nothing


def test_a_healthy_compiled_loop_reports_nothing_and_never_recompiles(models):
    _, model = models
    weights = copy.deepcopy(model.state_dict())
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01), max_norm=1.0)
    before = graphs_compiled()
    x, y = batch()
    try:
        results = [guard.step(lambda: F.cross_entropy(model(x), y)) for _ in range(4)]
        bad = guard.step(lambda: F.cross_entropy(model(batch("zero_std")[0]), y))  # a replay, eagerly
        results += [guard.step(lambda: F.cross_entropy(model(x), y)) for _ in range(2)]
    finally:
        model.load_state_dict(weights)  # the weights the other tests share
    assert [r.action for r in results] == ["step"] * 6 and bad.skipped
    assert all(r.finding is None and r.verdict == "" for r in results)
    assert results[-1].loss < results[0].loss
    assert graphs_compiled() == before


def test_a_nan_only_the_compiled_code_makes_is_compiled_only_with_its_kernel(models):
    eager, compiled = models
    assert not guard_step(eager, "compiled_only").skipped
    with pytest.warns(nanguard.NanGuardWarning) as warned:
        r = guard_step(compiled, "compiled_only")
    # The step's line says the kernel and the remedy, as an abort's error does.
    warning = next(str(w.message) for w in warned if w.category is nanguard.NanGuardWarning)
    assert "only in the compiled code" in warning and "cpp_fused_" in warning, warning
    assert "remedy: " in warning and "torch.compiler.disable" in warning, warning
    assert r.skipped and r.verdict == "compiled only"
    assert r.finding is None  # the eager replay found nothing to blame: never the data
    assert "cpp_fused_" in r.note and "clamped_log" in r.note, r.note
    assert r.to_dict()["verdict"] == "compiled only"
    assert "remedy: " in r.note and "torch.compiler.disable" in r.note, r.note


def test_an_abort_on_a_nan_only_the_compiled_code_makes_names_its_kernel_and_remedy(models, tmp_path):
    _, compiled = models
    with pytest.raises(nanguard.NonFiniteError) as e:
        guard_step(compiled, "compiled_only", policy="abort", verbose=False, bundle_dir=tmp_path)
    assert e.value.result.verdict == "compiled only"
    message = str(e.value)
    assert "cpp_fused_" in message and "clamped_log" in message and "torch.compiler.disable" in message, message
    assert "nanguard.trace" not in message  # the eager trace cannot see it
    # The bundle keeps the note, and `nanguard inspect` says why it has no finding.
    bundle = e.value.result.bundle
    meta = json.loads((pathlib.Path(bundle) / "meta.json").read_text())
    assert meta["verdict"] == "compiled only" and meta["finding"] is None
    assert "cpp_fused_" in meta["note"] and "torch.compiler.disable" in meta["note"], meta
    shown = nanguard.inspect(bundle)
    assert "finding: none (only the compiled code made the NaN/Inf" in shown, shown
    assert "note: compiled only:" in shown and "torch.compiler.disable" in shown, shown
    assert "not replayed" not in shown, shown


def test_the_kernel_is_named_when_its_fresh_buffers_hold_old_nans(models, monkeypatch):
    # Inductor's fresh buffers are not cleared: the memory the eager replay
    # just freed may hand the kernel that makes the NaN an output buffer
    # that already holds one. Here every fresh float buffer starts as NaN.
    _, compiled = models
    def nan_filled(alloc):
        def allocate(*args):
            buf = alloc(*args)
            return buf.fill_(float("nan")) if buf.is_floating_point() else buf
        return allocate
    modules = [m for m in _compile._generated_modules() if hasattr(m, "empty_strided_cpu")]
    assert modules, "the compiled model's generated code"
    for module in modules:
        monkeypatch.setattr(module, "empty_strided_cpu", nan_filled(module.empty_strided_cpu))
    assert not guard_step(compiled, None).skipped  # the compiled code never reads what it did not write
    r = guard_step(compiled, "compiled_only")
    assert r.skipped and r.verdict == "compiled only" and r.finding is None
    assert "cpp_fused_" in r.note and "clamped_log" in r.note, r.note


@pytest.mark.skipif(not has_triton(), reason="no working Triton: Inductor generates no GPU kernels here")
@cuda_only
def test_a_nan_only_the_compiled_code_makes_on_cuda_is_named_with_its_triton_kernel():
    # On a GPU Inductor generates Triton kernels, launched by their run method.
    model = torch.compile(Net().cuda())
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.0))
    x, y = (t.cuda() for t in batch())
    assert not guard.step(lambda: F.cross_entropy(model(x), y)).skipped  # compiles
    x, y = (t.cuda() for t in batch("compiled_only"))
    r = guard.step(lambda: F.cross_entropy(model(x), y))
    assert r.skipped and r.verdict == "compiled only" and r.finding is None
    assert "triton_" in r.note and "clamped_log" in r.note, r.note


def test_trace_runs_a_compiled_model_eagerly(models):
    _, compiled = models
    before = graphs_compiled()
    x, y = batch("zero_std")
    with nanguard.trace(compiled) as t:
        F.cross_entropy(compiled(x), y).backward()
    compiled.zero_grad(set_to_none=True)
    f = t.findings[0]
    assert (f.op, f.module, f.role) == ("aten::div", "norm", "producer")
    assert math.isnan(compiled(x).sum().item())  # compiled again after the block
    assert graphs_compiled() == before


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x) / x.std(-1, keepdim=True)


def test_a_first_compile_inside_a_trace_neither_crashes_nor_floods(capfd):
    model = Tiny()
    model.compile()  # in place: names stay those of the model
    x = torch.randn(4, 4)
    x[1] = 2.0
    with nanguard.trace(model) as t:
        with torch.compiler.set_stance("default"):  # compiles here, under the tracer
            model(torch.randn(4, 4)).sum().backward()
        model(x).sum()  # eagerly
    assert [(f.op, f.module) for f in t.findings] == [("aten::div", "")]
    err = capfd.readouterr().err
    assert "RecordFunction" not in err and "data pointer" not in err
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.0), trace_every_step=True)
    r = guard.step(lambda: model(x).sum())
    assert r.skipped and r.finding.op == "aten::div"
    assert "RecordFunction" not in capfd.readouterr().err


@pytest.mark.parametrize("how", [dict(fullgraph=True), dict(dynamic=True), dict(mode="max-autotune")])
def test_compile_options_work_under_the_guard(how):
    model = torch.compile(Tiny(), **how)
    x = torch.randn(4, 4)
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01))
    assert guard.step(lambda: model(x).sum()).action == "step"
    x[1] = 2.0
    r = guard.step(lambda: model(x).sum())
    assert r.skipped and (r.finding.op, r.finding.module) == ("aten::div", "")
    assert r.first_nonfinite_param in ("", "fc.weight", "fc.bias")


def test_a_backend_that_does_not_exist_is_one_clear_error():
    with pytest.raises(Exception, match="does_not_exist") as e:
        torch.compile(Tiny(), backend="does_not_exist")
    assert len(str(e.value).strip().splitlines()) <= 3

    def failing_backend(gm, example_inputs):
        raise RuntimeError("this backend cannot compile")

    model = torch.compile(Tiny(), backend=failing_backend)
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.01))
    with pytest.raises(Exception, match="this backend cannot compile"):
        guard.step(lambda: model(torch.randn(4, 4)).sum())
    assert not nanguard._nanguard.observers_paused()


def test_lightning_guards_a_compiled_lightning_module():
    pl = pytest.importorskip("lightning.pytorch")
    from nanguard.integrations.lightning import NanGuard

    class Lit(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.norm, self.head = Norm(), nn.Linear(4, 3)

        def forward(self, x):
            return self.head(self.norm(x))

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    x, y = torch.randn(32, 4), torch.arange(32) % 3
    x[20] = 1.0  # step 3's batch holds a constant row
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    callback = NanGuard(policy="skip")
    trainer = pl.Trainer(max_epochs=1, callbacks=[callback], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False)
    breaks = graphs_compiled()[1]
    trainer.fit(torch.compile(Lit()), loader)
    assert [(r.step, r.verdict, r.finding.op, r.finding.module) for r in callback.bad_steps] == \
        [(2, "reproduced", "aten::div", "norm")]  # Lightning's global_step 2: its third step
    assert graphs_compiled()[1] == breaks
