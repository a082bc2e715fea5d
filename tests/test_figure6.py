"""A short run of bench/figure6.py: one configuration, Poisson, half a simulated second per run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import SHARED

BENCH = Path(__file__).resolve().parents[1] / "bench" / "figure6.py"
PNG = b"\x89PNG\r\n\x1a\n"


def _bench():
    spec = importlib.util.spec_from_file_location("figure6", BENCH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["figure6"] = mod  # dataclasses and worker pickling look the module up by name
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.shared
def test_figure6_short_run(tmp_path, capsys):
    if not (SHARED / "reference-plans" / "maf21").is_dir():
        pytest.skip("../shared/data/ppipe is not present")
    out = tmp_path / "f6"
    assert _bench().main(["--data", str(SHARED), "--limit", "1", "--duration", "0.5", "--traces", "poisson",
                          "--jobs", "1", "--jitter", "0", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert [r["system"] for r in runs] == ["PPipe", "NP", "DART-r", "Reactive"]
    assert all(0 <= r["max_load_factor"] <= 3 for r in runs)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["means"]["poisson"]) == {"PPipe", "NP", "DART-r", "Reactive"}
    assert "mean, poisson" in text and "configuration" in text
    for name in ("figure6.png", "figure7.png", "figure12-ppipe.png", "figure12-reactive.png"):
        assert (out / name).read_bytes()[:8] == PNG


def test_figure6_skips_without_data(tmp_path, capsys):
    assert _bench().main(["--data", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 0
    assert "skipped" in capsys.readouterr().err
