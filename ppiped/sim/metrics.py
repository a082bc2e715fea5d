"""What a simulation measured, computed once from the loop's per-request arrays.

Everything here is a pure function of the simulated run (same seed, same numbers bit for bit),
except the ``speed`` block (wall time, simulated requests per wall-second), which is reported
apart so that comparing two results' ``to_json(speed=False)`` tests determinism.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..core.scheduler import DROP_REASONS
from .engine import LATE_EPS_US, R_CANCELLED, R_PENDING, R_SERVED


@dataclass
class ModelResult:
    model: str
    offered: int
    rate_rps: float
    served: int  # completed within the SLO
    late: int  # completed after the deadline
    drops: dict[str, int]
    unfinished: int  # still pending when the run stopped early (0 for a full run)
    p50_ms: float  # latency of completed requests (late ones included)
    p99_ms: float
    goodput_rps: float = 0.0  # arrived in the window and completed within the SLO, per window second
    invalid_rate: float = 0.0  # GPU time on requests that ended late or dropped after starting / all

    @property
    def drop_rate(self) -> float:
        """Dropped / offered."""
        return sum(self.drops.values()) / self.offered if self.offered else 0.0

    @property
    def attainment(self) -> float:
        """Served within SLO / offered (1.0 when nothing was offered)."""
        return self.served / self.offered if self.offered else 1.0


@dataclass
class SimResult:
    policy: str
    plan: str
    duration_s: float
    seed: int
    jitter_sigma: float
    models: list[ModelResult]
    utilization: dict[str, float]  # GPU type -> busy time (drain included) / (vGPUs of that type x duration)
    counters: dict[str, int]
    stopped: bool = False  # the miss budget ran out: attainments are upper bounds below target
    speed: dict[str, float] = field(default_factory=dict)
    timeline: list[tuple[str, float, float, int, int]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    classes: dict[str, list[ModelResult]] = field(default_factory=dict)  # "high"/"low" when both ran
    apps: list = field(default_factory=list)  # sim.dag.AppResult per app, for runs with queries

    @property
    def min_attainment(self) -> float:
        return min((m.attainment for m in self.models), default=1.0)

    @property
    def offered(self) -> int:
        return sum(m.offered for m in self.models)

    def class_min_attainment(self, name: str) -> float:
        """Worst model's attainment within priority class ``name`` (models it never used count 1)."""
        return min((m.attainment for m in self.classes.get(name, [])), default=1.0)

    def to_json(self, speed: bool = True) -> dict[str, Any]:
        c = self.counters
        d = {
            "plan": self.plan,
            "policy": self.policy,
            "duration_s": self.duration_s,
            "seed": self.seed,
            "jitter_sigma": self.jitter_sigma,
            **self.extra,
            "stopped": self.stopped,
            "min_attainment": self.min_attainment,
            "models": [
                {"model": m.model, "rate_rps": m.rate_rps, "offered": m.offered,
                 "attainment": m.attainment, "served": m.served, "late": m.late, "drops": m.drops,
                 "unfinished": m.unfinished, "p50_ms": m.p50_ms, "p99_ms": m.p99_ms,
                 "goodput_rps": m.goodput_rps, "drop_rate": m.drop_rate, "invalid_rate": m.invalid_rate}
                for m in self.models
            ],
            "utilization": self.utilization,
            "decisions": c["decisions"],
            "dispatches": c["dispatches"],
            "probes_per_dispatch": c["probes"] / c["dispatches"] if c["dispatches"] else 0.0,
            "counters": c,
        }
        if self.classes:
            d["classes"] = {
                name: {"min_attainment": self.class_min_attainment(name),
                       "models": [{"model": m.model, "offered": m.offered, "attainment": m.attainment,
                                   "goodput_rps": m.goodput_rps, "late": m.late, "drop_rate": m.drop_rate,
                                   "invalid_rate": m.invalid_rate} for m in ms]}
                for name, ms in self.classes.items()}
        if self.apps:
            d["apps"] = [a.to_json() for a in self.apps]
        if speed:
            d["speed"] = self.speed
        return d

    def summary(self) -> str:
        lines = [f"{self.plan}  policy={self.policy}  {self.duration_s:g} s  seed={self.seed}  "
                 f"jitter σ={self.jitter_sigma:g}" + ("  (stopped early: below target)" if self.stopped else "")]
        lines.append(f"{'model':<44} {'rate/s':>8} {'offered':>8} {'attain%':>8} {'goodput/s':>9} {'late':>6} "
                     f"{'dropped':>8} {'invalid%':>8} {'p50 ms':>8} {'p99 ms':>8}")
        for m in self.models:
            lines.append(f"{m.model[:44]:<44} {m.rate_rps:8.1f} {m.offered:8d} {100 * m.attainment:8.2f} "
                         f"{m.goodput_rps:9.1f} {m.late:6d} {sum(m.drops.values()):8d} "
                         f"{100 * m.invalid_rate:8.2f} {m.p50_ms:8.2f} {m.p99_ms:8.2f}")
        for ap in self.apps:
            drops = ", ".join(f"{k} {v}" for k, v in sorted(ap.dropped.items())) or "none"
            lines.append(f"app {ap.app}: {ap.queries} queries, {100 * ap.attainment:.2f}% in SLO, goodput "
                         f"{ap.goodput_qps:.1f}/s, late {ap.late}, dropped {sum(ap.dropped.values())} ({drops}), "
                         f"invalid GPU {100 * ap.invalid_rate:.2f}%, p99 {ap.p99_ms:.2f} ms")
        for name, ms in self.classes.items():
            off = sum(m.offered for m in ms)
            lines.append(f"class {name}: {off} requests, worst model attainment "
                         f"{100 * self.class_min_attainment(name):.2f}%, dropped "
                         f"{sum(sum(m.drops.values()) for m in ms)}, late {sum(m.late for m in ms)}")
        util = "  ".join(f"{g} {100 * u:.1f}%" for g, u in self.utilization.items())
        c = self.counters
        ppd = c["probes"] / c["dispatches"] if c["dispatches"] else 0.0
        lines.append(f"utilization: {util}")
        lines.append(f"decisions {c['decisions']}  dispatches {c['dispatches']}  probes/dispatch {ppd:.2f}")
        if self.speed:
            s = self.speed
            per = s["wall_us_per_decision"]
            per = f"{per:.2f} µs" if math.isfinite(per) else "n/a"
            lines.append(f"sim wall {s['wall_s']:.3f} s  {s['requests_per_wall_s']:,.0f} simulated requests/s  "
                         f"{per} wall per decision (whole loop)")
        return "\n".join(lines)


