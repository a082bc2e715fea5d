"""``ppiped-executor --config ppiped.toml --vgpu ID``: runs the partitions of one or more vGPUs.

Life of an executor process:

1. REGISTER its vGPUs and its data endpoint with the scheduler (resent every second until a
   WELCOME arrives, so executors may start before the scheduler).
2. Load each vGPU's backend from the assignment in WELCOME, then start heartbeating: the first
   heartbeat tells the scheduler the vGPUs are ready for work. Before a plan migration, PREPARE
   carries the next assignment: it is loaded in the background while the current one serves
   (PRELOADED answers), and the WELCOME of the switch then only swaps the loaded workers in.
3. Run batches in reservation order: each batch carries its reserved start per hop; a vGPU takes
   the earliest reserved batch it holds and starts it as soon as it is free (``start_early_us``
   inf, the default: work-conserving, which the scheduler's tables assume when an early end
   pulls the queue forward), or no earlier than its reservation minus ``start_early_us``.
4. Send the fp16 feature map straight to the next hop's executor (in-process when it lives here)
   or, on the last hop, the per-request results to the scheduler. Report every use's actual
   ready/start/end times (FEEDBACK), coalesced per event-loop turn.

Several vGPUs in one process (``--vgpu 0-63``) is how emulated clusters of hundreds of vGPUs run
on one machine; a real deployment runs one process per vGPU (systemd ``ppiped-executor@ID``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import heapq
import hmac
import itertools
import math
import os
import sys
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from .. import logs, wire
from ..daemon.config import (
    BACKENDS,
    ConfigError,
    ServeConfig,
    check_data_endpoint,
    check_endpoint,
    format_ranges,
    ipc_taken,
    load_config,
    tensor_frame_cap,
)
from ..daemon.loop import NOBLOCK, Reader, Timers, now_us, on_stop_signals, send_parts
from ..errors import UserError
from ..security import connect_as, load_keypair, serve, start_authenticator, vgpu_ids
from ..wire import T
from .backends import Backend, make_backend

log = logs.get("ppiped.executor")

# A reserved start further ahead than this is not a real reservation (it would hold the queue).
MAX_START_SKEW_US = 60_000_000

REGISTER_RETRY_US = 1_000_000
CANCELLED_MEMORY = 4096
# FORWARDs remembered against replays: far more than the batches in flight at any time.
FORWARDED_MEMORY = 1 << 16
# The data socket is read in slices, so a flood on it (a local process pushing FORWARDs without
# the data key) cannot starve the control socket, heartbeats and timers; behind this long with
# refused FORWARDs in the backlog, it is read at most this share of the time.
DATA_SLICE_US = 1000
DATA_PACE_AFTER_US = 5000
DATA_FLOOD_DUTY = 0.5
PEER_RETRY_US = 200_000
EAGER_PEERS = 256  # peer endpoints connected when PEERS comes; the rest at their first batch
MAX_VGPUS_PER_PROCESS = 4096
"""Most vGPUs one executor process runs. Emulated clusters put some hundreds in one process
(each is a Worker on the one event loop, and REGISTER and heartbeats list them all); beyond a
few thousand one loop cannot keep their reservations, so ``--vgpu 0-100000`` is a typo, not a
cluster."""
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def ipc_path(endpoint: str) -> str | None:
    """The file an ``ipc://`` endpoint binds (None: not ipc, or Linux's abstract namespace)."""
    if not endpoint.startswith("ipc://") or endpoint[6:].startswith("@") or len(endpoint) == 6:
        return None
    return endpoint[6:]


