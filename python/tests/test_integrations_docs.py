"""The examples of docs/integrations.md run as they are written (each
```python block runs in a fresh interpreter in an empty folder and must exit
0; the blocks assert what their text claims), and a missing framework
fails with an error that says how to install it."""
import os
import pathlib
import re
import subprocess
import sys

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "integrations.md"


def blocks():
    text = DOC.read_text(encoding="utf-8")
    found = re.findall(r"^## (.+?)$|^```python\n(.*?)^```", text, flags=re.M | re.S)
    out, section = [], ""
    for heading, code in found:
        if heading:
            section = heading
        else:
            out.append(pytest.param(code, id=re.sub(r"\W+", "_", section).strip("_").lower()))
    return out


def test_the_doc_has_an_example_per_framework():
    assert len(blocks()) == 2, f"{DOC} should hold one ```python example per framework"


@pytest.mark.parametrize("code", blocks())
def test_the_example_runs(code, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONWARNINGS="ignore")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"the example failed:\n{r.stdout}\n{r.stderr[-4000:]}"
    assert (tmp_path / "events.jsonl").exists()


@pytest.mark.parametrize("module,package", [("lightning", "lightning"), ("transformers", "transformers")])
def test_a_missing_framework_says_how_to_install_it(module, package):
    """Without its framework, importing a callback fails with an ImportError
    that names the package and `make setup`."""
    code = (f"import sys; sys.modules[{package!r}] = None\n"
            f"import nanguard.integrations.{module}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    assert "ImportError" in r.stderr and f"the {package!r} package is not installed" in r.stderr, r.stderr[-2000:]
    assert "make setup" in r.stderr and "requirements-frameworks.txt" in r.stderr


def test_the_last_cause_codes_agree_with_the_core_and_the_doc_s_table():
    from nanguard import _nanguard
    from nanguard.integrations import LAST_CAUSE_CODES
    assert all(_nanguard.cause_code(name) == code for code, name in LAST_CAUSE_CODES.items() if code > 0)
    assert sorted(LAST_CAUSE_CODES) == list(range(len(LAST_CAUSE_CODES)))
    table = dict(re.findall(r"\| (\d+) \| `?(\w+)`?", DOC.read_text(encoding="utf-8")))
    assert {int(k): v for k, v in table.items()} == LAST_CAUSE_CODES
