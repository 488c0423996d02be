"""Where nanguard.trace looks when a step is not a plain training step: a
forward-only pass (judged by the model's outputs), a non-finite loss made
of intended infinities, TorchScript models, complex ops (#40)."""
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard


class LogActivation(nn.Module):
    """A real log(0): log of a ReLU, -inf wherever the ReLU is 0."""

    def forward(self, x):
        return torch.log(torch.relu(x))


def _gpt2(log_in_block_1):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config)  # built from a config: no download
    assert model.config._attn_implementation == "sdpa"
    if log_in_block_1:
        model.transformer.h[1].mlp.act = LogActivation()
    return model.train()  # train mode: dropout on, the causal mask built with its -inf


def test_a_forward_only_gpt2_names_the_log_not_the_causal_mask():
    model = _gpt2(log_in_block_1=True)
    ids = torch.randint(0, 64, (2, 8))
    with nanguard.trace(model) as t, torch.no_grad():
        logits = model(ids).logits
    assert not logits.isfinite().all()
    f = t.findings[0]  # was the causal mask's -inf: aten::scalar_tensor in transformer.h.0.attn
    assert (f.op, f.role, f.direction) == ("aten::log", "producer", "forward"), str(f)
    assert f.module.startswith("transformer.h.1.mlp"), str(f)
    assert f.cause == "log_of_nonpositive"


@pytest.mark.parametrize("grad", [False, True])
def test_a_healthy_forward_only_gpt2_reports_nothing(grad):
    model = _gpt2(log_in_block_1=False)
    ids = torch.randint(0, 64, (2, 8))
    with nanguard.trace(model) as t, torch.set_grad_enabled(grad):
        model(ids, attention_mask=torch.tensor([[1] * 8, [1] * 5 + [0] * 3]))  # a padded row too
        model.eval()(ids)
    assert t.findings == [], [str(f) for f in t.findings]


class CausalLM(nn.Module):
    """A hand-written causal LM: a full + triu causal mask, one attention
    block, an MLP whose activation may be a log of 0."""

    def __init__(self, activation):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.mlp = nn.Sequential(nn.Linear(16, 32), activation, nn.Linear(32, 16))
        self.head = nn.Linear(16, 32)

    def forward(self, ids):
        h = self.embed(ids)
        q, k, v = self.qkv(h).chunk(3, -1)
        n = ids.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)
        h = h + torch.softmax(q @ k.transpose(-1, -2) / 4 + mask, -1) @ v
        return self.head(h + self.mlp(h))


def test_a_forward_only_causal_lm_names_the_log_not_the_mask():
    torch.manual_seed(0)
    model = CausalLM(LogActivation())
    with nanguard.trace(model) as t, torch.no_grad():
        model(torch.randint(0, 32, (2, 6)))
    f = t.findings[0]  # was aten::full, the mask
    assert (f.op, f.module) == ("aten::log", "mlp.1"), str(f)


def test_a_healthy_forward_only_causal_lm_reports_nothing():
    torch.manual_seed(0)
    model = CausalLM(nn.GELU())
    with nanguard.trace(model) as t:
        model.eval()
        with torch.no_grad():
            model(torch.randint(0, 32, (2, 6)))
    assert t.findings == [], [str(f) for f in t.findings]


def _masked_logits(requires_grad=True):
    torch.manual_seed(0)
    logits = torch.randn(4, 6, requires_grad=requires_grad)
    mask = torch.zeros(4, 6, dtype=torch.bool)
    mask[:, 4:] = True  # two classes masked out in every row
    return logits, mask


@pytest.mark.parametrize("backward", [True, False])
def test_a_label_smoothed_loss_over_masked_logits_is_a_finding(backward):
    logits, mask = _masked_logits()
    with nanguard.trace() as t:
        loss = F.cross_entropy(logits.masked_fill(mask, float("-inf")), torch.tensor([0, 1, 2, 3]),
                               label_smoothing=0.1)
        if backward:
            loss.backward()
    assert math.isinf(loss.item())
    f = t.findings[0]  # was none: every -inf was intended
    assert f.role == "producer" and f.direction == "forward", str(f)
    assert f.cause == "masked_infinity_reduced", f.evidence
    assert "out of the reduction" in f.remedy and "label_smoothing" in f.remedy


def test_a_label_smoothed_loss_over_a_full_mask_names_the_reduction():
    logits, mask = _masked_logits()
    with nanguard.trace() as t:
        additive = torch.zeros(6)
        additive[4:] = float("-inf")
        F.cross_entropy(logits + additive, torch.tensor([0, 1, 2, 3]), label_smoothing=0.1).backward()
    f = t.findings[0]  # was the -inf's writer
    assert f.cause == "masked_infinity_reduced", str(f)


def _safe_log(x):
    positive = x > 0
    return torch.where(positive, torch.log(torch.where(positive, x, 1.0)), 0.0)


def _invalid_actions(logits):
    _, mask = _masked_logits()
    log_probs = torch.log_softmax(logits.masked_fill(mask, float("-inf")), -1)
    return log_probs.gather(1, torch.tensor([[0], [1], [2], [3]])).sum()


