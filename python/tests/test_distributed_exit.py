"""The end of a distributed run: a guard left open past destroy_process_group
no longer aborts the process at the interpreter's exit ("terminate called
without an active exception", 4 runs in 8 before), and a rank that dies
makes the surviving rank fail with an error within the process group's
timeout, not hang."""
import os
import subprocess
import sys

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo")

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed_exit_run.py")


def _run(tmp_path, i, *flags):
    return subprocess.run([sys.executable, SCRIPT, str(tmp_path / f"store{i}"), *flags], capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONWARNINGS="ignore"))


@pytest.mark.parametrize("i", range(2))
def test_the_ranks_exit_cleanly_with_the_guard_still_open(tmp_path, i):
    r = _run(tmp_path, i)
    assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr[-3000:]


def test_a_dead_rank_makes_the_other_fail_within_the_timeout(tmp_path):
    r = _run(tmp_path, 0, "--dead-rank")
    assert r.returncode != 0
    assert "rank 0 step 3:" in r.stdout, r.stdout[-2000:] + r.stderr[-2000:]
