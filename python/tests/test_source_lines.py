"""A finding names the user's line: the file, line and function of the
op's call in their code (never torch's own), for forward ops, backward
nodes (their forward op's line), TorchScript and the guard's replay; and the
bad element by its position in each dimension."""
import torch
import torch.nn as nn

import nanguard


def line_of(function, text):
    """The line of ``function``'s source that holds ``text``."""
    import inspect
    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x):
        h = self.fc(x)
        return torch.sqrt(h * 0).sum()  # finite forward, 1/0 in SqrtBackward0


class Normalised(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return x / x.sum(-1, keepdim=True) + self.fc(x)  # 0/0 on a row of zeros


def test_a_forward_finding_names_the_line_in_the_model_and_the_row_and_column():
    model = Normalised()
    x = torch.ones(32, 3)
    x[24] = 0
    with nanguard.trace(model) as t:
        model(x).sum().backward()
    f = t.findings[0]
    assert (f.op, f.file, f.line, f.function) == ("aten::div", __file__, line_of(Normalised.forward, "x / x.sum"),
                                                  "forward")
    assert f.position == [24, 0] and f.index == 72
    assert str(f).startswith(f"{__file__}:{f.line} (forward): step 0 forward aten::div")
    assert "[24, 0] = nan" in str(f)


def test_a_backward_finding_names_the_line_of_its_forward_op_in_trace_and_guard():
    model = Scaled()
    x = torch.ones(4, 2)
    sqrt_line = line_of(Scaled.forward, "torch.sqrt")
    with nanguard.trace(model) as t:
        model(x).backward()
    traced = t.findings[0]
    assert (traced.direction, traced.node, traced.line, traced.file) == ("backward", "SqrtBackward0", sqrt_line,
                                                                          __file__)
    guard = nanguard.Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), verbose=False)
    replayed = guard.step(lambda x: model(x), x).finding
    assert (replayed.op, replayed.node, replayed.file, replayed.line) == (traced.op, "SqrtBackward0", __file__,
                                                                          sqrt_line)
    assert f"{__file__}:{sqrt_line} (forward)" in replayed.to_text()


@torch.jit.script
def scripted_ratio(x):
    return x / (x - x)


def test_torchscript_names_the_line_of_its_source():
    with nanguard.trace() as t:
        scripted_ratio(torch.ones(2))
    f = t.findings[0]
    line = 1 + open(__file__).read().splitlines().index("    return x / (x - x)")
    assert (f.op, f.file, f.line, f.function) == ("aten::div", __file__, line, "scripted_ratio")


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), 2,
                                             enable_nested_tensor=False)

    def forward(self, x, padding):
        return self.encoder(x, src_key_padding_mask=padding)


def test_the_trace_leaves_the_fused_fast_path_alone_and_names_its_masked_softmax():
    # pytorch PR #190486: in eval, nn.TransformerEncoderLayer's fused kernel
    # makes NaN for a sequence that is all padding; the slow path, which a
    # module holding hooks takes, does not. The trace must see the fast path.
    torch.manual_seed(0)
    model = Encoder().eval()
    x = torch.randn(2, 4, 8)
    padding = torch.zeros(2, 4, dtype=torch.bool)
    padding[1] = True
    with torch.no_grad():
        plain = model(x, padding)
        with nanguard.trace(model, warn=False, inside_kernels=True) as t:
            traced = model(x, padding)
    assert torch.equal(plain.isnan(), traced.isnan()) and plain.isnan().any()
    assert torch.equal(torch.nan_to_num(plain), torch.nan_to_num(traced))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    f = t.findings[0]
    assert (f.op, f.caller, f.module, f.role) == ("aten::_masked_softmax", "aten::_transformer_encoder_layer_fwd",
                                                  "encoder.layers.0.self_attn", "producer")
    assert f.position[0] == 1  # the padded sequence
    assert (f.file, f.line) == (__file__, line_of(Encoder.forward, "self.encoder("))
    assert (f.cause, f.confidence) == ("fully_masked_softmax", "high")
    assert "all padding" in f.evidence and "fast path" in f.evidence and "all padding" in f.remedy
