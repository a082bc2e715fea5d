"""Apps in the daemon: a QUERY becomes stage requests in the core's queue, glue calls in the glue
workers, and exactly one ANSWER.

:class:`Queries` is the server's seam for multi-model queries. The server calls it at five
points — a QUERY arrives (:meth:`Queries.on_query`), a stage request has its result
(:meth:`Queries.stage_result`), a stage request ends without one (:meth:`Queries.stage_dropped`:
dropped by the core, failed at an executor, lost, shut down), a lost batch's stage request is
queued again (:meth:`Queries.requeued`), and shutdown (:meth:`Queries.close`) — and every request
of a query is a :class:`StageReq`, so the server tells them apart by ``r.query``. What to submit
and when a query is over is the pure :class:`~ppiped.query.tracker.QueryTracker`'s call; this
module carries it out with the wall clock, the core and ZeroMQ.

Accounting: a stage request is a request of its model (accepted, answered, GPU time, fair
share of its client), so the models' admission windows see the apps' load. When a query fails
or is answered late, the GPU time its stage requests already used becomes invalid (the model's
``invalid_us`` and the app's), as does that of results that come in for a query already over.
Stage requests still queued when their query fails are withdrawn from the core and counted
dropped ``query-failed``; those already in a batch run, and their results are discarded.
"""

from __future__ import annotations

import math
import os
import traceback
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from .. import logs, wire
from ..query.app import App
from ..query.glue import GluePool, GlueSpec, glue_spec
from ..query.tracker import Glue, QueryTracker, Submit
from ..security import peer_key
from ..wire import Status
from .config import ConfigError
from .loop import now_us, send_parts
from .server import Peer, Req, Share

if TYPE_CHECKING:
    from .server import Server

log = logs.get("ppiped.apps")

QUERY_FAILED = "query-failed"  # a stage request withdrawn because its query failed elsewhere


class AppStats:
    """Per app: what status, ctl and metrics show."""

    __slots__ = ("offered", "accepted", "ok", "ok_late", "rejected", "dropped", "stage_requests",
                 "glue_calls", "gpu_us", "invalid_us", "in_flight")

    def __init__(self, stages: list[str]) -> None:
        self.offered = self.accepted = self.ok = self.ok_late = self.in_flight = 0
        self.rejected: dict[str, int] = defaultdict(int)
        self.dropped: dict[str, dict[str, int]] = {s: defaultdict(int) for s in stages}
        # (defaultdicts: a replan may give the app other stages under the same name)
        self.stage_requests: dict[str, int] = defaultdict(int, dict.fromkeys(stages, 0))
        self.glue_calls: dict[str, int] = defaultdict(int, dict.fromkeys(stages[1:], 0))
        self.gpu_us = 0.0
        self.invalid_us = 0.0

    def to_json(self) -> dict[str, Any]:
        answered = self.ok + sum(sum(d.values()) for d in self.dropped.values())
        return {"offered": self.offered, "accepted": self.accepted, "ok": self.ok, "late": self.ok_late,
                "dropped": {s: dict(d) for s, d in self.dropped.items() if d},
                "rejected": dict(self.rejected), "in_flight": self.in_flight,
                "attainment": (self.ok - self.ok_late) / answered if answered else 1.0,
                "stage_requests": dict(self.stage_requests), "glue_calls": dict(self.glue_calls),
                "gpu_s": self.gpu_us / 1e6, "invalid_gpu_s": self.invalid_us / 1e6,
                "invalid_rate": self.invalid_us / self.gpu_us if self.gpu_us else 0.0}


class Query:
    """One query from QUERY to ANSWER."""

    __slots__ = ("app", "stats", "ident", "qid", "peer", "frame", "prio", "tracker", "reqs", "spent",
                 "answered", "keep_all", "gen")

    def __init__(self, app: App, stats: AppStats, ident: bytes, qid: int, peer: Peer, frame: Any,
                 prio: int, tracker: QueryTracker) -> None:
        self.app, self.stats, self.ident, self.qid, self.peer = app, stats, ident, qid, peer
        self.frame, self.prio, self.tracker = frame, prio, tracker
        self.gen = 0  # the connection behind ``ident`` when it came (Server.ident_gen)
        self.reqs: dict[int, StageReq] = {}  # node -> its live request
        # (model, GPU µs, already invalid for the model: its result was past its own deadline)
        self.spent: list[tuple[str, float, bool]] = []
        self.answered = False


