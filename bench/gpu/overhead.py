#!/usr/bin/env python3
"""Step-time overhead of NaN/Inf checking on a GPU: the table of issue #23.

Two workloads, built with torch.nn: nn.Embedding -> nn.TransformerEncoder
(dropout 0.1) -> mean pool -> nn.Linear to 10 classes; AdamW,
clip_grad_norm_(1.0), float32:
  reference  d=256, 4 layers, 4 heads, ff 1024, batch 16 x 64 tokens
  large      d=1024, 8 layers, 16 heads, ff 4096, batch 32 x 512 tokens

Variants, measured interleaved round-robin on one model per workload (drift
of the machine hits them all alike); each step is timed from a synchronised
device to a synchronised device:
  plain     the usual loop
  hooks     forward hooks on every module checking torch.isfinite(out).all()
  anomaly   the loop under torch.autograd.detect_anomaly()
  scaler    GradScaler's fused check: torch._amp_foreach_non_finite_check_and_unscale_
            over all gradients, then one .item() (the floor for a sentinel)
  dispatch  a TorchDispatchMode checking every op output with isfinite().all(),
            no sync until the step ends
  trace     the loop under nanguard.trace(model): every forward and backward op
  guard     nanguard.Guard(max_norm=1.0): the always-on sentinel

Prints first the census throughput at 2^26 float32 elements against
x.sum(): `gpu_census_<fn>_vs_sum: X` (above 1: faster than x.sum().item()),
then `gpu_<workload>_<variant>_ratio: X`: the median over rounds of the
variant's step time over plain's in the same round. A variant that fails is
reported (`FAILED, left out`) and the others go on.

Options: --device (default cuda), --workloads reference,large, --rounds
(reference), --large-rounds, --steps (per variant per round), --tiny (shrinks both workloads and the
census tensor, for a dry run on the CPU).
"""
import argparse
import os
import statistics
import sys
import time
import warnings

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python", "bench"))
import nanguard  # noqa: E402
from workload import WORKLOADS, paired_ratio, rotated, step_variants, synchronize, training  # noqa: E402

class CheckEveryOutput(TorchDispatchMode):
    """isfinite().all() of every floating output, kept on the device; one
    sync when the step ends (`verdict`). The outputs of allocating ops hold
    whatever the memory held before: they are not checked."""

    UNINITIALISED = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided"}

    def __init__(self):
        super().__init__()
        self.checks = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket.__name__ in self.UNINITIALISED:
            return out
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and o.numel():
                self.checks.append(torch.isfinite(o).all())
        return out

    def verdict(self):
        ok = bool(torch.stack(self.checks).all()) if self.checks else True
        self.checks.clear()
        return ok


def shrink(w):
    return dict(d=max(8, w["d"] // 16), layers=2, heads=2, ff=max(16, w["ff"] // 16), batch=2,
                tokens=max(8, w["tokens"] // 16))


def bench_workload(name, shape, device, rounds, steps):
    torch.manual_seed(0)
    model, opt, tokens, labels = training(shape, device)
    params = list(model.parameters())
    found_inf = torch.zeros(1, device=device)
    inv_scale = torch.ones(1, device=device)
    variants, loss_fn = step_variants(model, opt, tokens, labels)

    def scaler_step():
        opt.zero_grad(set_to_none=True)
        loss_fn().backward()
        found_inf.zero_()
        grads = [p.grad for p in params if p.grad is not None]
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        assert found_inf.item() == 0
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def dispatch_step():
        with CheckEveryOutput() as mode:
            variants["plain"]()
        assert mode.verdict()

    variants.update(scaler=scaler_step, dispatch=dispatch_step)

    def run(k, fn):
        """One step of variant k; a variant that fails is reported and left
        out of the rest of the run, so the others still give figures."""
        try:
            fn()
            return True
        except Exception as e:  # noqa: BLE001 (any failure: report it, go on)
            print(f"# {name} {k} FAILED, left out: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
            del variants[k]
            return False

    for k, fn in list(variants.items()):  # warm-up: allocator, kernels, autotuning
        run(k, fn)
    times = {k: [] for k in variants}
    synchronize(device)
    for r in range(rounds):
        for k, fn in rotated(variants, r):
            for _ in range(steps):
                synchronize(device)
                t0 = time.perf_counter()
                if not run(k, fn):
                    break
                synchronize(device)
                times[k].append(time.perf_counter() - t0)
    print(f"# {name}: {shape}, {rounds} rounds x {steps} steps per variant, {device}")
    for k in variants:
        print(f"# {name} {k:8s} median step {statistics.median(times[k]) * 1000:9.2f} ms")
    if "plain" in variants:
        for k in variants:
            if k != "plain":
                print(f"gpu_{name}_{k}_ratio: {paired_ratio(times[k], times['plain'])[0]:.3f}")


def median_time(fn, device, repeats):
    fn()
    out = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def bench_census(device, log2_numel, repeats):
    x = torch.randn(1 << log2_numel, device=device)
    grads = list(x.split(1 << max(0, log2_numel - 8)))  # 256 tensors, one call
    fns = {
        "sum": lambda: x.sum().item(),
        "isfinite_all": lambda: bool(torch.isfinite(x).all()),
        "has_nonfinite": lambda: nanguard.has_nonfinite(x),
        "census": lambda: nanguard.census(x),
        "check_many_256": lambda: nanguard.check_many(grads),
        "census_many_256": lambda: nanguard.census_many(grads),
    }
    t = {k: median_time(fn, device, repeats) for k, fn in fns.items()}
    gbs = lambda s: x.numel() * x.element_size() / s / 1e9
    print(f"# census of 2^{log2_numel} float32 on {device}, median of {repeats}")
    for k, s in t.items():
        print(f"# {k:16s} {s * 1000:8.3f} ms  {gbs(s):8.1f} GB/s")
    for k in fns:
        if k != "sum":
            print(f"gpu_census_{k}_vs_sum: {t['sum'] / t[k]:.3f}")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--workloads", default="reference,large")
    p.add_argument("--rounds", type=int, default=20, help="rounds of the reference workload")
    p.add_argument("--large-rounds", type=int, default=12, help="rounds of the large one (~5 s each on an H200)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="shrink everything (a dry run on the CPU)")
    a = p.parse_args()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("overhead.py: no CUDA device found; pass --device cpu --tiny for a dry run", file=sys.stderr)
        return 2
    warnings.filterwarnings("ignore")
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 as the table
    print(f"# torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}")
    # The census first: quick, and its figures do not wait on the workloads.
    bench_census(device, 16 if a.tiny else 26, 5 if a.tiny else 50)
    for name in a.workloads.split(","):
        shape = shrink(WORKLOADS[name]) if a.tiny else WORKLOADS[name]
        rounds = min(a.rounds, a.large_rounds) if name == "large" else a.rounds
        bench_workload(name, shape, device, rounds, a.steps)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
