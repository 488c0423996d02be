"""What the guard and the tracer hand back: a :class:`StepResult` per
guarded step, a :class:`Finding` per op that made a NaN or Inf (with the
:class:`RemedyCheck` of each remedy a guard tried on it), the
:class:`NonFiniteError` that stops a caller, and the
:class:`NanGuardWarning` a guard tells its user with.

The bottom of the package: it imports nothing of nanguard's Python but the
extension, so that every other module can name these types."""
from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Literal, Optional, Tuple, cast

from . import _nanguard

#: A step's action: "step" (healthy) or the policy that acted ("data": the firewall dropped the batch).
Action = Literal["step", "skip", "backoff", "rollback", "abort", "data"]
#: A replay's verdict ("": no replay).
Verdict = Literal["", "reproduced", "not reproduced", "replay failed", "compiled only"]
#: Hardware or software (docs/hardware-or-software.md; "": not told).
Fault = Literal["", "data", "model", "compiler", "transient", "persistent"]
#: What a replay with a remedy gave (``nanguard::check_result``).
CheckResult = Literal["finite", "still_nonfinite", "not_checkable"]


class NanGuardWarning(UserWarning):
    """What a :class:`Guard` tells its user: one for each step the optimizer
    did not take (the op, the cause, what the guard did and the remedy; the
    same failure again in a few words, "again (3rd time)"), and the summary
    of a run that had one when the guard closes. Silence it with
    ``Guard(verbose=False)`` (or the callbacks' ``verbose=False``), or
    ``warnings.filterwarnings("ignore", category=nanguard.NanGuardWarning)``."""


_FLOAT_KEYS = {"value", "min", "max", "mean", "std", "first_nonfinite_value", "l2_norm", "absmax", "loss"}


def _floats(d: Any) -> Any:
    """JSON spells NaN/Inf as strings: turn them back into floats."""
    if isinstance(d, list):
        return [_floats(x) for x in d]
    if isinstance(d, dict):
        return {k: (float(v) if k in _FLOAT_KEYS and isinstance(v, str) else _floats(v))
                for k, v in d.items()}
    return d


@dataclass(frozen=True)
class RemedyCheck:
    """One remedy a guard tried on a replay of the bad step, and what came
    out (the C++ ``nanguard::remedy_check``; docs/diagnosis.md, "Verified
    remedies"). ``str(c)`` is its line: "verified finite: eps 1e-05 on the
    zero denominators of aten::div (replayed loss 0.52)".

    Attributes:
        remedy: the remedy's kind: "lr_cut", "loss_scale_cut", "skip_rows",
            "float32", "safe_softmax", "denominator_eps", "clamp_input" or
            "none" (no mechanical remedy for the cause).
        applied: what the replay changed, e.g. "eps 1e-05 on the zero
            denominators of aten::div".
        result: "finite" (the loss and every gradient finite: the remedy
            works), "still_nonfinite" or "not_checkable".
        loss: the replay's loss with the remedy (NaN when none was computed).
        detail: still_nonfinite: what stayed bad; not_checkable: why;
            finite: "" or what the replay needed (rows dropped).
    """

    remedy: str
    applied: str
    result: CheckResult
    loss: float = float("nan")
    detail: str = ""

    def __str__(self) -> str:
        return str(_nanguard.remedy_check_to_string(self.remedy, self.applied, self.result, self.loss, self.detail))


