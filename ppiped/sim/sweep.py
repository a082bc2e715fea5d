"""Load-factor sweep: the largest load at which every model keeps its SLO attainment target.

The search is generic over a ``run(load_factor) -> min attainment`` function, so the same
search serves the simulator, the figure-6 bench and (later) sweeps against a live daemon.
The search steps up coarsely and then bisects. Attainment need not fall monotonically as load
rises (at very low load a policy that waits to fill batches can lose requests to latency noise
that it would not lose at a higher load): points below the answer that miss the target are
kept as ``dips`` and do not stop the search.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import NamedTuple

DIP_STEPS = 4  # coarse steps searched past a failure before anything has passed


class Outcome(NamedTuple):
    """What one run may return instead of a bare attainment: ``complete`` False for a run stopped
    once it could no longer reach the target, whose ``attainment`` is not the run's value."""

    attainment: float
    complete: bool = True


@dataclass
class SweepResult:
    max_load_factor: float
    points: dict[float, float] = field(default_factory=dict)  # load factor -> min attainment (every run)
    stopped: set[float] = field(default_factory=set)  # runs cut short below target: attainment unknown

    def curve(self) -> list[tuple[float, float]]:
        """Load factor and attainment of the runs that ran to the end."""
        return sorted((f, a) for f, a in self.points.items() if f not in self.stopped)

    def dips(self, target: float) -> list[float]:
        """Load factors below the answer whose attainment missed ``target``."""
        return sorted(f for f, a in self.points.items()
                      if f < self.max_load_factor and (a < target or f in self.stopped))


def sweep(
    run: Callable[[float], float | Outcome],
    target: float = 0.99,
    step: float = 0.05,
    resolution: float = 0.01,
    max_factor: float = 3.0,
    pool: Executor | None = None,
    width: int = 1,
    start: float | None = None,
) -> SweepResult:
    """Find the largest load factor (multiple of ``resolution``) with attainment ≥ ``target``.

    Coarse phase: factors ``step, 2·step, …`` until one fails, ``width`` at a time (in ``pool``
    when given, so both cores are busy). With ``start`` (a guess of the answer), the coarse phase
    begins there instead and steps up while it passes or down until it passes: the same answer
    for a monotone curve in far fewer runs. Fine phase: bisection between the last pass and the
    first failure down to ``resolution``. The coarse phase ends at ``max_factor`` (tried
    itself where the grid steps past it). Returns 0 when even the smallest step fails.
    Load factors are whole multiples of ``resolution`` throughout: the coarse step is rounded to
    one (at least one), so no two coarse steps land on the same factor.
    """
    points: dict[float, float] = {}
    stopped: set[float] = set()

    def record(f: float, r: float | Outcome) -> None:
        if isinstance(r, Outcome):
            points[f] = r.attainment
            if not r.complete:
                stopped.add(f)
        else:
            points[f] = r

    def evaluate(factors: list[float]) -> None:
        todo = [f for f in factors if f not in points]
        if pool is not None and len(todo) > 1:
            for f, r in zip(todo, pool.map(run, todo), strict=True):
                record(f, r)
        else:
            for f in todo:
                record(f, run(f))

    def q(n: int) -> float:
        return round(n * resolution, 10)

    def passes(f: float) -> bool:
        return f not in stopped and points[f] >= target

    su = max(1, round(step / resolution))  # the coarse step, in resolutions
    top = max(1, round(max_factor / resolution))
    ok, bad = 0, None  # in resolutions
    first_bad = None
    k = 1
    if start is not None and start > step:
        k = max(1, round(start / resolution / su))
        n0 = min(su * k, top)
        evaluate([q(n0)])
        if not passes(q(n0)):
            bad = n0
            while k > 1:  # step down until a factor passes
                k -= 1
                evaluate([q(su * k)])
                if passes(q(su * k)):
                    ok = su * k
                    break
                bad = su * k
        else:
            ok = n0
            k += 1
    while bad is None:
        # the coarse grid, and max_factor itself where the grid steps past it
        batch = sorted({min(su * (k + i), top) for i in range(max(1, width))} - {round(f / resolution) for f in points})
        if not batch:
            break
        evaluate([q(n) for n in batch])
        for n in batch:
            if passes(q(n)):
                ok = n
            elif ok > 0:
                bad = n
                break
            elif first_bad is None:
                first_bad = n  # maybe a dip at light load: look a few steps further up
            elif n >= first_bad + DIP_STEPS * su:
                bad = first_bad  # nothing passes above it either: search below it
                break
        k += len(batch)
    if bad is None and ok == 0 and first_bad is not None:
        bad = first_bad
    if bad is None:
        return SweepResult(q(ok), points, stopped)
    lo_steps, hi_steps = ok, bad
    while hi_steps - lo_steps > 1:
        if pool is not None and width > 1 and hi_steps - lo_steps > 2:
            # Probe two interior points at once: the interval shrinks to a third.
            a = lo_steps + (hi_steps - lo_steps) // 3
            b = lo_steps + 2 * (hi_steps - lo_steps) // 3
            a, b = max(a, lo_steps + 1), max(b, a + 1)
            evaluate([q(a), q(b)])
            if passes(q(b)):
                lo_steps = b
            elif passes(q(a)):
                lo_steps, hi_steps = a, b
            else:
                hi_steps = a
        else:
            mid = (lo_steps + hi_steps) // 2
            evaluate([q(mid)])
            if passes(q(mid)):
                lo_steps = mid
            else:
                hi_steps = mid
    return SweepResult(q(lo_steps), points, stopped)
