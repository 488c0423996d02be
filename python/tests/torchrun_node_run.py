"""One worker of a two-node torchrun job (run by test_torchrun_nodes.py: two
`torchrun --nnodes=2 --node-rank=K` agents on 127.0.0.1 with a c10d
rendezvous): a DDP model under nanguard.Guard, a NaN in rank 1's batch at
step 2; writes OUT_DIR/result-RANK.json. With `--dead-rank`, rank 1 dies
at step 3 and rank 0 prints the error its step raised."""
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import nanguard


def main(out, dead_rank):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))  # torchrun's environment
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1))
    g = torch.Generator().manual_seed(rank)
    results = []
    for step in range(1, 5):
        x = torch.randn(8, 4, generator=g)
        if rank == 1 and step == 2:
            x[0, 0] = float("nan")
        if dead_rank and rank == 1 and step == 3:
            os._exit(3)
        try:
            r = guard.step(lambda a: F.mse_loss(model(a), a.sum(1, keepdim=True)), x)
        except RuntimeError as e:
            print(f"rank {rank} step {step}: {e}".splitlines()[0], flush=True)
            sys.exit(4)
        results.append({"action": r.action, "bad_ranks": r.nonfinite_ranks,
                        "finding_rank": r.finding.rank if r.finding else -1,
                        "finding": (r.finding.op, r.finding.role) if r.finding else None})
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump({"steps": results, "params": [p.detach().tolist() for p in model.parameters()]}, f)
    guard.close()
    model = None
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], "--dead-rank" in sys.argv)
