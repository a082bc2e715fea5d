"""The control-plane planner: plans pass the checker, baselines keep their shape, bad input
fails clearly, more GPUs never hurt, and the subprocess and CLI paths work end to end."""

from __future__ import annotations

import asyncio
import json
import time

import numpy as np
import pytest
from conftest import MODELS_DIR, reference_plans

from ppiped.cli import main as cli
from ppiped.cluster import cluster_from_flags, cluster_from_json
from ppiped.errors import InputError
from ppiped.plan import PlanParams, check, import_reference, load_plan
from ppiped.planner import (
    PlannerTimeout,
    algo_configs,
    make_request,
    plan_async,
    plan_cluster,
    plan_in_subprocess,
)
from ppiped.planner.bounds import knapsack_bound
from ppiped.planner.configs import PipelineConfig, Segment, enumerate_configs, prune_dominated
from ppiped.planner.milp import solve_allocation
from ppiped.profiles import Profile, save_profile

# --- a synthetic two-model world, so the planner is tested without the shared data ----------


def _toy_profile(name: str, scale: float, boundary: list[int]) -> Profile:
    """Four blocks on a fast GPU "A" (splits 1-2) and a slow one "B" (split 1), bs 1-4."""
    base = np.array([3000.0, 5000.0, 4000.0, 2000.0]) * scale
    bs = np.arange(1, 5)

    def lat(mult: float, split: int) -> np.ndarray:
        per_bs = 1 + 0.55 * (bs - 1)
        return np.outer(base * mult * (1 + 0.7 * (split - 1)), per_bs)

    latency = {"A": {1: lat(1.0, 1), 2: lat(1.0, 2)[:, :2]}, "B": {1: lat(2.6, 1)}}
    whole = {"A": float(base.sum()), "B": float(base.sum() * 2.6)}
    return Profile(name, 4, latency, np.array(boundary, dtype=float), whole)


TOY = {
    "alpha": _toy_profile("alpha", 1.0, [600_000, 300_000, 150_000]),
    "beta": _toy_profile("beta", 1.4, [200_000, 800_000, 100_000]),
}
TOY_PARAMS = PlanParams(slo_scale=5.0, slo_reference_gpu="A")


def toy_cluster(a: int = 3, b: int = 8):
    return cluster_from_json({"nic_gbps": 10, "gpus": {
        "A": {"count": a, "per_server": 2, "splits": [1, 2]},
        "B": {"count": b, "per_server": 1, "splits": [1]}}})


def toy_plan(algo="ppipe", cluster=None, rates=(400.0, 300.0), **kw):
    return plan_cluster(TOY, ["alpha", "beta"], [1.0, 0.5], cluster or toy_cluster(), TOY_PARAMS,
                        algo, kw.pop("time_limit", 20.0), rates, **kw)


@pytest.mark.parametrize("algo", ["ppipe", "np", "dart-r"])
def test_toy_plans_pass_the_checker(algo):
    plan = toy_plan(algo)
    assert check(plan, TOY) == []
    assert plan.algo == algo
    assert plan.normalized_throughput > 0
    assert plan.solver["status"] in ("optimal", "feasible")
    assert plan.solver["gap"] >= 0
    assert plan.normalized_throughput == pytest.approx(
        min(m.throughput_rps / m.weight for m in plan.models))


def test_optimal_means_within_the_gap_asked_and_the_plan_says_which():
    exact = toy_plan("ppipe", toy_cluster(3, 10))
    assert exact.solver["mip_gap"] == 1e-6
    assert exact.solver["status"] == "optimal" and exact.solver["gap"] <= 1e-6
    loose = toy_plan("ppipe", toy_cluster(3, 10), mip_gap=0.05)
    assert loose.solver["mip_gap"] == 0.05
    if loose.solver["status"] == "optimal":
        assert loose.solver["gap"] <= 0.05
    assert loose.normalized_throughput >= exact.normalized_throughput * (1 - 0.05)
    assert loose.solver["bound"] >= exact.normalized_throughput * (1 - 1e-6)


