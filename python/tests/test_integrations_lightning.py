"""nanguard.integrations.lightning.NanGuard on real Lightning Trainers (tiny
models on the CPU): a healthy run is untouched; a planted NaN (a bad batch,
an LR spike, a log of 0 in the model) is skipped or rolled back, named, and
the run ends finite; `nanguard report` / `inspect` read what it wrote.

The lightning package comes from python/requirements-frameworks.txt (`make
setup`); without it, importing the callback fails and says so."""
import json
import logging
import math
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard
from nanguard.integrations.lightning import NanGuard  # ImportError saying `make setup` installs lightning

import lightning.pytorch as pl

CLI = os.environ.get("NANGUARD_CLI", "")
needs_cli = pytest.mark.skipif(not CLI, reason="NANGUARD_CLI is not set (CTest sets it to the built nanguard)")

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")


class Classifier(pl.LightningModule):
    """A 2-layer MLP on 4 features; the test plants its bug through
    ``log0_at`` (a log of 0 in the forward at that global step) or
    ``lr_spike_at`` (the LR times 1e37 for that step)."""

    def __init__(self, lr=0.1, log0_at=-1, lr_spike_at=-1):
        super().__init__()
        self.lin = nn.Linear(4, 16)
        self.head = nn.Linear(16, 3)
        self.lr, self.log0_at, self.lr_spike_at = lr, log0_at, lr_spike_at
        self.losses = []

    def forward(self, x):
        h = torch.relu(self.lin(x))
        if self.global_step == self.log0_at:
            h = h + torch.log(torch.zeros_like(h[:, :1]))  # the planted bug: log(0) = -inf
        return self.head(h)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        spike = lambda step: 1e37 if step == self.lr_spike_at else 1.0
        return {"optimizer": opt,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.LambdaLR(opt, spike), "interval": "step"}}


def loader(n=64, batch=8, nan_in_batch=-1):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] > 0).long()
    if nan_in_batch >= 0:
        x[nan_in_batch * batch + 3, 2] = float("nan")  # a bad sample in that batch
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=batch)


def fit(model, callbacks=(), steps=8, **trainer_args):
    torch.manual_seed(0)
    data = trainer_args.pop("train_dataloaders", None) or loader()
    trainer = pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                         callbacks=list(callbacks), **trainer_args)
    trainer.fit(model, data)
    return trainer


