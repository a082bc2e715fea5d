"""The Python face of the compiled data plane: one Scheduler per plan in force."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from ..kernels import sched as K
from ..kernels import state as S
from ..plan import Plan
from ..profiles import Profile
from .layout import Layout


@dataclass(frozen=True)
class Policy:
    """A data-plane policy: knobs of the one compiled algorithm, not a separate copy of it.

    ``reserve``: PPipe's reservation-based batching (True) or per-pool reactive batching (False).
    ``early_drop``: Nexus-style; keep the planned batch size and drop the requests it cannot
    serve in time instead of shrinking the batch (reserve policies only).
    ``take``: which end of the deadline DEPQ a batch is taken from; only ``"min"`` (earliest
    deadline first) is a fixed choice.
    ``pard``: PARD's proactive dropping on the whole path's estimate when a full batch cannot
    meet the oldest deadline under load, and high-budget-first (the DEPQ's max end) for the
    model's SLO after each such drop while its arrivals run over the planned rate (delayed
    transition back to earliest-deadline-first; in bursts within the plan, EDF throughout); not
    at an app's later stages (``Scheduler(pard_exempt=...)``, by default every stage with a
    parent), whose requests' queries already spent GPU time upstream.
    """

    name: str
    reserve: bool = True
    early_drop: bool = False
    take: str = "min"
    pard: bool = False


POLICIES = {
    "ppipe": Policy("ppipe"),
    "reactive": Policy("reactive", reserve=False),
    "ppipe-early-drop": Policy("ppipe-early-drop", early_drop=True),
    "pard": Policy("pard", pard=True),
}

# Longest a batch may be held for company (min_wait_us) or the wake-up guard: 10 s.
MAX_WAIT_US = 1e7
DROP_REASONS = {S.DROP_DEADLINE: "deadline", S.DROP_NO_CAPACITY: "no-capacity", S.DROP_EARLY: "early-drop"}
KINDS = {S.KIND_INFER: "infer", S.KIND_UPLINK: "uplink", S.KIND_DOWNLINK: "downlink", S.KIND_CLAIM: "claim"}


@dataclass(frozen=True)
class Reservation:
    handle: int
    resource: int
    kind: str  # infer | uplink | downlink | claim (reactive: vGPU held until reported)
    hop: int  # partition index the reservation serves
    vgpu: int  # the vGPU running that partition (for transfers: the receiving one)
    start_us: float
    end_us: float


@dataclass(frozen=True)
class Dispatch:
    model: int
    pipeline: int  # dense pipeline id (Layout.pipe_model / pipe_index map it back to the plan)
    stage: int  # first partition index this dispatch covers
    path: tuple[int, ...]  # vGPU per covered partition
    final: bool  # covers the last partition: its requests have left the scheduler
    request_ids: tuple[int, ...]
    sources: tuple[int, ...]  # per request, the vGPU holding its input (-1: the client)
    finish_us: float  # expected end of the last covered partition
    reservations: tuple[Reservation, ...]


class Actions:
    """What one :meth:`Scheduler.decide` call decided, as arrays (fast) or objects (convenient).

    The arrays are views into the scheduler's arena, longer than needed and valid until its next
    ``decide`` call. Dispatch ``i < n_dispatch`` has fields ``model[i]``, ``pipeline[i]``,
    ``stage[i]``, ``n_hops[i]``, ``final[i]``, ``bs[i]``, ``finish_us[i]``; its vGPUs are
    ``path[i, :n_hops[i]]``; its requests ``req_id[j]`` / ``req_src[j]`` for ``j`` in
    ``req_start[i] .. req_start[i] + bs[i] - 1``; its reservations ``handle[j]``, ``resource[j]``,
    ``kind[j]`` (0 infer, 1 uplink, 2 downlink, 3 claim), ``hop[j]``, ``vgpu[j]``,
    ``start_us[j]``, ``end_us[j]`` for ``j`` in ``res_start[i] .. + n_res_of[i] - 1``. Drops:
    ``drop_id[k]``, ``drop_reason[k]`` (1 deadline, 2 no-capacity, 3 early-drop), ``k < n_drop``.
    ``wake_at`` is when to call ``decide`` again if nothing else happens first (inf: never).
    """

    __slots__ = ("n_dispatch", "n_drop", "wake_at", "_s")

    def __init__(self, sched: Scheduler):
        self._s = sched
        self.n_dispatch = self.n_drop = 0
        self.wake_at = float("inf")

    @property
    def n_res(self) -> int:
        """Reservations in this call's dispatches."""
        return int(self._s._A[S.H_OUT_NR])

    @property
    def n_req(self) -> int:
        """Requests in this call's dispatches."""
        return int(self._s._A[S.H_OUT_NQ])

    @property
    def probes(self) -> int:
        """probe() calls this decision made."""
        return int(self._s._A[S.H_CALL_PROBES])

    def __getattr__(self, name: str) -> np.ndarray:
        # dispatch fields: model pipeline stage n_hops final bs finish_us req_start res_start
        # n_res_of path; reservations: handle resource kind hop vgpu start_us end_us;
        # requests: req_id req_src; drops: drop_id drop_reason
        sec = _ACTION_FIELDS.get(name)
        if sec is None:
            raise AttributeError(name)
        return self._s._arena.view(sec)

    def dispatches(self) -> list[Dispatch]:
        a = self._s._arena
        v = {k: a.view(s) for k, s in _ACTION_FIELDS.items()}
        out = []
        for i in range(self.n_dispatch):
            q0, r0 = int(v["req_start"][i]), int(v["res_start"][i])
            bs, nr, nh = int(v["bs"][i]), int(v["n_res_of"][i]), int(v["n_hops"][i])
            res = tuple(
                Reservation(int(v["handle"][j]), int(v["resource"][j]), KINDS[int(v["kind"][j])],
                            int(v["hop"][j]), int(v["vgpu"][j]), float(v["start_us"][j]), float(v["end_us"][j]))
                for j in range(r0, r0 + nr))
            out.append(Dispatch(
                int(v["model"][i]), int(v["pipeline"][i]), int(v["stage"][i]),
                tuple(int(x) for x in v["path"][i, :nh]), bool(v["final"][i]),
                tuple(int(x) for x in v["req_id"][q0:q0 + bs]),
                tuple(int(x) for x in v["req_src"][q0:q0 + bs]),
                float(v["finish_us"][i]), res))
        return out

    def drops(self) -> list[tuple[int, str]]:
        ids = self.drop_id
        why = self.drop_reason
        return [(int(ids[i]), DROP_REASONS[int(why[i])]) for i in range(self.n_drop)]


