#!/usr/bin/env python3
"""Step-time overhead of nanguard.Guard over DistributedDataParallel and
over FSDP2 (fully_shard), 2 Gloo ranks on 127.0.0.1, on the reference
workload (workload.Model: 4-layer TransformerEncoder d=256, batch 16 x 64
tokens per rank, AdamW, clip_grad_norm_(1.0)), one thread per rank.

For each wrapper, the plain step (zero_grad, forward, backward,
clip_grad_norm_, optimizer.step) and guard.step(max_norm=1.0) run
interleaved round-robin on one model, the same order on both ranks (so the
collectives pair up), each step after a barrier. Rank 0 prints `py_ddp_guard_ratio: X` and
`py_fsdp2_guard_ratio: X`: the median over steps of the guarded step's
time over the plain step's of the same round, with a 95% interval.
Environment: NANGUARD_BENCH_ROUNDS (default 20), NANGUARD_BENCH_STEPS per
variant per round (default 2).
"""
import datetime
import os
import sys
import tempfile
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import Model, paired_ratio, step_variants, timed_rounds  # noqa: E402

import nanguard  # noqa: E402


def wrapped(kind):
    torch.manual_seed(0)
    model = Model().train()
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.encoder.layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def measure(kind, rounds, steps):
    """Per-step seconds of the plain and the guarded step, interleaved."""
    model = wrapped(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, 1000, (16, 64), generator=g)
    labels = torch.randint(0, 10, (16,), generator=g)
    guard = nanguard.Guard(model, opt, max_norm=1.0)
    every, _ = step_variants(model, opt, tokens, labels, guard)
    variants = {k: every[k] for k in ("plain", "guard")}
    for fn in variants.values():  # warm-up
        fn()
    times, _ = timed_rounds(variants, rounds, steps, before_step=dist.barrier)
    guard.close()
    return times


def rank_main(rank, store, rounds, steps):
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo", init_method="file://" + store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    try:
        for kind in ("ddp", "fsdp2"):
            t = measure(kind, rounds, steps)
            if rank == 0:
                ratio, low, high = paired_ratio(t["guard"], t["plain"])
                print(f"py_{kind}_plain_step_s: {sorted(t['plain'])[len(t['plain']) // 2]:.4f}")
                print(f"py_{kind}_guard_ratio: {ratio:.4f}")
                print(f"py_{kind}_guard_ratio_ci95: {low:.4f}..{high:.4f}", flush=True)
    finally:
        dist.destroy_process_group()


def main():
    rounds = int(os.environ.get("NANGUARD_BENCH_ROUNDS", "20"))
    steps = int(os.environ.get("NANGUARD_BENCH_STEPS", "2"))
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(rank_main, args=(os.path.join(d, "store"), rounds, steps), nprocs=2)


if __name__ == "__main__":
    main()
