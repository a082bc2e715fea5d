"""The exact search over per-model GPU-type vectors (ppiped/planner/decompose.py).

Checked against CBC's proven optimum of the full MILP on generated configurations with three
GPU types, its pieces against brute force (no shared data needed), and the race that runs it
beside CBC.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st
from test_planner_lagrange import TYPES, instances

from ppiped.cluster import cluster_from_flags
from ppiped.planner import decompose, lagrange, milp
from ppiped.planner.configs import PipelineConfig, Segment
from ppiped.planner.milp import Allocation, gpu_budget_used


def _instance(counts: str, models: dict[str, tuple]):
    """An instance written out: per model (weight 0.5) its pipelines, each a tuple of (GPU type,
    req/s per vGPU[, split]) partitions."""
    configs = {name: [PipelineConfig(name, 1, tuple(Segment(k, k + 1, q[0], q[2] if len(q) > 2 else 1, 1.0, 0.0, q[1])
                                                    for k, q in enumerate(p)), 1.0) for p in pipelines]
               for name, pipelines in models.items()}
    return configs, {name: 0.5 for name in models}, cluster_from_flags(counts, "1,1,1", "4,4,4", 10.0)


def _one_model(counts: str, *pipelines: tuple[tuple, ...]):
    return _instance(counts, {"m0": pipelines})


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(max_models=3))
# where a fixed-pools plan from the cutoff form counted fewer GPUs than its vGPUs need
@example(inst=_instance("A:3,B:4,C:2", {"m0": ((("A", 10.0),), (("A", 21.0),)),
                                      "m1": ((("B", 10.0, 2), ("A", 10.0)), (("B", 10.0),))}))
def test_the_search_finds_and_proves_cbcs_optimum(inst):
    configs, weights, cluster = inst
    full = milp._cbc(configs, weights, cluster, None, 60.0, 1, 1e-9, [], False)
    if full.status != "optimal":
        return  # nothing proven to compare with
    note(f"CBC optimum {full.objective}")
    hi = 2 * full.objective + 1.0  # any valid bound will do
    r = decompose.decompose_search(configs, weights, cluster, 0.0, hi, time.perf_counter() + 60, 1e-6)
    assert r is not None
    note(f"search: objective {r.objective} bound {r.bound} {r.stats}")
    assert r.bound >= full.objective * (1 - 1e-9) - 1e-9, "the bound cuts off CBC's optimum"
    if full.objective <= 1e-9:
        return
    allocs = [milp.Allocation(c, n) for c, n in r.allocs]
    assert milp._fits(allocs, cluster, False), "the plan breaks PPipe's GPU rule"
    assert r.objective == pytest.approx(milp._objective(allocs, weights), rel=1e-9)
    assert r.objective == pytest.approx(full.objective, rel=1e-6)
    assert r.bound <= r.objective * (1 + 2e-6), "the search ended without proving its plan optimal"


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(max_models=1), caps=st.lists(st.integers(0, 6), min_size=2, max_size=2),
       share=st.floats(0.05, 1.1))
def test_the_capped_oracle_matches_brute_force(inst, caps, share):
    """Fewest whole GPUs of the last type (vGPU counts continuous) under caps on the others:
    the branch-and-bound against every integer pool vector."""
    configs, _, cluster = inst
    (name, cs), = configs.items()
    mp = lagrange.model_pools(name, cs, cluster)
    demand = share * lagrange.fluid_throughput(mp.use, mp.count)
    last, others = TYPES[2], dict(zip(TYPES[:2], caps, strict=True))
    got, _ = lagrange.min_capped(mp, last, others, demand)
    want = math.inf
    for G in itertools.product(*(range(int(c) + 1) for c in mp.count)):
        per_type = {g: 0 for g in TYPES}
        for (_, g), n in zip(mp.pools, G, strict=True):
            per_type[g] += n
        if any(per_type[g] > c for g, c in others.items()) or per_type[last] >= want:
            continue
        if lagrange.fluid_throughput(mp.use, np.array(G, dtype=float)) >= demand * (1 - 1e-9):
            want = per_type[last]
    note(f"pools {mp.pools} demand {demand} got {got} want {want}")
    if math.isinf(want):
        assert math.isinf(got)
    else:
        assert want - 1e-6 <= got <= want + 1e-6


@pytest.mark.parametrize("quick", [decompose._REFUTE_QUICK_S, 0.0], ids=["quick-try-first", "cutoff-only"])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(inst=instances(max_models=1), caps=st.lists(st.integers(0, 6), min_size=2, max_size=2),
       share=st.floats(0.05, 1.1))
# where CBC, under the cutoff, said "optimal" with no plan and nothing reached the cutoff
@example(inst=_one_model("A:2,B:2,C:2", (("A", 10.0), ("A", 10.0)), (("B", 10.0), ("C", 10.0))),
         caps=[1, 1], share=0.0625)
# ... the same, where a plan did reach it
@example(inst=_one_model("A:3,B:2,C:2", (("A", 10.0), ("A", 10.0)), (("B", 11.0),), (("B", 59.5),), (("A", 10.0),),
                         (("A", 40.0),), (("A", 88.0), ("B", 113.0))), caps=[4, 6], share=0.3125)
# ... where it handed back vGPUs in pools without their GPUs
@example(inst=_one_model("A:2,B:2,C:2", (("A", 10.0), ("A", 10.0)), (("B", 10.0),)), caps=[1, 2], share=0.5)
# ... and where a cutoff 2e-5 under the demand lost the plan serving just it
@example(inst=_one_model("A:2,B:2,C:2", (("A", 10.0),), (("B", 10.0),)), caps=[0, 2], share=0.5)
def test_a_refutation_agrees_with_the_exact_oracle(quick, inst, caps, share):
    """A count of T - 1 GPUs of the last type is refuted and one of T is not, where T is
    the exact per-model MILP's fewest; the oracle answers its full question again afterwards.
    Small instances settle in the quick try, so the cutoff form (the most served, nodes below
    the demand cut off) is also run alone; a plan it hands back must keep to the caps and the
    count (CBC once handed back one that did not). Alone it may also end without the plan at
    T (CBC's first solution under the cutoff can be fractional, and the plain maximum after it
    out of time): finding that plan is the quick try's job."""
    saved = decompose._REFUTE_QUICK_S
    decompose._REFUTE_QUICK_S = quick
    try:
        _refutation_agrees(inst, caps, share, must_find=quick > 0)
    finally:
        decompose._REFUTE_QUICK_S = saved


