"""``ppiped serve``: the scheduler process. One uvloop thread, three ZeroMQ ROUTER sockets.

* clients: SUBMIT → admission checks → the core's deadline queue; REPLY per request, exactly once.
* executors: REGISTER / HEARTBEAT / FEEDBACK / RESULT / BYE in; WELCOME / PEERS / DISPATCH /
  CANCEL out.
* ctl: JSON status for the demo and LocalCluster; operators use ``ppiped-ctl`` on a unix socket
  (:mod:`.ctl_server`), Prometheus scrapes :mod:`.metrics`, and :mod:`.replan` replans and migrates
  (while it holds, :meth:`Server.decide` does nothing and requests wait in the core's queue).

Every scheduling decision is the core's (:class:`ppiped.core.scheduler.Scheduler`): this module
only feeds it requests with the wall clock, carries out what ``decide`` returns (dispatch now,
drop, or call again at ``wake_at``) and reports what executors say actually happened.
Payload frames go from the client socket to the executor socket as the same ``zmq.Frame``
objects: never copied, never decoded.

Failure handling (nothing hangs): an executor is gone when its connection drops (the executor
ROUTER is mandatory-routing, so a dispatch to a dead peer fails at once), when it misses
heartbeats for ``heartbeat.timeout_ms``, or when a batch it holds is overdue by
``limits.result_grace_ms`` (or by its reserved length, if longer). Its vGPUs leave the core
(their reservations are released), the other executors of its in-flight batches get CANCEL, and
each request of those batches goes back into the queue with its original deadline: the core
serves it if it still can, else drops it and the client hears ``executor-lost``.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import time
from collections import defaultdict
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import parse_monitor_message

from .. import logs, wire
from ..core.scheduler import DROP_REASONS, Scheduler
from ..plan import Plan
from ..profiles import Profile
from ..security import peer_key, serve, start_authenticator
from ..wire import Status, T
from . import sdnotify
from .config import (
    ConfigError,
    ServeConfig,
    check_endpoint,
    format_ranges,
    ipc_taken,
    tensor_frame_cap,
)
from .ctl_server import CtlServer
from .loop import (
    NOBLOCK,
    Reader,
    Timers,
    has_input,
    now_us,
    on_stop_signals,
    pin_this_thread,
    send_parts,
    unavailable_cpus,
    zmq_context,
)
from .metrics import Metrics, MetricsServer
from .replan import RateMeter, Replanner

log = logs.get("ppiped.serve")

OVERHEAD_SAMPLES = 1 << 20
WAKE_SAMPLES = 1 << 16
SHED_SAMPLES = 1 << 16
ADJUST_US = 100_000  # admission windows: adjusted this often (from results' lateness)
MIN_LIMIT = 64  # the smallest admission window: something is always in flight, so results come
LATE_FLOOR_US = 1000  # lateness below this never counts as executors falling behind
CALM_INTERVALS = 100  # adjustments in a row with nothing late or refused: the window is lifted
# Time budget of one wake-up of a reader: a flood of SUBMITs cannot starve RESULTs (whose replies
# are the answers that count) or the timers, and vice versa.
CLIENT_SLICE_US = 1000
EXEC_SLICE_US = 1000
CTL_SLICE_US = 2000
CTL_DUTY = 0.25
# A client socket behind this long with one client's flood is read at most this share of the time
# (a flood cannot take the loop's whole CPU from the executors and clients on the same host)
CLIENT_PACE_AFTER_US = 5000
CLIENT_FLOOD_DUTY = 0.25
CLIENT_RCVHWM = 1000  # unread messages the daemon holds per client connection
BURST_DECIDE_US = 200
SHED_REPLY_IDS = 4096  # a reply of held-back backlog sheds carries at most about this many ids
SHED_HOLD_US = 200  # and waits at most about this long for more (a refusal stays prompt)
_ACTION_VIEWS = ("path", "n_hops", "req_start", "bs", "res_start", "n_res_of", "finish_us", "model", "handle",
                 "kind", "hop", "start_us", "req_id", "drop_id", "drop_reason")
OFFSET_SAMPLES = 16
MAX_VGPU_ID = 1 << 16  # registrations beyond the plan's vGPUs wait on standby, up to this id
MAX_VGPUS_PER_EXEC = 4096  # vGPUs one executor process may register
MAX_ENDPOINT_CHARS = 256  # REGISTER.data_endpoint
MAX_BACKEND_CHARS = 64  # REGISTER.backend (a name: emulate, ort, trt, torch)
DONE_BATCH_KEEP_US = 2_000_000  # keep answered batches this long for late feedback
# An executor charged with this many overdue batches in a row (Server._blame_overdue) is removed
# and its vGPUs refused for QUARANTINE_US, doubling at each repeat up to QUARANTINE_MAX_US.
OVERDUE_STRIKES = 3
QUARANTINE_US = 5_000_000
QUARANTINE_MAX_US = 300_000_000
REPORT_MANY_FROM = 8  # feedback reports: one compiled call each below this many, else one for all
WARN_EVERY_US = 1_000_000  # repeated warnings of one kind: at most one log line a second
FEEDBACK_AHEAD_US = 1_000_000  # a reported end this far past the scheduler's clock (or a start this
# far before the batch was sent) is not believed: the clock offsets' error is far smaller
# Clients (fair admission, queueing delay): what the daemon keeps per client connection is
# forgotten once it has nothing in flight and has been silent this long; past MAX_CLIENTS known
# connections, every one with nothing in flight is forgotten at once (at most every 0.1 s).
CLIENT_IDLE_US = 10_000_000
CLIENT_PRUNE_US = 1_000_000
MAX_CLIENTS = 1 << 16
# A client's clock offset plus its base delay is the least (receive - sent_us) over the last
# one to two of these windows: long enough to see a message that did not queue, short enough
# to follow clock drift (and a client restarted with a new clock on the same connection).
CLOCK_WINDOW_US = 5_000_000
BACKLOG_FEW_MSGS = 8  # messages since a backlog began below which a client is not shed for it
# ... and one beside others that sent more than this many, and this share of all, is shed at once
BACKLOG_FLOOD_MSGS = 64
FLOOD_SHARE = 0.75
# Under contention (two or more clients with requests in flight for a model) the model's
# admission capacity is at most this share of what it serves in one SLO at its planned
# throughput: with that many ahead of it, a new request still makes its SLO.
FAIR_SLO_SHARE = 0.5


class Req:
    """A request from SUBMIT until its reply. ``arrival`` is when the scheduler received it (a
    retry keeps it); one is made per request, so the constructor is kept to plain stores."""

    __slots__ = ("ident", "cid", "frame", "model", "arrival", "deadline", "retried", "prio", "share", "gen")
    query = None  # a stage request of a query (apps.StageReq) has one

    def __init__(self, ident: bytes, cid: int, frame: Any, model: int, arrival: int, deadline: int,
                 prio: int, share: Share, gen: int = 0) -> None:
        self.ident = ident
        self.gen = gen  # the connection behind ``ident`` when it came (Server.ident_gen)
        self.cid = cid
        self.frame = frame
        self.model = model
        self.arrival = arrival
        self.deadline = deadline
        self.retried = False
        self.prio = prio
        self.share = share


class Share:
    """One client's requests in flight for one model: what fair admission counts. ``st`` is the
    model's stats, whose ``clients`` counts the shares above zero."""

    __slots__ = ("n", "st")

    def __init__(self, st: ModelStats) -> None:
        self.n = 0
        self.st = st

    def done(self, k: int = 1) -> None:
        """``k`` of its requests were answered."""
        self.n -= k
        if not self.n:
            self.st.clients -= 1


class Peer:
    """A client connection (ROUTER identity): its clock offset, for the time its messages queued
    before the daemon read them, and its fair-admission shares by model name (one dict for
    every connection of a CURVE key, which is then the client's identity)."""

    __slots__ = ("key", "shares", "off", "off_prev", "off_at", "seen", "epoch", "msgs")

    def __init__(self, key: bytes | None, shares: dict[str, Share], t: int) -> None:
        self.key = key
        self.shares = shares
        self.off = self.off_prev = math.inf  # least (receive - sent_us): this window, the last
        self.off_at = t + CLOCK_WINDOW_US  # when this window ends
        self.seen = t
        self.epoch = self.msgs = 0  # messages read since the client socket fell behind at ``epoch``

    def queue_delay(self, t: int, sent: int, slo: int) -> int:
        """How long a message sent at the client's ``sent`` (µs, its clock; 0: unknown) queued
        before the daemon read it at ``t``, at most ``slo``. (receive - sent) is the client's clock
        offset plus its base delay plus the queueing; the least over the last window or two is
        the first two (as executors' offsets). A lying client harms only its own requests."""
        if not sent:
            return 0
        d = t - sent
        if t >= self.off_at:
            self.off_prev, self.off, self.off_at = self.off, d, t + CLOCK_WINDOW_US
        elif d < self.off:
            self.off = d
        off = self.off if self.off < self.off_prev else self.off_prev
        return d - off if d - off < slo else slo


class Batch:
    """A dispatched batch until every request in it is answered and every hop reported."""

    __slots__ = ("id", "model", "path", "infer_h", "link_h", "reqs", "finish", "answered", "times",
                 "done_at", "size", "span", "sent")

    def __init__(self, bid: int, model: int, path: list[int], infer_h: list[int],
                 link_h: list[tuple[int, int] | None], reqs: dict[int, Req], finish: float) -> None:
        self.id, self.model, self.path, self.infer_h, self.link_h = bid, model, path, infer_h, link_h
        self.reqs, self.finish, self.answered = reqs, finish, False
        self.times: list[tuple[int, int, int] | None] = [None] * len(path)  # per hop (ready, start, end)
        self.done_at = 0
        self.size = len(reqs)
        self.span = 0.0  # reserved length, first hop's start to the end (µs)
        self.sent = 0  # when the decision to send it came due: no hop of it ran before


class ExecState:
    __slots__ = ("ident", "vgpus", "endpoint", "backend", "pid", "incarnation", "last_seen", "offsets",
                 "offset", "ready", "rewelcome", "key", "overdue", "overdue_since", "queued", "unreachable",
                 "unreachable_at")

    def __init__(self, ident: bytes, vgpus: list[int], endpoint: str, backend: str, pid: int,
                 incarnation: int) -> None:
        self.ident, self.vgpus, self.endpoint, self.backend = ident, vgpus, endpoint, backend
        self.pid, self.incarnation = pid, incarnation
        self.last_seen = now_us()
        self.offsets: list[int] = []
        self.offset = 0  # executor clock minus scheduler clock (µs), less the smallest one-way delay
        self.ready = False
        self.rewelcome = False  # told to re-register for a new plan: its heartbeats do not count yet
        self.key = os.urandom(16)  # of its hop tags (wire.hop_tag): told to it alone, in WELCOME
        self.overdue = 0  # batches charged to it (Server._blame_overdue) since one came through
        self.overdue_since = 0  # when the first of them was charged (µs)
        self.queued = 0  # batches it held at its last heartbeat (its own word)
        self.unreachable: list[int] = []  # next hops it last said it could not reach, and when (µs)
        self.unreachable_at = 0

    def clock_sample(self, exec_clock: int, t: int) -> None:
        self.offsets.append(exec_clock - t)
        if len(self.offsets) > OFFSET_SAMPLES:
            del self.offsets[0]
        self.offset = max(self.offsets)


