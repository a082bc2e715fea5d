"""App queries in the simulator: the workload (roots, fan-outs drawn up front) and what it measures.

A query's root request arrives with the trace; when a request of a stage is served, its children
(a Poisson number per child stage, mean = the stage's fan-out, drawn when the workload is built so
that every policy sees the same queries) arrive one glue step later. Each request is scheduled by
the compiled core against the deadline its mode gives (:func:`ppiped.query.app.stage_deadline_us`:
``split``, ``e2e`` with the core's live estimate of the downstream stages, or ``chain``) and is
late against its query's deadline. A query is served when every request it spawned ended by the
query's deadline; it failed at the first drop (its queued requests are then withdrawn, except
when a client chains stages by hand) or when a request ended late.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.layout import Layout
from ..errors import InputError
from ..plan import Plan
from ..query.app import MODES, App, planned_yield, stage_deadline_us
from . import engine as E
from .workload import generate

if TYPE_CHECKING:
    from .run import SimOptions


@dataclass
class DagWorkload:
    """The loop's per-request arrays for a run with queries (engine ``DQ_*`` / ``DF_*``) and the
    per-model tables of its downstream estimate. Requests ``0 .. n_roots-1`` arrive with the
    trace (sorted); the others are app stages, their arrival set when spawned."""

    times_us: np.ndarray
    model: np.ndarray
    priority: np.ndarray
    n_roots: int
    dq_i: np.ndarray
    dq_f: np.ndarray
    qm0: np.ndarray  # [Q+1] members of query q are qm[qm0[q]:qm0[q+1]]
    qm: np.ndarray
    q_root: np.ndarray  # [Q] root request of each query
    q_app: np.ndarray  # [Q] app index
    m_c0: np.ndarray  # [M+1] child models of model m: m_cm[m_c0[m]:m_c0[m+1]]
    m_cm: np.ndarray
    m_n: np.ndarray  # [M] requests a parent request yields, rounded up (the estimate's batch)
    m_order: np.ndarray  # models, children before parents
    m_glue: np.ndarray  # [M] glue µs before a request of this model arrives
    m_share: np.ndarray  # [M] the stage's planned budget / its app's SLO (0: no split, or no app)
    stop_late: bool
    apps: list[App] = field(default_factory=list)
    mode: str = "e2e"

    @classmethod
    def plain(cls, times_us: np.ndarray, model: np.ndarray, priority: np.ndarray, slo_us: np.ndarray,
              num_models: int) -> DagWorkload:
        """No queries: every request is scheduled and late against arrival + its model's SLO."""
        n = len(times_us)
        dq_i = np.zeros((n, E.DQ_SIZE), dtype=np.int64)
        dq_i[:, E.DQ_QUERY] = -1
        dq_f = np.empty((n, E.DF_SIZE))
        dq_f[:, E.DF_DL] = times_us + slo_us[model] if n else 0.0
        dq_f[:, E.DF_DC] = dq_f[:, E.DF_DL]
        return cls(times_us, model, priority, n, dq_i, dq_f, np.zeros(1, dtype=np.int64),
                   np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                   np.zeros(num_models + 1, dtype=np.int64), np.zeros(0, dtype=np.int64),
                   np.ones(num_models, dtype=np.int64), np.arange(num_models, dtype=np.int64),
                   np.zeros(num_models), np.zeros(num_models), True)


