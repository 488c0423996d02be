"""torch.compile as nanguard sees it: compiled models by their own names,
traced runs that run eagerly, no observer during a compile, and the bisect
of a NaN that only the compiled code makes.

A compiled step runs fused kernels (Inductor's ``cpp_fused_...`` on the
CPU, Triton kernels on a GPU) that the op tracer cannot see. So a traced
run (``nanguard.trace``, a guard's replay, ``trace_every_step``) runs
compiled code eagerly, under ``torch.compiler.set_stance("force_eager")``:
every op is seen, and the compiled graphs are used again afterwards without
recompiling. When that eager run stays finite, the NaN belongs to the
compiled code: :func:`bisect` runs the step under each stage of the
compiler, as PyTorch's minifier does, and names the stage and the kernel.
"""
import re
import sys
import threading

import torch

from . import _nanguard

_watching = threading.Lock()
_watched = False


def original_module(model):
    """The module ``torch.compile`` wrapped (``model._orig_mod`` of an
    ``OptimizedModule``), whose parameters and submodules are named without
    the ``_orig_mod.`` prefix; ``model`` itself otherwise (a module compiled
    in place with ``model.compile()`` keeps its names)."""
    while isinstance(getattr(model, "_orig_mod", None), torch.nn.Module):
        model = model._orig_mod
    return model


def anything_compiled():
    """True once Dynamo has compiled a frame in this process (a compiled
    function or training step is compiled too, not only a module)."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    return dynamo_utils is not None and dynamo_utils.counters["stats"]["unique_graphs"] > 0


def watch_compilation():
    """Pauses nanguard's observers (the tracer, the precision advisor) on a
    thread while Dynamo, AOTAutograd and Inductor compile there: they run
    the model's ops on FakeTensors and FunctionalTensors, which hold no data.
    Registers Dynamo's compile start and end callbacks once per process."""
    global _watched
    with _watching:
        if _watched:
            return
        from torch._dynamo.callback import callback_handler
        callback_handler.register_start_callback(lambda _args: _nanguard.pause_observers())
        callback_handler.register_end_callback(lambda _args: _nanguard.resume_observers())
        _watched = True


def begin_eager_run():
    """Runs code compiled with ``torch.compile`` eagerly
    (``torch.compiler.set_stance("force_eager")``) until the function it
    returns is called, so that the op tracer sees every op; nothing to do
    before Dynamo is loaded (nothing is compiled yet)."""
    if "torch._dynamo" not in sys.modules:
        return lambda: None
    stance = torch.compiler.set_stance("force_eager")
    return lambda: stance.__exit__(None, None, None)  # back to the stance before


def bisect(step_finite):
    """Which stage of the compiler makes a NaN/Inf that the eager step does
    not: runs ``step_finite()`` (the step again from its RNG state; whether
    it stayed finite) with the graphs compiled by ``aot_eager`` (Dynamo and
    AOTAutograd, no code generation), then as compiled, with Inductor's
    kernels checked one by one. Returns one sentence, or "" when nothing is
    compiled in this process or neither stage makes the NaN/Inf again
    (non-determinism)."""
    if not anything_compiled():
        return ""
    with torch.compiler.set_stance("default", force_backend="aot_eager"):
        aot_eager_finite = step_finite()
    if not aot_eager_finite:
        return ("compiled only: the eager step is finite, and the graph that Dynamo and AOTAutograd capture "
                "is not (backend aot_eager): look at the decompositions, functionalization or a graph break; "
                "TORCH_COMPILE_DEBUG=1 writes the graphs")
    with _KernelWatch() as watch:
        if step_finite():
            return ""
    return "compiled only: the eager step and the aot_eager graph are finite; " + watch.describe()


class _KernelWatch:
    """Checks every kernel of Inductor's generated code while it lives, and
    keeps the first that read only finite values and wrote a NaN/Inf. The
    generated modules call their kernels through module globals: a C++
    kernel as a function (``cpp_fused_div_0(buf0, arg0_1)``), a Triton one
    by its ``run`` method; each is wrapped for the while.

    Which arguments a kernel reads and which it only writes comes from its
    parameter names (``in_ptr0``, ``out_ptr0``, ``in_out_ptr0``): an output
    buffer's old contents do not count, since fresh buffers are not cleared
    and may hold a NaN that freed memory left. An argument of unknown role
    counts as both read and written."""

    _KERNEL_PREFIXES = ("cpp_fused_", "triton_", "cpp_kernel_")

    def __init__(self):
        self.kernel = None
        self.path = None
        self._wrapped = []

    def __enter__(self):
        for module in _generated_modules():
            path = getattr(module, "__file__", None)
            cpp_parameters = _cpp_kernel_parameters(path)
            for name, kernel in list(vars(module).items()):
                if not name.startswith(self._KERNEL_PREFIXES) or not callable(getattr(kernel, "run", kernel)):
                    continue
                parameters = cpp_parameters.get(name) or _triton_parameters(kernel)
                self._wrapped.append((module, name, kernel))
                setattr(module, name, self._checked(name, kernel, parameters, path))
        return self

    def __exit__(self, *exc):
        for module, name, kernel in self._wrapped:
            setattr(module, name, kernel)
        self._wrapped = []
        return False

    def _checked(self, name, kernel, parameters, path):
        launch = getattr(kernel, "run", kernel)
        roles = [_role(p) for p in parameters or ()]

        def run(*args, **kwargs):
            if self.kernel is not None:
                return launch(*args, **kwargs)
            arguments = [(a, roles[i] if i < len(roles) else _role("")) for i, a in enumerate(args)]
            arguments += [(a, _role(k)) for k, a in kwargs.items()]
            arguments = [(a, role) for a, role in arguments if isinstance(a, torch.Tensor) and a.dtype in _CHECKED]
            read_finite = not any(role != "writes" and _nanguard.has_nonfinite(a) for a, role in arguments)
            out = launch(*args, **kwargs)
            if read_finite and any(role != "reads" and _nanguard.has_nonfinite(a) for a, role in arguments):
                self.kernel, self.path = name, path
            return out

        return _TritonLaunch(kernel, run) if launch is not kernel else run

    def describe(self):
        """The kernel that made the NaN/Inf, its FX origins and source lines
        where Inductor recorded them, and its generated file."""
        if self.kernel is None:
            return ("the code the backend generated is not: no fused kernel turned finite arguments into a "
                    "NaN/Inf (an extern kernel, or a backend other than Inductor); TORCH_COMPILE_DEBUG=1 "
                    "writes the generated code")
        text = f"Inductor's kernel {self.kernel} made the NaN/Inf"
        origins = _kernel_origins(self.kernel)
        if origins:
            text += f" (from {origins})"
        if self.path:
            text += f"; its code: {self.path}"
        return text + "; " + _KERNEL_REMEDY


