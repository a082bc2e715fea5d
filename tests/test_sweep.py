"""The load-factor search finds the threshold of a monotone attainment curve, and looks past a\nlight-load dip."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from ppiped.sim.sweep import Outcome, sweep


@pytest.mark.parametrize("threshold", [0.01, 0.37, 0.87, 0.9, 1.23])
@pytest.mark.parametrize("parallel", [False, True])
def test_sweep_finds_threshold(threshold, parallel):
    calls = []

    def run(lf):
        calls.append(lf)
        return 1.0 if lf <= threshold + 1e-9 else 0.95

    if parallel:
        with ThreadPoolExecutor(2) as pool:
            r = sweep(run, pool=pool, width=2)
    else:
        r = sweep(run)
    assert r.max_load_factor == pytest.approx(threshold)
    assert len(calls) == len(set(calls)), "no load factor is simulated twice"
    assert len(calls) < threshold / 0.05 + 12


def test_sweep_zero_when_nothing_passes_and_cap():
    assert sweep(lambda lf: 0.5).max_load_factor == 0.0
    assert sweep(lambda lf: 1.0, max_factor=0.5).max_load_factor == pytest.approx(0.5)


@pytest.mark.parametrize("step, max_factor, threshold, want", [
    (5.0, 3.0, 0.98, 0.98),  # the first coarse step is past the cap: the cap itself is tried
    (0.5, 1.23, 5.0, 1.23),  # everything passes: the answer is the cap, off the coarse grid
    (0.5, 1.23, 1.1, 1.1),   # the failure at the cap bounds the bisection
])
def test_sweep_tries_the_cap_when_the_grid_steps_past_it(step, max_factor, threshold, want):
    """A coarse step larger than what is left below --max-factor once ended the search with no
    run at all and answered 0."""
    calls = []

    def run(lf):
        calls.append(lf)
        return 1.0 if lf <= threshold + 1e-9 else 0.9

    r = sweep(run, step=step, max_factor=max_factor)
    assert r.max_load_factor == pytest.approx(want)
    assert max(calls) <= max_factor + 1e-9 and len(calls) == len(set(calls))


def test_sweep_looks_past_a_dip_at_light_load():
    """Attainment below target at 0.05 only (a light-load dip), then fine up to 0.62."""
    r = sweep(lambda lf: 0.98 if lf <= 0.05 + 1e-9 else (1.0 if lf <= 0.62 + 1e-9 else 0.9))
    assert r.max_load_factor == pytest.approx(0.62)
    assert r.dips(0.99) == [pytest.approx(0.05)]


@pytest.mark.parametrize("step, resolution, max_factor", [
    (0.05, 0.1, 3.0),  # two coarse steps rounded to one factor once ended the search at 0.2
    (0.001, 0.01, 1.0),  # every step rounded to 0.00: the answer was 0
    (0.05, 0.03, 3.0),  # a step that is no multiple of the resolution
    (0.25, 0.05, 3.0),
])
@pytest.mark.parametrize("threshold", [0.37, 0.9])
def test_sweep_is_right_for_any_step_and_resolution(step, resolution, max_factor, threshold):
    calls = []

    def run(lf):
        calls.append(lf)
        return 1.0 if lf <= threshold + 1e-9 else 0.5

    r = sweep(run, step=step, resolution=resolution, max_factor=max_factor)
    want = resolution * int(threshold / resolution + 1e-9)
    assert r.max_load_factor == pytest.approx(want)
    assert len(calls) == len(set(calls))


def test_runs_stopped_early_are_not_reported_as_attainments():
    """A run cut short once below target has no attainment to plot: it is listed apart."""
    r = sweep(lambda lf: 1.0 if lf <= 0.5 + 1e-9 else Outcome(0.2, complete=False))
    assert r.max_load_factor == pytest.approx(0.5)
    assert r.stopped and all(f > 0.5 for f in r.stopped)
    assert all(f not in r.stopped for f, _ in r.curve())
    assert [f for f, _ in r.curve()] == sorted(f for f in r.points if f <= 0.5 + 1e-9)