def model_results(names: list[str], rates: np.ndarray, arr_t: np.ndarray, arr_m: np.ndarray,
                  slo_us: np.ndarray, r_state: np.ndarray, r_end: np.ndarray, r_gpu: np.ndarray | None = None,
                  duration_s: float = 0.0, subset: np.ndarray | None = None,
                  deadline_us: np.ndarray | None = None, wasted: np.ndarray | None = None) -> list[ModelResult]:
    """Per-model attainment, goodput, lateness, drops by reason, invalid rate and latency
    percentiles. The invalid rate is the share of the model's GPU time spent on requests that
    ended late or were dropped after a batch had started on them (``r_gpu``: GPU µs per
    request). ``subset`` (a mask over requests) restricts it to some, e.g. a priority class;
    ``deadline_us`` (per request) replaces arrival + SLO (app stages are late against their
    query's deadline; ``wasted``, a mask over requests, marks those whose query failed or was
    late, whose GPU time is invalid even if they were on time, as the daemon counts it).
    Withdrawn app stages count as dropped ("query-failed")."""
    out = []
    for m, name in enumerate(names):
        sel = arr_m == m if subset is None else (arr_m == m) & subset
        st = r_state[sel]
        done = st == R_SERVED
        lat = r_end[sel][done] - arr_t[sel][done]
        if deadline_us is None:
            is_late = lat > slo_us[m] + LATE_EPS_US
        else:
            is_late = r_end[sel][done] > deadline_us[sel][done] + LATE_EPS_US
        late = int(np.count_nonzero(is_late))
        drops = {why: int(np.count_nonzero(st == R_SERVED + code)) for code, why in sorted(DROP_REASONS.items())}
        n_cancel = int(np.count_nonzero(st == R_CANCELLED))
        if n_cancel:
            drops["query-failed"] = n_cancel
        p50, p99 = (np.percentile(lat, [50, 99]) / 1e3) if len(lat) else (np.nan, np.nan)
        served = int(done.sum()) - late
        invalid = 0.0
        if r_gpu is not None:
            g = r_gpu[sel]
            ok = np.zeros(len(st), dtype=bool)
            ok[np.flatnonzero(done)[~is_late]] = True
            if wasted is not None:
                ok &= ~wasted[sel]
            total = float(g.sum())
            invalid = float(g[~ok].sum()) / total if total > 0 else 0.0
        out.append(ModelResult(name, int(sel.sum()), float(rates[m]), served, late, drops,
                               int(np.count_nonzero(st == R_PENDING)), float(p50), float(p99),
                               served / duration_s if duration_s > 0 else 0.0, invalid))
    return out


def utilization(gpu_types: list[str], v_gpu_type: np.ndarray, busy_us: np.ndarray,
                duration_us: float) -> dict[str, float]:
    """Temporal utilization per GPU type: inference busy time / (vGPUs of the type x duration).
    The busy time is all the run's, past the arrival window too, as goodput counts every request
    that arrived in it: both measure the window's requests, so an overloaded run may pass 1."""
    out = {}
    for t, name in enumerate(gpu_types):
        sel = v_gpu_type == t
        n = int(sel.sum())
        if n:
            out[name] = float(busy_us[sel].sum() / (n * duration_us)) if duration_us > 0 else 0.0
    return out
