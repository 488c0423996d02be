"""What a snapshot of a large model costs under nanguard.Guard (the Python
host): a stack of Linear layers with AdamW's state after one step; prints
the parameters, the snapshot's bytes and the seconds of three saves.

    PYTHONPATH=build/python .venv/bin/python bench/snapshot_cost.py [LAYERS WIDTH]

The defaults, 24 x 4096 (403M parameters, a 4.8 GB snapshot beside 6.4 GB
of model and optimizer state), are the largest this 24 GB machine holds
with room for the copies."""
import sys
import time

import torch

import nanguard
from nanguard._hosts import host_for


def main(layers=24, width=4096):
    torch.set_num_threads(2)
    model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.randn(4, width)).sum().backward()
    optimizer.step()  # AdamW's two moments exist
    optimizer.zero_grad(set_to_none=True)
    nanguard.Guard(model, optimizer, verbose=False)  # as a run begins: the snapshot of step 0
    host, _ = host_for(model, optimizer, None)
    seconds = []
    for _ in range(3):
        start = time.perf_counter()
        saved = host.save()
        seconds.append(time.perf_counter() - start)
        del saved
    params = sum(p.numel() for p in model.parameters())
    size = host.state_bytes()
    print(f"parameters {params / 1e6:.0f}M; snapshot_bytes {size / 1e9:.2f} GB; "
          f"snapshot_s {min(seconds):.2f}-{max(seconds):.2f} ({size / 1e9 / min(seconds):.2f} GB/s at best)")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
