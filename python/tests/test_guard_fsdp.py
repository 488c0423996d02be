"""nanguard.Guard over an FSDP2 model (fully_shard on a CPU device mesh, Gloo,
two ranks): the sentinel reads the local gradient shards, the norm is
global, a NaN born on rank 1 makes every rank skip the step and names rank
1 and the op (the replay runs on both ranks: FSDP all-gathers in forward),
and the full parameters stay bit-identical; a rollback restores the local
shards."""
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanguard
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo")


def _sharded_model():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)  # the same model on both ranks
    # 5 rows: uneven shards (3 + 2).
    model = torch.nn.Sequential(torch.nn.Linear(4, 5), torch.nn.Tanh(), torch.nn.Linear(5, 1))
    mesh = init_device_mesh("cpu", (2,))
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _fsdp_run(rank, policy):
    model = _sharded_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    guard = nanguard.Guard(model, opt, policy=policy, max_norm=1.0, snapshot_every=1)
    g = torch.Generator().manual_seed(rank)
    out = []
    for step in range(1, 6):
        x = torch.randn(16, 4, generator=g)
        y = x.sum(1, keepdim=True)
        if rank == 1 and step == 2:
            x[3, 1] = float("nan")

        def loss_fn(a, b, step=step):
            out = model(a)
            loss = F.mse_loss(out, b)
            if rank == 1 and step == 3:
                loss = loss + torch.sqrt(out.sum() * 0)  # NaN born in backward (a gradient of sqrt at 0)
            return loss

        r = guard.step(loss_fn, x, y)
        out.append({"action": r.action, "rank": r.rank, "bad_ranks": r.nonfinite_ranks, "verdict": r.verdict,
                    "finding": r.finding.to_dict() if r.finding else None, "loss": r.loss,
                    "grad_norm": r.grad_norm, "note": r.note})
    guard.close()
    full = [p.full_tensor().tolist() for p in model.parameters()]  # no shared storage across processes
    return out, full


@pytest.mark.parametrize("policy", ["skip", "rollback"])
def test_guard_over_fsdp2(tmp_path, policy):
    got = run_ranks(_fsdp_run, tmp_path, policy)
    for rank, (out, _) in got.items():
        assert [o["action"] for o in out] == ["step", policy, policy, "step", "step"], (rank, out)
        for bad in out[1:3]:
            assert (bad["rank"], bad["bad_ranks"], bad["verdict"]) == (rank, [1], "reproduced"), (rank, bad)
            assert bad["finding"]["rank"] == 1, bad
        assert out[1]["finding"]["culprit"] == "a", out[1]
        assert (out[2]["finding"]["node"], out[2]["finding"]["forward_op"]) == ("SqrtBackward0", "aten::sqrt"), out[2]
        if rank == 0:
            assert "received from rank 1 via reduce-scatter" in out[2]["note"], out[2]
    # One global norm: the same on both ranks.
    assert [o["grad_norm"] for o in got[0][0] if o["action"] == "step"] == \
           [o["grad_norm"] for o in got[1][0] if o["action"] == "step"]
    p0, p1 = got[0][1], got[1][1]
    assert p0 == p1, "the ranks' full parameters differ"
    assert all(torch.isfinite(torch.tensor(p)).all() for p in p0)


def _snapshot_of_a_shard(rank):
    from nanguard._hosts import ShardedHost
    model = _sharded_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 1)).backward()
    opt.step()  # Adam's state: two tensors per parameter, sharded like it
    host = ShardedHost(model, opt)
    (model_state, opt_state), _ = host.save()
    held = sum(t.to_local().numel() if hasattr(t, "to_local") else t.numel() for t in model_state.values())
    held += sum(v.to_local().numel() if hasattr(v, "to_local") else v.numel()
                for s in opt_state["state"].values() for k, v in s.items() if k != "step")
    full = sum(p.full_tensor().numel() for p in model.parameters())
    return held, full


def test_a_snapshot_holds_only_this_rank_s_shard(tmp_path):
    """Under FSDP2 a snapshot (the parameters and Adam's two states) holds
    this rank's shards only: the ranks' together are one copy of the model."""
    got = run_ranks(_snapshot_of_a_shard, tmp_path)
    full = got[0][1]
    for rank, (held, _) in got.items():
        assert held < 3 * full, (rank, held, full)
    assert sum(held for held, _ in got.values()) == 3 * full, got
