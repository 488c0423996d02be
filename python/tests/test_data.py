"""nanguard.data: a fitted Firewall in a DataLoader (firewall_collate,
FirewallDataset): drop, repair and raise; counts that survive DataLoader
workers; data events in the event log that `nanguard report` reads."""
import json
import os
import subprocess

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

import nanguard
from nanguard import _nanguard
from nanguard.data import DROPPED, FirewallDataset, FirewallIterableDataset, firewall_collate

CLI = os.environ.get("NANGUARD_CLI", "")
needs_cli = pytest.mark.skipif(not CLI, reason="NANGUARD_CLI is not set (CTest sets it to the built nanguard)")

BAD = {3: float("nan"), 10: float("inf"), 11: float("nan"), 25: -float("inf")}  # row -> value in column 1


def dataset(n=40):
    """(x, y) with y the row index, so a test sees which rows came through;
    the rows of BAD hold a NaN or Inf in column 1."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(n, 4, generator=g)
    for row, v in BAD.items():
        x[row, 1] = v
    return x, torch.arange(n)


def events(path):
    return [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]


def test_collate_drops_rows_from_features_and_labels(tmp_path):
    x, y = dataset()
    collate = firewall_collate(nanguard.Firewall(nonfinite="drop"), event_log=tmp_path / "data.jsonl")
    batches = list(DataLoader(TensorDataset(x, y), batch_size=8, collate_fn=collate))
    got_y = torch.cat([b[1] for b in batches])
    assert got_y.tolist() == [i for i in range(40) if i not in BAD]
    got_x = torch.cat([b[0] for b in batches])
    assert torch.equal(got_x, x[got_y]) and torch.isfinite(got_x).all()
    assert (collate.checked, collate.dropped, collate.repaired) == (40, 4, 0)
    assert (collate.nan, collate.pos_inf, collate.neg_inf) == (2, 1, 1)
    assert collate.counts()["dropped"] == 4
    # One data event per batch in which the firewall found something: rows 3 | 10, 11 | 25 (the
    # clean batch of rows 16-23 is counted in the next event's rows checked), named as rows of
    # their batch; flush() writes the clean rows checked since (32-39), so every row is counted.
    collate.flush()
    ev = events(tmp_path / "data.jsonl")
    assert [e["action"] for e in ev] == ["data"] * 4
    assert [e["data"]["dropped"] for e in ev] == [1, 2, 1, 0]
    assert [e["data"]["checked"] for e in ev] == [8, 8, 16, 8]
    assert [e["data"]["check"] for e in ev] == [1, 2, 4, 5]
    assert [e["data"].get("dropped_rows") for e in ev] == [[3], [2, 3], [1], None]
    assert all(e["data"]["row_index"] == "batch" for e in ev)
    assert all(e["data"]["source"] == "firewall_collate" for e in ev)
    # A data event is no training step: no step number, no loss.
    assert not any("step" in e or "loss" in e for e in ev)


def test_collate_repairs_with_the_fitted_medians(tmp_path):
    x, y = dataset()
    fw = nanguard.Firewall(nonfinite="impute_median").fit(x[torch.isfinite(x).all(1)])
    collate = firewall_collate(fw)
    out_x, out_y = collate([(x[i], y[i]) for i in range(16)])
    assert out_y.tolist() == list(range(16)) and torch.isfinite(out_x).all()
    assert torch.equal(out_x[[0, 1, 2]], x[[0, 1, 2]])
    assert out_x[3, 1] == out_x[10, 1] != 0  # the same fitted median
    assert (collate.checked, collate.dropped, collate.changed, collate.repaired) == (16, 0, 3, 3)


def test_collate_raise_names_the_row_and_is_counted(tmp_path):
    x, y = dataset()
    log = tmp_path / "data.jsonl"
    collate = firewall_collate(nanguard.Firewall(nonfinite="raise"), event_log=str(log))
    assert collate([(x[i], y[i]) for i in range(3)])[0].shape == (3, 4)
    with pytest.raises(ValueError, match="row 3"):
        collate([(x[i], y[i]) for i in range(8)])
    assert (collate.checked, collate.raised) == (11, 1)
    [e] = events(log)
    assert e["data"]["raised"] == 1 and e["data"]["checked"] == 3 + 8
    # An input the firewall cannot check is an error, not a refusal under the policy.
    with pytest.raises(TypeError, match="expected a floating-point tensor but got Long"):
        collate([(torch.ones(4, dtype=torch.long), 0)] * 2)
    assert collate.raised == 1 and len(events(log)) == 1


def test_collate_field_for_dict_batches_and_shape_errors():
    x, _ = dataset()
    collate = firewall_collate(nanguard.Firewall(nonfinite="drop"), field="features")
    out = collate([{"features": x[i], "id": i, "name": f"s{i}"} for i in range(5)])
    assert out["id"].tolist() == [0, 1, 2, 4] and out["name"] == ["s0", "s1", "s2", "s4"]
    with pytest.raises(TypeError, match="needs field="):
        firewall_collate(nanguard.Firewall())([{"features": x[0]}])
    with pytest.raises(ValueError, match=r"\[batch, features\] tensors; the collated features have shape \[2, 2, 2\]"):
        firewall_collate(nanguard.Firewall())([torch.zeros(2, 2), torch.zeros(2, 2)])
    with pytest.raises(TypeError, match="firewall must be a nanguard.Firewall, got .drop. \\(str\\)"):
        firewall_collate("drop")
    with pytest.raises(ValueError, match=r"firewall_collate: the sample has no field 'feature' \(its fields: "
                                         r"\['features', 'id'\]\); pass field= naming the features tensor"):
        firewall_collate(nanguard.Firewall(), field="feature")([{"features": x[0], "id": 0}])
    with pytest.raises(ValueError, match=r"has no field 2 \(its fields: \[0, 1\]\)"):
        firewall_collate(nanguard.Firewall(), field=2)([(x[0], 0)])


@pytest.mark.parametrize("workers", [0, 2])
def test_counts_and_events_of_worker_processes_are_kept(tmp_path, workers):
    """The workers check copies of the collate function: their counts land in
    shared memory, their events in the log (each worker appends)."""
    x, y = dataset(400)
    for row in range(50, 400, 50):
        x[row, 2] = float("nan")
    log = tmp_path / "data.jsonl"
    collate = firewall_collate(nanguard.Firewall(nonfinite="drop"), event_log=log)
    loader = DataLoader(TensorDataset(x, y), batch_size=20, collate_fn=collate, num_workers=workers)
    rows = sum(b[1].numel() for b in loader)
    bad = len(BAD) + 7
    assert rows == 400 - bad
    assert (collate.checked, collate.dropped) == (400, bad)
    collate.flush()
    ev = events(log)
    assert sum(e["data"]["dropped"] for e in ev) == bad
    # The clean batches count too: the workers write what they checked since their last event as they exit.
    assert sum(e["data"]["checked"] for e in ev) == 400
    assert sorted(e["data"]["check"] for e in ev) == sorted(set(e["data"]["check"] for e in ev))  # numbered once each
    collate.reset_counts()
    assert collate.checked == 0


class DictSamples(Dataset):
    def __init__(self, x):
        self.x = x

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"x": self.x[i], "i": i}


def test_dataset_skip_marks_dropped_samples_and_its_collate_leaves_them_out():
    x, y = dataset()
    ds = FirewallDataset(TensorDataset(x, y), nanguard.Firewall(nonfinite="drop"))
    assert ds[3] is DROPPED and ds[4][1] == 4
    assert (ds.checked, ds.dropped) == (2, 1)
    ys = torch.cat([b[1] for b in DataLoader(ds, batch_size=8, collate_fn=ds.collate_fn)])
    assert ys.tolist() == [i for i in range(40) if i not in BAD]
    assert ds.dropped == 1 + 4
    # firewall_collate leaves the markers out too, and checks the batch again.
    collate = firewall_collate(nanguard.Firewall(nonfinite="drop"))
    assert collate([ds[2], ds[3]])[1].tolist() == [2]
    # A batch of dropped samples only: None, to skip.
    assert ds.collate_fn([ds[3], ds[10]]) is None and collate([DROPPED]) is None


def test_dataset_resample_keeps_the_batch_size_and_repair_replaces_the_features():
    x, y = dataset()
    ds = FirewallDataset(TensorDataset(x, y), nanguard.Firewall(nonfinite="drop"), policy="resample")
    assert ds[10][1] == 12  # 10 and 11 dropped
    assert ds[39][1] == 39 and ds[25][1] == 26
    sizes = [b[1].numel() for b in DataLoader(ds, batch_size=8)]
    assert sizes == [8] * 5
    fw = nanguard.Firewall(nonfinite="nan_to_num", nan_value=-7.0)
    rep = FirewallDataset(DictSamples(x), fw, field="x")
    sample = rep[3]
    assert sample["x"][1] == -7.0 and sample["i"] == 3 and torch.equal(rep[0]["x"], x[0])
    assert (rep.checked, rep.changed, rep.repaired, rep.dropped) == (2, 1, 1, 0)
    with pytest.raises(ValueError, match="policy must be one of"):
        FirewallDataset(TensorDataset(x), fw, policy="drop")
    with pytest.raises(ValueError, match="dropped every one of the 1 samples"):
        FirewallDataset(TensorDataset(x[3:4]), nanguard.Firewall(nonfinite="drop"), policy="resample")[0]
    with pytest.raises(ValueError, match=r"sample 0's features have shape \[2, 2\]"):
        FirewallDataset([torch.zeros(2, 2)], fw)[0]


def test_dataset_with_workers_and_the_guards_event_log(tmp_path):
    """Data events and the Guard's steps in one log; `nanguard report` reads it."""
    x, y = dataset()
    log = tmp_path / "events.jsonl"
    model = torch.nn.Linear(4, 2)
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), event_log=log)  # truncates the log
    ds = FirewallDataset(TensorDataset(x, y % 2), nanguard.Firewall(nonfinite="drop"), event_log=log)
    loader = DataLoader(ds, batch_size=8, collate_fn=ds.collate_fn, num_workers=2)
    for bx, by in loader:
        guard.step(lambda: torch.nn.functional.cross_entropy(model(bx), by))
    guard.close()
    assert (ds.checked, ds.dropped) == (40, 4)
    ev = events(log)
    data = [e for e in ev if e["action"] == "data"]
    assert all(e["data"]["source"] == "FirewallDataset" for e in data)
    # The dropped samples by their dataset index, through the DataLoader's workers; every row counted.
    assert sorted(r for e in data for r in e["data"].get("dropped_rows", [])) == sorted(BAD)
    assert all(e["data"]["row_index"] == "dataset" for e in data if "dropped_rows" in e["data"])
    assert sum(e["data"]["checked"] for e in data) == 40
    assert [e["step"] for e in ev if e["action"] != "data"] == [1, 2, 3, 4, 5]
    if CLI:
        r = subprocess.run([CLI, "report", str(log), "-o", str(tmp_path / "r.html")], capture_output=True,
                           text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "FirewallDataset: " in (tmp_path / "r.html").read_text()
        assert ", 4 dropped, 0 repaired or clipped (NaN 2, +Inf 1, -Inf 1" in (tmp_path / "r.html").read_text()
        assert "dropped dataset indices 3, 10, 11, 25" in (tmp_path / "r.html").read_text()


def test_event_log_argument_is_checked(tmp_path):
    with pytest.raises(TypeError, match="event_log must be a path"):
        firewall_collate(nanguard.Firewall(), event_log=3)
    with pytest.raises(OSError):
        firewall_collate(nanguard.Firewall(), event_log=tmp_path / "no" / "such" / "dir.jsonl")
    assert isinstance(_nanguard.EventLog(str(tmp_path / "e.jsonl")), _nanguard.EventLog)


@pytest.mark.filterwarnings("ignore:Got pickle error when attempting to start a worker Process")
def test_spawned_workers_are_refused_with_what_to_do():
    x, y = dataset()
    collate = firewall_collate(nanguard.Firewall(nonfinite="drop"))
    loader = DataLoader(TensorDataset(x, y), batch_size=8, collate_fn=collate, num_workers=1,
                        multiprocessing_context="spawn")
    with pytest.raises(TypeError, match="use multiprocessing_context='fork'"):
        next(iter(loader))


class Stream(torch.utils.data.IterableDataset):
    """Rows of x with their index; each DataLoader worker takes every n-th row."""

    def __init__(self, x):
        self.x = x

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        start, step = (info.id, info.num_workers) if info else (0, 1)
        for i in range(start, len(self.x), step):
            yield self.x[i], i


@pytest.mark.parametrize("workers", [0, 2])
def test_iterable_dataset_leaves_dropped_samples_out(tmp_path, workers):
    x, _ = dataset()
    ds = FirewallIterableDataset(Stream(x), nanguard.Firewall(nonfinite="drop"), event_log=tmp_path / "d.jsonl")
    ids = sorted(torch.cat([i for _, i in DataLoader(ds, batch_size=8, num_workers=workers)]).tolist())
    assert ids == [i for i in range(40) if i not in BAD]
    assert (ds.checked, ds.dropped, ds.nan, ds.pos_inf, ds.neg_inf) == (40, 4, 2, 1, 1)
    assert sum(e["data"]["dropped"] for e in events(tmp_path / "d.jsonl")) == 4


@needs_cli
def test_a_log_of_data_events_only_is_reported(tmp_path):
    """A log with no training step (the firewall ran alone): `nanguard report`
    shows its data events, not "No steps logged"; a log written before data
    events had their own axis (their check as "step") still reads."""
    x, y = dataset()
    log = tmp_path / "data.jsonl"
    ds = FirewallDataset(TensorDataset(x, y), nanguard.Firewall(nonfinite="drop"), event_log=log)
    for i in range(len(ds)):
        ds[i]
    ds.flush()
    with open(log, "a", encoding="utf-8") as f:
        f.write('{"step": 9, "action": "data", "data": {"source": "old_writer", "checked": 5, "dropped": 1}}\n')
    r = subprocess.run([CLI, "report", str(log), "-o", str(tmp_path / "r.html")], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "r.html").read_text()
    assert "FirewallDataset: 40 rows checked, 4 dropped" in page and "dropped dataset indices 3, 10, 11, 25" in page
    assert "old_writer: 5 rows checked, 1 dropped" in page


def test_robust_z_leaves_clean_normal_rows_and_drops_outliers():
    """The default robust_z: of 100k clean N(0, 1) rows of 32 features at most
    0.1% dropped (3.5 dropped 1.5%); a row 8 sigma out still goes."""
    g = torch.Generator().manual_seed(3)
    fw = nanguard.Firewall(outliers="drop", rule="robust_z").fit(torch.randn(100_000, 32, generator=g))
    clean, report = fw.apply(torch.randn(100_000, 32, generator=g))
    assert len(report.dropped_rows) <= 100, len(report.dropped_rows)
    bad = torch.randn(4, 32, generator=g)
    bad[2, 7] = 8.0
    assert fw.apply(bad)[1].dropped_rows == [2]
