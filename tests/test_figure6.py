"""A short run of bench/figure6.py: one configuration, Poisson, half a simulated second per run."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from conftest import SHARED, other_plan_set

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


@pytest.mark.shared
def test_figure6_on_another_plan_set(tmp_path, capsys):
    """--plan-set: a folder with a single-model plan and no NP plans runs, and PPipe/NP is taken
    over the configurations both have."""
    if not (SHARED / "reference-plans" / "maf21").is_dir():
        pytest.skip("../shared/data/ppipe is not present")
    group, single = other_plan_set(tmp_path / "set")
    (tmp_path / "set" / f"{group}_bl.json").write_text(
        (SHARED / "reference-plans" / "maf21" / f"{group}_bl.json").read_text())
    out = tmp_path / "f6"
    assert _bench().main(["--data", str(SHARED), "--plan-set", str(tmp_path / "set"), "--duration", "0.5",
                          "--traces", "poisson", "--systems", "PPipe,NP", "--jobs", "1", "--jitter", "0",
                          "--no-plots", "--out", str(out)]) == 0
    runs = [json.loads(x) for x in (out / "runs.jsonl").read_text().splitlines()]
    assert sorted((r["config"], r["system"]) for r in runs) == sorted(
        [(group, "PPipe"), (group, "NP"), (single, "PPipe")])
    summary = json.loads((out / "summary.json").read_text())
    lf = {(r["config"], r["system"]): r["max_load_factor"] for r in runs}
    assert summary["ppipe_over_np"]["poisson"] == pytest.approx(lf[(group, "PPipe")] / lf[(group, "NP")])
    assert summary["configs"] == 2 and single[:20] in capsys.readouterr().out


def test_figure6_empty_plan_set_is_an_error(tmp_path, capsys):
    (tmp_path / "models").mkdir()
    (tmp_path / "empty").mkdir()
    assert _bench().main(["--data", str(tmp_path), "--plan-set", str(tmp_path / "empty"),
                          "--out", str(tmp_path / "o"), "--jitter", "0"]) == 2
    assert "no *_v4.json plans in" in capsys.readouterr().err