def test_np_uses_one_partition_on_whole_gpus():
    plan = toy_plan("np")
    for m in plan.models:
        for p in m.pipelines:
            assert len(p.partitions) == 1
            assert p.partitions[0].vgpu_split == 1


def test_dart_r_pipelines_are_replicated_low_high_pairs_or_whole_models():
    plan = toy_plan("dart-r")
    for m in plan.models:
        for p in m.pipelines:
            assert all(q.vgpu_split == 1 for q in p.partitions)
            if len(p.partitions) == 2:
                a, b = p.partitions
                assert a.gpu != b.gpu
                assert a.num_vgpus == b.num_vgpus
            else:
                assert len(p.partitions) == 1 and p.partitions[0].blocks == (0, 4)


def test_ppipe_is_never_below_np_or_dart_r():
    ppipe = toy_plan("ppipe").normalized_throughput
    assert ppipe >= toy_plan("np").normalized_throughput * (1 - 1e-6)
    assert ppipe >= toy_plan("dart-r").normalized_throughput * (1 - 1e-6)


def test_more_gpus_never_lower_the_objective():
    prev = 0.0
    for a, b in [(1, 2), (2, 5), (3, 8), (3, 10)]:
        plan = toy_plan("ppipe", toy_cluster(a, b))
        assert plan.solver["status"] == "optimal"
        assert plan.normalized_throughput >= prev * (1 - 1e-6)
        prev = plan.normalized_throughput


def test_partitions_respect_max_partitions_and_splits():
    params = PlanParams(slo_scale=5.0, slo_reference_gpu="A", max_partitions=3)
    plan = plan_cluster(TOY, ["alpha", "beta"], [1.0, 1.0], toy_cluster(), params, "ppipe", 20.0,
                        [400.0, 300.0])
    assert check(plan, TOY) == []
    for m in plan.models:
        for p in m.pipelines:
            assert len(p.partitions) <= 3
            for q in p.partitions:
                assert q.vgpu_split in plan.cluster.gpus[q.gpu].splits


def test_enumeration_finds_every_configuration_that_meets_the_slo():
    """The pruned depth-first search against brute force over cuts, pool kinds and batch sizes."""
    import itertools

    from ppiped.plan import batch_delay_us, slo_margin_us

    cl, prof, rate = toy_cluster(), TOY["beta"], 250.0
    slo = 5.0 * prof.whole_model_latency_us["A"]
    room = slo - slo_margin_us(slo, TOY_PARAMS.slo_margin)
    kinds = [("A", 1), ("A", 2), ("B", 1)]
    want = set()
    for parts in (1, 2, 3):
        for cuts in itertools.combinations(range(1, 4), parts - 1):
            bounds = (0, *cuts, 4)
            for ks in itertools.product(kinds, repeat=parts):
                for bs in range(1, 5):
                    if any(prof.max_batch(g, v) < bs for g, v in ks):
                        continue
                    lat = sum(prof.partition_latency_us(g, v, bounds[i], bounds[i + 1], bs)
                              + prof.transfer_us(bounds[i + 1], bs, cl.nic_gbps)
                              for i, (g, v) in enumerate(ks))
                    if lat + batch_delay_us(bs, rate, 1.3) <= room:
                        want.add((bs, tuple((bounds[i], bounds[i + 1], g, v) for i, (g, v) in enumerate(ks))))
    got = {(c.batch_size, tuple((s.start, s.end, s.gpu, s.split) for s in c.segments))
           for c in enumerate_configs(prof, cl, TOY_PARAMS, slo, rate, 3)}
    assert want and got == want


