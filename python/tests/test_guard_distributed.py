"""nanguard.Guard(distributed=True) on two Gloo ranks (two processes): the
C++ guard's consensus from Python. The gradients are averaged, a NaN in
rank 1's batch makes every rank skip the step, and both ranks' results
name rank 1 and its finding; the parameters stay equal on both ranks."""
import math
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import nanguard

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo")


def _rank_main(rank, store, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    try:
        torch.manual_seed(0)  # the same model on both ranks
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
        guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.05), distributed=True)
        g = torch.Generator().manual_seed(rank)  # each rank its own data
        out = []
        for step in range(1, 5):
            x = torch.randn(16, 4, generator=g)
            y = x.sum(1, keepdim=True)
            if rank == 1 and step == 2:
                x[3, 1] = float("nan")
            r = guard.step(lambda a, b: F.mse_loss(model(a), b), x, y)  # tensors as arguments: named a, b
            out.append((r.step, r.action, r.rank, r.nonfinite_ranks,
                        r.finding.to_dict() if r.finding is not None else None, r.loss))
        results.put((rank, out, [p.detach().tolist() for p in model.parameters()]))
    finally:
        dist.destroy_process_group()


def test_every_rank_skips_the_step_one_rank_saw_a_nan_in(tmp_path):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = mp.spawn(_rank_main, args=(str(tmp_path / "store"), results), nprocs=2, join=False)
    got = {}
    while len(got) < 2:
        try:
            rank, out, params = results.get(timeout=1)
            got[rank] = (out, params)
        except queue.Empty:
            ranks.join(timeout=0)  # raises when a rank failed
    while not ranks.join():
        pass
    for rank, (out, _) in got.items():
        assert [o[1] for o in out] == ["step", "skip", "step", "step"], (rank, out)
        step, _, own_rank, bad_ranks, finding, _ = out[1]
        assert (step, own_rank, bad_ranks) == (2, rank, [1])
        assert finding is not None and finding["rank"] == 1 and finding["culprit"] == "a", finding
        assert math.isnan(out[1][5]) == (rank == 1)  # a bad step keeps each rank's own loss
    assert got[0][1] == got[1][1], "the ranks' parameters differ: the gradients were not averaged"
