"""``nanguard.trace``: the C++ tracer as a context manager, with modules
named from the Python side."""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Set, Tuple, Type

import torch
import torch.utils._pytree
from torch.optim.optimizer import register_optimizer_step_post_hook

from . import _args, _compile, _nanguard
from ._args import boolean, instance, integer, sequence_of, text, wrong_type
from ._batches import named_call_tensors
from ._log import tell, warnings_last
from ._results import Finding, NonFiniteError


@dataclass(frozen=True)
class AllowRule:
    """Non-finite values an op may produce on purpose.

    ``op`` and ``module`` are globs ("aten::masked_fill*", "*.self_attn");
    empty matches everything. By default only ``-inf`` is allowed.
    """

    op: str = ""
    module: str = ""
    nan: bool = False
    pos_inf: bool = False
    neg_inf: bool = True

    def __post_init__(self) -> None:
        for name in ("op", "module"):
            text("nanguard.AllowRule", name, getattr(self, name))
        for name in ("nan", "pos_inf", "neg_inf"):
            boolean("nanguard.AllowRule", name, getattr(self, name))


def _allow_rule(where: str, name: str, rule: Any) -> AllowRule:
    return instance(where, name, rule, AllowRule, "a nanguard.AllowRule")


#: The default rules: the -inf of masked_fill (attention masks).
DEFAULT_ALLOW = (AllowRule(op="aten::masked_fill*"),)


def _scripted(module: torch.nn.Module) -> bool:
    """True for a TorchScript module, which takes no Python hooks: the tracer
    names the ops it runs from TorchScript's own module hierarchy."""
    return isinstance(module, torch.jit.ScriptModule)


def _output_tensors(output: Any) -> List[torch.Tensor]:
    """The tensors a model's forward returned: the leaves of its pytree
    (tuples, lists, dicts, a Hugging Face ``ModelOutput``) and, inside an
    object torch's pytree does not open, the tensors its attributes hold,
    as deep as they go: a Hugging Face ``Cache`` (``DynamicCache``: its
    layers' keys and values), which generation hands to the next forward.
    A module held there is not opened (its parameters are no output)."""
    tensors: List[torch.Tensor] = []
    opened: Set[int] = set()

    def walk(value: Any) -> None:
        for leaf in torch.utils._pytree.tree_leaves(value):
            if isinstance(leaf, torch.Tensor):
                tensors.append(leaf)
            elif hasattr(leaf, "__dict__") and not isinstance(leaf, (torch.nn.Module, type)) \
                    and id(leaf) not in opened:
                opened.add(id(leaf))
                walk(vars(leaf))

    walk(output)
    return tensors


def open_module_scopes(model: torch.nn.Module, prefix: str = "") -> Callable[[], None]:
    """Opens a nanguard scope (scope.h) around the forward of every submodule
    of ``model``, so that findings name modules; returns the function that
    removes the hooks again (and closes the scopes a forward that raised
    left open). A TorchScript module (``torch.jit.script``) and what it holds
    get no hooks: the tracer reads their names from TorchScript's scope.

    The hooks are global (``register_module_forward_pre_hook``), looking the
    module up by identity, so that no module holds a hook of its own: a
    module with hooks leaves its fast path (``nn.TransformerEncoderLayer``
    in eval runs its fused kernel only when none of its modules has one),
    and the traced step must compute what the untraced step computes."""
    depth = _nanguard.scope_depth()
    stack: List[str] = []  # qualified names of the modules running now
    names: Dict[int, str] = {}  # the hooked modules' qualified names, by id
    scripted: List[str] = []  # names of the TorchScript modules met: nothing inside them is hooked
    for name, module in _compile.original_module(model).named_modules():
        if _scripted(module) or any(name.startswith(s + ".") for s in scripted):
            scripted.append(name)
        elif name:  # not the model itself: findings name paths inside it
            names[id(module)] = f"{prefix}.{name}" if prefix else name

    def pre(module: torch.nn.Module, args: Any) -> None:
        name = names.get(id(module))
        if name is None:
            return
        top = stack[-1] if stack else prefix
        if not top:
            rel = name
        elif name.startswith(top + "."):
            rel = name[len(top) + 1:]
        else:
            rel = name  # run outside its parent: nests under the open scope
        _nanguard.scope_push(rel)
        stack.append(name)

    def post(module: torch.nn.Module, args: Any, output: Any) -> None:
        name = names.get(id(module))
        if name is not None and stack and stack[-1] == name:
            stack.pop()
            _nanguard.scope_pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
             torch.nn.modules.module.register_module_forward_hook(post)]

    def close() -> None:
        for h in hooks:
            h.remove()
        while _nanguard.scope_depth() > depth:  # a forward that raised
            _nanguard.scope_pop()

    return close


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, *handles: Any) -> None:
        self.handles = handles

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


