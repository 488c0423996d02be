"""Runs a function on several Gloo ranks of a real process group: spawned
processes on 127.0.0.1 that meet in a file store, as the distributed tests
need them."""
import os
import queue
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def run_ranks(target, tmp_path, *args, world_size=2, timeout=180, pg_timeout=60):
    """``{rank: target(rank, *args)}`` with ``target`` run on each of
    ``world_size`` ranks, each in its own process with the default process
    group initialized (Gloo) and destroyed after. ``target`` must be a
    module-level function (spawned processes import it) and return what
    pickles. A rank that raises fails the call with its traceback; ranks
    still running after ``timeout`` seconds are killed and the call fails."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    store = str(tmp_path / f"store-{os.getpid()}-{time.monotonic_ns()}")
    ranks = mp.spawn(_rank_main, args=(target, store, world_size, pg_timeout, args, results), nprocs=world_size,
                     join=False)
    got = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world_size:
            try:
                rank, value = results.get(timeout=1)
                got[rank] = value
            except queue.Empty:
                ranks.join(timeout=0)  # raises when a rank failed
                if time.monotonic() > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world_size)) - set(got))} still running after "
                                       f"{timeout} s")
        while not ranks.join(timeout=max(1.0, deadline - time.monotonic())):
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks still running {timeout} s after they returned their results")
    finally:
        for p in ranks.processes:
            if p.is_alive():
                p.kill()
    return got


def _rank_main(rank, target, store, world_size, pg_timeout, args, results):
    import datetime
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=pg_timeout))
    try:
        results.put((rank, target(rank, *args)))
    finally:
        dist.destroy_process_group()