class Recent:
    """A set that remembers only the last ``size`` items added: what was seen lately (cancelled
    batches, FORWARDs taken), in memory bounded however long the executor runs."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: set = set()
        self.order: deque = deque()

    def __contains__(self, x: object) -> bool:
        return x in self.items

    def add(self, x: object) -> None:
        if x in self.items:
            return
        self.items.add(x)
        self.order.append(x)
        if len(self.order) > self.size:
            self.items.discard(self.order.popleft())

    def clear(self) -> None:
        self.items.clear()
        self.order.clear()


class Job:
    """One batch at one hop: its reservation, request ids, payload frames and tensor meta."""

    __slots__ = ("batch", "path", "starts", "hop", "ids", "frames", "meta", "ready_us", "seq", "tags")

    def __init__(self, batch: int, path: list, starts: list, hop: int, ids: list, frames: list,
                 meta: Any, ready_us: int, seq: int, tags: list) -> None:
        self.batch, self.path, self.starts, self.hop = batch, path, starts, hop
        self.ids, self.frames, self.meta, self.ready_us, self.seq = ids, frames, meta, ready_us, seq
        self.tags = tags  # DISPATCH.tags, passed on to every later hop

    def __lt__(self, other: Job) -> bool:
        a, b = self.starts[self.hop], other.starts[other.hop]
        return a < b or (a == b and self.seq < other.seq)


class Prep:
    """A PREPARE: the next assignment, loaded while the current one serves, until a WELCOME adopts it."""

    __slots__ = ("id", "key", "assignments", "workers", "task", "error")

    def __init__(self, prep_id: int, assignments: list[wire.Assignment]) -> None:
        self.id, self.assignments = prep_id, assignments
        self.key = [a.to_wire() for a in assignments]
        self.workers: dict[int, Worker] = {}  # only vGPUs whose assignment changes
        self.task: asyncio.Task | None = None
        self.error = ""


class Worker:
    """One vGPU: a heap of batches keyed by reserved start, at most one running."""

    def __init__(self, exe: Executor, vgpu: int, backend: Backend, early_us: float) -> None:
        # None: work-conserving (start as soon as the vGPU is free); else whole µs, as the
        # timers take integer times
        self.exe, self.vgpu, self.backend = exe, vgpu, backend
        self.early = None if math.isinf(early_us) else int(early_us)
        self.heap: list[Job] = []
        self.busy = False
        self.timer: list | None = None
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"vgpu{vgpu}") \
            if backend.blocking else None

    def push(self, job: Job) -> None:
        heapq.heappush(self.heap, job)
        if not self.busy:
            self.pump()

    def cancel(self, batches: set[int]) -> None:
        keep = [j for j in self.heap if j.batch not in batches]
        if len(keep) != len(self.heap):
            self.heap = keep
            heapq.heapify(self.heap)

    def pump(self) -> None:
        if self.busy or not self.heap:
            return
        job = self.heap[0]
        t = now_us()
        at = t if self.early is None else job.starts[job.hop] - self.early
        if at > t:
            if self.timer is None or self.timer[0] != at:
                if self.timer is not None:
                    Timers.cancel(self.timer)
                self.timer = self.exe.timers.call_at(at, self._on_timer)
            return
        if self.timer is not None:
            Timers.cancel(self.timer)
            self.timer = None
        heapq.heappop(self.heap)
        self.busy = True
        if self.pool is None:
            # the emulator only waits: a loop timer, so hundreds of emulated vGPUs share a thread
            out = self.backend.run(job.frames, job.meta, len(job.ids))
            end = t + int(self.backend.duration_us(len(job.ids)))
            self.exe.timers.call_at(end, self._done, job, t, None, out)
        else:
            fut = self.exe.loop.run_in_executor(self.pool, self._run_timed, job)
            fut.add_done_callback(lambda f, job=job, t=t: self._thread_done(job, t, f))

    def _run_timed(self, job: Job) -> tuple[int, int, Any, BaseException | None]:
        """In the vGPU's thread: the batch and the wall-clock times of the run itself, so the
        feedback holds neither the hand-over to the thread nor the event loop's delay in hearing
        of the end. An error is returned with its times, not raised."""
        start = now_us()
        try:
            out, err = self.backend.run(job.frames, job.meta, len(job.ids)), None
        except Exception as e:  # noqa: BLE001 - reported as the batch's failed entries
            out, err = None, e
        return start, now_us(), out, err

    def _on_timer(self) -> None:
        self.timer = None
        self.pump()

    def _thread_done(self, job: Job, queued: int, fut: asyncio.Future) -> None:
        if fut.cancelled():  # the worker was closed with this batch still queued in its thread
            return
        err = fut.exception()
        if err is None:
            start, end, out, err = fut.result()
            c = self.exe.counters  # where a batch's time went, in the stop log
            c["run_us"] += end - start
            c["wait_us"] += start - queued  # hand-over to the thread
            c["loop_lag_max_us"] = max(c["loop_lag_max_us"], now_us() - end)
        else:  # _run_timed itself failed (it catches the backend's errors): times from the loop
            start, end, out = queued, None, None
        if err is not None:
            log.error("batch-failed", vgpu=self.vgpu, batch=job.batch, error=repr(err))
            out = ([], None, [(i, f"executor-error: {err}") for i in range(len(job.ids))])
        self._done(job, start, end, out)

    def _done(self, job: Job, start: int, end: int | None, out: tuple) -> None:
        """``end`` None: now (the emulator's timer, or a failure measured on the loop)."""
        self.busy = False
        self.exe.finished(self, job, start, now_us() if end is None else end, out)
        self.pump()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.submit(self.backend.close)
            self.pool.shutdown(wait=True, cancel_futures=True)
        else:
            self.backend.close()


class Executor:
    def __init__(self, cfg: ServeConfig, vgpus: Sequence[int], backend: str | None = None,
                 data_endpoint: str | None = None, scheduler: str | None = None) -> None:
        self.cfg = cfg
        self.vgpus = list(vgpus)
        self.backend_override = backend
        first = cfg.executor_settings(self.vgpus[0])
        for v in self.vgpus[1:]:  # one process registers one endpoint and one backend for all
            other = cfg.executor_settings(v)
            for key in ("backend", "data_endpoint"):
                if getattr(other, key) != getattr(first, key) and not (key == "backend" and backend):
                    raise ConfigError(f"{cfg.source}: executors.{v}.{key} is {getattr(other, key)!r} but vGPU "
                                      f"{self.vgpus[0]}'s is {getattr(first, key)!r}; one process serves its "
                                      f"vGPUs with one: start vGPU {v} in a process of its own")
        self.data_endpoint = data_endpoint or first.endpoint_for(self.vgpus[0])
        self.scheduler = scheduler or cfg.executor
        self.incarnation = int.from_bytes(os.urandom(4), "little")
        self.workers: dict[int, Worker] = {}
        self.directory: dict[int, str] = {}
        self.push_socks: dict[str, zmq.Socket] = {}
        self.cancelled = Recent(CANCELLED_MEMORY)
        self.seq = itertools.count()
        self.fb: list[int] = []
        self.fb_scheduled = False
        self.registered = False
        self.loading = False
        # a WELCOME that came while loading: loaded next if it differs (the scheduler's latest
        # word is what it dispatches for, so the one being loaded must not be served instead)
        self.pending: tuple[list[wire.Assignment], Any] | None = None
        self.assign_key: Any = None
        self.prep: Prep | None = None
        self.hb_ms = cfg.heartbeat_interval_ms
        self.hb_gen = 0
        self.exit_code = 0
        self.counters = {"batches": 0, "requests": 0, "forwarded": 0, "dropped_no_peer": 0,
                         "bad_peer_messages": 0, "forwards_refused": 0, "forwards_replayed": 0, "bad_jobs": 0,
                         "not_my_vgpu": 0, "run_us": 0, "wait_us": 0, "loop_lag_max_us": 0}
        self.unreachable: set[int] = set()  # next hops given up on since the last heartbeat
        self.data_key = b""  # WELCOME's: the key of this executor's hop tags (wire.hop_tag)
        self.forwarded = Recent(FORWARDED_MEMORY)  # (batch, hop) taken: a hop runs once, a replay never
        # the scheduler and every peer cap frames alike (the same config and profiles)
        self.tensor_cap, self.tensor_cap_from = tensor_frame_cap(cfg)

    # --- life cycle ---------------------------------------------------------------------------

    async def run(self) -> int:
        self.loop = asyncio.get_running_loop()
        self.stopped = self.loop.create_future()
        sec = self.cfg.security
        if sec.curve and sec.own is None:
            log.error("no-key", error="security.curve is on but security.executor_key is not set")
            return 2
        self.zctx = zmq.Context()
        self.auth = start_authenticator(self.zctx, sec)  # peers' FORWARDs: executor keys only
        self.ctl = self.zctx.socket(zmq.DEALER)
        self.ctl.setsockopt(zmq.LINGER, 0)
        self.ctl.setsockopt(zmq.SNDHWM, 100_000)
        self.ctl.setsockopt(zmq.IDENTITY, f"x{self.vgpus[0]}-{os.getpid()}-{self.incarnation}".encode())
        connect_as(self.ctl, sec)
        self.ctl.connect(self.scheduler)
        self.data = self.zctx.socket(zmq.PULL)
        self.data.setsockopt(zmq.LINGER, 0)
        self.data.setsockopt(zmq.RCVHWM, 100_000)
        self.data.setsockopt(zmq.MAXMSGSIZE, max(self.tensor_cap, wire.MAX_HEADER_BYTES) + wire.FRAME_SLACK)
        serve(self.data, sec, "data", sec.own)
        path = ipc_path(self.data_endpoint)
        why = ipc_taken(path) if path else None
        if why is not None and why.endswith("a live process"):
            why += (": another executor already serves this data endpoint (stop it first, or give "
                    "this one another vGPU or --data-endpoint)")
        try:
            if why is None:
                self.data.bind(self.data_endpoint)
        except zmq.ZMQError as e:
            why = f"cannot bind the data endpoint {self.data_endpoint}: {e}"
        if why is not None:
            log.error("bind-failed", endpoint=self.data_endpoint, error=why)
            print(f"ppiped-executor: error: {why}", file=sys.stderr, flush=True)
            self._close_zmq()
            return 2
        owned = None
        if path:
            with contextlib.suppress(OSError):
                st = os.stat(path)
                owned = (st.st_dev, st.st_ino)
        try:
            return await self._serve()
        finally:
            self._unlink_own(path, owned)

    @staticmethod
    def _unlink_own(path: str | None, owned: tuple[int, int] | None) -> None:
        """Remove the data socket file this process bound (never one another process made since)."""
        if not path or owned is None:
            return
        with contextlib.suppress(OSError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == owned:
                os.unlink(path)

    async def _serve(self) -> int:
        self.timers = Timers(self.loop)
        self.ctl_reader = Reader(self.loop, self.ctl, self.on_ctl)
        self.data_reader = Reader(self.loop, self.data, self.on_data, budget_us=DATA_SLICE_US,
                                  pace_after_us=DATA_PACE_AFTER_US, duty=DATA_FLOOD_DUTY)
        on_stop_signals(self.loop, self.stop, log)
        log.info("start", vgpus=format_ranges(self.vgpus), data=self.data_endpoint, scheduler=self.scheduler,
                 pid=os.getpid())
        self.register()
        code = await self.stopped
        await self.shutdown()
        return code

    def stop(self, code: int = 0) -> None:
        if not self.stopped.done():
            self.stopped.set_result(code)

    async def shutdown(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.ctl.send(wire.bye(self.vgpus), zmq.NOBLOCK)
        self.ctl_reader.close()
        self.data_reader.close()
        self.timers.close()
        for w in self.workers.values():
            w.close()
        if self.prep is not None:
            self._discard(self.prep)
        await asyncio.sleep(0.05)  # let BYE leave
        self._close_zmq()
        log.info("stop", vgpus=format_ranges(self.vgpus), **self.counters,
                 handler_errors=self.ctl_reader.handler_errors + self.data_reader.handler_errors)

    def _close_zmq(self) -> None:
        if self.auth is not None:
            self.auth.stop()
            self.auth = None
        self.zctx.destroy(0)

    def register(self) -> None:
        if self.registered or self.stopped.done():
            return
        backend = self.backend_override or self.cfg.executor_settings(self.vgpus[0]).backend
        self.ctl.send(wire.register(self.vgpus, self.data_endpoint, backend, os.getpid(), now_us(),
                                    self.incarnation), zmq.NOBLOCK)
        self.ctl_reader.kick()
        self.timers.call_at(now_us() + REGISTER_RETRY_US, self._register_retry)

    def _register_retry(self) -> None:
        if not self.registered and not self.loading:
            log.info("waiting-for-scheduler", endpoint=self.scheduler)
            self.register()

    # --- control messages ---------------------------------------------------------------------

    def on_ctl(self, msg: list) -> None:
        try:
            h = wire.decode(msg[0])
            t = h.type
            if t == T.DISPATCH:
                ids = h.ids
                wire.expect_frames(h, len(msg) - 1, len(ids))
                self.accept(Job(h.batch, h.path, h.starts, 0, ids, msg[1:], None, now_us(), next(self.seq),
                                h.tags))
            elif t == T.CANCEL:
                self.on_cancel(h.batches)
            elif t == T.PEERS:
                self.on_peers(h.directory)
            elif t == T.WELCOME:
                if h.data_key != self.data_key:
                    # a new registration (a restarted scheduler numbers its batches from 1 again):
                    # the FORWARDs remembered against replays were signed under the old key
                    self.forwarded.clear()
                self.data_key = h.data_key
                self.on_welcome(h.assignments, h.heartbeat_ms)
            elif t == T.PREPARE:
                self.on_prepare(h.prep, h.assignments)
            elif t == T.ERROR:
                self.on_error(h.code, h.message)
            elif t == T.ALIVE:
                pass
            else:
                log.warning("unexpected-message", type=T(t).name)
        except wire.ProtocolError as e:
            log.warning("bad-message", source="scheduler", code=e.code, error=str(e)[:300])
        except Exception as e:  # noqa: BLE001 - no message of the scheduler's takes the executor down
            log.error("scheduler-message-failed", error=f"{type(e).__name__}: {e}"[:300])

    def on_peers(self, flat: list) -> None:
        """The directory of data endpoints; an entry that is not a vGPU id and a valid endpoint
        is left out (and logged), never connected to."""
        directory: dict[int, str] = {}
        bad = []
        for i in range(0, len(flat) - 1, 2):
            v, ep = flat[i], flat[i + 1]
            try:
                if type(v) is not int or v < 0:
                    raise ConfigError(f"vGPU id {v!r} is not an unsigned int")
                check_endpoint(ep, f"vGPU {v}", "PEERS", self.cfg.allow_remote)
                directory[v] = ep
            except ConfigError as e:
                bad.append(str(e))
        if bad:
            log.warning("bad-peers", entries=len(bad), first=bad[0])
        for ep in set(self.push_socks) - set(directory.values()):
            self.push_socks.pop(ep).close(0)
        self.directory = directory
        # connect now: a first send must not wait for a handshake (to the first EAGER_PEERS
        # endpoints: the others at their first batch, so a directory of thousands of processes
        # does not take a socket each)
        for v in self.directory:
            if len(self.push_socks) >= EAGER_PEERS:
                break
            if v not in self.workers and v not in self.vgpus:
                self._push_sock(v)

    def on_error(self, code: str, message: str) -> None:
        if code == wire.UNREGISTERED:
            if self.registered:
                log.warning("re-register", reason=message[:300])
                for w in self.workers.values():  # the scheduler gave those batches up with us
                    w.heap.clear()
            self.registered = False
            self.register()
        elif code in (wire.VGPU_TAKEN, wire.QUARANTINED):
            log.warning(code, error=message)  # the register retry timer tries again
        else:
            log.error("scheduler-refused", code=code[:64], error=message[:300])
            self.stop(2)

    def on_welcome(self, raw: list, hb_ms: int) -> None:
        assignments = [wire.Assignment.from_wire(x) for x in raw]
        if hb_ms > wire.MAX_HEARTBEAT_MS:
            raise wire.ProtocolError(wire.MALFORMED, f"WELCOME.heartbeat_ms {wire.brief(hb_ms)} is above "
                                     f"{wire.MAX_HEARTBEAT_MS}")
        mine = set(self.vgpus)
        foreign = sorted({a.vgpu for a in assignments} - mine)
        if foreign:  # (a WELCOME for vGPUs it does not run was once adopted, its own left idle)
            raise wire.ProtocolError(wire.MALFORMED, f"WELCOME assigns vGPU(s) {str(foreign)[:80]}, not "
                                     f"among this executor's {format_ranges(self.vgpus)}")
        self.hb_ms = hb_ms or self.hb_ms
        key = [a.to_wire() for a in assignments]
        if self.loading:
            self.pending = (assignments, key)
            return
        if key == self.assign_key and self.workers:
            self.ready()
            return
        self.loading = True
        self.hb_gen += 1
        self.heartbeat(self.hb_gen)  # alive while loading (for minutes, maybe): not silent, not ready
        p = self.prep
        if p is not None and p.key == key:  # the switch to a preloaded assignment: swap
            self.prep = None
            self.loop.create_task(self._adopt(p, assignments, key))
        else:
            self.loop.create_task(self._load(assignments, key))

    async def _make_worker(self, a: wire.Assignment) -> Worker:
        """A worker for assignment ``a`` with its backend loaded (off the event loop)."""
        s = self.cfg.executor_settings(a.vgpu)
        kind = self.backend_override or s.backend
        fields = dict(model=a.model, pipeline=a.pipeline, partition=a.partition, start=a.start,
                      end=a.end, gpu=a.gpu, vgpu=a.vgpu)
        source = engine = None
        if kind != "emulate":
            source, engine = self._model_source(s, a, fields)
        be = make_backend(kind, a, source, threads=s.threads, engine_path=engine,
                          device=s.device, fp16=s.fp16_engine, split=s.split, load_ms=s.emulate_load_ms,
                          jitter=s.emulate_jitter)
        w = Worker(self, a.vgpu, be, s.start_early_us)
        try:
            await self.loop.run_in_executor(w.pool, be.load)  # pool None: the loop's default threads
        except BaseException:
            self._close_workers([w])
            raise
        log.info("loaded", vgpu=a.vgpu, backend=kind, model=a.model, pipeline=a.pipeline,
                 partition=a.partition, blocks=f"{a.start}-{a.end}", gpu=a.gpu, split=a.split,
                 source=source[1] if source else "-")
        return w

    def _close_workers(self, workers: Any) -> None:
        """Close workers off the event loop (a blocking backend's close waits for its thread)."""
        for w in list(workers):
            self.loop.run_in_executor(None, w.close)

    # --- preloading (plan migration) ----------------------------------------------------------

    def on_prepare(self, prep_id: int, raw: list) -> None:
        """Load the next assignment while serving the current one; answer PRELOADED when done.
        A later PREPARE replaces this one (the scheduler cancels with the assignment in force)."""
        try:
            assignments = [wire.Assignment.from_wire(x) for x in raw]
        except wire.ProtocolError as e:
            self._send_ctl(wire.preloaded(prep_id, 0, str(e)))
            return
        old, self.prep = self.prep, Prep(prep_id, assignments)
        if old is not None:
            self._discard(old)
        self.prep.task = self.loop.create_task(self._preload(self.prep))

    def _discard(self, p: Prep) -> None:
        if p.task is not None and not p.task.done():
            p.task.add_done_callback(lambda _t, p=p: self._close_workers(p.workers.values()))
        else:
            self._close_workers(p.workers.values())

    def _serving(self, a: wire.Assignment) -> Worker | None:
        """The worker that already serves exactly assignment ``a``, if any."""
        w = self.workers.get(a.vgpu)
        return w if w is not None and a.to_wire() in (self.assign_key or ()) else None

    async def _preload(self, p: Prep) -> None:
        t0 = now_us()
        a = None
        try:
            for a in p.assignments:
                if self._serving(a) is not None:
                    continue  # unchanged: the worker serving it now goes on serving it
                p.workers[a.vgpu] = await self._make_worker(a)
        except Exception as e:  # noqa: BLE001 - any load failure is reported, never raised
            p.error = f"{type(e).__name__}: {e}"
            log.warning("preload-failed", prep=p.id, **_where(a), error=p.error)
            self._close_workers(p.workers.values())
            p.workers = {}
        load_us = now_us() - t0
        if not p.error:
            log.info("preloaded", prep=p.id, vgpus=format_ranges([a.vgpu for a in p.assignments]),
                     loaded=len(p.workers), load_ms=round(load_us / 1000, 1))
        self._send_ctl(wire.preloaded(p.id, load_us, p.error))

    async def _adopt(self, p: Prep, assignments: list[wire.Assignment], key: Any) -> None:
        """Switch to a preloaded assignment: swap the workers in (waiting for a preload still
        running), close the ones it replaces; load from scratch if the preload failed."""
        if p.task is not None and not p.task.done():
            await asyncio.shield(p.task)
        new: dict[int, Worker] = {}
        for a in assignments:
            w = p.workers.get(a.vgpu) or self._serving(a)
            if w is None or p.error:
                self._close_workers(p.workers.values())
                await self._load(assignments, key)
                return
            new[a.vgpu] = w
        old = [w for v, w in self.workers.items() if new.get(v) is not w]
        self.workers = new
        self.assign_key = key
        log.info("switched", prep=p.id, vgpus=format_ranges(list(new)), swapped=len(p.workers))
        self._close_workers(old)
        self._loaded(key)

    def _send_ctl(self, msg: bytes) -> None:
        with contextlib.suppress(zmq.Again):
            self.ctl.send(msg, zmq.NOBLOCK)
        self.ctl_reader.kick()

    async def _load(self, assignments: list[wire.Assignment], key: Any) -> None:
        old, self.workers = self.workers, {}
        for w in old.values():
            w.close()
        a = None
        try:
            workers = {}
            for a in assignments:
                workers[a.vgpu] = await self._make_worker(a)
        except Exception as e:  # noqa: BLE001 - the executor cannot serve: say why and exit 2
            log.error("load-failed", **_where(a), error=f"{type(e).__name__}: {e}")
            w = _where(a)
            what = (f"vGPU {w['vgpu']} ({w['model']} pipeline {w['pipeline']} partition "
                    f"{w['partition']}, blocks {w['blocks']})") if w else "the assignment"
            print(f"ppiped-executor: error: cannot load {what}: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            self.loading = False
            self.stop(2)
            return
        self.workers = workers
        self.assign_key = key
        self._loaded(key)

    def _loaded(self, key: Any) -> None:
        """The assignment ``key`` is loaded: ready, unless a WELCOME that came meanwhile asks for
        another one, which is loaded first."""
        p, self.pending = self.pending, None
        if p is not None and p[1] != key and not self.stopped.done():
            prep = self.prep
            if prep is not None and prep.key == p[1]:  # preloaded meanwhile (a replan's PREPARE)
                self.prep = None
                self.loop.create_task(self._adopt(prep, *p))
            else:
                log.info("reloading", reason="a newer WELCOME came while loading")
                self.loop.create_task(self._load(*p))
            return
        self.loading = False
        self.ready()

    def load_in_flight(self) -> bool:
        """A backend load still running in a thread (it cannot be interrupted)."""
        return self.loading or (self.prep is not None and self.prep.task is not None
                                and not self.prep.task.done())

    def _model_source(self, s: Any, a: wire.Assignment, fields: dict) -> tuple[tuple, Path]:
        """The partition graph: the ``executor.partitions`` file, else cut from the profiled model
        (``ppiped profile`` records the model file and its block cuts in the profile)."""
        from .onnxio import load_model_file

        if s.partitions:
            path = self.cfg.partition_file(s, **fields)
            return (lambda: load_model_file(path), str(path)), self.cfg.engine_file(s, path, **fields)
        if self.cfg.profiles is None:
            raise ConfigError(f"{self.cfg.source}: executor.partitions or profiles is needed by the "
                              f"{s.backend} backend")
        prof = self.cfg.profiles / f"{a.model}.json"

        def load():
            from ..profiler.export import partition_from_profile

            return partition_from_profile(str(prof), a.start, a.end)

        cache = Path(os.environ.get("CACHE_DIRECTORY") or self.cfg.profiles / "engines")
        engine = (self.cfg.engine_file(s, prof, **fields) if s.engines
                  else cache / f"{a.model}_{a.start}-{a.end}.{a.gpu}.engine")
        return (load, f"{prof}[{a.start}:{a.end}]"), engine

    def ready(self) -> None:
        first = not self.registered
        self.registered = True
        if first:
            log.info("ready", vgpus=format_ranges(list(self.workers)), max_tensor_bytes=self.tensor_cap,
                     max_tensor_bytes_from=self.tensor_cap_from)
            self.hb_gen += 1
            self.heartbeat(self.hb_gen)

    def heartbeat(self, gen: int) -> None:
        if self.stopped.done() or not (self.registered or self.loading) or gen != self.hb_gen:
            return
        queued = sum(len(w.heap) + w.busy for w in self.workers.values())
        unreachable, self.unreachable = sorted(self.unreachable), set()
        with contextlib.suppress(zmq.Again):
            self.ctl.send(wire.heartbeat(now_us(), queued, unreachable, self.loading), zmq.NOBLOCK)
        self.ctl_reader.kick()
        self.timers.call_at(now_us() + self.hb_ms * 1000, self.heartbeat, gen)

    def on_cancel(self, batches: list[int]) -> None:
        s = set(batches)
        for b in batches:
            self.cancelled.add(b)
        for w in self.workers.values():
            w.cancel(s)

    # --- data path ----------------------------------------------------------------------------

    def on_data(self, msg: list) -> None:
        try:
            h = wire.decode(msg[0])
            if h.type != T.FORWARD:
                raise wire.ProtocolError(wire.MALFORMED, f"unexpected {T(h.type).name} on the data socket")
            batch, path, starts, hop, ids, meta, tags = h.batch, h.path, h.starts, h.hop, h.ids, h.meta, h.tags
            if meta is None:  # per-request frames; with a tensor spec, the batch's feature map(s)
                wire.expect_frames(h, len(msg) - 1, len(ids))
            elif len(msg) < 2:
                raise wire.ProtocolError(wire.MALFORMED, "FORWARD with a tensor spec carries no frame")
            if hop < 1:
                raise wire.ProtocolError(wire.MALFORMED, "FORWARD.hop: hop 0 comes only from the scheduler")
            if not self.data_key or hop >= len(path) or len(tags) < hop or len(starts) != len(path) or \
                    not -wire.CLOCK_LIMIT < starts[hop] < wire.CLOCK_LIMIT or not hmac.compare_digest(
                    tags[hop - 1], wire.hop_tag(self.data_key, batch, hop, path[hop], starts[hop])):
                self.counters["forwards_refused"] += 1
                self.data_reader.flood()
                raise wire.ProtocolError(wire.UNAUTHORIZED, f"FORWARD of batch {batch} hop {hop} without the "
                                         "scheduler's tag for it (from a peer that was not given the batch)")
            if starts[hop] < now_us() - MAX_START_SKEW_US:  # (remembered or not: stale)
                self.counters["forwards_refused"] += 1
                raise wire.ProtocolError(wire.UNAUTHORIZED, f"FORWARD of batch {batch} hop {hop} reserved "
                                         f"{MAX_START_SKEW_US / 1e6:g} s or more ago (a replay)")
            if (batch, hop) in self.forwarded:
                self.counters["forwards_replayed"] += 1
                raise wire.ProtocolError(wire.UNAUTHORIZED, f"FORWARD of batch {batch} hop {hop} again (a replay)")
            self.forwarded.add((batch, hop))
            self.accept(Job(batch, path, starts, hop, ids, msg[1:], meta, now_us(), next(self.seq), tags))
        except wire.ProtocolError as e:
            self.counters["bad_peer_messages"] += 1
            if logs.sampled(self.counters["bad_peer_messages"]):
                log.warning("bad-message", source="peer", code=e.code, error=str(e),
                            count=self.counters["bad_peer_messages"])

    def accept(self, job: Job) -> None:
        if job.batch in self.cancelled:
            return
        if not (0 <= job.hop < len(job.path)) or len(job.starts) != len(job.path) or \
                job.starts[job.hop] - job.ready_us > MAX_START_SKEW_US:
            self.counters["bad_jobs"] += 1
            if logs.sampled(self.counters["bad_jobs"]):  # (peer input: a flood must not flood the journal)
                log.warning("bad-job", batch=job.batch, hop=job.hop, path=job.path[:8], count=self.counters["bad_jobs"])
            return
        w = self.workers.get(job.path[job.hop])
        if w is None:
            self.counters["not_my_vgpu"] += 1
            if logs.sampled(self.counters["not_my_vgpu"]):
                log.warning("not-my-vgpu", batch=job.batch, vgpu=job.path[job.hop], count=self.counters["not_my_vgpu"])
            return
        w.push(job)

    def finished(self, w: Worker, job: Job, start: int, end: int, out: tuple) -> None:
        frames, meta, failed = out
        self.counters["batches"] += 1
        self.counters["requests"] += len(job.ids)
        self.fb += (w.vgpu, job.batch, job.hop, job.ready_us, start, end)
        self._schedule_fb()
        if job.batch in self.cancelled:
            return
        ids = job.ids
        bad: list = []
        big = max((_nbytes(f) for f in frames), default=0)
        if big > self.tensor_cap:
            # the receiver's socket would drop the frame and its connection with it, silently
            why = (f"failed: a feature map of {big} bytes exceeds limits.max_tensor_bytes "
                   f"{self.tensor_cap} ({self.tensor_cap_from})")
            log.error("tensor-too-large", vgpu=w.vgpu, batch=job.batch, bytes=big, cap=self.tensor_cap)
            failed = [(i, why) for i in range(len(ids))]
            frames = []
        if failed:
            gone = {i for i, _ in failed}
            for i, reason in failed:
                bad += (ids[i], reason)
            ids = [x for i, x in enumerate(ids) if i not in gone]
        last = job.hop == len(job.path) - 1
        if last or bad:
            res_ids = ids if last else []
            fb, self.fb = self.fb, []  # feedback rides along instead of a message of its own
            send_parts(self.ctl, [wire.result(job.batch, res_ids, meta if last else None, bad, fb),
                                  *(frames if last else ())])
            self.ctl_reader.kick()
        if last or not ids:
            return
        nxt = job.path[job.hop + 1]
        local = self.workers.get(nxt)
        if local is not None:
            local.push(Job(job.batch, job.path, job.starts, job.hop + 1, ids, frames, meta, now_us(),
                           next(self.seq), job.tags))
            return
        msg = [wire.forward(job.batch, job.path, job.starts, job.hop + 1, ids, meta, job.tags), *frames]
        self._send_peer(nxt, job.batch, msg, now_us() + PEER_RETRY_US)

    def _send_peer(self, vgpu: int, batch: int, msg: list, give_up_us: int) -> None:
        """Send to the next hop; while its connection is not up, retry briefly, then give up
        (the scheduler notices the missing result and re-dispatches or drops the requests)."""
        if batch in self.cancelled or self.stopped.done():
            return
        sock = self._push_sock(vgpu)
        if sock is not None:
            try:
                send_parts(sock, msg, NOBLOCK)
                self.counters["forwarded"] += 1
                return
            except zmq.Again:
                pass
        t = now_us()
        if t < give_up_us:
            self.timers.call_at(t + 1000, self._send_peer, vgpu, batch, msg, give_up_us)
            return
        self.counters["dropped_no_peer"] += 1
        self.unreachable.add(vgpu)  # the next heartbeat tells the scheduler, which resends PEERS
        log.warning("peer-unreachable", vgpu=vgpu, batch=batch, endpoint=self.directory.get(vgpu, "-"))

    def _push_sock(self, vgpu: int) -> zmq.Socket | None:
        ep = self.directory.get(vgpu)
        if ep is None:
            return None
        s = self.push_socks.get(ep)
        if s is None:
            try:
                s = None
                s = self.zctx.socket(zmq.PUSH)  # (past the context's socket limit this raises too)
                s.setsockopt(zmq.LINGER, 0)
                s.setsockopt(zmq.IMMEDIATE, 1)  # fail fast instead of queueing for a dead peer
                s.setsockopt(zmq.SNDHWM, 10_000)
                if self.cfg.security.curve:
                    key = self.cfg.security.vgpu_key(vgpu)
                    if key is None:
                        raise zmq.ZMQError(msg=f"no executor key is bound to vGPU {vgpu}")
                    connect_as(s, self.cfg.security, key)
                s.connect(ep)
            except zmq.ZMQError as e:
                if s is not None:
                    s.close(0)
                log.warning("peer-connect-failed", vgpu=vgpu, endpoint=ep, error=str(e))
                return None
            self.push_socks[ep] = s
        return s

    def _schedule_fb(self) -> None:
        if not self.fb_scheduled:
            self.fb_scheduled = True
            self.loop.call_soon(self._flush_fb)

    def _flush_fb(self) -> None:
        self.fb_scheduled = False
        if self.fb:
            entries, self.fb = self.fb, []
            with contextlib.suppress(zmq.Again):
                self.ctl.send(wire.feedback(entries), zmq.NOBLOCK)
            self.ctl_reader.kick()


def _nbytes(frame: Any) -> int:
    try:
        return memoryview(frame).nbytes
    except TypeError:
        return len(frame)


def _where(a: wire.Assignment | None) -> dict:
    """The vGPU and partition a load failure concerns, for the log."""
    if a is None:
        return {}
    return {"vgpu": a.vgpu, "model": a.model, "pipeline": a.pipeline, "partition": a.partition,
            "blocks": f"[{a.start},{a.end})"}


async def _cancel_the_rest() -> None:
    """What ``asyncio.run`` does after its coroutine: cancel the tasks left, join the threads."""
    tasks = asyncio.all_tasks() - {asyncio.current_task()}
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await asyncio.get_running_loop().shutdown_default_executor()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ppiped-executor",
                                 description="Run the partitions of one or more vGPUs for a ppiped scheduler.")
    ap.add_argument("--config", required=True, help="serving config (TOML), as given to ppiped serve")
    ap.add_argument("--vgpu", action="append", required=True, metavar="ID",
                    help="vGPU id(s) to run: 3, 0-7 or 0,2,5 (repeatable)")
    ap.add_argument("--backend", choices=BACKENDS, help="override the config's backend")
    ap.add_argument("--data-endpoint", help="endpoint to bind for feature maps (default from the config)")
    ap.add_argument("--scheduler", help="scheduler executor endpoint (default: endpoints.executor)")
    ap.add_argument("--key", help="this executor's CURVE .key_secret (default: security.executor_key)")
    ap.add_argument("--log-level", default="info", type=str.lower, choices=LOG_LEVELS)
    args = ap.parse_args(argv)
    logs.setup(args.log_level)
    try:
        cfg = load_config(args.config)
        vgpus = vgpu_ids(args.vgpu, "--vgpu", MAX_VGPUS_PER_PROCESS)
        if args.data_endpoint:
            check_data_endpoint(args.data_endpoint, "--data-endpoint", cfg)
        if args.scheduler:
            check_endpoint(args.scheduler, "--scheduler", "flags", cfg.allow_remote)
        if args.key:
            cfg.security.own = load_keypair(args.key, need_secret=True, what="--key")
        exe = Executor(cfg, vgpus, args.backend, args.data_endpoint, args.scheduler)
    except UserError as e:
        print(f"ppiped-executor: error: {e}", file=sys.stderr)
        return 2
    import uvloop

    loop = uvloop.new_event_loop()
    try:
        code = loop.run_until_complete(exe.run())
        if exe.load_in_flight():
            # a backend load blocks its thread until it ends (an engine build may take minutes)
            # and both the loop's close and the interpreter's exit would wait for it: leave now
            log.warning("exit-mid-load", vgpus=format_ranges(exe.vgpus))
            with contextlib.suppress(OSError, ValueError):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
        loop.run_until_complete(_cancel_the_rest())
    except KeyboardInterrupt:
        return 130
    finally:
        loop.close()
    return code


if __name__ == "__main__":
    sys.exit(main())