class Trace:
    """Checks the output of every forward and backward op while active.

    Made by :func:`trace`; use it as a context manager. ``findings`` lists
    what was found, first first; ``check()`` raises :class:`NonFiniteError`
    when ``raise_on_finding`` is set and something was found. Otherwise, with
    ``warn`` (the default), the exit of the ``with`` block tells the first
    finding as a :class:`NanGuardWarning` and a record of the ``nanguard``
    logger.

    NOTE: ATen swallows exceptions thrown inside op observers, so nothing is
    raised inside the op: the error comes at ``check()`` or at the exit of
    the ``with`` block.
    """

    def __init__(self, model: Optional[torch.nn.Module] = None, max_findings: int = 1, raise_on_finding: bool = False,
                 allow: Iterable[AllowRule] = DEFAULT_ALLOW, step: int = 0, capture_backtrace: bool = False,
                 prefix: str = "", measure_cost: bool = False, inside_kernels: bool = False,
                 warn: bool = True) -> None:
        where = "nanguard.trace"
        if model is not None and not isinstance(model, torch.nn.Module):
            raise wrong_type(where, "model", "an nn.Module (its modules name the findings) or None", model)
        self.model = model
        self.max_findings = integer(where, "max_findings", max_findings, minimum=1)
        self.raise_on_finding = boolean(where, "raise_on_finding", raise_on_finding)
        self.allow = tuple(sequence_of(_allow_rule, where, "allow", allow, "a list of nanguard.AllowRule"))
        self.step = integer(where, "step", step)
        self.capture_backtrace = boolean(where, "capture_backtrace", capture_backtrace)
        self.prefix = text(where, "prefix", prefix)
        self.measure_cost = boolean(where, "measure_cost", measure_cost)
        self.inside_kernels = boolean(where, "inside_kernels", inside_kernels)
        self.warn = boolean(where, "warn", warn)
        self._cost: Optional[Dict[str, Any]] = None
        self._tracer: Optional[_nanguard.Tracer] = None
        self._close_scopes: Optional[Callable[[], None]] = None
        self._judge_outputs: Optional[Any] = None  # the hook's RemovableHandle
        self._end_eager_run: Optional[Callable[[], None]] = None
        self._optimizer_hook: Optional[Any] = None  # the RemovableHandle of _optimizer_stepped
        self._findings: Optional[List[Finding]] = None
        # What name_tensor named, by id (a tensor compares by value): kept over the argument names.
        self._named_by_user: Dict[int, "weakref.ref[torch.Tensor]"] = {}

    # -- the context manager ------------------------------------------------
    def __enter__(self) -> "Trace":
        if self._tracer is not None:
            raise RuntimeError("nanguard.trace: this trace is already active")
        rules = [(r.op, r.module, r.nan, r.pos_inf, r.neg_inf) for r in self.allow]
        self._findings = None
        _compile.watch_compilation()
        self._tracer = _nanguard.Tracer(self.max_findings, self.capture_backtrace, rules, self.measure_cost,
                                         self.inside_kernels, record_sources=True)
        try:
            self._end_eager_run = _compile.begin_eager_run()
            self._tracer.set_step(self.step)
            self._optimizer_hook = register_optimizer_step_post_hook(self._optimizer_stepped)
            if self.model is not None:
                self.name_parameters(self.model, self.prefix)
                self._close_scopes = open_module_scopes(self.model, self.prefix)
                self._judge_outputs = self._hook_outputs(self.model)
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, exc_type: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> Literal[False]:
        self._close()
        if exc_type is None:
            self.check()
        with warnings_last(exc):  # the block's error wins over the finding's warning
            self._tell()
        return False

    def _tell(self) -> None:
        """At the block's exit, with ``warn`` and no ``raise_on_finding``: the
        first finding as a warning (and a ``nanguard`` log record)."""
        findings = self.findings
        if self.warn and not self.raise_on_finding and findings:
            more = f"\n  ({len(findings) - 1} more in Trace.findings)" if len(findings) > 1 else ""
            tell(f"nanguard: trace found a non-finite value: {findings[0]}{more}")

    def _hook_outputs(self, model: torch.nn.Module) -> Any:
        """After each forward of ``model``, the tracer judges what was found by
        what reaches its outputs (``tracer::judge_by_outputs``; a cache's
        tensors among them): in a pass with no backward nothing else does. A pass that left nothing to judge (a
        healthy one) skips collecting the outputs. Returns the hook's handle."""
        model = _compile.original_module(model)

        def judge(module: torch.nn.Module, args: Any, output: Any) -> None:
            if module is model and self._tracer is not None and self._tracer.awaits_judgement():
                self._tracer.judge_by_outputs(_output_tensors(output))

        def name_arguments(module: torch.nn.Module, args: Any) -> None:
            if module is model and self._tracer is not None:
                self._name_arguments(model, args)

        # Global, as the scopes' hooks (see open_module_scopes): a hook of
        # the model's own would turn its fast path off. A TorchScript module
        # takes none of its own either; a call from Python still runs these.
        return _Handles(torch.nn.modules.module.register_module_forward_pre_hook(name_arguments),
                        torch.nn.modules.module.register_module_forward_hook(judge))

    def _name_arguments(self, model: torch.nn.Module, args: Tuple[Any, ...]) -> None:
        """Names the tensors ``model`` was called with as the guard names a
        closure's (``named_call_tensors``: ``x``, ``x[1]`` inside a tuple, a
        dict's key), so that a NaN the data brought in is named as the
        user's code names it."""
        for leaf, path in zip(*named_call_tensors(model.forward, args, {})):
            named = self._named_by_user.get(id(leaf))
            if named is None or named() is not leaf:
                self._active().name_tensor(leaf, path)

    def _optimizer_stepped(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """After the step of any torch.optim optimizer: what the tracer knows of
        its state (Adam's moments) outlasts the step, so the next step's update
        does not read the state again (``tracer::keep_known_across_steps``).
        Only the optimizer's own ops write its state."""
        if self._tracer is not None:
            self._tracer.keep_known_across_steps([v for state in optimizer.state.values() if isinstance(state, dict)
                                                  for v in state.values() if isinstance(v, torch.Tensor)])

    def _close(self) -> None:
        if self._optimizer_hook is not None:
            self._optimizer_hook.remove()
            self._optimizer_hook = None
        if self._judge_outputs is not None:
            self._judge_outputs.remove()
            self._judge_outputs = None
        if self._close_scopes is not None:
            self._close_scopes()
            self._close_scopes = None
        if self._end_eager_run is not None:
            end, self._end_eager_run = self._end_eager_run, None
            end()
        if self._tracer is not None:
            tracer, self._tracer = self._tracer, None
            try:
                self._findings = [Finding.from_json(j) for j in tracer.findings_json()]
                self._cost = tracer.cost()
            finally:  # whatever reading them raised, this thread is free again
                tracer.close()

    # -- the API --------------------------------------------------------------
    def name_parameters(self, model: torch.nn.Module, prefix: str = "") -> None:
        """Names the parameters of ``model`` (and through them, modules)."""
        instance("nanguard.Trace.name_parameters", "model", model, torch.nn.Module, "an nn.Module")
        text("nanguard.Trace.name_parameters", "prefix", prefix)
        named = [((f"{prefix}.{n}" if prefix else n), p)
                 for n, p in _compile.original_module(model).named_parameters()]
        self._active().name_parameters(named)

    def name_tensor(self, tensor: torch.Tensor, name: str) -> None:
        """Names one tensor of the data, e.g. the input batch ("batch"); a
        finding with role input then names it as the culprit (in place of
        the model's argument name the trace gives it)."""
        self._active().name_tensor(_args.tensor("nanguard.Trace.name_tensor", "tensor", tensor),
                                   text("nanguard.Trace.name_tensor", "name", name))
        self._named_by_user[id(tensor)] = weakref.ref(tensor)

    def set_step(self, step: int) -> None:
        """The step findings are tagged with."""
        self.step = integer("nanguard.Trace.set_step", "step", step)
        self._active().set_step(self.step)

    @property
    def findings(self) -> List[Finding]:
        """The findings so far (or of the finished ``with`` block), first first."""
        if self._tracer is not None:
            return [Finding.from_json(j) for j in self._tracer.findings_json()]
        return list(self._findings or [])

    @property
    def cost(self) -> Dict[str, Any]:
        """What the tracer cost, with ``measure_cost=True`` (else zeros): a dict
        of ``ops``, ``scans``, ``scanned_bytes``, ``seconds`` inside its
        callbacks (``scan_seconds`` of them reading tensors), and
        ``scans_by_op``, (op, scans, bytes) most bytes first."""
        if self._tracer is not None:
            return self._tracer.cost()
        return dict(self._cost or {})

    @property
    def found(self) -> bool:
        """True when there is at least one finding."""
        return bool(self.findings)

    def clear(self) -> None:
        """Forgets the findings and checks again."""
        if self._tracer is not None:
            self._tracer.clear()
        self._findings = []

    def check(self) -> None:
        """Raises NonFiniteError with the first finding, if raise_on_finding is set."""
        if self.raise_on_finding:
            f = self.findings
            if f:
                raise NonFiniteError(f[0])

    def _active(self) -> _nanguard.Tracer:
        if self._tracer is None:
            raise RuntimeError("nanguard.trace: not active (use it in a 'with' block)")
        return self._tracer


def trace(model: Optional[torch.nn.Module] = None, max_findings: int = 1, raise_on_finding: bool = False,
          allow: Iterable[AllowRule] = DEFAULT_ALLOW, step: int = 0, capture_backtrace: bool = False,
          measure_cost: bool = False, inside_kernels: bool = False, warn: bool = True) -> Trace:
    """A context manager that checks every forward and backward op's output.

    With ``model`` (an ``nn.Module``) findings name its modules (by global
    forward hooks that open nanguard scopes, so that no module holds a hook
    and fused fast paths such as ``nn.TransformerEncoderLayer``'s in eval
    still run; no per-tensor work in Python) and its
    parameters, and each forward of ``model`` that left something to judge
    (not a healthy one) hands its outputs to the tracer: a pass with no
    backward (evaluation, ``torch.no_grad()``, generation) is judged by what
    reaches them (a Hugging Face ``DynamicCache`` among them: its keys and
    values), so that a causal mask's intended ``-inf`` is no finding there
    either. A ``torch.jit.ScriptModule`` takes no hooks
    of its own: TorchScript names its modules. The tracer observes the
    thread that enters the block.

        with nanguard.trace(model, raise_on_finding=True) as t:
            loss = loss_fn(model(x), y)
            loss.backward()
        # NonFiniteError here, at the exit, when an op made a NaN/Inf
        # (raise_on_finding=False: a NanGuardWarning there instead)

    Code compiled with ``torch.compile`` runs eagerly inside the block
    (``torch.compiler.set_stance("force_eager")``), so that every op is
    checked, as in the model's own code; the compiled graphs are used again
    after the block, without recompiling. A compiled ``model``'s modules are
    named as in the model (``fc1``, not ``_orig_mod.fc1``).

    Args:
        model: names the findings' modules and parameters (None: unnamed).
        max_findings: stop checking after that many findings.
        raise_on_finding: raise :class:`NonFiniteError` at the block's exit
            (or at ``check()``) when something was found.
        allow: :class:`AllowRule` for intentional infinities (default: the
            -inf of masked_fill).
        step: the step the findings are tagged with.
        capture_backtrace: keep each finding's C++ call site.
        measure_cost: time the tracer's callbacks and count what it reads
            (``Trace.cost``).
        inside_kernels: also check the ops a kernel runs inside itself,
            naming the inner op (``aten::sum`` inside ``aten::mean``), for
            half as much again per op; off, the kernel is named.
        warn: at the block's exit, tell the first finding (when there is
            one and ``raise_on_finding`` is off) as a
            :class:`NanGuardWarning` and a WARNING record of the
            ``nanguard`` logger (its one line, cause and remedy);
            ``warn=False``: silent, the findings only in ``Trace.findings``.

    Returns:
        The :class:`Trace`, to use in a ``with`` block: ``t.findings``.

    Raises:
        TypeError: an argument of the wrong type, named: ``model`` not an
            ``nn.Module``, ``allow`` not a list of AllowRule, ``max_findings``
            or ``step`` not an int, a flag not a bool.
        ValueError: ``max_findings`` < 1.
    """
    return Trace(model, max_findings=max_findings, raise_on_finding=raise_on_finding, allow=allow,
                 step=step, capture_backtrace=capture_backtrace, measure_cost=measure_cost,
                 inside_kernels=inside_kernels, warn=warn)
