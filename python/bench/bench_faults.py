#!/usr/bin/env python3
"""The fault campaign (make bench-faults): what nanguard.Guard detects of
planted faults and how it classifies them, hardware or software
(docs/hardware-or-software.md), on the reference workload (workload.Model,
d=256, 4 layers; batch 16 x 64 tokens; AdamW; a per-sample weight, the
batch's float tensor).

Part 1, 2 Gloo ranks on 127.0.0.1 (Guard(distributed=True): the guard
averages the gradients): each trial makes a Guard, takes one clean step and
plants one fault on one rank at the next step. The faults: transient and
persistent NaN, Inf and exponent bit flips in the output of an op, forward
and backward (Guard.inject); a NaN in a sample's weight (data); a planted
model bug, a log of 0 when a rare token comes (model). A fault is harmful
when its step came out non-finite; it is detected when the guard acted
before the optimizer stepped on it (skipped, redone, or stopped); its class
is the event's `fault`.
Part 2, one process, one long run (the spike windows filled): finite
faults in the pooled features (aten::mean), a value scaled by 1e4 (a loss
spike: the spike replay) and by 1.01 (too small to spike: the audit,
audit_every=1), transient.
Part 3: 500 healthy steps in one process (replay_spikes on): no detection.

Prints the confusion table (planted class x the guard's), then
`fault_detection_rate: X` (harmful faults detected), `fault_class_accuracy:
X` (detected ones rightly classed), `healthy_false_detections: N`,
`audit_detection_rate: X` and `audit_cost_ratio: X` (audited steps against
plain guarded steps). Environment: NANGUARD_BENCH_TRIALS (default 216).
"""
import collections
import datetime
import math
import os
import random
import sys
import tempfile
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workload import REFERENCE, Model  # noqa: E402

import nanguard  # noqa: E402

RARE_TOKEN = 999
# The ops of the reference workload that faults are planted in, by direction.
FORWARD_OPS = ["aten::addmm", "aten::_softmax", "aten::native_layer_norm", "aten::relu"]
BACKWARD_OPS = ["aten::mm", "aten::_softmax_backward_data", "aten::native_layer_norm_backward"]


class BuggyModel(Model):
    """The reference model with a planted bug: a log of 0 added to the
    embedding when the rare token comes (the model's own numerics)."""

    def forward(self, tokens):
        h = self.embed(tokens)
        rare = (tokens == RARE_TOKEN).any(1, keepdim=True).unsqueeze(-1).to(h.dtype)
        h = h + torch.log(1 - rare)  # log(0) = -inf on a sample holding the rare token
        return self.head(self.encoder(h).mean(1))


def batch(seed, rank):
    g = torch.Generator().manual_seed(seed * 7 + rank)
    tokens = torch.randint(0, RARE_TOKEN - 1, (REFERENCE["batch"], REFERENCE["tokens"]), generator=g)
    labels = torch.randint(0, 10, (REFERENCE["batch"],), generator=g)
    return tokens, labels, torch.ones(REFERENCE["batch"])


def loss_fn(model):
    def loss(tokens, labels, weight):
        return (F.cross_entropy(model(tokens), labels, reduction="none") * weight).mean()
    return loss


