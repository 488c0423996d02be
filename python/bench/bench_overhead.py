#!/usr/bin/env python3
"""Step-time overhead of NaN/Inf checking in PyTorch training, on the
reference workload built with torch.nn.

Workload: nn.Embedding(1000, 256) -> 4-layer nn.TransformerEncoder (d=256,
4 heads, ff=1024, dropout 0.1) -> mean pool -> nn.Linear(256, 10); batch
16 x 64 tokens, AdamW, clip_grad_norm_(1.0), torch.set_num_threads(2).

Variants (workload.step_variants: plain, hooks, anomaly, trace, guard),
measured interleaved round-robin on one model (so drift of the machine hits
them all alike), median step time each.

Prints `py_<variant>_ratio: X` lines: the median over rounds of the ratio
of the variant's step time to plain's in the same round (slow phases of a
shared machine cancel), and `py_<variant>_ratio_ci95: low..high`, a 95%
distribution-free interval for it. `py_<variant>_cpu_ratio` is the same
for the main thread's CPU time (`time.thread_time()`), where the checks
run: other tenants of a shared machine move it less than the wall time.
Environment: NANGUARD_BENCH_ROUNDS (default 30: with fewer the median moves
by ±2% from run to run on a shared VM), NANGUARD_BENCH_STEPS per variant per
round (default 2).
"""
import statistics
import sys

import torch

from workload import paired_ratio, settings, step_variants, timed_rounds, training


def main():
    rounds, steps = settings(rounds=30, steps=2)
    model, opt, tokens, labels = training()
    variants, _ = step_variants(model, opt, tokens, labels)
    for fn in variants.values():  # warm-up
        fn()
    times, cpu_times = timed_rounds(variants, rounds, steps)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"# reference workload, {rounds} rounds x {steps} steps per variant, 2 threads, torch {torch.__version__}")
    for k, v in med.items():
        print(f"# {k:8s} median step {v * 1000:8.1f} ms  (min {min(times[k]) * 1000:.1f} ms)")
    for k in ("hooks", "anomaly", "trace", "guard"):
        for key, samples in (("ratio", times), ("cpu_ratio", cpu_times)):
            ratio, low, high = paired_ratio(samples[k], samples["plain"])
            print(f"py_{k}_{key}: {ratio:.3f}")
            print(f"py_{k}_{key}_ci95: {low:.3f}..{high:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
