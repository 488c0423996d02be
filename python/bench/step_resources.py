#!/usr/bin/env python3
"""Where a traced step's extra time goes: wall time, user and system CPU
time and minor page faults per step of the reference workload
(workload.py's model and steps), plain and under nanguard.trace(model),
interleaved step by step.

Prints `<variant>_wall_ms`, `_user_ms`, `_sys_ms` and `_page_faults`
(means over the steps). Environment: NANGUARD_BENCH_STEPS (default 30).
Run with glibc's thresholds fixed to take its allocator's dynamics out:
MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4000000000.
"""
import resource
import sys
import time

from workload import settings, step_variants, training


def main():
    _, steps = settings(rounds=0, steps=30)
    model, opt, tokens, labels = training()
    steps_of, _ = step_variants(model, opt, tokens, labels)
    variants = {k: steps_of[k] for k in ("plain", "trace")}
    for fn in variants.values():  # warm-up
        fn()
        fn()
    totals = {k: [0.0, 0.0, 0.0, 0] for k in variants}
    for _ in range(steps):
        for name, fn in variants.items():
            before, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            fn()
            wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
            total = totals[name]
            total[0] += wall
            total[1] += after.ru_utime - before.ru_utime
            total[2] += after.ru_stime - before.ru_stime
            total[3] += after.ru_minflt - before.ru_minflt
    for name, (wall, user, system, faults) in totals.items():
        print(f"{name}_wall_ms: {wall / steps * 1e3:.1f}")
        print(f"{name}_user_ms: {user / steps * 1e3:.1f}")
        print(f"{name}_sys_ms: {system / steps * 1e3:.1f}")
        print(f"{name}_page_faults: {faults / steps:.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
