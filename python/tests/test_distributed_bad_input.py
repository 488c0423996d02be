"""A distributed Guard given what does not fit, on two Gloo ranks: a clear
error on every rank within the process group's timeout, never a hang or a
signal."""
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanguard
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo")


def _error_of(fn):
    try:
        fn()
    except Exception as e:  # the error a user would see, as text
        return f"{type(e).__name__}: {e}"
    return None


def _bad_inputs(rank):
    out = {}
    # A process group the DDP model is not on.
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    other = dist.new_group([0, 1])
    out["group"] = _error_of(lambda: nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                    distributed=other))
    model = None
    # Different models on the two ranks (an unwrapped model, distributed=True).
    net = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(1 + rank)])
    out["models"] = _error_of(lambda: nanguard.Guard(net, torch.optim.SGD(net.parameters(), lr=0.1),
                                                     distributed=True))
    # Rank 1 builds its guard but never steps: rank 0's step fails after the timeout (5 s).
    net = torch.nn.Linear(4, 1)
    guard = nanguard.Guard(net, torch.optim.SGD(net.parameters(), lr=0.1), distributed=True)
    start = time.monotonic()
    if rank == 0:
        out["no_step"] = _error_of(lambda: guard.step(lambda: F.mse_loss(net(torch.ones(2, 4)), torch.ones(2, 1))))
    else:
        time.sleep(8)
    out["no_step_s"] = time.monotonic() - start
    guard.close()
    return out


def test_a_guard_that_does_not_fit_the_ranks_fails_clearly(tmp_path):
    got = run_ranks(_bad_inputs, tmp_path, pg_timeout=5)
    for rank, out in got.items():
        assert out["group"] is not None and "ValueError" in out["group"] and "process group" in out["group"], out
        assert out["models"] is not None and "the ranks guard different models" in out["models"], out
        assert "rank 0 has 2 parameters" in out["models"] and "rank 1 has 4 parameters" in out["models"], out
    # Within the timeout (5 s) and some slack, with what to look at.
    no_step = got[0]["no_step"]
    assert no_step is not None and no_step.startswith("RuntimeError: nanguard::distributed: rank 0: the consensus "
                                                      "all-reduce of step 1 failed: no rank has exited"), got[0]
    assert "rank 1 (host " in no_step and "did not answer within the timeout" in no_step, no_step
    assert got[0]["no_step_s"] < 15, got[0]