# What to do about a fused kernel that computes other than eager (docs/compile.md).
_KERNEL_REMEDY = ("remedy: run that part of the model eagerly (`torch.compiler.disable` on its forward) or compile it "
                  "with backend=\"aot_eager\"; a low-precision model: "
                  "torch._inductor.config.emulate_precision_casts = True; random ops: "
                  "torch._inductor.config.fallback_random = True")


# The dtypes has_nonfinite reads on every device (the CUDA census reads no float8).
_CHECKED = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class _TritonLaunch:
    """A Triton kernel whose ``run`` is checked; everything else is the kernel's."""

    def __init__(self, kernel, run):
        self._kernel = kernel
        self.run = run

    def __getattr__(self, name):
        return getattr(self._kernel, name)


def _role(parameter):
    """What a kernel does with the argument of its parameter so named:
    "reads" (``in_ptr``), "writes" (an output buffer: ``out_ptr``) or
    "both" (``in_out_ptr``, or a name that says nothing)."""
    if parameter.startswith("in_ptr"):
        return "reads"
    if parameter.startswith("out_ptr"):
        return "writes"
    return "both"


# name = async_compile.cpp_pybinding([types], r'''...extern "C" void kernel(parameters)
_CPP_KERNEL = re.compile(r"""^(\w+) = async_compile\.cpp_pybinding\(\[[^\]]*\], r'''"""
                         r""".*?extern "C"\s+void\s+kernel\(([^)]*)\)""", re.M | re.S)


def _cpp_kernel_parameters(path):
    """{kernel: its parameter names} of the C++ kernels a generated module
    at `path` defines (``const float* in_ptr0`` gives "in_ptr0")."""
    try:
        with open(path) as f:
            source = f.read()
    except (OSError, TypeError):
        return {}
    return {m.group(1): [p.split()[-1].lstrip("*&") for p in m.group(2).split(",") if p.strip()]
            for m in _CPP_KERNEL.finditer(source)}


def _triton_parameters(kernel):
    """A Triton kernel's parameter names (its JIT function's), or None."""
    return getattr(getattr(kernel, "fn", None), "arg_names", None)


def _generated_modules():
    """The Python modules of Inductor's generated code in this process:
    PyCodeCache's, and those it also put in sys.modules (with Inductor's
    caches off, PyCodeCache forgets its modules after each compile)."""
    from torch._inductor.codecache import PyCodeCache
    prefix = "torch._inductor.runtime.compile_tasks."
    modules = list(PyCodeCache.modules) + [m for name, m in list(sys.modules.items()) if name.startswith(prefix)]
    return list({id(m): m for m in modules}.values())


def _kernel_origins(kernel):
    """The FX nodes and source lines a kernel was generated from, as Inductor
    records them with ``torch._inductor.config.trace.provenance_tracking_level
    = 1`` set before compiling; "" otherwise."""
    debug = sys.modules.get("torch._inductor.debug")
    if debug is None:
        return ""
    nodes = _recorded(getattr(debug, "_inductor_triton_kernel_to_post_grad_node_info", {}), kernel)
    traces = _recorded(getattr(debug, "_inductor_kernel_stack_trace", {}), kernel)
    lines = [_last_frame(t) for t in traces]
    parts = []
    if nodes:
        parts.append("FX nodes " + ", ".join(dict.fromkeys(nodes)))
    if any(lines):
        parts.append("source " + "; ".join(dict.fromkeys(l for l in lines if l)))
    return ", ".join(parts)


def _recorded(by_kernel, kernel):
    """What Inductor recorded for `kernel`, keyed by its name or by
    "name:debug handle"."""
    return [v for key, values in by_kernel.items() if key == kernel or key.startswith(kernel + ":")
            for v in values]


def _last_frame(stack_trace):
    """'file.py:12 in forward: return x / s' from an FX node's stack trace."""
    lines = [l.strip() for l in str(stack_trace).strip().splitlines() if l.strip()]
    for i in range(len(lines) - 1, -1, -1):
        if lines[i].startswith('File "'):
            code = lines[i + 1] if i + 1 < len(lines) and not lines[i + 1].startswith('File "') else ""
            where = lines[i][len('File "'):].replace('", line ', ":").replace(", in ", " in ")
            return f"{where}: {code}" if code else where
    return ""
