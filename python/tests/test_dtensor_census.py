"""census, has_nonfinite, census_many and check_many of DTensors (torch.distributed.tensor,
FSDP2's parameters) on two Gloo ranks: they answer for the global tensor,
or for the local shard with local=True."""
import math

import pytest
import torch
import torch.distributed as dist

import nanguard
from ranks import run_ranks

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with Gloo")


def _whole():
    """The global tensor: 7 x 3 (rows shard unevenly over 2 ranks), a NaN and an
    Inf in the rows rank 1 holds, a -Inf in a column rank 1 holds."""
    x = torch.arange(21, dtype=torch.float32).reshape(7, 3) - 10
    x[5, 1] = float("nan")
    x[6, 2] = float("inf")
    return x


def _census_on_a_mesh(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Partial, Replicate, Shard, distribute_tensor, DTensor
    mesh = init_device_mesh("cpu", (2,))
    x = _whole()
    rows = distribute_tensor(x, mesh, [Shard(0)])
    y = x.clone()
    y[0, 0] = float("-inf")
    cols = distribute_tensor(y, mesh, [Shard(1)])
    replicated = distribute_tensor(x, mesh, [Replicate()])
    # Partial: each rank holds half of the values; their sum is x.
    partial = DTensor.from_local(x / 2, mesh, [Partial()])
    finite = distribute_tensor(torch.ones(4, 2), mesh, [Shard(0)])
    many = nanguard.census_many([rows, torch.tensor([1.0, float("nan")]), cols, finite])
    verdicts = [nanguard.check_many(xs, local=local) for xs, local in
                (([finite, rows, torch.tensor([1.0, float("nan")])], False), ([finite, cols], False),
                 ([rows], True), ([finite, torch.ones(3)], False))]
    return {"check_many": [(v.tensors, v.nan, v.pos_inf, v.neg_inf, v.first_tensor, v.first_index, v.first_value)
                           for v in verdicts],
            "rows": nanguard.census(rows).to_dict(),
            "rows_local": nanguard.census(rows, local=True).to_dict(),
            "cols": nanguard.census(cols).to_dict(),
            "replicated": nanguard.census(replicated).to_dict(),
            "partial": nanguard.census(partial).to_dict(),
            "many": [s.to_dict() for s in many],
            "has_nonfinite": (nanguard.has_nonfinite(rows), nanguard.has_nonfinite(rows, local=True),
                              nanguard.has_nonfinite(finite))}


def _same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], float) and math.isnan(a[k]):
            assert math.isnan(b[k]), (k, a, b)
        else:
            assert a[k] == pytest.approx(b[k], rel=1e-6), (k, a, b)


def test_a_dtensor_census_is_the_census_of_the_global_tensor(tmp_path):
    got = run_ranks(_census_on_a_mesh, tmp_path)
    x = _whole()
    y = x.clone()
    y[0, 0] = float("-inf")
    whole = nanguard.census(x).to_dict()
    for rank in (0, 1):
        r = got[rank]
        _same(whole, r["rows"])  # counts summed, ranges over both ranks, the global index (5 * 3 + 1)
        assert r["rows"]["first_nonfinite_index"] == 16
        _same(nanguard.census(y).to_dict(), r["cols"])  # a column shard's index mapped back to rows
        _same(whole, r["replicated"])  # replicated: counted once, not once per rank
        _same(whole, r["partial"])
        _same(whole, r["many"][0])
        assert r["many"][1]["nan"] == 1 and r["many"][3]["finite"] == 8
        _same(nanguard.census(y).to_dict(), r["many"][2])
        # local=True: rank 0 holds rows 0-3 (all finite), rank 1 rows 4-6.
        _same(nanguard.census(x[:4] if rank == 0 else x[4:]).to_dict(), r["rows_local"])
        assert r["has_nonfinite"] == (True, rank == 1, False)
        # check_many: the global tensors' counts, the first by its global index (#38).
        v = r["check_many"]
        assert v[0][:6] == (3, 2, 1, 0, 1, 16) and math.isnan(v[0][6]), v[0]
        assert v[1] == (2, 1, 1, 1, 1, 0, -math.inf), v[1]
        # local=True: rank 0's rows are finite, rank 1's hold the NaN at its local index (1 * 3 + 1).
        assert v[2][:6] == ((1, 0, 0, 0, -1, -1) if rank == 0 else (1, 1, 1, 0, 0, 4)), v[2]
        assert v[3] == (2, 0, 0, 0, -1, -1, 0.0), v[3]
