"""Run by the python_wheel test: the package pip installed under the
site-packages folder given as argv[1] imports from there and reaches the C++ core."""
import os
import sys

import torch

import nanguard

site = os.path.realpath(sys.argv[1])
where = os.path.realpath(nanguard.__file__)
assert where.startswith(site + os.sep), f"nanguard imported from {where}, not from the install under {site}"
assert os.path.realpath(nanguard._nanguard.__file__).startswith(site + os.sep), nanguard._nanguard.__file__
import nanguard.integrations  # noqa: E402  (the framework callbacks' package; imports no framework itself)
assert os.path.realpath(nanguard.integrations.__file__).startswith(site + os.sep), nanguard.integrations.__file__
for callback in ("lightning", "transformers"):
    assert os.path.exists(os.path.join(os.path.dirname(nanguard.integrations.__file__), callback + ".py")), callback

# The package's metadata: its licence (the LICENSE file, BSD-3-Clause) and classifiers.
from importlib.metadata import metadata  # noqa: E402

meta = metadata("nanguard")
assert "License :: OSI Approved :: BSD License" in (meta.get_all("Classifier") or []), meta.get_all("Classifier")
assert "LICENSE" in " ".join(meta.get_all("License-File") or []) or "BSD 3-Clause" in (meta.get("License") or ""), \
    dict(meta)

s = nanguard.census(torch.tensor([1.0, float("nan"), float("inf")]))
assert (s.nan, s.pos_inf, s.finite) == (1, 1, 1), s.to_dict()

model = torch.nn.Linear(3, 1)
with nanguard.trace(model) as t:
    model(torch.tensor([[1.0, float("nan"), 0.0]])).sum().backward()
assert t.findings and t.findings[0].role == "input", [str(f) for f in t.findings]
print(f"nanguard imports from {where} and finds: {t.findings[0]}")