class StageReq(Req):
    """A request of one stage of a query: ``query``, its ``node`` in the query's tracker, and
    ``rid``, its id in the core's queue (a lost batch's request is queued again under a new one)."""

    __slots__ = ("query", "node", "rid", "ended")

    def __init__(self, ident: bytes, frame: Any, model: int, arrival: int, deadline: int, prio: int,
                 share: Share, query: Query, node: int, rid: int) -> None:
        super().__init__(ident, 0, frame, model, arrival, deadline, prio, share)
        self.query = query
        self.node = node
        self.rid = rid
        self.ended = False


class Queries:
    """The apps the plan in force serves, their glue workers and their queries in flight."""

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        cfg = srv.cfg
        self.mode = cfg.app_deadlines
        self.apps: dict[str, App] = {}
        self.stats: dict[str, AppStats] = {}
        self.live: dict[tuple[bytes, int], Query] = {}
        self.install(srv.plan.apps)
        self.pool: GluePool | None = None
        self.pool = self.pool_for(srv.plan.apps)

    def install(self, apps: list[App]) -> None:
        """The apps of the plan in force (checked against the deadline mode; stats kept by name)."""
        srv = self.srv
        for a in apps:
            if self.mode != "e2e" and not a.split_done:
                raise ConfigError(f"{srv.cfg.source}: scheduler.app_deadlines = {self.mode!r}: app {a.name!r} "
                                  "has no SLO split in the plan (plan it with its stage budgets, or use e2e)")
            if a.slo_us > srv.cfg.max_slo_ms * 1000:
                raise ConfigError(f"{srv.cfg.source}: app {a.name!r}: SLO {a.slo_us / 1000:g} ms is above "
                                  f"limits.max_slo_ms = {srv.cfg.max_slo_ms:g}")
        self.apps = {a.name: a for a in apps}
        for a in apps:
            if a.name not in self.stats:
                self.stats[a.name] = AppStats([s.name for s in a.stages])

    def pool_for(self, apps: list[App]) -> GluePool | None:
        """A glue pool (not started) for ``apps`` when the one running lacks some of their
        callables, with the running one's too (its queries in flight may still call them)."""
        need = {s.glue for a in apps for s in a.stages if s.glue}
        have = set(self.pool.refs) if self.pool is not None else set()
        if need <= have:
            return None
        cfg = self.srv.cfg
        return GluePool(sorted(need | have), cfg.glue_workers, cfg.glue_timeout_ms / 1000, cfg.glue_max_children)

    def start_pool(self, pool: GluePool, apps: list[App], source: str) -> None:
        """Start ``pool``'s workers (blocking: before the daemon serves, or off the loop during a
        replan); a callable that does not import is a ConfigError naming the app, stage and
        callable, and the pool is closed."""
        try:
            errors = pool.start()
        except RuntimeError as e:
            raise ConfigError(f"{self.srv.cfg.source}: glue: {e}") from None
        if errors:
            pool.close()
            lines = [f"app {a.name!r}, stage {s.name!r}: glue {s.glue}: {errors[s.glue]}"
                     for a in apps for s in a.stages if s.glue in errors]
            raise ConfigError(f"{source}: cannot import glue callable(s): " + "; ".join(lines))

    def start(self) -> None:
        """Start the glue workers before the daemon serves: an import error stops it."""
        if self.pool is None:
            return
        self.start_pool(self.pool, list(self.apps.values()), self.srv.plan.source)
        self.pool.attach(self.srv.loop)
        log.info("glue-workers", workers=self.pool.n, callables=",".join(self.pool.refs))

    def swap_pool(self, pool: GluePool) -> None:
        """A replan's started pool takes every new glue call; the old one stops once every query
        from before the switch is over (none outlives ``limits.max_slo_ms``)."""
        old, self.pool = self.pool, pool
        pool.attach(self.srv.loop)
        log.info("glue-workers", workers=pool.n, callables=",".join(pool.refs))
        if old is not None:
            cfg = self.srv.cfg
            self.srv.loop.call_later((cfg.max_slo_ms + cfg.glue_timeout_ms) / 1000 + 1.0, old.close)

    def close(self) -> None:
        """Shutdown: answer every query still open, stop the glue workers."""
        for q in list(self.live.values()):
            self._fail(q, "", wire.SHUTDOWN, "the daemon is stopping")
        if self.pool is not None:
            self.pool.close()

    # --- QUERY --------------------------------------------------------------------------------

    def on_query(self, ident: bytes, h: wire.Query, msg: list, t: int) -> None:
        """A QUERY: refused at once, or its root stage request queued. Never raises: a bug here
        still answers the query (``failed``) and is logged."""
        try:
            self._on_query(ident, h, msg, t)
        except Exception as e:
            q = self.live.get((ident, h.qid))
            self._internal(e, q)
            if q is None:
                send_parts(self.srv.client, [ident, wire.answer(h.qid, Status.REJECTED, wire.FAILED, "",
                                                                f"internal error: {type(e).__name__}")])

    def _internal(self, e: Exception, q: Query | None) -> None:
        """A bug met while serving query ``q``: logged (rate-limited), and the query answered."""
        self.srv.counters["query_internal_errors"] += 1
        tb = traceback.extract_tb(e.__traceback__)
        self.srv.warn_limited("query-internal-error", error=f"{type(e).__name__}: {e}",
                              at=" < ".join(f"{os.path.basename(f.filename)}:{f.lineno}" for f in tb[::-1][:4]))
        if q is not None and not q.answered:
            q.tracker.fail("", wire.FAILED, f"internal error: {type(e).__name__}")
            try:
                self._answer(q)
            except Exception:  # noqa: BLE001 - nothing more to do than what was logged
                q.answered = True
                self.live.pop((q.ident, q.qid), None)

    def _on_query(self, ident: bytes, h: wire.Query, msg: list, t: int) -> None:
        name, slo_us, qid, stages, prio, sent = h.app, h.slo_us, h.qid, h.stages, h.priority, h.sent_us
        srv = self.srv
        frames = msg[2:]
        app = self.apps.get(name)

        def refuse(reason: str, detail: str, stage: str = "") -> None:
            if app is not None:
                self.stats[app.name].rejected[reason] += 1
            srv.counters[f"query_{reason}"] += 1
            send_parts(srv.client, [ident, wire.answer(qid, Status.REJECTED, reason, stage, detail)])

        if h.epoch and h.epoch != srv.epoch:  # sent to an earlier scheduler (see Server.on_submit)
            srv.counters["stale_epoch"] += 1
            send_parts(srv.client, [ident, wire.answer(qid, Status.DROPPED, wire.DAEMON_RESTARTED, "",
                                                       "sent to an earlier scheduler")])
            return None
        if app is None:
            return refuse(wire.UNKNOWN_APP, f"unknown app {wire.brief(name)} (plan v{srv.plan_version} serves "
                          f"{', '.join(self.apps) or 'no apps'})")
        ast = self.stats[app.name]
        ast.offered += 1
        if len(frames) != 1:
            return refuse(wire.MALFORMED, f"QUERY carries {len(frames)} frames; it takes exactly one")
        if prio >= wire.PRIORITIES or stages > 1:
            return refuse(wire.MALFORMED, f"QUERY.priority {prio}: 0 (low) or 1 (high)" if prio >= wire.PRIORITIES
                          else f"QUERY.stages {stages}: 0 or 1")
        if slo_us > app.slo_us:
            return refuse(wire.MALFORMED, f"SLO {slo_us / 1000:g} ms is above app {app.name!r}'s "
                          f"{app.slo_us / 1000:g} ms")
        if (ident, qid) in self.live:
            return refuse(wire.MALFORMED, f"query id {qid} is already in flight on this connection")
        root = app.stages[0]
        frame = frames[0]
        if len(frame) > srv.cfg.max_payload_bytes:
            return refuse(wire.PAYLOAD_TOO_LARGE, f"frame of {len(frame)} bytes, limits.max_payload_bytes "
                          f"{srv.cfg.max_payload_bytes}", root.name)
        models = [srv.model_index.get(s.model) for s in app.stages]
        if None in models:
            gone = [s.model for s, m in zip(app.stages, models, strict=True) if m is None]
            return refuse(wire.MODEL_REMOVED, f"the plan in force lacks model(s) {', '.join(gone)}")
        want = srv.input_bytes[models[0]]
        if want and len(frame) != want:
            return refuse(wire.BAD_INPUT, f"frame of {len(frame)} bytes; model {root.model!r} takes {want}",
                          root.name)
        if srv.stopping or srv.draining:
            return refuse(wire.SHUTDOWN, "draining" if srv.draining else "stopping")
        slo = slo_us or int(app.slo_us)
        peer = srv.peers.get(ident)
        if peer is None or (srv.cfg.security.curve and peer.key != peer_key(msg[1])):
            peer = srv._new_peer(ident, msg[1], t)
        peer.seen = t
        delay = peer.queue_delay(t, sent, slo)
        if delay >= slo:
            ast.accepted += 1
            ast.dropped[root.name][wire.DEADLINE] += 1
            srv.counters["late_on_arrival"] += 1
            send_parts(srv.client, [ident, wire.answer(qid, Status.DROPPED, wire.DEADLINE, root.name,
                                                       f"queued {delay / 1000:.1f} ms before it was read")])
            return None
        # overload: a backlogged socket, too many queries, or a stage model at its window or queue
        # (refused before its first stage: the root stage is named)
        since = srv.client_reader.busy_since
        if since and t - since > min(srv.max_backlog_us, slo >> 1):
            return refuse(wire.OVERLOADED, f"client socket backlogged {(t - since) / 1000:.1f} ms", root.name)
        if len(self.live) >= srv.cfg.max_pending or len(srv.reqs) >= srv.cfg.max_pending:
            return refuse(wire.OVERLOADED, f"{len(self.live)} queries in flight, {len(srv.reqs)} requests "
                          f"queued (limits.max_pending {srv.cfg.max_pending})", root.name)
        for s, m in zip(app.stages, models, strict=True):
            full = self._window_full(srv.stats[m], s.model)
            if full:
                return refuse(wire.OVERLOADED, full, s.name)
        tr = QueryTracker(app, self.mode, float(t - delay), float(t - delay + slo), keep_all=bool(stages))
        q = Query(app, ast, ident, qid, peer, frame, prio, tr)
        q.gen = srv.ident_gen.get(ident, 0)
        self.live[(ident, qid)] = q
        ast.accepted += 1
        ast.in_flight += 1
        self._submit(q, tr.start(float(t), self._estimate(app, t)), [frame], t)
        return None

    # --- events from the server ---------------------------------------------------------------

    def stage_result(self, r: Any, frame: Any, meta: Any, gpu_us: float, late: bool) -> None:
        """Stage request ``r`` has its result (the server counted it OK for its model; ``late``:
        past its own deadline, so the model counted its GPU time invalid already). The app counts
        its GPU time invalid only if the query fails or is late."""
        q: Query = r.query
        r.ended = True
        try:
            self._stage_result(q, r, frame, meta, gpu_us, late)
        except Exception as e:
            self._internal(e, q)

    def _stage_result(self, q: Query, r: Any, frame: Any, meta: Any, gpu_us: float, late: bool) -> None:
        q.reqs.pop(r.node, None)
        q.stats.gpu_us += gpu_us
        if q.answered:  # its query is over: the work was for nothing
            if not late:
                self.srv.stats[r.model].invalid_us += gpu_us
            q.stats.invalid_us += gpu_us
            return
        q.spent.append((self.srv.model_names[r.model], gpu_us, late))
        if self.srv.stopping and q.tracker.app.children(q.tracker.nodes[r.node].stage):
            self._fail(q, q.app.stages[q.tracker.nodes[r.node].stage].name, wire.SHUTDOWN, "the daemon is stopping")
            return
        glue = q.tracker.stage_done(r.node, (frame, meta))
        for g in glue:
            self._glue(q, g, frame, meta)
        if q.tracker.finished:
            self._answer(q)

    def stage_dropped(self, r: Any, outcomes: dict[str, int], reason: str, detail: str = "") -> None:
        """Stage request ``r`` ended without a result (``outcomes``: its model's dropped or
        rejected counts): counted there once, and its query fails at its stage."""
        if r.ended:
            return
        r.ended = True
        self.srv._end_unserved(r, outcomes, reason)
        q: Query = r.query
        q.reqs.pop(r.node, None)
        if q.answered:
            return
        if reason not in (wire.DEADLINE, wire.NO_CAPACITY, wire.EARLY_DROP, wire.BAD_INPUT, wire.SHUTDOWN,
                          wire.EXECUTOR_LOST, wire.MODEL_REMOVED):
            detail = f"{reason}: {detail}" if detail else reason
            reason = wire.FAILED
        try:
            q.tracker.stage_failed(r.node, reason, detail)
            self._answer(q)
        except Exception as e:
            self._internal(e, q)

    def requeued(self, r: Any, rid: int) -> None:
        """A lost batch's stage request is queued again under id ``rid``."""
        r.rid = rid

    # --- internals ----------------------------------------------------------------------------

    def _estimate(self, app: App, t: int) -> Any:
        """The core's estimate of a stage's next ``n`` requests (e2e deadlines only)."""
        if self.mode != "e2e":
            return None
        srv = self.srv
        models = [srv.model_index.get(s.model) for s in app.stages]

        def est(stage: int, n: int) -> float:
            m = models[stage]
            if m is None:
                return 0.0
            v = srv.core.stage_estimate_us(m, float(t), n)
            return v if math.isfinite(v) else app.slo_us  # no live pipeline: nothing fits
        return est

    def _submit(self, q: Query, subs: list[Submit], frames: list, t: int) -> None:
        """Queue stage requests ``subs`` (``frames``: their inputs, in order) in the core."""
        if not subs:
            return
        srv = self.srv
        app = q.app
        for sub, frame in zip(subs, frames, strict=True):
            stage = app.stages[sub.stage]
            if srv.stopping:
                self._fail(q, stage.name, wire.SHUTDOWN, "the daemon is stopping")
                return
            m = srv.model_index.get(stage.model)
            if m is None:
                q.tracker.fail(stage.name, wire.MODEL_REMOVED, f"the plan in force lacks model {stage.model!r}")
                self._answer(q)
                return
            st = srv.stats[m]
            # a glue's children count against the same bounds as the query itself did: one
            # query must not queue max_children^depth requests past max_pending and the windows
            why = (f"{len(srv.reqs)} requests queued (limits.max_pending {srv.cfg.max_pending})"
                   if len(srv.reqs) >= srv.cfg.max_pending else self._window_full(st, stage.model))
            if why:
                st.limited = True
                srv.counters["query_children_refused"] += 1
                self._fail(q, stage.name, wire.OVERLOADED, why)
                return
            sh = q.peer.shares.get(stage.model)
            if sh is None or sh.st is not st:
                sh = q.peer.shares[stage.model] = Share(st)
            rid = srv.next_rid
            srv.next_rid += 1
            deadline = int(sub.deadline_us)
            r = StageReq(q.ident, frame, m, t, deadline, q.prio, sh, q, sub.node, rid)
            srv.reqs[rid] = r
            q.reqs[sub.node] = r
            srv.core.submit(rid, m, float(t), float(deadline), q.prio)
            if not sh.n:
                st.clients += 1
            sh.n += 1
            st.accepted += 1
            if q.prio:
                st.high[0] += 1
            q.stats.stage_requests[stage.name] += 1
        srv._dirty_decide = True

    @staticmethod
    def _window_full(st: Any, model: str) -> str:
        """Why model ``model``'s admission window takes no more requests ('' if it does)."""
        if st.accepted - st.answered < st.limit:
            return ""
        st.limited = True
        return f"model {model!r}: {st.accepted - st.answered} requests in flight, admission window {st.limit}"

    def _glue(self, q: Query, g: Glue, frame: Any, meta: Any) -> None:
        app = q.app
        stage = app.stages[g.stage]
        q.stats.glue_calls[stage.name] += 1
        assert self.pool is not None  # an app with a child stage has glue, so a pool
        spec = self._spec(app, g.stage)

        def done(out: list[bytes] | None, reason: str, detail: str) -> None:
            self._glue_done(q, g, out, reason, detail)

        self.pool.call(stage.glue, _bytes(frame), meta, _bytes(q.frame), spec, done,
                       int(q.tracker.deadline_us))

    def _glue_done(self, q: Query, g: Glue, out: list[bytes] | None, reason: str, detail: str) -> None:
        """A glue call ended (on the loop, from the glue pool): submit its children or fail."""
        srv = self.srv
        if q.answered:
            return
        try:
            if out is None:
                q.tracker.glue_failed(g.stage, reason, detail)
            else:
                t = now_us()
                subs = q.tracker.glue_done(g.parent, g.stage, len(out), float(t), self._estimate(q.app, t))
                self._submit(q, subs, out, t)
            if q.tracker.finished:
                self._answer(q)
        except Exception as e:
            self._internal(e, q)
        if srv.stopping:
            return
        if srv._dirty_decide:
            srv.decide(now_us())
        srv._kick()

    def _spec(self, app: App, i: int) -> GlueSpec:
        srv = self.srv
        idx = {s.model: srv.model_index.get(s.model) for s in app.stages}
        inputs = {name: srv.input_specs[m] for name, m in idx.items() if m is not None}
        m = idx[app.stages[i].model]
        return glue_spec(app, i, inputs, srv.input_bytes[m] if m is not None else 0)

    def _fail(self, q: Query, stage: str, reason: str, detail: str) -> None:
        q.tracker.fail(stage, reason, detail)
        self._answer(q)

    def _answer(self, q: Query) -> None:
        """Send the query's one ANSWER if its tracker says it is over; withdraw what is left."""
        tr = q.tracker
        if q.answered or not tr.finished:
            return
        q.answered = True
        srv = self.srv
        self.live.pop((q.ident, q.qid), None)
        ast = q.stats
        ast.in_flight -= 1
        t = now_us()
        if tr.failed is None:
            outs = tr.outputs()
            entries = [wire.output_entry(s, k, final, o[1]) for s, k, final, o in outs]
            frames = [o[0] for _s, _k, _f, o in outs]
            if srv.connection_holds(q.ident, q.gen, 1):
                send_parts(srv.client, [q.ident, wire.answer(q.qid, Status.OK, "", "", "", entries), *frames])
            ast.ok += 1
            if t > tr.deadline_us:
                ast.ok_late += 1
                self._invalidate(q)
        else:
            stage, reason, detail = tr.failed
            status = Status.REJECTED if reason == wire.BAD_INPUT else Status.DROPPED
            if srv.connection_holds(q.ident, q.gen, 1):
                send_parts(srv.client, [q.ident, wire.answer(q.qid, status, reason, stage, detail)])
            ast.dropped.setdefault(stage or "-", defaultdict(int))[reason] += 1
            self._invalidate(q)
            self._withdraw(q)
        q.frame = None

    def _invalidate(self, q: Query) -> None:
        """The GPU time of the query's stage results so far was for nothing."""
        for model, us, counted in q.spent:
            m = self.srv.model_index.get(model)
            if m is not None and not counted:
                self.srv.stats[m].invalid_us += us
            q.stats.invalid_us += us
        q.spent.clear()

    def _withdraw(self, q: Query) -> None:
        """Cancel the failed query's stage requests still queued in the core; the others (in
        batches) run, and their results are discarded when they come."""
        srv = self.srv
        for r in list(q.reqs.values()):
            if srv.reqs.get(r.rid) is r and srv.core.cancel(r.rid, r.model):
                del srv.reqs[r.rid]
                r.ended = True
                q.reqs.pop(r.node, None)
                srv._end_unserved(r, srv.stats[r.model].dropped, QUERY_FAILED)

    def info(self) -> dict[str, Any]:
        """What a client needs to send an app queries (PONG): its SLO and stages."""
        return {a.name: {"slo_ms": a.slo_us / 1000,
                         "stages": [{"name": s.name, "model": s.model,
                                     "after": a.stages[s.parent].name if s.parent >= 0 else None}
                                    for s in a.stages]}
                for a in self.apps.values()}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"deadlines": self.mode, "queries_in_flight": len(self.live),
                               "apps": {n: s.to_json() for n, s in self.stats.items()}}
        if self.pool is not None:
            out["glue"] = self.pool.status()
        return out


def _bytes(f: Any) -> bytes:
    return f.bytes if hasattr(f, "bytes") else bytes(f)

