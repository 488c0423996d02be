#!/usr/bin/env python3
"""Step-time overhead of NaN/Inf checking in PyTorch training, on the
reference workload built with torch.nn.

Workload: nn.Embedding(1000, 256) -> 4-layer nn.TransformerEncoder (d=256,
4 heads, ff=1024, dropout 0.1) -> mean pool -> nn.Linear(256, 10); batch
16 x 64 tokens, AdamW, clip_grad_norm_(1.0), torch.set_num_threads(2).

Variants, measured interleaved round-robin on one model (so drift of the
machine hits them all alike), median step time each:
  plain     the usual loop
  hooks     forward hooks on every module checking torch.isfinite(out).all()
  anomaly   the loop under torch.autograd.detect_anomaly()
  trace     the loop under nanguard.trace(model): every forward and backward op checked
  guard     nanguard.Guard(max_norm=1.0): sentinel on, tracing on failure only

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
import math
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard


class Model(nn.Module):
    """The reference TransformerEncoder classifier."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(1000, 256)
        layer = nn.TransformerEncoderLayer(256, 4, dim_feedforward=1024, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 4)
        self.head = nn.Linear(256, 10)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


def paired_ratio(variant, baseline):
    """Median of the per-step ratios variant/baseline (steps of the same
    round and index pair up), with a 95% order-statistic interval."""
    r = sorted(v / b for v, b in zip(variant, baseline))
    n = len(r)
    half_width = 0.98 * math.sqrt(n)  # 1.96 sigma of Binomial(n, 1/2)
    at = lambda k: r[min(max(int(k), 0), n - 1)]
    return statistics.median(r), at(math.floor(n / 2 - half_width)), at(math.ceil(n / 2 + half_width) - 1)


def main():
    torch.set_num_threads(2)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    rounds = int(os.environ.get("NANGUARD_BENCH_ROUNDS", "30"))
    steps = int(os.environ.get("NANGUARD_BENCH_STEPS", "2"))
    model = Model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 1000, (16, 64))
    labels = torch.randint(0, 10, (16,))
    guard = nanguard.Guard(model, opt, max_norm=1.0)

    def loss_fn():
        return F.cross_entropy(model(tokens), labels)

    def plain_step():
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    def check(module, args, out):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for o in outs:
            if isinstance(o, torch.Tensor) and o.is_floating_point() and not torch.isfinite(o).all():
                raise RuntimeError(f"non-finite output in {type(module).__name__}")

    def hooks_step():
        handles = [m.register_forward_hook(check) for m in model.modules()]
        try:
            plain_step()
        finally:
            for h in handles:
                h.remove()

    def anomaly_step():
        with torch.autograd.detect_anomaly():
            plain_step()

    def trace_step():
        with nanguard.trace(model, raise_on_finding=True):
            plain_step()

    def guard_step():
        r = guard.step(loss_fn)
        assert r.action == "step", r

    variants = {"plain": plain_step, "hooks": hooks_step, "anomaly": anomaly_step,
                "trace": trace_step, "guard": guard_step}
    times = {k: [] for k in variants}
    cpu_times = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        fn()
    for r in range(rounds):
        order = list(variants.items())
        order = order[r % len(order):] + order[:r % len(order)]  # rotate who goes first
        for name, fn in order:
            for _ in range(steps):
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.thread_time() - c0)
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
