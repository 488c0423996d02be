#!/usr/bin/env python3
"""Step-time overhead of the framework callbacks (nanguard.integrations) on
healthy steps: the framework's own step with and without the callback.

Workloads (tiny, on the CPU, torch.set_num_threads(2)):
  lightning     a LightningModule around a 2-layer nn.TransformerEncoder
                (d=64, 4 heads, ff=256), batch 16 x 32 tokens, 10 classes,
                AdamW; Trainer(logger=False, no checkpointing, no progress bar)
  transformers  BertForSequenceClassification from BertConfig(vocab 1000,
                hidden 64, 2 layers, 4 heads, intermediate 256), batch 16 x 32
                tokens, the Trainer's defaults (AdamW, linear schedule,
                max_grad_norm 1.0), report_to=[]

A step is timed by the first callback of the list, from the framework's
step-start hook to its step-end hook (Lightning on_train_batch_start ->
on_train_batch_end; Trainer on_step_begin -> on_step_end): forward,
backward, the callbacks' work, clipping and optimizer.step(). The guarded
variant adds NanGuard / NanGuardCallback(event_log=...) with its defaults
(policy auto: snapshots every 10 steps, or less often as their cost allows). Each round fits S steps with
each variant in turn on the same model (the order alternates), after a
warm-up fit of each.

Prints `<framework>_callback_ratio: X`, the median over pairs (step i of a
round with and without the callback) of the ratio of step times, and
`<framework>_callback_ratio_ci95: low..high` (a 95% distribution-free
interval), as python/bench/bench_overhead.py does; and
`<framework>_callback_own_ms`, the median time a step spends inside the
callback's hooks (timed around each), with `<framework>_callback_own_fraction`,
that over the median plain step: the part of the ratio that is the
callback's own work, steadier than the ratio on a busy machine; and
`<framework>_callback_cpu_ratio` (with its ci95), the same pairing on the
process's CPU time (process_time: all its threads), which time spent
waiting for a core shared with other jobs does not inflate.
Environment: NANGUARD_BENCH_ROUNDS (default 20), NANGUARD_BENCH_STEPS per
variant per round (default 10), NANGUARD_BENCH_ONLY (lightning |
transformers: one framework), NANGUARD_BENCH_EVENT_LOG=0 (the guarded
variant without an event log: what the log's line costs).
"""
import logging
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn as nn
import torch.nn.functional as F

from workload import paired_ratio, settings


def event_log(tmp, name):
    """The guarded variant's event log (None with NANGUARD_BENCH_EVENT_LOG=0)."""
    return None if os.environ.get("NANGUARD_BENCH_EVENT_LOG", "1") == "0" else os.path.join(tmp, name)


def timed(callback_class, hooks):
    """A subclass of ``callback_class`` that adds the time spent in
    ``hooks`` to ``self.own`` (seconds, one entry per step: the last hook
    of ``hooks`` ends a step)."""

    def wrap(name, ends_step):
        def hook(self, *a, **k):
            t0 = time.perf_counter()
            try:
                return getattr(callback_class, name)(self, *a, **k)
            finally:
                self._t += time.perf_counter() - t0
                if ends_step:
                    self.own.append(self._t)
                    self._t = 0.0
        return hook

    def init(self, *a, **k):
        callback_class.__init__(self, *a, **k)
        self.own, self._t = [], 0.0

    body = {name: wrap(name, i == len(hooks) - 1) for i, name in enumerate(hooks)}
    return type("Timed" + callback_class.__name__, (callback_class,), {"__init__": init, **body})


def clocks():
    """Wall time and this process's CPU time (all its threads), in seconds."""
    return time.perf_counter(), time.process_time()


def since(t0):
    wall, cpu = clocks()
    return wall - t0[0], cpu - t0[1]


def tokens(n, vocab=1000, seq=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (n, seq), generator=g)
    return ids, (ids[:, 0] % 10)


