"""nanguard.data.track_indices: a bad batch row named by its dataset index,
through real DataLoaders (shuffled, with worker processes, persistent
workers, tensors moved after the loader) into nanguard.Guard's findings,
warnings and event log, and through the Lightning callback (#58)."""
import json
import logging
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

import nanguard
from nanguard.data import track_indices

BAD_ROW = 137


def dataset(rows=200):
    """Rows of 4 features and a class label, row BAD_ROW's features NaN."""
    x, y = torch.randn(rows, 4), torch.randint(0, 3, (rows,))
    x[BAD_ROW, 2] = float("nan")
    return TensorDataset(x, y)


def guarded_run(loader, tmp_path, move=lambda t: t, epochs=1):
    """Trains a Linear over the loader under a skipping Guard; the results of the bad steps and the log's lines."""
    model = nn.Linear(4, 3)
    log = tmp_path / "events.jsonl"
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), policy="skip", event_log=log,
                           verbose=False)
    bad = []
    for _ in range(epochs):
        for x, y in loader:
            r = guard.step(lambda x, y: F.cross_entropy(model(x), y), move(x), move(y))
            if r.skipped:
                bad.append(r)
    guard.close()
    return bad, [json.loads(line) for line in log.read_text().splitlines()]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shuffled_loaders_bad_row_is_named_by_its_dataset_index(tmp_path, workers):
    loader = track_indices(DataLoader(dataset(), batch_size=16, shuffle=True, num_workers=workers,
                                      generator=torch.Generator().manual_seed(3)))
    bad, lines = guarded_run(loader, tmp_path)
    assert len(bad) == 1
    finding = bad[0].finding
    assert (finding.culprit, finding.dataset_index) == ("x", BAD_ROW)
    assert f"dataset index {BAD_ROW}" in finding.summary()
    logged = [f for line in lines for f in line.get("findings", [])]
    assert [f["dataset_index"] for f in logged] == [BAD_ROW]


def test_tensors_moved_after_the_loader_are_matched_by_order(tmp_path):
    # x.double() stands for x.to("cuda"): another tensor, the same rows.
    loader = track_indices(DataLoader(dataset(), batch_size=16, shuffle=True,
                                      generator=torch.Generator().manual_seed(5)))
    model_dtype = lambda t: t.clone()
    bad, _ = guarded_run(loader, tmp_path, move=model_dtype)
    assert [r.finding.dataset_index for r in bad] == [BAD_ROW]


def test_persistent_workers_name_the_row_in_every_epoch(tmp_path):
    loader = track_indices(DataLoader(dataset(), batch_size=16, shuffle=True, num_workers=2,
                                      persistent_workers=True, generator=torch.Generator().manual_seed(7)))
    bad, _ = guarded_run(loader, tmp_path, epochs=2)
    assert [r.finding.dataset_index for r in bad] == [BAD_ROW, BAD_ROW]


def test_an_untracked_loader_names_no_index(tmp_path):
    bad, lines = guarded_run(DataLoader(dataset(), batch_size=16), tmp_path)
    assert [r.finding.dataset_index for r in bad] == [-1]
    assert "dataset index" not in bad[0].finding.summary()


def test_track_indices_refuses_what_has_no_indices():
    class Stream(IterableDataset):
        def __iter__(self):
            return iter([torch.zeros(4)])

    with pytest.raises(ValueError, match="IterableDataset, which has no indices"):
        track_indices(DataLoader(Stream()))
    with pytest.raises(ValueError, match="in_order=False"):
        track_indices(DataLoader(dataset(), num_workers=2, in_order=False))
    with pytest.raises(TypeError, match="loader must be a torch.utils.data.DataLoader, got a list"):
        track_indices([1, 2])
    loader = DataLoader(dataset(), batch_size=8)
    assert track_indices(track_indices(loader)) is loader and isinstance(loader, DataLoader)
    assert len(list(loader)) == 25


def test_the_lightning_callback_names_the_dataset_index():
    pl = pytest.importorskip("lightning.pytorch")
    from nanguard.integrations.lightning import NanGuard

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Classifier(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def training_step(self, batch, batch_idx):
            x, y = batch
            return F.cross_entropy(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return track_indices(DataLoader(dataset(), batch_size=16, shuffle=True,
                                            generator=torch.Generator().manual_seed(11)))

    cb = NanGuard(policy="skip", verbose=False)
    trainer = pl.Trainer(max_epochs=1, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer.fit(Classifier())
    assert [(r.finding.culprit, r.finding.dataset_index) for r in cb.bad_steps] == [("batch[0]", BAD_ROW)]
