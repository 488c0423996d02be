"""Every public entry point of the Python API, each of its arguments given a
value of each kind (None, a str, a float, a tensor, a list) with the others
right: a kind the argument's annotation does not take is a TypeError or
ValueError whose message names the argument (issue #60); a kind it takes
raises nothing else. The arguments are read from the signatures, so a new
argument is in the matrix as soon as an entry point has it."""
import ast
import inspect

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard
import nanguard.data
import nanguard.tensorboard
from nanguard import _nanguard

KINDS = {"None": None, "str": "abc", "float": 2.7, "tensor": torch.ones(2), "list": [1, 2]}
#: The types (an annotation's text, up to its first "[") that take each kind.
TAKES = {"None": {"None"}, "str": {"str", "PathLike", "os.PathLike"}, "float": {"float"},
         "tensor": {"torch.Tensor", "Tensor"}, "list": {"Sequence", "List", "Iterable", "list"}}
#: The aliases the signatures use.
ALIASES = {"Field": "Union[int, str, None]", "PathLike": "str", "StepEvent": "Union[StepResult, dict, str]",
           "NoneType": "None"}


def types(annotation):
    """The types of an annotation's text, a Union or Optional opened."""
    annotation = annotation.replace("typing.", "").removeprefix("ForwardRef(").removesuffix(")").strip("'\"")
    annotation = ALIASES.get(annotation, annotation)
    for union in ("Optional[", "Union["):
        if annotation.startswith(union):
            inner, depth, start, out = annotation[len(union):-1], 0, 0, ["None"] if union == "Optional[" else []
            for i, c in enumerate(inner + ","):
                depth += (c == "[") - (c == "]")
                if c == "," and depth == 0:
                    out += types(inner[start:i].strip())
                    start = i + 1
            return out
    return [annotation.split("[")[0]]


def takes(annotation, kind):
    return any(t == "Any" or t in TAKES[kind] for t in types(annotation))


def model_and_optimizer():
    model = nn.Linear(4, 1)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def guard():
    return nanguard.Guard(*model_and_optimizer(), verbose=False)


def begun_guard():
    g = guard()
    g.begin_step()
    return g


def in_trace(method):
    """A call of the Trace method ``method`` inside a trace's block."""
    def call(**kwargs):
        with nanguard.trace(warn=False) as t:
            getattr(t, method)(**kwargs)
    return call


X = torch.randn(8, 4)
FIREWALL = nanguard.Firewall(nonfinite="drop")
LINE = '{"step": 1, "loss": 0.5, "action": "step"}'


