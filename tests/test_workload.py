"""Arrival processes: rates, burstiness, replay, determinism."""

from __future__ import annotations

import numpy as np
import pytest

from ppiped.errors import InputError
from ppiped.sim.workload import azure_functions, gamma_bursty, generate, poisson


def cv_of_gaps(t):
    g = np.diff(t)
    return g.std() / g.mean()


def test_poisson_rate_and_cv():
    t = poisson(2000, 20, np.random.default_rng(1))
    assert abs(len(t) / 20 / 2000 - 1) < 0.03
    assert abs(cv_of_gaps(t) - 1) < 0.05
    assert np.all(np.diff(t) >= 0) and t[-1] < 20e6


def test_bursty_is_burstier_at_same_rate():
    t = gamma_bursty(2000, 60, np.random.default_rng(2), cv=4)
    assert abs(len(t) / 60 / 2000 - 1) < 0.15
    assert cv_of_gaps(t) > 3
    with pytest.raises(InputError):
        gamma_bursty(10, 1, np.random.default_rng(0), cv=0)


def test_same_seed_same_trace_bit_for_bit():
    a = generate("bursty", [100, 300], 5, seed=7)
    b = generate("bursty", [100, 300], 5, seed=7)
    c = generate("bursty", [100, 300], 5, seed=8)
    assert np.array_equal(a.times_us, b.times_us) and np.array_equal(a.model, b.model)
    assert not np.array_equal(a.times_us, c.times_us)
    share = (a.model == 1).mean()
    assert 0.6 < share < 0.9


def test_azure_replay_rescaled(tmp_path):
    f = tmp_path / "azure.csv"
    rng = np.random.default_rng(3)
    ends = np.sort(rng.uniform(0, 3600, 5000))
    with f.open("w") as fh:
        fh.write("app,func,end_timestamp,duration\n")
        for e in ends:
            fh.write(f"a,f,{e + 0.5:.6f},0.5\n")
    t = azure_functions(f, 500, 30, np.random.default_rng(0))
    assert abs(len(t) / 30 / 500 - 1) < 0.1
    tr = generate(str(f), [500], 30, seed=1)
    assert len(tr) == pytest.approx(15000, rel=0.1)
    (tmp_path / "bad.csv").write_text("app,func,when\n")
    with pytest.raises(InputError, match="missing duration, end_timestamp"):
        azure_functions(tmp_path / "bad.csv", 1, 1, rng)
    with pytest.raises(InputError, match="unknown trace"):
        generate("nosuchfile.csv", [1], 1, seed=0)


def test_azure_fold_overlays_windows_like_the_ppipe_artifact(tmp_path):
    f = tmp_path / "azure.csv"
    # bursts: 40 invocations within 10 ms at the start of every second, 200 s long (8000 in all)
    starts = np.sort(np.concatenate([s + np.linspace(0, 0.01, 40) for s in range(200)]))
    with f.open("w") as fh:
        fh.write("app,func,end_timestamp,duration\n")
        for s in starts:
            fh.write(f"a,f,{s + 0.25:.6f},0.25\n")
    rate = 4000.0  # 100 x the native 40/s: 100 windows of 2 s are overlaid
    t = azure_functions(f, rate, 10, np.random.default_rng(0), scale="fold")
    assert t[0] == 0.0 and np.all(np.diff(t) >= 0)
    assert len(t) / 10 == pytest.approx(rate, rel=0.05)
    # the artifact's scaleTrace: x mod segment, sorted, replayed gap by gap from 0; a segment
    # holds the trace's n arrivals at the rate asked
    seg = len(starts) / rate
    ref = np.sort(starts % seg)
    ref = (ref - ref[0]) * 1e6
    n = min(len(ref), len(t))
    np.testing.assert_allclose(t[:n], ref[:n], rtol=0, atol=1.0)  # the file keeps µs
    # no randomness: the seed does not matter
    assert np.array_equal(t, azure_functions(f, rate, 10, np.random.default_rng(9), scale="fold"))
    tr = generate(str(f), [rate, rate / 2], 10, seed=1, trace_scale="fold")
    assert np.bincount(tr.model).tolist() == [len(t), len(azure_functions(f, rate / 2, 10, None, scale="fold"))]
    with pytest.raises(InputError, match="trace scaling"):
        azure_functions(f, rate, 10, np.random.default_rng(0), scale="squash")


def _trace_file(path, starts):
    with path.open("w") as fh:
        fh.write("app,func,end_timestamp,duration\n")
        for x in starts:
            fh.write(f"a,f,{x:.6f},0\n")
    return path


@pytest.mark.parametrize("scale", ["fold", "stretch"])
@pytest.mark.parametrize("rate", [10.0, 100.0, 3000.0])
def test_trace_replays_the_rate_asked_below_and_above_its_own(tmp_path, scale, rate):
    """fold below the trace's native rate (1000/s) replayed it at that rate, up to 9x the load
    asked."""
    f = _trace_file(tmp_path / "t.csv", np.arange(5000) / 1000.0 + np.random.default_rng(0).uniform(0, 5e-4, 5000))
    t = azure_functions(f, rate, 20, np.random.default_rng(1), scale=scale)
    assert len(t) / 20 == pytest.approx(rate, rel=0.02)


@pytest.mark.parametrize("scale", ["fold", "stretch"])
def test_a_tiny_trace_replays_the_rate_asked(tmp_path, scale):
    """Three invocations: fold replayed 3/2 of the rate, stretch 3/4."""
    f = _trace_file(tmp_path / "t.csv", [0.0, 1.0, 2.0])
    t = azure_functions(f, 10.0, 30, np.random.default_rng(1), scale=scale)
    assert abs(len(t) - 300) <= 3


@pytest.mark.parametrize("cv", [0.5, 4.0, 20.0])
def test_bursty_counts_rate_times_duration_for_any_cv(cv):
    """Started afresh at 0, a Gamma renewal process adds about (cv^2 - 1) / 2 arrivals near 0
    (cv 20 at 100/s for 1 s: 238 arrivals on average, not 100)."""
    counts = [len(gamma_bursty(100.0, 1.0, np.random.default_rng(s), cv)) for s in range(3000)]
    assert np.mean(counts) == pytest.approx(100.0, abs=15.0)
    again = gamma_bursty(100.0, 1.0, np.random.default_rng(5), cv)
    assert np.array_equal(again, gamma_bursty(100.0, 1.0, np.random.default_rng(5), cv))