def finite_params(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


def events(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def cli(*args):
    return subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=300)


def test_a_healthy_run_is_untouched(tmp_path):
    plain = Classifier()
    torch.manual_seed(0)
    guarded = Classifier()
    guarded.load_state_dict(plain.state_dict())
    fit(plain)
    cb = NanGuard(policy="rollback", event_log=tmp_path / "events.jsonl")
    fit(guarded, [cb])
    for a, b in zip(plain.parameters(), guarded.parameters()):
        assert torch.equal(a, b)
    lines = events(tmp_path / "events.jsonl")
    # Numbered as Lightning numbers its steps: global_step, from 0.
    assert [l["step"] for l in lines] == list(range(8)) and all(l["action"] == "step" for l in lines)
    assert cb.bad_steps == [] and cb.last.step == 7


def test_a_log_of_zero_in_the_model_is_skipped_and_named(tmp_path):
    model = Classifier(log0_at=3)
    cb = NanGuard(policy="skip", event_log=tmp_path / "events.jsonl")
    fit(model, [cb])
    assert [r.step for r in cb.bad_steps] == [3]  # Lightning's global_step 3
    r = cb.bad_steps[0]
    assert r.action == "skip" and r.finding is not None and r.finding.op == "aten::log", r
    assert r.verdict == "reproduced"
    assert finite_params(model) and math.isfinite(model.losses[-1])
    lines = events(tmp_path / "events.jsonl")
    assert [l["action"] for l in lines].count("skip") == 1
    assert lines[3]["findings"][0]["op"] == "aten::log"


def test_without_the_callback_the_planted_bug_poisons_the_model():
    """The control of the tests above: the same run without nanguard ends non-finite."""
    model = Classifier(log0_at=3)
    fit(model)
    assert not finite_params(model)


def test_a_bad_batch_is_skipped_with_gradient_accumulation(tmp_path):
    cb = NanGuard(policy="skip", event_log=tmp_path / "events.jsonl")
    model = Classifier()
    fit(model, [cb], steps=4, accumulate_grad_batches=2, train_dataloaders=loader(nan_in_batch=5))
    lines = events(tmp_path / "events.jsonl")
    assert len(lines) == 4  # one event per optimizer step, not per micro-batch
    assert [l["action"] for l in lines] == ["step", "step", "skip", "step"]  # batch 5 is in step 3
    f = cb.bad_steps[0].finding
    assert f is not None and f.role == "input" and f.op == "aten::addmm", f  # the NaN came with the batch
    # Named as training_step sees it (x of the second micro-batch is its batch[0]), with a remedy
    # that works under Lightning: a firewall in the DataLoader, no Guard option, no CSV.
    assert f.culprit.startswith("batch[0]") and f.cause == "bad_data", f
    assert "collate_fn=nanguard.data.firewall_collate(" in f.remedy, f.remedy
    assert "nanguard scan" not in f.remedy and "C++" not in f.remedy, f.remedy
    assert finite_params(model) and math.isfinite(model.losses[-1])


def test_an_lr_spike_is_rolled_back(tmp_path):
    model = Classifier(lr_spike_at=3)
    cb = NanGuard(policy="rollback", snapshot_every=1, event_log=tmp_path / "events.jsonl")
    trainer = fit(model, [cb], steps=10)
    assert cb.bad_steps and all(r.action == "rollback" for r in cb.bad_steps)
    # step 4 is bad; the snapshot taken at step 3, before its spiked update, is restored
    assert cb.bad_steps[0].step == 4 and cb.bad_steps[0].rollback_to == 3 and len(cb.bad_steps) == 1
    f = cb.bad_steps[0].finding  # the spiked weights overflow: inf - inf in the head's matmul
    assert f is not None and f.op == "aten::addmm" and f.role == "producer" and f.module == "head", f
    assert finite_params(model) and math.isfinite(model.losses[-1])
    # The rollback halved the LR, and the scheduler keeps it halved.
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(0.05)


class WithUserScheduler(Classifier):
    """The LR spike of Classifier from a scheduler made before fit, with a
    scheduler of the user's on the same optimizer that Lightning does not
    step (one the user steps in a callback of their own)."""

    def __init__(self):
        super().__init__(lr_spike_at=3)
        self.opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        self.lightnings = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1e37 if s == self.lr_spike_at else 1.0)
        self.users = torch.optim.lr_scheduler.LambdaLR(self.opt, lambda s: 1.0)

    def configure_optimizers(self):
        return {"optimizer": self.opt, "lr_scheduler": {"scheduler": self.lightnings, "interval": "step"}}


def test_a_rollback_lowers_the_user_s_lr_scheduler_and_lightning_s_once_each():
    """The user's lr_scheduler= was replaced by Lightning's schedulers: a
    rollback left the user's base LR as it was."""
    model = WithUserScheduler()
    cb = NanGuard(policy="rollback", snapshot_every=1, lr_scheduler=[model.users, model.lightnings], verbose=False)
    fit(model, [cb], steps=10)
    assert [r.action for r in cb.bad_steps] == ["rollback"]
    # Halved once each: Lightning's, named by the user too, is not lowered twice.
    assert model.users.base_lrs == pytest.approx([0.05]) and model.lightnings.base_lrs == pytest.approx([0.05])


def test_skip_cannot_undo_an_lr_spike_without_rollback():
    """Control: skipping alone leaves the spiked parameters in place."""
    model = Classifier(lr_spike_at=3)
    cb = NanGuard(policy="skip")
    fit(model, [cb], steps=10)
    assert len(cb.bad_steps) >= 4  # every step after the spike is bad