def _key_padding(q):
    pad = torch.tensor([False, False, False, True])  # the last of 4 keys is padding
    return (q @ q.transpose(-1, -2)).masked_fill(pad, float("-inf")).softmax(-1).sum()


HEALTHY = {
    "causal sdpa": lambda x: F.scaled_dot_product_attention(x[None], x[None], x[None], is_causal=True).sum(),
    "key padding mask": _key_padding,
    "invalid actions masked before log_softmax": _invalid_actions,
    "double-where safe log": lambda x: _safe_log(x - 0.5).sum(),
    "plain cross entropy over masked logits": lambda x: F.cross_entropy(
        x.masked_fill(_masked_logits()[1], float("-inf")), torch.tensor([0, 1, 2, 3])),
}


class Step(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("case", sorted(HEALTHY))
def test_a_healthy_step_reports_nothing(case, backward):
    x, _ = _masked_logits()
    model = Step(HEALTHY[case])
    with nanguard.trace(model) as t:  # forward-only: judged by the model's output
        out = model(x)
        if backward:
            out.backward()
    assert out.isfinite().all()
    assert t.findings == [], [str(f) for f in t.findings]


def test_outputs_are_collected_only_when_something_awaits_judgement(monkeypatch):
    """A forward that left nothing to judge (a healthy one) does not hand its
    outputs to the tracer (#40: py_trace_ratio); one that made an Inf does."""
    handed = []
    judge = nanguard._nanguard.Tracer.judge_by_outputs

    def counted(tracer, outputs):
        handed.append(len(outputs))
        judge(tracer, outputs)

    monkeypatch.setattr(nanguard._nanguard.Tracer, "judge_by_outputs", counted)
    x = torch.rand(4, 6) + 0.5
    with nanguard.trace(Step(lambda v: (v * 2, {"half": v / 2}))) as t:
        t.model(x)
        t.model(x)
    assert handed == [] and t.findings == [], [str(f) for f in t.findings]
    with nanguard.trace(Step(lambda v: (torch.log(v - v), v))) as t:
        t.model(x)
    assert handed == [2], handed
    assert [(f.op, f.role) for f in t.findings] == [("aten::log", "producer")], [str(f) for f in t.findings]


class ScriptedMask(nn.Module):
    """A padding row written by index assignment: TorchScript runs it as a
    copy_ of a constant tensor."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        mask = torch.zeros(4, 4)
        mask[0] = float("-inf")
        return torch.softmax(self.lin(x) + mask, -1)


@pytest.mark.parametrize("backward", [True, False])
def test_a_scripted_fully_masked_row_names_the_softmax(backward):
    torch.manual_seed(0)
    model = torch.jit.script(ScriptedMask())
    with nanguard.trace(model) as t:  # was: register_forward_pre_hook is not supported on ScriptModules
        out = model(torch.randn(4, 4))
        if backward:
            out.sum().backward()
    f = t.findings[0]  # was aten::copy_, role input, bad_data
    assert "softmax" in f.op and f.role == "producer", str(f)
    assert f.cause == "fully_masked_softmax"
    assert f.module == "", str(f)  # the root's own op


def test_the_guard_replays_a_scripted_model():
    torch.manual_seed(0)
    model = torch.jit.script(ScriptedMask())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = nanguard.Guard(model, opt, policy="skip")
    r = g.step(lambda: model(torch.randn(4, 4)).sum())
    g.close()
    assert r.skipped and r.finding is not None
    assert "softmax" in r.finding.op and r.finding.cause == "fully_masked_softmax", str(r.finding)


class ScaledByNan(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * float("nan")


@pytest.mark.parametrize("scripted", [False, True])
def test_a_nan_scalar_operand_is_named(scripted):
    torch.manual_seed(0)
    model = ScaledByNan()
    if scripted:
        model = torch.jit.script(model)
    with nanguard.trace(model) as t:
        model(torch.randn(2, 4))
    f = t.findings[0]
    assert f.op == "aten::mul", str(f)
    assert f.outputs[0]["shape"] == [2, 4], f.to_text()  # was Float [], "1 NaN of 1"
    nan_operand = [r for r in f.inputs if r["stats"]["nan"] > 0]
    assert nan_operand and nan_operand[0]["shape"] == [], f.to_text()


def test_complex_ops_leave_stderr_clean_and_complex_nan_is_found(capfd):
    z = torch.randn(4, dtype=torch.cfloat, requires_grad=True)
    with nanguard.trace(max_findings=2) as t:
        torch.angle(z).sum().backward()
        torch.atan2(z.real, z.imag).sum()
        (z.real * 2 + z.imag).softmax(0)  # a complex parameter's views under the range rules
        torch.stack([z.real, z.imag])
        torch.cat([z, z]).abs().sum().backward()  # a list of complex tensors
    assert t.findings == [], [str(f) for f in t.findings]
    assert capfd.readouterr().err == ""  # was "Exception in RecordFunction callback: ... ComplexFloat"
    nan_imaginary = torch.complex(torch.zeros(4), torch.tensor([0.0, float("nan"), 0.0, 0.0]))
    with nanguard.trace() as t:
        z.detach() + nan_imaginary.log().exp()
    assert t.findings and t.findings[0].outputs[0]["stats"]["nan"] > 0, [str(f) for f in t.findings]
    assert capfd.readouterr().err == ""
