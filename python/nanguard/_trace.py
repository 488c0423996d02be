"""``nanguard.trace``: the C++ tracer as a context manager, with modules
named from the Python side."""
import json
from dataclasses import dataclass

import torch

from . import _compile, _nanguard


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


#: The default rules: the -inf of masked_fill (attention masks).
DEFAULT_ALLOW = (AllowRule(op="aten::masked_fill*"),)


_FLOAT_KEYS = {"value", "min", "max", "mean", "std", "first_nonfinite_value", "l2_norm", "absmax"}


def _floats(d):
    """JSON spells NaN/Inf as strings: turn them back into floats."""
    if isinstance(d, list):
        return [_floats(x) for x in d]
    if isinstance(d, dict):
        return {k: (float(v) if k in _FLOAT_KEYS and isinstance(v, str) else _floats(v))
                for k, v in d.items()}
    return d


class Finding:
    """One op that output a NaN or Inf: op, direction, node, module, role,
    the census of its inputs and outputs, and the first bad element.

    ``str(f)`` is one line, ``f.to_text()`` several, ``f.to_dict()`` every
    field (the C++ ``to_json``). Fields are also attributes: ``f.op``,
    ``f.direction``, ``f.node``, ``f.forward_op``, ``f.role``, ``f.module``,
    ``f.culprit``, ``f.step``, ``f.index``, ``f.value``, ``f.inputs``,
    ``f.outputs``.

    Its diagnosis (``nanguard::diagnose``): ``f.cause`` (e.g.
    "log_of_nonpositive", "unclassified"), ``f.evidence`` (one sentence with
    the numbers), ``f.remedy`` (what to change) and ``f.confidence``
    ("low", "medium", "high").
    """

    def __init__(self, json_text):
        self._json = json_text
        self._dict = _floats(json.loads(json_text))

    def to_dict(self):
        """Every field as a dict (inputs and outputs with their census);
        NaN and Inf values are Python floats."""
        return _floats(json.loads(self._json))

    def to_json(self):
        """The finding as JSON text (``nanguard::to_json``)."""
        return self._json

    def to_text(self):
        """Several lines, with the census of every input and output."""
        return _nanguard.finding_to_text(self._json)

    def __str__(self):
        return _nanguard.finding_to_string(self._json)

    def __repr__(self):
        return f"<nanguard.Finding {self}>"

    @property
    def cause(self):
        """The likely cause, a class of docs/diagnosis.md ("unclassified" when none fits)."""
        return self._dict["diagnosis"]["cause"]

    @property
    def evidence(self):
        """The evidence for the cause, with its numbers."""
        return self._dict["diagnosis"]["evidence"]

    @property
    def remedy(self):
        """What to change, with C++ and Python one-liners."""
        return self._dict["diagnosis"]["remedy"]

    @property
    def confidence(self):
        """How far the evidence goes: "low", "medium" or "high"."""
        return self._dict["diagnosis"]["confidence"]

    def __getattr__(self, name):
        d = self.__dict__.get("_dict")
        if d is not None and name in d:
            return d[name]
        raise AttributeError(f"nanguard.Finding has no field '{name}'")


class NonFiniteError(RuntimeError):
    """A NaN or Inf that must stop the caller; ``.finding`` says where it was
    born. From a Guard's abort, ``.result`` is the step's StepResult (its
    ``bundle``); None otherwise."""

    def __init__(self, finding, result=None):
        super().__init__("non-finite value: " + str(finding))
        self.finding = finding
        self.result = result


def open_module_scopes(model, prefix=""):
    """Opens a nanguard scope (scope.h) around the forward of every submodule
    of ``model``, so that findings name modules; returns the function that
    removes the hooks again (and closes the scopes a forward that raised
    left open)."""
    depth = _nanguard.scope_depth()
    stack = []  # qualified names of the modules running now
    hooks = []

    def make(name):
        def pre(module, args):
            top = stack[-1] if stack else prefix
            if not top:
                rel = name
            elif name.startswith(top + "."):
                rel = name[len(top) + 1:]
            else:
                rel = name  # run outside its parent: nests under the open scope
            _nanguard.scope_push(rel)
            stack.append(name)

        def post(module, args, output):
            if stack and stack[-1] == name:
                stack.pop()
                _nanguard.scope_pop()

        return pre, post

    for name, module in _compile.original_module(model).named_modules():
        if not name:
            continue  # the model itself: findings name paths inside it
        pre, post = make(f"{prefix}.{name}" if prefix else name)
        hooks.append(module.register_forward_pre_hook(pre))
        hooks.append(module.register_forward_hook(post))

    def close():
        for h in hooks:
            h.remove()
        while _nanguard.scope_depth() > depth:  # a forward that raised
            _nanguard.scope_pop()

    return close


