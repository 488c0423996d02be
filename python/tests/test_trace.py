"""nanguard.trace on the classic NaN/Inf scenarios."""
import gc
import math
import subprocess
import sys
import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanguard

# Every case runs on the CPU and, where a GPU is found, again on CUDA with
# the same expectations: the tracer finds the same thing on both
# (conftest.on_device).
pytestmark = pytest.mark.usefixtures("on_device")


class Norm(nn.Module):
    """Standardises the last dimension: 0/0 = NaN when a row is constant."""

    def forward(self, x):
        return (x - x.mean(-1, keepdim=True)) / x.std(-1, keepdim=True)


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.norm = Norm()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.norm(self.lin(x)))


def test_std_zero_normalisation_names_div_in_norm():
    model = NormNet()
    with torch.no_grad():
        model.lin.weight.zero_()  # every row constant: std = 0
        model.lin.bias.fill_(0.5)
    with nanguard.trace(model) as t:
        model(torch.randn(8, 4)).sum().backward()
    assert len(t.findings) == 1
    f = t.findings[0]
    assert (f.op, f.direction, f.role, f.module) == ("aten::div", "forward", "producer", "norm")
    assert math.isnan(f.value)
    div_line = Norm.forward.__code__.co_firstlineno + 1
    assert str(f).startswith(f"{__file__}:{div_line} (forward): step 0 forward aten::div in norm: producer")
    assert "module:    norm" in f.to_text()
    d = f.to_dict()
    assert d["op"] == "aten::div" and d["inputs"][1]["stats"]["max"] == 0
    assert math.isnan(d["value"])


def test_log_softmax_underflow():
    # log(softmax(x)) underflows to log(0) = -inf for a large logit gap.
    logits = torch.tensor([[0.0, 200.0, -200.0]], requires_grad=True)
    with nanguard.trace() as t:
        p = torch.softmax(logits, -1)
        torch.log(p).sum()
    f = t.findings[0]
    assert (f.op, f.role, f.direction) == ("aten::log", "producer", "forward")
    assert f.value == -math.inf
    # The stable form is finite.
    with nanguard.trace() as t:
        F.log_softmax(logits, -1).sum().backward()
    assert t.findings == []


def test_sqrt_backward_inf():
    x = torch.tensor([0.0, 1.0, 4.0], requires_grad=True)
    with nanguard.trace() as t:
        torch.sqrt(x).sum().backward()
    f = t.findings[0]
    assert f.direction == "backward"
    assert f.node == "SqrtBackward0"
    assert f.forward_op == "aten::sqrt"
    assert f.role == "producer"
    assert f.value == math.inf


def test_nan_in_data_is_role_input():
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    x = torch.randn(5, 3)
    x[2, 1] = float("nan")
    with nanguard.trace(model) as t:
        t.name_tensor(x, "batch")
        model(x).sum().backward()
    f = t.findings[0]
    assert f.role == "input"
    assert f.culprit == "batch"
    assert f.module == "0"
    assert f.direction == "forward"


def test_a_write_behind_torchs_back_is_seen_once_marked():
    x = torch.ones(4)
    with nanguard.trace(max_findings=4) as t:
        y = x * 2  # the tracer knows y: all 2
        y.numpy()[1] = float("nan")  # what an all_reduce from another rank does
        nanguard.mark_written(y)
        y.mul_(3)
    assert [f.op for f in t.findings] == ["aten::mul_"]
    assert t.findings[0].role == "input"


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)

    def forward(self, x, mask):
        scores = self.q(x) @ self.k(x).transpose(-1, -2) / math.sqrt(8)
        scores = scores.masked_fill(~mask, -math.inf)
        return torch.softmax(scores, -1)


class AttnNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = Attention()

    def forward(self, x, mask):
        return self.attn(x, mask) @ x


def test_masked_attention_is_fine():
    model = AttnNet()
    x = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, 5, dtype=torch.bool).tril()  # causal: every row keeps one
    with nanguard.trace(model) as t:
        model(x, mask).sum().backward()
    assert t.findings == []


