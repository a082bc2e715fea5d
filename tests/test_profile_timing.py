"""Profile timing: median of rounds with its dispersion, the warning above 10 %, core pinning."""

from __future__ import annotations

import os

import onnx
import pytest

from ppiped.profiler.backends import Timing, dispersion, measure
from ppiped.profiler.example import build_tiny_model
from ppiped.profiler.harness import DISPERSION_WARN, Job, run_split, timing_dispersion

FAST = Timing(warmup_s=0.0, round_s=0.0, rounds=3)


class _Scripted:
    """A session whose rounds take the scripted seconds per inference, after two warm-up calls
    (what ``measure`` makes with ``warmup_s = 0``)."""

    def __init__(self, per_run: list[float]) -> None:
        self.script = [1e-3, 1e-3, *per_run]
        self.k = 0

    def timed(self, bs: int, n: int) -> float:
        t = self.script[self.k]
        self.k += 1
        return t * n

    def close(self) -> None:
        pass


def test_dispersion_is_iqr_over_median():
    assert dispersion([2.0, 2.0, 2.0]) == 0.0
    assert dispersion([5.0]) == 0.0
    assert dispersion([1.0, 2.0, 3.0, 4.0, 5.0]) == pytest.approx((4.0 - 2.0) / 3.0)
    # One disturbed round barely moves it: IQR ignores the tail.
    assert dispersion([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 9.0]) == 0.0


def test_measure_returns_median_and_dispersion():
    m = measure(_Scripted([1e-3, 1e-3, 1e-3, 1e-3, 1e-3]), 1, Timing(warmup_s=0.0, round_s=0.0, rounds=5))
    assert m.median_us == pytest.approx(1000.0) and m.dispersion == pytest.approx(0.0)
    m = measure(_Scripted([1e-3, 2e-3, 3e-3, 4e-3, 5e-3]), 1, Timing(warmup_s=0.0, round_s=0.0, rounds=5))
    assert m.median_us == pytest.approx(3000.0) and m.dispersion == pytest.approx(2 / 3)


def test_summary_and_one_warning(capsys):
    splits = {
        "1": {"workers": [{"dispersion": [[0.01, 0.02], [0.03, 0.04], [0.05]]}]},
        "2": {"workers": [{"dispersion": [[0.02, 0.30], [0.12, 0.01]]},
                          {"dispersion": [[0.02, 0.02], [0.01, 0.01]]}]},
    }
    s = timing_dispersion(splits, blocks=2, gpu="CPU")
    assert s["timings"] == 13 and s["over_threshold"] == 2 and s["max"] == 0.3
    assert s["worst"] == {"split": 2, "job": "block 0", "batch_size": 2, "dispersion": 0.3}
    assert s["threshold"] == DISPERSION_WARN == 0.10
    err = capsys.readouterr().err
    assert err.count("warning") == 1
    assert "2 of 13 timings on CPU vary by more than 10%" in err and "block 0, batch size 2, split 2: 30.0%" in err
    calm = {"1": {"workers": [{"dispersion": [[0.01, 0.02], [0.05]]}]}}
    s = timing_dispersion(calm, blocks=1)
    assert s["over_threshold"] == 0 and s["worst"]["job"] == "whole model"
    assert capsys.readouterr().err == ""
    assert timing_dispersion({}, blocks=1)["timings"] == 0


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this OS")
def test_one_thread_copies_in_workers_are_pinned_and_the_parent_is_not(tmp_path):
    model = tmp_path / "tiny.onnx"
    onnx.save(build_tiny_model(), str(model))
    before = os.sched_getaffinity(0)
    cores = sorted(before)
    res = run_split("ort", {"threads": 2}, 2, [Job(model, (1, 2))], FAST, 2)  # 1 thread per copy
    pinned = [w["pinned_core"] for w in res.info["workers"]]
    assert pinned == [cores[0], cores[1 % len(cores)]]
    assert all(len(w["dispersion"][0]) == 2 for w in res.info["workers"])
    assert len(res.dispersion) == 1 and len(res.dispersion[0]) == 2
    assert os.sched_getaffinity(0) == before
    alone = run_split("ort", {"threads": 1}, 1, [Job(model, (1,))], FAST, 1)  # in this process
    assert alone.info["workers"][0]["pinned_core"] is None
    assert os.sched_getaffinity(0) == before
