"""Request arrival processes: Poisson, bursty (Gamma renewal), and Azure Functions trace replay.

Every generator returns sorted arrival times in µs (float64) over ``[0, duration_s)`` and is a
pure function of its ``numpy.random.Generator``, so the same seed gives the same trace bit for bit.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..readfile import read_text


@dataclass(frozen=True)
class Trace:
    """Merged multi-model arrivals: ``times_us[i]`` is when request i arrives for ``model[i]``,
    in priority class ``priority[i]`` (0 low, 1 high; ``None``: all low)."""

    times_us: np.ndarray
    model: np.ndarray
    priority: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.times_us)

    def with_high_share(self, share: float, seed: int) -> Trace:
        """The same arrivals with each request high-priority with probability ``share``,
        independently (its own random stream: the times stay bit for bit the same)."""
        if not 0.0 <= share <= 1.0:
            raise InputError(f"high-priority share must be within [0, 1], got {share}")
        if share == 0.0:
            return Trace(self.times_us, self.model)
        rng = np.random.default_rng([seed, 0x9E3779B9])
        return Trace(self.times_us, self.model, (rng.random(len(self.times_us)) < share).astype(np.int64))


def _renewal(gaps_fn, rate_rps: float, duration_s: float, rng: np.random.Generator,
             first_fn=None) -> np.ndarray:
    """Draw inter-arrival gaps in chunks until the horizon is covered; independent of chunking.
    ``first_fn()``: the first arrival (default: one gap after 0)."""
    if rate_rps <= 0 or duration_s <= 0:
        return np.empty(0)
    horizon = duration_s * 1e6
    n = int(rate_rps * duration_s * 1.1) + 64
    parts, t0 = [], 0.0
    if first_fn is not None:
        t0 = float(first_fn())
        parts.append(np.array([t0]))
        if t0 >= horizon:
            return np.empty(0)
    while True:
        t = t0 + np.cumsum(gaps_fn(n))
        parts.append(t)
        if t[-1] >= horizon:
            break
        t0 = t[-1]
    out = np.concatenate(parts)
    return out[out < horizon]


def poisson(rate_rps: float, duration_s: float, rng: np.random.Generator) -> np.ndarray:
    return _renewal(lambda n: rng.exponential(1e6 / rate_rps, n), rate_rps, duration_s, rng)


def gamma_bursty(rate_rps: float, duration_s: float, rng: np.random.Generator, cv: float = 2.0) -> np.ndarray:
    """Gamma renewal process: mean rate ``rate_rps``, coefficient of variation ``cv`` of the gaps.

    cv = 1 is Poisson; cv = 4 (as in the bursty workloads of the PPipe and Nexus
    evaluations) packs arrivals into bursts separated by long quiet gaps. The process is observed
    in equilibrium: the first arrival is drawn from the forward-recurrence time (``U · Gamma(k+1,
    θ)`` for ``Gamma(k, θ)`` gaps), so the expected count is ``rate_rps · duration_s`` for any cv
    (started afresh at 0, a burst at t = 0 adds about (cv² - 1) / 2 arrivals).
    """
    if cv <= 0:
        raise InputError(f"bursty trace: coefficient of variation must be > 0, got {cv}")
    shape = 1.0 / (cv * cv)
    scale = 1e6 / (rate_rps * shape) if rate_rps > 0 else 1.0
    return _renewal(lambda n: rng.gamma(shape, scale, n), rate_rps, duration_s, rng,
                    lambda: rng.random() * rng.gamma(shape + 1.0, scale))


TRACE_SCALES = ("stretch", "fold")


def azure_functions(path: str | Path, rate_rps: float, duration_s: float,
                    rng: np.random.Generator, scale: str = "stretch") -> np.ndarray:
    """Replay an Azure Functions 2021 invocation trace at mean rate ``rate_rps``.

    The file has columns ``app, func, end_timestamp, duration`` (seconds); an invocation arrives
    at ``end_timestamp - duration``. Two ways to reach the rate:

    A trace of ``n`` invocations over ``span`` seconds is taken as one period of ``n`` arrivals,
    ``span · n / (n - 1)`` long (the span and one mean gap), so both ways replay exactly
    ``rate_rps`` on average however short the trace:

    * ``stretch``: the time axis is scaled so that the period is ``n / rate_rps``; the trace's
      own burstiness is kept. The period repeats, from a random phase (so seeds differ).
    * ``fold``: what the PPipe artifact does for its bursty ("MAF21") runs
      (``cluster-sim/.../TraceRequestGenerator.java``, ``scaleTrace``): with ``k`` = rate_rps /
      the trace's native rate, the trace is cut into ``k`` segments of ``n / rate_rps`` seconds
      that are overlaid (arrival ``x`` goes to ``x mod segment``), and the overlay is replayed
      from its first arrival (gaps in order; the segment repeats). Overlaying many windows of the
      trace smooths it a lot; the artifact uses no randomness here, so neither does this. Below
      the native rate (``k`` < 1) there is less than one window to overlay: the trace is
      stretched to fill the segment, as ``stretch`` does without its random phase.
    """
    if scale not in TRACE_SCALES:
        raise InputError(f"trace scaling must be one of {', '.join(TRACE_SCALES)}, got {scale!r}")
    path = Path(path)
    try:
        starts = _trace_starts(path, csv.DictReader(io.StringIO(read_text(path, InputError), newline="")))
    except csv.Error as e:  # a field past the csv module's limit, a NUL byte
        raise InputError(f"{path}: not a readable CSV trace: {e}") from None
    if len(starts) < 2:
        raise InputError(f"{path}: trace has fewer than 2 invocations")
    span = float(np.max(starts)) - float(np.min(starts))
    if span == 0:
        raise InputError(f"{path}: all invocations arrive at the same instant")
    if not 1e-6 <= span < math.inf:
        # (a span of 5e-324 s made the period infinite and one of 2e308 NaN; folded, either
        # replayed as 1 request)
        raise InputError(f"{path}: the invocations span {span:g} s: a trace must span from a microsecond "
                         "up to a finite time")
    if scale == "fold":
        return _fold(np.asarray(starts, dtype=np.float64), rate_rps, duration_s, path)
    t = np.sort(np.asarray(starts))
    t -= t[0]
    span = t[-1]
    if span <= 0:
        raise InputError(f"{path}: all invocations arrive at the same instant")
    # n - 1 gaps cover the span, one more closes the period: n arrivals per n / rate_rps
    t_us = t * ((len(t) - 1) / rate_rps / span) * 1e6
    period = t_us[-1] + 1e6 / rate_rps
    horizon = duration_s * 1e6
    reps = int(np.ceil(horizon / period))
    out = np.concatenate([t_us + k * period for k in range(reps)])
    # Random phase so different seeds see different windows of the trace.
    out = np.sort((out + rng.uniform(0, period)) % (reps * period))
    return out[out < horizon]


def _trace_starts(path: Path, reader: csv.DictReader) -> list[float]:
    missing = {"end_timestamp", "duration"} - set(reader.fieldnames or [])
    if missing:
        raise InputError(f"{path}: Azure trace needs columns app, func, end_timestamp, "
                         f"duration; missing {', '.join(sorted(missing))}")
    starts = []
    for i, row in enumerate(reader, start=2):
        try:
            start = float(row["end_timestamp"]) - float(row["duration"])
        except (TypeError, ValueError):
            raise InputError(f"{path}:{i}: end_timestamp/duration are not numbers") from None
        if not math.isfinite(start):
            raise InputError(f"{path}:{i}: end_timestamp/duration must be finite numbers")
        starts.append(start)
    return starts


def _fold(starts: np.ndarray, rate_rps: float, duration_s: float, path: Path) -> np.ndarray:
    """The PPipe artifact's ``scaleTrace`` + replay (see :func:`azure_functions`)."""
    t = np.sort(starts)
    t -= t[0]
    n, span = len(t), t[-1]
    if span <= 0:
        raise InputError(f"{path}: all invocations arrive at the same instant")
    period = span * n / (n - 1)  # the trace's own: n arrivals at its native rate
    segment = n / rate_rps  # n arrivals at the rate asked
    if segment > period:  # less than one window to overlay: stretch it over the segment
        t = t * (segment / period)
    folded = np.sort(t % segment)
    # the gaps in order; when the overlay is used up it starts again one segment later (the
    # artifact cycles the gaps without this last one, but its runs never get that far)
    gaps = np.append(np.diff(folded), segment - folded[-1] + folded[0]) * 1e6
    horizon = duration_s * 1e6
    # arrival 0 at t = 0, then the gaps in order, cycling
    per_cycle = float(gaps.sum())
    reps = int(horizon // per_cycle) + 1 if per_cycle > 0 else 1
    out = np.concatenate([[0.0], np.cumsum(np.tile(gaps, reps))])
    return out[out < horizon]


def generate(kind: str, rates_rps: Sequence[float], duration_s: float, seed: int,
             cv: float = 2.0, trace_scale: str = "stretch", high_share: float = 0.0) -> Trace:
    """Arrivals for several models at once; ``kind`` is poisson, bursty or a trace file path
    (replayed per ``trace_scale``, see :func:`azure_functions`); a ``high_share`` of requests
    is in the high priority class."""
    rng = np.random.default_rng(seed)
    times, models = [], []
    for i, r in enumerate(rates_rps):
        if r < 0:
            raise InputError(f"rate of model {i} is negative: {r}")
        sub = np.random.default_rng(rng.integers(2**63))
        if kind == "poisson":
            t = poisson(r, duration_s, sub)
        elif kind == "bursty":
            t = gamma_bursty(r, duration_s, sub, cv)
        elif Path(kind).is_file():
            t = azure_functions(kind, r, duration_s, sub, trace_scale) if r > 0 else np.empty(0)
        else:
            raise InputError(f"unknown trace {kind!r}: use poisson, bursty or an Azure trace file")
        times.append(t)
        models.append(np.full(len(t), i, dtype=np.int32))
    if not times:
        return Trace(np.empty(0), np.empty(0, dtype=np.int32)).with_high_share(high_share, seed)
    t = np.concatenate(times)
    m = np.concatenate(models)
    order = np.argsort(t, kind="stable")
    return Trace(t[order], m[order]).with_high_share(high_share, seed)
