"""The census of a DTensor (``torch.distributed.tensor``, what FSDP2's
parameters and gradients are): the statistics of the global tensor, from each
rank's census of its local shard and one all-gather per sharded mesh
dimension. Counts add up, ranges are the min/max over the mesh, mean and std
are pooled, and the first non-finite element is named by its index in the
global tensor.

Every rank of the mesh must make the same calls, in the same order (each is
a collective), as with any DTensor operation that communicates.
"""
import sys

import torch

from . import _nanguard

#: TensorStats' fields (its to_dict()), in the order a shard's census crosses the wire.
_FIELDS = ("numel", "nan", "pos_inf", "neg_inf", "finite", "zeros", "subnormal", "min", "max", "mean", "std",
           "l2_norm", "absmax", "fp16_overflow", "fp16_underflow", "bf16_overflow", "first_nonfinite_index",
           "first_nonfinite_value")


def is_dtensor(t):
    """Whether ``t`` is a DTensor (without importing torch.distributed.tensor:
    no DTensor exists before it is imported)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def census_many(dtensors):
    """The census of each global tensor of ``dtensors``, as TensorStats."""
    dtensors = [_without_partial(t) for t in dtensors]
    parts = [_shard_census(t) for t in dtensors]
    # One all-gather per (mesh, sharded dimension) for all the tensors that share it.
    groups = {}
    for i, t in enumerate(dtensors):
        key = (t.device_mesh, _sharded_dims(t))
        groups.setdefault(key, []).append(i)
    for (mesh, dims), members in groups.items():
        stats = [parts[i] for i in members]
        for dim in dims:
            stats = _gather_and_merge(stats, mesh, dim)
        for i, s in zip(members, stats):
            parts[i] = s
    return [_nanguard.TensorStats.from_dict(p) for p in parts]


def check_many(tensors):
    """check_many's RecordVerdict over ``tensors``, the DTensors among them
    read as their global tensors (one census_many for all of those)."""
    whole = iter(census_many([t for t in tensors if is_dtensor(t)]))
    parts = []
    for t in tensors:
        if is_dtensor(t):
            s = next(whole)
            parts.append((s.nan, s.pos_inf, s.neg_inf, s.first_nonfinite_index, s.first_nonfinite_value))
        else:
            v = _nanguard.check_many([t])
            parts.append((v.nan, v.pos_inf, v.neg_inf, v.first_index, v.first_value))
    return _nanguard.verdict_of(parts)


def has_nonfinite(t):
    """Whether the global tensor of the DTensor ``t`` holds a NaN or an Inf:
    each rank's check of its shard, then a MAX over the sharded mesh dimensions."""
    t = _without_partial(t)
    flag = torch.tensor([int(_nanguard.has_nonfinite(t.to_local().detach()))], device=t.device_mesh.device_type)
    import torch.distributed as dist
    for dim in _sharded_dims(t):
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=t.device_mesh.get_group(dim))
    return bool(flag.item())


def _without_partial(t):
    """``t`` with its Partial placements reduced (Replicate): a partial sum's
    census says nothing about the tensor's values."""
    if not any(p.is_partial() for p in t.placements):
        return t
    from torch.distributed.tensor import Replicate
    return t.redistribute(t.device_mesh, [Replicate() if p.is_partial() else p for p in t.placements])


def _sharded_dims(t):
    """The mesh dimensions ``t`` is sharded over (the replicated ones hold copies)."""
    return tuple(d for d, p in enumerate(t.placements) if p.is_shard())


def _shard_census(t):
    """The census of this rank's shard of ``t`` as a dict, its first
    non-finite element indexed in the global tensor."""
    local = t.to_local().detach()
    stats = _nanguard.census(local).to_dict()
    if stats["first_nonfinite_index"] >= 0:
        stats["first_nonfinite_index"] = _global_index(t, local.shape, stats["first_nonfinite_index"])
    return stats


def _global_index(t, local_shape, local_index):
    """The flat index in the global tensor of element ``local_index`` of this rank's shard."""
    # A private helper, but the one DTensor itself places shards with.
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    coords = []
    for size in reversed(local_shape):
        coords.append(local_index % size)
        local_index //= size
    index = 0
    for size, c, o in zip(t.shape, reversed(coords), offset):
        index = index * size + c + o
    return index


def _gather_and_merge(stats, mesh, dim):
    """Each census of ``stats`` merged with the same tensor's census on every
    rank along mesh dimension ``dim``."""
    import torch.distributed as dist
    group = mesh.get_group(dim)
    mine = torch.tensor([[float(s[f]) for f in _FIELDS] for s in stats], dtype=torch.float64,
                        device=mesh.device_type)
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(everyone, mine, group=group)
    rows = [r.cpu().tolist() for r in everyone]
    return [_nanguard.merge_census([_nanguard.TensorStats.from_dict(dict(zip(_FIELDS, r[i]))) for r in rows]).to_dict()
            for i in range(len(stats))]
