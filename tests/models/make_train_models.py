"""Writes the TorchScript models and CSV files the `nanguard train` CLI test uses.

Usage: python3 make_train_models.py OUT_DIR   (Debian's python3 with python3-torch)

Every model takes a float tensor [batch, 4] and returns [batch] (regression)
or [batch, 3] logits (classification). Each CSV has the columns a,b,c,d,y.
"""
import os
import random
import sys

import torch
from torch import nn


class Encoder(nn.Module):
    """Two stacked layers, so modules get dotted names (encoder.layers.0)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 8)])

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class MlpClassifier(nn.Module):
    """A healthy 3-class classifier."""

    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        return self.head(self.encoder(x))


class LinearRegressor(nn.Module):
    """y = w.x + b: finite on finite data, diverges when the LR is too high."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 1)

    def forward(self, x):
        return self.lin(x).squeeze(1)


class Norm(nn.Module):
    """Standardisation over the batch, without epsilon unless given one.

    sqrt(var + eps) rather than std + eps: std's backward divides by std, so
    only the former is finite at a zero variance in both directions.
    """

    def __init__(self, eps: float):
        super().__init__()
        self.eps = eps

    def forward(self, x):
        return (x - x.mean(0, keepdim=True)) / torch.sqrt(x.var(0, keepdim=True) + self.eps)


class NormNet(nn.Module):
    """Forward producer: a batch of identical rows has std 0, and 0/0 = NaN."""

    def __init__(self, eps: float):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = Norm(eps)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.norm(self.lin(x))).squeeze(1)


class ShiftedRoot(nn.Module):
    """sqrt(h - min h): the minimum is 0, so finite forward, infinite gradient."""

    def forward(self, x):
        return torch.sqrt(x - x.min())


class SqrtNet(nn.Module):
    """Backward-only Inf: SqrtBackward0 divides by 2 sqrt(0); it reaches the weights."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.root = ShiftedRoot()

    def forward(self, x):
        return self.root(self.lin(x)).sum(1)


class ReluRoot(nn.Module):
    """sqrt(relu(h)): Inf inside backward that relu's backward masks to 0."""

    def forward(self, x):
        return torch.sqrt(torch.relu(x))


class MaskedSqrtNet(nn.Module):
    """The weights' gradients stay finite: only a tracer on every step sees the Inf."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.root = ReluRoot()

    def forward(self, x):
        return self.root(self.lin(x)).sum(1)


class ArgmaxClassifier(nn.Module):
    """Returns class indices (int64), not logits: nothing to train on."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).argmax(1)


class NoParameters(nn.Module):
    """A float output that depends on no parameter: nothing to train."""

    def forward(self, x):
        return x.sum(1)


def write_csv(path, rows):
    with open(path, "w") as f:
        f.write("a,b,c,d,y\n")
        for r in rows:
            f.write(",".join(r) + "\n")


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(0)
    models = [
        ("mlp_clf", MlpClassifier()),
        ("linear_reg", LinearRegressor()),
        ("norm_net", NormNet(0.0)),
        ("norm_net_eps", NormNet(1e-5)),
        ("sqrt_net", SqrtNet()),
        ("masked_sqrt_net", MaskedSqrtNet()),
        ("argmax_clf", ArgmaxClassifier()),
        ("no_params", NoParameters()),
    ]
    for name, model in models:
        torch.jit.script(model).save(os.path.join(out, name + ".pt"))

    rng = random.Random(7)
    w = [0.5, -1.0, 2.0, 0.25]

    def features(scale=1.0):
        return [rng.uniform(-1.0, 1.0) * scale for _ in range(4)]

    # Regression: y = w.x + noise, 64 rows.
    reg = []
    for _ in range(64):
        x = features()
        y = sum(wi * xi for wi, xi in zip(w, x)) + rng.gauss(0.0, 0.05)
        reg.append([f"{v:.5f}" for v in x + [y]])
    write_csv(os.path.join(out, "reg.csv"), reg)

    # The same with a NaN in row 10 (file line 12) and an inf in row 40 (line 42).
    bad = [list(r) for r in reg]
    bad[10][2] = "nan"
    bad[40][0] = "inf"
    write_csv(os.path.join(out, "reg_nan.csv"), bad)

    # Large features: plain SGD at a high LR diverges to Inf.
    big = []
    for _ in range(64):
        x = features(10.0)
        y = sum(wi * xi for wi, xi in zip(w, x))
        big.append([f"{v:.5f}" for v in x + [y]])
    write_csv(os.path.join(out, "big.csv"), big)

    # Classification: the class is the index of the largest of a, b, c.
    clf = []
    for _ in range(90):
        x = features()
        clf.append([f"{v:.5f}" for v in x] + [str(max(range(3), key=lambda k: x[k]))])
    write_csv(os.path.join(out, "clf.csv"), clf)

    # Every row the same: the batch std is 0.
    write_csv(os.path.join(out, "constant.csv"), [["1", "2", "3", "4", "0.5"]] * 32)

    # One feature too many for the 4-input models.
    with open(os.path.join(out, "wide.csv"), "w") as f:
        f.write("a,b,c,d,e,y\n")
        for r in reg[:16]:
            f.write(",".join(r[:4] + ["0.0"] + r[4:]) + "\n")


if __name__ == "__main__":
    main()