@needs_cli
def test_nanguard_report_and_inspect_read_what_the_callback_wrote(tmp_path):
    log, bundles = tmp_path / "events.jsonl", tmp_path / "bundles"
    model = Classifier(log0_at=2)
    with pytest.raises(nanguard.NonFiniteError, match="aten::log"):
        fit(model, [NanGuard(policy="abort", event_log=log, bundle_dir=bundles)])
    lines = events(log)
    assert lines[-1]["action"] == "abort" and lines[-1]["bundle"]
    r = cli("report", log, "-o", tmp_path / "report.html")
    assert r.returncode == 0, r.stderr
    assert "aten::log" in (tmp_path / "report.html").read_text()
    r = cli("inspect", lines[-1]["bundle"])
    assert r.returncode == 0, r.stderr
    assert "aten::log" in r.stdout and "lightning" in r.stdout


def test_the_callback_refuses_what_it_cannot_guard():
    with pytest.raises(ValueError, match="loss_scale is Lightning's"):
        NanGuard(loss_scale=True)
    with pytest.raises(ValueError, match="policy must be one of"):
        NanGuard(policy="retry")
    with pytest.raises(TypeError, match=r"NanGuard: unknown option 'snapshot_evry'; did you mean 'snapshot_every'\?"):
        NanGuard(snapshot_evry=10)
    with pytest.raises(TypeError, match=r"unknown option 'log_metric'; did you mean 'log_metrics'\?") as e:
        NanGuard(log_metric=False)  # the callback's own option is one of those it lists; loss_scale is not
    assert "loss_scale" not in str(e.value)

    class Manual(Classifier):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False

    with pytest.raises(ValueError, match="manual optimization"):
        fit(Manual(), [NanGuard()])


def test_ddp_ranks_skip_the_same_step_and_the_bad_rank_names_the_op(tmp_path):
    """strategy="ddp", 2 processes on the CPU (gloo): the NaN in rank 1's
    batch reaches rank 0 through the gradient all-reduce; both skip that
    step (their parameters stay equal), rank 1's replay names the input,
    and every rank's result is rank 1's (the guard agrees on DDP's group); each rank writes its own event log."""
    script = os.path.join(os.path.dirname(__file__), "ddp_lightning_run.py")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)
    r = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=300,
                       env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    assert [b["step"] for b in res[0]["bad"]] == [b["step"] for b in res[1]["bad"]] == [3]
    assert all(b["action"] == "skip" for x in res for b in x["bad"])
    # Every rank's result is rank 1's: its op, its verdict.
    for x in res:
        b = x["bad"][0]
        assert (b["bad_ranks"], b["finding_rank"], b["verdict"], b["role"]) == ([1], 1, "reproduced", "input"), b
        assert b["op"] == "aten::addmm", b  # the NaN sample read by the first Linear, on rank 1
    assert res[0]["finite"] and res[1]["finite"] and res[0]["checksum"] == res[1]["checksum"]
    assert len(events(tmp_path / "events.jsonl")) == len(events(tmp_path / "events.rank1.jsonl")) == 6


def test_bf16_autocast_log_of_zero_is_named_under_autocast(tmp_path):
    """precision="bf16-mixed" (autocast, no scaler): the replay runs under
    Lightning's autocast too and names the op."""
    model = Classifier(log0_at=2)
    cb = NanGuard(policy="skip")
    fit(model, [cb], steps=5, precision="bf16-mixed")
    assert [r.step for r in cb.bad_steps] == [2] and cb.bad_steps[0].finding.op == "aten::log"
    assert cb.scaler_skips == 0 and finite_params(model)


def fp16_scaler_plugin(init_scale):
    """Lightning's 16-bit AMP with a GradScaler, on the CPU (Lightning turns
    precision="16-mixed" into bf16 on the CPU, so the plugin is given)."""
    from lightning.pytorch.plugins.precision import MixedPrecision
    return MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=init_scale))