class Trace:
    """Checks the output of every forward and backward op while active.

    Made by :func:`trace`; use it as a context manager. ``findings`` lists
    what was found, first first; ``check()`` raises :class:`NonFiniteError`
    when ``raise_on_finding`` is set and something was found.

    NOTE: ATen swallows exceptions thrown inside op observers, so nothing is
    raised inside the op: the error comes at ``check()`` or at the exit of
    the ``with`` block.
    """

    def __init__(self, model=None, max_findings=1, raise_on_finding=False, allow=DEFAULT_ALLOW,
                 step=0, capture_backtrace=False, prefix="", measure_cost=False, inside_kernels=False):
        if max_findings < 1:
            raise ValueError(f"nanguard.trace: max_findings must be >= 1, got {max_findings}")
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError("nanguard.trace: model must be an nn.Module (its modules name the findings) or None, "
                            f"got {type(model).__name__}")
        self.model = model
        self.max_findings = int(max_findings)
        self.raise_on_finding = bool(raise_on_finding)
        self.allow = tuple(allow)
        for r in self.allow:
            if not isinstance(r, AllowRule):
                raise TypeError(f"nanguard.trace: allow takes AllowRule objects, got {type(r).__name__}")
        self.step = step
        self.capture_backtrace = capture_backtrace
        self.prefix = prefix
        self.measure_cost = bool(measure_cost)
        self.inside_kernels = bool(inside_kernels)
        self._cost = None
        self._tracer = None
        self._close_scopes = None
        self._end_eager_run = None
        self._findings = None

    # -- the context manager ------------------------------------------------
    def __enter__(self):
        if self._tracer is not None:
            raise RuntimeError("nanguard.trace: this trace is already active")
        rules = [(r.op, r.module, r.nan, r.pos_inf, r.neg_inf) for r in self.allow]
        self._findings = None
        _compile.watch_compilation()
        self._tracer = _nanguard.Tracer(self.max_findings, self.capture_backtrace, rules, self.measure_cost,
                                         self.inside_kernels)
        try:
            self._end_eager_run = _compile.begin_eager_run()
            self._tracer.set_step(int(self.step))
            if self.model is not None:
                self.name_parameters(self.model, self.prefix)
                self._close_scopes = open_module_scopes(self.model, self.prefix)
        except BaseException:
            self._close()
            raise
        return self

    def __exit__(self, exc_type, exc, tb):
        self._close()
        if exc_type is None:
            self.check()
        return False

    def _close(self):
        if self._close_scopes is not None:
            self._close_scopes()
            self._close_scopes = None
        if self._end_eager_run is not None:
            end, self._end_eager_run = self._end_eager_run, None
            end()
        if self._tracer is not None:
            tracer, self._tracer = self._tracer, None
            try:
                self._findings = [Finding(j) for j in tracer.findings_json()]
                self._cost = tracer.cost()
            finally:  # whatever reading them raised, this thread is free again
                tracer.close()

    # -- the API --------------------------------------------------------------
    def name_parameters(self, model, prefix=""):
        """Names the parameters of ``model`` (and through them, modules)."""
        named = [((f"{prefix}.{n}" if prefix else n), p)
                 for n, p in _compile.original_module(model).named_parameters()]
        self._active().name_parameters(named)

    def name_tensor(self, tensor, name):
        """Names one tensor, e.g. the input batch ("batch"); a finding with role
        input then names it as the culprit."""
        self._active().name_tensor(tensor, name)

    def set_step(self, step):
        """The step findings are tagged with."""
        self.step = step
        self._active().set_step(int(step))

    @property
    def findings(self):
        """The findings so far (or of the finished ``with`` block), first first."""
        if self._tracer is not None:
            return [Finding(j) for j in self._tracer.findings_json()]
        return list(self._findings or [])

    @property
    def cost(self):
        """What the tracer cost, with ``measure_cost=True`` (else zeros): a dict
        of ``ops``, ``scans``, ``scanned_bytes``, ``seconds`` inside its
        callbacks (``scan_seconds`` of them reading tensors), and
        ``scans_by_op``, (op, scans, bytes) most bytes first."""
        if self._tracer is not None:
            return self._tracer.cost()
        return dict(self._cost or {})

    @property
    def found(self):
        """True when there is at least one finding."""
        return bool(self.findings)

    def clear(self):
        """Forgets the findings and checks again."""
        if self._tracer is not None:
            self._tracer.clear()
        self._findings = []

    def check(self):
        """Raises NonFiniteError with the first finding, if raise_on_finding is set."""
        if self.raise_on_finding:
            f = self.findings
            if f:
                raise NonFiniteError(f[0])

    def _active(self):
        if self._tracer is None:
            raise RuntimeError("nanguard.trace: not active (use it in a 'with' block)")
        return self._tracer


def trace(model=None, max_findings=1, raise_on_finding=False, allow=DEFAULT_ALLOW, step=0,
          capture_backtrace=False, measure_cost=False, inside_kernels=False):
    """A context manager that checks every forward and backward op's output.

    With ``model`` (an ``nn.Module``) findings name its modules (by forward
    hooks that open nanguard scopes; no per-tensor work in Python) and its
    parameters. The tracer observes the thread that enters the block.

        with nanguard.trace(model, raise_on_finding=True) as t:
            loss = loss_fn(model(x), y)
            loss.backward()
        # NonFiniteError here, at the exit, when an op made a NaN/Inf

    Code compiled with ``torch.compile`` runs eagerly inside the block
    (``torch.compiler.set_stance("force_eager")``), so that every op is
    checked, as in the model's own code; the compiled graphs are used again
    after the block, without recompiling. A compiled ``model``'s modules are
    named as in the model (``fc1``, not ``_orig_mod.fc1``).

    ``allow`` lists :class:`AllowRule` for intentional infinities (default:
    the -inf of masked_fill). ``max_findings`` stops checking after that many.
    ``measure_cost`` times the tracer's callbacks and counts what it reads
    (``Trace.cost``). ``inside_kernels`` also checks the ops a kernel runs
    inside itself, naming the inner op (``aten::sum`` inside ``aten::mean``)
    for half as much again per op; off, the kernel is named.
    """
    return Trace(model, max_findings=max_findings, raise_on_finding=raise_on_finding, allow=allow,
                 step=step, capture_backtrace=capture_backtrace, measure_cost=measure_cost,
                 inside_kernels=inside_kernels)
