"""Recovery as users train, fault by fault: a plain loop (nanguard.Guard),
Lightning's Trainer (NanGuard) and Hugging Face's Trainer
(NanGuardCallback), with the defaults (policy "auto") and with each policy.

The faults: a bad sample that recurs every epoch, a divergent LR, a batch
whose log is of 0, a float16 overflow. For each, the guarded run ends
finite; within 1.25x of the clean run's final loss for the faults of the
data; below half its initial loss for the divergent LR; never on its
initial weights; and the user saw a NanGuardWarning for each bad step and
the run's summary."""
import logging
import math
import os
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing may be fetched
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import pytest
import torch
import torch.nn as nn

import nanguard

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("accelerate").setLevel(logging.ERROR)
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning", "ignore::FutureWarning")

ROWS, FEATURES, BATCH, BAD_ROW = 256, 8, 32, 37


class Data:
    """Regression on ROWS rows: y = x w + 0.5 + noise; ``scale``: of x;
    ``positive``: x = exp(N(0, 1)), which the model reads through a log."""

    def __init__(self, scale=1.0, positive=False):
        g = torch.Generator().manual_seed(4)
        x = torch.randn(ROWS, FEATURES, generator=g)
        self.y = x @ torch.randn(FEATURES, 1, generator=g) + 0.5 + 0.1 * torch.randn(ROWS, 1, generator=g)
        self.x = (x.exp() if positive else x) * scale
        self.positive = positive

    def with_bad_row(self, value):
        """The same data with ``value`` in one feature of row BAD_ROW."""
        bad = Data.__new__(Data)
        bad.x, bad.y, bad.positive = self.x.clone(), self.y, self.positive
        bad.x[BAD_ROW, 3] = value
        return bad

    def batches(self):
        return [(self.x[i:i + BATCH], self.y[i:i + BATCH]) for i in range(0, ROWS, BATCH)]

    def clean_rows(self):
        keep = torch.arange(ROWS) != BAD_ROW
        return self.x[keep], self.y[keep]


class Regressor(nn.Module):
    """A linear model; ``log_features``: it reads log(x)."""

    def __init__(self, log_features=False):
        super().__init__()
        torch.manual_seed(5)
        self.lin = nn.Linear(FEATURES, 1)
        self.log_features = log_features

    def forward(self, x):
        return self.lin(x.log() if self.log_features else x)

    def loss(self, x, y):
        return (self(x) - y).pow(2).mean()


def loss_on(model, x, y):
    with torch.no_grad():
        return float(model.loss(x, y))


def nanguard_warnings(caught):
    return [str(w.message) for w in caught if issubclass(w.category, nanguard.NanGuardWarning)]


# -- a plain loop --------------------------------------------------------------------------------

