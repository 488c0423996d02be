"""What the Python step benchmarks share (bench_overhead.py, step_resources.py,
bench_integrations.py and bench/gpu/overhead.py): the reference model, the
training step each checking tool is compared in, the round-robin order of
the variants and the paired ratio they print."""
import math
import os
import statistics
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard


class Model(nn.Module):
    """The reference TransformerEncoder classifier: nn.Embedding(vocab, d) ->
    nn.TransformerEncoder (dropout 0.1) -> mean pool -> nn.Linear(d, classes).
    The defaults are the reference workload's (d=256, 4 layers, 4 heads, ff
    1024)."""

    def __init__(self, d=256, layers=4, heads=4, ff=1024, vocab=1000, classes=10):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens):
        return self.head(self.encoder(self.embed(tokens)).mean(1))


REFERENCE = dict(d=256, layers=4, heads=4, ff=1024, batch=16, tokens=64)
LARGE = dict(d=1024, layers=8, heads=16, ff=4096, batch=32, tokens=512)
#: The workloads by name: the reference one, and the large one of the GPU figures.
WORKLOADS = {"reference": REFERENCE, "large": LARGE}


def settings(rounds, steps):
    """Two threads, seed 0, warnings off; returns (rounds, steps):
    NANGUARD_BENCH_ROUNDS and NANGUARD_BENCH_STEPS, else these defaults."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    return (int(os.environ.get("NANGUARD_BENCH_ROUNDS", str(rounds))),
            int(os.environ.get("NANGUARD_BENCH_STEPS", str(steps))))


def training(shape=REFERENCE, device="cpu"):
    """(model, optimizer, tokens, labels) of a workload of `shape`'s sizes:
    the Model in training mode, AdamW(lr=1e-4), a batch of random tokens
    and class labels."""
    model = Model(shape["d"], shape["layers"], shape["heads"], shape["ff"]).to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, 1000, (shape["batch"], shape["tokens"]), device=device)
    labels = torch.randint(0, 10, (shape["batch"],), device=device)
    return model, opt, tokens, labels


def step_variants(model, opt, tokens, labels, guard=None):
    """One training step of `model` (cross entropy, clip_grad_norm_(1.0),
    `opt`) per checking tool, by name, the baseline first:
      plain     the usual loop
      hooks     forward hooks on every module checking torch.isfinite(out).all()
      anomaly   the loop under torch.autograd.detect_anomaly()
      trace     the loop under nanguard.trace(model): every forward and backward op checked
      guard     nanguard.Guard(max_norm=1.0): sentinel on, tracing on failure only
    plus `loss`, the loss closure they step on. `guard` is the guard
    variant's Guard (default: a new one)."""
    params = list(model.parameters())
    if guard is None:
        guard = nanguard.Guard(model, opt, max_norm=1.0)

    def loss():
        return F.cross_entropy(model(tokens), labels)

    def plain():
        opt.zero_grad(set_to_none=True)
        loss().backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()

    def check(module, args, out):
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor) and o.is_floating_point() and not torch.isfinite(o).all():
                raise RuntimeError(f"non-finite output in {type(module).__name__}")

    def hooks():
        handles = [m.register_forward_hook(check) for m in model.modules()]
        try:
            plain()
        finally:
            for h in handles:
                h.remove()

    def anomaly():
        with torch.autograd.detect_anomaly():
            plain()

    def trace():
        with nanguard.trace(model, raise_on_finding=True):
            plain()

    def guarded():
        r = guard.step(loss)
        assert r.action == "step", r

    return {"plain": plain, "hooks": hooks, "anomaly": anomaly, "trace": trace, "guard": guarded}, loss


def synchronize(device):
    """Waits for the work queued on `device` (a GPU; nothing on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def rotated(variants, round_index):
    """The (name, step) pairs of `variants` in round `round_index`'s order:
    who goes first rotates, so that drift of the machine hits them all alike."""
    order = list(variants.items())
    k = round_index % len(order)
    return order[k:] + order[:k]


def timed_rounds(variants, rounds, steps, before_step=lambda: None):
    """Runs `steps` steps of each variant per round, in rotated() order, for
    `rounds` rounds; returns ({name: wall seconds of each step}, {name: the
    main thread's CPU seconds of each step}). `before_step` runs untimed
    before each step (e.g. a barrier)."""
    times = {k: [] for k in variants}
    cpu_times = {k: [] for k in variants}
    for r in range(rounds):
        for name, fn in rotated(variants, r):
            for _ in range(steps):
                before_step()
                t0, c0 = time.perf_counter(), time.thread_time()
                fn()
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.thread_time() - c0)
    return times, cpu_times


def paired_ratio(variant, baseline):
    """Median of the per-step ratios variant/baseline (steps of the same
    round and index pair up), with a 95% distribution-free interval:
    (median, low, high)."""
    r = sorted(v / b for v, b in zip(variant, baseline))
    n = len(r)
    half_width = 0.98 * math.sqrt(n)  # 1.96 sigma of Binomial(n, 1/2)
    at = lambda k: r[min(max(int(k), 0), n - 1)]
    return statistics.median(r), at(math.floor(n / 2 - half_width)), at(math.ceil(n / 2 + half_width) - 1)
