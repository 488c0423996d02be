"""A trace on two DistributedDataParallel ranks (Gloo, two processes):
gradients average as without it, and a trace on rank 0 sees the NaN that
rank 1 sends through the all-reduce, which writes the gradient bucket on
Gloo's thread without a version bump (the tracer marks c10d's tensors)."""
import queue

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nanguard

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo")


def _rank_main(rank, store, nan_on_rank_1, results):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2)
    model = None
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        x = torch.full((8, 4), float(rank + 1))
        if nan_on_rank_1 and rank == 1:
            x[0, 0] = float("nan")
        with nanguard.trace(model.module, max_findings=4) as t:
            model(x).sum().backward()
        if rank == 0:
            results.put(([f.to_dict() for f in t.findings], model.module.weight.grad.tolist()))  # no shared storage
    finally:
        # The reducer must let go of the process group while the group is
        # still registered: if its destructor dropped the last reference,
        # ~ProcessGroupGloo would join Gloo's workers with the GIL held while
        # a worker waits for the GIL to release a Python callback (a hang).
        model = None
        dist.destroy_process_group()


def _run_two_ranks(tmp_path, nan_on_rank_1):
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    ranks = mp.spawn(_rank_main, args=(str(tmp_path / "store"), nan_on_rank_1, results), nprocs=2, join=False)
    # Read rank 0's result before joining: a process that put data on a
    # queue exits only once the data has gone down the pipe.
    while True:
        try:
            findings, grad = results.get(timeout=1)
            break
        except queue.Empty:
            if ranks.join(timeout=0):  # raises when a rank failed
                findings, grad = results.get(timeout=5)  # the last word of a rank that just ended
                break
    while not ranks.join():
        pass
    return findings, torch.tensor(grad)


def test_gradients_average_under_a_trace(tmp_path):
    findings, grad = _run_two_ranks(tmp_path, nan_on_rank_1=False)
    assert findings == []
    # d(sum(w.x + b))/dw = sum of x's rows: 8 * 1 on rank 0, 8 * 2 on rank 1; averaged 12.
    assert torch.equal(grad, torch.full((1, 4), 12.0))


def test_a_trace_sees_the_nan_another_rank_sent(tmp_path):
    findings, grad = _run_two_ranks(tmp_path, nan_on_rank_1=True)
    assert torch.isnan(grad).any()
    assert findings, "rank 1's NaN reached rank 0's gradient unseen"
    # It came in through the all-reduce: the reducer's copy into the
    # gradient is handed it, and makes nothing.
    first = findings[0]
    assert (first["op"], first["role"]) == ("aten::copy_", "input"), first
    assert first["caller"] == "torch.distributed.ddp.reducer::copy_bucket_to_grad"
    # Named as what it is: another rank's values, received through the
    # all-reduce, not data this rank was fed (#38).
    assert first["culprit"] == "received via all-reduce", first
    assert first["diagnosis"]["cause"] != "bad_data", first