def plain_run(data, epochs=25, lr=0.05, optimizer="adam", guarded=True, **options):
    """Trains a Regressor on ``data`` for ``epochs`` (the batches in the same
    order every epoch) under nanguard.Guard(**options), or a plain loop;
    returns the model, its initial weight, the guard and the warnings."""
    model = Regressor(log_features=data.positive)
    w0 = model.lin.weight.detach().clone()
    opt = (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(model.parameters(), lr=lr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = nanguard.Guard(model, opt, **options) if guarded else None
        for _ in range(epochs):
            for x, y in data.batches():
                if guard is not None:
                    guard.step(model.loss, x, y)
                else:
                    opt.zero_grad()
                    model.loss(x, y).backward()
                    opt.step()
        if guard is not None:
            guard.close()
    return model, w0, guard, nanguard_warnings(caught)


class SmallTransformer(nn.Module):
    """Two encoder layers (d=32, 4 heads) over 8 tokens of 4 features, a
    linear head: a regression on the tokens' sum."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Linear(4, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(32, 1)

    def forward(self, x):
        return self.head(self.enc(self.emb(x)).mean(1))


@pytest.mark.parametrize("optimizer,stable_lr", [(torch.optim.SGD, 0.01), (torch.optim.AdamW, 0.001)])
@pytest.mark.parametrize("times", [30, 100])
def test_plain_loop_defaults_rescue_a_small_transformer_diverging_from_its_first_step(optimizer, stable_lr, times):
    """SGD and AdamW at 30x and 100x their stable LR from the first step:
    at the defaults the guard rolls back to the initial weights with
    escalating cuts, and in the clean run's 300 steps the loss ends below
    half its initial value, status "recovered". (Unguarded, AdamW's run
    never goes non-finite: its loss jumps 15x at the second step and the
    model stalls on a plateau at 0.50; the guard's rule for the first steps
    catches the jump.)"""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, 4, generator=g)
    y = x.sum((1, 2)).unsqueeze(1) / 8
    model = SmallTransformer()
    initial = nn.functional.mse_loss(model(x), y).item()
    opt = optimizer(model.parameters(), lr=stable_lr * times)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = nanguard.Guard(model, opt)
        for i in range(300):
            xb, yb = x[32 * (i % 8):32 * (i % 8 + 1)], y[32 * (i % 8):32 * (i % 8 + 1)]
            guard.step(lambda: nn.functional.mse_loss(model(xb), yb))
        guard.close()
    with torch.no_grad():
        final = nn.functional.mse_loss(model(x), y).item()
    assert math.isfinite(final) and final < 0.5 * initial, (final, initial)
    s = guard.summary()
    assert s["status"] == "recovered" and s["rolled_back"] >= 1, s
    assert nanguard_warnings(caught)[-1] == s["text"]


def assert_recovered_from_bad_data(model, w0, guard, messages, clean):
    """Finite, within 1.25x of the clean run, not on the initial weights, a
    warning per bad step and the summary."""
    final = loss_on(model, *clean.clean_rows())
    reference = loss_on(plain_run(clean, guarded=False)[0], *clean.clean_rows())
    assert math.isfinite(final) and final < 1.25 * reference, (final, reference)
    assert not torch.equal(model.lin.weight.detach(), w0)
    summary = guard.summary()
    assert summary["not_taken"] >= 1
    assert len(messages) == summary["not_taken"] + 1, messages  # one per bad step, then the summary
    assert messages[-1] == summary["text"] and messages[-1].startswith(f"nanguard: {summary['steps']} steps")


def assert_converged_after_rollbacks(model, w0, guard, messages, data):
    """Finite, below half the initial loss, not on the initial weights,
    status "recovered", after at least 3 rollbacks (3.0 cut towards a stable LR, each cut
    deeper than the one before: x0.5, x0.25, x0.125), a warning per bad
    step and the summary."""
    initial = loss_on(Regressor(), data.x, data.y)
    final = loss_on(model, data.x, data.y)
    assert math.isfinite(final) and final < 0.5 * initial, (final, initial)
    assert not torch.equal(model.lin.weight.detach(), w0)
    s = guard.summary()
    assert s["rolled_back"] >= 3 and s["status"] == "recovered", s
    assert len(messages) == s["not_taken"] + 1 and messages[-1] == s["text"], messages


def test_plain_loop_defaults_quarantine_a_bad_sample_recurring_every_epoch():
    clean = Data()
    model, w0, guard, messages = plain_run(clean.with_bad_row(float("nan")))
    assert_recovered_from_bad_data(model, w0, guard, messages, clean)
    s = guard.summary()
    assert (s["not_taken"], s["rolled_back"]) == (25, 0)  # the bad batch, once an epoch, skipped
    assert "[bad_data]" in messages[0] and "skipped the step" in messages[0]


def test_plain_loop_defaults_skip_a_batch_whose_log_is_of_zero_and_keep_the_lr():
    clean = Data(positive=True)
    model, w0, guard, messages = plain_run(clean.with_bad_row(0.0))
    assert_recovered_from_bad_data(model, w0, guard, messages, clean)
    assert guard.summary()["rolled_back"] == 0
    assert "aten::log" in messages[0] and "[log_of_nonpositive]" in messages[0]


def test_plain_loop_defaults_roll_a_divergent_lr_back_until_it_converges():
    data = Data(scale=3.0)  # SGD is stable below an LR of about 0.08
    model, w0, guard, messages = plain_run(data, epochs=40, lr=3.0, optimizer="sgd")
    assert_converged_after_rollbacks(model, w0, guard, messages, data)


def test_plain_loop_defaults_back_the_loss_scale_off_on_a_float16_overflow():
    torch.manual_seed(2)
    l1, l2 = nn.Linear(16, 16), nn.Linear(16, 1)
    model = nn.Sequential(l1, l2)
    w0 = l1.weight.detach().clone()
    x, y = torch.randn(32, 16), torch.randn(32, 1) * 1000
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def loss(x, y):  # float16 emulated: the activation and its gradient round-trip through half
        return (l2(l1(x).half().float()) - y).pow(2).mean()

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        guard = nanguard.Guard(model, opt, loss_scale=True)
        results = [guard.step(loss, x, y) for _ in range(60)]
        guard.close()
    messages = nanguard_warnings(caught)
    assert results[0].action == "backoff"
    assert all(r.action in ("step", "backoff") for r in results)
    taken = [r for r in results if not r.skipped]
    assert sum(not r.skipped for r in results[-20:]) >= 18  # the scale found its level
    assert math.isfinite(taken[-1].loss) and taken[-1].loss < taken[0].loss
    assert not torch.equal(l1.weight.detach(), w0)
    assert len(messages) == guard.summary()["not_taken"] + 1


@pytest.mark.parametrize("policy", ["skip", "backoff", "rollback"])
def test_plain_loop_each_policy_ends_a_run_with_a_recurring_bad_sample_finite(policy):
    clean = Data()
    model, w0, guard, messages = plain_run(clean.with_bad_row(float("nan")), policy=policy)
    final = loss_on(model, *clean.clean_rows())
    assert math.isfinite(final)
    assert not torch.equal(model.lin.weight.detach(), w0)
    s = guard.summary()
    assert s["not_taken"] == 25 and len(messages) == 26
    # rollback: once, keeping the LR (the data is bad, not the LR), then the batch is quarantined
    assert s["rolled_back"] == (1 if policy == "rollback" else 0)
    assert_recovered_from_bad_data(model, w0, guard, messages, clean)


def test_plain_loop_abort_stops_at_the_first_bad_step_with_a_bundle(tmp_path):
    data = Data().with_bad_row(float("nan"))
    model = Regressor()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    guard = nanguard.Guard(model, opt, policy="abort", bundle_dir=tmp_path, verbose=False)
    with pytest.raises(nanguard.NonFiniteError) as raised:
        for x, y in data.batches():
            guard.step(model.loss, x, y)
    assert raised.value.result.step == 2 and raised.value.result.bundle
    assert os.path.isdir(raised.value.result.bundle)


def test_plain_loop_a_run_that_never_recovers_stops_after_max_bad_steps(tmp_path):
    model = Regressor()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.Guard(model, opt, bundle_dir=tmp_path, verbose=False)
    x, y = torch.full((4, FEATURES), float("nan")), torch.zeros(4, 1)
    with pytest.raises(nanguard.NonFiniteError) as raised:
        for _ in range(100):
            guard.step(model.loss, x, y)
    assert raised.value.result.step == 20
    assert "max_bad_steps=20: 20 bad steps in a row" in raised.value.result.note


# -- Lightning ---------------------------------------------------------------------------------------

def lightning_run(data, epochs, lr, optimizer="adam", callbacks=()):
    pl = pytest.importorskip("lightning.pytorch")

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = Regressor(log_features=data.positive)

        def training_step(self, batch, batch_idx):
            return self.net.loss(*batch)

        def configure_optimizers(self):
            return (torch.optim.Adam if optimizer == "adam" else torch.optim.SGD)(self.parameters(), lr=lr)

    module = Module()
    w0 = module.net.lin.weight.detach().clone()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data.x, data.y), batch_size=BATCH)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = pl.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, callbacks=list(callbacks))
        trainer.fit(module, loader)
    return module.net, w0, nanguard_warnings(caught)


def test_lightning_defaults_recover_from_a_bad_sample_recurring_every_epoch():
    from nanguard.integrations.lightning import NanGuard
    clean = Data()
    callback = NanGuard()
    model, w0, messages = lightning_run(clean.with_bad_row(float("nan")), epochs=25, lr=0.05, callbacks=[callback])
    assert_recovered_from_bad_data(model, w0, callback.guard, messages, clean)
    assert callback.guard.summary()["rolled_back"] == 0


def test_lightning_defaults_roll_a_divergent_lr_back_until_it_converges():
    from nanguard.integrations.lightning import NanGuard
    data = Data(scale=3.0)
    callback = NanGuard()
    model, w0, messages = lightning_run(data, epochs=40, lr=3.0, optimizer="sgd", callbacks=[callback])
    assert_converged_after_rollbacks(model, w0, callback.guard, messages, data)


# -- Hugging Face's Trainer ----------------------------------------------------------------------

def transformers_run(data, tmp_path, epochs, lr, optimizer="adamw_torch", callbacks=(), max_grad_norm=1.0):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = Regressor(log_features=data.positive)

        def forward(self, x, labels):
            return {"loss": self.net.loss(x, labels)}

    class Rows(torch.utils.data.Dataset):
        def __len__(self):
            return ROWS

        def __getitem__(self, i):
            return {"x": data.x[i], "labels": data.y[i]}

    model = Model()
    w0 = model.net.lin.weight.detach().clone()
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=BATCH,
                                          num_train_epochs=epochs, learning_rate=lr, optim=optimizer,
                                          lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=max_grad_norm,
                                          report_to=[], save_strategy="no", logging_strategy="no",
                                          disable_tqdm=True, use_cpu=True, seed=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Rows(), callbacks=list(callbacks))
        trainer.train()
    return model.net, w0, nanguard_warnings(caught)


def test_transformers_defaults_recover_from_a_bad_sample_recurring_every_epoch(tmp_path):
    from nanguard.integrations.transformers import NanGuardCallback
    clean = Data()
    callback = NanGuardCallback()
    model, w0, messages = transformers_run(clean.with_bad_row(float("nan")), tmp_path, epochs=25, lr=0.05,
                                           callbacks=[callback])
    final = loss_on(model, *clean.clean_rows())
    # The Trainer shuffles: the bad sample meets other rows each epoch, and its batch is skipped.
    reference_model, _, _ = transformers_run(clean, tmp_path / "clean", epochs=25, lr=0.05)
    reference = loss_on(reference_model, *clean.clean_rows())
    assert math.isfinite(final) and final < 1.25 * reference, (final, reference)
    assert not torch.equal(model.lin.weight.detach(), w0)
    s = callback.guard.summary()
    assert (s["not_taken"], s["rolled_back"]) == (25, 0)
    assert len(messages) == 26 and messages[-1] == s["text"]


def test_transformers_defaults_roll_a_divergent_lr_back_until_it_converges(tmp_path):
    from nanguard.integrations.transformers import NanGuardCallback
    data = Data(scale=3.0)
    callback = NanGuardCallback()
    model, w0, messages = transformers_run(data, tmp_path, epochs=40, lr=3.0, optimizer="sgd", callbacks=[callback],
                                           max_grad_norm=0.0)
    assert_converged_after_rollbacks(model, w0, callback.guard, messages, data)
