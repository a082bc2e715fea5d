"""Live replanning and plan migration (PPipe §5.1).

The daemon measures each model's arrival rate (an EWMA of accepted requests), plans in a child
process (:func:`ppiped.planner.plan_async`, so the event loop never waits on CBC) with the plan's
cluster and the measured mix, then migrates:

1. preload, while serving: build and warm up the new plan's core, and send every executor its
   next assignment (PREPARE); each loads the partitions that change in the background (a blocking
   backend's load runs in its worker thread) and answers PRELOADED. The daemon waits for every
   answer, at most ``replan.preload_timeout_ms``; a straggler falls back to loading at the switch;
2. hold: stop dispatching; requests keep arriving into the deadline queue;
3. flush: wait until every in-flight batch is answered (bounded; an overdue one is requeued);
4. switch: move the queued requests into the new core with their original deadlines, hand every
   executor its new assignment at once (ERROR ``unregistered`` makes it re-register, and the
   WELCOME it gets back carries the new partition: a preloaded executor only swaps its workers
   in), and count a vGPU in only when its executor heartbeats after the swap;
5. resume: dispatching restarts as soon as the preloaded executors are back (all of them, when
   none preloaded); a straggler's vGPUs join when it is ready.

The new plan may serve other models: requests queued for a model it drops are answered DROPPED
``model-removed``, later ones are rejected ``unknown-model``; a model it adds is accepted from the
switch on. It may also use more vGPUs than have executors: those stay out of service in the core
(and show as missing in ``ppiped-ctl status``/``executors``) until an executor registers for them.

Every request is answered: queued ones move, in-flight ones finish or are requeued, and the new
core drops (with a reply) whatever it can no longer serve in time.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import time
from typing import TYPE_CHECKING, Any

from .. import logs, wire
from ..core.layout import Layout
from ..core.scheduler import Scheduler
from ..errors import InputError, UserError
from ..plan import Plan, check_weights, format_plan_table, refuse_for_serving
from .config import format_ranges
from .loop import Timers, now_us
from .state import save_plan_in_force

if TYPE_CHECKING:
    from .server import Server

log = logs.get("ppiped.replan")


class RateMeter:
    """Per-model arrival rate: an EWMA with time constant ``tau_s`` over accepted-request counts."""

    def __init__(self, n: int, tau_s: float) -> None:
        self.tau_s = tau_s
        self.rates = [0.0] * n
        self.last = [0] * n
        self.t = now_us()
        self.samples = 0

    def remap(self, old: list[str], new: list[str]) -> None:
        """The plan's models changed: keep each kept model's rate, start added ones at zero."""
        r, c = dict(zip(old, self.rates, strict=True)), dict(zip(old, self.last, strict=True))
        self.rates = [r.get(m, 0.0) for m in new]
        self.last = [c.get(m, 0) for m in new]

    def update(self, counts: list[int], t: int) -> None:
        dt = (t - self.t) / 1e6
        if dt <= 0:
            return
        a = 1.0 - math.exp(-dt / self.tau_s)
        for i, c in enumerate(counts):
            self.rates[i] += a * ((c - self.last[i]) / dt - self.rates[i])
            self.last[i] = c
        self.t = t
        self.samples += 1


def mix_drift(rates: list[float], weights: list[float]) -> float:
    """Total-variation distance between the measured load shares and the plan's weight shares."""
    tr, tw = sum(rates), sum(weights)
    if tr <= 0 or tw <= 0:
        return 0.0
    return 0.5 * sum(abs(r / tr - w / tw) for r, w in zip(rates, weights, strict=True))


def weights_from_rates(rates: list[float]) -> list[float] | None:
    """The measured mix as planner weights (a model with no traffic keeps a small share)."""
    top = max(rates, default=0.0)
    if top <= 0:
        return None
    return [max(r, 0.01 * top) / top for r in rates]


