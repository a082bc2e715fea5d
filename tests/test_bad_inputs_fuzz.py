"""Random mutations of the embedded example's plan, profile and serving config (hypothesis): one to three fields
set to a value of any type, or deleted. Each document loads, or is refused with the error of its
kind (what the CLI prints without a traceback); a plan that loads is checked, laid out and served
on the simulator without any other exception. The hand-written cases of
``test_bad_inputs_plan.py`` pin the messages; this covers what nobody thought to write."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

from ppiped.core.layout import Layout
from ppiped.daemon.config import ConfigError, config_from_dict
from ppiped.errors import UserError
from ppiped.plan import check, plan_from_json
from ppiped.profiles import profile_from_json
from ppiped.readfile import read_toml
from ppiped.sim.run import SimOptions, simulate
from ppiped.sim.workload import generate

EXAMPLE = Path(__file__).resolve().parents[1] / "plans" / "example"
PLAN: dict[str, Any] = json.loads((EXAMPLE / "plan.json").read_text())
PROFILE: dict[str, Any] = json.loads((EXAMPLE / "example.json").read_text())
PROFILES = {"example": profile_from_json(PROFILE, "example.json")}
CONFIG: dict[str, Any] = read_toml(EXAMPLE.parent / "ppiped.toml", ConfigError)

VALUES = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.integers(-3, 5),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=4), st.just([]), st.just({}),
    st.lists(st.one_of(st.integers(-3, 5), st.floats(-1, 1e9)), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(-2, 3), max_size=2))


def _paths(x: Any, at: tuple = ()) -> list[tuple]:
    out = [at]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, (*at, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, (*at, i))
    return out


@st.composite
def mutated(draw, base: dict) -> dict:
    d = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, 3), label="mutations")):
        paths = _paths(d)[1:]
        if not paths:
            break
        p = paths[draw(st.integers(0, len(paths) - 1), label="field")]
        parent = d
        for k in p[:-1]:
            parent = parent[k]
        if draw(st.booleans(), label="delete"):
            del parent[p[-1]]
        else:
            parent[p[-1]] = draw(VALUES, label=f"value of {p}")
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(d=mutated(PLAN))
def test_a_mutated_plan_loads_or_is_refused_and_what_loads_is_served(d):
    try:
        plan = plan_from_json(d, "fuzz.json")
    except UserError as e:
        note(f"refused: {e}")
        event("plan refused")
        return
    problems = check(plan, PROFILES)
    note(f"loaded; check: {problems[:3]}")
    if problems:
        event("check found problems")
        return
    try:
        Layout.from_plan(plan, PROFILES)
    except UserError as e:
        note(f"layout refused: {e}")
        event("layout refused")
        return
    event("served")
    rates = [m.throughput_rps for m in plan.models]
    res = simulate(plan, PROFILES, generate("poisson", rates, 0.02, seed=1), jitter=0.05, duration_s=0.02,
                   options=SimOptions(sigma=0.05))
    for m in res.models:
        assert m.served + m.late + sum(m.drops.values()) + m.unfinished == m.offered


@settings(max_examples=300, deadline=None)
@given(d=mutated(PROFILE))
def test_a_mutated_profile_loads_or_is_refused(d):
    try:
        profile_from_json(d, "fuzz.json")
    except UserError as e:
        note(f"refused: {e}")


@settings(max_examples=300, deadline=None)
@given(d=mutated(CONFIG))
def test_a_mutated_serving_config_loads_or_is_refused(d):
    """(The key a mutation sets may be unknown, a type TOML cannot even write, or a path to
    nowhere: each is a ConfigError naming the key, which ``ppiped serve`` prints and exits 2.)"""
    try:
        config_from_dict(d, EXAMPLE.parent / "ppiped.toml")
    except UserError as e:
        note(f"refused: {e}")
