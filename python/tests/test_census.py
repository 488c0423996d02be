"""nanguard.census and has_nonfinite from Python."""
import copy
import math
import pickle

import pytest
import torch

import nanguard
from conftest import cuda_only

FIELDS = ["numel", "nan", "pos_inf", "neg_inf", "finite", "zeros", "subnormal", "min", "max",
          "mean", "std", "l2_norm", "absmax", "fp16_overflow", "fp16_underflow", "bf16_overflow",
          "first_nonfinite_index", "first_nonfinite_value"]


def test_census_counts_every_kind():
    t = torch.tensor([1.0, float("nan"), float("inf"), -float("inf"), 0.0, 1e5, 1e-8])
    s = nanguard.census(t)
    assert (s.numel, s.nan, s.pos_inf, s.neg_inf, s.finite, s.zeros) == (7, 1, 1, 1, 4, 1)
    assert s.fp16_overflow == 1 and s.fp16_underflow == 1
    assert s.first_nonfinite_index == 1 and math.isnan(s.first_nonfinite_value)
    assert s.max == pytest.approx(1e5)
    assert set(s.to_dict()) == set(FIELDS)
    assert "nan=1" in str(s)


def same_value(a, b):
    """Equal and of the same type, NaN equal to NaN."""
    return type(a) is type(b) and (a == b or (isinstance(a, float) and math.isnan(a) and math.isnan(b)))


@pytest.mark.parametrize("values", [[1.0, float("nan"), float("inf"), -float("inf"), 0.0, 1e5, 1e-8],
                                    [-float("inf"), float("inf")], [2.0, 3.0], []],
                         ids=["nan_first", "inf_only", "finite", "empty"])
def test_tensor_stats_pickle_round_trips_every_field(values):
    """A census goes through pickle (DataLoader workers, multiprocessing,
    saved findings) with each field's value and type, NaN and Inf too."""
    s = nanguard.census(torch.tensor(values))
    for protocol in range(pickle.HIGHEST_PROTOCOL + 1):
        back = pickle.loads(pickle.dumps(s, protocol=protocol))
        assert isinstance(back, nanguard.TensorStats)
        for name in FIELDS:
            assert same_value(getattr(back, name), getattr(s, name)), (name, getattr(back, name), getattr(s, name))
        assert str(back) == str(s)
    assert copy.deepcopy(s).to_dict().keys() == s.to_dict().keys()


def test_census_matches_torch_on_views():
    x = torch.randn(64, 33)[:, ::2]
    s = nanguard.census(x)
    assert s.mean == pytest.approx(x.mean().item(), abs=1e-5)
    assert s.std == pytest.approx(x.std(unbiased=False).item(), rel=1e-4)
    assert s.all_finite() and s.nonfinite == 0


def test_has_nonfinite():
    assert not nanguard.has_nonfinite(torch.ones(1000))
    x = torch.ones(1000)
    x[999] = float("inf")
    assert nanguard.has_nonfinite(x)
    assert not nanguard.has_nonfinite(torch.arange(5))  # integers are always finite