def test_fully_masked_row_names_softmax():
    model = AttnNet()
    x = torch.randn(2, 5, 8)
    mask = torch.ones(2, 5, 5, dtype=torch.bool).tril()
    mask[1, 3, :] = False  # a row with nothing to attend to
    with nanguard.trace(model) as t:
        model(x, mask).sum().backward()
    f = t.findings[0]
    assert f.op == "aten::_softmax"
    assert f.module == "attn"
    assert f.direction == "forward"
    assert math.isnan(f.value)


def test_raise_on_finding_raises_at_exit_with_the_finding():
    x = torch.tensor([0.0, 1.0])
    with pytest.raises(nanguard.NonFiniteError, match="aten::div") as e:
        with nanguard.trace(raise_on_finding=True):
            x / x
    assert e.value.finding.op == "aten::div"


def test_check_raises_inside_the_block():
    x = torch.tensor([-1.0])
    with nanguard.trace(raise_on_finding=True) as t:
        t.check()  # nothing yet
        torch.log(x)
        with pytest.raises(nanguard.NonFiniteError):
            t.check()
        t.clear()


def test_allow_rules_and_max_findings():
    x = torch.tensor([0.0, 1.0])
    with nanguard.trace(allow=[nanguard.AllowRule(op="aten::log", neg_inf=True)]) as t:
        torch.log(x)
    assert t.findings == []
    with nanguard.trace(max_findings=2) as t:
        torch.log(x)
        torch.sqrt(-x - 1)
    assert [f.op for f in t.findings] == ["aten::log", "aten::sqrt"]
    with pytest.raises(ValueError, match="max_findings"):
        nanguard.trace(max_findings=0)


def test_scopes_are_balanced_after_a_failing_forward():
    class Boom(nn.Module):
        def forward(self, x):
            raise KeyError("boom")

    model = nn.Sequential(nn.Linear(2, 2), Boom())
    with pytest.raises(KeyError):
        with nanguard.trace(model):
            model(torch.randn(1, 2))
    assert nanguard._nanguard.scope_depth() == 0
    assert nanguard._nanguard.current_scope() == ""


def test_nothing_is_observed_after_the_block():
    with nanguard.trace() as t:
        pass
    torch.log(torch.tensor([0.0]))
    assert t.findings == []


def test_a_trace_left_on_another_thread_frees_the_one_it_watched():
    t = nanguard.trace()
    t.__enter__()
    worker = threading.Thread(target=t.__exit__, args=(None, None, None))
    worker.start()
    worker.join()
    with nanguard.trace() as again:  # used to fail: "a tracer is already active"
        torch.log(torch.tensor([0.0]))
    assert [f.op for f in again.findings] == ["aten::log"]


def test_the_forward_op_of_a_custom_function_outlives_its_class():
    def make():  # a class of its own per call, freed once applied
        class Twice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return g * 0 / torch.zeros_like(g)  # 0/0: NaN born in this backward

        return Twice

    x = torch.ones(3, requires_grad=True)
    with nanguard.trace() as t:
        y = make().apply(x).sum()
        gc.collect()
        y.backward()
    f = t.findings[0]
    assert (f.op, f.direction, f.node, f.forward_op) == ("aten::div", "backward", "TwiceBackward", "Twice")


def test_a_trace_whose_findings_cannot_be_read_still_frees_its_thread(monkeypatch):
    def unreadable(_):
        raise ValueError("cannot read this finding")

    monkeypatch.setattr(nanguard._trace.Finding, "from_json", staticmethod(unreadable))
    first = nanguard.trace()  # kept: its tracer is not freed with it
    with pytest.raises(ValueError):
        with first:
            torch.log(torch.tensor([0.0]))
    monkeypatch.undo()
    with nanguard.trace() as again:  # used to fail: "a tracer is already active"
        torch.log(torch.tensor([0.0]))
    assert [f.op for f in again.findings] == ["aten::log"]


