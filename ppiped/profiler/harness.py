"""Runs timing sessions, one process per vGPU, all at once, as PPipe's profiler does.

At split v the v vGPUs of a GPU serve concurrently in production, so each block is timed with all
v copies running it together: the figure then includes their interference (shared memory
bandwidth, caches, the MPS scheduler). On NVIDIA GPUs each process gets
``CUDA_MPS_ACTIVE_THREAD_PERCENTAGE = 100 / v`` under a private MPS daemon; on CPU (``ort``)
each gets 1/v of the cores. GPU work always runs in child processes so that the parent never
holds a CUDA context that would bypass MPS. A one-thread ORT copy in a child process is pinned to
a core of its own (the OS cannot migrate it mid-round); the parent, which may be a test runner or
a server, is never pinned.

Every figure is the median over timed rounds; their dispersion (IQR / median) is recorded per
block and batch size, and the profile warns when it exceeds 10 %.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import shutil
import subprocess
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..profiles import ProfileError
from .backends import GPU_BACKENDS, Timing, make_runtime, measure

BARRIER_TIMEOUT_S = 1800.0
DISPERSION_WARN = 0.10  # IQR / median of the rounds above which a figure is called unsteady


@dataclass(frozen=True)
class Job:
    """Time one model file at each batch size in ``batch_sizes``."""

    path: Path
    batch_sizes: tuple[int, ...]


@dataclass
class SplitResult:
    latency_us: list[list[float]]  # per job, per batch size; mean over the concurrent copies
    spread: float  # largest relative difference between copies (how unevenly they shared)
    info: dict[str, Any] = field(default_factory=dict)
    dispersion: list[list[float]] = field(default_factory=list)  # per job, per bs; worst copy


class Mps:
    """A private MPS control daemon (own pipe/log directory), started and stopped by us."""

    def __init__(self) -> None:
        self.dir: str | None = None
        self.error: str | None = None

    def start(self) -> bool:
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe is None:
            self.error = "nvidia-cuda-mps-control not found"
            return False
        self.dir = tempfile.mkdtemp(prefix="ppiped-mps-")
        env = {**os.environ, **self.env()}
        try:
            r = subprocess.run([exe, "-d"], env=env, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.error = f"cannot start MPS: {e}"
            return False
        if r.returncode != 0:
            self.error = f"MPS control daemon failed ({r.returncode}): {(r.stderr or r.stdout).strip()}"
            return False
        return True

    def env(self) -> dict[str, str]:
        if self.dir is None:
            return {}
        return {"CUDA_MPS_PIPE_DIRECTORY": self.dir, "CUDA_MPS_LOG_DIRECTORY": self.dir}

    def stop(self) -> None:
        if self.dir is None:
            return
        exe = shutil.which("nvidia-cuda-mps-control")
        if exe:
            subprocess.run([exe], input="quit\n", env={**os.environ, **self.env()},
                           capture_output=True, text=True, timeout=60, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.dir = None


def _pin(rank: int, cores: Sequence[int] | None, rt: Any) -> int | None:
    """Pin this (child) process to one core when its runtime uses one thread."""
    if not cores or getattr(rt, "threads", None) != 1 or not hasattr(os, "sched_setaffinity"):
        return None
    core = cores[rank % len(cores)]
    try:
        os.sched_setaffinity(0, {core})
    except OSError:
        return None
    return core


def _worker(rank: int, backend: str, opts: dict, split: int, jobs: Sequence[Job], timing: Timing,
            env: dict[str, str], barrier, out_q, cores: Sequence[int] | None = None) -> None:
    os.environ.update(env)
    try:
        rt = make_runtime(backend, split=split, **opts)
        core = _pin(rank, cores, rt)
        res: list[list[float]] = []
        disp: list[list[float]] = []
        for job in jobs:
            if barrier is not None and rank != 0:
                barrier.wait(BARRIER_TIMEOUT_S)  # copy 0 builds/caches the engine first
            sess = rt.open(job.path, max(job.batch_sizes))
            if barrier is not None and rank == 0:
                barrier.wait(BARRIER_TIMEOUT_S)
            row, drow = [], []
            for bs in job.batch_sizes:
                if barrier is not None:
                    barrier.wait(BARRIER_TIMEOUT_S)
                m = measure(sess, bs, timing)
                row.append(m.median_us)
                drow.append(round(m.dispersion, 4))
                if rank == 0:
                    out_q.put(("tick", rank, None))
            sess.close()
            res.append(row)
            disp.append(drow)
        out_q.put(("done", rank, (res, {**rt.info(), "pinned_core": core, "dispersion": disp})))
    except BaseException as e:  # report everything, the parent decides
        if barrier is not None:
            barrier.abort()
        out_q.put(("error", rank, (type(e).__name__, str(e), traceback.format_exc())))


def run_split(backend: str, opts: dict, split: int, jobs: Sequence[Job], timing: Timing,
              copies: int, env: dict[str, str] | None = None,
              tick: Callable[[], None] | None = None) -> SplitResult:
    """Time ``jobs`` with ``copies`` concurrent processes (in-process when one copy on CPU)."""
    env = dict(env or {})
    if copies == 1 and backend not in GPU_BACKENDS:
        q: queue_mod.Queue = queue_mod.Queue()
        _worker(0, backend, opts, split, jobs, timing, {}, None, _TickQueue(q, tick))
        return _collect(q, 1, None, tick)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    barrier = ctx.Barrier(copies) if copies > 1 else None
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    procs = [ctx.Process(target=_worker, args=(r, backend, opts, split, list(jobs), timing, env, barrier, q,
                                               cores), daemon=True) for r in range(copies)]
    for p in procs:
        p.start()
    try:
        return _collect(q, copies, procs, tick)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()


class _TickQueue:
    """In-process stand-in for the queue: ticks go straight to the progress bar."""

    def __init__(self, q: queue_mod.Queue, tick: Callable[[], None] | None) -> None:
        self.q, self.tick = q, tick

    def put(self, item: tuple) -> None:
        if item[0] == "tick":
            if self.tick:
                self.tick()
        else:
            self.q.put(item)


def _collect(q, copies: int, procs, tick) -> SplitResult:
    results: dict[int, Any] = {}
    while len(results) < copies:
        try:
            kind, rank, payload = q.get(timeout=5.0)
        except queue_mod.Empty:
            if procs is not None and any(not p.is_alive() for p in procs) and q.empty():
                dead = [p.exitcode for p in procs if not p.is_alive()]
                if any(code not in (0, None) for code in dead):
                    raise ProfileError(f"a timing process died (exit codes {dead})") from None
            continue
        if kind == "tick":
            if tick:
                tick()
        elif kind == "error":
            name, msg, tb = payload
            if name == "InputError":
                raise InputError(msg)
            raise ProfileError(f"timing process {rank} failed: {name}: {msg}\n{tb}")
        else:
            results[rank] = payload
    arr = np.array([results[r][0] for r in range(copies)], dtype=object)
    jobs = len(arr[0])
    lat: list[list[float]] = []
    spread = 0.0
    for j in range(jobs):
        per = np.array([arr[r][j] for r in range(copies)], dtype=np.float64)  # copies x bs
        mean = per.mean(axis=0)
        lat.append([float(x) for x in mean])
        if copies > 1:
            spread = max(spread, float(np.max((per.max(axis=0) - per.min(axis=0)) / mean)))
    infos = [results[r][1] for r in range(copies)]
    disp = [np.max([i["dispersion"][j] for i in infos], axis=0).tolist() for j in range(jobs)]
    return SplitResult(lat, spread, {"copies": copies, "workers": infos}, disp)


def timing_dispersion(splits: dict[str, dict[str, Any]], blocks: int, gpu: str | None = None,
                      warn: bool = True) -> dict[str, Any]:
    """Summary of the per-(block, batch) dispersion the copies recorded (``splits`` as the
    profile's ``latency_source[gpu]['splits']``; job ``blocks`` is the whole model), with one
    warning on stderr when some exceed :data:`DISPERSION_WARN`."""
    figs: list[tuple[float, str, str, int]] = []
    for v, sp in splits.items():
        for w in sp.get("workers", []):
            for j, row in enumerate(w.get("dispersion", [])):
                what = f"block {j}" if j < blocks else "whole model"
                figs.extend((float(d), v, what, bs) for bs, d in enumerate(row, start=1))
    out: dict[str, Any] = {
        "metric": "IQR / median of the timed rounds, per block, batch size and copy "
                  "(splits[v].workers[k].dispersion[block][batch_size-1])",
        "threshold": DISPERSION_WARN, "timings": len(figs),
    }
    if not figs:
        return out
    values = np.array([f[0] for f in figs])
    worst = max(figs)
    over = int(np.sum(values > DISPERSION_WARN))
    out.update({"median": round(float(np.median(values)), 4), "max": round(worst[0], 4), "over_threshold": over,
                "worst": {"split": int(worst[1]), "job": worst[2], "batch_size": worst[3],
                          "dispersion": round(worst[0], 4)}})
    if warn and over:
        print(f"ppiped profile: warning: {over} of {len(figs)} timings{f' on {gpu}' if gpu else ''} vary by "
              f"more than {DISPERSION_WARN:.0%} between rounds (IQR / median); worst: {worst[2]}, batch "
              f"size {worst[3]}, split {worst[1]}: {worst[0]:.1%}. Other load on the machine? More "
              "--rounds or a quieter machine give steadier figures", file=sys.stderr)
    return out