def _refutation_agrees(inst, caps, share, must_find):
    configs, _, cluster = inst
    (name, cs), = configs.items()
    mp = lagrange.model_pools(name, cs, cluster)
    demand = share * lagrange.fluid_throughput(mp.use, mp.count)
    last, others = TYPES[2], list(TYPES[:2])
    oracle = decompose._Oracle(name, cs, cluster, others, last)
    caps = tuple(caps)
    lo, val, _ = oracle.solve(caps, demand, 30.0)
    if not math.isfinite(val) or lo != val:
        return  # no plan at these caps, or not proven: nothing to compare with
    note(f"fewest {val}")
    if val >= 1:
        lo_r, _, picks = oracle.refute(caps, demand, int(val) - 1, 30.0)
        assert picks is None and lo_r == math.inf, "a count below the fewest was not refuted"
    lo_r, val_r, picks = oracle.refute(caps, demand, int(val), 30.0)
    assert lo_r != math.inf, "the fewest count was refuted"
    assert picks is not None or not must_find
    if picks is not None:
        assert val_r <= val
        assert decompose._served(picks) >= demand * (1 - 1e-6)
        used = gpu_budget_used([Allocation(c, n) for c, n in picks])
        assert used.get(last, 0) <= val and all(used.get(g, 0) <= k for g, k in zip(others, caps, strict=True))
    assert oracle.solve(caps, demand, 30.0)[1] == val


@st.composite
def tables(draw):
    """Nonincreasing integer tables over a small grid, one per model."""
    dims = draw(st.lists(st.integers(1, 4), min_size=0, max_size=2), label="grid")
    M = draw(st.integers(1, 3), label="models")
    size = int(np.prod(dims)) if dims else 1
    T = np.zeros((M, size))
    for m in range(M):
        raw = np.array(draw(st.lists(st.integers(0, 9), min_size=size, max_size=size))).reshape(dims or ())
        for ax in range(len(dims)):  # nonincreasing along every axis: suffix maxima
            raw = np.flip(np.maximum.accumulate(np.flip(raw, ax), axis=ax), ax)
        T[m] = np.asarray(raw, dtype=float).reshape(-1)
        if draw(st.booleans()):
            T[m, 0] = np.inf  # nothing at all serves the model
    return dims, T


