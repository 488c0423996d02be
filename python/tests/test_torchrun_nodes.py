"""Two torchrun agents on 127.0.0.1 form one job of two "nodes" (c10d
rendezvous), one worker each: nanguard.Guard over DDP skips the step rank
1's NaN spoiled on both nodes, names rank 1, and the parameters stay equal;
a node that dies makes the other fail with an error, not hang."""
import json
import os
import re
import socket
import subprocess
import sys

import pytest
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo")

SCRIPT = os.path.join(os.path.dirname(__file__), "torchrun_node_run.py")


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(out, *flags):
    port = _free_port()
    agents = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                                f"--node-rank={node}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                                "--rdzv-id=nanguard-test", "--local-addr=127.0.0.1", SCRIPT, str(out), *flags],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=dict(os.environ, PYTHONWARNINGS="ignore", OMP_NUM_THREADS="1"))
              for node in (0, 1)]
    try:
        return [(a.wait(timeout=150), *a.communicate()) for a in agents]
    finally:
        for a in agents:
            a.kill()


def test_two_torchrun_nodes_skip_the_same_step(tmp_path):
    runs = _two_nodes(tmp_path)
    for code, stdout, stderr in runs:
        assert code == 0, stdout[-2000:] + stderr[-3000:]
    res = [json.loads((tmp_path / f"result-{rank}.json").read_text()) for rank in (0, 1)]
    for r in res:
        assert [s["action"] for s in r["steps"]] == ["step", "skip", "step", "step"], r
        assert (r["steps"][1]["bad_ranks"], r["steps"][1]["finding_rank"]) == ([1], 1), r
        assert r["steps"][1]["finding"] == ["aten::addmm", "input"], r  # rank 1's batch, read by the Linear
    assert res[0]["params"] == res[1]["params"]


def test_a_dead_node_makes_the_other_fail(tmp_path):
    (code0, out0, err0), (code1, _, _) = _two_nodes(tmp_path, "--dead-rank")
    assert code0 != 0 and code1 != 0
    assert "rank 0 step 3:" in out0, out0[-2000:] + err0[-3000:]
    # The guard's error names the rank that died (DDP's all-reduce in the backward the guard ran).
    assert re.search(r"rank 0 step 3: nanguard::distributed: rank 0: .* of step 3 failed: rank 1 \(host .+, pid "
                     r"\d+\) has exited", out0), out0[-2000:]