def test_census_errors_are_python_exceptions():
    with pytest.raises(TypeError, match="float32"):  # a wrong dtype
        nanguard.census(torch.arange(3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        nanguard.census([1.0, 2.0])


def test_census_does_not_copy_grad_tensors():
    w = torch.randn(10, requires_grad=True)
    assert nanguard.census(w * 2).numel == 10


def test_isolation_forest_scores_the_outlier_lowest():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(500, 4, generator=g, dtype=torch.float64)
    x[17] = 8.0
    forest = nanguard.IsolationForest(n_estimators=50, seed=1).fit(x)
    assert forest.fitted and forest.features == 4
    scores = forest.score_samples(x)
    assert scores.shape == (500,) and scores.dtype == torch.float64
    assert int(scores.argmin()) == 17
    assert int(forest.predict(x)[17]) == -1
    with pytest.raises(ValueError):
        nanguard.IsolationForest(n_estimators=0)


# Every kind of tensor a user may hand over: each call answers or raises a
# Python exception with the C++ message (a crash would take pytest down).
# Regression: with torch 2.x, census of an integer tensor crashed Python.
ODD_TENSORS = {
    "int": lambda: torch.arange(3),
    "bool": lambda: torch.tensor([True, False]),
    "complex": lambda: torch.tensor([1 + 1j, complex(float("nan"), 0.0)]),
    "empty": lambda: torch.empty(0),
    "zero_dim": lambda: torch.tensor(float("nan")),
    "meta": lambda: torch.empty(3, device="meta"),
    "sparse": lambda: torch.eye(3).to_sparse(),
}
CENSUS_ANSWERS = {
    "int": (TypeError, "integer and bool tensors cannot hold NaN"),
    "bool": (TypeError, "integer and bool tensors cannot hold NaN"),
    "complex": (TypeError, r"torch.view_as_real\(x\)"),
    "empty": 0,
    "zero_dim": 1,
    "meta": (ValueError, "on the meta device and holds no values"),
    "sparse": (ValueError, r"expected a dense \(strided\) tensor but got layout Sparse"),
}
HAS_NONFINITE_ANSWERS = {
    "int": False, "bool": False, "complex": True, "empty": False, "zero_dim": True,
    "meta": (ValueError, "on the meta device"), "sparse": (ValueError, "expected a dense"),
}


ANSWERS = {"census": CENSUS_ANSWERS, "has_nonfinite": HAS_NONFINITE_ANSWERS}


@pytest.mark.parametrize("fn", sorted(ANSWERS))
@pytest.mark.parametrize("kind", sorted(ODD_TENSORS))
def test_every_kind_of_tensor(fn, kind):
    answer = ANSWERS[fn][kind]
    call = lambda: getattr(nanguard, fn)(ODD_TENSORS[kind]())  # noqa: E731
    if isinstance(answer, tuple):
        with pytest.raises(answer[0], match=answer[1]):
            call()
    elif fn == "census":
        s = call()
        assert (s.numel, s.nan) == (answer, answer)
    else:
        assert call() is answer


@pytest.mark.parametrize("kind", sorted(ODD_TENSORS))
def test_trace_over_every_kind_of_tensor(kind, capfd):
    x = ODD_TENSORS[kind]()
    with nanguard.trace() as t:
        y = x & x if kind == "bool" else x * 2
    # A NaN is found (a complex one in its real view); the rest hold nothing
    # to check and are skipped quietly (no exception inside ATen's observer,
    # which it would print).
    assert len(t.findings) == (1 if kind in ("zero_dim", "complex") else 0), [str(f) for f in t.findings]
    assert "Exception in RecordFunction callback" not in capfd.readouterr().err
    assert y.shape == x.shape


@cuda_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_census_on_cuda_equals_the_cpu_census(dtype):
    x = torch.randn(3 * 70000, dtype=torch.float64) * 3
    x[[5, 70001, 140002, 9]] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0], dtype=torch.float64)
    x = x.to(dtype)
    for view in (x, x.view(3, -1).t(), x[1:]):
        cpu, gpu = nanguard.census(view).to_dict(), nanguard.census(view.cuda()).to_dict()
        for k in FIELDS:
            if k in ("mean", "std", "l2_norm"):
                assert gpu[k] == pytest.approx(cpu[k], rel=1e-6), k
            elif isinstance(cpu[k], float) and math.isnan(cpu[k]):
                assert math.isnan(gpu[k]), k
            else:
                assert gpu[k] == cpu[k], k
        assert nanguard.has_nonfinite(view.cuda())


def test_census_many_and_check_many_name_the_first_bad_tensor():
    xs = [torch.ones(3), torch.tensor([1.0, float("inf")]), torch.tensor([float("nan")], dtype=torch.float64)]
    stats = nanguard.census_many(xs)
    assert [s.nonfinite for s in stats] == [0, 1, 1]
    v = nanguard.check_many(xs)
    assert (v.tensors, v.first_tensor, v.first_index, v.first_value) == (3, 1, 1, math.inf)
    assert (v.nan, v.pos_inf, v.nonfinite) == (1, 1, 2) and not v.all_finite()
    assert nanguard.check_many([]).all_finite()
    with pytest.raises(TypeError, match=r"nanguard.check_many: tensors\[0\] must be a torch.Tensor, got 1.0 \(float\)"):
        nanguard.check_many([1.0])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_says_to_convert_and_has_nonfinite_reads_it(dtype):
    bad = torch.tensor([1.0, float("nan")]).to(dtype)
    convert = r"but got Float8_.*; convert with x.float\(\) \(NaN and Inf are kept\)"
    with pytest.raises(TypeError, match=convert) as e:
        nanguard.census(bad)
    assert "integer and bool" not in str(e.value)
    assert nanguard.has_nonfinite(bad)
    assert not nanguard.has_nonfinite(torch.tensor([1.0, 2.0]).to(dtype))


def test_census_reads_a_negative_view_as_torch_shows_it():
    # z.conj().imag holds its values negated in memory (torch's neg bit); a
    # one-element one is contiguous, which the census read as raw memory.
    z = torch.tensor([3 - 4j, complex(1.0, -math.inf)])
    value, infinity = z.conj().imag[0], z.conj().imag[1:]
    assert value.is_neg() and infinity.is_neg() and infinity.is_contiguous()
    assert (value.item(), infinity.item()) == (4.0, math.inf)
    for s in (nanguard.census(value), nanguard.census_many([value])[0]):
        assert (s.min, s.max, s.mean) == (4.0, 4.0, 4.0)
    s = nanguard.census(infinity)
    assert (s.pos_inf, s.neg_inf, s.first_nonfinite_value) == (1, 0, math.inf)


def test_has_nonfinite_reads_a_conjugate_view():
    z = torch.tensor([1 + 2j, complex(math.nan, 1.0)])
    assert nanguard.has_nonfinite(z.conj())
    assert not nanguard.has_nonfinite(z[:1].conj())