class ModelStats:
    """Per model: counts, and the admission window (see :meth:`Server.adjust_limits`)."""

    __slots__ = ("accepted", "ok", "dropped", "rejected", "batches", "batch_reqs", "answered", "limit",
                 "late", "limited", "peak", "calm", "was_late", "ok_late", "gpu_us", "invalid_us", "high",
                 "clients")

    def __init__(self) -> None:
        self.accepted = self.ok = self.batches = self.batch_reqs = 0
        self.ok_late = 0  # of ``ok``: answered after the deadline
        self.gpu_us = 0.0  # measured GPU time of answered batches, and of it the share spent on
        self.invalid_us = 0.0  # requests answered late or failed after starting
        self.high = [0, 0, 0]  # the high priority class: accepted, ok within the SLO, dropped
        self.dropped: dict[str, int] = defaultdict(int)
        self.rejected: dict[str, int] = defaultdict(int)
        self.answered = 0  # accepted requests answered (any outcome): in flight = accepted - answered
        self.limit: float = math.inf  # most requests in flight; none until executors fall behind
        self.late: list[float] = []  # this interval: µs each batch's result came after its reserved end
        self.limited = False  # this interval: a request was refused for the limit
        self.peak = 0  # this interval: the most requests in flight
        self.calm = 0  # intervals in a row neither late nor refusing anything
        self.was_late = False  # the previous interval was late
        self.clients = 0  # clients with requests in flight (fair admission shares them the window)

    def new_plan(self) -> None:
        """The model is served again after a plan without it: counts go on, the admission window
        (a measure of the old executors) starts afresh."""
        self.limit = math.inf
        self.late = []
        self.limited = self.was_late = False
        self.peak = self.calm = 0

    def outcomes(self, up_s: float) -> dict[str, Any]:
        """The figures both status views show: goodput over ``up_s`` seconds, drop rate, invalid
        rate (GPU time of answers late or failed after starting) and the high class's counts."""
        return {"goodput_rps": (self.ok - self.ok_late) / max(up_s, 1e-9),
                "drop_rate": sum(self.dropped.values()) / self.accepted if self.accepted else 0.0,
                "invalid_rate": self.invalid_us / self.gpu_us if self.gpu_us else 0.0,
                "high": {"accepted": self.high[0], "ok_in_slo": self.high[1], "dropped": self.high[2]}}


