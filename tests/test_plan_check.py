"""The plan checker: every shared reference plan passes; each kind of broken plan is caught."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
from conftest import MODELS_DIR, reference_plans

from ppiped.cli import main as cli
from ppiped.cluster import cluster_from_json, load_cluster
from ppiped.core.layout import Layout, LayoutError
from ppiped.plan import (
    ModelPlan,
    Partition,
    Pipeline,
    Plan,
    PlanError,
    PlanParams,
    check,
    gpus_used,
    import_reference,
    load_plan,
    per_vgpu_throughput_rps,
    plan_from_json,
    save_plan,
)
from ppiped.profiles import Profile, save_profile

ALL_REFERENCE = reference_plans()


@pytest.mark.skipif(not ALL_REFERENCE, reason="../shared/data/ppipe is not present")
def test_all_reference_plans_pass(shared_profiles):
    assert len(ALL_REFERENCE) == 144
    for path in ALL_REFERENCE:
        plan = load_plan(path)
        assert check(plan, shared_profiles) == [], path.name


@pytest.fixture
def plan_and_profiles(reference_plan_path, shared_profiles):
    return import_reference(reference_plan_path), shared_profiles


def rules(plan, profiles):
    return {v.rule for v in check(plan, profiles)}


def first_multi_partition(plan):
    for m in plan.models:
        for pi, p in enumerate(m.pipelines):
            if len(p.partitions) == 2:
                return m, pi, p
    raise AssertionError("plan has no partitioned pipeline")


def test_roundtrip_keeps_plan_valid(plan_and_profiles, tmp_path):
    plan, profiles = plan_and_profiles
    save_plan(plan, tmp_path / "p.json")
    again = load_plan(tmp_path / "p.json")
    assert check(again, profiles) == []
    assert again.normalized_throughput == pytest.approx(plan.normalized_throughput)
    d = json.loads((tmp_path / "p.json").read_text())
    assert d["format"] == "ppiped-plan/1"
    part = d["models"][0]["pipelines"][0]["partitions"][0]
    assert {"blocks", "gpu", "vgpu_split", "num_vgpus", "lat_infer_us", "lat_trans_us",
            "throughput_rps"} <= set(part)


def test_over_budget_gpus(plan_and_profiles):
    plan, profiles = plan_and_profiles
    m, pi, p = first_multi_partition(plan)
    q = p.partitions[0]
    q.num_vgpus += q.vgpu_split * plan.cluster.gpus[q.gpu].count
    vs = check(plan, profiles)
    assert any(v.rule == "gpu-budget" and q.gpu in v.message for v in vs)


def test_latency_over_slo_names_model_and_pipeline(plan_and_profiles):
    plan, profiles = plan_and_profiles
    m, pi, p = first_multi_partition(plan)
    m.slo_us = p.latency_us  # no room left for the margin
    vs = [v for v in check(plan, profiles) if v.rule == "latency-slo"]
    assert vs and vs[0].model == m.model and vs[0].pipeline == pi
    assert f"model {m.model}, pipeline {pi}: [latency-slo]" in str(vs[0])


def test_non_contiguous_blocks(plan_and_profiles):
    plan, profiles = plan_and_profiles
    m, pi, p = first_multi_partition(plan)
    a, b = p.partitions[1].blocks
    p.partitions[1].blocks = (a + 1, b)
    assert "blocks-contiguous" in rules(plan, profiles)


def test_mixed_batch_sizes(plan_and_profiles):
    plan, profiles = plan_and_profiles
    m, pi, p = first_multi_partition(plan)
    p.partitions[1].batch_size = p.batch_size + 1
    assert "batch-size-mixed" in rules(plan, profiles)


@pytest.mark.parametrize("level", ["partition", "pipeline", "model", "objective"])
def test_inflated_throughput(plan_and_profiles, level):
    plan, profiles = plan_and_profiles
    m, pi, p = first_multi_partition(plan)
    if level == "partition":
        p.partitions[0].throughput_rps *= 1.5
    elif level == "pipeline":
        p.throughput_rps = max(q.throughput_rps for q in p.partitions) * 1.01
    elif level == "model":
        m.throughput_rps *= 1.2
    else:
        plan.normalized_throughput *= 1.01
    assert "throughput-inflated" in rules(plan, profiles)


def test_misc_rules(plan_and_profiles):
    plan, profiles = plan_and_profiles
    broken = copy.deepcopy(plan)
    m, pi, p = first_multi_partition(broken)
    p.partitions[0].gpu = "A100"
    p.partitions[1].lat_infer_us *= 0.5
    assert {"unknown-gpu", "latency-mismatch"} <= rules(broken, profiles)
    broken = copy.deepcopy(plan)
    broken.params.max_partitions = 1
    assert "max-partitions" in rules(broken, profiles)
    broken = copy.deepcopy(plan)
    broken.models[0].slo_us *= 2
    assert "slo" in rules(broken, profiles)


def test_malformed_plan_file_errors(tmp_path):
    from ppiped.plan import PlanError

    with pytest.raises(PlanError, match="field format"):
        plan_from_json({"format": "x"}, "p.json")
    with pytest.raises(PlanError, match="missing field 'cluster'"):
        plan_from_json({"format": "ppiped-plan/1"}, "p.json")
    f = tmp_path / "weird.json"
    f.write_text("[{}]")
    with pytest.raises(PlanError, match="not a reference plan file name"):
        load_plan(f)


def test_cli_check_accepts_and_rejects(plan_and_profiles, reference_plan_path, tmp_path, capsys):
    plan, _ = plan_and_profiles
    assert cli(["check", str(reference_plan_path), "--profiles", str(MODELS_DIR)]) == 0
    m, pi, p = first_multi_partition(plan)
    p.partitions[0].throughput_rps *= 3
    save_plan(plan, tmp_path / "bad.json")
    assert cli(["check", str(tmp_path / "bad.json"), "--profiles", str(MODELS_DIR)]) == 1
    out = capsys.readouterr().out
    assert f"model {m.model}, pipeline {pi}, partition 0: [throughput-inflated]" in out
    assert cli(["check", str(tmp_path / "missing.json"), "--profiles", str(MODELS_DIR)]) == 2


# --- the GPU budget rule and single-model reference files, on a synthetic world -------------
# (no ../shared needed: the profiles, plans and reference files are built here)


def _syn_profile(name: str) -> Profile:
    """Four blocks; GPU "A" at splits 1-4 and "B" whole, batch sizes 1-2."""
    base = np.array([2000.0, 3000.0, 2500.0, 1500.0])

    def lat(mult: float, split: int) -> np.ndarray:
        return np.outer(base * mult * (1 + 0.6 * (split - 1)), [1.0, 1.6])

    latency = {"A": {v: lat(1.0, v) for v in (1, 2, 3, 4)}, "B": {1: lat(2.5, 1)}}
    whole = {g: float(latency[g][1][:, 0].sum()) for g in latency}
    return Profile(name, 4, latency, np.array([400_000.0, 200_000.0, 100_000.0]), whole)


SYN = {m: _syn_profile(m) for m in ("alpha", "beta")}
SYN_SLO_US = 1e6


def _syn_cluster(a: int, b: int = 8):
    return cluster_from_json({"nic_gbps": 10, "gpus": {
        "A": {"count": a, "per_server": 2, "splits": [1, 2, 3, 4]},
        "B": {"count": b, "per_server": 1, "splits": [1]}}})


def _syn_plan(spec: dict, cluster, share_gpus: bool = False) -> Plan:
    """A plan whose every figure is recomputed from SYN: ``spec`` maps a model to its pipelines,
    each a list of (start, end, gpu, split, vGPUs) partitions at batch size 1."""
    params = PlanParams(slo_scale=None, slo_reference_gpu=None, share_gpus=share_gpus)
    models = []
    for name, pipes in spec.items():
        prof = SYN[name]
        pipelines = []
        for parts in pipes:
            qs = [Partition((a, b), g, v, n, prof.partition_latency_us(g, v, a, b, 1),
                            prof.transfer_us(b, 1, cluster.nic_gbps),
                            n * per_vgpu_throughput_rps(prof, cluster, g, v, a, b, 1), 1)
                  for a, b, g, v, n in parts]
            pipelines.append(Pipeline(1, min(q.throughput_rps for q in qs),
                                      sum(q.lat_infer_us + q.lat_trans_us for q in qs), qs))
        models.append(ModelPlan(name, SYN_SLO_US, 1.0, sum(p.throughput_rps for p in pipelines),
                                pipelines, 100.0))
    return Plan(cluster, params, models, min(m.throughput_rps / m.weight for m in models), "ppipe")


def test_gpus_used_rounds_per_model_and_partition_index():
    pools = [("m", 0, "A", 2, 3), ("m", 0, "A", 2, 3), ("m", 1, "A", 2, 3), ("n", 0, "A", 2, 1),
             ("n", 0, "B", 4, 1)]
    assert gpus_used(pools) == {"A": {"total": 3 + 2 + 1, "groups": {("m", 0): 3, ("m", 1): 2, ("n", 0): 1}},
                                "B": {"total": 1, "groups": {("n", 0): 1}}}
    assert gpus_used(pools, share_gpus=True) == {"A": {"total": 4 + 2, "groups": {(0,): 4, (1,): 2}},
                                                 "B": {"total": 1, "groups": {(0,): 1}}}
    assert gpus_used([("m", 0, "A", 3, 1)] * 3)["A"]["total"] == 1
    assert gpus_used([("m", 0, "A", 10, 1)] * 10)["A"]["total"] == 1


def test_mixed_splits_that_fill_whole_gpus_pass_check_and_the_layout():
    """3 half, 3 third and 2 quarter vGPUs of one model fill exactly 3 GPUs; first fit,
    larger first, would have opened a fourth, and the daemon refused what check passed."""
    spec = {"alpha": [[(0, 4, "A", 2, 3)], [(0, 4, "A", 3, 3)], [(0, 4, "A", 4, 2)]]}
    plan = _syn_plan(spec, _syn_cluster(a=3))
    assert check(plan, SYN) == []
    lay = Layout.from_plan(plan, SYN)
    per_gpu: dict[int, float] = {}
    for v in range(lay.num_vgpus):
        per_gpu[int(lay.v_gpu[v])] = per_gpu.get(int(lay.v_gpu[v]), 0.0) + 1 / int(lay.v_split[v])
    assert len(per_gpu) == 3 and all(x <= 1 + 1e-9 for x in per_gpu.values())


def test_a_split_the_cluster_forbids_is_flagged_by_check_and_refused_by_the_layout():
    cl = cluster_from_json({"nic_gbps": 10, "gpus": {"A": {"count": 3, "per_server": 2, "splits": [1, 2, 4]},
                                                     "B": {"count": 8, "per_server": 1, "splits": [1]}}})
    plan = _syn_plan({"alpha": [[(0, 4, "A", 3, 3)]]}, _syn_cluster(a=3))
    plan = Plan(cl, plan.params, plan.models, plan.normalized_throughput, plan.algo)
    assert rules(plan, SYN) == {"split-not-allowed"}
    with pytest.raises(LayoutError, match=r"split 1/3 of A is not allowed by the cluster \(allowed: \[1, 2, 4\]\)"):
        Layout.from_plan(plan, SYN)


def test_layout_never_puts_two_models_on_one_gpu_unless_shared():
    spec = {"alpha": [[(0, 4, "A", 2, 1)]], "beta": [[(0, 4, "A", 2, 1)]]}
    for share, gpus in ((False, 2), (True, 1)):
        lay = Layout.from_plan(_syn_plan(spec, _syn_cluster(a=2), share_gpus=share), SYN)
        assert len({int(g) for g in lay.v_gpu}) == gpus


def test_two_models_never_share_a_gpu_unless_asked():
    """Half a GPU each for two models: one GPU holds both only with share_gpus."""
    spec = {"alpha": [[(0, 4, "A", 4, 2)]], "beta": [[(0, 4, "A", 4, 2)]]}
    cl = _syn_cluster(a=1)
    vs = check(_syn_plan(spec, cl), SYN)
    assert [v.rule for v in vs] == ["gpu-budget"]
    assert "2 A GPUs used" in vs[0].message and "cluster has 1" in vs[0].message
    assert check(_syn_plan(spec, cl, share_gpus=True), SYN) == []
    assert check(_syn_plan(spec, _syn_cluster(a=2)), SYN) == []
    # sharing still counts whole GPUs: 0.75 + 0.75 of one GPU does not fit in one
    over = {"alpha": [[(0, 4, "A", 4, 3)]], "beta": [[(0, 4, "A", 4, 3)]]}
    assert rules(_syn_plan(over, cl, share_gpus=True), SYN) == {"gpu-budget"}


# alpha's two pipelines hold 1.5 A GPUs each (3 vGPUs at split 2)
A_FIRST_0_2 = [(0, 2, "A", 2, 3), (2, 4, "B", 1, 2)]
A_FIRST_0_3 = [(0, 3, "A", 2, 3), (3, 4, "B", 1, 1)]
A_SECOND = [(0, 1, "B", 1, 1), (1, 4, "A", 2, 3)]


def test_one_models_pools_at_one_index_round_together():
    plan = _syn_plan({"alpha": [A_FIRST_0_2, A_FIRST_0_3]}, _syn_cluster(a=3))
    assert sum(q.num_gpus for p in plan.models[0].pipelines for q in p.partitions if q.gpu == "A") == 3.0
    assert check(plan, SYN) == []  # ceil(1.5 + 1.5) = 3
    assert rules(_syn_plan({"alpha": [A_FIRST_0_2, A_FIRST_0_3]}, _syn_cluster(a=2)), SYN) == {"gpu-budget"}


@pytest.mark.parametrize("share_gpus", [False, True])
def test_pools_at_different_indices_round_apart(share_gpus):
    """The same 3 GPUs' worth at partition indices 0 and 1: ceil(1.5) + ceil(1.5) = 4 > 3,
    whether or not models may share GPUs (sharing is across models, never across indices)."""
    plan = _syn_plan({"alpha": [A_FIRST_0_2, A_SECOND]}, _syn_cluster(a=3), share_gpus)
    vs = check(plan, SYN)
    assert [v.rule for v in vs] == ["gpu-budget"]
    assert "4 A GPUs used" in vs[0].message and "cluster has 3" in vs[0].message
    assert check(_syn_plan({"alpha": [A_FIRST_0_2, A_SECOND]}, _syn_cluster(a=4), share_gpus), SYN) == []


def test_two_models_pools_at_one_index_round_apart():
    """Two models' 1.5-GPU pools at index 0: 2 + 2 GPUs under PPipe's rule, 3 shared."""
    spec = {"alpha": [A_FIRST_0_2], "beta": [A_FIRST_0_3]}
    assert rules(_syn_plan(spec, _syn_cluster(a=3)), SYN) == {"gpu-budget"}
    assert check(_syn_plan(spec, _syn_cluster(a=3), share_gpus=True), SYN) == []
    assert check(_syn_plan(spec, _syn_cluster(a=4)), SYN) == []


def _reference_json(plan: Plan) -> list[dict]:
    """``plan`` in the layout of PPipe's reference plan files."""
    out = []
    for m in plan.models:
        cfg = {"dnn_name": m.model, "gpu_name_arr": ["A", "B"], "num_gpu_per_server_arr": [2, 1],
               "num_mps_levels": [4, 1], "bw_gbps": 10, "sla": m.slo_us,
               "hist_adjustment": math.floor(0.4 * m.slo_us), "batch_build_factor": 1.3,
               "max_num_parts": 2, "est_xput": m.batch_delay_rate_rps}
        pipes = [{"xput": p.throughput_rps, "partitions": [
            {"layers": list(q.blocks), "gpu": q.gpu, "mps": q.vgpu_split - 1, "num_gpu": q.num_gpus,
             "lat_infer": q.lat_infer_us, "lat_trans": q.lat_trans_us, "xput": q.throughput_rps,
             "bs": q.batch_size} for q in p.partitions]} for p in m.pipelines]
        out.append({"config": cfg, "pipelines": pipes, "xput": m.throughput_rps})
    return out