@dataclass(frozen=True, eq=False)
class Finding:
    """One op that output a NaN or Inf: op, direction, node, module, role,
    the census of its inputs and outputs, and the first bad element (the
    C++ ``nanguard::finding``, read from its JSON).

    ``f.summary()`` is one line; ``str(f)`` that line, then the cause and the
    remedy (a line each); ``f.to_text()`` every line with the census;
    ``f.to_dict()`` every field (the C++ ``to_json``).

    Its diagnosis (``nanguard::diagnose``): ``f.cause`` (e.g.
    "log_of_nonpositive", "unclassified"), ``f.evidence`` (one sentence with
    the numbers), ``f.remedy`` (what to change) and ``f.confidence``
    ("low", "medium", "high").

    A guard's finding also says whether the remedy works: ``f.remedy_checks``
    (a :class:`RemedyCheck` per remedy tried on a replay of the step) and
    ``f.verified_remedy`` (the first that kept the step finite, or None).

    Attributes:
        file: the user's file the op ran from ("" when unknown): the
            innermost Python (or TorchScript) frame outside torch and
            nanguard; a backward op's is its forward op's.
        line: the line in ``file`` (0 when unknown).
        function: the function of that line ("forward").
        op: the ATen op, e.g. "aten::div".
        direction: "forward" or "backward".
        role: "producer" (the op made the NaN/Inf from finite inputs),
            "propagator" (a non-finite input flowed through it) or "input"
            (one entered from data or a parameter: ``culprit`` names it).
        module: the dotted module path ("" if unknown).
        node: backward: the autograd node, e.g. "SqrtBackward0".
        forward_op: backward: the forward op that made the node.
        culprit: role "input": the non-finite tensor (a parameter's name or "input k").
        caller: the outermost op it ran inside ("aten::to"), if any.
        step: the training step (-1 if unknown).
        output: which output holds the bad value.
        index: the flat index of its first non-finite element.
        position: that element's index in each dimension of its output
            (``[24, 0]``: row 24, column 0).
        dataset_index: the dataset index of the batch row the bad value
            came from (-1 unknown): a guard's finding that reads a batch
            from a loader wrapped by :func:`nanguard.data.track_indices`.
        value: that element: NaN, +Inf or -Inf.
        inputs: the op's floating-point inputs: dicts of name, dtype, shape, stats (a census).
        outputs: its floating-point outputs, the same way.
        rank: distributed: the rank that saw it (-1: one process).
        cause: the likely cause, a class of docs/diagnosis.md ("unclassified" when none fits).
        evidence: the evidence for the cause, with its numbers.
        remedy: what to change, as one-liners for the front end (Python's for nanguard.trace).
        confidence: how far the evidence goes: "low", "medium" or "high".
        remedy_checks: the remedies a guard tried on a replay of the step,
            in order (empty when none was tried, and for a trace's finding).
    """

    op: str
    direction: Literal["forward", "backward"]
    role: Literal["producer", "propagator", "input"]
    module: str = ""
    node: str = ""
    forward_op: str = ""
    culprit: str = ""
    caller: str = ""
    step: int = -1
    output: int = 0
    index: int = -1
    position: List[int] = field(default_factory=list)
    dataset_index: int = -1
    value: float = 0.0
    inputs: List[Dict[str, Any]] = field(default_factory=list)
    outputs: List[Dict[str, Any]] = field(default_factory=list)
    rank: int = -1
    file: str = ""
    line: int = 0
    function: str = ""
    cause: str = "unclassified"
    evidence: str = ""
    remedy: str = ""
    confidence: str = "low"
    remedy_checks: List[RemedyCheck] = field(default_factory=list)
    _json: str = field(default="{}", repr=False, compare=False)

    @classmethod
    def from_json(cls, json_text: str) -> "Finding":
        """The finding of the C++ ``to_json``'s text."""
        d = _floats(json.loads(json_text))
        diagnosis = d.get("diagnosis", {})
        known = {f.name for f in fields(cls)} - {"_json", "cause", "evidence", "remedy", "confidence", "remedy_checks"}
        checks = [RemedyCheck(remedy=c["remedy"], applied=c["applied"], result=c["result"], loss=float(c["loss"]),
                              detail=c["detail"]) for c in d.get("remedy_checks", [])]
        d.update(d.pop("source", {}))  # file, line, function
        return cls(**{k: v for k, v in d.items() if k in known}, cause=diagnosis.get("cause", "unclassified"),
                   evidence=diagnosis.get("evidence", ""), remedy=diagnosis.get("remedy", ""),
                   confidence=diagnosis.get("confidence", "low"), remedy_checks=checks, _json=json_text)

    @property
    def verified_remedy(self) -> Optional[RemedyCheck]:
        """The first remedy check whose replay came out finite (the remedy to
        take), or None (``nanguard::verified_remedy``)."""
        return next((c for c in self.remedy_checks if c.result == "finite"), None)

    def to_dict(self) -> Dict[str, Any]:
        """Every field as a dict (inputs and outputs with their census);
        NaN and Inf values are Python floats."""
        out: Dict[str, Any] = _floats(json.loads(self._json))
        return out

    def to_json(self) -> str:
        """The finding as JSON text (``nanguard::to_json``)."""
        return self._json

    def to_text(self) -> str:
        """Several lines, with the census of every input and output."""
        return str(_nanguard.finding_to_text(self._json))

    def summary(self) -> str:
        """The one-line summary: step, direction, op, module, role and the
        first bad element (``nanguard::to_string``)."""
        return str(_nanguard.finding_to_string(self._json))

    def __str__(self) -> str:
        """The one line, then the cause (with its evidence) and the remedy,
        indented: ``cause: log_of_nonpositive (high confidence): log of a
        value at or below 0: ...`` and ``remedy: ...`` (and the verified
        remedy, for a guard's finding that has one)."""
        text = f"{self.summary()}\n  cause: {self.cause} ({self.confidence} confidence)"
        if self.evidence:
            text += f": {self.evidence}"
        if self.remedy:
            text += f"\n  remedy: {self.remedy}"
        if self.verified_remedy is not None:
            text += f"\n  verified: {self.verified_remedy}"
        return text

    def __repr__(self) -> str:
        return f"<nanguard.Finding {self.summary()}>"

    def __getattr__(self, name: str) -> Any:
        # The JSON's other fields (thread, sequence_nr, backtrace, ...) as attributes too.
        if not name.startswith("__"):
            d = json.loads(self.__dict__.get("_json", "{}"))
            if name in d:
                return _floats(d[name])
        raise AttributeError(f"nanguard.Finding has no field '{name}'")


