"""Short runs of the serving and planner benches: they run and print what they promise
(figures are not checked here; bench/ prints them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import reference_plans

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _json_lines(args: list[str], timeout: int = 600) -> list[dict]:
    out = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)
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