@pytest.fixture
def syn_dirs(tmp_path):
    """A profile directory with SYN, and cluster specs with 3 and 2 A GPUs."""
    prof = tmp_path / "profiles"
    prof.mkdir()
    for p in SYN.values():
        save_profile(p, prof / f"{p.model}.json")
    for a in (3, 2):
        (tmp_path / f"a{a}.toml").write_text(
            f'nic_gbps = 10\n[gpus.A]\ncount = {a}\nper_server = 2\nsplits = [1, 2, 3, 4]\n'
            '[gpus.B]\ncount = 8\nper_server = 1\nsplits = [1]\n')
    return tmp_path, prof


def test_single_model_reference_file_without_weights_checks(syn_dirs, capsys):
    tmp, prof = syn_dirs
    plan = _syn_plan({"alpha": [A_FIRST_0_2, A_FIRST_0_3]}, _syn_cluster(a=3))
    f = tmp / "alpha_A-B_3-8_bw-gbps-10_sla-multiplier-5_v4.json"
    f.write_text(json.dumps(_reference_json(plan)))
    ref = import_reference(f)
    assert [m.weight for m in ref.models] == [1.0]
    assert ref.algo == "ppipe" and ref.cluster.gpus["A"].count == 3
    assert ref.normalized_throughput == pytest.approx(plan.models[0].throughput_rps)
    assert check(ref, SYN) == []
    assert cli(["check", str(f), "--profiles", str(prof), "--cluster", str(tmp / "a3.toml")]) == 0
    assert cli(["check", str(f), "--profiles", str(prof)]) == 0  # the cluster from the name
    assert capsys.readouterr().out.startswith("ok ")
    assert cli(["check", str(f), "--profiles", str(prof), "--cluster", str(tmp / "a2.toml"), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert not out["ok"] and any("[gpu-budget]" in v for v in out["violations"])


def test_sim_and_sweep_take_a_reference_files_cluster(syn_dirs, capsys):
    """sim and sweep read a reference file's cluster from its name, or from --cluster."""
    tmp, prof = syn_dirs
    plan = _syn_plan({"alpha": [A_FIRST_0_2, A_FIRST_0_3]}, _syn_cluster(a=3))
    f = tmp / "alpha_A-B_3-8_bw-gbps-10_sla-multiplier-5_v4.json"
    f.write_text(json.dumps(_reference_json(plan)))
    sim = ["sim", "--plan", str(f), "--profiles", str(prof), "--load-factor", "0.5", "--duration", "0.5", "--json"]
    assert cli(sim) == 0
    named = json.loads(capsys.readouterr().out)
    assert cli([*sim, "--cluster", str(tmp / "a3.toml")]) == 0
    assert json.loads(capsys.readouterr().out)["models"] == named["models"]
    assert cli(["sweep", "--plan", str(f), "--profiles", str(prof), "--duration", "0.3", "--cluster",
                str(tmp / "a3.toml"), "--max-factor", "1.2", "--step", "0.3", "--resolution", "0.1"]) == 0
    assert cli([*sim, "--cluster", str(tmp / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err


def test_check_and_sim_judge_a_ppiped_plan_on_the_cluster_given(syn_dirs, capsys):
    """--cluster replaces a ppiped-plan/1 file's own cluster in check and sim alike: a plan for
    3 A GPUs fails both on 2, and passes both on 3 (sim used to run the file's cluster)."""
    tmp, prof = syn_dirs
    f = tmp / "plan.json"
    save_plan(_syn_plan({"alpha": [A_FIRST_0_2, A_FIRST_0_3]}, _syn_cluster(a=3)), f)
    sim = ["sim", "--plan", str(f), "--profiles", str(prof), "--load-factor", "0.5", "--duration", "0.2"]
    for spec, ok in (("a3.toml", True), ("a2.toml", False)):
        cl = ["--cluster", str(tmp / spec)]
        assert cli(["check", str(f), "--profiles", str(prof), *cl]) == (0 if ok else 1)
        assert cli([*sim, *cl]) == (0 if ok else 2)
        capsys.readouterr()
    assert load_plan(f, load_cluster(tmp / "a2.toml")).cluster.gpus["A"].count == 2


def test_multi_model_reference_file_without_weights_is_refused(syn_dirs, capsys):
    tmp, prof = syn_dirs
    plan = _syn_plan({"alpha": [A_FIRST_0_2], "beta": [A_FIRST_0_3]}, _syn_cluster(a=4))
    f = tmp / "alpha-beta_A-B_4-8_bw-gbps-10_sla-multiplier-5_v4.json"
    f.write_text(json.dumps(_reference_json(plan)))
    with pytest.raises(PlanError, match="2 models but the file name gives no weights"):
        import_reference(f)
    for extra in ([], ["--cluster", str(tmp / "a3.toml")]):
        assert cli(["check", str(f), "--profiles", str(prof), *extra]) == 2
        err = capsys.readouterr().err
        assert "ppiped check: error:" in err and "no weights" in err
        assert "Traceback" not in err
    # with weights in the name the same file is fine
    g = tmp / "alpha-beta_0.5-0.5_A-B_4-8_bw-gbps-10_sla-multiplier-5_v4.json"
    g.write_text(f.read_text())
    assert cli(["check", str(g), "--profiles", str(prof)]) == 0


def test_single_model_name_ending_in_a_number_is_not_a_weight(tmp_path):
    plan = _syn_plan({"alpha": [A_FIRST_0_2]}, _syn_cluster(a=3))
    ref = _reference_json(plan)
    ref[0]["config"]["dnn_name"] = "net_2"
    f = tmp_path / "net_2_A-B_3-8_bw-gbps-10_sla-multiplier-5_v4.json"
    f.write_text(json.dumps(ref))
    assert [m.weight for m in import_reference(f).models] == [1.0]


def test_check_reads_only_the_plans_profiles(syn_dirs, capsys):
    """A broken profile of another model in the same folder does not fail a good plan."""
    tmp, prof = syn_dirs
    plan = _syn_plan({"alpha": [A_FIRST_0_2]}, _syn_cluster(a=3))
    f = tmp / "plan.json"
    f.write_text(json.dumps(plan.to_json()))
    bad = json.loads((prof / "beta.json").read_text())
    bad["boundary_bytes"][0] = "many"
    (prof / "beta.json").write_text(json.dumps(bad))
    assert cli(["check", str(f), "--profiles", str(prof)]) == 0
    assert "ok" in capsys.readouterr().out


def test_a_profile_quicker_at_larger_batches_is_planned(tmp_path):
    """Batch size 1 misses the SLO, batch size 2 meets it (measured profiles are not always
    monotone in the batch): the plan uses batch size 2 instead of refusing the model."""
    from ppiped.planner import plan_cluster

    lat = np.outer([300.0, 300.0], [4.0, 1.0])  # per block: 1,200 µs at batch 1, 300 µs at 2
    p = Profile("rev", 2, {"A": {1: lat}}, np.array([1000.0]), {"A": 2400.0})
    cluster = cluster_from_json({"nic_gbps": 10, "gpus": {"A": {"count": 2, "per_server": 2, "splits": [1]}}})
    plan = plan_cluster({"rev": p}, ["rev"], [1.0], cluster, PlanParams(slo_scale=None, slo_reference_gpu=None),
                        "ppipe", 10, None, slos_us=[2000.0])
    assert {q.batch_size for pl in plan.models[0].pipelines for q in pl.partitions} == {2}
    assert check(plan, {"rev": p}) == []
