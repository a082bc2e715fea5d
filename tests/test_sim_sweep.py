"""The sweep's ``start`` guess changes how many runs it takes, never the answer."""

from __future__ import annotations

import pytest

from ppiped.sim.sweep import sweep


@pytest.mark.parametrize("threshold", [0.0, 0.03, 0.37, 0.9, 0.96, 1.23])
@pytest.mark.parametrize("start", [0.05, 0.5, 0.9, 1.5])
def test_start_guess_gives_the_same_answer(threshold, start):
    calls = []

    def run(lf):
        calls.append(lf)
        return 1.0 if lf <= threshold + 1e-9 else 0.5

    assert sweep(run, start=start).max_load_factor == pytest.approx(threshold)
    assert len(calls) == len(set(calls))


def test_good_guess_takes_few_runs():
    calls = []
    sweep(lambda lf: calls.append(lf) or (1.0 if lf <= 0.96 else 0.0), start=0.9)
    assert len(calls) <= 5