def test_a_node_that_returns_nan_no_op_made_is_named():
    class ConstantNanBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return torch.tensor([[float("nan")] * 3] * 2)  # from Python numbers: no op makes it

    lin = nn.Linear(3, 3)
    with nanguard.trace(lin) as t:
        ConstantNanBackward.apply(lin(torch.ones(2, 3))).sum().backward()
    f = t.findings[0]  # was aten::mm in AddmmBackward0, role input
    assert (f.op, f.node, f.direction, f.role, f.forward_op) == (
        "ConstantNanBackwardBackward", "ConstantNanBackwardBackward", "backward", "producer", "ConstantNanBackward")


def test_a_nan_gradient_handed_to_backward_is_an_input():
    x = torch.ones(3, requires_grad=True)
    y = x * 2
    seed = torch.tensor([1.0, float("nan"), 1.0])
    with nanguard.trace() as t:
        y.backward(seed)
    f = t.findings[0]
    assert (f.direction, f.role, f.index) == ("backward", "input", 1)


def test_complex_division_by_zero_is_named():
    with nanguard.trace() as t:
        torch.tensor([1 + 1j, 0j]) / torch.tensor([1 + 0j, 0j])
    f = t.findings[0]
    # A complex tensor is checked as its real view: element 2 is the real part of [1].
    assert (f.op, f.role, f.index, f.outputs[0]["shape"]) == ("aten::div", "producer", 2, [2, 2])


def test_a_nan_born_in_complex_backward_is_named():
    z = torch.full((3,), 1e-25 + 1e-25j, dtype=torch.complex64, requires_grad=True)  # |z|^2 underflows
    with nanguard.trace() as t:
        torch.angle(z).sum().backward()
    assert z.grad.isnan().all()
    f = t.findings[0]
    assert (f.op, f.direction, f.node, f.role) == ("aten::div", "backward", "AngleBackward0", "producer")


def test_measure_cost_counts_what_the_tracer_read():
    model = NormNet()
    with nanguard.trace(model, measure_cost=True) as t:
        model(torch.randn(8, 4)).sum().backward()
    c = t.cost
    assert c["ops"] > 10
    assert 0 < c["scans"] == sum(n for _, n, _ in c["scans_by_op"])
    assert c["scanned_bytes"] == sum(b for _, _, b in c["scans_by_op"])
    assert 0 < c["scan_seconds"] <= c["seconds"]
    # A parameter is read once, where it is first used.
    assert any(op.endswith("(parameter)") for op, _, _ in c["scans_by_op"])
    with nanguard.trace(model) as quiet:
        model(torch.randn(8, 4))
    assert quiet.cost["scans"] == 0, "nothing is counted unless asked"


def test_a_trace_over_many_steps_reads_each_step_about_what_its_first_read(on_device):
    # AdamW bounds the weights it updates by 1/eps times the bound of their
    # gradients; from such bounds on, the matrix products of a deeper model
    # would be read, more with every step. The tracer reads each weight
    # again where the next step first uses it instead.
    if on_device != "cpu":
        pytest.skip("range rules run on CPU tensors; a GPU's are checked on the deferred path")
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 4, 1024, dropout=0.1, batch_first=True)
    encoder = nn.Sequential(nn.Embedding(1000, 256), nn.TransformerEncoder(layer, 4, enable_nested_tensor=False))
    head = nn.Linear(256, 10)
    model = nn.ModuleDict({"encoder": encoder, "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens, labels = torch.randint(0, 1000, (8, 64)), torch.randint(0, 10, (8,))
    read = []
    with nanguard.trace(model, measure_cost=True) as t:
        for _ in range(4):
            before = t.cost["scanned_bytes"]
            opt.zero_grad()
            F.cross_entropy(head(encoder(tokens).mean(1)), labels).backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            read.append(t.cost["scanned_bytes"] - before)
    assert max(read[1:]) < 1.5 * read[0], f"bytes read per step: {read}"


def test_inside_kernels_names_the_inner_op():
    x = torch.full((8,), 3e38)
    with nanguard.trace() as t:
        x.mean()
    assert t.findings[0].op == "aten::mean"
    with nanguard.trace(inside_kernels=True) as inner:
        x.mean()
    assert inner.findings[0].op == "aten::sum"
    assert inner.findings[0].caller == "aten::mean"


# PyTorch's anomaly-mode tests (test/test_autograd.py: test_anomaly_detect_nan,
# test_nested_anomaly_detect_nan), asserting the backward node detect_anomaly
# names ("Function 'MyFuncBackward' returned nan values in its 0th output").
ANOMALY_SIZE = 10


class AnomalyFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp1, inp2, fail_0th):
        ctx.fail_0th = fail_0th
        return inp1.sum(0, keepdim=True)

    @staticmethod
    def backward(ctx, gO):
        gI = gO.clone().expand(ANOMALY_SIZE)
        gI[0] = 0
        gI[0] /= 0  # generate a nan
        return (gI, None, None) if ctx.fail_0th else (None, gI, None)


@pytest.mark.parametrize("fail_0th", [True, False])
def test_anomaly_detect_nan_names_the_node(fail_0th):
    inp = torch.rand(ANOMALY_SIZE, requires_grad=True)
    with nanguard.trace() as t:
        AnomalyFunc.apply(inp, inp, fail_0th).backward()
    f = t.findings[0]
    assert (f.node, f.direction, f.role) == ("AnomalyFuncBackward", "backward", "producer")


class NestedOuter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp1, fail_0th):
        ctx.fail_0th = fail_0th
        ctx.save_for_backward(inp1)
        return inp1.sum(0, keepdim=True)

    @staticmethod
    def backward(ctx, gO):
        (inp,) = ctx.saved_tensors
        g = gO.clone().expand(ANOMALY_SIZE)
        return NestedInner.apply(g * inp, g + inp, ctx.fail_0th), None


