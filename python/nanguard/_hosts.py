"""The guard's view of a model and its optimizer (``nanguard::training_host``):
what the C++ step calls back. One host for a plain ``nn.Module``, one for a
``DistributedDataParallel`` model, one for an FSDP2 (``fully_shard``)
model; ``host_for`` picks it and the consensus that goes with it."""
import copy

import torch

from . import _compile, _nanguard
from ._trace import open_module_scopes


class ModuleHost(_nanguard.TrainingHost):
    """An ``nn.Module`` and a ``torch.optim`` optimizer. ``model`` may be
    compiled (``torch.compile``): its state and names are those of the
    module it compiled."""

    def __init__(self, model, optimizer, named):
        super().__init__()
        self.model = _compile.original_module(model)
        self.optimizer = optimizer
        self.named = named

    def named_parameters(self):
        return self.named

    def zero_grad(self):
        self.optimizer.zero_grad(set_to_none=True)

    def optimizer_step(self):
        self.optimizer.step()

    def lrs(self):
        return [float(g["lr"]) for g in self.optimizer.param_groups]

    def set_lrs(self, lrs):
        for g, lr in zip(self.optimizer.param_groups, lrs):
            g["lr"] = lr

    def save(self):
        model_state = _off_accelerator(self.model.state_dict())
        saved = [(n, _local(model_state[n])) for n, _ in self.named if n in model_state]
        return (model_state, _off_accelerator(self.optimizer.state_dict())), saved

    def state_bytes(self):
        """The bytes a save() copies: the model's state and the optimizer's
        tensors (a DTensor's local shard: each rank holds only its own)."""
        tensors = list(self.model.state_dict().values())
        for per_param in self.optimizer.state.values():
            tensors += list(per_param.values())
        return sum(_local(t).nbytes for t in tensors if isinstance(t, torch.Tensor))

    def restore(self, state):
        model_state, optimizer_state = state
        self.model.load_state_dict(model_state)
        # The param groups' settings stay as they are now: they are the LR
        # schedule's (the LR, a OneCycleLR's bounds and momentum), and the
        # rollbacks since the snapshot lowered them. The snapshot brings back
        # the weights and the optimizer's state.
        settings = [{k: v for k, v in group.items() if k != "params"} for group in self.optimizer.param_groups]
        # A copy: load_state_dict keeps the state's tensors (those of the
        # parameters' dtype and device), which the optimizer then updates in
        # place; a later rollback may restore this snapshot again.
        self.optimizer.load_state_dict(copy.deepcopy(optimizer_state))
        for group, kept in zip(self.optimizer.param_groups, settings):
            group.update(kept)

    def begin_traced_run(self):
        end_eager_run = _compile.begin_eager_run()
        close_scopes = open_module_scopes(self.model)

        def end():
            close_scopes()
            end_eager_run()

        return end

    def bisect_compiled(self, step_finite):
        return _compile.bisect(step_finite)


class _OwnGradients:
    """Whether this rank's own gradients stayed finite in a traced run (a
    replay): a hook on each watched tensor reads the gradient this rank's
    backward computes for it, before it is accumulated (after a reduced
    micro-batch, ``.grad`` holds what the other ranks sent too) and before
    the model's backward collective sends it. Only in a traced run: on a
    healthy step the reduced gradients being finite says every rank's own
    were, and the hooks would cost a pass over every gradient."""

    def __init__(self):
        self.finite = True
        self._handles = []

    def watch_during(self, begin_run, tensors):
        """Begins a traced run (``begin_run()``, which returns what ends
        it) with ``tensors`` watched; returns what ends both."""
        end_run = begin_run()
        self._handles = [t.register_hook(self._read) for t in tensors]

        def end():
            for h in self._handles:
                h.remove()
            self._handles = []
            end_run()

        return end

    def _read(self, grad):
        if self.finite and _nanguard.has_nonfinite(grad.detach()):
            self.finite = False

    def take(self):
        """Whether they were finite; starts over."""
        finite, self.finite = self.finite, True
        return finite


class DataParallelHost(ModuleHost):
    """The module a ``DistributedDataParallel`` wraps (its parameters and
    state dict named as there): after backward the parameters hold the
    gradients DDP's all-reduce averaged; in a traced run a hook on each says
    whether this rank's own were finite before it."""

    def __init__(self, module, optimizer):
        super().__init__(module, optimizer, _trainable(module))
        self._own = _OwnGradients()

    def begin_traced_run(self):
        return self._own.watch_during(super().begin_traced_run, [p for _, p in self.named])

    def backward_done(self):
        return self._own.take()


class ShardedHost(ModuleHost):
    """An FSDP2 (``fully_shard``) model: the guard reads each parameter's
    local shard and, after backward, the local shard of its gradient (the
    reduce-scatter's output); in a traced run hooks on FSDP's unsharded
    parameters say whether this rank's own gradients were finite before the
    reduce-scatter."""

    def __init__(self, model, optimizer):
        self.sharded = _trainable(model)
        # Aliases of the local shards: the C++ guard reads them and their .grad.
        super().__init__(model, optimizer, [(n, p.to_local().detach()) for n, p in self.sharded])
        self._own = _OwnGradients()

    def begin_traced_run(self):
        return self._own.watch_during(super().begin_traced_run, _unsharded_parameters(self.model))

    def zero_grad(self):
        super().zero_grad()
        for _, local in self.named:
            local.grad = None

    def backward_done(self):
        for (_, p), (_, local) in zip(self.sharded, self.named):
            local.grad = None if p.grad is None else p.grad.to_local()
        return self._own.take()


