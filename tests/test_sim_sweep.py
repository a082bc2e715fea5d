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


WORLD = ["--profiles", "profiles", "--trace", "bursty", "--cv", "3", "--seed", "7", "--policy", "pard",
         "--high-share", "0.2", "--jitter", "0.1", "--start-early-us", "50", "--margin-quantile", "0.5",
         "--noise-z", "2", "--duration", "4", "--trace-scale", "fold"]


def test_sweep_runs_the_world_sim_runs_for_every_flag():
    """--noise-z and --margin-quantile were accepted by sweep and dropped; every world flag must
    reach its runs as it reaches sim's."""
    from ppiped.cli import build_parser
    from ppiped.commands.sim import options_from
    from ppiped.commands.sweep import point_spec

    sim = build_parser().parse_args(["sim", "--plan", "p.json", "--load-factor", "1", *WORLD])
    sw = build_parser().parse_args(["sweep", "--plan", "p.json", *WORLD])
    spec = point_spec(sw, "p.json")
    assert spec.sim_options(stop=False) == options_from(sim)
    assert (spec.trace, spec.cv, spec.seed, spec.policy, spec.high_share, spec.duration_s, spec.trace_scale) == (
        sim.trace, sim.cv, sim.seed, sim.policy, sim.high_share, sim.duration, sim.trace_scale)
