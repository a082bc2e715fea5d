"""bench/dispatch.py runs and says what the issue asks for (a short run; figures not checked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import reference_plans

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.shared
def test_dispatch_bench_prints_json_lines():
    if not reference_plans("v4"):
        pytest.skip("../shared/data/ppipe is not present")
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "dispatch.py"), "--json", "--duration", "2"],
                         capture_output=True, text=True, timeout=600, check=True).stdout
    recs = {r["metric"]: r for r in map(json.loads, out.splitlines())}
    assert {"decision_with_dispatch", "per_dispatch", "tables", "outcome"} <= set(recs)
    assert recs["decision_with_dispatch"]["n"] > 0 and recs["decision_with_dispatch"]["p99_us"] > 0
    assert recs["per_dispatch"]["probes_per_dispatch"] >= 1
    out = recs["outcome"]
    assert out["ended"] == out["requests"] and out["pending"] == 0
    assert recs["tables"]["arena_bytes_end"] == recs["tables"]["arena_bytes_start"]