def host_for(compiled, optimizer, distributed):
    """The host of the model ``compiled`` (compiled or not) and the C++
    consensus for it: ``(host, nanguard.Distributed or None)``. A DistributedDataParallel model and an
    FSDP2 one are distributed on their own process group; ``distributed``
    (None, True, a ProcessGroup or a nanguard.Distributed) must then be None,
    True, or that group. A ``nanguard.Distributed(group, backward="all_reduce")``
    declares the module inside a framework's DistributedDataParallel."""
    import torch.distributed as dist
    model = _compile.original_module(compiled)  # what a compiled model compiled: its parameters, its wrapper
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        group = model.process_group
        return DataParallelHost(model.module, optimizer), _consensus_on(group, distributed, "all_reduce",
                                                                         "DistributedDataParallel")
    if isinstance(distributed, _nanguard.Distributed) and distributed.backward == "all_reduce":
        # The module a framework's DDP wraps (the integrations): the framework runs its steps.
        return DataParallelHost(model, optimizer), distributed
    sharded = [p for _, p in _trainable(model) if _is_dtensor(p)]
    if sharded:
        group = _mesh_group(sharded)
        return ShardedHost(model, optimizer), _consensus_on(group, distributed, "reduce_scatter", "fully_shard")
    return ModuleHost(compiled, optimizer, _trainable(model)), _consensus(distributed, dist)


def _trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def _off_accelerator(state):
    """A deep copy of ``state`` (a state dict) whose tensors on an
    accelerator are in pinned host memory, copied asynchronously on the
    current stream (what writes them next is queued after the copy; loading
    the state back copies onto the parameters' device). A DTensor keeps its
    local shard where it is: each rank holds only its own. One memo for
    the whole state, as one deepcopy of it: tensors that share storage
    (tied weights) still share it in the copy."""
    memo = {}

    def host(t):
        if not isinstance(t, torch.Tensor) or t.device.type == "cpu" or _is_dtensor(t):
            return copy.deepcopy(t, memo)
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        return out.copy_(t.detach(), non_blocking=True)

    def walk(v):
        if isinstance(v, dict):
            out = type(v)((k, walk(x)) for k, x in v.items())
            if hasattr(v, "_metadata"):  # a module state dict's versions, which load_state_dict reads
                out._metadata = copy.deepcopy(v._metadata, memo)
            return out
        if isinstance(v, (list, tuple)):
            return type(v)(walk(x) for x in v)
        return host(v)

    return walk(state)


def _local(t):
    """A DTensor's local shard; any other tensor as is."""
    return t.to_local() if _is_dtensor(t) else t


def _is_dtensor(t):
    from ._dtensor import is_dtensor
    return is_dtensor(t)


def _mesh_group(dtensors):
    """The process group of the 1-D device mesh the parameters are sharded on."""
    meshes = {p.device_mesh for p in dtensors}
    mesh = next(iter(meshes))
    if len(meshes) != 1 or mesh.ndim != 1:
        raise ValueError("nanguard.Guard: the model's parameters are DTensors on "
                         + (f"{len(meshes)} device meshes" if len(meshes) != 1 else f"a {mesh.ndim}-D device mesh")
                         + "; the guard supports FSDP2 (fully_shard) on one 1-D mesh, e.g. "
                           "init_device_mesh('cpu', (world_size,))")
    return mesh.get_group()


def _unsharded_parameters(model):
    """FSDP2's unsharded parameters of every fully_shard module in ``model``:
    their gradients are this rank's own, before the reduce-scatter. (FSDP2
    has no public handle on them; these are its FSDPParam objects. It makes
    them at the first forward: none before.)"""
    from torch.distributed.fsdp import FSDPModule
    out = []
    for m in model.modules():
        if isinstance(m, FSDPModule):
            group = m._get_fsdp_state()._fsdp_param_group
            out += [fp._unsharded_param for fp in (group.fsdp_params if group is not None else [])
                    if fp.sharded_param.requires_grad and hasattr(fp, "_unsharded_param")]
    return out


def _consensus_on(group, distributed, backward, wrapper):
    """The consensus on ``group``, the process group the model's backward
    reduces its gradients over with ``backward``."""
    import torch.distributed as dist
    if isinstance(distributed, _nanguard.Distributed):
        raise ValueError(f"nanguard.Guard: the model is wrapped in {wrapper}, which reduces the gradients "
                         "itself: pass distributed=True (or its process group), not a nanguard.Distributed")
    if isinstance(distributed, dist.ProcessGroup) and distributed is not group:
        raise ValueError(f"nanguard.Guard: the model is on a {wrapper} process group of {group.size()} ranks, "
                         f"but distributed= is another ProcessGroup ({distributed.size()} ranks); pass "
                         "distributed=True, or the process group the model was wrapped with")
    if distributed is False:
        raise ValueError(f"nanguard.Guard: the model is wrapped in {wrapper}: its steps are collective, so the "
                         "guard must be too; leave distributed= out (or True)")
    return _nanguard.Distributed(group, backward=backward)


def _consensus(d, dist):
    """The C++ consensus for ``Guard(distributed=d)`` on an unwrapped model:
    None, True (the default process group), a torch.distributed
    ProcessGroup, or a ``nanguard.Distributed``."""
    if d is None or d is False:
        return None
    if isinstance(d, _nanguard.Distributed):
        return d
    if d is True:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("nanguard.Guard: distributed=True needs torch.distributed initialized first "
                             "(torch.distributed.init_process_group, or run under torchrun)")
        d = dist.group.WORLD
    if not isinstance(d, dist.ProcessGroup):
        raise TypeError("nanguard.Guard: distributed must be True, a torch.distributed ProcessGroup or a "
                        f"nanguard.Distributed, got {type(d).__name__}")
    return _nanguard.Distributed(d)
