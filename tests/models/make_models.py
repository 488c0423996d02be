"""Writes the small TorchScript models the C++ tests load.

Usage: python3 make_models.py OUT_DIR   (Debian's python3 with python3-torch)
"""
import os
import sys

import torch
from torch import nn


class Norm(nn.Module):
    """Standardisation without epsilon: NaN on a constant feature."""

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) / x.std(0, keepdim=True)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = Norm()
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.norm(self.lin(x)))


class Root(nn.Module):
    """sqrt: finite forward at 0, infinite gradient."""

    def forward(self, x):
        return torch.sqrt(x)


class SqrtNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.root = Root()

    def forward(self, x):
        h = self.lin(x)
        return self.root(h - h.min()).sum(1)  # 0 at the minimum: an infinite gradient that reaches lin


class Blow(nn.Module):
    """Scales up past float16's range (65504): fine in float32 and bfloat16."""

    def forward(self, x):
        return x * 1e5


class Squash(nn.Module):
    """Scales back down: its forward is in range, its backward values are tiny."""

    def forward(self, x):
        return x * 1e-5


class Fp16Net(nn.Module):
    """One module (blow) overflows float16; the precision advisor must name it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 8)
        self.blow = Blow()
        self.squash = Squash()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        return self.head(self.squash(self.blow(self.lin(x))))


class ClfNet(nn.Module):
    """A small classifier whose values stay well within float16 and bfloat16."""

    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(4, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(torch.relu(self.hidden(x)))


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    for name, model in [("norm_net", NormNet()), ("sqrt_net", SqrtNet()),
                        ("fp16_net", Fp16Net()), ("clf_net", ClfNet())]:
        torch.jit.script(model).save(os.path.join(out, name + ".pt"))


if __name__ == "__main__":
    main()
