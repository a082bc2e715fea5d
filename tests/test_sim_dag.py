"""App queries in the simulator (#17): every query accounted once, children only from served
parents, the three deadline modes on time at light load, determinism, clear errors. Synthetic
profiles (the world of test_apps_plan)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from test_apps_plan import LIMIT, PARAMS, PROFILES, cluster, tree_app, two_stage

from ppiped.core.layout import Layout
from ppiped.errors import InputError
from ppiped.query.split import plan_apps
from ppiped.sim import engine as E
from ppiped.sim.dag import app_capacity_qps, app_workload, default_policy, simulate_apps
from ppiped.sim.run import SimOptions, Simulation


@pytest.fixture(scope="module")
def plans():
    return {"chain": plan_apps(PROFILES, [two_stage()], cluster(), PARAMS, time_limit=LIMIT),
            "tree": plan_apps(PROFILES, [tree_app()], cluster(), PARAMS, time_limit=LIMIT)}


def _run(plan, mode, lf, seed=0, duration=4.0, policy=None):
    lay = Layout.from_plan(plan, PROFILES)
    a = plan.apps[0]
    w = app_workload(plan, lay, {a.name: lf * app_capacity_qps(plan, a)}, duration, seed, mode)
    pol = policy or default_policy(mode)
    sim = Simulation(plan, PROFILES, None, pol, seed, duration, SimOptions(), lay, dag=w)
    return sim, w, sim.run()


@pytest.mark.parametrize("shape", ["chain", "tree"])
@pytest.mark.parametrize("mode", ["split", "e2e", "chain"])
def test_every_query_is_accounted_once_and_children_come_only_from_served_parents(plans, shape, mode):
    sim, w, r = _run(plans[shape], mode, 1.4)
    a = r.apps[0]
    assert a.queries == w.n_roots > 100
    assert a.ok + a.late + sum(a.dropped.values()) == a.queries
    assert r.counters["ended_twice"] == 0
    assert a.ok < a.queries  # overloaded: something was dropped
    spawned = np.isfinite(sim.arr_t)
    for r_id in range(len(sim.arr_t)):
        c0, nc = w.dq_i[r_id, E.DQ_C0], w.dq_i[r_id, E.DQ_NC]
        if nc == 0:
            continue
        kids = spawned[c0:c0 + nc]
        assert kids.all() == kids.any()  # a parent's children arrive together or not at all
        if kids.any():
            assert sim.r_state[r_id] == E.R_SERVED
            assert np.all(sim.arr_t[c0:c0 + nc] >= sim.r_end[r_id])
        elif mode == "chain" and spawned[r_id]:
            # a client chaining by hand goes on whenever it gets an answer
            assert sim.r_state[r_id] != E.R_SERVED
    if mode == "chain":
        assert not np.any(sim.r_state == E.R_CANCELLED)
    # nothing left behind: every spawned request ended one way or another
    assert not np.any(sim.r_state[spawned] == E.R_PENDING)
    # the models count a failed or late query's GPU time invalid, as the app does (and the daemon)
    per_model = sum(m.invalid_rate * float(sim.r_gpu[sim.arr_m == i].sum()) for i, m in enumerate(r.models))
    assert per_model == pytest.approx(a.invalid_rate * a.gpu_s * 1e6, rel=1e-9, abs=1e-6)


@pytest.mark.parametrize("mode", ["split", "e2e", "chain"])
def test_light_load_meets_the_end_to_end_slo_in_every_mode(plans, mode):
    _, _, r = _run(plans["tree"], mode, 0.2, duration=6.0)
    a = r.apps[0]
    assert a.attainment >= 0.99
    assert a.p99_ms <= plans["tree"].apps[0].slo_us / 1e3


def test_a_query_without_children_is_done_when_its_root_is(plans):
    plan = plans["chain"]
    app = plan.apps[0]
    sparse = replace(app, stages=(app.stages[0], replace(app.stages[1], fanout=0.05)))
    plan.apps = [sparse]
    try:
        sim, w, r = _run(plan, "e2e", 0.3)
    finally:
        plan.apps = [app]
    lonely = [q for q in range(len(w.q_root)) if w.qm0[q + 1] - w.qm0[q] == 1]
    assert len(lonely) > 0.8 * len(w.q_root)
    roots = w.q_root[lonely]
    served = sim.r_state[roots] == E.R_SERVED
    assert served.mean() > 0.99
    assert r.apps[0].ok >= int(served.sum())


def test_the_downstream_estimate_keeps_each_stage_its_planned_share_in_engine_and_daemon_alike():
    """The simulator's compiled estimate (engine._rest) and the daemon's (query.app.downstream_us
    over the core's stage estimates) give the same rest on the same core state; and a congested
    middle stage cannot hide behind an idle last one: each stage counts at least its planned
    share, so the rest exceeds both the live sum and the planned total."""
    from ppiped.core.scheduler import Scheduler
    from ppiped.query.app import app_from_json, downstream_us, planned_yield

    app = app_from_json({"name": "line", "slo_ms": 400, "glue_ms": 2, "stages": [
        {"name": "detect", "model": "det"},
        {"name": "classify", "model": "cls", "after": "detect", "fanout": 2, "glue": "ppiped.query.example_glue:crop"},
        {"name": "describe", "model": "slow", "after": "classify", "glue": "ppiped.query.example_glue:crop"}]})
    plan = plan_apps(PROFILES, [app], cluster(), PARAMS, time_limit=LIMIT)
    app = plan.apps[0]
    lay = Layout.from_plan(plan, PROFILES)
    w = app_workload(plan, lay, {app.name: 10.0}, 0.5, 0, "e2e")
    midx = {m: i for i, m in enumerate(lay.models)}
    sched = Scheduler(plan, PROFILES, "pard", lay)
    span = app.slo_us
    cls = midx["cls"]
    sched.submit_many(0, 300, cls, 0.0, 10 * span)  # a backlog on the middle stage only

    def est(stage: int, n: int) -> float:
        return sched.stage_estimate_us(midx[app.stages[stage].model], 0.0, n)

    F = sched._A.view(np.float64)
    for k in (1, 3):
        want = [0.0] * 3
        for i in (1, 2):  # the daemon's tracker: children for k parents, deeper for one
            n = planned_yield(app.stages[i].fanout)
            want[i] = est(i, n * k if app.stages[i].parent == 0 else n)
        rest = downstream_us(app, want, span)[0]
        got = E._rest(sched._A, F, midx["det"], k, 0.0, span, w.m_c0, w.m_cm, w.m_n, w.m_order, w.m_glue,
                      w.m_share, np.zeros(len(lay.models)))
        assert got == pytest.approx(rest, rel=1e-12)
        live = downstream_us(app, want)[0]
        planned = span - app.end_us(0) * span / app.slo_us
        assert want[1] > app.stages[1].budget_us and want[2] < app.stages[2].budget_us
        assert rest > max(live, planned) + 1.0


def test_the_options_jitter_holds_unless_sigma_is_given(plans):
    """options=SimOptions(sigma=0) without sigma ran at the default 0.05: two sources, one value."""
    kw = {"duration_s": 1.0, "seed": 3}
    exact = simulate_apps(plans["chain"], PROFILES, 1.2, "e2e", sigma=0.0, **kw).to_json(speed=False)
    via = simulate_apps(plans["chain"], PROFILES, 1.2, "e2e", options=SimOptions(sigma=0.0), **kw)
    noisy = simulate_apps(plans["chain"], PROFILES, 1.2, "e2e", **kw)
    assert via.to_json(speed=False) == exact != noisy.to_json(speed=False)


def test_same_seed_same_numbers(plans):
    r1 = simulate_apps(plans["chain"], PROFILES, 1.2, "e2e", duration_s=2.0, seed=3)
    r2 = simulate_apps(plans["chain"], PROFILES, 1.2, "e2e", duration_s=2.0, seed=3)
    assert r1.to_json(speed=False) == r2.to_json(speed=False)
    assert r1.to_json(speed=False)["apps"][0]["queries"] > 0


def test_bad_requests_of_the_workload_are_named(plans):
    plan = plans["chain"]
    lay = Layout.from_plan(plan, PROFILES)
    with pytest.raises(InputError, match="no app 'nope'"):
        app_workload(plan, lay, {"nope": 10.0}, 1.0, 0)
    with pytest.raises(InputError, match="deadline mode"):
        app_workload(plan, lay, {"q": 10.0}, 1.0, 0, mode="fastest")
    unsplit = replace(plan.apps[0], stages=tuple(replace(st, budget_us=0.0) for st in plan.apps[0].stages))
    saved = plan.apps
    plan.apps = [unsplit]
    try:
        with pytest.raises(InputError, match="no SLO split"):
            app_workload(plan, lay, {"q": 10.0}, 1.0, 0, mode="split")
    finally:
        plan.apps = saved


def test_sim_command_runs_a_plan_with_apps(plans, tmp_path, capsys):
    import json

    from ppiped.cli import main as cli
    from ppiped.plan import save_plan
    from ppiped.profiles import save_profile

    for p in PROFILES.values():
        save_profile(p, tmp_path / f"{p.model}.json")
    save_plan(plans["chain"], tmp_path / "plan.json")
    base = ["sim", "--plan", str(tmp_path / "plan.json"), "--profiles", str(tmp_path), "--duration", "2"]
    assert cli([*base, "--load-factor", "1.0", "--app-deadlines", "split", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "ppipe-early-drop" and out["app_deadlines"] == "split"
    (a,) = out["apps"]
    assert a["app"] == "q" and a["queries"] > 0
    assert cli([*base, "--rate", "100"]) == 2
    assert "--load-factor" in capsys.readouterr().err


@pytest.mark.parametrize("mode, policy", [("split", "ppipe-early-drop"), ("e2e", "pard"), ("chain", "ppipe")])
def test_each_deadline_mode_defaults_to_its_systems_policy(plans, mode, policy):
    """e2e is PARD's: its default is pard, not the e2e-ppipe variant listed after it."""
    assert simulate_apps(plans["chain"], PROFILES, 0.5, mode, duration_s=0.2).policy == policy


def test_app_runs_take_every_world_flag(plans, monkeypatch, tmp_path, capsys):
    """--start-early-us, --noise-z, --margin-quantile and --trace-scale were dropped for plans
    with apps: the run got the defaults."""
    from ppiped.cli import build_parser
    from ppiped.commands import sim as cmd
    from ppiped.sim import dag, run

    trace = tmp_path / "t.csv"
    trace.write_text("app,func,end_timestamp,duration\n" + "".join(f"a,f,{i * 0.01:.2f},0\n" for i in range(50)))
    seen = {}
    real_sim, real_gen = run.Simulation.__init__, dag.generate

    def sim_init(self, *a, **kw):
        seen["options"] = a[6]
        real_sim(self, *a, **kw)

    def gen(*a):
        seen["trace_scale"] = a[5]
        return real_gen(*a)

    monkeypatch.setattr(run.Simulation, "__init__", sim_init)
    monkeypatch.setattr(dag, "generate", gen)
    args = build_parser().parse_args(
        ["sim", "--plan", "p", "--profiles", "d", "--load-factor", "0.5", "--duration", "0.2", "--trace", str(trace),
         "--trace-scale", "fold", "--start-early-us", "0", "--noise-z", "2", "--margin-quantile", "0.5", "--json"])
    assert cmd._run_apps(args, plans["chain"], PROFILES) == 0
    assert seen["options"] == cmd.options_from(args)
    assert (seen["options"].start_early_us, seen["options"].noise_z, seen["options"].margin_quantile) == (0, 2, 0.5)
    assert seen["trace_scale"] == "fold"


def test_sweep_refuses_a_plan_with_apps(plans, tmp_path):
    """sweep loaded an app's stages as independent models at their planned rates."""
    from conftest import assert_refused, run_cli

    from ppiped.plan import save_plan

    path = tmp_path / "app.json"
    save_plan(plans["chain"], path)
    p = run_cli(["ppiped.cli", "sweep", "--plan", str(path), "--profiles", str(tmp_path), "--duration", "0.2"])
    assert_refused(p, "a plan with apps is not swept", 2, prefix="ppiped sweep: error: --plan")