def test_pruning_and_knapsack_bound_keep_the_optimum():
    """Dominance pruning loses nothing, and the knapsack bound is a true upper bound."""
    cl = toy_cluster(2, 5)
    weights = {"alpha": 1.0, "beta": 0.5}
    slo = {m: 5.0 * TOY[m].whole_model_latency_us["A"] for m in TOY}
    full = {m: enumerate_configs(TOY[m], cl, TOY_PARAMS, slo[m], 350.0, 2) for m in TOY}
    pruned = {m: prune_dominated(cs) for m, cs in full.items()}
    assert sum(map(len, pruned.values())) < sum(map(len, full.values()))
    _, a = solve_allocation(full, weights, cl, time_limit_s=30)
    _, b = solve_allocation(pruned, weights, cl, time_limit_s=30)
    assert a.status == b.status == "optimal"
    assert b.objective == pytest.approx(a.objective, rel=1e-6)
    for prices in ({"A": 1.0, "B": 0.0}, {"A": 1.0, "B": 0.3}, {"A": 0.2, "B": 1.0}):
        assert knapsack_bound(pruned, weights, cl, prices, 2 * a.objective).bound >= a.objective * (1 - 1e-9)


def test_the_knapsack_bound_holds_when_prices_are_thousands_of_times_apart():
    """An instance cheaper than one budget unit is not charged a whole one: here A's GPUs cost
    a millionth of B's, so a unit (a 40,000th of the budget) is worth 25 of A's GPUs. Charged
    one unit, "alpha"'s cost read 25 times what its four GPUs cost, and the Lagrangian bound,
    which takes that cost as a floor, could cut off the optimum (a regression)."""
    cl = cluster_from_json({"nic_gbps": 10, "gpus": {"A": {"count": 4}, "B": {"count": 4}}})
    configs = {"alpha": [PipelineConfig("alpha", 1, (Segment(0, 1, "A", 1, 1.0, 0.0, 100.0),), 1.0)],
               "beta": [PipelineConfig("beta", 1, (Segment(0, 1, "B", 1, 1.0, 0.0, 100.0),), 1.0)]}
    weights = {"alpha": 1.0, "beta": 1.0}
    _, info = solve_allocation(configs, weights, cl, time_limit_s=10)
    assert info.status == "optimal" and info.objective == pytest.approx(400.0)
    kb = knapsack_bound(configs, weights, cl, {"A": 1e-6, "B": 1.0}, 800.0)
    assert kb.bound >= 400.0 * (1 - 1e-9)
    assert kb.money_for("alpha", 400.0) <= 4e-6


def test_tied_pairs_are_bounded_by_their_slowest_partition():
    """A DART-r pair runs at its slow partition's rate, so its count may exceed what the fast
    partition alone would need (a regression: the bound once used the fast one)."""
    cl = cluster_from_json({"nic_gbps": 10, "gpus": {"A": {"count": 20}, "B": {"count": 20}}})
    pair = PipelineConfig("m", 1, (Segment(0, 1, "A", 1, 1.0, 0.0, 10.0),
                                   Segment(1, 2, "B", 1, 1.0, 0.0, 100.0)), 2.0, tied=True)
    allocs, info = solve_allocation({"m": [pair]}, {"m": 1.0}, cl, time_limit_s=10)
    assert info.status == "optimal"
    assert info.objective == pytest.approx(200.0)
    assert allocs[0].vgpus == (20, 20)


def test_batch_delay_rate_defaults_to_np_throughput():
    np_plan = plan_cluster(TOY, ["alpha", "beta"], [1.0, 0.5], toy_cluster(), TOY_PARAMS, "np", 20.0)
    assert check(np_plan, TOY) == []
    for m in np_plan.models:  # NP is planned with its own (settled) throughputs as λ
        assert m.batch_delay_rate_rps == pytest.approx(m.throughput_rps, rel=0.02)
    pp = plan_cluster(TOY, ["alpha", "beta"], [1.0, 0.5], toy_cluster(), TOY_PARAMS, "ppipe", 20.0)
    assert check(pp, TOY) == []
    for m, n in zip(pp.models, np_plan.models, strict=True):
        assert m.batch_delay_rate_rps == pytest.approx(n.throughput_rps, rel=0.02)


# --- bad input ------------------------------------------------------------------------------


def test_slo_below_every_single_gpu_latency_is_an_input_error():
    tight = PlanParams(slo_scale=1.2, slo_reference_gpu="A")  # 60% of it after the margin
    with pytest.raises(InputError, match="alpha: no ppipe pipeline meets the SLO"):
        plan_cluster(TOY, ["alpha", "beta"], [1, 1], toy_cluster(), tight, "ppipe", 5.0, [100, 100])