@settings(max_examples=80, deadline=None)
@given(tab=tables())
def test_the_split_is_the_best_one(tab):
    dims, T = tab
    grid = decompose._Grid([d - 1 for d in dims])
    v, pts = decompose._master(T, grid.dims, grid.strides)
    coords = [tuple(grid.coords[p]) for p in range(grid.size)]
    top = np.array(dims) - 1
    best = np.inf
    for combo in itertools.product(range(grid.size), repeat=T.shape[0]):
        if np.all(sum((np.array(coords[p]) for p in combo), np.zeros(len(dims), dtype=int)) <= top):
            best = min(best, sum(T[m, p] for m, p in enumerate(combo)))
    assert v == best
    if math.isfinite(v):
        assert sum(T[m, p] for m, p in enumerate(pts)) == v
        assert np.all(sum((np.array(coords[p]) for p in pts), np.zeros(len(dims), dtype=int)) <= top)


def test_bounds_spread_over_the_orthants():
    grid = decompose._Grid([3, 4, 2])
    rng = np.random.default_rng(7)
    for _ in range(20):
        p = int(rng.integers(grid.size))
        lo = rng.integers(0, 5, grid.size).astype(float)
        want = lo.copy()
        below = np.all(grid.coords <= grid.coords[p], axis=1)
        want[below] = np.maximum(want[below], 3.0)
        decompose._lift_lower(lo, grid.dims, grid.strides, p, 3.0)
        assert np.array_equal(lo, want)
        ub = rng.integers(0, 5, grid.size).astype(float)
        src = np.full(grid.size, -1, dtype=np.int64)
        want = ub.copy()
        above = np.all(grid.coords >= grid.coords[p], axis=1)
        lower = above & (ub > 2.0)
        want[lower] = 2.0
        decompose._cap_upper(ub, src, grid.dims, grid.strides, p, 2.0, 5)
        assert np.array_equal(ub, want) and np.array_equal(src == 5, lower)


def test_a_grid_too_large_is_left_to_the_milp():
    configs, weights, cluster = _world("A:300,B:300,C:300")
    assert decompose.decompose_search(configs, weights, cluster, 0.0, 1e9, time.perf_counter() + 5, 1e-6) is None


def _world(gpus: str):
    from ppiped.cluster import cluster_from_flags
    from ppiped.planner.configs import PipelineConfig, Segment

    cluster = cluster_from_flags(gpus, "1,1,1", "1,1,1", 10.0)
    cs = [PipelineConfig("m0", 1, (Segment(0, 1, g, 1, 1.0, 0.0, 10.0 + i),), 1.0) for i, g in enumerate(TYPES)]
    return {"m0": cs}, {"m0": 1.0}, cluster


def test_the_race_kills_at_the_limit_and_stops_the_rest_once_settled():
    seen = []

    def settle(i, answer, how):
        seen.append((i, answer, how))
        return i == 1

    t0 = time.monotonic()
    milp.race([(lambda: time.sleep(30), 60.0), (lambda: 42, 60.0)], settle)
    assert seen == [(1, 42, "ok"), (0, None, "stopped")] and time.monotonic() - t0 < 10
    seen.clear()
    milp.race([(lambda: time.sleep(30), 0.5), (lambda: 7, 5.0)], lambda i, a, h: seen.append((i, a, h)) or False)
    assert sorted(seen) == [(0, None, "killed"), (1, 7, "ok")]


def test_cbc_models_are_built_without_the_bound_propagation_that_calls_feasible_ones_infeasible():
    """min G with x <= 10 n0, x <= 10 n1, x <= 51 n2, their sum >= 265, n0 + n1 + n2 <= G <= 7:
    six GPUs of the 51 pipeline serve it; cbcbox 2.935's default bound propagation said
    "infeasible" ("FBBT divergence")."""
    def run():
        m = milp.cbc_model("MIN")
        xs, ns = [], []
        for r in (10.0, 10.0, 51.0):
            x, n = m.add_var(), m.add_var(var_type="I", ub=7)
            m += x <= r * n
            xs.append(x)
            ns.append(n)
        m += xs[0] + xs[1] + xs[2] >= 265.0
        G = m.add_var(var_type="I", ub=7)
        m += ns[0] + ns[1] + ns[2] <= G
        m.objective = G
        with milp.quiet_stdout():
            return m.optimize(max_seconds=10).name, m.objective_value

    answer, how = milp.in_child(run, 30.0)
    assert how == "ok" and answer == ("OPTIMAL", pytest.approx(6.0))
