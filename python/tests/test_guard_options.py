"""Guard's options are written once, in the bindings' table
(``_nanguard.GUARD_OPTION_TABLE``: name, type, default, doc, field): the
places that must spell them again (Guard's signature, which type checkers
read; the extension's stub; docs/python.md) agree with it, and Guard's
docstring, its checks and the GuardOptions it builds come from it."""
import ast
import inspect
import os
import re

import pytest

import nanguard
from nanguard import _nanguard, _options

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
TABLE = _nanguard.GUARD_OPTION_TABLE


def keyword_options():
    return [p for p in inspect.signature(nanguard.Guard).parameters.values() if p.kind is p.KEYWORD_ONLY]


def test_the_signature_spells_the_table():
    """Names in the table's order, defaults of the same value and type,
    annotations as the table writes them."""
    params = keyword_options()
    assert [p.name for p in params] == [o.name for o in TABLE]
    for p, o in zip(params, TABLE):
        assert (p.default, type(p.default)) == (o.default, type(o.default)), o.name
        assert p.annotation == o.type, o.name


def test_the_defaults_are_the_cpp_ones_where_python_has_no_own():
    """A row with a field whose default Python does not choose itself reads
    the C++ guard_options' default (a path's None is "", a bool or dict
    option's False or None is no scaler)."""
    defaults = _nanguard.GuardOptions()
    own = {"loss_scale": False, "event_log": None, "bundle_dir": None, "bundle_tags": None}
    for o in TABLE:
        if o.field and o.name not in own:
            assert o.default == getattr(defaults, o.field), o.name
    assert {o.name: o.default for o in TABLE if o.name in own} == own
    assert (defaults.max_norm, defaults.spike_window, defaults.policy) == (0.0, 50, "auto")


def test_each_type_has_its_check_and_each_field_its_property():
    for o in TABLE:
        assert o.type in _options.CHECKS, o.name
        assert not o.field or isinstance(getattr(_nanguard.GuardOptions, o.field), property), o.name
    assert set(_options.CHECKS) == {o.type for o in TABLE}, "a check for a type no option has"


def test_guard_options_are_built_from_the_checked_defaults():
    values = _options.read({o.name: o.default for o in TABLE})
    options = _options.guard_options(values, verbose=False)
    assert (options.policy, options.event_log, options.bundle_dir, options.scaler, options.front_end,
            options.bundle_tags) == ("auto", "", "", None, "python", [("front_end", "python")])
    with pytest.raises(TypeError, match="nanguard.GuardOptions: no option 'max_nrom'"):
        _nanguard.GuardOptions(max_nrom=1.0)


def test_the_stub_declares_every_field():
    stub = ast.parse(open(os.path.join(os.path.dirname(nanguard.__file__), "_nanguard.pyi")).read())
    cls = next(n for n in stub.body if isinstance(n, ast.ClassDef) and n.name == "GuardOptions")
    declared = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    declared |= {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name != "__init__"}
    assert {o.field for o in TABLE if o.field} <= declared


def test_the_docs_signature_spells_the_table():
    """docs/python.md's ``nanguard.Guard(model, optimizer, *, ...)`` block."""
    text = open(os.path.join(ROOT, "docs", "python.md"), encoding="utf-8").read()
    call = re.search(r"^nanguard\.Guard\(model, optimizer, \*,.*?\)$", text, re.S | re.M)
    assert call, "docs/python.md: no nanguard.Guard(model, optimizer, *, ...) block"
    fn = ast.parse("def " + call.group(0)[len("nanguard."):] + ": pass").body[0]
    documented = [(a.arg, ast.literal_eval(d)) for a, d in zip(fn.args.kwonlyargs, fn.args.kw_defaults)]
    assert documented == [(o.name, o.default) for o in TABLE]


def test_the_docstring_lists_each_option_with_its_doc():
    doc = nanguard.Guard.__doc__
    assert "{options}" not in doc
    for o in TABLE:
        entry = re.search(rf"^        {o.name}: (.*?)(?=^        \w+:|^\s*$)", doc, re.S | re.M)
        assert entry, o.name
        assert " ".join(entry.group(1).split()) == o.doc, o.name


def test_the_callbacks_take_the_table_options():
    from nanguard.integrations._common import CALLBACK_OPTIONS
    assert CALLBACK_OPTIONS == tuple(o.name for o in TABLE if o.name != "loss_scale") + ("log_metrics",)