class NestedInner(torch.autograd.Function):
    @staticmethod
    def forward(ctx, inp1, inp2, fail_0th):
        ctx.fail_0th = fail_0th
        return inp1 * 2.0 + inp2

    @staticmethod
    def backward(ctx, gO):
        g1, g2 = gO.clone(), gO.clone()
        g1[0] = 0
        g2[0] = 0
        if ctx.fail_0th:  # generate a nan
            g1[0] /= 0
        else:
            g2[0] /= 0
        return g1, g2, None


@pytest.mark.parametrize("fail_0th", [True, False])
def test_nested_anomaly_detect_nan_names_the_inner_node(fail_0th):
    inp = torch.rand(ANOMALY_SIZE, requires_grad=True)
    out = NestedOuter.apply(inp, fail_0th)
    (ginp,) = torch.autograd.grad(out, (inp,), create_graph=True)
    with nanguard.trace() as t:
        ginp.sum().backward()
    f = t.findings[0]
    assert (f.node, f.direction, f.role) == ("NestedInnerBackward", "backward", "producer")


# ---- Judged by consequence: an infinity that never reaches the loss or a
# gradient is not a finding (#24). Each case trains one step under the tracer.
L = 5


def _scores(q):
    return q @ q.transpose(-1, -2)


def _causal_bool():
    return torch.ones(L, L).triu(1).bool()


def _mask_by_full_triu(q):
    return (_scores(q) + torch.full((L, L), float("-inf")).triu(1)).softmax(-1)


def _mask_by_index_assignment(q):
    m = torch.zeros(L, L)
    m[_causal_bool()] = float("-inf")
    return (_scores(q) + m).softmax(-1)


def _mask_by_where(q):
    return torch.where(_causal_bool(), torch.tensor(float("-inf")), _scores(q)).softmax(-1)


def _mha(**masks):
    def run(q):
        torch.manual_seed(0)
        mha = nn.MultiheadAttention(4, 2, batch_first=True)
        x = q.flatten(0, 1)
        return mha(x, x, x, **masks)[0]
    return run


HEALTHY_MASKS = {
    "mha float -inf mask": _mha(attn_mask=nn.Transformer.generate_square_subsequent_mask(L)),
    "mha bool mask": _mha(attn_mask=_causal_bool()),
    "mha key_padding_mask": _mha(key_padding_mask=torch.tensor([[False] * 3 + [True] * 2] * 4)),
    "sdpa is_causal": lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True),
    "sdpa float attn_mask": lambda q: F.scaled_dot_product_attention(
        q, q, q, attn_mask=nn.Transformer.generate_square_subsequent_mask(L)),
    "full + triu": _mask_by_full_triu,
    "index assignment": _mask_by_index_assignment,
    "where": _mask_by_where,
}


