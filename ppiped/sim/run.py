"""Python entry of the simulator: :func:`simulate` and the load-factor helpers the sweeps use.

:class:`Simulation` owns the loop's arrays and the :class:`~ppiped.core.scheduler.Scheduler`
whose arena the compiled loop drives; when the loop returns a ``FULL_*`` status it grows the
array that ran out (the core's through the scheduler, its own here) and resumes the loop.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cluster import load_cluster
from ..core.layout import Layout
from ..core.scheduler import Policy, Scheduler
from ..plan import Plan, load_plan
from ..profiles import Profile
from . import engine as E
from .dag import DagWorkload, app_results
from .metrics import SimResult, model_results, utilization
from .sweep import Outcome
from .workload import Trace, generate

DEFAULT_SIGMA = 0.05  # lognormal log-sd of executor latency: ~5% spread around the profile


@dataclass(frozen=True)
class SimOptions:
    """Knobs of the simulated world (not of the algorithm: those are the core's ``Policy``).

    ``sigma``: log-sd of the lognormal latency jitter (median 1; 0 = exactly the profile).
    ``start_early_us``: how long before its reserved start an executor may start a batch
    (``inf``, the default, as the daemon's executors: work-conserving, and the core pulls a
    vGPU's queue forward when a batch ends early; 0: never before the reserved start).
    ``margin_quantile`` / ``margin_step``: the core's latency margins (see ``Scheduler``).
    ``gc_every_us`` / ``gc_lag_us``: the core's tables are GC'd every ``gc_every_us`` of simulated
    time, of intervals that ended ``gc_lag_us`` before (the daemon: every 100 ms heartbeat, 1 ms lag; 10 ms measured fastest here).
    ``stop_below``: stop as soon as some model's attainment can no longer reach this (sweeps
    need only pass/fail); None runs to the end.
    ``timeline_us``: record inferences starting in this window, for the Figure-12 plot.
    ``nic_fifo``: transfers share the NICs they use (a server's vGPUs share its uplink and
    downlink, as the planner and the core assume): each takes the first time at which both its
    uplink and downlink are free, a reserved transfer (ppipe) no earlier than its reserved slot,
    like an inference, a reactive one as soon as its batch is dispatched. False: every transfer
    takes bytes/bandwidth from the end of the upstream inference however many share the NIC, so
    NIC contention exists only in the core's reservations, which favours the reactive baseline
    that makes none.
    ``oracle_latency``: "all": the core books every inference at the latency it will take (each
    vGPU's next jitter factor is drawn ahead and set as its margins before each decision, whatever
    they learned from reports); "first" / "later": only the inferences of the vGPUs in pipelines'
    first pools / in the pools after them; "": none. Not a policy: an upper reference for what
    better latency estimates could recover under ``sigma``, and where (``bench/figure6.py
    --oracle-latency``).
    """

    sigma: float = DEFAULT_SIGMA
    start_early_us: float = math.inf
    gc_every_us: float = 10_000.0
    gc_lag_us: float = 1000.0
    stop_below: float | None = None
    timeline_us: tuple[float, float] | None = None
    nic_fifo: bool = True
    min_wait_us: float = 1.0
    wait_guard_us: float = 0.0
    margin_quantile: float = 0.9
    margin_step: float = 0.02
    class_room: float = 0.25  # share of the SLO the low class leaves to the high class
    pressure_room: float = 0.2  # PARD: most of the SLO left unbooked under pressure (learned below it)
    room_quantile: float = 0.995  # PARD: quantile of how late paths end that the learned room covers
    noise_z: float = 0.0  # deadline checks keep this many sds of the path's latency noise
    margin_quantile_hi: float = 0.99  # the margins' quantile while a model is under pressure and overloaded
    oracle_latency: str = ""


ORACLE_STAGES = ("", "all", "first", "later")


class Simulation:
    """One run: a scheduler for ``plan``, a trace, and the compiled loop's state."""

    def __init__(self, plan: Plan, profiles: dict[str, Profile], trace: Trace | None, policy: str | Policy = "ppipe",
                 seed: int = 0, duration_s: float | None = None, options: SimOptions | None = None,
                 layout: Layout | None = None, dag: DagWorkload | None = None):
        opt = options or SimOptions()
        if opt.sigma < 0:
            raise ValueError(f"jitter sigma must be >= 0, got {opt.sigma}")
        self.plan, self.options, self.seed = plan, opt, int(seed)
        self.sched = Scheduler(plan, profiles, policy, layout, min_wait_us=opt.min_wait_us,
                               wait_guard_us=opt.wait_guard_us, margin_quantile=opt.margin_quantile,
                               margin_quantile_hi=max(opt.margin_quantile, opt.margin_quantile_hi),
                               margin_step=opt.margin_step, class_room=opt.class_room,
                               pressure_room=opt.pressure_room, noise_z=opt.noise_z,
                               room_quantile=opt.room_quantile,
                               work_conserving=math.isinf(opt.start_early_us))
        lay = self.layout = self.sched.layout
        M = len(lay.models)
        self.slo = np.ascontiguousarray(lay.slo_us, dtype=np.float64)
        if dag is None:
            t = np.ascontiguousarray(trace.times_us, dtype=np.float64)
            m = np.ascontiguousarray(trace.model, dtype=np.int64)
            p = (np.ascontiguousarray(trace.priority, dtype=np.int64) if trace.priority is not None
                 else np.zeros(len(t), dtype=np.int64))
            if len(m) and (m.min() < 0 or m.max() >= M):
                raise ValueError(f"trace names model {int(m.max())} but the plan has {M} models")
            if len(p) != len(t):
                raise ValueError(f"trace has {len(t)} arrivals and {len(p)} priorities")
            dag = DagWorkload.plain(t, m, p, self.slo, M)
        self.dag = dag
        t, m = dag.times_us.copy(), np.ascontiguousarray(dag.model, dtype=np.int64)
        if dag.n_roots > 1 and np.any(np.diff(t[:dag.n_roots]) < 0):
            raise ValueError("trace arrival times must be sorted")
        self.arr_t, self.arr_m, self.arr_p = t, m, np.ascontiguousarray(dag.priority, dtype=np.int64)
        roots = t[:dag.n_roots]
        self.duration_s = (float(duration_s) if duration_s is not None
                           else (float(roots[-1]) / 1e6 if len(roots) else 0.0))
        self.offered = np.bincount(m[:dag.n_roots], minlength=M)
        if opt.stop_below is None:
            self.miss_allow = np.full(M, -1, dtype=np.int64)
        else:
            self.miss_allow = np.floor(self.offered * (1.0 - opt.stop_below) + 1e-9).astype(np.int64)
        Kd = int(max(lay.pipe_npools, default=1))
        B = lay.max_batch
        V = lay.num_vgpus
        N = len(t)
        si = self.si = np.zeros(E.I_SIZE, dtype=np.int64)
        sf = self.sf = np.zeros(E.G_SIZE, dtype=np.float64)
        si[E.I_FRESH] = 1
        si[E.I_REACTIVE] = 0 if self.sched.policy.reserve else 1
        si[E.I_SEED] = np.array([E.mix64(np.uint64(self.seed & (2**64 - 1)))], dtype=np.uint64).view(np.int64)[0]
        si[E.I_K] = Kd
        si[E.I_NIC] = int(opt.nic_fifo)
        if opt.oracle_latency not in ORACLE_STAGES:
            raise ValueError(f"oracle_latency must be one of {ORACLE_STAGES}, got {opt.oracle_latency!r}")
        si[E.I_ORACLE] = int(bool(opt.oracle_latency))
        # oracle latency: each vGPU's first factor, from a stream of its own (counters 2^40 + v);
        # NaN where the oracle leaves the vGPU to its learned margins
        stage = np.asarray(lay.pool_stage)[np.asarray(lay.v_pool)]
        on = {"": stage < 0, "all": stage >= 0, "first": stage == 0, "later": stage > 0}[opt.oracle_latency]
        self.v_fac = np.array([E.jitter(si[E.I_SEED], (1 << 40) + v, opt.sigma) if on[v] else math.nan
                               for v in range(V)])
        si[E.I_NROOT] = dag.n_roots
        si[E.I_STOP_LATE] = int(dag.stop_late)
        self.dq_i = dag.dq_i.copy()  # the loop moves a spawn's progress into it
        self.q_fail = np.zeros(len(dag.q_root), dtype=np.int64)
        self.rest_tmp = np.zeros(M)
        sf[E.G_WAKE] = math.inf
        sf[E.G_NEXT_GC] = opt.gc_every_us if opt.gc_every_us > 0 else math.inf
        sf[E.G_GC_EVERY] = opt.gc_every_us
        sf[E.G_GC_LAG] = opt.gc_lag_us
        sf[E.G_SIGMA] = opt.sigma
        sf[E.G_EARLY] = opt.start_early_us
        sf[E.G_DURATION] = self.duration_s * 1e6
        lo, hi = opt.timeline_us if opt.timeline_us is not None else (0.0, 0.0)
        sf[E.G_TL_LO], sf[E.G_TL_HI] = lo, hi
        self.lat = np.ascontiguousarray(lay.lat)
        self.tin = np.ascontiguousarray(lay.tin)
        self.v_pool = np.ascontiguousarray(lay.v_pool, dtype=np.int64)
        self.v_server = np.ascontiguousarray(lay.v_server, dtype=np.int64)
        self.nic_s = np.zeros((2 * max(1, lay.num_servers), 32))
        self.nic_e = np.zeros((2 * max(1, lay.num_servers), 32))
        self.nic_n = np.zeros(2 * max(1, lay.num_servers), dtype=np.int64)
        self.nic_busy = np.zeros(2 * max(1, lay.num_servers))
        # events: one end or timer per vGPU plus transfers in flight; grown on demand
        self.et = np.zeros(2 * V + 64)
        self.es = np.zeros(2 * V + 64, dtype=np.int64)
        self.ex = np.zeros(2 * V + 64, dtype=np.int64)
        self._alloc_batches(4 * V + 64, Kd, B)
        self.v_head = np.full(V, -1, dtype=np.int64)
        self.v_run = np.full(V, -1, dtype=np.int64)
        self.v_timer = np.full(V, math.inf)
        self.v_busy = np.zeros(V)
        self.r_state = np.zeros(N, dtype=np.int64)
        self.r_end = np.full(N, np.nan)
        self.r_gpu = np.zeros(N)  # GPU µs spent on each request (its share of every batch it rode)
        self.miss = np.zeros(M, dtype=np.int64)
        self.rb_h = np.zeros(E.RB_CAP, dtype=np.int64)
        self.rb_f = np.zeros((E.RB_CAP, 2))
        tl = 1024 if opt.timeline_us is not None else 0
        self.tl_i = np.zeros((tl, 3), dtype=np.int64)
        self.tl_f = np.zeros((tl, 2))
        self.grows: dict[str, int] = {}
        self.wall_s = 0.0

    def _alloc_batches(self, n: int, Kd: int, B: int) -> None:
        self.bi = np.zeros((n, E.BI_SIZE), dtype=np.int64)
        self.bhi = np.zeros((n, Kd, E.HI_SIZE), dtype=np.int64)
        self.bhf = np.zeros((n, Kd, E.HF_SIZE))
        self.breq = np.zeros((n, B), dtype=np.int64)
        self.j_next = np.full(n * Kd, -1, dtype=np.int64)
        self.bi[:, E.BI_NEXT] = np.arange(1, n + 1)
        self.bi[-1, E.BI_NEXT] = -1
        self.si[E.I_BFREE] = 0

    def _grow_batches(self) -> None:
        """Double the batch records; job ids (batch * K + hop) stay valid as K is unchanged."""
        old = self.bi.shape[0]
        bi, bhi, bhf, breq, jn = self.bi, self.bhi, self.bhf, self.breq, self.j_next
        Kd = bhi.shape[1]
        self._alloc_batches(2 * old, Kd, breq.shape[1])
        self.bi[:old], self.bhi[:old], self.bhf[:old], self.breq[:old] = bi, bhi, bhf, breq
        self.j_next[:old * Kd] = jn
        # the free list was empty: it is now the new records only
        self.bi[old:, E.BI_NEXT] = np.arange(old + 1, 2 * old + 1)
        self.bi[-1, E.BI_NEXT] = -1
        self.si[E.I_BFREE] = old

    def _grow(self, status: int) -> None:
        name = {E.SIM_FULL_BATCH: "batches", E.SIM_FULL_HEAP: "events", E.SIM_FULL_NIC: "nic"}.get(
            status, f"core{status}")
        self.grows[name] = self.grows.get(name, 0) + 1
        if status == E.SIM_FULL_BATCH:
            self._grow_batches()
        elif status == E.SIM_FULL_NIC:
            n = self.nic_s.shape[1]
            self.nic_s = np.concatenate([self.nic_s, np.zeros_like(self.nic_s)], axis=1)
            self.nic_e = np.concatenate([self.nic_e, np.zeros_like(self.nic_e)], axis=1)
            assert self.nic_s.shape[1] == 2 * n
        elif status == E.SIM_FULL_HEAP:
            n = self.et.shape[0]
            self.et = np.concatenate([self.et, np.zeros(n)])
            self.es = np.concatenate([self.es, np.zeros(n, dtype=np.int64)])
            self.ex = np.concatenate([self.ex, np.zeros(n, dtype=np.int64)])
        else:
            # the core's arena; Scheduler._grow is the one place that knows how to enlarge it
            self.sched._grow(status)

    def run(self) -> SimResult:
        """Run to the end (or until the miss budget is spent) and measure."""
        t0 = time.perf_counter()
        while True:
            st = E.run_loop(
                self.sched._A, self.si, self.sf, self.arr_t, self.arr_m, self.arr_p, self.slo, self.miss_allow,
                self.v_pool, self.v_server, self.lat, self.tin, self.nic_s, self.nic_e, self.nic_n, self.nic_busy, self.et, self.es,
                self.ex, self.bi, self.bhi, self.bhf, self.breq, self.j_next, self.v_head, self.v_run, self.v_timer, self.v_busy, self.r_state,
                self.r_end, self.r_gpu, self.miss, self.rb_h, self.rb_f, self.tl_i, self.tl_f,
                self.dq_i, self.dag.dq_f, self.dag.qm0, self.dag.qm, self.q_fail, self.dag.m_c0, self.dag.m_cm,
                self.dag.m_n, self.dag.m_order, self.dag.m_glue, self.dag.m_share, self.rest_tmp, self.v_fac)
            if st in (E.DONE, E.STOPPED):
                break
            self._grow(st)
        self.wall_s = time.perf_counter() - t0
        return self._result(st == E.STOPPED)

    def _result(self, stopped: bool) -> SimResult:
        lay = self.layout
        st = self.sched.stats()
        counters = {k: int(v) for k, v in st.items() if k != "arena_bytes"}
        counters.update(events=int(self.si[E.I_EVENTS]), inferences=int(self.si[E.I_USES]),
                        ended_twice=int(self.si[E.I_TWICE]), max_batches_in_flight=int(self.si[E.I_MAX_INFL]))
        spawned = np.isfinite(self.arr_t)  # app stages whose parent never finished never arrived
        offered = np.bincount(self.arr_m[spawned], minlength=len(lay.models))
        rates = offered / self.duration_s if self.duration_s > 0 else np.zeros(len(offered))
        dl = self.dag.dq_f[:, E.DF_DL]
        wasted = None
        apps = None
        if self.dag.apps:
            wasted = np.zeros(len(self.arr_t), dtype=bool)
            apps = app_results(self.dag, lay, self.arr_t, self.r_state, self.r_end, self.r_gpu, self.duration_s,
                               self.q_fail, wasted)
        models = model_results(lay.models, rates, self.arr_t, self.arr_m, self.slo, self.r_state, self.r_end,
                               self.r_gpu, self.duration_s, spawned, dl, wasted)
        util = utilization(lay.gpu_types, lay.v_gpu_type, self.v_busy, self.duration_s * 1e6)
        n = len(self.arr_t)
        dec = counters["decisions"]
        speed = {"wall_s": self.wall_s, "requests_per_wall_s": n / self.wall_s if self.wall_s > 0 else 0.0,
                 "wall_us_per_decision": 1e6 * self.wall_s / dec if dec else math.nan}
        tl = []
        n_tl = min(int(self.si[E.I_TL_N]), self.tl_i.shape[0])
        for i in range(n_tl):
            v, m, bs = (int(x) for x in self.tl_i[i])
            tl.append((_vgpu_label(lay, v), float(self.tl_f[i, 0]), float(self.tl_f[i, 1]), m, bs))
        res = SimResult(self.sched.policy.name, Path(self.plan.source).name, self.duration_s, self.seed,
                        self.options.sigma, models, util, counters, stopped, speed, tl)
        if self.arr_p.any():
            for name, sel in (("high", self.arr_p > 0), ("low", self.arr_p <= 0)):
                off = np.bincount(self.arr_m[sel], minlength=len(lay.models))
                res.classes[name] = model_results(
                    lay.models, off / self.duration_s if self.duration_s > 0 else off * 0.0, self.arr_t,
                    self.arr_m, self.slo, self.r_state, self.r_end, self.r_gpu, self.duration_s, sel, dl, wasted)
        if apps is not None:
            res.apps = apps
            res.extra["app_deadlines"] = self.dag.mode
        if self.duration_s > 0:
            nb = self.nic_busy / (self.duration_s * 1e6)
            res.extra["nic_max_utilization"] = {"uplink": float(nb[0::2].max()), "downlink": float(nb[1::2].max())}
        return res


def _vgpu_label(lay: Layout, v: int) -> str:
    p = int(lay.v_pool[v])
    return (f"{lay.pool_gpu[p]}/{int(lay.v_split[v])} g{int(lay.v_gpu[v]):03d} v{v:03d} "
            f"m{int(lay.v_model[v])}p{int(lay.pipe_index[lay.v_pipe[v]])}.{int(lay.v_stage[v])}")


def simulate(plan: Plan, profiles: dict[str, Profile], trace: Trace, policy: str | Policy = "ppipe",
             jitter: float = DEFAULT_SIGMA, seed: int = 0, *, duration_s: float | None = None,
             options: SimOptions | None = None, layout: Layout | None = None) -> SimResult:
    """Simulate ``plan`` serving ``trace`` (model indices in plan order) under ``policy``.

    ``jitter`` is the lognormal σ of executor latencies (overrides ``options.sigma``); ``seed``
    seeds the jitter stream (the trace has its own seed).
    """
    opt = options or SimOptions()
    if jitter != opt.sigma:
        opt = SimOptions(**{**opt.__dict__, "sigma": jitter})
    if opt.timeline_us is None:
        return Simulation(plan, profiles, trace, policy, seed, duration_s, opt, layout).run()
    # the timeline buffer is sized on a first pass when it overflowed (runs are deterministic)
    sim = Simulation(plan, profiles, trace, policy, seed, duration_s, opt, layout)
    res = sim.run()
    need = int(sim.si[E.I_TL_N])
    if need > sim.tl_i.shape[0]:
        sim2 = Simulation(plan, profiles, trace, policy, seed, duration_s, opt, layout)
        sim2.tl_i = np.zeros((need, 3), dtype=np.int64)
        sim2.tl_f = np.zeros((need, 2))
        res = sim2.run()
    return res


# --- load factors ------------------------------------------------------------------------


def base_rates(plan: Plan, models: Sequence[str] | None = None) -> np.ndarray:
    """Per-model request rates at load factor 1.0: the plan's throughput of each model.

    ``models`` orders them (the simulated plan's order); as in the paper, load factor 1.0 is the
    ``_v4`` (PPipe) plan's throughput, so baseline plans are loaded with the v4 plan's rates.
    """
    names = list(models) if models is not None else [m.model for m in plan.models]
    return np.array([plan.model(n).throughput_rps for n in names], dtype=np.float64)


def weight_rates(plan: Plan, total_rps: float) -> np.ndarray:
    """Split a total request rate across the plan's models in proportion to their weights."""
    w = np.array([m.weight for m in plan.models], dtype=np.float64)
    return total_rps * w / w.sum()


def v4_sibling(path: str | Path) -> Path:
    """The ``_v4`` reference plan of the same configuration as ``path`` (``_bl``, ``_dart-r``)."""
    p = Path(path)
    for algo in ("_dart-r.json", "_bl.json", "_v4.json"):
        if p.name.endswith(algo):
            return p.with_name(p.name[: -len(algo)] + "_v4.json")
    return p


def refuse_unservable(plan: Plan, path: str | Path) -> None:
    """A model with no pipelines serves nothing of its planned throughput (``ppiped check``:
    throughput-inflated); simulating it would report a plan that cannot run."""
    from ..errors import InputError

    for m in plan.models:
        if not m.pipelines:
            raise InputError(f"--plan {path}: model {m.model!r} has no pipelines, so none of its "
                             f"{m.throughput_rps:g} req/s can be served (ppiped check: throughput-inflated)")


def rates_at_one(plan_path: str | Path, plan: Plan, base_plan: str | Path | None = None,
                 cluster=None) -> np.ndarray:
    """Per-model rates (``plan``'s order) at load factor 1.0: the throughput of each model in
    ``base_plan``, by default the ``_v4`` sibling of a reference plan, else ``plan`` itself
    (``cluster``: a loaded cluster spec for reference plans)."""
    from ..errors import InputError

    base = Path(base_plan) if base_plan else v4_sibling(plan_path)
    bplan = load_plan(base, cluster) if base.is_file() and str(base) != str(plan_path) else plan
    have = {m.model for m in bplan.models}
    missing = [m.model for m in plan.models if m.model not in have]
    if missing:
        raise InputError(f"--base-plan {base}: has no model {missing[0]!r} of {Path(plan_path).name}, whose "
                         "throughput there is its load factor 1.0")
    return base_rates(bplan, [m.model for m in plan.models])


def load_factor_trace(plan: Plan, rates_at_1: np.ndarray, load_factor: float, kind: str,
                      duration_s: float, seed: int, cv: float = 2.0, trace_scale: str = "stretch") -> Trace:
    return generate(kind, list(load_factor * rates_at_1), duration_s, seed, cv, trace_scale)


def run_load_factor(plan_path: str | Path, profiles: dict[str, Profile], load_factor: float,
                    kind: str = "poisson", duration_s: float = 30.0, seed: int = 0,
                    policy: str = "ppipe", jitter: float = DEFAULT_SIGMA, cv: float = 2.0,
                    base_plan: str | Path | None = None, options: SimOptions | None = None,
                    cache: dict | None = None, trace_scale: str = "stretch", high_share: float = 0.0,
                    cluster: str | Path | None = None) -> SimResult:
    """Simulate a plan file at ``load_factor`` x the base plan's per-model throughput.

    ``base_plan`` defaults to the ``_v4`` sibling of a reference plan (else the plan itself).
    ``cache`` (a dict) keeps loaded plans and layouts across calls of one process. ``cluster``:
    a cluster spec file for reference plans (default: read from their file names).
    """
    cache = cache if cache is not None else {}
    key = f"{plan_path}\0{cluster or ''}"
    if key not in cache:
        cl = load_cluster(cluster) if cluster else None
        plan = load_plan(plan_path, cl)
        rates = rates_at_one(plan_path, plan, base_plan, cl)
        cache[key] = (plan, rates, Layout.from_plan(plan, profiles))
    plan, rates, lay = cache[key]
    trace = generate(kind, list(load_factor * rates), duration_s, seed, cv, trace_scale, high_share)
    res = simulate(plan, profiles, trace, policy, jitter, seed, duration_s=duration_s, options=options,
                   layout=lay)
    res.extra.update(load_factor=load_factor, trace=kind)
    return res


# --- sweeps ------------------------------------------------------------------------------

_PROFILES: dict[str, dict[str, Profile]] = {}
_PLANS: dict = {}
_MODELS: dict[tuple[str, str | None], list[str]] = {}


def _profiles(directory: str, plan: str, cluster: str | None) -> dict[str, Profile]:
    """The profiles of ``plan``'s models only, as ``sim`` reads them: another file in the folder
    is not this plan's concern."""
    from ..profiles import load_profiles

    if (plan, cluster) not in _MODELS:
        _MODELS[plan, cluster] = [m.model for m in load_plan(plan, load_cluster(cluster) if cluster else None).models]
    have = _PROFILES.setdefault(directory, {})
    missing = [n for n in _MODELS[plan, cluster] if n not in have]
    if missing:
        have.update(load_profiles(directory, missing))
    return have


@dataclass(frozen=True)
class PointSpec:
    """Everything one sweep point needs, picklable so that worker processes can run it.

    Calling it with a load factor runs the simulation (profiles and plans are cached per
    process) and returns the min-over-models attainment, marked incomplete for a run stopped below
    the target; :meth:`result` returns the whole :class:`SimResult`.
    """

    plan: str
    profiles: str
    trace: str = "poisson"
    duration_s: float = 30.0
    seed: int = 0
    policy: str = "ppipe"
    sigma: float = DEFAULT_SIGMA
    cv: float = 2.0
    start_early_us: float = math.inf
    base_plan: str | None = None
    stop_below: float | None = None
    nic_fifo: bool = True
    trace_scale: str = "stretch"  # trace files: stretch or fold (see workload.azure_functions)
    high_share: float = 0.0  # share of requests in the high priority class
    cluster: str | None = None  # cluster spec for reference plans (default: from their names)
    margin_quantile: float = 0.9
    noise_z: float = 0.0
    oracle_latency: str = ""  # see SimOptions

    def sim_options(self, stop: bool = True, timeline_us: tuple[float, float] | None = None) -> SimOptions:
        """The options of one run: the fields above, the early stop only when ``stop``."""
        return SimOptions(sigma=self.sigma, start_early_us=self.start_early_us,
                          stop_below=self.stop_below if stop else None, timeline_us=timeline_us,
                          nic_fifo=self.nic_fifo, margin_quantile=self.margin_quantile, noise_z=self.noise_z,
                          oracle_latency=self.oracle_latency)

    def result(self, load_factor: float, stop: bool = True, timeline_us: tuple[float, float] | None = None
               ) -> SimResult:
        opt = self.sim_options(stop, timeline_us)
        profiles = _profiles(self.profiles, self.plan, self.cluster)
        return run_load_factor(self.plan, profiles, load_factor, self.trace, self.duration_s,
                               self.seed, self.policy, self.sigma, self.cv, self.base_plan, opt, _PLANS,
                               self.trace_scale, self.high_share, self.cluster)

    def __call__(self, load_factor: float) -> Outcome:
        res = self.result(load_factor)
        return Outcome(res.min_attainment, not res.stopped)