def test_the_grad_scalers_own_overflow_skips_are_left_to_it():
    """A scale so high that the first steps' scaled gradients overflow: the
    GradScaler skips them and halves its scale; nanguard counts them in
    scaler_skips and neither replays nor acts on them."""
    model = Classifier()
    cb = NanGuard(policy="rollback")
    trainer = fit(model, [cb], steps=8, plugins=[fp16_scaler_plugin(2.0 ** 20)])
    scaler = trainer.precision_plugin.scaler
    assert cb.scaler_skips >= 1 and cb.bad_steps == [], (cb.scaler_skips, cb.bad_steps)
    assert scaler.get_scale() < 2.0 ** 20 and finite_params(model)


def test_a_log_of_zero_under_the_grad_scaler_is_nanguards():
    model = Classifier(log0_at=2)
    cb = NanGuard(policy="skip")
    fit(model, [cb], steps=5, plugins=[fp16_scaler_plugin(2.0 ** 8)])
    assert [r.step for r in cb.bad_steps] == [2] and cb.bad_steps[0].finding.op == "aten::log"
    assert cb.scaler_skips == 0 and finite_params(model)


def test_a_training_step_that_skips_its_batch_is_not_a_bad_step(tmp_path):
    """Lightning skips a batch whose training_step returns None: no backward,
    nothing to step; nanguard neither acts on it nor logs it (it was logged
    as a healthy step with loss 0, #41)."""

    class Skipping(Classifier):
        def training_step(self, batch, batch_idx):
            return None if batch_idx == 2 else super().training_step(batch, batch_idx)

    cb = NanGuard(policy="rollback", event_log=tmp_path / "events.jsonl")
    model = Skipping()
    fit(model, [cb], steps=5)
    lines = events(tmp_path / "events.jsonl")
    assert cb.bad_steps == [] and all(l["action"] == "step" for l in lines)
    # One event per batch that ran backward, each with its real loss, numbered as Lightning's global_step
    # (which counts the step the user skipped: batch 2's).
    assert len(lines) == len(model.losses) and [l["step"] for l in lines] == [0, 1, 3, 4], lines
    assert [l["loss"] for l in lines] == pytest.approx(model.losses), lines


def test_the_callback_logs_its_steps_to_tensorboard(tmp_path):
    """NanGuard(tensorboard=DIR) hands the directory to the Guard: every
    optimizer step's loss and skip flag are in TensorBoard, the bad step's
    finding as text."""
    from tensorboard.backend.event_processing.event_accumulator import TENSORS, EventAccumulator
    fit(Classifier(log0_at=3), [NanGuard(policy="skip", tensorboard=str(tmp_path / "tb"))])
    acc = EventAccumulator(str(tmp_path / "tb"), size_guidance={TENSORS: 0})
    acc.Reload()
    assert [e.step for e in acc.Scalars("loss")] == list(range(8))
    assert [e.value for e in acc.Scalars("skipped")] == [0, 0, 0, 1, 0, 0, 0, 0]
    texts = [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("nanguard/findings")]
    assert any("aten::log" in t for t in texts), texts