def test_other_bad_inputs_are_input_errors():
    with pytest.raises(InputError, match="unknown GPU type 'H100'"):
        cl = cluster_from_flags("H100:4", None, None, 10)
        plan_cluster(TOY, ["alpha"], [1], cl, TOY_PARAMS, "ppipe", 5.0, [100])
    with pytest.raises(InputError, match="no profile for model"):
        plan_cluster(TOY, ["gamma"], [1], toy_cluster(), TOY_PARAMS, "ppipe", 5.0, [100])
    with pytest.raises(InputError, match="weights"):
        plan_cluster(TOY, ["alpha", "beta"], [1], toy_cluster(), TOY_PARAMS, "ppipe", 5.0)
    with pytest.raises(InputError, match="unknown algorithm"):
        plan_cluster(TOY, ["alpha"], [1], toy_cluster(), TOY_PARAMS, "magic", 5.0, [100])
    with pytest.raises(InputError, match="too small"):
        plan_cluster(TOY, ["alpha", "beta"], [1, 1], toy_cluster(1, 0), TOY_PARAMS, "np", 5.0, [100, 100])


# --- subprocess and async -------------------------------------------------------------------


def test_subprocess_plan_matches_in_process():
    req = make_request(TOY, ["alpha", "beta"], [1.0, 0.5], toy_cluster(), TOY_PARAMS, "ppipe", 20.0,
                       [400.0, 300.0])
    plan = plan_in_subprocess(req)
    assert check(plan, TOY) == []
    assert plan.normalized_throughput == pytest.approx(toy_plan().normalized_throughput, rel=1e-6)


def test_subprocess_reports_input_errors_and_is_killed_at_its_wall_limit():
    bad = make_request(TOY, ["alpha"], [1.0], toy_cluster(),
                       PlanParams(slo_scale=1.2, slo_reference_gpu="A"), "ppipe", 5.0, [100.0])
    with pytest.raises(InputError, match="no ppipe pipeline meets the SLO"):
        plan_in_subprocess(bad)
    req = make_request(TOY, ["alpha", "beta"], [1.0, 0.5], toy_cluster(), TOY_PARAMS, "ppipe", 5.0,
                       [400.0, 300.0])
    t0 = time.perf_counter()
    with pytest.raises(PlannerTimeout):
        plan_in_subprocess(req, wall_limit_s=0.05)
    assert time.perf_counter() - t0 < 5


def test_plan_async_keeps_the_event_loop_running():
    req = make_request(TOY, ["alpha", "beta"], [1.0, 0.5], toy_cluster(), TOY_PARAMS, "np", 20.0,
                       [400.0, 300.0])

    async def main():
        ticks = 0

        async def ticker():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.create_task(ticker())
        plan = await plan_async(req)
        t.cancel()
        return plan, ticks

    plan, ticks = asyncio.run(main())
    assert check(plan, TOY) == []
    assert ticks > 0


