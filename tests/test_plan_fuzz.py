"""Property-based tests of reading plans (issue 17 point 4): whatever a plan file holds, ``Plan.from_json`` /
``Plan.from_dict`` return a valid Plan or raise ``PlanError`` naming what is wrong; they never raise anything else
and never modify their input.

The inputs: any JSON value (Hypothesis' recursive strategy, with non-finite floats and odd strings), any text, and a
valid plan with one value replaced, one key deleted, or one unknown key added, at a random place in its tree."""

from __future__ import annotations

import copy
import json
import math

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_plan import _plan_dict

from autopar_nb.plan import Plan, PlanError

SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.sampled_from([0, 1, 2, 3, -1, 1e30, 0.5, 2.5, "", "0", "1", "none", "bf16", "colwise", "h.0",
                              "\ud800", "h.0\"); import os; (\"", "__import__('os')", "Infinity"])
           | st.text(max_size=12))
JSON = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=8) | st.sampled_from(["mesh", "dp", "layers", "path"]),
                                      inner, max_size=4), max_leaves=20)
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
BASE = _plan_dict()
FREE_KEYS = ("tp", "tp_parts", "comm_by_kind", "comm_exposed_by_kind", "cpu_by_part")
"""dicts keyed by module path (a new key there is a module like any other), by collective kind or by host-CPU part
(any string)"""


def _paths(node, prefix=()):
    """Every (path, value) in a JSON tree, the root included."""
    yield prefix, node
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


PATHS = [p for p, _ in _paths(BASE) if p]


def _outcome(read, value):
    """``read(value)``: a Plan, or the PlanError; any other exception fails the test (it propagates)."""
    try:
        plan = read(value)
    except PlanError as e:
        assert str(e), "a PlanError says what is wrong"
        return e
    assert isinstance(plan, Plan)
    again = Plan.from_dict(plan.to_dict())  # a plan that was accepted is valid: it survives its own round trip
    assert again.to_dict() == plan.to_dict()
    return plan


def _at(d, path):
    for k in path:
        d = d[k]
    return d


@FAST
@given(JSON)
def test_any_json_value_is_a_plan_or_a_plan_error(value):
    before = copy.deepcopy(value)
    _outcome(Plan.from_dict, value)
    assert repr(value) == repr(before)  # repr: NaN != NaN, but prints alike


@FAST
@given(st.text(max_size=200) | JSON.map(lambda v: json.dumps(v, allow_nan=True)))
def test_any_text_is_a_plan_or_a_plan_error(text):
    _outcome(Plan.from_json, text)


@FAST
@given(st.sampled_from(PATHS), JSON, st.sampled_from(["replace", "delete", "add"]))
def test_a_valid_plan_mutated_anywhere_is_a_plan_or_a_plan_error(path, value, how):
    d = copy.deepcopy(BASE)
    parent, key = _at(d, path[:-1]), path[-1]
    if how == "replace":
        parent[key] = value
    elif how == "delete" and isinstance(parent, dict):
        del parent[key]
    elif how == "delete":
        parent.pop(key)
    else:
        target = _at(d, path)
        if isinstance(target, dict):
            target["unknown_field"] = value
        elif isinstance(target, list):
            target.append(value)
        else:
            parent[key] = value
    before = copy.deepcopy(d)
    result = _outcome(Plan.from_dict, d)
    assert d == before or any(isinstance(x, float) and math.isnan(x) for _, x in _paths(d))
    if isinstance(result, Plan) and how == "add" and path[-1] not in FREE_KEYS:  # unknown keys are refused
        assert not isinstance(_at(BASE, path), dict)


def test_deep_nesting_and_non_finite_numbers_are_plan_errors():
    for text in ["[" * 100000 + "]" * 100000, '{"schema_version": 1, "mesh": ' + "[" * 5000 + "]" * 5000 + "}",
                 "not json", ""]:
        try:
            Plan.from_json(text)
        except PlanError:
            continue
        raise AssertionError(f"{text[:20]!r} was accepted")
    for path, value in [(("mesh", "dp"), 1e30), (("mesh", "dp"), True), (("batch", "micro_batches"), 2.5),
                        (("optimizer", "lr"), "0.1"), (("optimizer", "lr"), math.inf),
                        (("optimizer", "lr"), math.nan), (("sync_batchnorm",), "no"),
                        (("layers", 0, "path"), 3), (("cluster", "nodes"), "1")]:
        d = copy.deepcopy(BASE)
        _at(d, path[:-1])[path[-1]] = value
        try:
            Plan.from_dict(d)
        except PlanError as e:
            assert str(path[-1]) in str(e) or "path" in str(e), e
            continue
        raise AssertionError(f"{path}={value!r} was accepted")