class Replanner:
    """One replan at a time: plan in a child, then migrate the server to the new plan."""

    def __init__(self, srv: Server) -> None:
        self.srv = srv
        self.task: asyncio.Task | None = None
        self.last_end = time.monotonic()
        self.last: dict[str, Any] = {}
        self.history: list[dict[str, Any]] = []
        self.prep_id = 0  # the latest PREPARE sent
        self.waiting: set[bytes] = set()  # executors whose answer to the current PREPARE is awaited
        self.answers: dict[bytes, tuple[int, str]] = {}  # current PREPARE: executor -> (load µs, error)
        self.answered: asyncio.Event | None = None

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()

    def maybe_auto(self) -> None:
        """Housekeeping: replan when the mix drifted past the threshold, at most every min_interval_s."""
        srv, cfg = self.srv, self.srv.cfg
        if not cfg.replan_auto or self.busy or srv.stopping:
            return
        if time.monotonic() - self.last_end < cfg.replan_min_interval_s:
            return
        if srv.rates.samples * cfg.heartbeat_interval_ms / 1000 < cfg.replan_ewma_s:
            return  # the EWMA has not settled yet
        weights = [srv.plan.model(m).weight for m in srv.model_names]
        d = mix_drift(srv.rates.rates, weights)
        if d >= cfg.replan_drift:
            log.info("replan-auto", drift=round(d, 3), threshold=cfg.replan_drift)
            self.start(None, False, trigger=f"drift {d:.3f}")

    def start(self, weights: list[float] | None, dry_run: bool, trigger: str = "ctl",
              plan: Plan | None = None) -> asyncio.Task:
        if self.busy:
            raise InputError("a replan is already running")
        self.task = asyncio.get_running_loop().create_task(self.run(weights, dry_run, trigger, plan))
        return self.task

    async def run(self, weights: list[float] | None, dry_run: bool, trigger: str,
                  plan: Plan | None = None) -> dict[str, Any]:
        srv = self.srv
        t0 = time.monotonic()
        out: dict[str, Any] = {"trigger": trigger, "dry_run": dry_run, "from_version": srv.plan_version,
                               "started_s": round(t0, 3)}
        try:
            if plan is None:
                if weights is None:
                    weights = weights_from_rates(srv.rates.rates) or [srv.plan.model(m).weight
                                                                            for m in srv.model_names]
                weights = check_weights(weights, srv.model_names)
                out["weights"] = dict(zip(srv.model_names, weights, strict=True))
                plan = await self.compute(weights)
            out["plan_s"] = round(time.monotonic() - t0, 3)
            out["plan"] = format_plan_table(plan)
            if not dry_run:
                out.update(await migrate(srv, plan))
            else:
                _new_core(srv, plan)  # what a switch would refuse, a dry run refuses too
            out["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported to the operator; the old plan stays
            out.update(ok=False, error=str(e) if isinstance(e, UserError) else f"{type(e).__name__}: {e}")
            log.warning("replan-failed", error=out["error"])
        out["duration_s"] = round(time.monotonic() - t0, 3)
        out["ended_s"] = round(time.monotonic(), 3)
        out["version"] = srv.plan_version
        result = "dry-run" if dry_run and out["ok"] else ("ok" if out["ok"] else "failed")
        srv.metrics.replans[result] = srv.metrics.replans.get(result, 0) + 1
        if out["ok"] and not dry_run:
            srv.metrics.replan_s = out["duration_s"]
        self.last_end = time.monotonic()
        self.last = {k: v for k, v in out.items() if k != "plan"}
        self.history = [*self.history[-9:], self.last]
        return out

    async def compute(self, weights: list[float]) -> Plan:
        from ..planner import make_request, plan_in_subprocess

        srv = self.srv
        req = make_request(srv.profiles, srv.model_names, weights, srv.plan.cluster, srv.plan.params,
                           srv.cfg.replan_algo, srv.cfg.replan_time_limit_s,
                           slos_us=[srv.plan.model(m).slo_us for m in srv.model_names])
        # plan_in_subprocess in a thread, not plan_async: uvloop spawns with fork(), which copies
        # this large process's page tables on the loop thread (tens of ms without dispatching);
        # the subprocess module uses vfork() off the loop
        task = asyncio.get_running_loop().run_in_executor(None, plan_in_subprocess, req)
        try:
            for _ in range(20):  # the child is CPU-heavy for a while: let serving have the CPU first
                await asyncio.sleep(0.002)
                if renice_children(PLANNER) or task.done():
                    break
            plan = await task
            plan.apps = list(srv.plan.apps)  # every model keeps its SLO, so the stage budgets hold
            return plan
        except asyncio.CancelledError:  # shutdown: do not leave the thread waiting on CBC
            for pid in children(PLANNER):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            raise

    # --- preloading: PREPARE out, PRELOADED back -----------------------------------------------

    def prepare(self, assignments: dict[bytes, list[list]]) -> None:
        """Send each executor its next assignment; :meth:`wait_preloaded` waits for the answers."""
        srv = self.srv
        self.prep_id += 1
        self.waiting, self.answers = set(), {}
        self.answered = asyncio.Event()
        for ident, a in assignments.items():
            if srv._send_exec(ident, wire.prepare(self.prep_id, a)):
                self.waiting.add(ident)
        if not self.waiting:
            self.answered.set()

    async def wait_preloaded(self, timeout_s: float) -> None:
        if self.answered is not None and not self.answered.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.answered.wait(), timeout_s)

    def on_preloaded(self, ident: bytes, prep: int, load_us: int, error: str) -> None:
        if prep != self.prep_id or ident not in self.waiting:  # an earlier PREPARE's, or unasked
            self.srv.counters["stale_preloaded"] += 1
            return
        self.waiting.discard(ident)
        self.answers[ident] = (load_us, error)
        if error:
            log.warning("preload-failed", executor=ident.decode(errors="replace"), error=error)
        self._check()

    def forget(self, ident: bytes) -> None:
        """An executor left: stop waiting for its answer."""
        self.waiting.discard(ident)
        self._check()

    def _check(self) -> None:
        if not self.waiting and self.answered is not None:
            self.answered.set()


