"""Guard.inject and NANGUARD_INJECT: a planted fault through the real
guard (eager, and Lightning's Trainer without a change to its program): a
transient one is not reproduced by the replay, a persistent one is and is
named at its op; a bad spec is refused at set-up, naming what is wrong (#59)."""
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard


def run(steps=4, inject=None, policy="skip"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy=policy, verbose=False,
                           verify_remedies=False)
    if inject:
        guard.inject(**inject)
    results = [guard.step(lambda x, y: F.mse_loss(model(x), y), x, y) for _ in range(steps)]
    guard.close()
    return results


def test_a_transient_nan_is_not_reproduced_and_its_step_is_redone():
    clean = run()
    results = run(inject=dict(op="aten::addmm", step=3))
    assert [r.skipped for r in results] == [False] * 4
    hit = results[2]
    assert (hit.verdict, hit.fault, hit.finding) == ("not reproduced", "transient", None)
    assert "injected: nan written into [0, 0] of the output of aten::addmm (forward, call 0) at step 3" in hit.note
    assert [r.signature for r in results] == [r.signature for r in clean]  # taken as a clean run computes it


def test_the_user_is_told_of_a_transient_fault(caplog):
    with pytest.warns(nanguard.NanGuardWarning, match=r"step 2: transient fault: injected: nan .* redone"):
        model = nn.Linear(4, 1)
        guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="skip")
        guard.inject("aten::addmm", step=2)
        x = torch.randn(8, 4)
        for _ in range(3):
            guard.step(lambda: model(x).pow(2).mean())
        summary = guard.summary()
        guard.close()
    assert summary["transient_faults"] == 1 and summary["not_taken"] == 0
    assert "1 transient fault (the step ran again and was taken)" in summary["text"]


def test_a_persistent_inf_is_reproduced_and_named_at_its_op_and_module():
    results = run(inject=dict(op="aten::addmm", step=2, kind="inf", occurrence=1, element=3, mode="persistent"))
    assert [r.skipped for r in results] == [False, True, True, True]
    f = results[1].finding
    assert (results[1].verdict, results[1].fault) == ("reproduced", "model")
    assert (f.op, f.module, f.role, f.index, f.value) == ("aten::addmm", "2", "producer", 3, float("inf"))


def test_an_inf_in_the_backward_leaves_the_loss_finite():
    # call 1: the last layer's weight gradient (call 0, its input's, meets a ReLU that may zero it)
    results = run(inject=dict(op="aten::mm", step=1, direction="backward", kind="inf", mode="persistent",
                              occurrence=1), steps=1)
    r = results[0]
    assert r.skipped and r.finding is not None and r.finding.direction == "backward"
    assert torch.isfinite(torch.tensor(r.loss))


def test_nanguard_inject_plants_a_fault_when_the_guard_is_made(monkeypatch):
    monkeypatch.setenv("NANGUARD_INJECT", "op=aten::addmm,step=2,kind=nan")  # (a -inf the ReLU would zero)
    results = run(steps=3)
    assert [r.fault for r in results] == ["", "transient", ""]
    monkeypatch.setenv("NANGUARD_INJECT", "op=aten::addmm,step=two")
    with pytest.raises(ValueError, match=r"NANGUARD_INJECT='op=aten::addmm,step=two': .*step must be an integer"):
        run(steps=1)


def test_a_bad_spec_is_refused_at_set_up():
    model = nn.Linear(4, 1)
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    with pytest.raises(ValueError, match="'aten::addmn' is not an operator PyTorch knows"):
        guard.inject("aten::addmn", step=1)
    with pytest.raises(ValueError, match=r"rank 1 is not in the guard's group of 1 process \(rank 0\)"):
        guard.inject("aten::addmm", step=1, rank=1)
    with pytest.raises(ValueError, match="kind must be one of 'nan', 'inf', '-inf', 'bit_flip', 'scale', got 'zero'"):
        guard.inject("aten::addmm", step=1, kind="zero")
    with pytest.raises(TypeError, match="step must be an int >= 0, got 2.5"):
        guard.inject("aten::addmm", step=2.5)
    x = torch.randn(4, 4)
    for _ in range(2):
        guard.step(lambda: model(x).sum())
    with pytest.raises(ValueError, match="step 1 has passed .the last step was 2.; name a step from 3 on"):
        guard.inject("aten::addmm", step=1)
    guard.close()


def test_lightning_runs_a_planted_fault_without_a_change_to_its_program(monkeypatch):
    pl = pytest.importorskip("lightning.pytorch")
    from nanguard.integrations.lightning import NanGuard

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Regressor(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    monkeypatch.setenv("NANGUARD_INJECT", "op=aten::addmm,step=3,kind=nan,mode=persistent")
    cb = NanGuard(policy="skip", verbose=False)
    trainer = pl.Trainer(max_steps=5, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Regressor(), torch.utils.data.DataLoader(data, batch_size=16))
    # Lightning's global_step 3 on: every step is bad, reproduced, named at the planted op.
    assert [r.step for r in cb.bad_steps] == [3, 4]
    assert all(r.verdict == "reproduced" and r.finding.op == "aten::addmm" for r in cb.bad_steps)


def _planted_on_rank_1(rank, planted):
    """Two steps of a guard over 2 Gloo ranks (the guard averages the
    gradients), `planted` on rank 1 at step 2: the event of step 2 as each rank sees it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="skip", distributed=True,
                           verbose=False, bundle_dir=None)
    if planted != "data":
        guard.inject("aten::addmm", step=2, rank=1, mode=planted)
    loss = lambda x, y: F.mse_loss(model(x), y)
    g = torch.Generator().manual_seed(rank)
    guard.step(loss, torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g))
    x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
    if planted == "data" and rank == 1:
        x[2, 1] = float("nan")
    try:
        r = guard.step(loss, x, y)
    except nanguard.NonFiniteError as stop:
        r = stop.result
    guard.close()
    return r.action, r.fault, r.note


@pytest.mark.parametrize("planted,action,fault", [("transient", "skip", "transient"),
                                                  ("persistent", "abort", "persistent"),
                                                  ("data", "skip", "data")])
def test_the_other_rank_tells_a_faulty_device_from_a_bug(tmp_path, planted, action, fault):
    """The origin rank's micro-batch and state run on the other rank: a
    persistent fault reproduces on its rank only (a faulty device: the run
    stops naming it), bad data on both."""
    from ranks import run_ranks
    got = run_ranks(_planted_on_rank_1, tmp_path, planted)
    for rank in (0, 1):
        assert got[rank][:2] == (action, fault), got[rank]
    if planted == "persistent":
        assert "persistent fault on rank 1 (host " in got[0][2] and "rank 0 given the same micro-batch" in got[0][2]
    if planted == "data":
        assert "rank 0 ran rank 1's micro-batch from the same state and made it too" in got[1][2]
