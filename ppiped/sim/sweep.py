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

DIP_STEPS = 4  # coarse steps searched past a failure before anything has passed


@dataclass
class SweepResult:
    max_load_factor: float
    points: dict[float, float] = field(default_factory=dict)  # load factor -> min attainment

    def curve(self) -> list[tuple[float, float]]:
        return sorted(self.points.items())

    def dips(self, target: float) -> list[float]:
        """Load factors below the answer whose attainment missed ``target``."""
        return [f for f, a in self.curve() if f < self.max_load_factor and a < target]


def sweep(
    run: Callable[[float], float],
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
    """
    points: dict[float, float] = {}

    def evaluate(factors: list[float]) -> None:
        todo = [f for f in factors if f not in points]
        if pool is not None and len(todo) > 1:
            for f, a in zip(todo, pool.map(run, todo), strict=True):
                points[f] = a
        else:
            for f in todo:
                points[f] = run(f)

    def q(x: float) -> float:
        return round(round(x / resolution) * resolution, 10)

    ok, bad = 0.0, None
    first_bad = None
    k = 1
    if start is not None and start > step:
        k = max(1, round(start / step))
        f0 = q(step * k)
        evaluate([f0])
        if points[f0] < target:
            bad = f0
            while k > 1:  # step down until a factor passes
                k -= 1
                f = q(step * k)
                evaluate([f])
                if points[f] >= target:
                    ok = f
                    break
                bad = f
        else:
            ok = f0
            k += 1
    top = q(max_factor)
    while bad is None:
        # the coarse grid, and max_factor itself where the grid steps past it
        batch = sorted({min(q(step * (k + i)), top) for i in range(max(1, width))} - set(points))
        if not batch:
            break
        evaluate(batch)
        for f in batch:
            if points[f] >= target:
                ok = f
            elif ok > 0:
                bad = f
                break
            elif first_bad is None:
                first_bad = f  # maybe a dip at light load: look a few steps further up
            elif f >= first_bad + DIP_STEPS * step - 1e-9:
                bad = first_bad  # nothing passes above it either: search below it
                break
        k += len(batch)
    if bad is None and ok == 0 and first_bad is not None:
        bad = first_bad
    if bad is None:
        return SweepResult(ok, points)
    lo_steps, hi_steps = round(ok / resolution), round(bad / resolution)
    while hi_steps - lo_steps > 1:
        if pool is not None and width > 1 and hi_steps - lo_steps > 2:
            # Probe two interior points at once: the interval shrinks to a third.
            a = lo_steps + (hi_steps - lo_steps) // 3
            b = lo_steps + 2 * (hi_steps - lo_steps) // 3
            a, b = max(a, lo_steps + 1), max(b, a + 1)
            evaluate([q(a * resolution), q(b * resolution)])
            if points[q(b * resolution)] >= target:
                lo_steps = b
            elif points[q(a * resolution)] >= target:
                lo_steps, hi_steps = a, b
            else:
                hi_steps = a
        else:
            mid = (lo_steps + hi_steps) // 2
            f = q(mid * resolution)
            evaluate([f])
            if points[f] >= target:
                lo_steps = mid
            else:
                hi_steps = mid
    return SweepResult(q(lo_steps * resolution), points)
