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
        return self.root(torch.relu(self.lin(x))).sum(1)


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    for name, model in [("norm_net", NormNet()), ("sqrt_net", SqrtNet())]:
        torch.jit.script(model).save(os.path.join(out, name + ".pt"))


if __name__ == "__main__":
    main()