def _three_type_world():
    """Three models on three GPU types (A fast, B middling, C slow and the most numerous), each
    model's blocks faring differently on each type: a world where the exact search over per-model
    GPU vectors (:mod:`ppiped.planner.decompose`) runs beside the full MILP."""
    def prof(name, scale, boundary, affinity):
        base = np.array([3000.0, 5000.0, 4000.0, 2000.0]) * scale
        per_bs = 1 + 0.55 * np.arange(4)

        def lat(mult, split, k):
            return np.outer(base * mult * np.array(affinity[k]) * (1 + 0.7 * (split - 1)), per_bs)

        latency = {"A": {1: lat(1.0, 1, 0), 2: lat(1.0, 2, 0)[:, :2]},
                   "B": {1: lat(1.7, 1, 1), 2: lat(1.7, 2, 1)[:, :3]}, "C": {1: lat(2.6, 1, 2)}}
        whole = {g: float(latency[g][1][:, 0].sum()) for g in latency}
        return Profile(name, 4, latency, np.array(boundary, dtype=float), whole)

    flat = [1.0, 1.0, 1.0, 1.0]
    profiles = {
        "alpha": prof("alpha", 1.0, [600_000, 300_000, 150_000], [flat, [0.8, 1.2, 1.1, 0.7], [1.3, 0.8, 0.9, 1.2]]),
        "beta": prof("beta", 1.4, [200_000, 800_000, 100_000], [flat, [1.2, 0.7, 0.8, 1.3], [0.7, 1.3, 1.2, 0.9]]),
        "gamma": prof("gamma", 0.8, [400_000, 500_000, 300_000], [flat, [1.0, 0.9, 1.3, 0.8], [1.1, 1.1, 0.7, 1.0]]),
    }
    cluster = cluster_from_json({"nic_gbps": 10, "gpus": {
        "A": {"count": 5, "per_server": 2, "splits": [1, 2]},
        "B": {"count": 6, "per_server": 2, "splits": [1, 2]},
        "C": {"count": 12, "per_server": 4, "splits": [1]}}})
    return profiles, sorted(profiles), [1.0, 0.6, 0.8], cluster, [400.0, 300.0, 500.0]


def test_a_replan_child_plans_three_gpu_types_with_the_search():
    """The daemon replans in a child (:func:`plan_in_subprocess`); with three GPU types that
    child runs the exact search in a grandchild beside CBC's, and must end with the same proven
    optimum as planning in process, a plan that passes the checker."""
    profiles, models, weights, cluster, rates = _three_type_world()
    here = plan_cluster(profiles, models, weights, cluster, TOY_PARAMS, "ppipe", 20.0, rates)
    child = plan_in_subprocess(make_request(profiles, models, weights, cluster, TOY_PARAMS, "ppipe", 20.0,
                                            rates))
    for plan in (here, child):
        assert check(plan, profiles) == []
        assert plan.solver["status"] == "optimal"
        assert isinstance(plan.solver.get("decompose"), dict) and plan.solver["decompose"]["tests"]
    assert child.normalized_throughput == pytest.approx(here.normalized_throughput, rel=1e-6)
    assert {q.gpu for m in child.models for p in m.pipelines for q in p.partitions} == {"A", "B", "C"}


# --- the CLI ----------------------------------------------------------------------------------


@pytest.fixture
def toy_profile_dir(tmp_path):
    d = tmp_path / "profiles"
    d.mkdir()
    for p in TOY.values():
        save_profile(p, d / f"{p.model}.json")
    return d


