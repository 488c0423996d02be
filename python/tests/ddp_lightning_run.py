"""A 2-process Lightning DDP run (gloo, CPU) with NanGuard, run by
test_integrations_lightning.py as `python ddp_lightning_run.py OUT_DIR`
(Lightning's launcher starts rank 1 by running the same command again).

Rank 1 reads one bad sample (a NaN) in its 4th batch; each rank writes
OUT_DIR/result-RANK.json: its bad steps, and a checksum of its parameters."""
import json
import logging
import os
import sys
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import lightning.pytorch as pl

from nanguard.integrations.lightning import NanGuard

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


class Data(torch.utils.data.Dataset):
    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 4, generator=g)
        self.y = (self.x[:, 0] > 0).long()

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i].clone()
        if dist.get_rank() == 1 and i == 8 * 3 + 5:  # rank 1, 4th batch of 8
            x[1] = float("nan")
        return x, self.y[i]


class Classifier(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main(out):
    torch.manual_seed(0)
    model = Classifier()
    guard = NanGuard(policy="skip", event_log=os.path.join(out, "events.jsonl"))
    loader = torch.utils.data.DataLoader(Data(), batch_size=8)
    trainer = pl.Trainer(max_steps=6, accelerator="cpu", devices=2, strategy="ddp", use_distributed_sampler=False,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[guard])
    trainer.fit(model, loader)
    result = {"rank": trainer.global_rank,
              "bad": [{"step": r.step, "action": r.action, "verdict": r.verdict, "bad_ranks": r.nonfinite_ranks,
                       "finding_rank": r.finding.rank if r.finding else -1,
                       "role": r.finding.role if r.finding else "", "op": r.finding.op if r.finding else ""}
                      for r in guard.bad_steps],
              "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
              "checksum": float(sum(p.double().sum() for p in model.parameters()))}
    with open(os.path.join(out, f"result-{trainer.global_rank}.json"), "w") as f:
        json.dump(result, f)
    # Both ranks done, then the process group goes: a gloo group left to
    # the interpreter's exit can end the process with std::terminate.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