_ACTION_FIELDS = {
    "model": "od_model", "pipeline": "od_pipe", "stage": "od_stage", "n_hops": "od_nhops",
    "final": "od_final", "bs": "od_bs", "finish_us": "od_finish", "req_start": "od_req0",
    "res_start": "od_res0", "n_res_of": "od_nres", "path": "od_path",
    "handle": "or_handle", "resource": "or_res", "kind": "or_kind", "hop": "or_hop",
    "vgpu": "or_vgpu", "start_us": "or_start", "end_us": "or_end",
    "req_id": "oq_rid", "req_src": "oq_src", "drop_id": "ox_rid", "drop_reason": "ox_reason",
}


class Scheduler:
    """Scheduler state for one plan: reservation tables, deadline queues, the batching decision.

    See the package docstring (:mod:`ppiped.core`) for the contract the simulator and the daemon
    rely on.
    """

    def __init__(self, plan: Plan, profiles: dict[str, Profile], policy: str | Policy = "ppipe",
                 layout: Layout | None = None, *, min_wait_us: float = 1.0, wait_guard_us: float = 0.0,
                 margin_quantile: float = 0.9, margin_quantile_hi: float = 0.99, margin_step: float = 0.02,
                 margin_max: float = 4.0, margin_prior: float = 1.25, class_room: float = 0.25,
                 pressure_room: float = 0.2, noise_z: float = 0.0, room_quantile: float = 0.995,
                 share_window: float = 20.0,
                 work_conserving: bool = True, pard_exempt: Iterable[str] | None = None,
                 table_capacity: int = 32, queue_capacity: int = 256, request_slots: int = 1024):
        if isinstance(policy, str):
            if policy not in POLICIES:
                raise ValueError(f"unknown policy {policy!r} (known: {', '.join(POLICIES)})")
            policy = POLICIES[policy]
        if policy.take != "min":
            raise ValueError(f"policy {policy.name}: take={policy.take!r} is not implemented (only 'min')")
        if not 0.0 < margin_quantile <= margin_quantile_hi < 1.0:
            raise ValueError("margin quantiles must satisfy 0 < margin_quantile <= margin_quantile_hi < 1, "
                             f"got {margin_quantile}, {margin_quantile_hi}")
        if not 0.0 <= class_room < 1.0 or not 0.0 <= pressure_room < 1.0:
            raise ValueError(f"class_room and pressure_room must be within [0, 1), got {class_room}, "
                             f"{pressure_room}")
        for name, v in (("min_wait_us", min_wait_us), ("wait_guard_us", wait_guard_us)):
            if not 0.0 <= v <= MAX_WAIT_US:  # NaN fails too
                raise ValueError(f"{name} must be within [0, {MAX_WAIT_US:g}] µs, got {v}")
        if not share_window > 0.0 or not math.isfinite(share_window):
            raise ValueError(f"share_window is a number of SLOs > 0, got {share_window}")
        if not 0.0 < room_quantile < 1.0:
            raise ValueError(f"room_quantile must be within (0, 1), got {room_quantile}")
        if not (0.0 <= noise_z < 10.0):
            raise ValueError(f"noise_z is a number of standard deviations in [0, 10), got {noise_z}")
        if margin_step < 0.0 or margin_max < 1.0:
            raise ValueError(f"margin_step must be >= 0 and margin_max >= 1 (got {margin_step}, {margin_max})")
        if policy.early_drop and not policy.reserve:
            raise ValueError(f"policy {policy.name}: early_drop needs reserve=True")
        self.plan = plan
        self.policy = policy
        self.layout = lay = layout if layout is not None else Layout.from_plan(plan, profiles)
        if not lay.models or lay.num_vgpus == 0:
            raise ValueError(f"{plan.source}: the plan serves no model on any vGPU: nothing to schedule")
        # PARD drops proactively where nothing has been spent on a request yet: a later stage of
        # an app holds requests whose query already used GPU time upstream, and dropping one
        # wastes it (the invalid rate), so such stages keep PPipe's earliest-deadline batching
        self.pard_exempt = set(pard_exempt) if pard_exempt is not None else {
            s.model for app in plan.apps for s in app.stages if s.parent >= 0}
        if lay.num_resources >= 1 << S.HANDLE_SHIFT:
            raise ValueError(f"{lay.num_resources} resources: at most {1 << S.HANDLE_SHIFT} fit in a handle")
        M, P = len(lay.models), lay.num_pools
        dims = dict(V=lay.num_vgpus, S=lay.num_servers, R=lay.num_resources, P=P, N=lay.num_pipelines,
                    M=M, Q=2 * M + P, B=lay.max_batch, K=int(max(lay.pipe_npools, default=1)),
                    C=table_capacity, QC=queue_capacity, SC=request_slots, BR=max(64, lay.num_vgpus),
                    OD=64, OR=256, OQ=256, OX=256)
        a = S.Arena(dims)
        for name in ("v_server", "v_pool", "pool_v0", "pool_pipe", "pool_stage", "lat", "tin", "rem",
                     "pipe_model", "pipe_pool0", "pipe_npools", "pipe_bs", "model_pipe0"):
            a.view(name)[...] = getattr(lay, name)
        counts = np.diff(lay.pool_v0)
        a.view("v_alive")[:] = 1
        a.view("pool_live")[:] = counts
        a.view("pool_idle")[:] = counts
        a.view("v_busy")[:] = -1
        a.view("q_wake")[:] = np.inf
        a.view("t_tail")[:] = -np.inf
        a.view("t_gfrom")[:] = -np.inf
        a.view("s_pos")[:] = -1
        a.view("s_free")[:] = np.arange(dims["SC"])[::-1]
        a.A[S.H_NFREE] = dims["SC"]
        a.view("b_free")[:] = np.arange(dims["BR"])[::-1]
        a.view("b_handle")[:] = -1
        a.A[S.H_BNFREE] = dims["BR"]
        a.A[S.H_POLICY] = S.POLICY_PPIPE if policy.reserve else S.POLICY_REACTIVE
        a.A[S.H_EARLY] = int(policy.early_drop)
        a.F[S.F_MIN_WAIT] = min_wait_us
        a.F[S.F_GUARD] = wait_guard_us
        a.F[S.F_MARGIN_Q] = margin_quantile
        a.F[S.F_MARGIN_QHI] = margin_quantile_hi
        a.F[S.F_MARGIN_STEP] = margin_step
        a.F[S.F_MARGIN_MAX] = margin_max
        a.F[S.F_MARGIN_PRIOR] = margin_prior
        a.F[S.F_CLASS_ROOM] = class_room
        a.F[S.F_PRESSURE_ROOM] = pressure_room
        a.F[S.F_NOISE_Z] = noise_z
        a.F[S.F_ROOM_Q] = room_quantile
        a.F[S.F_SHARE_WINDOW] = share_window
        a.view("m_hi_until")[:] = -np.inf
        a.view("v_margin")[:] = 1.0
        a.view("v_margin_hi")[:] = 1.0
        a.view("m_last")[:] = -np.inf
        a.view("m_gap")[:] = lay.planned_gap_us()
        a.view("m_pgap")[:] = lay.planned_gap_us()
        a.view("v_rh")[:] = -1
        a.view("q_hbf")[:] = -np.inf
        a.view("v_rfin")[:] = -np.inf
        a.view("m_room")[:] = 0.5 * pressure_room * lay.slo_us
        a.view("m_room_b")[:] = 0.5 * pressure_room * lay.slo_us
        a.view("m_hold")[:] = lay.slo_us
        a.A[S.H_PARD] = int(policy.pard)
        a.view("m_pard")[:] = [int(m not in self.pard_exempt) for m in lay.models]
        share = a.view("m_share")
        share[:, S.SH_RATE] = 1.0 / lay.planned_gap_us()
        share[:, S.SH_ARATE] = share[:, S.SH_RATE]
        share[:, S.SH_TOK] = 1.0
        servers = [set(lay.v_server[lay.v_model == m].tolist()) for m in range(len(lay.models))]
        a.view("m_near")[:] = [[int(bool(x & y)) for y in servers] for x in servers]
        a.A[S.H_PULL] = int(work_conserving)
        a.F[S.F_LAST_NOW] = -np.inf
        a.F[S.F_WAKE] = np.inf
        self._arena = a
        self._A = a.A
        # compiled entry points for the hot calls, bypassing numba's argument-type dispatch
        # (~0.2 µs a call); warmed on a scratch copy so the real arena is untouched
        scratch = a.A.copy()
        self._decide = _entry(K.decide_ppipe if policy.reserve else K.decide_reactive, scratch, 0.0, True)
        self._submit = _entry(K.submit, scratch, 0, 0, 0.0, 0.0, 0)
        self._submit_many = _entry(K.submit_many, scratch, 0, 1, 0, 0.0, 0.0, 0, 0)
        self._report = _entry(K.report, scratch, 1 << S.HANDLE_SHIFT, 0.0, 0.0)
        self._actions = Actions(self)

    # --- requests --------------------------------------------------------------------------

    def slo_us(self, model: int) -> float:
        return float(self.layout.slo_us[model])

    def submit(self, req_id: int, model: int, arrival_us: float, deadline_us: float | None = None,
               priority: int = 0) -> None:
        """Queue a request; ``deadline_us`` defaults to arrival + the model's SLO from the plan.
        ``priority`` > 0 is the high class: the reserving policies batch it before the low class,
        so under overload the low class absorbs the drops (reactive ignores it)."""
        if deadline_us is None:
            deadline_us = arrival_us + self.layout.slo_us[model]
        status = self._submit(self._A, req_id, model, arrival_us, deadline_us, priority)
        while status:
            self._grow(status)
            status = K.submit(self._A, req_id, model, arrival_us, deadline_us, priority)

    def submit_many(self, first_id: int, count: int, model: int, arrival_us: float,
                    deadline_us: float | None = None, priority: int = 0) -> None:
        """Queue requests ``first_id .. first_id + count - 1`` that share a model, an arrival and a
        deadline (one client message) in one compiled call; the same as ``count`` :meth:`submit`
        calls in id order, at a fraction of their per-call cost."""
        if deadline_us is None:
            deadline_us = arrival_us + self.layout.slo_us[model]
        status, i = self._submit_many(self._A, first_id, count, model, arrival_us, deadline_us, priority, 0)
        while status:
            self._grow(status)
            status, i = K.submit_many(self._A, first_id, count, model, arrival_us, deadline_us, priority, i)

    def cancel(self, req_id: int, model: int) -> bool:
        """Withdraw a request still pending for ``model``'s first pool (O(queue length) lookup)."""
        return bool(K.cancel(self._A, req_id, model))

    def pending(self, model: int | None = None) -> int:
        """Requests waiting in queues (``model=None``: all queues, including reactive stage queues;
        a model's count includes its high-priority queue)."""
        q = self._arena.view("q_size")
        if model is None:
            return int(q.sum())
        return int(q[model] + q[len(q) - len(self.layout.models) + model])

    # --- the decision ----------------------------------------------------------------------

    def decide(self, now_us: float) -> Actions:
        """Run the batching decision at ``now_us`` (µs) and return what to do now."""
        status, nd, nx, wake = self._decide(self._A, now_us, True)
        while status:
            self._grow(status)
            status, nd, nx, wake = self._decide(self._A, now_us, False)
        act = self._actions
        act.n_dispatch = nd
        act.n_drop = nx
        act.wake_at = wake
        return act

    # --- feedback, failures, housekeeping ----------------------------------------------------

    def report(self, handle: int, actual_start_us: float, actual_end_us: float) -> None:
        """An executor's account of reservation ``handle``: it ran over [start, end) µs.

        ``end <= start`` means it did not run (failed or cancelled). Unknown or stale handles are
        ignored. Under ``reactive``, the report of a ``claim`` is what frees the vGPU and moves the
        batch on to the next pool, so every claim must be reported exactly once.
        """
        status = self._report(self._A, handle, actual_start_us, actual_end_us)
        while status:
            self._grow(status)
            status = K.report(self._A, handle, actual_start_us, actual_end_us)

    def report_many(self, handles: np.ndarray, starts_us: np.ndarray, ends_us: np.ndarray) -> None:
        """Several reports in one compiled call (arrays of int64 / float64 / float64)."""
        handles = np.ascontiguousarray(handles, dtype=np.int64)
        starts_us = np.ascontiguousarray(starts_us, dtype=np.float64)
        ends_us = np.ascontiguousarray(ends_us, dtype=np.float64)
        i = 0
        while True:
            status, i = K.report_many(self._A, handles, starts_us, ends_us, i)
            if not status:
                return
            self._grow(status)

    def remove_vgpu(self, vgpu: int) -> None:
        """Take a failed vGPU out of service: its reservations are released and no new batch goes
        to it. Batches already dispatched over it are the caller's to retry (a reactive batch
        waiting on it goes back to its queue). Every queue is re-decided at the next decide."""
        self._set_alive(vgpu, False)

    def restore_vgpu(self, vgpu: int) -> None:
        self._set_alive(vgpu, True)

    def _set_alive(self, vgpu: int, alive: bool) -> None:
        if not 0 <= vgpu < self.layout.num_vgpus:
            raise ValueError(f"vGPU {vgpu} does not exist (0..{self.layout.num_vgpus - 1})")
        status = K.set_alive(self._A, vgpu, alive)
        while status:
            self._grow(status)
            status = K.set_alive(self._A, vgpu, alive)

    def gc(self, now_us: float) -> int:
        """Forget reservations that ended at or before ``now_us``; returns how many."""
        return int(K.gc(self._A, now_us))

    # --- inspection ------------------------------------------------------------------------

    def earliest_slot(self, resources: Sequence[int], t_us: float, duration_us: float) -> float:
        return float(K.earliest(self._A, np.asarray(resources, dtype=np.int64), t_us, duration_us))

    def probe(self, pipeline: int, bs: int, now_us: float) -> tuple[float, float, list[int]]:
        """(finish, waiting, path) of a batch of ``bs`` on ``pipeline`` now; reserves nothing."""
        f, w = K.probe_entry(self._A, pipeline, bs, now_us)
        n = int(self.layout.pipe_npools[pipeline])
        path = [int(x) for x in self._arena.view("pr_vg")[0, :n]] if f < np.inf else []
        return float(f), float(w), path

    def stage_estimate_us(self, model: int, now_us: float, n: int = 1) -> float:
        """µs from ``now_us`` until ``n`` new requests of ``model`` could be done (best pipeline's
        probe, behind what is already queued for it): what a query's upstream stage leaves for
        this one when it schedules against the query's deadline."""
        return float(K.stage_estimate_entry(self._A, model, n, now_us))

    def table(self, resource: int) -> list[tuple[float, float, int]]:
        """Live intervals ``(start, end, handle)`` of one resource, in order."""
        lo, hi = int(self._arena.view("t_lo")[resource]), int(self._arena.view("t_hi")[resource])
        ts, te, th = (self._arena.view(n)[resource, lo:hi] for n in ("t_start", "t_end", "t_handle"))
        return [(float(a), float(b), int(h)) for a, b, h in zip(ts, te, th, strict=True)]

    def table_sizes(self) -> np.ndarray:
        """Intervals held per resource (ended ones count until GC)."""
        return self._arena.view("t_hi") - self._arena.view("t_lo")

    @property
    def arena_bytes(self) -> int:
        return self._arena.nbytes

    def stats(self) -> dict[str, int]:
        A = self._A
        return {
            "decisions": int(A[S.H_CT_DECIDE]), "dispatches": int(A[S.H_CT_DISPATCH]),
            "drops": int(A[S.H_CT_DROP]), "probes": int(A[S.H_CT_PROBES]),
            "reservations": int(A[S.H_CT_RESERVE]), "reports": int(A[S.H_CT_REPORT]),
            "gc_removed": int(A[S.H_CT_GC]), "table_capacity": int(A[S.H_C]),
            "share_holds": int(A[S.H_CT_SHARE_HOLD]), "arena_bytes": self._arena.nbytes,
        }

    # --- growth ----------------------------------------------------------------------------

    def _grow(self, status: int) -> None:
        """Enlarge the section that ran out; the compiled call is then simply repeated."""
        a = self._arena
        d = a.dims
        if status == S.FULL_TABLE:
            new = a.grown(C=2 * d["C"])
        elif status == S.FULL_OUT:
            new = a.grown(OD=2 * d["OD"], OR=2 * d["OR"], OQ=2 * d["OQ"], OX=2 * d["OX"])
        elif status == S.FULL_QUEUE:
            new = a.grown(QC=2 * d["QC"])
        elif status == S.FULL_SLOTS:
            new = a.grown(SC=2 * d["SC"])
            old, n = d["SC"], int(new.A[S.H_NFREE])
            new.view("s_free")[n:n + old] = np.arange(2 * old - 1, old - 1, -1)
            new.view("s_pos")[old:] = -1
            new.A[S.H_NFREE] = n + old
        elif status == S.FULL_BATCH:
            new = a.grown(BR=2 * d["BR"])
            old, n = d["BR"], int(new.A[S.H_BNFREE])
            new.view("b_free")[n:n + old] = np.arange(2 * old - 1, old - 1, -1)
            new.view("b_handle")[old:] = -1
            new.A[S.H_BNFREE] = n + old
        else:
            raise RuntimeError(f"compiled scheduler returned unknown status {status}")
        self._arena = new
        self._A = new.A


def _entry(dispatcher, *args):
    """The compiled function behind ``dispatcher`` for these argument types (compiling or loading
    it from the cache). Calling it skips the type dispatch, so callers must pass the same types:
    the arena, Python ints/floats where the warm-up had them (ints are accepted for floats)."""
    dispatcher(*args)
    sigs = dispatcher.signatures
    sig = sigs[0] if len(sigs) == 1 else tuple(dispatcher.typeof_pyval(a) for a in args)
    return dispatcher.overloads[sig].entry_point
