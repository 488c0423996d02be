"""Each cause's remedy, as written, works on a case of that cause: the case
is traced, its finding has the cause, and the remedy's own code (the
snippet in backquotes, run as it stands on the case's variables) computes
the same thing finite, forward and backward."""
import re

import pytest
import torch
import torch.nn.functional as F

import nanguard


def snippets(remedy):
    """The code in the remedy's backquotes, in order."""
    return re.findall(r"`([^`]+)`", remedy)


def finding_of(case):
    """The first finding of ``case()`` run forward and backward under a trace."""
    with nanguard.trace(warn=False) as t:
        out = case()
        if out.requires_grad:
            out.sum().backward()
    assert t.findings, "the case made nothing non-finite"
    return t.findings[0]


def finite_with_gradients(value, leaves):
    """``value`` (a tensor) is finite and so are the gradients it sends to ``leaves``."""
    assert torch.isfinite(value).all(), value
    grads = torch.autograd.grad(value.sum(), leaves, allow_unused=True, retain_graph=True)
    for g in grads:
        assert g is None or torch.isfinite(g).all(), g


def leaf(t):
    return t.clone().requires_grad_(True)


def test_log_of_underflowed_probabilities_clamped():
    p = leaf(torch.tensor([0.5, 0.0, 0.25]))
    f = finding_of(lambda: torch.log(p))
    assert f.cause == "log_of_nonpositive"
    fix = next(s for s in snippets(f.remedy) if "clamp_min" in s)
    finite_with_gradients(eval(fix, {"torch": torch, "p": p}), [p])


def test_log_of_a_mask_made_without_a_log():
    scores = leaf(torch.randn(4, 5))
    mask = torch.ones(4, 5)
    mask[2] = 0  # a row with nothing kept: softmax of nothing but -inf
    f = finding_of(lambda: (scores + mask.log()).softmax(-1))
    assert (f.op, f.cause) == ("aten::log", "log_of_nonpositive") and "0/1 mask" in f.evidence
    additive = eval(snippets(f.remedy)[0], {"torch": torch, "mask": mask, "scores": scores})
    finite_with_gradients((scores + additive).softmax(-1), [scores])
    masked = eval(snippets(f.remedy)[1], {"torch": torch, "mask": mask, "scores": scores})
    finite_with_gradients(masked.softmax(-1), [scores])


def test_normalisation_by_a_zero_std_with_an_eps():
    x = leaf(torch.randn(8, 3))
    with torch.no_grad():
        x[:, 1] = 2.0  # a constant feature
    f = finding_of(lambda: x / x.std(0))
    assert f.cause == "division_by_zero" and "normalisation" in f.evidence or "0" in f.evidence
    finite_with_gradients(eval(snippets(f.remedy)[0], {"x": x}), [x])


def test_mean_over_a_mask_with_an_empty_row():
    x = leaf(torch.randn(4, 5, 3))
    mask = torch.ones(4, 5, 1)
    mask[2] = 0
    f = finding_of(lambda: (x * mask).sum(1) / mask.sum(1))
    assert f.cause == "division_by_zero" and "mask" in f.evidence, f.evidence
    assert "std" not in f.remedy and "batches of 1" not in f.remedy
    finite_with_gradients(eval(snippets(f.remedy)[0], {"x": x, "mask": mask}), [x])


def test_exp_overflow_in_log_space_or_clamped():
    x = leaf(torch.tensor([[1.0, 200.0, 3.0]]))
    f = finding_of(lambda: torch.exp(x).sum(-1).log())
    assert f.cause == "overflow"
    finite_with_gradients(eval(snippets(f.remedy)[0], {"torch": torch, "x": x}), [x])
    finite_with_gradients(eval(snippets(f.remedy)[1], {"torch": torch, "x": x}), [x])


def test_fully_masked_softmax_row_given_a_defined_result():
    scores = leaf(torch.randn(3, 4))
    mask = torch.zeros(3, 4, dtype=torch.bool)
    mask[1] = True  # a row with nothing to attend to
    f = finding_of(lambda: scores.masked_fill(mask, float("-inf")).softmax(-1))
    assert f.cause == "fully_masked_softmax"
    p = eval(snippets(f.remedy)[0], {"torch": torch, "scores": scores, "mask": mask})
    finite_with_gradients(p, [scores])
    zeroed = eval(snippets(f.remedy)[1], {"p": p, "mask": mask})
    finite_with_gradients(zeroed, [scores])
    assert (zeroed[1] == 0).all() and torch.allclose(zeroed[0].sum(), torch.tensor(1.0))


def test_sqrt_at_zero_kept_away_from_zero():
    x = leaf(torch.tensor([0.0, 4.0]))
    f = finding_of(lambda: torch.sqrt(x))
    assert f.cause == "sqrt_at_zero"
    finite_with_gradients(eval(snippets(f.remedy)[0], {"torch": torch, "x": x}), [x])


def test_acos_at_its_bound_clamped():
    x = leaf(torch.tensor([1.0, 0.5]))
    f = finding_of(lambda: torch.acos(x))
    assert f.cause == "inverse_trig_at_bound"
    finite_with_gradients(eval(snippets(f.remedy)[0], {"torch": torch, "x": x}), [x])


def test_masked_infinity_reduced_by_label_smoothing():
    logits = leaf(torch.randn(4, 6))
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 5] = True  # a class masked out
    y = torch.tensor([0, 1, 2, 3])
    f = finding_of(lambda: F.cross_entropy(logits.masked_fill(mask, float("-inf")), y, label_smoothing=0.1))
    assert f.cause == "masked_infinity_reduced", f.evidence
    masked = logits.masked_fill(mask, float("-inf"))
    finite_with_gradients(eval(snippets(f.remedy)[0], {"F": F, "logits": masked, "y": y}), [logits])
    kept_sum = eval(snippets(f.remedy)[1], {"x": masked, "mask": mask})
    finite_with_gradients(kept_sum, [logits])


def test_constant_in_the_model_named_and_made_finite():
    x = leaf(torch.tensor([-1.0, 2.0, 3.0]))
    f = finding_of(lambda: x.masked_fill(x > 0, float("nan")))
    assert f.cause == "constant_in_model" and f.culprit == "constant (argument 2)", f
    finite_with_gradients(x.masked_fill(x > 0, eval(snippets(f.remedy)[-1], {"torch": torch, "x": x})), [x])