@pytest.mark.parametrize("case", sorted(HEALTHY_MASKS))
def test_a_causal_mask_is_not_a_finding(case):
    q = torch.randn(2, 2, L, 4, requires_grad=True)
    with nanguard.trace(raise_on_finding=True) as t:
        HEALTHY_MASKS[case](q).sum().backward()
    assert t.findings == [], [str(f) for f in t.findings]
    assert q.grad.isfinite().all()


def test_a_fully_masked_row_built_by_assignment_names_the_softmax():
    q = torch.randn(2, 2, L, 4, requires_grad=True)
    m = torch.zeros(L, L)
    m[0, :] = float("-inf")  # padding: a row with nothing to attend to
    with nanguard.trace() as t:
        (_scores(q) + m).softmax(-1).sum().backward()
    f = t.findings[0]  # was the -inf itself, role input at aten::fill_/copy_
    assert (f.op, f.direction, f.role) == ("aten::_softmax", "forward", "producer")
    assert math.isnan(f.value)


MASKED_BACKWARD_INFINITIES = {
    "norm p=0.5 at zero": lambda x: (x * 0).norm(p=0.5),
    "std of a constant": lambda x: (x * 0 + 1).std(),
    "cdist of repeated points": lambda x: torch.cdist(x.view(1, 2, 2), x.view(1, 2, 2)).sum(),
    # torch 2.11 masks these gradients to 0 (finite): nothing to report either.
    "norm of a zero vector": lambda x: (x * 0).norm(),
    "atan2 at the origin": lambda x: torch.atan2(x * 0, x * 0).sum(),
}


@pytest.mark.parametrize("case", sorted(MASKED_BACKWARD_INFINITIES))
def test_an_infinity_a_backward_formula_masks_out_is_not_a_finding(case):
    x = torch.ones(4, requires_grad=True)
    with nanguard.trace(raise_on_finding=True) as t:
        y = MASKED_BACKWARD_INFINITIES[case](x)
        y.backward()
    assert x.grad.isfinite().all(), x.grad
    assert t.findings == [], [str(f) for f in t.findings]


def test_a_nan_born_in_backward_names_its_infinity():
    x = torch.zeros(3, requires_grad=True)
    with nanguard.trace() as t:
        (x.sqrt() * 0).sum().backward()  # 0 * (1 / (2 sqrt(0))) = 0 * inf
    assert x.grad.isnan().all()
    f = t.findings[0]
    assert (f.direction, f.node, f.role) == ("backward", "SqrtBackward0", "producer")


def test_where_with_a_nan_gradient_from_the_branch_not_taken():
    v = torch.zeros(3, requires_grad=True)
    with nanguard.trace(max_findings=2) as t:
        torch.where(v > -1, v, torch.log(v)).sum().backward()  # log(0) forward is absorbed; its gradient is not
    assert v.grad.isnan().all()
    # One failure: the -inf of log(0), and the 0/0 its backward makes of where's zero gradient.
    forward, backward = t.findings
    assert (forward.direction, forward.op, forward.role) == ("forward", "aten::log", "producer")
    assert (backward.direction, backward.node, backward.op) == ("backward", "LogBackward0", "aten::div")


# The first compile of a model inside a trace: Dynamo, AOTAutograd and
# Inductor run ops on FakeTensors and FunctionalTensors, which hold no values;
# reading one crashed the process (SIGSEGV) after ~100 "Exception in
# RecordFunction callback" warnings (#37). In a subprocess, so that a crash
# fails this test, not the suite.
FIRST_COMPILE_INSIDE_A_TRACE = """
import sys, torch, torch.nn as nn, nanguard
torch.set_default_device(sys.argv[1])

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.fc2 = nn.Linear(16, 2)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc2((h - h.mean(-1, keepdim=True)) / (h.std(-1, keepdim=True) + 1e-3))

model = Net()
compiled = torch.compile(model)
with nanguard.trace(model) as t:
    with torch.compiler.set_stance("default"):  # compile here (a trace runs compiled code eagerly)
        compiled(torch.randn(4, 8)).sum().backward()
print("findings:", len(t.findings))
"""