class NormRecorder(Classifier):
    """Records the global grad norm that Lightning's own hook sees (before
    its gradient_clip_val clipping)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.norms = []

    def on_before_optimizer_step(self, optimizer):
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        self.norms.append(float(torch.nn.utils.get_total_norm(grads)) if grads else float("nan"))


def test_the_grad_norm_is_the_one_before_lightning_s_clipping(tmp_path):
    model = NormRecorder(lr=0.5)
    fit(model, [NanGuard(event_log=tmp_path / "events.jsonl")], gradient_clip_val=0.05)
    lines = events(tmp_path / "events.jsonl")
    assert [l["grad_norm"] for l in lines] == pytest.approx(model.norms, rel=1e-5)
    assert min(model.norms) > 0.05  # every step was clipped


def test_the_logger_gets_the_guard_s_metrics_and_the_user_sees_each_bad_step(tmp_path):
    from lightning.pytorch.loggers import CSVLogger
    model = Classifier(log0_at=3)
    cb = NanGuard(policy="skip")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.manual_seed(0)
        trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name="run"),
                             log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, callbacks=[cb])
        trainer.fit(model, loader())
    told = [str(w.message) for w in caught if issubclass(w.category, nanguard.NanGuardWarning)]
    assert len(told) == 2, told
    assert told[0].startswith("nanguard: step 3: ") and "aten::log" in told[0] and "skipped the step" in told[0]
    assert told[1].startswith("nanguard: 8 steps, 1 not taken (1 skipped); last bad step 3 ")
    import csv
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("nanguard/skipped_steps")]
    assert [float(r["nanguard/skipped_steps"]) for r in rows] == [0, 0, 0, 1, 1, 1, 1, 1]
    assert float(rows[2]["nanguard/last_cause"]) == 0
    assert float(rows[-1]["nanguard/last_cause"]) == nanguard._nanguard.cause_code(cb.bad_steps[0].finding.cause)
    assert float(rows[-1]["nanguard/loss_scale"]) == 1.0 and float(rows[-1]["nanguard/rollbacks"]) == 0
    assert float(rows[-1]["nanguard/grad_norm"]) == pytest.approx(cb.last.grad_norm, rel=1e-5)
    assert rows[3]["nanguard/grad_norm"] == "nan"  # the bad step's, not the step before's
    assert int(rows[3]["step"]) == 3  # logged at the guard's step number


class LoggedLoss(Classifier):
    """Logs its loss as ``train_loss`` (on the progress bar too); records, at
    the end of each batch, the step's loss and the Trainer's logged one."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = []  # (global_step, the step's loss, callback_metrics', progress_bar_metrics' train_loss)

    def training_step(self, batch, batch_idx):
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        t = self.trainer
        self.seen.append((t.global_step, float(outputs["loss"]), float(t.callback_metrics["train_loss"]),
                          float(t.progress_bar_metrics["train_loss"])))


def test_a_replay_leaves_no_stale_loss_in_lightning_s_logged_metrics(tmp_path):
    """The replay (and each remedy trial) runs training_step again, whose
    self.log must not outlive it: each step's logged train_loss is the loss
    that step computed (the bad step's own NaN/Inf, then the healthy ones')."""
    from lightning.pytorch.loggers import CSVLogger
    import csv
    model = LoggedLoss(log0_at=3)
    cb = NanGuard(policy="skip")
    torch.manual_seed(0)
    trainer = pl.Trainer(max_steps=8, accelerator="cpu", devices=1, logger=CSVLogger(tmp_path, name="run"),
                         log_every_n_steps=1, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[cb])
    trainer.fit(model, loader())
    assert [r.step for r in cb.bad_steps] == [3]
    assert len(model.losses) > 8  # the replay and the remedy trials ran training_step again
    for step, loss, logged, bar in model.seen:
        assert str(logged) == str(bar) == str(loss), model.seen  # nan == nan as text
    assert not math.isfinite(model.seen[3][1]) and all(math.isfinite(s[2]) for s in model.seen[4:])
    with open(os.path.join(trainer.logger.log_dir, "metrics.csv")) as f:
        logged = [(int(r["step"]), r["train_loss"]) for r in csv.DictReader(f) if r.get("train_loss")]
    assert [float(v) for _, v in logged] == pytest.approx([s[1] for s in model.seen], nan_ok=True)
    # The guard's bad step is the step Lightning's logger shows the NaN train_loss at.
    assert [step for step, v in logged if not math.isfinite(float(v))] == [r.step for r in cb.bad_steps]


