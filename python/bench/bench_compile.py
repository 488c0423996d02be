#!/usr/bin/env python3
"""The guard over a compiled model: step time against the compiled plain
step, and the recompiles and graph breaks nanguard causes.

Workload: workload.py's reference model (TransformerEncoder
classifier, batch 16 x 64 tokens, AdamW, clip_grad_norm_(1.0), 2 threads),
compiled with torch.compile (Inductor, default mode).

Variants, measured interleaved round-robin on one compiled model, median
step time each:
  plain   the usual compiled loop: forward, backward, clip, AdamW step
  guard   nanguard.Guard(max_norm=1.0) over the compiled model

Prints `py_compiled_guard_ratio` (and `_ci95`, `_cpu_ratio`) as
bench_overhead.py does, then `compiled_recompiles` and
`compiled_graph_breaks`: what Dynamo's counters gained from the first guarded
step on (two plain steps compiled the model before it), 0 when nanguard
neither recompiles nor breaks the graph. `compiled_guard_replay_recompiles` is the same after a
bad step that the guard replays eagerly.
Environment: NANGUARD_BENCH_ROUNDS (default 30), NANGUARD_BENCH_STEPS (2).
"""
import statistics
import sys
import time

import torch
from torch._dynamo.utils import counters

import nanguard
from workload import paired_ratio, settings, step_variants, timed_rounds, training


def dynamo_counts():
    """(graphs compiled, graph breaks) so far in this process."""
    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def main():
    rounds, steps = settings(rounds=30, steps=2)
    eager, opt, tokens, labels = training()
    model = torch.compile(eager)
    every, loss = step_variants(model, opt, tokens, labels)
    variants = {k: every[k] for k in ("plain", "guard")}
    t0 = time.perf_counter()
    variants["plain"]()  # compiles forward and backward
    print(f"# first compiled step (compiling) {time.perf_counter() - t0:.1f} s")
    variants["plain"]()
    before = dynamo_counts()
    variants["guard"]()
    times, cpu_times = timed_rounds(variants, rounds, steps)
    after = dynamo_counts()
    bad = nanguard.Guard(model, opt).step(lambda: loss() * float("nan"))  # replayed eagerly
    assert bad.skipped and bad.verdict == "reproduced", bad
    variants["guard"]()
    after_replay = dynamo_counts()
    print(f"# reference workload compiled (Inductor), {rounds} rounds x {steps} steps per variant, 2 threads, "
          f"torch {torch.__version__}")
    for k, v in times.items():
        print(f"# {k:8s} median step {statistics.median(v) * 1000:8.1f} ms  (min {min(v) * 1000:.1f} ms)")
    for key, samples in (("ratio", times), ("cpu_ratio", cpu_times)):
        ratio, low, high = paired_ratio(samples["guard"], samples["plain"])
        print(f"py_compiled_guard_{key}: {ratio:.3f}")
        print(f"py_compiled_guard_{key}_ci95: {low:.3f}..{high:.3f}")
    print(f"compiled_recompiles: {after[0] - before[0]}")
    print(f"compiled_graph_breaks: {after[1] - before[1]}")
    print(f"compiled_guard_replay_recompiles: {after_replay[0] - after[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