def test_the_first_compile_of_a_model_inside_a_trace(on_device):
    r = subprocess.run([sys.executable, "-c", FIRST_COMPILE_INSIDE_A_TRACE, on_device], capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Exception in RecordFunction callback" not in r.stderr, r.stderr[-3000:]
    assert "findings: 0" in r.stdout, r.stdout + r.stderr[-3000:]


class LastPositionHead(nn.Module):
    """A log of 0 in one position of a sequence, spread by a cumulative sum;
    the head reads the last position only (as a causal language model's
    `generate` does, `logits_to_keep=1`): a slice that starts inside its
    base's data."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        keep = (torch.arange(x.shape[0]) != 1).float().unsqueeze(-1)  # position 1: log(0)
        return self.head((self.lin(x) + torch.log(keep)).cumsum(0)[-1:])


@pytest.mark.parametrize("grad_mode", [torch.enable_grad, torch.no_grad, torch.inference_mode])
def test_a_nan_read_through_a_slice_names_where_it_was_born(grad_mode):
    # The head's addmm was named, role input: the slice hid the chain.
    model = LastPositionHead()
    with grad_mode(), nanguard.trace(model) as t:
        out = model(torch.randn(3, 4))
    assert not out.isfinite().all()
    f = t.findings[0]
    assert (f.op, f.direction, f.role) == ("aten::log", "forward", "producer"), str(f)


class SqrtBlock(nn.Module):
    """sqrt(x²) is |x|, and infinite in backward where x = 0 (row 1)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        h = self.lin(x) * (torch.arange(x.shape[0]) != 1).float().unsqueeze(-1)
        return torch.tanh(torch.sqrt(h * h))


class CheckpointedNet(nn.Module):
    def __init__(self, block, use_reentrant):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.block = block
        self.use_reentrant = use_reentrant

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.block, self.lin(x), use_reentrant=self.use_reentrant)


@pytest.mark.parametrize("use_reentrant", [True, False])
def test_a_nan_born_in_the_backward_of_a_checkpointed_block_names_its_module(use_reentrant):
    # A reentrant checkpoint runs the block's forward again inside the
    # backward pass, making the graph the backward then runs; its ops were
    # taken for backward ops, so SqrtBackward0 named no forward op nor module.
    model = CheckpointedNet(SqrtBlock(), use_reentrant)
    with nanguard.trace(model) as t:
        model(torch.randn(3, 4)).sum().backward()
    assert not model.lin.weight.grad.isfinite().all()
    f = t.findings[0]
    assert (f.direction, f.node, f.forward_op, f.module) == ("backward", "SqrtBackward0", "aten::sqrt", "block")
    healthy = CheckpointedNet(nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), use_reentrant)
    with nanguard.trace(healthy) as t:
        healthy(torch.randn(3, 4)).sum().backward()
    assert t.findings == []


def test_per_step_traces_keep_what_they_saw_of_the_optimizer_state(on_device):
    # torch.optim's optimizers own their state: what one step's trace saw of
    # AdamW's moments vouches for them in the next step's trace
    # (tracer::keep_known_across_steps), whose update need not read them again.
    if on_device != "cpu":
        pytest.skip("range rules run on CPU tensors; a GPU's are checked on the deferred path")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(16, 64), torch.randint(0, 4, (16,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()

    old_values_read = []
    for _ in range(3):
        with nanguard.trace(model, measure_cost=True) as t:
            step()
        old_values_read.append(sum(n for op, n, _ in t.cost["scans_by_op"] if op.endswith("(old values)")))
    assert old_values_read[0] > 0 and old_values_read[1:] == [0, 0], old_values_read
    # A write the optimizer did not make moves the moment's version on: read again.
    opt.state[model[0].weight]["exp_avg"][0, 0] = float("nan")
    with nanguard.trace(model) as t:
        step()
    f = t.findings[0]
    assert (f.op, f.role) == ("aten::lerp_", "input"), f
