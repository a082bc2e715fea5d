"""Short runs of the serving and planner benches: they run and print what they promise
(figures are not checked here; bench/ prints them)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import other_plan_set, reference_plans

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _json_lines(args: list[str], timeout: int = 600, env: dict | None = None) -> list[dict]:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout,
                         env=None if env is None else {**os.environ, **env})
    assert out.returncode == 0, out.stderr[-2000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_hotpath_bench_answers_every_request():
    (r,) = [r for r in _json_lines([str(BENCH / "hotpath.py"), "--requests", "3000", "--repeat", "1"])
            if r.get("bench")]
    assert r["bench"] == "hotpath" and r["requests"] == 3000
    assert r["us_per_request"] > 0 and r["submit_side_us"] > 0 and r["result_side_us"] > 0
    assert 1 < r["mean_batch"] <= r["bs"]


def test_ingest_bench_short_run():
    recs = {r["bench"]: r for r in _json_lines([
        str(BENCH / "ingest.py"), "--rate", "2000", "--duration", "1", "--recovery-rate", "300",
        "--recovery-duration", "2", "--kill-at", "0.8"]) if "bench" in r}
    ing, rec = recs["ingest"], recs["recovery"]
    assert ing["sent"] > 0 and ing["no_reply"] == 0
    assert ing["answered_ok"] + ing["dropped"] + ing["rejected"] == ing["sent"]
    assert ing["overhead_samples"] > 0 and ing["overhead_p99_us"] >= ing["overhead_p50_us"]
    assert rec["no_reply"] == 0 and rec["executors_lost"] >= 1


@pytest.mark.shared
def test_planner_bench_one_configuration():
    if not reference_plans("v4"):
        pytest.skip("../shared/data/ppipe is not present")
    recs = _json_lines([str(BENCH / "planner.py"), "--jobs", "1", "--limit", "1", "--algo", "np"])
    (row,) = [r for r in recs if "config" in r]
    (summary,) = [r for r in recs if r.get("summary")]
    assert row["algos"]["np"]["check"] == "ok" and row["algos"]["np"]["ours"] > 0
    assert summary["configurations"] == 1 and summary["np"]["errors"] == 0


@pytest.mark.shared
def test_planner_bench_on_another_plan_set(tmp_path):
    """--plan-set: a single-model reference and a group without NP or DART-r references are
    planned by every algorithm; ratios exist only where a reference does."""
    if not reference_plans("v4"):
        pytest.skip("../shared/data/ppipe is not present")
    group, single = other_plan_set(tmp_path / "set")
    recs = _json_lines([str(BENCH / "planner.py"), "--jobs", "1", "--algo", "ppipe,np", "--time-limit", "10",
                        "--plan-set", str(tmp_path / "set")])
    rows = {r["config"]: r for r in recs if "config" in r}
    (summary,) = [r for r in recs if r.get("summary")]
    assert set(rows) == {group, single}
    assert rows[single]["weights"] == [1.0] and len(rows[single]["models"]) == 1
    for row in rows.values():
        pp, np_ = row["algos"]["ppipe"], row["algos"]["np"]
        assert pp["check"] == np_["check"] == "ok" and pp["ours"] >= np_["ours"] * (1 - 1e-6)
        assert "ratio" in pp and np_["ref"] is None and "ratio" not in np_ and row["missed"] == []
    assert summary["np"]["planned"] == 2 and summary["np"]["without_reference"] == 2
    assert summary["np"]["errors"] == 0


def _run_part(part: str, *extra: str) -> tuple[int, list[dict]]:
    """Run one part of bench/planner.py; its exit status is 1 exactly when a case missed a target."""
    out = subprocess.run([sys.executable, str(BENCH / "planner.py"), "--part", part, "--limit", "1",
                          "--time-limit", "5", *extra], capture_output=True, text=True, timeout=600)
    assert out.returncode in (0, 1), out.stderr[-2000:]
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows = [r for r in recs if not r.get("summary")]
    (summary,) = [r for r in recs if r.get("summary")]
    assert summary["part"] == part and summary["cases_missed"] == sum(1 for r in rows if r["missed"])
    assert out.returncode == (1 if summary["cases_missed"] else 0)
    assert "missed a target" in out.stderr  # the table and the closing line go to stderr
    return out.returncode, recs


@pytest.mark.shared
def test_planner_bench_ablation_part():
    if not reference_plans("v4"):
        pytest.skip("../shared/data/ppipe is not present")
    _, recs = _run_part("ablation")
    (row,) = [r for r in recs if not r.get("summary")]
    assert row["part"] == "ablation" and row["cluster"] == "L4:25,T4:75"
    for algo in ("np", "ppipe"):
        assert row["algos"][algo]["check"] == "ok" and row["algos"][algo]["ours"] > 0
    assert row["batch_delay_rate_rps"] == pytest.approx(row["algos"]["np"]["ours"], rel=1e-3)
    assert row["ratio"] == pytest.approx(row["algos"]["ppipe"]["ours"] / row["algos"]["np"]["ours"], rel=1e-3)


@pytest.mark.shared
def test_planner_bench_scale_part():
    if not reference_plans("v4"):
        pytest.skip("../shared/data/ppipe is not present")
    _, recs = _run_part("scale")
    rows = [r for r in recs if not r.get("summary")]
    (summary,) = [r for r in recs if r.get("summary")]
    assert [r["kind"] for r in rows] == ["3types", "4types", "1kgpus", "10kgpus"]  # --limit 1 per cluster
    assert [r["cluster"] for r in rows] == ["L4:25,V100:25,T4:50", "L4:25,V100:25,T4:25,P4:25",
                                            "L4:250,T4:750", "L4:2500,T4:7500"]
    assert [r["rate_scale"] for r in rows] == [1.0, 1.0, 10.0, 100.0]
    for r in rows:
        rec = r["algos"]["ppipe"]
        assert "error" not in rec and rec["check"] == "ok" and rec["ours"] > 0, r
    assert all(summary[k]["cases"] == 1 for k in ("3types", "4types", "1kgpus", "10kgpus"))


def test_planner_bench_case_selection(monkeypatch):
    spec = importlib.util.spec_from_file_location("bench_planner", BENCH / "planner.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_planner", bench)  # dataclasses look their module up
    spec.loader.exec_module(bench)
    cases = [bench.Case("scale", k, f"{k}/g{i}") for k in ("3types", "1kgpus") for i in range(3)]
    assert [c.name for c in bench.select(cases, None, 2)] == ["3types/g0", "3types/g1", "1kgpus/g0", "1kgpus/g1"]
    assert [c.name for c in bench.select(cases, "g2", None)] == ["3types/g2", "1kgpus/g2"]
    assert [c.name for c in bench.select(cases, "1kgpus/", 1)] == ["1kgpus/g0"]


def test_faults_bench_short_run():
    out = subprocess.run([sys.executable, str(BENCH / "faults.py"), "--seconds", "1", "--rate", "500",
                          "--flood", "5000"], capture_output=True, text=True, timeout=600)
    recs = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    rows = {r["case"]: r for r in recs if "case" in r}
    assert set(rows) == {"forged-results", "forward-injection", "forward-injection-curve", "unauthorized-register",
                         "tcp-ctl-stop", "oversize-payloads", "daemon-restart", "executor-kill", "executor-stop",
                         "flood"}
    assert rows["forged-results"]["forged_accepted"] == 0 and rows["forged-results"]["forged_sent"] > 0
    for case in ("forward-injection", "forward-injection-curve"):
        assert rows[case]["forged_run"] == 0 and rows[case]["executors_lost"] == 0
    assert rows["forward-injection"]["forged_sent"] > 0
    assert rows["unauthorized-register"]["accepted"] == 0
    assert rows["unauthorized-register"]["answers"]["plain, bogus data endpoint"] == "bad-endpoint"
    assert rows["tcp-ctl-stop"]["daemon_alive"]
    assert rows["oversize-payloads"]["growth_mb"] <= 64
    assert rows["daemon-restart"]["silent"] == 0 and rows["daemon-restart"]["pending"] == 100
    assert rows["daemon-restart"]["under_load"]["no_reply"] == 0
    for case in ("executor-kill", "executor-stop"):
        assert rows[case]["no_reply"] == 0 and rows[case]["bad_echo"] == 0
    assert rows["flood"]["flooder"]["sent"] == 5000 and rows["flood"]["flooder"]["no_reply"] == 0
    (summary,) = [r for r in recs if r.get("summary")]
    # attainment targets depend on the host's load: the exit status only has to agree with them
    assert summary["cases"] == 9 and out.returncode == (1 if summary["missed"] else 0)


def test_overload_bench_short_run(tmp_path):
    """Light-load part on its synthetic 2 ms plan (and one shared plan when present), then the
    daemon part for a second: every request answered, and no temporary folder left behind."""
    recs = _json_lines([str(BENCH / "overload.py"), "--part", "lowload", "--policies", "ppipe,pard",
                        "--limit", "1", "--duration", "0.5"], env={"TMPDIR": str(tmp_path)})
    assert list(tmp_path.iterdir()) == []
    (summary,) = [r for r in recs if r.get("bench") == "overload"]
    low = summary["summary"]["lowload"]
    assert set(low) == {f"{p}@{lf}" for p in ("ppipe", "pard") for lf in (0.01, 0.02, 0.05, 0.1, 0.2)}
    assert all(0.0 <= v["attainment_2ms_plan"] <= 1.0 for v in low.values())
    (d,) = [r for r in _json_lines([str(BENCH / "overload.py"), "--part", "daemon", "--daemon-seconds", "1"])
            if r.get("bench") == "overload-daemon"]
    assert d["sent"] > 0 and d["no_reply"] == 0
    assert 0.0 <= d["goodput_over_capacity"] <= 1.5


def test_realserve_bench_short_run(tmp_path):
    """Real ONNX Runtime executors serving two zoo models on one core for two seconds: every
    request is answered (attainment depends on the host's cores and is only reported)."""
    (r,) = [r for r in _json_lines([str(BENCH / "realserve.py"), "--models", "attention,yolo", "--scale", "1",
                                    "--splits", "1,2", "--cores", "1", "--duration", "2", "--rounds", "1",
                                    "--cache", str(tmp_path / "cache"), "--no-pin"]) if "attainment" in r]
    assert r["sent"] > 0 and r["no_reply"] == 0
    assert 0.0 <= r["attainment"] <= 1.0


@pytest.mark.shared
def test_dag_bench_short_run():
    if not reference_plans("v4"):
        pytest.skip("../shared/data/ppipe is not present")
    recs = _json_lines([str(BENCH / "dag.py"), "--apps", "2", "--loads", "1.3", "--duration", "1",
                        "--seeds", "1", "--time-limit", "10"])
    runs = [r for r in recs if "system" in r]
    assert {r["system"] for r in runs} == {"split", "e2e", "chain", "e2e-ppipe"}
    for r in runs:
        assert r["queries"] > 0 and r["ok"] + r["late"] + sum(r["dropped"].values()) == r["queries"]
        assert 0 <= r["invalid_rate"] <= 1
    assert any(r.get("summary") == "dag" for r in recs)
