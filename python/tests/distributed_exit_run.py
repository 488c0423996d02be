"""Two Gloo ranks of DDP + begin_step/check that end as users write them:
destroy_process_group with the guard still open (and alive until the
interpreter's exit, as in a script written at the top level), then the exit (run by test_distributed_exit.py as `python distributed_exit_run.py
STORE`; a rank that dies dies with the run's exit code). With
`--dead-rank`, rank 1 dies at step 3 and rank 0 prints the error its step
raised: `--loop check` (the default) as above, `--loop step` the DDP model
under guard.step, `--loop plain` an unwrapped model under
Guard(distributed=True) and guard.step."""
import datetime
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import nanguard

#: What a script at the top level keeps until the interpreter exits.
KEPT = []


def main(rank, store, dead_rank, loop):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=10))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    if loop != "plain":
        model = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    guard = nanguard.Guard(model, opt, distributed=True if loop == "plain" else None)
    KEPT.append((guard, model))
    for step in range(1, 5):
        x = torch.randn(8, 4)
        if rank == 1 and step == 2:
            x[0, 0] = float("nan")
        if dead_rank and rank == 1 and step == 3:
            os._exit(3)
        try:
            if loop == "check":
                guard.begin_step()
                opt.zero_grad()
                loss = model(x).sum()
                loss.backward()
                guard.check(loss, replay=lambda: model(x).sum(), batch=[x])
                opt.step()
            else:
                guard.step(lambda b: model(b).sum(), x)
        except RuntimeError as e:
            print(f"rank {rank} step {step}: {type(e).__name__}: {e}".splitlines()[0], flush=True)
            os._exit(4)
    dist.destroy_process_group()


if __name__ == "__main__":
    # Every rank is joined: spawn's own join ends rank 0 with SIGTERM as soon
    # as rank 1 dies, before rank 0 can report the error its step raised.
    loop = sys.argv[sys.argv.index("--loop") + 1] if "--loop" in sys.argv else "check"
    ranks = mp.spawn(main, args=(sys.argv[1], "--dead-rank" in sys.argv, loop), nprocs=2, join=False)
    for p in ranks.processes:
        p.join()
    sys.exit(next((p.exitcode for p in ranks.processes if p.exitcode), 0))