def entry_points(tmp_path):
    """(name, function whose signature lists the arguments, call, right arguments)."""
    model, _ = model_and_optimizer()
    csv = tmp_path / "a.csv"
    csv.write_text("a,b\n1,2\n")
    forest = nanguard.IsolationForest(n_estimators=4, max_samples=8).fit(torch.randn(16, 2))
    fitted = nanguard.Firewall().fit(torch.randn(16, 4))
    entries = [
        ("census", nanguard.census, None, dict(tensor=X, local=False)),
        ("has_nonfinite", nanguard.has_nonfinite, None, dict(tensor=X, local=False)),
        ("census_many", nanguard.census_many, None, dict(tensors=[X], local=False)),
        ("check_many", nanguard.check_many, None, dict(tensors=[X], local=False)),
        ("mark_written", nanguard.mark_written, None, dict(tensor=X)),
        ("trace", nanguard.trace, None,
         dict(model=model, max_findings=1, raise_on_finding=False, allow=(), step=0, capture_backtrace=False,
              measure_cost=False, inside_kernels=False, warn=True)),
        ("Trace.name_parameters", nanguard.Trace.name_parameters, in_trace("name_parameters"),
         dict(model=model, prefix="")),
        ("Trace.name_tensor", nanguard.Trace.name_tensor, in_trace("name_tensor"),
         dict(tensor=X, name="x")),
        ("Trace.set_step", nanguard.Trace.set_step, in_trace("set_step"), dict(step=1)),
        ("AllowRule", nanguard.AllowRule, None, dict(op="", module="", nan=False, pos_inf=False, neg_inf=True)),
        ("Guard", nanguard.Guard, None, dict(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))),
        ("Guard.step", nanguard.Guard.step, lambda **k: guard().step(**k), dict(closure=lambda: model(X).sum())),
        ("Guard.step_accumulated", nanguard.Guard.step_accumulated, lambda **k: guard().step_accumulated(**k),
         dict(closure=lambda: model(X).sum(), micro_batches=[()])),
        ("Guard.begin_step", nanguard.Guard.begin_step, lambda **k: guard().begin_step(**k), dict(step=0)),
        ("Guard.check", nanguard.Guard.check, lambda **k: begun_guard().check(**k),
         dict(loss=torch.tensor(float("nan")), replay=None, batch=(), names=())),
        ("report", nanguard.report, None, dict(events=str(tmp_path / "no.jsonl"), out_html=str(tmp_path / "r.html"),
                                               title=None, tensorboard=None)),
        ("inspect", nanguard.inspect, None, dict(bundle=str(tmp_path / "no-bundle"))),
        ("Firewall", nanguard.Firewall, None,
         dict(nonfinite="drop", outliers="ignore", rule="quantile_range", low_quantile=0.001, high_quantile=0.999,
              sigmas=3.0, robust_z=5.0, nan_value=0.0, label_columns=[], column_names=[])),
        ("Firewall.fit", nanguard.Firewall.fit, lambda **k: nanguard.Firewall().fit(**k), dict(data=X)),
        ("Firewall.apply", nanguard.Firewall.apply, lambda **k: fitted.apply(**k), dict(batch=X)),
        ("IsolationForest", nanguard.IsolationForest, None,
         dict(n_estimators=4, max_samples=8, contamination=0.0, seed=0)),
        *[(f"IsolationForest.{m}", getattr(nanguard.IsolationForest, m),
           lambda m=m, **k: getattr(forest, m)(**k), dict(x=torch.randn(3, 2)))
          for m in ("fit", "score_samples", "decision_function", "predict")],
        ("WarmupCosine", nanguard.WarmupCosine, None, dict(base_lr=0.1, warmup_steps=0, total_steps=10, min_lr=0.0)),
        ("WarmupCosine.lr", nanguard.WarmupCosine.lr, lambda **k: nanguard.WarmupCosine(0.1).lr(**k), dict(step=1)),
        ("data.track_indices", nanguard.data.track_indices, None,
         dict(loader=torch.utils.data.DataLoader([X[0]]))),
        ("data.read_csv", nanguard.data.read_csv, None, dict(path=str(csv), delimiter=",")),
        ("data.FirewallDataset", nanguard.data.FirewallDataset, None,
         dict(dataset=[X[0]], firewall=FIREWALL, policy=None, field=None, event_log=None)),
        ("data.FirewallIterableDataset", nanguard.data.FirewallIterableDataset, None,
         dict(dataset=[X[0]], firewall=FIREWALL, field=None, event_log=None)),
        ("data.firewall_collate", nanguard.data.firewall_collate, None,
         dict(firewall=FIREWALL, collate_fn=torch.stack, field=None, event_log=None)),
        ("tensorboard.step_scalars", nanguard.tensorboard.step_scalars, None, dict(result=LINE)),
        ("tensorboard.step_text", nanguard.tensorboard.step_text, None, dict(result=LINE)),
    ]
    if _has("tensorboard"):
        entries += [
            ("tensorboard.StepLogger", nanguard.tensorboard.StepLogger, None,
             dict(writer=str(tmp_path / "tb"), flush_every_step=True)),
            ("tensorboard.StepLogger.log", nanguard.tensorboard.StepLogger.log,
             lambda **k: nanguard.tensorboard.StepLogger(str(tmp_path / "tb")).log(**k),
             dict(result=LINE, walltime=None)),
        ]
    for module, callback in (("lightning", "NanGuard"), ("transformers", "NanGuardCallback")):
        if _has(module):
            cls = getattr(__import__(f"nanguard.integrations.{module}", fromlist=[callback]), callback)
            entries.append((callback, cls, None,
                            dict(policy="auto", event_log=None, bundle_dir=None, max_norm=0.0, log_metrics=True)))
    return entries


def _has(module):
    try:
        __import__(module)
        return True
    except ImportError:
        return False


def arguments(fn):
    """The named arguments of ``fn`` (not self, *args, **kwargs) and their annotations as text."""
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    return {p.name: p.annotation if isinstance(p.annotation, str) else inspect.formatannotation(p.annotation)
            for p in params}


def test_every_argument_of_every_entry_point_is_named_when_wrong(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # "abc" is a valid path: made here
    wrong = []
    for name, fn, call, right in entry_points(tmp_path):
        call = call or fn
        annotations = arguments(fn)
        if name == "Guard":  # the options too, each with its default
            right = {**right, **{o.name: inspect.signature(fn).parameters[o.name].default
                                 for o in _nanguard.GUARD_OPTION_TABLE}}
        assert set(annotations) == set(right), f"{name}: the matrix lists {sorted(right)}, the signature " \
                                               f"{sorted(annotations)}"
        for argument, annotation in annotations.items():
            for kind, value in KINDS.items():
                try:  # any other exception fails the test
                    call(**{**right, argument: value})
                    outcome = None
                except (TypeError, ValueError, OSError) as e:
                    outcome = e
                if not takes(annotation, kind) and (isinstance(outcome, (type(None), OSError))
                                                    or argument not in str(outcome)):
                    wrong.append(f"{name}({argument}={kind}) [{annotation}]: {outcome!r}")
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("name", ["Firewall", "IsolationForest", "WarmupCosine", "Distributed"])
def test_the_checked_classes_keep_the_extensions_signature(name):
    """nanguard.Firewall (...) check their arguments in Python: the same
    names and defaults as the extension's class."""
    doc = getattr(_nanguard, name).__init__.__doc__.splitlines()[0]
    params = doc[doc.index("(") + 1:doc.rindex(") ->")].split(", ", 1)[1]  # without self
    extension = ast.parse(f"def f({params}): pass").body[0].args
    defaults = [ast.literal_eval(d) for d in extension.defaults]
    expected = dict(zip([a.arg for a in extension.args][-len(defaults):], defaults))
    ours = inspect.signature(getattr(nanguard, name)).parameters
    assert [a.arg for a in extension.args] == list(ours)
    assert {n: list(p.default) if isinstance(p.default, tuple) else p.default
            for n, p in ours.items() if p.default is not p.empty} == expected
