"""The package's types as a user's checker sees them (the python_typing
test): `mypy --strict` passes on typing_example.py (a training loop on the
public API) and fails on a misspelled Guard option; mypy's stubtest finds
_nanguard.pyi in agreement with the built extension; the example runs."""
import os
import subprocess
import sys
import textwrap

import pytest

import nanguard

HERE = os.path.dirname(os.path.abspath(__file__))


def mypy(*args, cwd=HERE):
    """mypy's run (its cache in $MYPY_CACHE_DIR when set: CTest keeps one in the build tree)."""
    return subprocess.run([sys.executable, "-m", "mypy", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=900)


def test_the_public_api_type_checks_under_strict():
    run = mypy("--strict", "typing_example.py")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Success: no issues found" in run.stdout


def test_a_misspelled_option_or_a_wrong_policy_fails_the_check(tmp_path):
    (tmp_path / "wrong.py").write_text(textwrap.dedent("""
        import torch
        import nanguard

        model = torch.nn.Linear(2, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        nanguard.Guard(model, opt, max_nrom=1.0)
        nanguard.Guard(model, opt, policy="retry")
        nanguard.Guard(model, opt, "rollback")
        nanguard.Guard(model, opt, loss_scale={"init_scael": 2.0})
    """))
    run = mypy("--strict", "wrong.py", cwd=tmp_path)
    assert run.returncode == 1, run.stdout + run.stderr
    for expected in ('Unexpected keyword argument "max_nrom" for "Guard"; did you mean "max_norm"?',
                     'Argument "policy" to "Guard" has incompatible type "Literal[\'retry\']"',
                     'Too many positional arguments for "Guard"',
                     'Argument "loss_scale" to "Guard" has incompatible type'):
        assert expected in run.stdout, run.stdout


def test_the_stub_agrees_with_the_extension():
    run = subprocess.run([sys.executable, "-m", "mypy.stubtest", "--concise", "--allowlist",
                          os.path.join(HERE, "stubtest_allowlist.txt"), "nanguard._nanguard"], cwd=HERE,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.skipif(not os.access(os.path.join(os.path.dirname(nanguard.__file__), "bin", "nanguard"), os.X_OK)
                    and not os.environ.get("NANGUARD_CLI"), reason="no nanguard command built")
def test_the_example_runs():
    run = subprocess.run([sys.executable, os.path.join(HERE, "typing_example.py")], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "step 3: skip, aten::addmm" in run.stdout or "step 3: skip" in run.stdout, run.stdout