def test_a_jagged_nested_tensor_is_read_as_its_components():
    j = torch.nested.nested_tensor([torch.tensor([1.0, math.nan, 3.0]), torch.tensor([4.0, 5.0])],
                                   layout=torch.jagged)
    s = nanguard.census(j)
    assert (s.numel, s.nan, s.first_nonfinite_index, s.mean) == (5, 1, 1, 3.25)
    assert nanguard.has_nonfinite(j)
    # A narrowed one keeps the whole buffer: the Inf it does not show is not read.
    rows = torch.tensor([[1.0, 2.0, math.inf], [4.0, 5.0, 6.0]])
    narrowed = torch.nested.narrow(rows, 1, torch.tensor([0, 1]), torch.tensor([2, 2]), layout=torch.jagged)
    assert not nanguard.has_nonfinite(narrowed)
    assert (nanguard.census(narrowed).numel, nanguard.census(narrowed).max) == (4, 6.0)
    # A transposed one: its buffer's order is not the logical one.
    first = torch.arange(6.0).reshape(2, 3)
    first[0, 1] = math.nan
    transposed = torch.nested.nested_tensor([first, torch.ones(4, 3)], layout=torch.jagged).transpose(1, 2)
    assert nanguard.census(transposed).first_nonfinite_index == 2  # [0, 1, 0] of a [3, 2] component


def test_the_core_reads_a_negative_view_as_torch_shows_it():
    """The C++ census and the tracer's ranges, below the Python wrapper: a
    negative view's memory holds its values negated (a range of the wrong
    sign would let a rule prove sqrt of it finite)."""
    shown = torch._neg_view(torch.tensor([100.0, 2.0]))
    s = nanguard._nanguard.census(shown)
    assert (s.min, s.max) == (-100.0, -2.0)
    with nanguard.trace() as t:
        torch.sqrt(shown)
    assert t.found and t.findings[0].op == "aten::sqrt"


def test_a_float8_nan_under_the_trace_is_a_finding_without_an_internal_error(capfd):
    """float8 has no census kernel nor ATen isfinite: the tracer reads it as
    float32, and nothing reaches stderr."""
    with nanguard.trace() as t:
        torch.tensor([1e30, 1.0]).to(torch.float8_e4m3fn)  # past its largest value: NaN
    assert t.found and t.findings[0].op == "aten::_to_copy"
    assert "Exception in RecordFunction callback" not in capfd.readouterr().err


def test_a_census_inside_vmap_says_to_call_it_outside():
    with pytest.raises(ValueError, match="stands for values it does not hold.*outside the transform"):
        torch.vmap(lambda x: torch.tensor(nanguard.has_nonfinite(x)))(torch.ones(2, 3))


def test_overflow_counts_are_what_a_cast_to_16_bits_turns_into_inf():
    """65504 < |x| < 65520 rounds down to float16's largest value, 65504; a
    float64 value is cast through float32, as torch casts it."""
    torch.manual_seed(0)
    around = torch.cat([65520 + (torch.rand(20000, dtype=torch.float64) - 0.5) * 40,
                        3.3961775292304459e38 * (1 + (torch.rand(20000, dtype=torch.float64) - 0.5) * 0.004),
                        torch.tensor([65504.0, 65519.998046875, 65520.0, 3.3895313892515355e38], dtype=torch.float64)])
    around = around * (torch.randint(0, 2, around.shape) * 2 - 1)
    for dtype in (torch.float64, torch.float32):
        x = around.to(dtype)
        s = nanguard.census(x)
        assert s.fp16_overflow == (x.isfinite() & x.to(torch.float16).isinf()).sum().item(), dtype
        assert s.bf16_overflow == (x.isfinite() & x.to(torch.bfloat16).isinf()).sum().item(), dtype
        assert s.fp16_overflow < ((x.abs() > 65504) & x.isfinite()).sum().item()


def test_float64_statistics_stay_finite_where_their_sums_overflow():
    def census(*values):
        return nanguard.census(torch.tensor(values, dtype=torch.float64))
    assert census(1e200, 1e200).l2_norm == pytest.approx(math.sqrt(2) * 1e200, rel=1e-15)
    opposite = census(1e308, -1e308)
    assert opposite.mean == 0.0
    assert opposite.std == pytest.approx(1e308, rel=1e-15)  # population std, as the census defines it
    assert opposite.l2_norm == pytest.approx(math.sqrt(2) * 1e308, rel=1e-15)
    assert census(1.7e308, 1.7e308).mean == 1.7e308


@cuda_only
def test_the_cuda_core_reads_a_negative_view_with_its_sign():
    shown = torch._neg_view(torch.tensor([100.0, 2.0, math.inf], device="cuda"))
    for s in (nanguard._nanguard.census(shown), nanguard._nanguard.census_many([shown])[0]):
        assert (s.min, s.max, s.pos_inf, s.neg_inf) == (-100.0, -2.0, 0, 1)
