"""Live replanning and plan migration (PPipe §5.1).

The daemon measures each model's arrival rate (an EWMA of accepted requests), plans in a child
process (:func:`ppiped.planner.plan_async`, so the event loop never waits on CBC) with the plan's
cluster and the measured mix, then migrates:

1. preload: build and warm up the new plan's core while the old one keeps serving;
2. hold: stop dispatching; requests keep arriving into the deadline queue;
3. flush: wait until every in-flight batch is answered (bounded; an overdue one is requeued);
4. switch: move the queued requests into the new core with their original deadlines, hand every
   executor its new assignment at once (ERROR ``unregistered`` makes it re-register, and the
   WELCOME it gets back carries the new partition), and count a vGPU in only when its executor
   heartbeats after loading;
5. resume: dispatching restarts as soon as the executors are back.

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
from ..core.scheduler import Scheduler
from ..errors import InputError
from ..plan import Plan, format_plan_table
from .loop import Timers, now_us

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
        out: dict[str, Any] = {"trigger": trigger, "dry_run": dry_run, "from_version": srv.plan_version}
        try:
            if plan is None:
                if weights is None:
                    weights = weights_from_rates(srv.rates.rates) or [srv.plan.model(m).weight
                                                                            for m in srv.model_names]
                out["weights"] = dict(zip(srv.model_names, weights, strict=True))
                plan = await self.compute(weights)
            out["plan_s"] = round(time.monotonic() - t0, 3)
            out["plan"] = format_plan_table(plan)
            if not dry_run:
                out.update(await migrate(srv, plan))
            out["ok"] = True
        except Exception as e:  # noqa: BLE001 - reported to the operator; the old plan stays
            out.update(ok=False, error=f"{type(e).__name__}: {e}" if not isinstance(e, InputError) else str(e))
            log.warning("replan-failed", error=out["error"])
        out["duration_s"] = round(time.monotonic() - t0, 3)
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
        if len(weights) != len(srv.model_names) or any(not w > 0 for w in weights):
            raise InputError(f"weights: expected {len(srv.model_names)} positive numbers "
                             f"({', '.join(srv.model_names)}), got {weights}")
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
            return await task
        except asyncio.CancelledError:  # shutdown: do not leave the thread waiting on CBC
            for pid in children(PLANNER):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            raise


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


def _new_core(srv: Server, plan: Plan) -> Scheduler:
    if [m.model for m in plan.models] != srv.model_names:
        raise InputError(f"the new plan serves {[m.model for m in plan.models]}, the daemon "
                         f"serves {srv.model_names}: a migration keeps the models")
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


async def migrate(srv: Server, plan: Plan) -> dict[str, Any]:
    """Preload, hold, flush, switch, resume; returns the figures of the migration."""
    core = _new_core(srv, plan)  # 1. preload, while serving
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
        moved = switch(srv, plan, core)  # 4. switch
        want = sum(len(e.vgpus) for e in srv.execs.values())
        # 5. resume once every executor has loaded its new partition (or after a timeout: then the
        # new core serves with the vGPUs it has and drops, with a reply, what it cannot serve)
        end = now_us() + int(max(1000, 2 * srv.cfg.heartbeat_timeout_ms) * 1000)
        while now_us() < end and sum(len(e.vgpus) for e in srv.execs.values() if e.ready) < want:
            await asyncio.sleep(0.0005)
    finally:
        srv.holding = False
        srv._dirty_decide = True
        srv.decide(now_us())
        srv._kick()
    t_ready = now_us()
    pause_ms = (t_ready - t_hold) / 1000
    srv.metrics.pause_s = pause_ms / 1000
    sdnotify_status(srv)
    figures = {"pause_ms": round(pause_ms, 2), "flush_ms": round((t_switch - t_hold) / 1000, 2),
               "all_ready_ms": round((t_ready - t_hold) / 1000, 2), "moved_requests": moved,
               "requeued_batches": len(overdue), "max_slo_ms": max(srv.slo_us) / 1000}
    log.info("migrated", version=srv.plan_version, **figures)
    return figures


def switch(srv: Server, plan: Plan, core: Scheduler) -> int:
    """Swap the core and the assignments, move the queue, re-welcome every executor at once."""
    old = srv.core
    for rid, r in srv.reqs.items():
        old.cancel(rid, r.model)
        core.submit(rid, r.model, float(r.arrival), float(r.deadline))
    srv.batches.clear()  # answered; their late feedback would name the old core's reservations
    srv.install_plan(plan, core)
    msg = wire.error(wire.UNREGISTERED, f"plan v{srv.plan_version}: register again for the new assignment")
    for ex in list(srv.execs.values()):
        ex.ready = False
        ex.rewelcome = True
        srv._send_exec(ex.ident, msg)
    return len(srv.reqs)


def sdnotify_status(srv: Server) -> None:
    from . import sdnotify

    sdnotify.notify(f"STATUS=plan v{srv.plan_version}: serving {len(srv.model_names)} models on {srv.nv} vGPUs")