def bench_lightning(rounds, steps, tmp):
    import lightning.pytorch as pl
    from nanguard.integrations.lightning import NanGuard

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)

    class Encoder(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(1000, 64)
            layer = nn.TransformerEncoderLayer(64, 4, dim_feedforward=256, dropout=0.1, batch_first=True)
            self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.head = nn.Linear(64, 10)

        def training_step(self, batch, batch_idx):
            ids, y = batch
            return F.cross_entropy(self.head(self.encoder(self.embed(ids)).mean(1)), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    class Timer(pl.Callback):
        def __init__(self):
            self.times = []

        def on_train_batch_start(self, *a):
            self.t0 = clocks()

        def on_train_batch_end(self, *a):
            self.times.append(since(self.t0))

    ids, y = tokens(16 * steps)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids, y), batch_size=16)
    model = Encoder()
    guard_class = timed(NanGuard, ["on_train_batch_start", "on_before_backward", "on_before_optimizer_step"])
    own = []

    def run(guarded):
        timer = Timer()
        guard = guard_class(event_log=event_log(tmp, "l.jsonl"))
        cbs = [timer] + ([guard] if guarded else [])
        pl.Trainer(max_steps=steps, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                   enable_progress_bar=False, enable_model_summary=False, callbacks=cbs).fit(model, loader)
        own.extend(guard.own)
        return timer.times

    return measure(run, rounds) + (own,)


def bench_transformers(rounds, steps, tmp):
    import transformers
    from nanguard.integrations.transformers import NanGuardCallback

    transformers.logging.set_verbosity_error()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    config = transformers.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=256, max_position_embeddings=32, num_labels=10)
    model = transformers.BertForSequenceClassification(config)
    ids, y = tokens(16 * steps)
    data = [{"input_ids": i, "labels": int(l)} for i, l in zip(ids, y)]

    class Timer(transformers.TrainerCallback):
        def __init__(self):
            self.times = []

        def on_step_begin(self, *a, **k):
            self.t0 = clocks()

        def on_step_end(self, *a, **k):
            self.times.append(since(self.t0))

    guard_class = timed(NanGuardCallback, ["on_step_begin", "on_pre_optimizer_step"])
    own = []

    def run(guarded):
        timer = Timer()
        guard = guard_class(event_log=event_log(tmp, "t.jsonl"))
        cbs = [timer] + ([guard] if guarded else [])
        args = transformers.TrainingArguments(output_dir=os.path.join(tmp, "out"), max_steps=steps,
                                              per_device_train_batch_size=16, use_cpu=True, report_to=[],
                                              save_strategy="no", disable_tqdm=True, logging_strategy="no")
        transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=cbs).train()
        own.extend(guard.own)
        return timer.times

    return measure(run, rounds) + (own,)


def measure(run, rounds):
    """Interleaved rounds: each fits both variants, the order alternating;
    returns (plain step times, guarded step times), paired by position."""
    run(False), run(True)  # warm-up
    plain, guarded = [], []
    for r in range(rounds):
        order = (False, True) if r % 2 == 0 else (True, False)
        got = {g: run(g) for g in order}
        n = min(len(got[False]), len(got[True]))
        plain += got[False][:n]
        guarded += got[True][:n]
    return plain, guarded


def main():
    rounds, steps = settings(rounds=20, steps=10)
    only = os.environ.get("NANGUARD_BENCH_ONLY", "")
    benches = {"lightning": bench_lightning, "transformers": bench_transformers}
    print(f"# {rounds} rounds x {steps} steps per variant, 2 threads, torch {torch.__version__}, event log "
          f"{'off' if event_log('', 'x') is None else 'on'}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, bench in benches.items():
            if only and name != only:
                continue
            plain, guarded, own = bench(rounds, steps, tmp)
            wall = lambda ts: [t[0] for t in ts]
            cpu = lambda ts: [t[1] for t in ts]
            print(f"# {name:12s} median step {statistics.median(wall(plain)) * 1000:7.2f} ms plain, "
                  f"{statistics.median(wall(guarded)) * 1000:7.2f} ms with the callback ({len(plain)} pairs); "
                  f"CPU {statistics.median(cpu(plain)) * 1000:.2f} / {statistics.median(cpu(guarded)) * 1000:.2f} ms")
            for key, pick in (("ratio", wall), ("cpu_ratio", cpu)):
                ratio, low, high = paired_ratio(pick(guarded), pick(plain))
                print(f"{name}_callback_{key}: {ratio:.3f}")
                print(f"{name}_callback_{key}_ci95: {low:.3f}..{high:.3f}")
            print(f"{name}_callback_own_ms: {statistics.median(own) * 1000:.3f}")
            print(f"{name}_callback_own_fraction: {statistics.median(own) / statistics.median(wall(plain)):.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
