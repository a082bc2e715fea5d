"""The plan checker: every shared reference plan passes; each kind of broken plan is caught."""

from __future__ import annotations

import copy
import json

import pytest
from conftest import MODELS_DIR, reference_plans

from ppiped.cli import main as cli
from ppiped.plan import check, import_reference, load_plan, plan_from_json, save_plan

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
