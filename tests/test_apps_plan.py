"""Planning apps (#17): every stage planned as a model at the app's rate times its fan-outs, the
SLO split across stages (dp, even, fixed) with every path within the SLO, the split reported and
checked, clear errors for what no plan can serve, and the plan file round trip. Synthetic
profiles, plus one run over the shared profiles where they are present."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from ppiped.cli import main as cli
from ppiped.cluster import cluster_from_json
from ppiped.errors import InputError
from ppiped.plan import PlanParams, check, format_plan_table, load_plan, save_plan
from ppiped.profiles import Profile, save_profile
from ppiped.query.app import App, Stage, app_from_json
from ppiped.query.split import load_apps, plan_apps, split_apps

# --- a synthetic world: a detector-like model, a fast classifier and a slow model ------------


def _profile(name: str, scale: float) -> Profile:
    """Four blocks on a fast GPU "A" (splits 1-2) and a slow "B" (split 1), batch sizes 1-4;
    ``scale`` 1 takes 14 ms on A at batch size 1."""
    base = np.array([3000.0, 5000.0, 4000.0, 2000.0]) * scale
    bs = np.arange(1, 5)

    def lat(mult: float, split: int) -> np.ndarray:
        return np.outer(base * mult * (1 + 0.7 * (split - 1)), 1 + 0.55 * (bs - 1))

    latency = {"A": {1: lat(1.0, 1), 2: lat(1.0, 2)[:, :2]}, "B": {1: lat(2.6, 1)}}
    return Profile(name, 4, latency, np.array([600_000.0, 300_000.0, 150_000.0]),
                   {"A": float(base.sum()), "B": float(base.sum() * 2.6)})


PROFILES = {"det": _profile("det", 1.0), "cls": _profile("cls", 0.3), "slow": _profile("slow", 3.0),
            "other": _profile("other", 0.6)}
PARAMS = PlanParams(slo_scale=5.0, slo_reference_gpu="A")
RATES = {"det": 300.0, "cls": 900.0, "slow": 100.0, "other": 300.0}
LIMIT = 20.0


def cluster(a: int = 4, b: int = 8):
    return cluster_from_json({"nic_gbps": 10, "gpus": {
        "A": {"count": a, "per_server": 2, "splits": [1, 2]},
        "B": {"count": b, "per_server": 1, "splits": [1]}}})


def two_stage(first="det", second="cls", slo_ms=150.0, fanout=3.0, glue_ms=2.0, **stage) -> App:
    return app_from_json({"name": "q", "slo_ms": slo_ms, "glue_ms": glue_ms, "stages": [
        {"name": "first", "model": first},
        {"name": "second", "model": second, "after": "first", "fanout": fanout, "glue": "ppiped.query.example_glue:crop", **stage}]})


def tree_app() -> App:
    """det at the root, then cls (fan-out 2) and slow (fan-out 1) beside each other."""
    return app_from_json({"name": "tree", "slo_ms": 400, "glue_ms": 3, "weight": 2, "stages": [
        {"name": "detect", "model": "det"},
        {"name": "classify", "model": "cls", "after": "detect", "fanout": 2, "glue": "ppiped.query.example_glue:crop"},
        {"name": "describe", "model": "slow", "after": "detect", "glue": "ppiped.query.example_glue:crop"}]})


def _paths_fit(app: App) -> None:
    assert app.split_done
    for p in app.paths():
        assert app.end_us(p[-1]) <= app.slo_us * (1 + 1e-9)
        assert app.end_us(p[-1]) == pytest.approx(app.slo_us)  # leaves take what their path leaves


# --- planning -------------------------------------------------------------------------------


def test_fanout_three_plans_the_downstream_stage_at_three_times_the_upstream_rate():
    plan = plan_apps(PROFILES, [two_stage()], cluster(), PARAMS, time_limit=LIMIT)
    assert check(plan, PROFILES) == []
    up, down = plan.model("det"), plan.model("cls")
    assert down.weight == pytest.approx(3 * up.weight)
    query_rps = min(up.throughput_rps, down.throughput_rps / 3)
    assert query_rps == pytest.approx(plan.normalized_throughput * plan.apps[0].weight, rel=1e-6)
    assert down.throughput_rps >= 3 * query_rps * (1 - 1e-6)
    # Up to the integer pools' rounding (the upstream may hold a little spare), 3x the upstream.
    assert down.throughput_rps >= 3 * up.throughput_rps * 0.9
    _paths_fit(plan.apps[0])
    # Without the fan-out the same two models are planned at about the same rate.
    one = plan_apps(PROFILES, [two_stage(fanout=1.0)], cluster(), PARAMS, time_limit=LIMIT)
    assert one.model("cls").throughput_rps < 1.5 * one.model("det").throughput_rps


def test_stage_slos_are_the_budgets_and_every_path_fits():
    app = tree_app()
    plan = plan_apps(PROFILES, [app], cluster(), PARAMS, time_limit=LIMIT, batch_delay_rates=RATES)
    assert check(plan, PROFILES) == []
    (got,) = plan.apps
    assert got.split == "dp"
    _paths_fit(got)
    for i, s in enumerate(got.stages):
        m = plan.model(s.model)
        assert m.slo_us == pytest.approx(s.budget_us)
        assert m.weight == pytest.approx(2 * app.rate_factor(i))
    rep = plan.solver["apps"]["tree"]
    assert rep["method"] == "dp"
    assert [r["stage"] for r in rep["stages"]] == ["detect", "classify", "describe"]
    assert sum(r["share"] for r in rep["stages"][:2]) <= 1.0
    assert [r["rate_factor"] for r in rep["stages"]] == [1.0, 2.0, 1.0]
    assert set(rep["dp"]["costs_gpus_per_rps"]) == {"detect", "classify", "describe"}
    assert len(rep["dp"]["costs_gpus_per_rps"]["detect"]) == 20
    json.dumps(plan.to_json())  # the report is plain JSON


def test_dp_beats_or_equals_even_when_one_stage_is_much_slower():
    app = two_stage("slow", "cls", slo_ms=110.0, fanout=2.0)
    plans = {m: plan_apps(PROFILES, [app], cluster(), PARAMS, method=m, time_limit=LIMIT) for m in ("dp", "even")}
    for m, p in plans.items():
        assert check(p, PROFILES) == [], m
        _paths_fit(p.apps[0])
        assert p.apps[0].split == m
    dp, even = plans["dp"], plans["even"]
    assert dp.normalized_throughput >= even.normalized_throughput * (1 - 1e-6)
    # The split differs: even gives the fast classifier its latency's small share.
    assert dp.apps[0].stages[1].budget_us != pytest.approx(even.apps[0].stages[1].budget_us)


def test_even_is_in_proportion_to_latency_and_fixed_keeps_the_files_budgets():
    sp = split_apps(PROFILES, [two_stage("slow", "cls", slo_ms=110.0, glue_ms=0.0)], cluster(), PARAMS,
                    method="even")
    first, second = sp.apps[0].stages
    assert first.budget_us / second.budget_us == pytest.approx(3.0 / 0.3)
    app = app_from_json({"name": "f", "slo_ms": 150, "glue_ms": 1, "stages": [
        {"name": "a", "model": "det", "budget_ms": 100},
        {"name": "b", "model": "cls", "after": "a", "fanout": 2, "glue": "ppiped.query.example_glue:crop", "budget_ms": 30}]})
    sp = split_apps(PROFILES, [app], cluster(), PARAMS, method="fixed")
    assert [s.budget_us for s in sp.apps[0].stages] == [100_000.0, 49_000.0]  # the leaf takes the rest
    assert sp.slos_us == [100_000.0, 49_000.0]
    assert sp.weights == [1.0, 2.0]


def test_apps_beside_plain_models_share_one_objective():
    plan = plan_apps(PROFILES, [two_stage()], cluster(), PARAMS, models=["other"], weights=[2.0],
                     time_limit=LIMIT, batch_delay_rates=RATES)
    assert check(plan, PROFILES) == []
    assert [m.model for m in plan.models] == ["other", "det", "cls"]
    assert plan.model("other").slo_us == pytest.approx(5.0 * PROFILES["other"].whole_model_latency_us["A"])
    assert plan.normalized_throughput == pytest.approx(
        min(m.throughput_rps / m.weight for m in plan.models))


def test_the_dp_finds_the_cheapest_split_that_fits_every_path():
    """Against brute force over every grid assignment, on random non-increasing costs."""
    import itertools
    import math

    from ppiped.query.split import _dp

    app, steps = tree_app(), 10
    u = app.slo_us / steps
    rng = np.random.default_rng(7)
    for _ in range(30):
        costs = []
        for _ in app.stages:
            c = np.sort(rng.uniform(0.1, 5.0, steps))[::-1].tolist()
            for k in range(int(rng.integers(0, 4))):
                c[k] = math.inf  # too small a budget for the stage
            costs.append(c)
        best = math.inf
        for ks in itertools.product(range(1, steps + 1), repeat=len(app.stages)):
            if all(sum(ks[j] for j in p) * u + app.glue_us * (len(p) - 1) <= app.slo_us for p in app.paths()):
                best = min(best, sum(app.rate_factor(i) * costs[i][k - 1] for i, k in enumerate(ks)))
        ks, obj = _dp(app, costs, steps)
        if math.isinf(best):
            assert ks is None
            continue
        assert obj == pytest.approx(best)
        assert sum(app.rate_factor(i) * costs[i][k - 1] for i, k in enumerate(ks)) == pytest.approx(best)
        assert all(sum(ks[j] for j in p) * u + app.glue_us * (len(p) - 1) <= app.slo_us for p in app.paths())


# --- what no plan can serve -----------------------------------------------------------------


@pytest.mark.parametrize("fanout", [0.0, -1.0, float("nan"), float("inf"), 1e300])
def test_a_fanout_out_of_range_names_the_stage(fanout):
    with pytest.raises(InputError, match=r"stage 'second'.*fanout.*in \(0, 10000\]"):
        two_stage(fanout=fanout)


@pytest.mark.parametrize("slo_ms", [0.0, -5.0, float("nan"), float("inf"), 1e12])
def test_an_slo_out_of_range_names_the_app(slo_ms):
    """Up to an hour: a 10^12 ms SLO planned, and the simulator then ran its queries for ever."""
    with pytest.raises(InputError, match=r"app 'q'.*slo must be a positive number of ms up to 3.6e\+06"):
        two_stage(slo_ms=slo_ms)


def test_an_app_naming_an_unknown_model():
    with pytest.raises(InputError, match=r"app 'q', stage 'second': no profile for model 'nope'"):
        split_apps(PROFILES, [two_stage(second="nope")], cluster(), PARAMS)


def test_an_slo_no_split_can_meet_names_the_stage_and_the_fastest_latency():
    # slow takes 42 ms at batch size 1 on A: with the 40 % margin it needs 70 ms of a 50 ms SLO.
    with pytest.raises(InputError) as e:
        split_apps(PROFILES, [two_stage("slow", "cls", slo_ms=50.0)], cluster(), PARAMS)
    msg = str(e.value)
    assert "app 'q', stage 'first' (model slow)" in msg
    assert "42.0 ms at batch size 1" in msg and "at least 70.0 ms" in msg
    for method in ("even",):
        with pytest.raises(InputError, match=r"stage 'first' \(model slow\).*42\.0 ms"):
            split_apps(PROFILES, [two_stage("slow", "cls", slo_ms=50.0)], cluster(), PARAMS, method=method)


def test_stages_that_fit_alone_but_not_together():
    # det needs >= 23.3 ms and slow >= 70 ms after the margin; each fits 90 ms, not both.
    with pytest.raises(InputError, match=r"no split of the SLO of 90\.0 ms.*first -> second"):
        split_apps(PROFILES, [two_stage("det", "slow", slo_ms=90.0, glue_ms=0.0)], cluster(), PARAMS)


def test_a_model_both_plain_and_in_an_app():
    with pytest.raises(InputError, match=r"model 'cls' is also listed as a plain model"):
        split_apps(PROFILES, [two_stage()], cluster(), PARAMS, models=["cls"])


def test_fixed_split_needs_budgets_and_unknown_split():
    with pytest.raises(InputError, match="fixed split needs budget_ms on every stage"):
        split_apps(PROFILES, [two_stage()], cluster(), PARAMS, method="fixed")
    with pytest.raises(InputError, match="unknown SLO split 'nexus'"):
        split_apps(PROFILES, [two_stage()], cluster(), PARAMS, method="nexus")


# --- the checker and the plan file ----------------------------------------------------------


def test_plan_json_round_trips_with_apps(tmp_path):
    plan = plan_apps(PROFILES, [tree_app()], cluster(), PARAMS, time_limit=LIMIT, batch_delay_rates=RATES)
    path = tmp_path / "plan.json"
    save_plan(plan, path)
    back = load_plan(path)
    assert back.apps == plan.apps
    assert back.solver["apps"] == json.loads(json.dumps(plan.solver["apps"]))
    assert check(back, PROFILES) == []
    assert "describe" in format_plan_table(back)


def test_check_reports_stage_slos_off_budget_and_paths_over_the_slo():
    plan = plan_apps(PROFILES, [two_stage()], cluster(), PARAMS, time_limit=LIMIT, batch_delay_rates=RATES)
    plan.model("cls").slo_us += 5_000.0  # a looser SLO than the stage's budget
    assert [v.rule for v in check(plan, PROFILES)] == ["app-budget"]
    plan.model("cls").slo_us -= 5_000.0
    a = plan.apps[0]
    over = replace(a, stages=(a.stages[0], replace(a.stages[1], budget_us=a.stages[1].budget_us + 1_000.0)))
    plan.apps = [over]
    vs = check(plan, PROFILES)
    assert {v.rule for v in vs} == {"app-budget", "app-slo"}
    assert any("first -> second" in str(v) for v in vs)
    plan.apps = [App("x", 100_000.0, (Stage("s", "missing"),))]
    assert "app-split" in [v.rule for v in check(plan, PROFILES)]


# --- the command ----------------------------------------------------------------------------

APPS_TOML = """
[[apps]]
name = "plates"
slo_ms = 150
glue_ms = 2