PLANNER = "ppiped.planner.solve"


def renice_children(marker: str, niceness: int = 19) -> int:
    """Lower the priority of this process's children whose command line contains ``marker``;
    returns how many. The planning child inherits the daemon's priority otherwise, and on a small
    host it would take CPU from the event loop while a migration is being prepared."""
    n = 0
    for pid in children(marker):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, pid, niceness)
            n += 1
    return n


def children(marker: str) -> list[int]:
    """PIDs of this process's children whose command line contains ``marker`` (Linux /proc)."""
    me = os.getpid()
    out = []
    for d in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as f:
                stat = f.read()
            if int(stat.rsplit(b")", 1)[1].split()[1]) != me:
                continue
            with open(f"/proc/{d}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            continue
    return out


def _new_profiles(srv: Server, plan: Plan) -> dict:
    """Profiles of the models ``plan`` serves that the daemon does not serve yet, as the config
    names them."""
    missing = [m.model for m in plan.models if m.model not in srv.profiles]
    if not missing:
        return {}
    from ..profiles import load_profiles

    if srv.cfg.profiles is None:
        raise InputError(f"the new plan serves {', '.join(missing)}: no profiles directory configured")
    return load_profiles(srv.cfg.profiles, missing)


def placeable(srv: Server, plan: Plan) -> None:
    """Raise what a switch to ``plan`` would refuse (profiles, splits, blocks, GPUs), without
    building a core; safe off the event loop (reads only)."""
    profiles = {**srv.profiles, **_new_profiles(srv, plan)}
    Layout.from_plan(plan, profiles)
    refuse_for_serving(plan, profiles)
    _slos_within_limit(srv, plan)


def _slos_within_limit(srv: Server, plan: Plan) -> None:
    """As at start: a model's SLO (the config's override, else the plan's) past
    ``limits.max_slo_ms`` would have its own requests refused (a plan's 1e308 µs was taken)."""
    cfg = srv.cfg
    for m in plan.models:
        slo = cfg.slo_us(m.model, m.slo_us)
        if slo > cfg.max_slo_ms * 1000:
            raise InputError(f"the new plan's SLO of {m.model} ({slo / 1000:.6g} ms) is over limits.max_slo_ms "
                             f"({cfg.max_slo_ms:g})")


def _new_core(srv: Server, plan: Plan) -> Scheduler:
    srv.profiles.update(_new_profiles(srv, plan))
    refuse_for_serving(plan, srv.profiles)
    _slos_within_limit(srv, plan)
    core = Scheduler(plan, srv.profiles, policy=srv.policy_name, **srv.core_kw)
    for v in range(core.layout.num_vgpus):
        core.remove_vgpu(v)
    t = float(now_us())  # compile-and-cache every entry point before the switch, not after
    core.submit(-1, 0, t, t + 1.0)
    core.cancel(-1, 0)
    core.decide(t)
    core.report(-1, t, t)
    core.gc(t)
    return core


async def preload(srv: Server, core: Scheduler) -> tuple[set[bytes], dict[str, Any]]:
    """Step 1 for the executors: PREPARE each with its next assignment and wait (bounded) for the
    answers, serving meanwhile; returns the executors that preloaded and the figures."""
    rp = srv.replanner
    timeout_ms = srv.cfg.replan_preload_timeout_ms
    if timeout_ms <= 0:
        return set(), {"preload": "off"}
    lay = core.layout
    nxt = [srv._assignment(v, lay) for v in range(lay.num_vgpus)]
    t0 = now_us()
    # only executors the new plan gives work: one on standby (or an intruder holding spare vGPU
    # ids) has nothing to preload, and waiting on its swap held dispatch for two heartbeat timeouts
    rp.prepare({ex.ident: a for ex in srv.execs.values() if (a := srv.wire_assignments(ex.vgpus, nxt))})
    sent = set(rp.waiting)
    await rp.wait_preloaded(timeout_ms / 1000)
    done = {i for i, (_, err) in rp.answers.items() if not err} & set(srv.execs)
    loads = [us / 1000 for us, err in rp.answers.values() if not err]
    state = "none" if not done else ("all" if done == sent else "partial")
    return done, {"preload": state, "preloaded_executors": len(done), "executors": len(sent),
                  "preload_ms": round((now_us() - t0) / 1000, 2),
                  "load_ms_max": round(max(loads, default=0.0), 2),
                  "stragglers": len(rp.waiting), "preload_failed": sum(1 for _, e in rp.answers.values() if e)}


def cancel_preload(srv: Server) -> None:
    """A migration given up after PREPARE: re-PREPARE the assignments in force, which loads nothing
    and makes every executor drop what it preloaded."""
    srv.replanner.prepare({ex.ident: srv.wire_assignments(ex.vgpus) for ex in srv.execs.values()})


async def migrate(srv: Server, plan: Plan) -> dict[str, Any]:
    """Preload, hold, flush, switch, resume; returns the figures of the migration."""
    core = _new_core(srv, plan)  # 1. preload, while serving
    # glue callables the new plan's apps add: their workers start off the loop, or the plan is refused
    pool = srv.queries.pool_for(plan.apps)
    if pool is not None:
        await asyncio.get_running_loop().run_in_executor(
            None, srv.queries.start_pool, pool, plan.apps, plan.source or "the new plan")
    switched = False
    try:
        preloaded, pre = await preload(srv, core)
    except BaseException:
        cancel_preload(srv)
        if pool is not None:
            pool.close()
        raise
    t_hold = now_us()
    srv.holding = True  # 2. hold
    if srv.wake_entry is not None:
        Timers.cancel(srv.wake_entry)
        srv.wake_entry, srv.wake_at = None, math.inf
    try:
        limit_ms = srv.cfg.replan_flush_timeout_ms or (max(srv.slo_us) / 1000 + srv.cfg.result_grace_ms)
        end = t_hold + int(limit_ms * 1000)
        while any(not b.answered for b in srv.batches.values()) and now_us() < end:  # 3. flush
            await asyncio.sleep(0.001)
        overdue = [b for b in srv.batches.values() if not b.answered]
        for b in overdue:
            srv.lose_batch(b, "migration")
        t_switch = now_us()
        moved, removed = switch(srv, plan, core)  # 4. switch
        switched = True
        if pool is not None:
            srv.queries.swap_pool(pool)
        try:
            save_plan_in_force(srv.cfg, plan, srv.plan_version)  # a restart serves it too
        except OSError as e:
            log.warning("state-plan-not-saved", error=str(e))
        # 5. resume once the preloaded executors have swapped (all executors, when none preloaded;
        # bounded: then the new core serves with the vGPUs it has and drops, with a reply, what it
        # cannot serve); stragglers and executors still to come join when they are ready
        wait = [e for e in srv.execs.values() if e.ident in preloaded] if preloaded else list(srv.execs.values())
        end = now_us() + int(max(1000, 2 * srv.cfg.heartbeat_timeout_ms) * 1000)
        while now_us() < end and not all(e.ready or srv.execs.get(e.ident) is not e for e in wait):
            await asyncio.sleep(0.0002)
    except BaseException:
        if not switched:
            cancel_preload(srv)
            if pool is not None:
                pool.close()
        raise
    finally:
        srv.holding = False
        srv._dirty_decide = True
        srv.decide(now_us())
        srv._kick()
    t_ready = now_us()
    pause_ms = (t_ready - t_hold) / 1000
    srv.metrics.pause_s = pause_ms / 1000
    sdnotify_status(srv)
    alive = srv.alive_vgpus()
    figures = {**pre, "pause_ms": round(pause_ms, 2), "flush_ms": round((t_switch - t_hold) / 1000, 2),
               "switch_ms": round((t_ready - t_switch) / 1000, 2), "moved_requests": moved,
               "dropped_model_removed": removed, "requeued_batches": len(overdue),
               "max_slo_ms": max(srv.slo_us) / 1000, "vgpus_alive": alive, "vgpus": srv.nv,
               "vgpus_missing": format_ranges(missing_vgpus(srv))}
    log.info("migrated", version=srv.plan_version, **figures)
    return figures


def switch(srv: Server, plan: Plan, core: Scheduler) -> tuple[int, int]:
    """Swap the core and the assignments, move the queue, re-welcome every executor at once;
    returns (requests moved, requests dropped because the new plan removed their model)."""
    old = srv.core
    index = {m: i for i, m in enumerate(core.layout.models)}
    gone = []
    for rid, r in list(srv.reqs.items()):
        old.cancel(rid, r.model)
        m = index.get(srv.model_names[r.model])
        if m is None:
            gone.append(r)
            del srv.reqs[rid]
            continue
        r.model = m  # the new plan's model index (stats move to it in install_plan)
        core.submit(rid, m, float(r.arrival), float(r.deadline), priority=r.prio)
    if gone:  # counted under the old model indices, before install_plan re-indexes the stats
        srv._drop_reqs(gone, wire.MODEL_REMOVED)
    srv.batches.clear()  # answered; their late feedback would name the old core's reservations
    srv.install_plan(plan, core)
    # the new plan's directory first: an executor on standby until now knows no peer, and the
    # others know no endpoint for its vGPUs (a re-registration that is only re-welcomed sends none)
    srv._send_peers()
    msg = wire.error(wire.UNREGISTERED, f"plan v{srv.plan_version}: register again for the new assignment")
    for ex in list(srv.execs.values()):
        ex.ready = False
        ex.rewelcome = True
        srv._send_exec(ex.ident, msg)
    return len(srv.reqs), len(gone)


def missing_vgpus(srv: Server) -> list[int]:
    """vGPUs of the plan in force that no executor has registered for."""
    return [v for v in range(srv.nv) if srv.vgpu_exec[v] is None]


def sdnotify_status(srv: Server) -> None:
    from . import sdnotify

    sdnotify.notify(f"STATUS=plan v{srv.plan_version}: serving {len(srv.model_names)} models on {srv.nv} vGPUs")
