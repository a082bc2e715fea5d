"""``ppiped demo`` and ``ppiped loadgen`` as a user runs them, and the example CNN served by ort executors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MODELS_DIR, reference_plans

from ppiped.daemon.launch import LocalCluster, short_tmpdir, write_config
from ppiped.executor import tiny

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_PROFILE = ROOT / "plans" / "example" / "example.json"


def ppiped(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ppiped.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def check_demo_json(out: str) -> dict:
    r = json.loads(out)
    assert r["total"]["sent"] > 0 and r["total"]["no_reply"] == 0
    assert r["total"]["ok"] + r["total"]["dropped"] + r["total"]["rejected"] == r["total"]["sent"]
    for m in r["models"]:
        assert {"offered_rps", "attainment", "dropped", "p50_ms", "p99_ms"} <= set(m)
    assert r["gpu_classes"] and all(0 <= c["utilization"] <= 1.05 for c in r["gpu_classes"].values())
    return r


def test_demo_default_plan_json():
    """The example plan pipelines across P4 and V100 (P4s first), beats NP, and its first such
    pipeline served for real by ort executors equals the whole model; then the emulated run."""
    from ppiped.commands.demo import format_head

    p = ppiped("demo", "--duration", "2", "--load-factor", "0.5", "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = check_demo_json(p.stdout)
    assert r["time_scale"] >= 1 and r["vgpus"] > 0
    spanning = [q for q in r["pipelines"] if q["gpu_classes"] == ["P4", "V100"]]
    assert spanning and spanning[0]["partitions"][0]["gpu"] == "P4"
    c = r["comparison"]
    assert c["algo"] == "ppipe" and c["gain"] > 1.5 and c["plan_rps"] > c["np_rps"] > 0
    real = r["real_inference"]
    assert real["equal"] and not real["errors"] and real["frames"] > 0
    assert real["partitions"] == [{"blocks": q["blocks"], "gpu": q["gpu"]} for q in spanning[0]["partitions"]]
    assert 0 <= real["max_diff"] <= 1e-2 * real["output_range"]
    assert set(r["gpu_classes"]) == {"P4", "V100"}
    head = format_head(r)
    assert f"PPipe {c['plan_rps']:.0f} rps vs NP {c['np_rps']:.0f} rps (×{c['gain']:.2f})" in head
    assert "real inference: partitions [0," in head and "equal to the whole model" in head


def test_example_plan_is_the_committed_cluster_and_checks():
    """plans/example/plan.json is planned on plans/example/cluster.toml and breaks no rule."""
    from ppiped.cluster import load_cluster
    from ppiped.plan import check, load_plan
    from ppiped.profiles import load_profiles

    plan = load_plan(EXAMPLE_PROFILE.parent / "plan.json")
    assert plan.cluster == load_cluster(EXAMPLE_PROFILE.parent / "cluster.toml")
    assert check(plan, load_profiles(EXAMPLE_PROFILE.parent, ["example"])) == []


def test_real_check_reports_a_difference_or_a_failure(tmp_path, monkeypatch):
    import ppiped.realcheck
    from ppiped.commands import demo
    from ppiped.plan import load_plan
    from ppiped.realcheck import RealCheck, format_check

    c = RealCheck([((0, 5), "P4"), ((5, 10), "V100")], 8, [3, 128, 128], max_diff=0.5, output_range=2.0)
    assert RealCheck.from_json(c.to_json()) == c
    assert "DIFFERS from the whole model" in format_check(c)

    def broken(*a, **k):
        raise RuntimeError("executor for vGPU 1 exited")

    monkeypatch.setattr(ppiped.realcheck, "serve_and_compare", broken)
    r = demo.real_inference(load_plan(EXAMPLE_PROFILE.parent / "plan.json"), tmp_path)
    assert not r["equal"] and r["partitions"][0]["gpu"] == "P4"
    assert "FAILED: RuntimeError: executor for vGPU 1 exited" in format_check(RealCheck.from_json(r))


def test_demo_reference_plan_text():
    plans = reference_plans("v4")
    if not plans or not MODELS_DIR.is_dir():
        pytest.skip("../shared/data/ppipe is not present")
    p = ppiped("demo", "--plan", str(plans[0]), "--profiles", str(MODELS_DIR), "--duration", "2",
               "--load-factor", "0.5", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "attainment" in p.stdout and "utilization" in p.stdout and "L4" in p.stdout


def test_demo_bad_arguments():
    p = ppiped("demo", "--plan", "x.json")
    assert p.returncode == 2 and "--plan needs --profiles" in p.stderr
    p = ppiped("demo", "--time-scale", "fast", "--duration", "1")
    assert p.returncode == 2 and "--time-scale" in p.stderr


def test_loadgen_cli():
    with short_tmpdir("ppiped-lg-") as d:
        d = Path(d)
        plan, profiles = tiny.write_example(d)
        cfg = write_config(d, plan, profiles, scheduler={"wait_guard_us": 25_000})
        with LocalCluster(cfg, [[0, 1, 2, 3]]) as c:
            p = ppiped("loadgen", "--endpoint", c.client_endpoint, "--rate", "tiny=150", "--duration", "1",
                       "--check-echo", "--json")
            assert p.returncode == 0, p.stderr[-2000:]
            r = json.loads(p.stdout)
            assert r["total"]["sent"] > 50 and r["total"]["no_reply"] == 0 and r["total"]["bad_echo"] == 0
            p = ppiped("loadgen", "--endpoint", c.client_endpoint, "--rate", "nope=10", "--duration", "1")
            assert p.returncode == 2 and "not served" in p.stderr
            p = ppiped("loadgen", "--endpoint", c.client_endpoint, "--rate", "tiny", "--duration", "1")
            assert p.returncode == 2 and "MODEL=REQ_PER_S" in p.stderr


def test_example_cnn_served_by_ort_partitions_cut_from_the_profile():
    """No partition files configured: the executors cut [0,4) and [4,10) from the profiled model
    (the profile records the model file and its block cuts), run them with ONNX Runtime, and the
    results match the whole model. A profile without its (uncommitted) model file, as in a fresh
    clone, gets the example built afresh."""
    pytest.importorskip("onnxruntime")
    from ppiped.profiler.example import example_with_model
    from ppiped.realcheck import serve_and_compare

    with short_tmpdir("ppiped-ex-") as d:
        d = Path(d)
        bare = d / "bare"
        bare.mkdir()
        (bare / "example.json").write_text(EXAMPLE_PROFILE.read_text())
        profile = example_with_model(bare, d / "example")
        assert profile == d / "example" / "example.json"
        built, kept = json.loads(profile.read_text()), json.loads(EXAMPLE_PROFILE.read_text())
        # the equivalence figures are ONNX Runtime's arithmetic, which moves between its releases
        eq_built, eq_kept = built.pop("equivalence"), kept.pop("equivalence")
        assert built == kept
        assert eq_built["passed"] and eq_built["max_rel_error"] <= eq_built["tolerance"] == eq_kept["tolerance"]
        assert {k: v for k, v in eq_built.items() if k not in ("max_rel_error", "per_output")} == {
            k: v for k, v in eq_kept.items() if k not in ("max_rel_error", "per_output")}
        c = serve_and_compare(d, profile, [((0, 4), "P4"), ((4, 10), "V100")], frames=4)
        assert c.input_shape == json.loads(profile.read_text())["input"]["shape"]  # clients learn the input
        assert c.equal and not c.errors and c.frames == 4, c
        assert c.max_diff <= 1e-2 * c.output_range


def test_write_config_keeps_executor_keys_in_executor_when_pinning_threads(tmp_path):
    """``extra`` may begin with keys of [executor] (the overload bench's emulate_jitter): with
    ``threads`` those keys once landed in [threads], and the daemon refused the config."""
    from ppiped.daemon.config import load_config

    plan, profiles = tiny.write_example(tmp_path)
    cfg = load_config(write_config(tmp_path, plan, profiles, threads=([0], [1]),
                                   extra="emulate_jitter = 0.05\n"))
    assert cfg.executor_defaults.emulate_jitter == 0.05
    assert cfg.loop_cpus == (0,)