def app_workload(plan: Plan, layout: Layout, app_rates: Mapping[str, float], duration_s: float,
                 seed: int, mode: str = "e2e", kind: str = "poisson", cv: float = 2.0,
                 plain_rates: Mapping[str, float] | None = None, trace_scale: str = "stretch") -> DagWorkload:
    """Queries of ``plan.apps`` at ``app_rates`` (queries/s per app name) and plain requests at
    ``plain_rates`` (per model name), arrivals of ``kind`` (a trace file replayed per
    ``trace_scale``), deadlines by ``mode``."""
    if mode not in MODES:
        raise InputError(f"unknown deadline mode {mode!r} (choose from {', '.join(MODES)})")
    apps = {a.name: a for a in plan.apps}
    for name in app_rates:
        if name not in apps:
            raise InputError(f"the plan has no app {name!r} (apps: {', '.join(apps) or 'none'})")
    midx = {m: i for i, m in enumerate(layout.models)}
    M = len(layout.models)
    app_list = [apps[n] for n in app_rates]
    for a in app_list:
        if not a.split_done and mode != "e2e":
            raise InputError(f"app {a.name!r} has no SLO split; mode {mode!r} needs one")
    # roots: one stream per app (the root stage's model) and per plain model
    streams: list[tuple[int, int]] = []  # (app index or -1, model)
    rates = []
    for ai, a in enumerate(app_list):
        streams.append((ai, midx[a.stages[0].model]))
        rates.append(float(app_rates[a.name]))
    for name, r in (plain_rates or {}).items():
        if name not in midx:
            raise InputError(f"the plan has no model {name!r}")
        streams.append((-1, midx[name]))
        rates.append(float(r))
    tr = generate(kind, rates, duration_s, seed, cv, trace_scale)
    n_roots = len(tr)
    rng = np.random.default_rng([seed, 0xDA6])
    stream = np.asarray(tr.model, dtype=np.int64)
    t_root = np.asarray(tr.times_us, dtype=np.float64)
    slo = layout.slo_us
    # breadth first per query: children of a request are contiguous
    model = [int(streams[s][1]) for s in stream]
    stage = [0] * n_roots
    query = [-1] * n_roots
    c0 = [0] * n_roots
    nc = [0] * n_roots
    q_root, q_app = [], []
    for r in range(n_roots):
        if streams[stream[r]][0] >= 0:
            query[r] = len(q_root)
            q_root.append(r)
            q_app.append(streams[stream[r]][0])
    members: list[list[int]] = [[r] for r in q_root]
    i = 0
    while i < len(model):
        q = query[i]
        if q >= 0:
            a = app_list[q_app[q]]
            c0[i] = len(model)
            for cs in a.children(stage[i]):
                k = int(rng.poisson(a.stages[cs].fanout))
                for _ in range(k):
                    model.append(midx[a.stages[cs].model])
                    stage.append(cs)
                    query.append(q)
                    c0.append(0)
                    nc.append(0)
                    members[q].append(len(model) - 1)
            nc[i] = len(model) - c0[i]
        i += 1
    n = len(model)
    times = np.full(n, math.inf)
    times[:n_roots] = t_root
    dq_i = np.zeros((n, E.DQ_SIZE), dtype=np.int64)
    dq_i[:, E.DQ_C0] = c0
    dq_i[:, E.DQ_NC] = nc
    dq_i[:, E.DQ_QUERY] = query
    dq_f = np.zeros((n, E.DF_SIZE))
    marr = np.asarray(model, dtype=np.int64)
    for r in range(n):
        q = query[r]
        if q < 0:
            dq_f[r, E.DF_DL] = dq_f[r, E.DF_DC] = t_root[r] + slo[marr[r]]
            continue
        a = app_list[q_app[q]]
        qa = t_root[q_root[q]]
        qd = qa + a.slo_us
        dq_f[r, E.DF_DL] = qd
        if mode == "e2e":  # DF_DC: the planned rest, the floor of the live estimate
            dq_i[r, E.DQ_MODE] = E.DM_E2E
            dq_f[r, E.DF_DC] = qd - stage_deadline_us(a, stage[r], "e2e", qa, qd, qa)
        elif mode == "split":
            dq_f[r, E.DF_DC] = stage_deadline_us(a, stage[r], "split", qa, qd, qa)
        elif r < n_roots:
            dq_f[r, E.DF_DC] = stage_deadline_us(a, 0, "chain", qa, qd, qa)
        else:
            dq_i[r, E.DQ_MODE] = E.DM_REL
            dq_f[r, E.DF_DC] = a.stages[stage[r]].budget_us
    qm0 = np.zeros(len(q_root) + 1, dtype=np.int64)
    qm0[1:] = np.cumsum([len(x) for x in members])
    qm = np.asarray([j for x in members for j in x], dtype=np.int64)
    # per-model tables of the downstream estimate
    kids: list[list[int]] = [[] for _ in range(M)]
    m_n = np.ones(M, dtype=np.int64)
    m_glue = np.zeros(M)
    m_share = np.zeros(M)
    depth = np.zeros(M, dtype=np.int64)
    for a in app_list:
        for si, s in enumerate(a.stages):
            m = midx[s.model]
            depth[m] = len(a.path(si))
            if s.parent >= 0:
                kids[midx[a.stages[s.parent].model]].append(m)
                m_n[m] = planned_yield(s.fanout)
                m_glue[m] = a.glue_us
            if a.split_done:
                m_share[m] = s.budget_us / a.slo_us
    m_c0 = np.zeros(M + 1, dtype=np.int64)
    m_c0[1:] = np.cumsum([len(k) for k in kids])
    m_cm = np.asarray([c for k in kids for c in k], dtype=np.int64)
    m_order = np.argsort(-depth, kind="stable").astype(np.int64)
    pr = np.zeros(n, dtype=np.int64)
    return DagWorkload(times, marr, pr, n_roots, dq_i, dq_f, qm0, qm, np.asarray(q_root, dtype=np.int64),
                       np.asarray(q_app, dtype=np.int64), m_c0, m_cm, m_n, m_order, m_glue, m_share,
                       mode != "chain", app_list, mode)