def test_cli_plan_end_to_end(toy_profile_dir, tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = cli(["plan", "--profiles", str(toy_profile_dir), "--models", "alpha,beta", "--weights", "1,0.5",
              "--gpus", "A:3,B:8", "--gpus-per-server", "2,1", "--vgpu-splits", "2,1", "--nic-gbps", "10",
              "--slo-reference-gpu", "A", "--time-limit", "10", "-o", str(out)])
    text = capsys.readouterr().out
    assert rc == 0
    assert "objective (min throughput/weight)" in text and "status=" in text
    assert json.loads(out.read_text())["format"] == "ppiped-plan/1"
    assert check(load_plan(out), TOY) == []
    assert cli(["check", str(out), "--profiles", str(toy_profile_dir)]) == 0


def test_cli_plan_reports_infeasible_input(toy_profile_dir, capsys):
    rc = cli(["plan", "--profiles", str(toy_profile_dir), "--models", "alpha", "--gpus", "A:2",
              "--slo-reference-gpu", "A", "--slo-scale", "1.1", "--time-limit", "5"])
    assert rc == 2
    assert "no ppipe pipeline meets the SLO" in capsys.readouterr().err


# --- against the shared reference plans -------------------------------------------------------

V4 = reference_plans("v4")


@pytest.mark.shared
@pytest.mark.skipif(not V4, reason="../shared/data/ppipe is not present")
@pytest.mark.parametrize("algo,suffix", [("ppipe", "v4"), ("np", "bl"), ("dart-r", "dart-r")])
def test_reference_configuration_is_matched(shared_profiles, algo, suffix):
    v4 = import_reference(V4[0])
    ref = import_reference(str(V4[0]).replace("_v4.json", f"_{suffix}.json"))
    models = [m.model for m in v4.models]
    plan = plan_cluster(shared_profiles, models, [m.weight for m in v4.models], v4.cluster, v4.params,
                        algo, 30.0, [m.batch_delay_rate_rps for m in v4.models])
    assert check(plan, shared_profiles) == []
    # Every algorithm meets its reference plan under PPipe's rules (float noise aside).
    assert plan.normalized_throughput >= ref.normalized_throughput * (1 - 1e-9)


@pytest.mark.shared
@pytest.mark.skipif(not V4, reason="../shared/data/ppipe is not present")
def test_cli_on_shared_two_model_subset(tmp_path, capsys):
    out = tmp_path / "p.json"
    rc = cli(["plan", "--profiles", str(MODELS_DIR), "--models", "googlenet-v3-pytorch,repvgg-b3",
              "--weights", "0.5,0.5", "--gpus", "L4:6,P4:18", "--gpus-per-server", "1,1",
              "--vgpu-splits", "4,1", "--nic-gbps", "6", "--time-limit", "10", "-o", str(out), "--json"])
    assert rc == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["violations"] == [] and summary["objective"] > 0
    assert cli(["check", str(out), "--profiles", str(MODELS_DIR)]) == 0


def test_algo_configs_shapes():
    cl = toy_cluster()
    slo = 5.0 * TOY["alpha"].whole_model_latency_us["A"]
    npc = algo_configs(TOY["alpha"], cl, TOY_PARAMS, "np", slo, 300.0)
    assert npc and all(len(c.segments) == 1 and c.segments[0].split == 1 for c in npc)
    dart = algo_configs(TOY["alpha"], cl, TOY_PARAMS, "dart-r", slo, 300.0)
    assert all(c.tied == (len(c.segments) == 2) for c in dart)


def test_rates_fall_back_to_one_partition_on_vgpus_when_np_cannot_place_every_model():
    """Two models, one GPU shared across models at split 2: NP (whole GPUs) has no plan, so the
    batching-delay rates come from one partition per model on vGPUs, and the plan says so."""
    one = cluster_from_json({"nic_gbps": 10, "gpus": {"A": {"count": 1, "per_server": 1, "splits": [1, 2]}}})
    shared = PlanParams(slo_scale=5.0, slo_reference_gpu="A", share_gpus=True)
    with pytest.raises(InputError, match="too small to serve every model"):
        plan_cluster(TOY, ["alpha", "beta"], [1.0, 1.0], one, shared, "np", 10.0)
    plan = plan_cluster(TOY, ["alpha", "beta"], [1.0, 1.0], one, shared, "ppipe", 10.0)
    assert plan.solver["batch_delay_rates_from"] == "np-vgpus"
    assert {m.model for m in plan.models} == {"alpha", "beta"} and all(m.throughput_rps > 0 for m in plan.models)
    assert check(plan, TOY) == []
    assert toy_plan().solver["batch_delay_rates_from"] == "given"


def test_a_solve_out_of_time_is_not_called_a_cluster_too_small(monkeypatch):
    """A solve that stopped before it served every model says so (and to give it more time);
    only a proven-empty optimum is "the cluster is too small"."""
    import ppiped.planner.api as api
    from ppiped.planner.milp import SolveInfo

    def stopped(configs, *a, **kw):
        return [], SolveInfo("feasible", 0.0, 5.0, 1.0, 1.0, 0, 0, 0, 0, 1, 1.0)

    monkeypatch.setattr(api, "solve_allocation", stopped)
    with pytest.raises(InputError, match=r"no plan serving every model found within .* give more time"):
        toy_plan()

    def proven(configs, *a, **kw):
        return [], SolveInfo("optimal", 0.0, 0.0, 0.0, 1.0, 0, 0, 0, 0, 1, 1.0)

    monkeypatch.setattr(api, "solve_allocation", proven)
    with pytest.raises(InputError, match="the cluster is too small"):
        toy_plan()
