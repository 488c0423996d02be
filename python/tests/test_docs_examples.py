"""The ```python examples of the docs run as written: each page's blocks in
order, in one namespace (as a reader would paste them), in a fresh working
directory."""
import pathlib
import re

import pytest

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
PAGES = ["tensorboard.md", "data-firewall.md", "compile.md"]


def python_blocks(page):
    return re.findall(r"^```python\n(.*?)^```", (DOCS / page).read_text(encoding="utf-8"), flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES)
def test_python_examples_of_the_page_run(page, tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard package is not installed")
    blocks = python_blocks(page)
    assert blocks, f"docs/{page} has no ```python block"
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": "__docs__"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"docs/{page} (python block {i + 1})", "exec"), namespace)