def test_the_warnings_are_attributed_to_the_user_s_trainer_fit():
    model = Classifier(log0_at=3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit(model, [NanGuard(policy="skip")])
    told = [w for w in caught if issubclass(w.category, nanguard.NanGuardWarning)]
    assert len(told) == 2 and {os.path.basename(w.filename) for w in told} == {os.path.basename(__file__)}, \
        [(w.filename, w.lineno) for w in told]


class OneCycle(Classifier):
    """OneCycleLR, and a log of 0 at each of ``log0_at``'s global steps."""

    def __init__(self, log0_at=()):
        super().__init__()
        self.log0_steps = log0_at

    def forward(self, x):
        self.log0_at = self.global_step if self.global_step in self.log0_steps else -1
        return super().forward(x)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=self.lr)
        cycle = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=self.lr, total_steps=20)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": cycle, "interval": "step"}}


def test_a_second_rollback_to_the_same_snapshot_lowers_one_cycle_s_lr_again():
    """OneCycleLR keeps its bounds in the optimizer's param groups, which a
    rollback restores to the snapshot's: the second rollback to the step-0
    snapshot brought back the bounds from before the first, and the LR
    went on cut by the second rollback alone instead of both: an eighth of
    the plain run's (x0.5, then x0.25: no calm snapshot came between, so
    the second cut is deeper)."""
    plain, model = OneCycle(), OneCycle(log0_at=(5, 9))
    model.load_state_dict(plain.state_dict())
    plain_trainer = fit(plain, steps=14)
    cb = NanGuard(policy="rollback", snapshot_every=100, verbose=False)
    trainer = fit(model, [cb], steps=14)
    # Rolled back to the initial weights: the snapshot before step 0.
    assert [(r.step, r.rollback_to) for r in cb.bad_steps] == [(5, -1), (9, -1)]
    lr, plain_lr = trainer.optimizers[0].param_groups[0]["lr"], plain_trainer.optimizers[0].param_groups[0]["lr"]
    assert lr == pytest.approx(plain_lr / 8)


def test_a_fit_after_one_that_stopped_in_an_accumulation_window_is_guarded(tmp_path):
    """An error in the middle of an accumulation window stops fit(); the
    next fit with the same callback checked its first step against the
    stopped fit's micro-batches, with no step begun on its new guard (a
    ValueError in the guard's words: "nanguard::guard::check: no step was
    begun")."""

    class Failing(Classifier):
        fail_at = 5

        def training_step(self, batch, batch_idx):
            if batch_idx == self.fail_at:
                raise RuntimeError("a bug in training_step")
            return super().training_step(batch, batch_idx)

    model = Failing()
    cb = NanGuard(policy="skip", event_log=tmp_path / "events.jsonl")
    with pytest.raises(RuntimeError, match="a bug in training_step"):
        fit(model, [cb], steps=4, accumulate_grad_batches=2)  # batch 5 is the second of step 3
    model.fail_at = -1
    fit(model, [cb], steps=4, accumulate_grad_batches=2)
    lines = events(tmp_path / "events.jsonl")
    assert [(l["step"], l["action"]) for l in lines] == [(s, "step") for s in range(4)]
    assert cb.bad_steps == [] and finite_params(model)


def test_a_second_fit_with_the_callback_is_a_run_of_its_own(tmp_path):
    """The second fit rewrote the event log while bad_steps kept the first
    fit's bad step too: the two disagreed. Both describe the latest fit."""
    cb = NanGuard(policy="skip", event_log=tmp_path / "events.jsonl", verbose=False)
    fit(Classifier(log0_at=3), [cb])
    assert [r.step for r in cb.bad_steps] == [3]
    fit(Classifier(log0_at=1), [cb], steps=4)
    lines = events(tmp_path / "events.jsonl")
    assert [l["step"] for l in lines] == [0, 1, 2, 3]
    assert [r.step for r in cb.bad_steps] == [l["step"] for l in lines if l["skipped"]] == [1]
    summary = cb.guard.summary()
    assert (summary["steps"], summary["not_taken"], cb.last.step) == (4, 1, 3)
