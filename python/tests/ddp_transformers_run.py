"""A 2-process Hugging Face Trainer run under torchrun (DDP, gloo, CPU) with
NanGuardCallback, run by test_integrations_transformers.py as
`python -m torch.distributed.run --nproc_per_node=2 ddp_transformers_run.py OUT_DIR`.

Rank 1's 4th batch holds one bad sample (a NaN); each rank writes
OUT_DIR/result-RANK.json: its bad steps, and a checksum of its parameters."""
import json
import logging
import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.distributed as dist

import transformers

from nanguard.integrations.transformers import NanGuardCallback

warnings.filterwarnings("ignore")
transformers.logging.set_verbosity_error()
logging.getLogger("accelerate").setLevel(logging.ERROR)

HIDDEN, SEQ, BATCH = 32, 8, 4


class Embedded(torch.utils.data.Dataset):
    """inputs_embeds samples; on rank 1 the 2nd sample read in its 4th batch
    holds a NaN (counted by reads, as the sampler shuffles)."""

    def __init__(self, n=64):
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, SEQ, HIDDEN, generator=g)
        self.y = (self.x[:, 0, 0] > 0).long()
        self.reads = 0

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        x = self.x[i].clone()
        if dist.get_rank() == 1 and self.reads == 3 * BATCH + 1:
            x[2, 5] = float("nan")
        self.reads += 1
        return {"inputs_embeds": x, "labels": self.y[i]}


def main(out):
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
                                     intermediate_size=64, max_position_embeddings=SEQ, num_labels=3)
    model = transformers.BertForSequenceClassification(config)
    cb = NanGuardCallback(policy="skip", event_log=os.path.join(out, "events.jsonl"))
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, "out"), report_to=[], use_cpu=True, ddp_backend="gloo", max_steps=6,
        per_device_train_batch_size=BATCH, learning_rate=1e-3, save_strategy="no", disable_tqdm=True, seed=0,
        dataloader_num_workers=0, logging_strategy="no")
    transformers.Trainer(model=model, args=args, train_dataset=Embedded(), callbacks=[cb]).train()
    rank = dist.get_rank()
    result = {"rank": rank, "world": dist.get_world_size(),
              "bad": [{"step": r.step, "action": r.action, "verdict": r.verdict, "bad_ranks": r.nonfinite_ranks,
                       "finding_rank": r.finding.rank if r.finding else -1,
                       "role": r.finding.role if r.finding else "", "op": r.finding.op if r.finding else ""}
                      for r in cb.bad_steps],
              "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
              "checksum": float(sum(p.double().sum() for p in model.parameters()))}
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    # Both ranks done, then the process group goes: a gloo group left to
    # the interpreter's exit can end the process with std::terminate.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