[[apps.stages]]
name = "detect"
model = "det"

[[apps.stages]]
name = "read"
model = "cls"
after = "detect"
fanout = 3
glue = "ppiped.query.example_glue:crop"
"""


@pytest.fixture
def profile_dir(tmp_path):
    d = tmp_path / "profiles"
    d.mkdir()
    for p in PROFILES.values():
        save_profile(p, d / f"{p.model}.json")
    return d


def _plan_cmd(profile_dir, apps_file, *extra):
    return ["plan", "--profiles", str(profile_dir), "--gpus", "A:4,B:8", "--gpus-per-server", "2,1",
            "--vgpu-splits", "2,1", "--slo-reference-gpu", "A", "--time-limit", "20",
            "--apps", str(apps_file), *extra]


@pytest.mark.parametrize("glue,why", [("no_such_module_xyz:crop", "No module named 'no_such_module_xyz'"),
                                      ("ppiped.query.example_glue:no_such_fn", "no_such_fn")])
def test_a_glue_that_does_not_import_is_refused_by_plan_and_flagged_by_check(profile_dir, tmp_path, capsys,
                                                                           glue, why):
    """The daemon refused to start on it while plan and check said ok."""
    good, bad = tmp_path / "apps.toml", tmp_path / "bad.toml"
    good.write_text(APPS_TOML)
    bad.write_text(APPS_TOML.replace("ppiped.query.example_glue:crop", glue))
    assert cli(_plan_cmd(profile_dir, bad)) == 2
    err = capsys.readouterr().err
    assert "app 'plates', stage 'read': glue" in err and why in err and "Traceback" not in err
    out = tmp_path / "plan.json"
    assert cli(_plan_cmd(profile_dir, good, "-o", str(out))) == 0
    plan = load_plan(out)
    a = plan.apps[0]
    plan.apps = [replace(a, stages=(a.stages[0], replace(a.stages[1], glue=glue)))]
    vs = [v for v in check(plan, PROFILES) if v.rule == "glue-import"]
    assert len(vs) == 1 and why in vs[0].message


def test_cli_plans_apps_and_prints_the_split(profile_dir, tmp_path, capsys):
    f = tmp_path / "apps.toml"
    f.write_text(APPS_TOML)
    out = tmp_path / "plan.json"
    assert cli(_plan_cmd(profile_dir, f, "--models", "other", "-o", str(out))) == 0
    text = capsys.readouterr().out
    assert "budget ms" in text and "plates" in text and "read" in text and "queries/s" in text
    plan = load_plan(out)
    assert [a.name for a in plan.apps] == ["plates"]
    assert [m.model for m in plan.models] == ["other", "det", "cls"]
    assert plan.apps[0].split == "dp"
    assert cli(_plan_cmd(profile_dir, f, "--split", "even", "--json")) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["solver"]["apps"]["plates"]["method"] == "even"
    assert cli(["check", str(out), "--profiles", str(profile_dir)]) == 0


@pytest.mark.parametrize("text, why", [
    ("[[apps]\nname = 1", "not valid TOML"),
    ("[[apps]]\nname = 'a'\nslo_ms = 100\n[[apps.stages]]\nmodel = 'det'\nfanuot = 2\n", "unknown key"),
    ("[[apps]]\nname = 'a'\nslo_ms = 100\n[[apps.stages]]\nmodel = 'det'\n[[apps.stages]]\nmodel = 'cls'\n"
     "after = 'nope'\nglue = 'ppiped.query.example_glue:crop'\n", "'after' must name a stage listed before it"),
    ("[[apps]]\nname = 'a'\nslo_ms = 100\n[[apps.stages]]\nmodel = 'det'\n[[apps.stages]]\nmodel = 'nope'\n"
     "after = 'det'\nglue = 'ppiped.query.example_glue:crop'\n", "app 'a', stage 'nope': unknown model 'nope'"),
    ("[[apps]]\nname = 'a'\nslo_ms = 20\n[[apps.stages]]\nmodel = 'slow'\n", "stage 'slow' (model slow)"),
    ("[[apps]]\nname = 'a'\nslo_ms = 100\n[[apps.stages]]\nmodel = 'other'\n", "also listed as a plain model"),
    ("[[apps]]\nname = 'a'\nslo_ms = 100\n[[apps.stages]]\nmodel = 'det'\n[[apps.stages]]\nmodel = 'cls'\n"
     "after = 'det'\nfanout = 0\nglue = 'ppiped.query.example_glue:crop'\n", "fanout is the mean number"),
    ("[[apps]]\nname = 'a'\nslo_ms = 100\nweight = 0\n[[apps.stages]]\nmodel = 'det'\n", "weight must be positive"),
    ("apps = 3\n", "'apps' must be a list"),
    ("[[apps]]\nname = 'a'\nslo_ms = 100\n[[apps.stages]]\nmodel = 'det'\n[[apps.stages]]\nmodel = 'cls'\n"
     "after = 'det'\nfanout = 1e-9\nglue = 'ppiped.query.example_glue:crop'\n",
     "stage 'cls': its load weight, the app's weight 1 x the fan-outs on its path 1e-09"),
    ("[[apps]]\nname = \"a\\n\"\nslo_ms = 100\n[[apps.stages]]\nmodel = 'det'\n", "app 'a\\n': a name is"),
    ("[[apps]]\nname = 'a'\nslo_ms = 100\n[[apps.stages]]\nmodel = 'det'\n[[apps.stages]]\nmodel = 'cls'\n"
     "after = 'det'\nglue = \"ppiped.query.example_glue:crop\\n\"\n", "module:function"),
    ("[app]\nname = 'a'\n", "top-level 'apps' list"),
])
def test_cli_bad_apps_files_exit_2_with_the_reason(profile_dir, tmp_path, capsys, text, why):
    f = tmp_path / "apps.toml"
    f.write_text(text)
    assert cli(_plan_cmd(profile_dir, f, "--models", "other")) == 2
    err = capsys.readouterr().err
    assert "ppiped plan: error:" in err and why in err and str(f) in err


def test_cli_split_needs_apps(profile_dir, capsys):
    args = ["plan", "--profiles", str(profile_dir), "--gpus", "A:4", "--models", "other", "--split", "even"]
    assert cli(args) == 2
    assert "give --apps FILE" in capsys.readouterr().err


def test_cli_reads_json_apps_files(profile_dir, tmp_path, capsys):
    f = tmp_path / "apps.json"
    f.write_text(json.dumps({"apps": [{"name": "solo", "slo_ms": 100, "stages": [{"model": "det"}]}]}))
    assert cli(_plan_cmd(profile_dir, f, "--json")) == 0
    rep = json.loads(capsys.readouterr().out)
    assert list(rep["models"]) == ["det"]
    assert rep["solver"]["apps"]["solo"]["stages"][0]["share"] == pytest.approx(1.0)


def test_load_apps_file(tmp_path):
    f = tmp_path / "apps.toml"
    f.write_text(APPS_TOML)
    (a,) = load_apps(f)
    assert a.slo_us == 150_000.0 and a.glue_us == 2_000.0
    assert a.rate_factor(1) == 3.0 and not a.split_done


# --- the shared profiles --------------------------------------------------------------------


def test_shared_detector_then_classifier(shared_profiles):
    det, cls = "tf_efficientdet_d1", "googlenet-v3-pytorch"
    if det not in shared_profiles or cls not in shared_profiles:
        pytest.skip("the shared detector or classifier profile is missing")
    ref = {m: shared_profiles[m].whole_model_latency_us["L4"] for m in (det, cls)}
    app = app_from_json({"name": "dc", "slo_ms": 5 * (ref[det] + ref[cls]) / 1e3, "glue_ms": 1, "stages": [
        {"name": "detect", "model": det},
        {"name": "classify", "model": cls, "after": "detect", "fanout": 3, "glue": "ppiped.query.example_glue:crop"}]})
    cl = cluster_from_json({"nic_gbps": 10, "gpus": {
        "L4": {"count": 4, "per_server": 1, "splits": [1, 2, 3, 4]},
        "P4": {"count": 8, "per_server": 1, "splits": [1]}}})
    plan = plan_apps(shared_profiles, [app], cl, PlanParams(), time_limit=30.0)
    assert check(plan, shared_profiles) == []
    _paths_fit(plan.apps[0])
    up, down = plan.model(det), plan.model(cls)
    assert down.throughput_rps >= 3 * min(up.throughput_rps, down.throughput_rps / 3) * (1 - 1e-6)
    assert down.weight == pytest.approx(3 * up.weight)


def test_the_dp_split_keeps_to_the_time_limit(monkeypatch):
    """The limit is the whole plan's: refining rounds run only in its first half, and a first
    round that overruns it is an error naming the app (a 12-stage app took 8 s of a 3 s limit).
    The clock here moves 1 s per grid cost computed (3 stages x 20 budgets a round)."""
    import types

    import ppiped.query.split as sp

    clock = [0.0]
    real = sp._cost

    def cost(*a):
        clock[0] += 1.0
        return real(*a)

    monkeypatch.setattr(sp, "_cost", cost)
    monkeypatch.setattr(sp, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    apps = [tree_app()]
    assert split_apps(PROFILES, apps, cluster(), PARAMS, time_limit=1000).report["tree"]["dp"]["rounds"] >= 2
    clock[0] = 0.0
    assert split_apps(PROFILES, apps, cluster(), PARAMS, time_limit=100).report["tree"]["dp"]["rounds"] == 1
    clock[0] = 0.0
    with pytest.raises(InputError, match=r"dp split ran past the time limit \(30 s\) at app 'tree', stage 3 of 3"):
        split_apps(PROFILES, apps, cluster(), PARAMS, time_limit=30)