@dataclass
class AppResult:
    app: str
    queries: int
    ok: int  # every request of the query served by its deadline
    late: int
    dropped: dict[str, int]  # "stage:reason" -> queries
    goodput_qps: float
    invalid_rate: float  # GPU time of the app's requests whose query failed / all of its GPU time
    gpu_s: float
    requests: int  # stage requests spawned
    p50_ms: float
    p99_ms: float

    @property
    def drop_rate(self) -> float:
        return sum(self.dropped.values()) / self.queries if self.queries else 0.0

    @property
    def attainment(self) -> float:
        return self.ok / self.queries if self.queries else 1.0

    def to_json(self) -> dict[str, Any]:
        return {"app": self.app, "queries": self.queries, "ok": self.ok, "late": self.late,
                "dropped": self.dropped, "attainment": self.attainment, "goodput_qps": self.goodput_qps,
                "drop_rate": self.drop_rate, "invalid_rate": self.invalid_rate, "gpu_s": self.gpu_s,
                "requests": self.requests, "p50_ms": self.p50_ms, "p99_ms": self.p99_ms}


def app_results(w: DagWorkload, layout: Layout, arr_t: np.ndarray, r_state: np.ndarray, r_end: np.ndarray,
                r_gpu: np.ndarray, duration_s: float, q_fail: np.ndarray | None = None,
                wasted: np.ndarray | None = None) -> list[AppResult]:
    """Per app: each query's outcome from its requests' ends (see the module docstring);
    ``arr_t`` as the loop left it (spawned stages have their arrival, the others inf).
    ``wasted`` (a mask over requests), when given, is set where a request's query failed or
    ended late: its GPU time was for nothing, which its model counts as invalid too."""
    from ..core.scheduler import DROP_REASONS

    out = []
    for ai, a in enumerate(w.apps):
        qs = np.flatnonzero(w.q_app == ai)
        ok = late = 0
        dropped: dict[str, int] = {}
        lat = []
        bad_gpu = all_gpu = 0.0
        spawned = 0
        for q in qs:
            mem = w.qm[w.qm0[q]:w.qm0[q + 1]]
            live = mem[np.isfinite(arr_t[mem])]
            spawned += len(live)
            st = r_state[live]
            g = float(r_gpu[mem].sum())
            all_gpu += g
            fail = st[(st != E.R_SERVED) & (st != E.R_PENDING) & (st != E.R_CANCELLED)]
            if len(fail):
                # the first failed request in breadth-first order names the stage
                first = live[np.argmax((st != E.R_SERVED) & (st != E.R_PENDING) & (st != E.R_CANCELLED))]
                why = DROP_REASONS.get(int(r_state[first]) - E.R_SERVED, "dropped")
                stg = a.stages[a.stage_of(layout.models[int(w.model[first])])].name
                key = f"{stg}:{why}"
                dropped[key] = dropped.get(key, 0) + 1
                bad_gpu += g
                if wasted is not None:
                    wasted[mem] = True
                continue
            if q_fail is not None and q_fail[q] == E.Q_FAIL_SPAWN:
                # dropped before its next stage: the first request never spawned names it
                first = mem[np.argmax(~np.isfinite(arr_t[mem]))]
                stg = a.stages[a.stage_of(layout.models[int(w.model[first])])].name
                key = f"{stg}:early-drop"
                dropped[key] = dropped.get(key, 0) + 1
                bad_gpu += g
                if wasted is not None:
                    wasted[mem] = True
                continue
            if np.any(st != E.R_SERVED) or len(live) < len(mem):
                # children never spawned (a parent ended late) or still pending at the end
                late += 1
                bad_gpu += g
                if wasted is not None:
                    wasted[mem] = True
                continue
            end = float(r_end[live].max())
            dl = float(w.dq_f[live[0], E.DF_DL])
            if end > dl + E.LATE_EPS_US:
                late += 1
                bad_gpu += g
                if wasted is not None:
                    wasted[mem] = True
            else:
                ok += 1
            lat.append(end - arr_t[w.q_root[q]])
        p50, p99 = (np.percentile(lat, [50, 99]) / 1e3) if lat else (math.nan, math.nan)
        out.append(AppResult(a.name, len(qs), ok, late, dropped,
                             ok / duration_s if duration_s > 0 else 0.0,
                             bad_gpu / all_gpu if all_gpu > 0 else 0.0, all_gpu / 1e6, spawned,
                             float(p50), float(p99)))
    return out


