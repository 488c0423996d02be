#!/usr/bin/env python3
"""The guard over a compiled model: step time against the compiled plain
step, and the recompiles and graph breaks nanguard causes.

Workload: workload.py's reference model (TransformerEncoder
classifier, batch 16 x 64 tokens, AdamW, clip_grad_norm_(1.0), 2 threads),
compiled with torch.compile (Inductor, default mode); `--workload large`
and `--device cuda` give the GPU figure (d=1024, 8 layers, batch 32 x 512:
Triton kernels), each step timed from a synchronised device to a
synchronised device.

Variants, measured interleaved round-robin on one compiled model, median
step time each:
  plain   the usual compiled loop: forward, backward, clip, AdamW step
  guard   nanguard.Guard(max_norm=1.0) over the compiled model

Prints `py_compiled_guard_ratio` (and `_ci95`, `_cpu_ratio`) as
bench_overhead.py does (`gpu_large_compiled_guard_ratio` for the large
workload on a GPU, see figure_prefix), then `compiled_recompiles` and
`compiled_graph_breaks`: what Dynamo's counters gained from the first guarded
step on (two plain steps compiled the model before it), 0 when nanguard
neither recompiles nor breaks the graph. `compiled_guard_replay_recompiles` is the same after a
bad step that the guard replays eagerly.
Environment: NANGUARD_BENCH_ROUNDS (default 30), NANGUARD_BENCH_STEPS (2).
"""
import argparse
import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters
from torch.utils._triton import has_triton

import nanguard
from workload import WORKLOADS, paired_ratio, settings, step_variants, synchronize, timed_rounds, training


def dynamo_counts():
    """(graphs compiled, graph breaks) so far in this process."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def synchronised(fn, device):
    """`fn` followed by a wait for the device's queued work (on a GPU)."""
    def step():
        fn()
        synchronize(device)

    return step


def figure_prefix(device, workload):
    """"py_" for the reference workload on the CPU (the figure of
    docs/performance.md), else "<device>_<workload>_" ("gpu_large_")."""
    if (device.type, workload) == ("cpu", "reference"):
        return "py_"
    return f"{'gpu' if device.type == 'cuda' else device.type}_{workload}_"


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="reference")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not has_triton():
        print("bench_compile: no working Triton here, so Inductor cannot compile for the GPU: no figure",
              file=sys.stderr)
        return 2
    rounds, steps = settings(rounds=30, steps=2)
    eager, opt, tokens, labels = training(WORKLOADS[a.workload], device)
    model = torch.compile(eager)
    every, loss = step_variants(model, opt, tokens, labels)
    variants = {k: synchronised(every[k], device) for k in ("plain", "guard")}
    t0 = time.perf_counter()
    variants["plain"]()  # compiles forward and backward
    print(f"# first compiled step (compiling) {time.perf_counter() - t0:.1f} s")
    variants["plain"]()
    before = dynamo_counts()
    variants["guard"]()
    times, cpu_times = timed_rounds(variants, rounds, steps, before_step=lambda: synchronize(device))
    after = dynamo_counts()
    bad = nanguard.Guard(model, opt).step(lambda: loss() * float("nan"))  # replayed eagerly
    assert bad.skipped and bad.verdict == "reproduced", bad
    variants["guard"]()
    after_replay = dynamo_counts()
    prefix = figure_prefix(device, a.workload)
    print(f"# {a.workload} workload compiled (Inductor) on {device.type}, {rounds} rounds x {steps} steps "
          f"per variant, 2 threads, torch {torch.__version__}")
    for k, v in times.items():
        print(f"# {k:8s} median step {statistics.median(v) * 1000:8.1f} ms  (min {min(v) * 1000:.1f} ms)")
    for key, samples in (("ratio", times), ("cpu_ratio", cpu_times)):
        ratio, low, high = paired_ratio(samples["guard"], samples["plain"])
        print(f"{prefix}compiled_guard_{key}: {ratio:.3f}")
        print(f"{prefix}compiled_guard_{key}_ci95: {low:.3f}..{high:.3f}")
    print(f"compiled_recompiles: {after[0] - before[0]}")
    print(f"compiled_graph_breaks: {after[1] - before[1]}")
    print(f"compiled_guard_replay_recompiles: {after_replay[0] - after[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