def trials(n, world):
    """The campaign's faults, the same list on every rank: (planted class, spec or None, rank)."""
    rnd = random.Random(5)
    plan = []
    for i in range(n):
        rank = rnd.randrange(world)
        kind = ["nan", "inf", "bit_flip"][i % 3]
        if i % 9 == 7:
            plan.append(("data", None, rank))
        elif i % 9 == 8:
            plan.append(("model", None, rank))
        else:
            mode = "transient" if i % 2 == 0 else "persistent"
            direction = "backward" if (i // 2) % 2 else "forward"
            op = rnd.choice(BACKWARD_OPS if direction == "backward" else FORWARD_OPS)
            spec = dict(op=op, kind=kind, mode=mode, direction=direction, rank=rank, bit=30,
                        occurrence=rnd.randrange(2), element=rnd.randrange(64))
            plan.append((mode, spec, rank))
    return plan


def one_trial(model, opt, planted, spec, fault_rank, seed, rank, bundles):
    """Runs a trial's two steps; returns (harmful, detected, class) as rank 0 sees it."""
    guard = nanguard.Guard(model, opt, policy="skip", distributed=True, verbose=False, bundle_dir=bundles,
                           max_norm=1.0)
    loss = loss_fn(model)
    if spec:
        guard.inject(step=2, **spec)
    guard.step(loss, *batch(seed, rank))
    tokens, labels, weight = batch(seed + 100_000, rank)
    if rank == fault_rank and planted == "data":
        weight[3] = float("nan")
    if rank == fault_rank and planted == "model":
        tokens[5, 7] = RARE_TOKEN
    try:
        r = guard.step(loss, tokens, labels, weight)
    except nanguard.NonFiniteError as stop:  # a persistent fault stops the run
        r = stop.result
    guard.close()
    harmful = r.verdict != "" or r.skipped or r.action == "abort" or r.fault != ""
    detected = r.skipped or r.fault == "transient" or r.action == "abort"
    return harmful, detected, r.fault


def distributed_part(rank, world, n, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ["NANGUARD_BENCH_PORT"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    model = BuggyModel().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    rows = []
    with tempfile.TemporaryDirectory() as bundles:
        for i, (planted, spec, fault_rank) in enumerate(trials(n, world)):
            rows.append((planted,) + one_trial(model, opt, planted, spec, fault_rank, i, rank, bundles))
    if rank == 0:
        torch.save(rows, out)
    dist.destroy_process_group()


def single_process_part(trials_each):
    """Finite faults in one long run (spike replay; audit) and healthy steps: (rows, false detections, audit cost)."""
    torch.set_num_threads(2)
    torch.manual_seed(0)
    model = Model().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    loss = loss_fn(model)
    rows, step = [], 0

    def run(guard, n, plant=None):
        nonlocal step
        results = []
        for k in range(n):
            step_no = guard.steps + 1
            if plant and k == n - 1:
                guard.inject(step=step_no, **plant)
            results.append(guard.step(loss, *batch(step, 0)))
            step += 1
        return results

    healthy = nanguard.Guard(model, opt, verbose=False, max_norm=1.0)
    false_detections = sum(r.skipped or r.fault != "" for r in run(healthy, 500))
    spike = nanguard.Guard(model, opt, verbose=False, max_norm=1.0)
    run(spike, 30)
    for i in range(trials_each):
        r = run(spike, 4, dict(op="aten::mean", kind="scale", factor=1e4, element=i % 64))[-1]
        rows.append(("transient", bool(r.spikes) or r.fault != "", r.fault == "transient", r.fault))
    spike.close()
    audit = nanguard.Guard(model, opt, verbose=False, max_norm=1.0, audit_every=1)
    audit_rows = []
    for i in range(trials_each):
        r = run(audit, 2, dict(op="aten::mean", kind="scale", factor=1.01, element=i % 64))[-1]
        audit_rows.append(r.fault == "transient")
    audit.close()
    plain = nanguard.Guard(model, opt, verbose=False, max_norm=1.0)
    audited = nanguard.Guard(model, opt, verbose=False, max_norm=1.0, audit_every=1)
    times = {"plain": [], "audited": []}
    for _ in range(10):
        for name, g in (("plain", plain), ("audited", audited)):
            t0 = time.perf_counter()
            run(g, 1)
            times[name].append(time.perf_counter() - t0)
    cost = sorted(a / p for a, p in zip(times["audited"], times["plain"]))[len(times["plain"]) // 2]
    return rows, false_detections, sum(audit_rows) / len(audit_rows), cost


def main():
    n = int(os.environ.get("NANGUARD_BENCH_TRIALS", "216"))
    world = 2
    os.environ.setdefault("NANGUARD_BENCH_PORT", str(29500 + os.getpid() % 1000))
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(distributed_part, args=(world, n, out), nprocs=world, join=True)
        rows = torch.load(out)
    finite_rows, false_detections, audit_rate, audit_cost = single_process_part(24)
    rows += finite_rows
    print(f"# {len(rows)} planted faults ({n} on 2 Gloo ranks, {len(finite_rows)} finite ones in one process), "
          f"reference workload, torch {torch.__version__}, {time.perf_counter() - start:.0f} s")
    classes = ["transient", "persistent", "data", "model"]
    seen = ["transient", "persistent", "data", "model", "compiler", "", "missed", "harmless"]
    table = collections.Counter()
    for planted, harmful, detected, fault in rows:
        table[planted, "harmless" if not harmful else "missed" if not detected else fault] += 1
    print("planted \\ guard  " + "".join(f"{c or '(none)':>12}" for c in seen))
    for c in classes:
        print(f"{c:<16} " + "".join(f"{table[c, s]:>12}" for s in seen))
    harmful = [r for r in rows if r[1]]
    detected = [r for r in harmful if r[2]]
    right = [r for r in detected if r[3] == r[0]]
    print(f"fault_detection_rate: {len(detected) / max(len(harmful), 1):.3f}  ({len(detected)} of {len(harmful)} harmful)")
    print(f"fault_class_accuracy: {len(right) / max(len(detected), 1):.3f}  ({len(right)} of {len(detected)} detected)")
    print(f"healthy_false_detections: {false_detections}  (of 500 healthy steps)")
    print(f"audit_detection_rate: {audit_rate:.3f}  (a value x1.01, too small to spike, audit_every=1)")
    print(f"audit_cost_ratio: {audit_cost:.3f}  (an audited step against a guarded one; audit_every=N costs about 1 + (ratio - 1) / N)")


if __name__ == "__main__":
    main()
