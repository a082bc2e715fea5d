"""``ppiped demo`` and ``ppiped loadgen`` as a user runs them, and the example CNN served by ort executors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
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
    p = ppiped("demo", "--duration", "2", "--load-factor", "0.5", "--json", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    r = check_demo_json(p.stdout)
    assert r["time_scale"] >= 1 and r["vgpus"] > 0


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


def _example_two_partition_plan(d: Path, profile: Path) -> Path:
    """The example CNN cut in two ([0,4) on a P4, [4,10) on a V100), a loose SLO for CPU inference."""
    from ppiped.profiles import load_profile

    prof = load_profile(profile)
    parts = []
    for (a, b), gpu in (((0, 4), "P4"), ((4, 10), "V100")):
        parts.append({"blocks": [a, b], "gpu": gpu, "vgpu_split": 1, "num_vgpus": 1,
                      "lat_infer_us": prof.partition_latency_us(gpu, 1, a, b, 2),
                      "lat_trans_us": prof.transfer_us(b, 2, 10.0), "throughput_rps": 1.0, "batch_size": 2})
    plan = {"format": "ppiped-plan/1", "algo": "hand",
            "cluster": {"nic_gbps": 10.0, "gpus": {"V100": {"count": 1, "per_server": 1, "splits": [1]},
                                                   "P4": {"count": 1, "per_server": 1, "splits": [1]}}},
            "params": {"slo_scale": None, "slo_reference_gpu": None}, "objective": {"normalized_throughput": 1.0},
            "models": [{"model": "example", "slo_us": 5e6, "weight": 1.0, "throughput_rps": 1.0,
                        "batch_delay_rate_rps": 1.0,
                        "pipelines": [{"batch_size": 2, "throughput_rps": 1.0, "latency_us": 1e4,
                                       "partitions": parts}]}]}
    path = d / "plan.json"
    path.write_text(json.dumps(plan))
    return path


def test_example_cnn_served_by_ort_partitions_cut_from_the_profile():
    """No partition files configured: the executors cut [0,4) and [4,10) from the profiled model
    (the profile records the model file and its block cuts), run them with ONNX Runtime, and the
    results match the whole model."""
    pytest.importorskip("onnxruntime")
    import onnxruntime as ort

    from ppiped.client import Client

    with short_tmpdir("ppiped-ex-") as d:
        d = Path(d)
        profile = EXAMPLE_PROFILE
        info = json.loads(profile.read_text()) if profile.exists() else {}
        if not (profile.parent / info.get("onnx", "-")).is_file():
            p = ppiped("example-model", "-o", str(d / "example"))
            assert p.returncode == 0, p.stderr[-2000:]
            profile = d / "example" / "example.json"
            info = json.loads(profile.read_text())
        model_path = profile.parent / info["onnx"]
        plan = _example_two_partition_plan(d, profile)
        cfg = write_config(d, plan, profile.parent, backend="ort", scheduler={"wait_guard_us": 1e6})
        shape = info["input"]["shape"]
        x = np.random.default_rng(2).standard_normal((4, *shape)).astype(np.float32)  # two full batches
        with LocalCluster(cfg, [[0], [1]]) as c, Client(c.client_endpoint, timeout_s=60) as cl:
            m = cl.info()["models"]["example"]  # clients learn the input the profile recorded
            assert m["input"]["shape"] == list(shape) and m["input_bytes"] == x[0].nbytes
            out = cl.submit_many("example", [xi.tobytes() for xi in x])
        sess = ort.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
        want = sess.run(None, {sess.get_inputs()[0].name: x})[0]
        for i, r in enumerate(out):
            (y,) = r.arrays()
            scale = float(np.abs(want[i]).max())
            assert float(np.abs(y - want[i]).max()) <= 2e-2 * scale + 1e-3
