"""nanguard.Guard over a DistributedDataParallel model on two Gloo ranks:
guard.step and begin_step/check with the model as DDP runs it. A NaN born
on rank 1 (in its batch at step 2, in a backward op at step 3) makes every
rank skip that step; every rank's result names rank 1 and the op, the
verdict is rank 1's ("reproduced"), and the parameters stay bit-identical."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanguard
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo")


def _loss(model, inner, x, y, rank, step):
    loss = F.mse_loss(model(x), y)
    if rank == 1 and step == 3:
        # sqrt(0) is finite; its gradient (Inf) times 0 is NaN: born in backward, the loss finite.
        loss = loss + torch.sqrt(inner[0].weight.sum() * 0)
    return loss


def _ddp_run(rank, with_check):
    torch.manual_seed(0)  # the same model on both ranks
    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.Guard(model, opt)  # DDP: distributed on the model's process group
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    out = []
    for step in range(1, 6):
        x = torch.randn(16, 4, generator=g)
        y = x.sum(1, keepdim=True)
        if rank == 1 and step == 2:
            x[3, 1] = float("nan")
        if with_check:
            guard.begin_step()
            opt.zero_grad()
            loss = _loss(model, inner, x, y, rank, step)
            loss.backward()
            r = guard.check(loss, replay=lambda: _loss(model, inner, x, y, rank, step), batch=[x, y])
            opt.step()
        else:
            r = guard.step(lambda a, b: _loss(model, inner, a, b, rank, step), x, y)
        out.append({"step": r.step, "action": r.action, "rank": r.rank, "bad_ranks": r.nonfinite_ranks,
                    "verdict": r.verdict, "finding": r.finding.to_dict() if r.finding else None, "loss": r.loss,
                    "note": r.note})
    guard.close()
    params = [p.detach().tolist() for p in inner.parameters()]  # no shared storage across processes
    model = None  # DDP's reducer lets go of the process group before it is destroyed
    return out, params


def _check_ranks(got, culprit):
    for rank, (out, _) in got.items():
        assert [o["action"] for o in out] == ["step", "skip", "skip", "step", "step"], (rank, out)
        for bad in out[1:3]:
            assert (bad["rank"], bad["bad_ranks"], bad["verdict"]) == (rank, [1], "reproduced"), (rank, bad)
            assert bad["finding"] is not None and bad["finding"]["rank"] == 1, (rank, bad)
        assert out[1]["finding"]["culprit"] == culprit, out[1]
        assert (out[2]["finding"]["node"], out[2]["finding"]["forward_op"]) == ("SqrtBackward0", "aten::sqrt"), out[2]
        assert math.isnan(out[1]["loss"]) == (rank == 1)  # a bad step keeps each rank's own loss
        assert math.isfinite(out[2]["loss"])
    p0, p1 = got[0][1], got[1][1]
    assert p0 == p1, "the ranks' parameters differ"
    assert all(torch.isfinite(torch.tensor(p)).all() for p in p0)


def test_guard_step_over_ddp(tmp_path):
    _check_ranks(run_ranks(_ddp_run, tmp_path, False), "a")  # the closure's parameter


def test_guard_check_over_ddp(tmp_path):
    _check_ranks(run_ranks(_ddp_run, tmp_path, True), "batch[0]")  # check(batch=[x, y]) without names


def _ddp_accumulated(rank):
    torch.manual_seed(0)
    inner = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model = torch.nn.parallel.DistributedDataParallel(inner)
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.05), policy="rollback", snapshot_every=1)
    g = torch.Generator().manual_seed(rank)
    out = []
    for step in range(1, 4):
        batches = []
        for i in range(3):
            x = torch.randn(4, 4, generator=g)
            if rank == 1 and step == 2 and i == 1:
                x[0, 0] = float("nan")
            batches.append((x, x.sum(1, keepdim=True)))
        r = guard.step_accumulated(lambda a, b: F.mse_loss(model(a), b), batches)
        out.append((r.action, r.nonfinite_ranks, r.verdict, r.finding.rank if r.finding else None))
    guard.close()
    params = [p.detach().tolist() for p in inner.parameters()]
    model = None
    return out, params


def test_accumulated_micro_batches_over_ddp_name_the_rank_the_nan_came_from(tmp_path):
    # Each micro-batch's backward all-reduces: after rank 1's bad one, rank
    # 0's .grad holds the NaN it received, yet its own gradients were finite.
    got = run_ranks(_ddp_accumulated, tmp_path)
    for rank, (out, _) in got.items():
        assert out == [("step", [], "", None), ("rollback", [1], "reproduced", 1), ("step", [], "", None)], (rank, out)
    assert got[0][1] == got[1][1]