class Server:
    def __init__(self, cfg: ServeConfig, plan: Plan, profiles: dict[str, Profile]) -> None:
        self.cfg = cfg
        self.plan = plan
        opts = dict(cfg.scheduler)
        policy = opts.pop("policy", "ppipe")
        if not isinstance(policy, str):
            raise ConfigError(f"{cfg.source}: scheduler.policy: expected a policy name (ppipe, pard, "
                              f"ppipe-early-drop), got {policy!r}")
        if policy == "reactive":
            raise ConfigError(f"{cfg.source}: scheduler.policy: the daemon runs the reservation "
                              "policies (ppipe, pard, ppipe-early-drop); 'reactive' is simulator-only")
        kw = {}
        for k in ("min_wait_us", "wait_guard_us", "class_room", "pressure_room", "noise_z", "room_quantile",
                  "share_window"):
            if k in opts:
                v = opts.pop(k)
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < math.inf:
                    raise ConfigError(f"{cfg.source}: scheduler.{k}: expected a finite number >= 0, got {v!r}")
                kw[k] = float(v)
        kw.setdefault("wait_guard_us", 1000.0)  # wake-up lateness of a busy loop on a busy host
        # the tables pull a vGPU's queue forward after an early end only if every executor
        # starts a batch as soon as it is free
        kw["work_conserving"] = all(math.isinf(s.start_early_us)
                                    for s in [cfg.executor_defaults, *cfg.executors.values()])
        if opts:
            raise ConfigError(f"{cfg.source}: scheduler: unknown key(s) {', '.join(sorted(opts))} "
                              "(known: policy, min_wait_us, wait_guard_us, class_room, pressure_room, "
                              "room_quantile, share_window, noise_z, app_deadlines)")
        self.policy_name, self.core_kw, self.profiles = policy, kw, profiles
        self.tensor_cap, self.tensor_cap_from = tensor_frame_cap(cfg, profiles)
        try:
            self.core = Scheduler(plan, profiles, policy=policy, **kw)
        except ValueError as e:
            raise ConfigError(f"{cfg.source}: scheduler: {e}") from None
        self.layout = lay = self.core.layout
        self.nv = lay.num_vgpus
        for v in range(self.nv):  # no vGPU serves until its executor says it is ready
            self.core.remove_vgpu(v)
        self._warm_up()
        self.model_names = list(lay.models)
        self.model_index = {m: i for i, m in enumerate(self.model_names)}
        for name in cfg.models:
            if name not in self.model_index:
                raise ConfigError(f"{cfg.source}: models.{name}: not a model of the plan "
                                  f"({', '.join(self.model_names)})")
        for v in range(self.nv):
            ex = cfg.executor_settings(v)
            if not ex.data_endpoint and ex.data_port_base + v > 65535:
                raise ConfigError(f"{cfg.source}: executor.data_port_base: vGPU {v} would listen on port "
                                  f"{ex.data_port_base + v} (> 65535); lower it")
        for v in sorted(cfg.executors):
            if v >= self.nv:
                log.warning("config-executor-unused", key=f"executors.{v}",
                            reason=f"the plan has vGPUs 0..{self.nv - 1}; ignored until a plan has it")
        self.slo_us: list[int] = []
        self.input_bytes: list[int] = []
        self._model_limits()
        over = [(m, u) for m, u in zip(self.model_names, self.slo_us, strict=True) if u > cfg.max_slo_ms * 1000]
        if over:  # its own requests would all be refused as malformed
            raise ConfigError(f"{cfg.source}: limits.max_slo_ms: {cfg.max_slo_ms:g} is below the SLO of "
                              + ", ".join(f"{m} ({u / 1000:g} ms)" for m, u in over))
        self.removed_models: dict[str, int] = {}  # model -> the plan version that stopped serving it
        # requests rejected that no model of the plan owns (unknown model, a malformed message),
        # by reason: counted per request, in the totals, status and /metrics (model "-")
        self.unowned_rejects: dict[str, int] = defaultdict(int)
        self.removed_stats: dict[str, ModelStats] = {}  # their counts: totals and counters never fall
        self.assignments = [self._assignment(v) for v in range(self.nv)]
        self.vgpu_exec: list[ExecState | None] = [None] * self.nv
        self.execs: dict[bytes, ExecState] = {}
        self.reqs: dict[int, Req] = {}  # queued in the core
        self.peers: dict[bytes, Peer] = {}  # client connections by ROUTER identity
        self.quarantined: dict[int, tuple[int, int]] = {}  # vGPU -> (refused until µs, times held)
        # A client chooses its ROUTER identity, so another client may take it once the first
        # disconnects (with or without CURVE, on any transport). Each identity's connection has a
        # generation, bumped when its connection closes or another one speaks under it; a request
        # keeps the one it came on, and its reply is sent only while that one holds
        # (``connection_holds``).
        self.ident_gen: dict[bytes, int] = {}
        self.ident_fd: dict[bytes, int] = {}
        self.fd_ident: dict[int, bytes] = {}
        self.client_events: zmq.Socket | None = None
        self.key_shares: dict[bytes, dict[str, Share]] = {}  # CURVE: shares by client key
        self.prune_at = 0  # when idle clients are next forgotten
        self.force_prune_at = 0  # past MAX_CLIENTS: the soonest they may be forgotten again
        # since the client socket fell behind (at epoch_since): messages read, clients they came from
        self.epoch_since = self.epoch_msgs = self.epoch_senders = 0
        self.batches: dict[int, Batch] = {}
        self.next_rid = 1
        self.next_batch = 1
        self.stats = [ModelStats() for _ in self.model_names]
        self.counters: dict[str, int] = defaultdict(int)
        self.busy_us = [0.0] * self.nv  # per vGPU; a list: one += per feedback entry
        self.overhead = np.zeros(OVERHEAD_SAMPLES, dtype=np.float64)
        self.n_overhead = 0
        self.wake_late = np.zeros(WAKE_SAMPLES, dtype=np.float64)
        self.n_wake = 0
        self.shed_us = np.zeros(SHED_SAMPLES, dtype=np.float64)  # read to overloaded reply sent
        self.n_shed = 0
        # backlog sheds of this client wake-up, one reply per client when it ends: ident ->
        # (ids, read times of their messages, detail)
        self._shed_later: dict[bytes, tuple[list[int], list[int], str]] = {}
        self.max_backlog_us = int(cfg.max_backlog_ms * 1000)
        self.adjust_at = 0  # when the admission windows are next adjusted
        self._views_key = -1
        self._v: dict[str, np.ndarray] = {}
        self.wake_entry: list | None = None
        self.wake_at = math.inf
        self.started = now_us()
        self.stopping = False
        self.plan_since = self.started
        self.plan_version = 1
        self.holding = False  # a migration holds dispatching
        self.draining = False  # ppiped-ctl drain: new requests are refused, queued ones served
        self.metrics = Metrics()
        self.rates = RateMeter(len(self.model_names), cfg.replan_ewma_s)
        self.replanner = Replanner(self)
        self.ctl_server: CtlServer | None = None
        self.metrics_server: MetricsServer | None = None
        # Set before any reader exists: a message may arrive while run() still awaits start-up.
        self._dirty_decide = False
        self._burst_start = 0
        self._warned: dict[str, int] = {}  # warning kind -> µs when last logged (rate limit)
        # Differs on every start: clients that see it change know their pending requests are gone.
        self.epoch = int.from_bytes(os.urandom(6), "big")
        from .apps import Queries  # (it builds on this module's Req)

        self.queries = Queries(self)  # the plan's apps: multi-model queries

    def _model_limits(self) -> None:
        """Per-model SLO and input size: the config's [models.NAME] overrides, else the plan's SLO."""
        lay = self.layout
        self.slo_us = []
        self.input_bytes = []  # checked at admission (0: not checked)
        self.input_specs: list[dict | None] = []  # what clients are told to send
        self.fair_cap: list[float] = []  # requests in flight shared out under contention
        # the fastest a request can be served (a batch of one on the quickest pipeline, no wait)
        self.fastest_us = [float(x) for x in lay.fastest_us()]
        rate = lay.rate_rps
        for i, m in enumerate(self.model_names):
            ms = self.cfg.models.get(m)
            self.slo_us.append(self.cfg.slo_us(m, lay.slo_us[i]))
            r = float(rate[i]) if rate is not None else 0.0
            self.fair_cap.append(max(MIN_LIMIT, r * self.slo_us[i] * 1e-6 * FAIR_SLO_SHARE) if r > 0
                                 else math.inf)
            self.input_bytes.append(ms.input_bytes if ms else 0)
            prof = self.profiles.get(m)
            self.input_specs.append(prof.input_spec() if prof is not None else None)

    def install_plan(self, plan: Plan, core: Scheduler) -> None:
        """Make ``plan`` (served by ``core``) the one in force; executors come back as they re-register.
        Queued requests must already carry the new plan's model indices (see replan.switch)."""
        self.plan, self.core = plan, core
        self.layout = lay = core.layout
        self.nv = lay.num_vgpus
        names = list(lay.models)
        if names != self.model_names:  # the plan adds or removes models: stats follow by name
            old = self.model_names
            by = dict(zip(old, self.stats, strict=True))
            for m in set(old) - set(names):  # cumulative counts outlive the model (totals, metrics)
                self.removed_stats[m] = by[m]
            self.stats = []
            for m in names:
                st = by.get(m)
                if st is None:  # added, or added back: counts on from where it stopped
                    st = self.removed_stats.pop(m, None)
                    if st is None:
                        st = ModelStats()
                    else:
                        st.new_plan()
                self.stats.append(st)
            self.rates.remap(old, names)
            for i, m in enumerate(names):
                if m not in by:  # its rate starts at zero from its count now, not from 0
                    self.rates.last[i] = self.stats[i].accepted
            for m in set(old) - set(names):
                self.removed_models[m] = self.plan_version + 1
            for m in names:
                self.removed_models.pop(m, None)
            self.model_names = names
            self.model_index = {m: i for i, m in enumerate(names)}
            log.info("models-changed", added=",".join(m for m in names if m not in by) or "-",
                     removed=",".join(m for m in old if m not in self.model_index) or "-")
        self._model_limits()
        try:
            self.queries.install(plan.apps)
        except ConfigError as e:  # served as before: the old apps (their stages fail where a model went)
            log.warning("apps-not-installed", error=str(e))
        self.assignments = [self._assignment(v) for v in range(self.nv)]
        self.vgpu_exec = [None] * self.nv
        for ex in self.execs.values():  # vGPUs the new plan lacks keep their executor on standby
            for v in ex.vgpus:
                if v < self.nv:
                    self.vgpu_exec[v] = ex
        self.busy_us = [0.0] * self.nv
        self._views_key = -1
        self.plan_version += 1
        self.plan_since = now_us()

    def _warm_up(self) -> None:
        """Call every compiled entry point once before listening: a first call may JIT-compile
        for seconds, which must not happen to the first request."""
        t = float(now_us())
        self.core.submit(-1, 0, t, t + 1.0)
        self.core.cancel(-1, 0)
        self.core.submit_many(-1, 1, 0, t, t + 1.0)
        self.core.cancel(-1, 0)
        self.core.decide(t)
        self.core.report(-1, t, t)
        self.core.report_many(np.array([-1, -1], dtype=np.int64), np.array([t, t]), np.array([t, t]))
        self.core.gc(t)

    def _assignment(self, v: int, lay: Any = None) -> wire.Assignment:
        lay = lay if lay is not None else self.layout
        p = int(lay.v_pool[v])
        pipe = int(lay.v_pipe[v])
        stage = int(lay.v_stage[v])
        last = stage == int(lay.pipe_npools[pipe]) - 1
        lat = [float(x) for x in lay.lat[p] if math.isfinite(x)]
        trans = [float(x) for x in lay.tin[p + 1][:len(lat)]] if not last else [0.0] * len(lat)
        a, e = (int(x) for x in lay.pool_blocks[p])
        return wire.Assignment(v, lay.models[int(lay.v_model[v])], int(lay.pipe_index[pipe]), stage, a, e,
                               lay.pool_gpu[p], int(lay.v_split[v]), int(lay.v_server[v]), last, lat, trans)

    # --- life cycle ---------------------------------------------------------------------------

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        self.done = self.loop.create_future()
        cfg = self.cfg
        for key, cpus in (("threads.loop_cpus", cfg.loop_cpus), ("threads.io_cpus", cfg.io_cpus)):
            if bad := unavailable_cpus(cpus):
                raise ConfigError(f"{cfg.source}: {key}: CPU {', '.join(map(str, bad))} not available to "
                                  f"this process (it may run on {format_ranges(sorted(os.sched_getaffinity(0)))})")
        CtlServer.group_id(cfg.ctl_group, cfg.source)
        self.queries.start()  # glue workers, before anything listens: an import error stops us here
        # a bind on an ipc path unlinks the live socket there: a second daemon started by mistake
        # would cut the first off from its clients and executors, and only then find out
        for key, ep in (("endpoints.client", cfg.client), ("endpoints.executor", cfg.executor),
                        ("endpoints.ctl", cfg.ctl), ("ctl.socket", "ipc://" + cfg.ctl_socket_path())):
            why = ipc_taken(ep[6:]) if ep.startswith("ipc://") else None
            if why is not None:
                raise ConfigError(f"{cfg.source}: {key}: {why}" + (": another ppiped serves it (stop it first)"
                                                                    if why.endswith("a live process") else ""))
        self.zctx = zmq_context(cfg.io_threads, cfg.io_cpus)
        self.auth = start_authenticator(self.zctx, cfg.security)
        try:
            self.client = self._bind(zmq.ROUTER, cfg.client, "endpoints.client",
                                     max_frame=max(cfg.max_payload_bytes, wire.MAX_HEADER_BYTES),
                                     domain="client", unlimited=True)
            self.exe = self._bind(zmq.ROUTER, cfg.executor, "endpoints.executor", mandatory=True,
                                  max_frame=max(self.tensor_cap, wire.MAX_HEADER_BYTES), domain="executor")
            self.ctl = self._bind(zmq.ROUTER, cfg.ctl, "endpoints.ctl", max_frame=wire.MAX_HEADER_BYTES,
                                  domain="ctl")
        except ConfigError:
            self._close_zmq()
            self.queries.close()
            raise
        if cfg.loop_cpus:  # after the sockets: ZeroMQ's threads keep the process's CPUs or io_cpus
            pin_this_thread(cfg.loop_cpus)
        self.timers = Timers(self.loop)
        self.client_reader = Reader(self.loop, self.client, self.on_client, after=self.after_clients,
                                    budget_us=CLIENT_SLICE_US, pace_after_us=CLIENT_PACE_AFTER_US,
                                    duty=CLIENT_FLOOD_DUTY)
        self.exe_reader = Reader(self.loop, self.exe, self.on_exec, after=self.after_execs,
                                 budget_us=EXEC_SLICE_US)
        # ctl requests are few and a status costs up to tens of ms: a flood of them (anyone who
        # reaches a TCP ctl endpoint may send one) gets at most CTL_DUTY of the loop
        self.ctl_reader = Reader(self.loop, self.ctl, self.on_ctl, budget_us=CTL_SLICE_US,
                                 pace_after_us=CTL_SLICE_US, duty=CTL_DUTY)
        # client identities are chosen by clients: watch who goes (see ident_gen); with or without
        # CURVE, since a plain client may set any ROUTING_ID too
        self.client_events = self.client.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.readers = [self.client_reader, self.exe_reader, self.ctl_reader,
                        Reader(self.loop, self.client_events, self.on_client_event)]
        try:
            await self._start_ops()
        except ConfigError:
            for r in self.readers:
                r.close()  # before their sockets go: a watched FD closed under the loop aborts it
            self.timers.close()
            self.queries.close()
            self._close_zmq()
            raise
        on_stop_signals(self.loop, self.stop, log)
        self.housekeeping()
        wd = sdnotify.watchdog_interval_s()
        if wd:
            self._watchdog(wd)
        log.info("listening", client=self.cfg.client, executor=self.cfg.executor, ctl=self.cfg.ctl,
                 models=",".join(self.model_names), vgpus=self.nv, plan=self.plan.source,
                 max_tensor_bytes=self.tensor_cap, max_tensor_bytes_from=self.tensor_cap_from)
        sdnotify.notify(f"READY=1\nSTATUS=serving {len(self.model_names)} models on {self.nv} vGPUs")
        await self.done
        await self.shutdown()
        return 0

    async def _start_ops(self) -> None:
        """The ctl socket (always; a failure is fatal only for an explicitly configured path) and
        the metrics endpoint (when a port is set)."""
        path = self.cfg.ctl_socket_path()
        try:
            self.ctl_server = CtlServer(self, path, self.cfg.ctl_mode, self.cfg.ctl_group)
            await self.ctl_server.start()
        except (OSError, ConfigError) as e:
            self.ctl_server = None
            if self.cfg.ctl_socket:
                raise ConfigError(f"{self.cfg.source}: ctl.socket: cannot listen on {path}: {e}") from None
            log.warning("ctl-socket-unavailable", path=path, error=str(e))
        if self.cfg.metrics_port:
            try:
                self.metrics_server = MetricsServer(self, self.cfg.metrics_host, self.cfg.metrics_port)
                await self.metrics_server.start()
            except OSError as e:
                if self.ctl_server is not None:
                    await self.ctl_server.close()
                raise ConfigError(f"{self.cfg.source}: metrics.port: cannot listen on "
                                  f"{self.cfg.metrics_host}:{self.cfg.metrics_port}: {e}") from None

    def _close_zmq(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.zctx.destroy(0)

    def _bind(self, kind: int, ep: str, key: str, mandatory: bool = False,
              max_frame: int = -1, domain: str = "", unlimited: bool = False) -> zmq.Socket:
        """A bound socket; ``max_frame``: ZMQ_MAXMSGSIZE, so libzmq drops a peer that sends a
        larger frame before allocating it (the payload check after receipt comes too late);
        ``domain``: its CURVE allow-list when ``security.curve`` is on; ``unlimited``: no send
        high water mark (a ROUTER drops what it sends past a peer's HWM: a reply must never be
        lost to a client that reads slowly), and at most CLIENT_RCVHWM unread messages per
        connection: past that libzmq stops reading the connection and the sender's socket holds
        the rest, so a flood costs neither memory nor I/O-thread CPU before the loop gets to it
        (with no limit, one flooding client took the I/O thread's CPU from the executors while
        it sent).

        Every option is set before ``bind``: libzmq's listener copies the socket's options when
        it is made, and the connections it accepts take theirs from that copy."""
        s = self.zctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        if unlimited:
            s.setsockopt(zmq.SNDHWM, 0)
            s.setsockopt(zmq.RCVHWM, CLIENT_RCVHWM)
        serve(s, self.cfg.security, domain)
        if max_frame > 0:
            s.setsockopt(zmq.MAXMSGSIZE, max_frame + wire.FRAME_SLACK)
        if mandatory:
            s.setsockopt(zmq.ROUTER_MANDATORY, 1)
            s.setsockopt(zmq.SNDHWM, 1_000_000)
        if ep.startswith("ipc://"):
            os.makedirs(os.path.dirname(ep[6:]) or ".", exist_ok=True)
        try:
            s.bind(ep)
        except zmq.ZMQError as e:
            s.close(0)
            raise ConfigError(f"{self.cfg.source}: {key}: cannot listen on {ep}: {e}") from None
        return s

    def stop(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    async def shutdown(self) -> None:
        """Answer everything: queued requests now, in-flight batches after at most a second."""
        self.stopping = True
        sdnotify.notify("STOPPING=1")
        self._drop_reqs(list(self.reqs.values()), wire.SHUTDOWN)
        self.reqs.clear()
        end = time.monotonic() + 1.0
        while any(not b.answered for b in self.batches.values()) and time.monotonic() < end:
            await asyncio.sleep(0.01)
        for b in self.batches.values():
            if not b.answered:
                self._drop_reqs(list(b.reqs.values()), wire.SHUTDOWN)
                b.reqs.clear()
                b.answered = True
        self.queries.close()  # queries waiting on glue
        await asyncio.sleep(0.05)  # let the replies leave
        if self.replanner.busy and self.replanner.task is not None:
            self.replanner.task.cancel()
        for srv in (self.ctl_server, self.metrics_server):
            if srv is not None:
                await srv.close()
        for r in self.readers:
            r.close()
        self.timers.close()
        self._close_zmq()
        log.info("stopped", **self._totals())

    def _watchdog(self, every_s: float) -> None:
        sdnotify.notify("WATCHDOG=1")
        self.loop.call_later(every_s, self._watchdog, every_s)

    # --- clients ------------------------------------------------------------------------------

    def on_client(self, msg: list) -> None:
        t = now_us()
        if not self._burst_start:
            self._burst_start = t
        self._on_client(msg, t)
        if self._dirty_decide and t - self._burst_start > BURST_DECIDE_US:
            # a long burst: decide now rather than after it, so early requests do not wait for
            # it; after this message, so an answer to it is not held up by the decision (nor
            # the refusals held back for one reply)
            if self._shed_later:
                self._flush_sheds()
            self.decide(self._burst_start)
            self._burst_start = 0

    def _on_client(self, msg: list, t: int) -> None:
        ident = msg[0].bytes
        if len(msg) < 2:
            self.counters["malformed"] += 1
            return
        if self.client_events is not None:
            self._drain_client_events()
            self._track_connection(ident, msg[1])
        try:
            h = wire.decode(msg[1])
        except wire.ProtocolError as e:
            self.counters["malformed"] += 1
            qid = wire.query_id(msg[1])  # a QUERY's error is its ANSWER, so its client hears of it
            send_parts(self.client, [ident, wire.error(e.code, str(e)) if qid is None else
                                     wire.answer(qid, Status.REJECTED, e.code, "", str(e))])
            return
        kind = h.type
        if kind == T.SUBMIT:
            self.on_submit(ident, h, msg, t)
        elif kind == T.QUERY:
            self.queries.on_query(ident, h, msg, t)
        elif kind == T.PING:
            if len(msg[1]) > wire.MAX_PING_BYTES:  # its token is echoed: no amplifier for floods
                self.counters["malformed"] += 1
                send_parts(self.client, [ident, wire.error(wire.MALFORMED, f"PING of {len(msg[1])} bytes: "
                                                           f"at most {wire.MAX_PING_BYTES}, token included")])
                return
            info = {"version": wire.VERSION, "epoch": self.epoch, "checks_epoch": True,
                    "models": {m: self._model_info(i) for i, m in enumerate(self.model_names)},
                    "max_payload_bytes": self.cfg.max_payload_bytes,
                    "max_ids_per_message": self.cfg.max_ids_per_message,
                    "vgpus_alive": self.alive_vgpus()}
            if self.queries.apps:
                info["apps"] = self.queries.info()
            send_parts(self.client, [ident, wire.pong(h.token, info)])
        else:
            self.counters["malformed"] += 1
            send_parts(self.client, [ident, wire.error(wire.MALFORMED,
                                                          f"a client may not send {T(kind).name}")])

    def _model_info(self, i: int) -> dict:
        """What a client needs to send model ``i`` a valid frame: its SLO and input (bytes from
        the config's check, else from the profile; shape and dtype as profiled)."""
        spec = self.input_specs[i]
        return {"slo_ms": self.slo_us[i] / 1000,
                "input_bytes": self.input_bytes[i] or (spec["bytes"] if spec else 0),
                "input": spec}

    def on_submit(self, ident: bytes, h: wire.Submit, msg: list, t: int) -> None:
        model, slo_us, ids, prio, sent = h.model, h.slo_us, h.ids, h.priority, h.sent_us
        frames = msg[2:]
        if not ids:
            self.counters["malformed"] += 1
            send_parts(self.client, [ident, wire.error(wire.MALFORMED, "SUBMIT carries no requests")])
            return
        if h.epoch and h.epoch != self.epoch:
            # sent to an earlier scheduler: its client ended them when it heard of the restart
            # (or gave them up as unreachable), so serving them would be work nobody waits for
            self.counters["stale_epoch"] += len(ids)
            send_parts(self.client, [ident, wire.reply(ids, Status.DROPPED, wire.DAEMON_RESTARTED,
                                                       "sent to an earlier scheduler")])
            return
        if prio >= wire.PRIORITIES:
            self.counters["malformed"] += 1
            self._reject(ident, ids, wire.MALFORMED, None,
                         f"SUBMIT.priority {prio}: 0 (low) or 1 (high)")
            return
        if len(ids) != len(frames):
            self.counters["malformed"] += 1
            self._reject(ident, ids, wire.MALFORMED, None,
                         f"SUBMIT announces {len(ids)} requests and carries {len(frames)} frames")
            return
        if len(ids) > self.cfg.max_ids_per_message:
            self.counters["malformed"] += 1
            self._reject(ident, ids, wire.MALFORMED, None,
                         f"more than {self.cfg.max_ids_per_message} requests in one message")
            return
        m = self.model_index.get(model)
        if m is None:
            self.counters[wire.UNKNOWN_MODEL] += 1
            self._reject(ident, ids, wire.UNKNOWN_MODEL, None, self._unknown_model(model))
            return
        st = self.stats[m]
        if self.stopping or self.draining:
            self._reject(ident, ids, wire.SHUTDOWN, st, "draining" if self.draining else "")
            return
        slo = slo_us or self.slo_us[m]
        if slo > self.cfg.max_slo_ms * 1000:
            self.counters["malformed"] += 1
            self._reject(ident, ids, wire.MALFORMED, st, f"SLO {slo / 1000:g} ms is above "
                         f"limits.max_slo_ms = {self.cfg.max_slo_ms:g}")
            return
        peer = self.peers.get(ident)
        if peer is None or (self.cfg.security.curve and peer.key != peer_key(msg[1])):
            peer = self._new_peer(ident, msg[1], t)
        peer.seen = t
        sh = peer.shares.get(model)
        if sh is None or sh.st is not st:  # (a replan may have removed the model, then added it back)
            sh = peer.shares[model] = Share(st)
        delay = peer.queue_delay(t, sent, slo)  # how long it queued before the daemon read it
        if delay == slo and slo >= self.fastest_us[m]:
            self._late_on_arrival(ident, ids, st, prio, "late_on_arrival",
                                  f"queued {delay / 1000:.1f} ms before it was read")
            return
        if slo - delay < self.fastest_us[m]:
            self._late_on_arrival(ident, ids, st, prio, "slo_below_fastest",
                                  f"SLO {slo / 1000:g} ms ({delay / 1000:.1f} ms of it queued before it was "
                                  f"read) is shorter than {model}'s fastest pipeline, "
                                  f"{self.fastest_us[m] / 1000:.3f} ms")
            return
        behind_us = min(self.max_backlog_us, slo >> 1)
        # Fair admission: with other clients in flight for this model, a client at its fair share
        # of the model's capacity takes no more (max-min: what the others leave unused is free)
        n_clients = st.clients if sh.n else st.clients + 1
        fair = math.inf
        if n_clients > 1:
            cap = min(st.limit, self.fair_cap[m], self.cfg.max_pending)
            fair = cap / n_clients
        since = self.client_reader.busy_since
        if since:
            # The socket is behind (one client's flood, or the loop's own ceiling): count messages
            # per client since it fell behind, and shed what comes from clients that sent more
            # than the mean or hold more than their share, so a flood does not shut others out.
            if peer.epoch != since:
                if self.epoch_since != since:
                    self.epoch_since, self.epoch_msgs, self.epoch_senders = since, 0, 0
                peer.epoch, peer.msgs = since, 0
                self.epoch_senders += 1
            peer.msgs += 1
            self.epoch_msgs += 1
            # (a client alone is shed as before; beside others, one that sent only a few
            # messages since is not what backs the socket up, even if it is read first)
            flooding = (self.epoch_senders < 2 and n_clients < 2) or (
                peer.msgs > BACKLOG_FEW_MSGS and peer.msgs * self.epoch_senders > self.epoch_msgs)
            # one client sending most of a backlog beside others is shed at once, not after the
            # SLO-scaled wait: what it gets admitted meanwhile fills the window others burst into
            reader = self.client_reader
            if self.epoch_senders > 1 and peer.msgs > BACKLOG_FLOOD_MSGS and \
                    peer.msgs > FLOOD_SHARE * self.epoch_msgs:
                flooding, behind_us = True, 0
                reader.flood()
            # (in one client's flood the others' messages are read in turn, not behind it: they
            # are not shed for the backlog, only by the share and window rules below)
            if t - since > behind_us and (flooding or (sh.n + len(ids) > fair and not reader.flooded)):
                self._shed(ident, ids, st, t, "backlog", f"client socket backlogged {(t - since) / 1000:.1f} ms")
                return
        inflight = st.accepted - st.answered
        window = st.limit - inflight
        queue = self.cfg.max_pending - len(self.reqs)
        room = queue
        if window <= room:
            room = window
            if window < len(ids):  # the window refuses some: it may be too small
                st.limited = True
        if n_clients > 1:
            # max-min: the capacity the others leave, and never less than the fair share, even
            # when another client has filled the window (it is then over its share, and refused)
            free = cap - inflight + sh.n
            share = (free if free > fair else fair) - sh.n
            room = share if share < queue else queue
            if share <= 0:
                self._shed(ident, ids, st, t, "share", f"{model}: this client has {sh.n} requests in "
                           f"flight, its fair share of {cap:.0f} with {n_clients} clients")
                return
        if room <= 0:
            if window <= 0 and room < queue:
                cause, why = "window", f"{model}: {inflight} requests in flight, admission window {st.limit}"
            else:
                cause, why = "queue", f"{len(self.reqs)} requests queued, limits.max_pending {self.cfg.max_pending}"
            self._shed(ident, ids, st, t, cause, why)
            return
        deadline = t - delay + slo
        gen = self.ident_gen.get(ident, 0)
        limit = self.cfg.max_payload_bytes
        want = self.input_bytes[m]
        reqs = self.reqs
        bad: dict[str, list[int]] = {}
        rid0 = rid = self.next_rid
        for cid, f in zip(ids, frames):  # noqa: B905 - lengths checked above
            n = len(f)
            if n > limit:
                bad.setdefault(wire.PAYLOAD_TOO_LARGE, []).append(cid)
                continue
            if want and n != want:
                bad.setdefault(wire.BAD_INPUT, []).append(cid)
                continue
            if room <= 0:
                bad.setdefault(wire.OVERLOADED, []).append(cid)
                continue
            room -= 1
            reqs[rid] = Req(ident, cid, f, m, t, deadline, prio, sh, gen)
            rid += 1
        k = rid - rid0
        if k:  # the accepted ones have consecutive ids: one compiled call queues them all
            self.core.submit_many(rid0, k, m, float(t), float(deadline), prio)
            if not sh.n:
                st.clients += 1
            sh.n += k
        st.accepted += k
        if prio:
            st.high[0] += k
        if inflight + k > st.peak:
            st.peak = inflight + k
        self.next_rid = rid
        self._dirty_decide = True
        for reason, cids in bad.items():
            self.counters[reason] += len(cids)
            self._reject(ident, cids, reason, st)

    def _new_peer(self, ident: bytes, frame: Any, t: int) -> Peer:
        """State for a client connection seen for the first time (or whose CURVE key changed:
        a ROUTER identity a client chose may come back on another connection)."""
        if len(self.peers) >= MAX_CLIENTS and t >= self.force_prune_at:
            self.force_prune_at = t + CLIENT_PRUNE_US // 10
            self.forget_clients(t, forced=True)
        key = peer_key(frame) if self.cfg.security.curve else None
        if key is None:
            shares: dict[str, Share] = {}
        else:
            shares = self.key_shares.setdefault(key, {})
        p = self.peers[ident] = Peer(key, shares, t)
        return p

    def _track_connection(self, ident: bytes, frame: Any) -> None:
        """Note the connection (its socket FD) ``ident`` speaks on; another one than
        before means another client took the identity, and replies due to the first are void."""
        try:
            fd = frame.get(zmq.SRCFD)
        except (AttributeError, zmq.ZMQError):
            return
        old = self.ident_fd.get(ident)
        if old == fd:
            return
        if old is not None:
            self.ident_gen[ident] = self.ident_gen.get(ident, 0) + 1
            if self.fd_ident.get(old) == ident:
                del self.fd_ident[old]
        self.ident_fd[ident] = fd
        self.fd_ident[fd] = ident

    def on_client_event(self, msg: list) -> None:
        """A client connection closed; what its identity was owed is void from now on."""
        try:
            ev = parse_monitor_message([bytes(f) for f in msg])
        except Exception:  # noqa: BLE001 - a monitor message we cannot read changes nothing
            return
        if ev.get("event") != zmq.EVENT_DISCONNECTED:
            return
        ident = self.fd_ident.pop(ev.get("value"), None)
        if ident is not None and self.ident_fd.get(ident) == ev.get("value"):
            del self.ident_fd[ident]
            if ident in self.peers:
                self.ident_gen[ident] = self.ident_gen.get(ident, 0) + 1
            else:  # it never had a request in flight: no reply to void, and nothing to keep
                # (one entry per closed connection that only pinged grew without bound)
                self.ident_gen.pop(ident, None)

    def _drain_client_events(self) -> None:
        """Read the disconnects libzmq has noted so far. Before a client message is handled and
        before a reply goes: a client that took a closed connection's identity (its socket may
        even reuse the FD) is never mistaken for the first, whichever reader the loop ran first."""
        ev = self.client_events
        while ev is not None and has_input(ev):  # the ctypes ZMQ_EVENTS read, as Reader's (per message)
            self.on_client_event(ev.recv_multipart())

    def connection_holds(self, ident: bytes, gen: int, n: int) -> bool:
        """Whether a reply to ``n`` requests that came on generation ``gen`` of ``ident`` may go:
        not when that connection closed or another client took its identity since."""
        if self.client_events is not None:
            self._drain_client_events()
        if gen == self.ident_gen.get(ident, 0):
            return True
        self.counters["replies_to_closed_connections"] += n
        return False

    def forget_clients(self, t: int, forced: bool = False) -> None:
        """Forget client connections with nothing in flight and silent for ``CLIENT_IDLE_US``
        (``forced``: any with nothing in flight), so per-client state stays bounded."""
        idle = t if forced else t - CLIENT_IDLE_US
        peers = self.peers
        for ident, p in list(peers.items()):
            if p.seen <= idle and not any(sh.n for sh in p.shares.values()):
                del peers[ident]
                self.ident_gen.pop(ident, None)  # nothing of it in flight: no reply to void
        if self.key_shares:
            used = {p.key for p in peers.values()}
            for key, shares in list(self.key_shares.items()):
                if key not in used and not any(sh.n for sh in shares.values()):
                    del self.key_shares[key]

    def _late_on_arrival(self, ident: bytes, ids: list[int], st: ModelStats, prio: int, counter: str,
                         why: str) -> None:
        """A SUBMIT that queued (before the daemon read it) past its SLO, or with less of its SLO
        left than the fastest pipeline takes: it is dropped at once as ``deadline``, never
        served late as if it had just arrived, nor refused as ``overloaded`` (a tiny SLO is no
        sign of load)."""
        n = len(ids)
        st.accepted += n
        st.answered += n
        st.dropped[wire.DEADLINE] += n
        if prio:
            st.high[0] += n
            st.high[2] += n
        self.counters[counter] += n
        send_parts(self.client, [ident, wire.reply(ids, Status.DROPPED, wire.DEADLINE, why)])

    def _shed(self, ident: bytes, ids: list[int], st: ModelStats, t: int, cause: str, detail: str) -> None:
        """Answer a whole SUBMIT ``overloaded`` at once, before its payloads are looked at: the
        client socket has been backlogged longer than ``limits.max_backlog_ms`` (or half the SLO:
        the loop is behind), or the model is at its admission window (the executors are).
        Costs at most a reply per message, nothing per request (a backlog's sheds share one reply
        per client and wake-up): shedding must be far cheaper than serving, or past its ceiling
        the daemon spends itself on requests that are already late."""
        n = len(ids)
        st.rejected[wire.OVERLOADED] += n
        self.counters[wire.OVERLOADED] += n
        self.counters["shed_messages"] += 1
        self.counters[f"shed_{cause}"] += n  # backlog, share (fair admission), window or queue (max_pending)
        if cause == "backlog":
            # A backlog is a flood: its sheds are answered together, one reply per client
            # rather than one per message (the largest cost of shedding), when the client
            # reader's wake-up ends or the first of them has waited SHED_HOLD_US
            later = self._shed_later.get(ident)
            if later is None:
                self._shed_later[ident] = later = (list(ids), [t], detail)
            else:
                later[0].extend(ids)
                later[1].append(t)
            if len(later[0]) >= SHED_REPLY_IDS or t - later[1][0] >= SHED_HOLD_US:
                self._flush_sheds(ident)
            return
        send_parts(self.client, [ident, wire.reply(ids, Status.REJECTED, wire.OVERLOADED, detail)])
        self.shed_us[self.n_shed & (SHED_SAMPLES - 1)] = now_us() - t
        self.n_shed += 1

    def _flush_sheds(self, only: bytes | None = None) -> None:
        """Send the backlog sheds held back during this wake-up (see :meth:`_shed`), or only
        those of client ``only``."""
        if only is None:
            later, self._shed_later = self._shed_later, {}
        else:
            later = {only: self._shed_later.pop(only)}
        for ident, (ids, ts, detail) in later.items():
            send_parts(self.client, [ident, wire.reply(ids, Status.REJECTED, wire.OVERLOADED, detail)])
            t = now_us()
            for t0 in ts:
                self.shed_us[self.n_shed & (SHED_SAMPLES - 1)] = t - t0
                self.n_shed += 1

    def _reject(self, ident: bytes, cids: list[int], reason: str, st: ModelStats | None,
                detail: str = "") -> None:
        if st is not None:
            st.rejected[reason] += len(cids)
        else:
            self.unowned_rejects[reason] += len(cids)
        if cids:
            send_parts(self.client, [ident, wire.reply(cids, Status.REJECTED, reason, detail or None)])

    def _unknown_model(self, model: str) -> str:
        """What is served instead, and since when a removed model is gone."""
        serves = f"plan v{self.plan_version} serves {', '.join(self.model_names)}"
        v = self.removed_models.get(model)
        return f"unknown model {wire.brief(model)} ({f'it was removed by plan v{v}; ' if v else ''}{serves})"

    def _drop_reqs(self, reqs: list[Req], reason: str) -> None:
        """Reply DROPPED to each request, one message per client."""
        by: dict[tuple[bytes, int], list[int]] = defaultdict(list)
        for r in reqs:
            if r.query is not None:
                self.queries.stage_dropped(r, self.stats[r.model].dropped, reason)
                continue
            by[(r.ident, r.gen)].append(r.cid)
            self._end_unserved(r, self.stats[r.model].dropped, reason)
        for (ident, gen), cids in by.items():
            if self.connection_holds(ident, gen, len(cids)):
                send_parts(self.client, [ident, wire.reply(cids, Status.DROPPED, reason)])

    def _end_unserved(self, r: Req, outcomes: dict[str, int], reason: str) -> None:
        """Count accepted request ``r`` answered without a result (``outcomes``: the model's
        dropped or rejected counts): answered, its client's share given back, the high class."""
        st = self.stats[r.model]
        outcomes[reason] += 1
        st.answered += 1
        r.share.done()
        if r.prio:
            st.high[2] += 1

    def after_clients(self) -> None:
        if self._shed_later:
            self._flush_sheds()
        due = self._burst_start
        self._burst_start = 0
        if self._dirty_decide:
            self.decide(due)
        self._kick()

    def _kick(self) -> None:
        """Sends may consume the edge of ZeroMQ's FD: look at both sockets again this loop turn."""
        self.client_reader.kick()
        self.exe_reader.kick()

    # --- the core's decisions -----------------------------------------------------------------

    def decide(self, due: int) -> None:
        """Run the core at the current time and carry out what it says. ``due``: when this decision
        became due (first arrival of the burst, or the wake time), for the overhead figure."""
        self._dirty_decide = False
        if self.holding:  # a migration: requests wait in the queue until the new plan is in force
            return
        t = now_us()
        t0 = time.perf_counter()
        act = self.core.decide(float(t))
        self.metrics.decide.observe(time.perf_counter() - t0)
        if act.n_dispatch:
            self._dispatch(act, due)
        if act.n_drop:
            v = self._views(act)
            ids = v["drop_id"][:act.n_drop].tolist()
            why = v["drop_reason"][:act.n_drop].tolist()
            by: dict[tuple[bytes, int, str], list[int]] = defaultdict(list)
            for rid, w in zip(ids, why):  # noqa: B905
                r = self.reqs.pop(rid, None)
                if r is None:
                    continue
                reason = wire.EXECUTOR_LOST if r.retried else DROP_REASONS.get(w, wire.DEADLINE)
                if r.query is not None:
                    self.queries.stage_dropped(r, self.stats[r.model].dropped, reason)
                    continue
                self._end_unserved(r, self.stats[r.model].dropped, reason)
                by[(r.ident, r.gen, reason)].append(r.cid)
            for (ident, gen, reason), cids in by.items():
                if self.connection_holds(ident, gen, len(cids)):
                    send_parts(self.client, [ident, wire.reply(cids, Status.DROPPED, reason)])
        wake = act.wake_at
        if wake < math.inf:
            w = int(wake)
            if self.wake_entry is None or w < self.wake_at:
                if self.wake_entry is not None:
                    Timers.cancel(self.wake_entry)
                self.wake_at = w
                self.wake_entry = self.timers.call_at(w, self._on_wake, w)

    def _on_wake(self, w: int) -> None:
        self.wake_entry = None
        self.wake_at = math.inf
        late = now_us() - w
        self.wake_late[self.n_wake & (WAKE_SAMPLES - 1)] = late
        self.n_wake += 1
        self.decide(w)
        self._kick()

    def _views(self, act: Any) -> dict[str, np.ndarray]:
        """The core's output arrays. They are views into its arena, which is only ever replaced by
        a larger one, so they are fetched again only when the arena's size changes."""
        key = self.core.arena_bytes
        if key != self._views_key:
            self._v = {k: getattr(act, k) for k in _ACTION_VIEWS}
            self._views_key = key
        return self._v

    def _dispatch(self, act: Any, due: int) -> None:
        """Send every batch the core decided on, then do the bookkeeping: after a stall the core
        may dispatch a dozen batches at once, and the last should not wait for the others' books.

        The core's output arrays are read once each as Python lists (a numpy scalar read costs as
        much as a whole ``tolist`` of a few elements); each batch's reservations are walked once."""
        n = act.n_dispatch
        v = self._views(act)
        nr = act.n_res
        paths = v["path"][:n].tolist()
        nhops = v["n_hops"][:n].tolist()
        req0 = v["req_start"][:n].tolist()
        bss = v["bs"][:n].tolist()
        res0 = v["res_start"][:n].tolist()
        nres = v["n_res_of"][:n].tolist()
        models = v["model"][:n].tolist()
        finish = v["finish_us"][:n].tolist()
        handles = v["handle"][:nr].tolist()
        kinds = v["kind"][:nr].tolist()
        hops = v["hop"][:nr].tolist()
        starts = v["start_us"][:nr].tolist()
        rids = v["req_id"][:act.n_req].tolist()
        exe = self.exe
        pop = self.reqs.pop
        vgpu_exec = self.vgpu_exec
        sent = []
        for i in range(n):
            k = nhops[i]
            path = paths[i][:k]
            execs = [vgpu_exec[x] for x in path]
            q0 = req0[i]
            ids = rids[q0:q0 + bss[i]]
            rs = list(map(pop, ids))
            if None in execs:
                # cannot happen while the core only uses live vGPUs; be safe: back to the queue
                self._requeue(rs)
                continue
            # per hop: its inference's reservation and start, and the transfer into it (uplink of
            # the sending server, downlink of the receiving one)
            infer_h = [0] * k
            hop_start = [e.offset for e in execs]  # on each executor's clock
            link_h: list[tuple[int, int] | None] = [None] * k
            up = {}
            for j in range(res0[i], res0[i] + nres[i]):
                kind, hop = kinds[j], hops[j]
                if kind == 0:  # infer
                    infer_h[hop] = handles[j]
                    hop_start[hop] = int(starts[j]) + execs[hop].offset
                elif kind == 1:  # uplink
                    up[hop] = handles[j]
                elif kind == 2:  # downlink
                    link_h[hop] = (up.get(hop, -1), handles[j])
            bid = self.next_batch
            self.next_batch += 1
            batch = Batch(bid, models[i], path, infer_h, link_h, dict(zip(ids, rs)), finish[i])  # noqa: B905
            batch.span = finish[i] - min(starts[res0[i]:res0[i] + nres[i]], default=finish[i])
            batch.sent = due
            try:
                tags = wire.path_tags([e.key for e in execs], bid, path, hop_start) if k > 1 else ()
                send_parts(exe, [execs[0].ident, wire.dispatch(bid, path, hop_start, ids, tags),
                                 *[r.frame for r in rs]], NOBLOCK)
            except zmq.ZMQError as e:  # the executor's connection is gone (mandatory routing), or
                # it has left a million messages unread: either way it is not serving
                log.warning("dispatch-failed", vgpu=path[0], error=str(e))
                self._book(batch, due, 0)
                self.remove_executor(execs[0], "unreachable")  # loses the batch: requeued
                continue
            except Exception as e:  # noqa: BLE001 - a batch that cannot be encoded loses no request
                log.error("dispatch-unencodable", batch=bid, vgpus=format_ranges(path),
                          error=f"{type(e).__name__}: {e}")
                self._book(batch, due, 0)
                self.lose_batch(batch, "dispatch-failed")
                continue
            sent.append((batch, now_us()))
        for batch, t in sent:
            self._book(batch, due, t)

    def _book(self, b: Batch, due: int, sent_at: int) -> None:
        """Record dispatched batch ``b`` (its reservation handles serve feedback, and voiding them
        if it is lost), stats, and each request's overhead (``sent_at`` 0: not sent)."""
        self.batches[b.id] = b
        st = self.stats[b.model]
        st.batches += 1
        st.batch_reqs += len(b.reqs)
        if sent_at:
            ov = self.overhead
            j = self.n_overhead
            for r in b.reqs.values():
                a = r.arrival
                ov[j & (OVERHEAD_SAMPLES - 1)] = sent_at - (a if a > due else due)
                j += 1
            self.n_overhead = j

    def _requeue(self, reqs: list[Req]) -> None:
        """Put requests of a lost batch back in the core with their original deadlines."""
        t = now_us()
        late = []
        for r in reqs:
            if r.deadline <= t or (r.query is not None and r.query.answered):
                late.append(r)
                continue
            r.retried = True
            rid = self.next_rid
            self.next_rid += 1
            if r.query is not None:
                r.rid = rid
            self.reqs[rid] = r
            self.core.submit(rid, r.model, float(r.arrival), float(r.deadline), r.prio)
            self.counters["retried"] += 1
        if late:
            self._drop_reqs(late, wire.EXECUTOR_LOST)
        self._dirty_decide = True

    # --- executors ----------------------------------------------------------------------------

    def on_exec(self, msg: list) -> None:
        ident = msg[0].bytes
        if len(msg) < 2:
            self.counters["exec_malformed"] += 1
            return
        try:
            h = wire.decode(msg[1])
            kind = h.type
            ex = self.execs.get(ident)
            if kind == T.RESULT:
                if ex is not None:
                    if h.feedback:
                        self.on_feedback(ex, h.feedback)
                    self.on_result(ex, h, msg[2:])
            elif kind == T.FEEDBACK:
                if ex is not None:
                    self.on_feedback(ex, h.entries)
            elif kind == T.HEARTBEAT:
                if ex is None:
                    self._send_exec(ident, wire.error(wire.UNREGISTERED, "register first"))
                    return
                t = now_us()
                ex.last_seen = t
                ex.queued = h.queued
                ex.clock_sample(h.clock_us, t)
                if h.unreachable:
                    self._peer_unreachable(ex, h.unreachable, t)
                if not ex.ready and not ex.rewelcome and not h.loading:
                    self.ready(ex)
            elif kind == T.REGISTER:
                self.on_register(ident, h, peer_key(msg[1]))
            elif kind == T.BYE:
                if ex is not None:
                    self.remove_executor(ex, "bye")
            elif kind == T.PRELOADED:
                self.replanner.on_preloaded(ident, h.prep, h.load_us, h.error)
            else:
                raise wire.ProtocolError(wire.MALFORMED, f"an executor may not send {T(kind).name}")
            if ex is not None:
                ex.last_seen = now_us()
        except wire.ProtocolError as e:
            self.counters["exec_malformed"] += 1
            self.warn_limited("bad-executor-message", code=e.code, error=str(e)[:300])
            self._send_exec(ident, wire.error(e.code, str(e)))

    def warn_limited(self, event: str, **fields: Any) -> None:
        """A warning logged at most once a second per kind; the rest are only counted."""
        t = now_us()
        if t - self._warned.get(event, -WARN_EVERY_US) >= WARN_EVERY_US:
            self._warned[event] = t
            n = self.counters[f"suppressed_{event}"]
            self.counters[f"suppressed_{event}"] = 0
            log.warning(event, suppressed=n, **fields)
        else:
            self.counters[f"suppressed_{event}"] += 1

    def _send_exec(self, ident: bytes, *frames: Any) -> bool:
        """Send to an executor-socket peer without ever blocking: a peer that does not read its
        replies fills its queue, and a blocking send then stopped the whole loop for good (a
        DEALER flooding unregistered heartbeats and reading none did it in 8 s). What cannot
        go is dropped and counted; a registered executor that stops reading is found out by
        its heartbeats."""
        try:
            send_parts(self.exe, [ident, *frames], NOBLOCK)
            return True
        except zmq.Again:
            self.counters["exec_sends_dropped"] += 1
            return False
        except zmq.ZMQError:
            return False

    def after_execs(self) -> None:
        if self._dirty_decide:
            self.decide(now_us())
        self._kick()

    def on_register(self, ident: bytes, h: wire.Register, key: bytes | None = None) -> None:
        vgpus, endpoint, backend, pid, clock, incarnation = (h.vgpus, h.data_endpoint, h.backend, h.pid,
                                                             h.clock_us, h.incarnation)
        t = now_us()
        held = max((self.quarantined.get(v, (0, 0))[0] for v in vgpus), default=0)
        if t < held:  # (by vGPU: the same process on a new connection is the same executor)
            self.counters["register_refused"] += 1
            self._send_exec(ident, wire.error(wire.QUARANTINED, f"batches went overdue at vGPU(s) "
                                              f"{format_ranges(sorted(v for v in vgpus if self.quarantined.get(v, (0, 0))[0] > t))}; "
                                              f"taken back in {(held - t) / 1e6:.0f} s"))
            return
        sec = self.cfg.security
        if sec.curve:
            mine = sec.executors.get(key or b"", frozenset())
            if not set(vgpus) <= mine:
                self.counters["register_refused"] += 1
                self.warn_limited("register-unauthorized", vgpus=format_ranges(vgpus), pid=pid)
                self._send_exec(ident, wire.error(
                    "unauthorized-vgpu", f"this executor's key may serve vGPUs "
                    f"{format_ranges(sorted(mine)) or 'none'}, not {format_ranges(vgpus)}"))
                return
        if len(vgpus) > MAX_VGPUS_PER_EXEC:
            # (every registration is broadcast in PEERS: thousands of ids made it megabytes)
            self.warn_limited("register-refused", vgpus=len(vgpus), pid=pid)
            self._send_exec(ident, wire.error("unknown-vgpu", f"{len(vgpus)} vGPUs in one REGISTER "
                                              f"(at most {MAX_VGPUS_PER_EXEC})"))
            return
        bad = [v for v in vgpus if not 0 <= v < MAX_VGPU_ID]
        if bad or not vgpus:
            self.warn_limited("register-refused", vgpus=str(vgpus)[:200], pid=pid)
            self._send_exec(ident, wire.error("unknown-vgpu", f"vGPU id(s) {str(bad or vgpus)[:200]} out of "
                                              f"range (0-{MAX_VGPU_ID - 1}; the plan has 0-{self.nv - 1})"))
            return
        if len(endpoint) > MAX_ENDPOINT_CHARS or len(backend) > MAX_BACKEND_CHARS:
            # (both are kept, logged and shown: 900 kB backends wrote megabytes of log)
            self.counters["register_refused"] += 1
            self.warn_limited("register-refused", vgpus=format_ranges(vgpus), pid=pid,
                              error=f"data_endpoint of {len(endpoint)} and backend of {len(backend)} characters")
            self._send_exec(ident, wire.error(wire.MALFORMED, f"REGISTER: data_endpoint of {len(endpoint)} and "
                                              f"backend of {len(backend)} characters (at most "
                                              f"{MAX_ENDPOINT_CHARS} and {MAX_BACKEND_CHARS})"))
            return
        try:
            check_endpoint(endpoint, "data_endpoint", "REGISTER", self.cfg.allow_remote)
        except ConfigError as e:
            self.counters["register_refused"] += 1
            self.warn_limited("register-refused", vgpus=format_ranges(vgpus), pid=pid, error=str(e))
            self._send_exec(ident, wire.error("bad-endpoint", str(e)))
            return
        old = self.execs.get(ident)
        if old is not None and old.incarnation == incarnation and old.vgpus == list(vgpus):
            # a REGISTER repeated while we were starting, or asked for by a migration: answer
            # again (with the assignment in force); its next heartbeat comes after loading it
            old.rewelcome = False
            self._welcome(ident, vgpus)
            # and the directory: this executor may have been on standby, which learns none, and
            # the plan it registers for may have moved other vGPUs to other executors
            self._send_peers(only=old)
            return
        if old is not None:
            self.remove_executor(old, "re-registered", limited=True)
        t = now_us()
        for v in vgpus:
            prev = self.vgpu_exec[v] if v < self.nv else None
            if prev is None or prev.ident == ident:
                continue
            if t - prev.last_seen <= self.cfg.heartbeat_timeout_ms * 1000 and \
                    self._send_exec(prev.ident, wire.ALIVE_HEADER):
                # two live processes claim one vGPU (a config mistake): the first keeps it
                self.counters["vgpu_taken"] += 1
                self._send_exec(ident, wire.error(wire.VGPU_TAKEN, f"vGPU {v} is served by pid {prev.pid} "
                                                  f"({prev.endpoint}); retrying"))
                return
            self.remove_executor(prev, "replaced")  # a restarted executor takes over from the dead one
        ex = ExecState(ident, list(vgpus), endpoint, backend, pid, incarnation)
        ex.clock_sample(clock, now_us())
        self.execs[ident] = ex
        for v in vgpus:
            if v < self.nv:
                self.vgpu_exec[v] = ex
        self._welcome(ident, vgpus)
        standby = [v for v in vgpus if v >= self.nv]
        if len(standby) < len(vgpus):  # (a standby-only executor changes no one's directory)
            self._send_peers()
        # (a new incarnation on the same connection is no fresh start: a loop of them is limited)
        (self.warn_limited if old is not None else log.info)(
            "executor-registered", vgpus=format_ranges(vgpus), pid=pid, backend=backend, data=endpoint,
            standby=format_ranges(standby) if standby else "-")

    def _welcome(self, ident: bytes, vgpus: list[int]) -> None:
        """WELCOME with the assignments in force; vGPUs the plan lacks wait on standby until a plan
        has them (a replan to fewer vGPUs, or an executor started ahead of the plan that needs it).
        Only an executor with an assignment is told its key (see wire.hop_tag)."""
        assignments = self.wire_assignments(vgpus)
        ex = self.execs.get(ident)
        self._send_exec(ident, wire.welcome(assignments, self.cfg.heartbeat_interval_ms,
                                            ex.key if assignments and ex is not None else b""))

    def wire_assignments(self, vgpus: list[int], assignments: list[wire.Assignment] | None = None) -> list[list]:
        """The assignments (those in force by default) of the vGPUs among ``vgpus`` that the plan
        has, as WELCOME and PREPARE carry them; the others are on standby."""
        a = self.assignments if assignments is None else assignments
        return [a[v].to_wire() for v in vgpus if v < len(a)]

    def alive_vgpus(self) -> int:
        """vGPUs of the plan in force whose executor is ready."""
        return sum(1 for e in self.vgpu_exec if e is not None and e.ready)

    def _send_peers(self, only: ExecState | None = None) -> None:
        """The data endpoints of the plan's vGPUs, to the executors serving some of them (or to
        ``only``). Sent on every change of the directory or of who serves the plan: a
        registration, a removal, a plan switch (an executor on standby learns none until then).
        Why not standby ids too: they carry no batches, and any local process may register one;
        each registration broadcast to every peer made the daemon's memory grow with the cube of
        the connections (and a directory of thousands of ids exceeded the executors' header limit)."""
        directory = {v: e.endpoint for e in self.execs.values() for v in e.vgpus if v < self.nv}
        msg = wire.peers(directory)
        for e in [only] if only is not None else list(self.execs.values()):
            if any(v < self.nv for v in e.vgpus):
                self._send_exec(e.ident, msg)

    def _peer_unreachable(self, ex: ExecState, vgpus: list[int], t: int) -> None:
        """``ex`` gave up forwarding batches to ``vgpus`` (its heartbeat says): a directory it
        lacks or a peer it cannot connect to. Not silent: counted, logged, shown in status (and
        ``ppiped-ctl executors``); the directory is sent to it again, which mends a stale one."""
        vs = sorted({v for v in vgpus[:MAX_VGPUS_PER_EXEC] if v < MAX_VGPU_ID})
        self.counters["peer_unreachable"] += len(vs)
        ex.unreachable, ex.unreachable_at = vs, t
        self.warn_limited("peer-unreachable", pid=ex.pid, vgpus=format_ranges(ex.vgpus),
                          unreachable=format_ranges(vs),
                          known=format_ranges([v for v in vs if v < self.nv and self.vgpu_exec[v] is not None]))
        self._send_peers(only=ex)

    def unreachable_peers(self, ex: ExecState, t: int) -> str:
        """The next hops ``ex`` reported unreachable within the last heartbeat timeout ('' if none)."""
        if ex.unreachable and t - ex.unreachable_at <= self.cfg.heartbeat_timeout_ms * 1000:
            return format_ranges(ex.unreachable)
        return ""

    def ready(self, ex: ExecState) -> None:
        ex.ready = True
        for v in ex.vgpus:
            if v < self.nv:
                self.core.restore_vgpu(v)
        self._dirty_decide = True
        log.info("executor-ready", vgpus=format_ranges(ex.vgpus), pid=ex.pid,
                 alive=self.alive_vgpus())

    def _blame_overdue(self, b: Batch, t: int) -> None:
        """Charge an overdue batch to the executor that stalled it, where the evidence says which:
        hop 0's when no hop reported (it had the DISPATCH from us), the last hop's when every
        hop reported but no RESULT came, and the first silent hop's when its heartbeats say it
        holds work (else the hop before may not have forwarded it, or a peer lies: nobody is
        charged, so no healthy executor is). A batch that comes through clears every executor
        on its path. One charged ``OVERDUE_STRIKES`` times in a row, over more than the
        heartbeat timeout, while it kept heartbeating (running nothing: a hung backend, an
        impostor) is removed and its vGPUs refused for a while, doubling each time, so batches
        stop flowing into it."""
        k = len(b.path)
        hop = next((j for j, x in enumerate(b.times) if x is None), k)
        v = b.path[min(hop, k - 1)]
        ex = self.vgpu_exec[v] if v < self.nv else None
        if ex is None or self.execs.get(ex.ident) is not ex or not (hop in (0, k) or ex.queued > 0):
            return
        ex.overdue += 1
        if ex.overdue == 1:
            ex.overdue_since = t
        # a stall shorter than the heartbeat timeout (a pause, a slow first run) is not enough,
        # nor is silence (that is the heartbeat rule's): it kept talking and ran nothing
        if ex.overdue < OVERDUE_STRIKES or t - ex.overdue_since < self.cfg.heartbeat_timeout_ms * 1000 \
                or t - ex.last_seen > self.cfg.heartbeat_interval_ms * 4000:
            return
        strikes = max((self.quarantined.get(u, (0, 0))[1] for u in ex.vgpus), default=0)
        hold = min(QUARANTINE_MAX_US, QUARANTINE_US << min(strikes, 16))
        for u in ex.vgpus:
            self.quarantined[u] = (t + hold, strikes + 1)
        self.counters["executors_quarantined"] += 1
        log.warning("executor-quarantined", vgpus=format_ranges(ex.vgpus), pid=ex.pid,
                    batches_overdue=ex.overdue, hold_s=hold / 1e6)
        self.remove_executor(ex, f"{ex.overdue} batches overdue in a row")

    def remove_executor(self, ex: ExecState, why: str, limited: bool = False) -> None:
        """Forget ``ex`` and requeue its batches; ``limited``: its log line goes through
        :meth:`warn_limited` (a peer re-registering in a loop wrote two lines per message)."""
        if self.execs.get(ex.ident) is not ex:
            return
        del self.execs[ex.ident]
        self.replanner.forget(ex.ident)
        dead = set(ex.vgpus)
        for v in ex.vgpus:
            if v >= self.nv:
                continue
            if self.vgpu_exec[v] is ex:
                self.vgpu_exec[v] = None
            if ex.ready:
                self.core.remove_vgpu(v)
        lost = [b for b in self.batches.values() if not b.answered and dead.intersection(b.path)]
        for b in lost:
            self.lose_batch(b, why)
        self.counters["executors_lost"] += 1
        (self.warn_limited if limited else log.warning)(
            "executor-removed", vgpus=format_ranges(ex.vgpus), pid=ex.pid, reason=why, batches_lost=len(lost))
        if any(v < self.nv for v in ex.vgpus):
            self._send_peers()
        self._dirty_decide = True

    def lose_batch(self, b: Batch, why: str) -> None:
        """A batch will not finish: void its reservations, cancel it along its path, requeue its requests."""
        b.answered = True
        b.done_at = now_us()
        self.counters["batches_lost"] += 1
        for h, hop_t in zip(b.infer_h, b.times):  # noqa: B905
            if hop_t is None:
                self.core.report(h, 0.0, 0.0)
        for lh in b.link_h:
            if lh is not None:
                for h in lh:
                    if h >= 0:
                        self.core.report(h, 0.0, 0.0)
        msg = wire.cancel([b.id])
        for ex in {self.vgpu_exec[v] for v in b.path} - {None}:
            self._send_exec(ex.ident, msg)
        reqs = list(b.reqs.values())
        b.reqs.clear()
        self._requeue(reqs)

    def on_result(self, ex: ExecState, h: wire.Result, frames: list) -> None:
        bid, ids, meta, failed = h.batch, h.ids, h.meta, h.failed
        if len(failed) % 2 or not all(type(failed[i]) is int and type(failed[i + 1]) is str
                                      for i in range(0, len(failed), 2)):
            raise wire.ProtocolError(wire.MALFORMED, "RESULT.failed: expected a flat list "
                                     "[request id, reason string, ...]")
        b = self.batches.get(bid)
        if b is None or b.answered:
            # (a batch this scheduler never dispatched: forged, or from before a restart)
            self.counters["late_results" if bid < self.next_batch else "results_never_dispatched"] += 1
            return
        if len(frames) != len(ids):
            raise wire.ProtocolError(wire.MALFORMED, f"RESULT for {len(ids)} requests carries {len(frames)} frames")
        # Results only from the executor holding the batch's last hop; failures from any hop;
        # nothing from off the path (an empty RESULT from a standby process was taken, and its
        # lateness sample fed the admission window)
        last = self.vgpu_exec[b.path[-1]] if b.path[-1] < self.nv else None
        if last is not ex and (ids or not any(v < self.nv and self.vgpu_exec[v] is ex for v in b.path)):
            self.counters["foreign_results"] += 1
            self.warn_limited("foreign-result", batch=bid, pid=ex.pid, vgpus=format_ranges(ex.vgpus),
                              path=b.path)
            return
        if ids:  # a batch came through: every executor on its path is doing its job
            for v in b.path:
                e = self.vgpu_exec[v] if v < self.nv else None
                if e is not None:
                    e.overdue = 0
        st = self.stats[b.model]
        t = now_us()
        st.late.append(t - b.finish)
        if t >= self.adjust_at:
            self.adjust_limits(t)
        # GPU time per request of this batch, from the hops measured so far
        per = sum(x[2] - x[1] for x in b.times if x is not None) / (b.size or 1)
        wasted = 0
        staged: list = []  # stage requests of queries: (request, frame, late)
        if ids:
            by: dict[bytes, tuple[list[int], list]] = {}
            for rid, f in zip(ids, frames):  # noqa: B905
                r = b.reqs.pop(rid, None)
                if r is None:
                    continue
                sh = r.share
                sh.n -= 1
                if not sh.n:
                    sh.st.clients -= 1
                if t > r.deadline:
                    wasted += 1
                elif r.prio:
                    st.high[1] += 1
                if r.query is not None:
                    staged.append((r, f, t > r.deadline))
                    continue
                e = by.get((r.ident, r.gen))
                if e is None:
                    e = by[(r.ident, r.gen)] = ([], [])
                e[0].append(r.cid)
                e[1].append(f)
            for (ident, gen), (cids, fs) in by.items():
                if self.connection_holds(ident, gen, len(cids)):
                    send_parts(self.client, [ident, wire.reply(cids, Status.OK, "", meta), *fs])
                st.ok += len(cids)
                st.answered += len(cids)
                st.gpu_us += per * len(cids)
            st.ok_late += wasted
            st.invalid_us += per * wasted
            for r, f, late in staged:
                st.ok += 1
                st.answered += 1
                st.gpu_us += per
                self.queries.stage_result(r, f, meta, per, late)
        if failed:
            for i in range(0, len(failed) - 1, 2):
                r = b.reqs.pop(failed[i], None)
                if r is None:
                    continue
                st.gpu_us += per
                st.invalid_us += per
                text = str(failed[i + 1])
                code = text.split(":", 1)[0]
                status = Status.REJECTED if code == wire.BAD_INPUT else Status.DROPPED
                reason = wire.BAD_INPUT if status == Status.REJECTED else code
                if r.query is not None:
                    self.queries.stage_dropped(r, st.rejected if status == Status.REJECTED else st.dropped,
                                               reason, text)
                    continue
                self._end_unserved(r, st.rejected if status == Status.REJECTED else st.dropped, reason)
                if self.connection_holds(r.ident, r.gen, 1):
                    send_parts(self.client, [r.ident, wire.reply([r.cid], status, reason, text)])
        if not b.reqs:
            b.answered = True
            b.done_at = t
            self._maybe_forget(b)

    def adjust_limits(self, t: int) -> None:
        """Every ``ADJUST_US``: each model's admission window, additive-increase /
        multiplicative-decrease on how late its executors are.

        Past the executors' capacity (or the event loop's, which reads their results) the core's
        reservations still say "on time" while a queue grows behind them: results come later and
        later after their reserved ends, then requests miss their SLOs, and at worst the core
        drops them at their deadlines, after spending the loop's time on them. The median of
        that lateness over an interval, against a quarter of the SLO, says when. Two such
        intervals in a row (one may be a stall of the host, which the queue absorbs), or one past
        half the SLO, shrink the window to 0.8 x the most that was in flight, and the excess is
        refused ``overloaded`` on arrival. While results are on time and the window refuses
        something, it grows again, slowly (the knee is near); after ``CALM_INTERVALS`` with
        neither, it is lifted, so a later burst is not held to an old limit."""
        self.adjust_at = t + ADJUST_US
        for i, st in enumerate(self.stats):
            late = st.late
            if not late:
                continue
            late.sort()
            med, slo = late[len(late) >> 1], self.slo_us[i]
            was_late, st.was_late = st.was_late, med > max(LATE_FLOOR_US, slo >> 2)
            if st.was_late:
                if was_late or med > slo >> 1:
                    st.limit = max(MIN_LIMIT, int(min(st.limit, st.peak) * 0.8))
                st.calm = 0
            elif st.limited:
                st.limit = min(self.cfg.max_pending, int(st.limit * 1.1) + MIN_LIMIT // 4)
                st.calm = 0
            else:
                st.calm += 1
                if st.calm >= CALM_INTERVALS:
                    st.limit = math.inf
            late.clear()
            st.limited = False
            st.peak = st.accepted - st.answered

    def on_feedback(self, ex: ExecState, entries: list[int]) -> None:
        """Hop times an executor measured (its clock, less its offset): they go to the batch, the
        vGPU's busy time and, as reports, to the core, which corrects the reservations by them."""
        off = ex.offset
        busy = self.busy_us
        k = wire.FEEDBACK_STRIDE
        hs: list[int] = []
        ts: list[float] = []
        te: list[float] = []
        vgpu_exec, nv = self.vgpu_exec, self.nv
        horizon = now_us() + FEEDBACK_AHEAD_US
        for i in range(0, len(entries) - k + 1, k):
            v, bid, hop, ready, start, end = entries[i:i + k]
            b = self.batches.get(bid)
            if b is None or not 0 <= hop < len(b.path) or b.path[hop] != v or b.times[hop] is not None:
                self.counters["stale_feedback"] += 1
                continue
            # only the executor serving that vGPU reports its hops, and only times that happened:
            # a forged end far ahead pushed every later reservation back and stopped serving; a
            # start long before the batch was sent inflated the GPU time counted for good
            ready, start, end = ready - off, start - off, end - off
            if not (0 <= v < nv and vgpu_exec[v] is ex) or not (
                    b.sent - FEEDBACK_AHEAD_US <= ready <= end <= horizon and b.sent - FEEDBACK_AHEAD_US <= start <= end):
                self.counters["foreign_feedback"] += 1
                self.warn_limited("foreign-feedback", batch=bid, hop=hop, vgpu=v, pid=ex.pid,
                                  vgpus=format_ranges(ex.vgpus))
                continue
            b.times[hop] = (ready, start, end)
            hs.append(b.infer_h[hop])
            ts.append(start)
            te.append(end)
            busy[v] += end - start
            last = len(b.path) - 1
            if hop == last:
                self.metrics.reservation_error(end - b.finish)
            # the transfer into a hop is known once both ends are: into this hop, into the next
            if hop > 0:
                self._link_report(b, hop, hs, ts, te)
            if hop < last:
                self._link_report(b, hop + 1, hs, ts, te)
            if b.answered:
                self._maybe_forget(b)
        if len(hs) < REPORT_MANY_FROM:  # the usual few: cheaper than building three arrays
            report = self.core.report
            for h, a, e in zip(hs, ts, te):  # noqa: B905 - appended together
                report(h, float(a), float(e))  # floats: one compiled signature
        else:
            self.core.report_many(np.array(hs, dtype=np.int64), np.array(ts, dtype=np.float64),
                                  np.array(te, dtype=np.float64))

    @staticmethod
    def _link_report(b: Batch, hop: int, hs: list[int], ts: list[float], te: list[float]) -> None:
        """The transfer into ``hop`` really ran from the previous hop's end to this hop's input arrival."""
        lh = b.link_h[hop]
        prev, cur = b.times[hop - 1], b.times[hop]
        if lh is None or prev is None or cur is None:
            return
        a = prev[2]
        e = max(cur[0], prev[2] + 1)
        for h in lh:
            if h >= 0:
                hs.append(h)
                ts.append(a)
                te.append(e)
        b.link_h[hop] = None

    def _maybe_forget(self, b: Batch) -> None:
        if None not in b.times:
            self.batches.pop(b.id, None)

    # --- housekeeping -------------------------------------------------------------------------

    def housekeeping(self) -> None:
        """Every heartbeat interval: silent executors, overdue batches, table GC."""
        if self.stopping:
            return
        # heartbeats that queued while this loop was busy count: read them before judging silence
        self.exe_reader.drain_now()
        t = now_us()
        timeout = self.cfg.heartbeat_timeout_ms * 1000
        for ex in list(self.execs.values()):
            if t - ex.last_seen > timeout:
                self.remove_executor(ex, "silent")
            elif not self._send_exec(ex.ident, wire.ALIVE_HEADER):
                self.remove_executor(ex, "disconnected")  # its connection closed: it died
        grace = self.cfg.result_grace_ms * 1000
        for b in list(self.batches.values()):
            if not b.answered:
                # a long batch on a loaded host overruns by a share of its length, not a fixed time
                if t > b.finish + max(grace, b.span):
                    log.warning("batch-overdue", batch=b.id, path=b.path, late_ms=round((t - b.finish) / 1000, 1))
                    self.lose_batch(b, "overdue")
                    self._blame_overdue(b, t)
            elif t - b.done_at > DONE_BATCH_KEEP_US:
                self.batches.pop(b.id, None)
        self.core.gc(float(t - 1000))
        for v, (until, _) in list(self.quarantined.items()):  # strikes are forgiven in time
            if t > until + QUARANTINE_MAX_US:
                del self.quarantined[v]
        if t >= self.prune_at:
            self.prune_at = t + CLIENT_PRUNE_US
            self.forget_clients(t)
        self.rates.update([s.accepted for s in self.stats], t)
        self.replanner.maybe_auto()
        if self._dirty_decide:
            self.decide(t)
        self._kick()
        self.timers.call_at(t + self.cfg.heartbeat_interval_ms * 1000, self.housekeeping)

    # --- ctl ----------------------------------------------------------------------------------

    def on_ctl(self, msg: list) -> None:
        self.ctl_reader.flood()  # a backlog here is a flood: paced once it outlasts a slice
        ident = msg[0].bytes
        delim = len(msg) > 2 and len(msg[1]) == 0
        body = msg[2] if delim else (msg[1] if len(msg) > 1 else b"")
        try:
            req = json.loads(bytes(body.buffer) or b"{}")
            cmd = req.get("cmd", "status") if isinstance(req, dict) else None
            if cmd == "status":
                out = self.status()
            elif cmd in ("reset-overhead", "stop") and not self.cfg.ctl.startswith("ipc://") \
                    and not self.cfg.security.curve:
                # Anyone who can reach a TCP port could send it; a unix socket has file permissions.
                out = {"error": f"{wire.brief(cmd)} is refused on a TCP ctl endpoint (status only); use an "
                                "ipc:// endpoints.ctl, or ppiped-ctl over the ctl unix socket"}
            elif cmd == "reset-overhead":
                self.n_overhead = self.n_wake = self.n_shed = 0
                out = {"ok": True}
            elif cmd == "stop":
                self.loop.call_soon(self.stop)
                out = {"ok": True}
            else:
                out = {"error": f"unknown command {wire.brief(cmd)} (status, reset-overhead, stop)"}
        except (ValueError, AttributeError, RecursionError) as e:
            out = {"error": f"bad request: {type(e).__name__}: {e}"[:1000]}
        frames = [ident, b""] if delim else [ident]
        self.ctl.send_multipart([*frames, json.dumps(out).encode()])
        self.ctl_reader.kick()

    @property
    def handler_errors(self) -> int:
        """Messages whose socket handler raised, over every reader (see ``Reader._failed``)."""
        return sum(r.handler_errors for r in getattr(self, "readers", ()))

    def all_stats(self) -> list[tuple[str, ModelStats]]:
        """Every model served since start, by name: the plan's, then those a replan removed
        (cumulative counts: totals and Prometheus counters never go backwards)."""
        return [*zip(self.model_names, self.stats, strict=True), *self.removed_stats.items()]

    def _totals(self) -> dict[str, int]:
        every = [s for _, s in self.all_stats()]
        return {"accepted": sum(s.accepted for s in every), "ok": sum(s.ok for s in every),
                "dropped": sum(sum(s.dropped.values()) for s in every),
                "rejected": sum(sum(s.rejected.values()) for s in every) + sum(self.unowned_rejects.values())}

    @staticmethod
    def _pcts(a: np.ndarray, n: int) -> dict[str, float]:
        k = min(n, len(a))
        if k == 0:
            return {"n": 0}
        a = a[:k]
        p50, p99, p999 = np.percentile(a, [50, 99, 99.9])
        return {"n": int(n), "p50": float(p50), "p99": float(p99), "p999": float(p999), "max": float(a.max())}

    def overhead_us(self) -> dict[str, float]:
        return self._pcts(self.overhead, self.n_overhead)

    def status(self) -> dict[str, Any]:
        lay = self.layout
        t = now_us()
        models = {}
        up = (t - self.started) / 1e6
        for i, m in enumerate(self.model_names):
            s = self.stats[i]
            models[m] = {"slo_ms": self.slo_us[i] / 1000, "accepted": s.accepted, "ok": s.ok,
                         "ok_late": s.ok_late, **s.outcomes(up),
                         "dropped": dict(s.dropped), "rejected": dict(s.rejected),
                         "in_flight": s.accepted - s.answered, "clients": s.clients,
                         "limit": s.limit if math.isfinite(s.limit) else None,
                         "pending": self.core.pending(i), "batches": s.batches,
                         "mean_batch": s.batch_reqs / s.batches if s.batches else 0.0}
        classes: dict[str, dict[str, Any]] = {}
        for v in range(self.nv):
            g = lay.pool_gpu[int(lay.v_pool[v])]
            c = classes.setdefault(g, {"vgpus": 0, "alive": 0, "busy_us": 0.0, "gpu_share": 0.0})
            c["vgpus"] += 1
            c["gpu_share"] += 1.0 / int(lay.v_split[v])
            ex = self.vgpu_exec[v]
            c["alive"] += int(ex is not None and ex.ready)
            c["busy_us"] += float(self.busy_us[v])
        return {
            "now_us": t, "uptime_s": (t - self.started) / 1e6, "plan": self.plan.source,
            "cpu_s": time.process_time(),
            "policy": self.core.policy.name, "models": models, "gpu_classes": classes,
            "executors": [{"vgpus": format_ranges(e.vgpus), "pid": e.pid, "backend": e.backend, "ready": e.ready,
                           "endpoint": e.endpoint, "silent_ms": (t - e.last_seen) / 1000,
                           "clock_offset_us": e.offset, "unreachable_peers": self.unreachable_peers(e, t)}
                          for e in self.execs.values()],
            "vgpus": {"total": self.nv, "alive": sum(c["alive"] for c in classes.values()),
                      "missing": format_ranges([v for v in range(self.nv) if self.vgpu_exec[v] is None])},
            "busy_us": list(self.busy_us),
            "in_flight_batches": sum(1 for b in self.batches.values() if not b.answered),
            "queued": len(self.reqs), "clients": len(self.peers), "client_identities": len(self.ident_gen),
            "overhead_us": self.overhead_us(),
            "wake_late_us": self._pcts(self.wake_late, self.n_wake),
            "shed_us": self._pcts(self.shed_us, self.n_shed),
            "counters": {**self.counters, "handler_errors": self.handler_errors},
            "core": self.core.stats(), "totals": self._totals(), "apps": self.queries.status(),
        }