# the three systems of the comparison: deadline mode and the policy that goes with it
SYSTEMS = {
    "split": ("split", "ppipe-early-drop"),  # Nexus: per-stage SLO split, early drop per stage
    "e2e": ("e2e", "pard"),  # PARD: one end-to-end budget, proactive drop on the whole path
    "chain": ("chain", "ppipe"),  # a client chaining per-stage submissions by hand
    # PARD's end-to-end deadlines and whole-path check before a stage's children arrive, with
    # PPipe's batching inside each model (which shrinks a batch rather than drop within a stage)
    "e2e-ppipe": ("e2e", "ppipe"),
}


def default_policy(mode: str) -> str:
    """The policy of the system named after deadline ``mode`` (``e2e``: PARD's ``pard``), looked up
    by name: several systems share a mode."""
    if mode not in MODES:
        raise InputError(f"unknown deadline mode {mode!r} (choose from {', '.join(MODES)})")
    return SYSTEMS[mode][1]


def app_capacity_qps(plan: Plan, app: App) -> float:
    """Queries/s the plan serves of ``app``: its slowest stage's throughput over its rate factor."""
    return min(plan.model(s.model).throughput_rps / app.rate_factor(i) for i, s in enumerate(app.stages))


def simulate_apps(plan: Plan, profiles: Mapping[str, Any], load_factor: float, mode: str = "e2e",
                  policy: str | None = None, duration_s: float = 20.0, seed: int = 0, sigma: float | None = None,
                  kind: str = "poisson", cv: float = 2.0, layout: Layout | None = None,
                  options: SimOptions | None = None, trace_scale: str = "stretch"):
    """Every app of ``plan`` at ``load_factor`` × its planned query rate, plain models at theirs
    (as :func:`ppiped.sim.run.run_load_factor` loads them); deadlines by ``mode``, ``policy``
    by default the mode's (:data:`SYSTEMS`). ``options`` (a ``SimOptions``) sets the simulated
    world as for :func:`ppiped.sim.run.simulate`; ``sigma``, when given, overrides its jitter."""
    from .run import SimOptions, Simulation

    opt = options or SimOptions()
    if sigma is not None:
        opt = replace(opt, sigma=sigma)

    if not plan.apps:
        raise InputError(f"{plan.source}: the plan has no apps")
    lay = layout if layout is not None else Layout.from_plan(plan, dict(profiles))
    staged = {s.model for a in plan.apps for s in a.stages}
    w = app_workload(plan, lay, {a.name: load_factor * app_capacity_qps(plan, a) for a in plan.apps},
                     duration_s, seed, mode, kind, cv,
                     {m.model: load_factor * m.throughput_rps for m in plan.models if m.model not in staged},
                     trace_scale)
    pol = policy or default_policy(mode)
    sim = Simulation(plan, dict(profiles), None, pol, seed, duration_s, opt, lay, dag=w)
    res = sim.run()
    res.extra.update(load_factor=load_factor, trace=kind)
    return res