class NonFiniteError(RuntimeError):
    """A NaN or Inf that must stop the caller; ``.finding`` says where it was
    born, and the message its likely cause and the remedy. From a Guard's
    abort, ``.result`` is the step's StepResult (its ``bundle``); None
    otherwise."""

    def __init__(self, finding: Finding, result: Optional["StepResult"] = None) -> None:
        if result is not None and result.verdict == "compiled only":
            # No eager op made it (the finding only stands for the loss): the
            # note names the compiler's stage, its kernel and the remedy.
            message = f"non-finite value: step {result.step}: {result.reason or 'non-finite step'}; {result.note}"
        else:
            message = f"non-finite value: {finding.summary()}; cause: {finding.cause}"
            if finding.remedy:
                message += f"; remedy: {finding.remedy}"
            if result is not None and result.note:  # e.g. why no repro bundle was written
                message += f"; note: {result.note}"
        super().__init__(message.replace("\n", " "))
        self.finding = finding
        self.result = result


@dataclass
class StepResult:
    """What one guarded step did: the C++ guard's step event.

    ``step`` counts from 1. ``action`` is "step" for a healthy step, else
    the policy that acted ("skip", "backoff", "rollback", "abort").
    ``reason`` says what made a bad step bad ("non-finite loss",
    "non-finite gradient", "gradient checksum differs on rank(s) 3", ...;
    "" on a healthy step) and ``note`` what else the guard noted
    (which layers moved most before a rollback, ...). ``finding`` is the
    replay's :class:`~nanguard.Finding` (or None), diagnosed with the steps
    before (``finding.cause``, ``finding.remedy``), and ``verdict``
    "reproduced" / "not reproduced" / "compiled only" (a compiled model's
    eager replay is finite, its compiled code is not: ``note`` names the
    stage and kernel) / "replay failed" / "" (no replay). ``nonfinite_params``
    lists (name, NaN/Inf count) of the gradients that held any,
    ``top_norms`` (name, norm) of the largest per-parameter gradient norms;
    ``bundle`` is the repro bundle an abort wrote and ``rollback_to`` the
    snapshot a rollback restored (steps done then); ``remedy`` is what the
    guard did about a bad step, e.g. "skipped the step; loss scale 65536 ->
    32768" ("" on a healthy step). ``forecast`` says when a loss or grad norm
    that grows step after step leaves its dtype's range ("the loss (4.1e+09)
    leaves the range 3.40282e+38 in about 26 steps (x3.1 a step)"; None when
    healthy). ``auto_fix`` is the verified op rewrite that ``Guard(auto_fix=True)``
    keeps in force from this step on ("" when none). ``fault`` says hardware
    or software (docs/hardware-or-software.md): "data", "model", "compiler",
    "transient" (a run of the same step from the same state computed
    something else: the step was run again and taken, ``skipped`` False,
    ``note`` says so) or "persistent"; "" when not told. ``signature`` is
    the step's fingerprint (16 hex digits: its loss and per-parameter
    gradient norms hashed). ``to_dict()`` gives the event log's line.
    """

    step: int
    loss: float
    grad_norm: float
    action: Action
    skipped: bool
    scale: float
    lr: float
    reason: str = ""
    first_nonfinite_param: str = ""
    finding: Optional[Finding] = None
    verdict: Verdict = ""
    spikes: List[Tuple[str, float, float]] = field(default_factory=list)
    nonfinite_params: List[Tuple[str, int]] = field(default_factory=list)
    top_norms: List[Tuple[str, float]] = field(default_factory=list)
    clip_coef: float = 1.0
    bundle: str = ""
    rollback_to: int = -1
    remedy: str = ""
    note: str = ""
    rank: int = -1
    nonfinite_ranks: List[int] = field(default_factory=list)
    forecast: Optional[str] = None
    auto_fix: str = ""
    fault: Fault = ""
    signature: str = ""
    _event: Optional[_nanguard.StepEvent] = field(default=None, repr=False, compare=False)

    @classmethod
    def from_event(cls, event: _nanguard.StepEvent) -> "StepResult":
        """The result of the C++ step event ``event``."""
        bad = event.nonfinite_params
        findings = event.findings_json
        return cls(step=event.step, loss=event.loss, grad_norm=event.grad_norm, action=cast(Action, event.action),
                   skipped=event.skipped, scale=event.scale, lr=event.lr, reason=event.reason,
                   first_nonfinite_param=bad[0][0] if bad else "",
                   finding=Finding.from_json(findings[0]) if findings else None,
                   verdict=cast(Verdict, event.verdict), spikes=event.spikes, nonfinite_params=bad,
                   top_norms=event.top_norms, clip_coef=event.clip_coef, bundle=event.bundle,
                   rollback_to=event.rollback_to, remedy=event.remedy, note=event.note, rank=event.rank,
                   nonfinite_ranks=event.nonfinite_ranks, forecast=event.forecast, auto_fix=event.auto_fix,
                   fault=cast(Fault, event.fault), signature=event.signature, _event=event)

    def to_dict(self) -> Dict[str, Any]:
        """The event as the event log holds it (``nanguard::step_event``; NaN
        and Inf as "nan", "inf", "-inf")."""
        return {} if self._event is None else cast(Dict[str, Any], json.loads(self._event.to_json()))
