"""``ppiped demo --app``: the example app (detector -> crop glue -> classifier) served end to end
with real ONNX Runtime inference on this host's CPUs, checked against the by-hand runner.

What runs, in a temporary (or ``--keep``) directory:

1. The example app's models (``ppiped example-app``; ``plans/example-app`` when its model files
   are there), each profiled with the ``ort`` backend on GPU type ``CPU`` (one intra-op thread,
   a few blocks and batch sizes, so it takes seconds; reused from ``--keep DIR`` when the model
   files are unchanged).
2. The app planned with :func:`ppiped.query.split.plan_apps` (the DP split of its SLO, then the
   joint MILP) on ``--vgpus`` CPU "vGPUs" (at most the host's CPUs: ORT on one thread per vGPU
   needs a core each), with the CPU SLO :data:`CPU_SLO_MS` unless ``--slo-ms`` says otherwise.
3. ``ppiped serve`` (its glue workers included) and one ``ort`` executor process per vGPU.
4. The expected answers: :class:`ppiped.query.local.LocalApp` on each example frame.
5. A query loader: ``submit_query`` at ``--load-factor`` x the plan's query rate (Poisson) for
   ``--duration`` seconds, cycling through the seeded example frames; every OK answer is
   compared with the by-hand outputs of its frame.

Why the SLO is hundreds of milliseconds here, not the few the example's V100 estimate gives:
the models take milliseconds on a CPU core, and on a small host the scheduler, its ZeroMQ
thread, the glue workers, the executors and the client share the same cores, so the OS's time
slices (several ms each, several runnable processes) and Python's per-request work add tens of
ms of queueing that no GPU deployment has. An SLO well above that makes the run test the
serving path (deadlines, glue, fan-out, answers) rather than this host's scheduler jitter.

No CPU pinning: with two cores, giving the event loop one to itself (as ``ppiped demo`` does)
would leave both ORT vGPUs on the other and halve the capacity the plan counts on.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from ..plan import Plan, PlanParams, check, load_plan, save_plan
from ..profiles import Profile, load_profiles
from ..query.app import App
from ..query.local import LocalApp, StageOutput

ROOT = Path(__file__).resolve().parents[2]
SOURCE_DIR = ROOT / "plans" / "example-app"  # the committed app (its models built on demand)
CPU_SLO_MS = 300.0  # see the module docstring
BLOCKS = {"detector": 4, "classifier": 3}  # few blocks: quick to profile, still splittable
MAX_BATCH = 4
PROFILE_ROUNDS = 3
FRAMES = 32  # distinct example frames the load cycles through
FRAME_SEED = 1  # not the fan-out measurement's frames (seed 0)
GRACE_S = 3.0  # past its SLO, a query still unanswered this long counts as no reply
# Served logits against the by-hand ones: fp16 at partition boundaries (when the plan cuts a
# model) moves them by about 1e-3 of their range; batching moves them by ~1e-6.
REL_TOL = 2e-2
ABS_TOL = 1e-3


# --- build, profile, plan ----------------------------------------------------------------------


def _digest(paths: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for p in paths:
        h.update(p.read_bytes())
    return h.hexdigest()


def build_models(work: Path, source: Path | None = None) -> Path:
    """A directory with the example app's ``apps.toml`` and model files: ``source`` (default
    ``plans/example-app``) when its models are there, else built now into ``work/src``."""
    from ..profiler.example_app import CLASSIFIER, DETECTOR, make_example_app

    src = source or SOURCE_DIR
    if all((src / m / "model.onnx").is_file() for m in (DETECTOR, CLASSIFIER)) and (src / "apps.toml").is_file():
        return src
    out = work / "src"
    if not (out / "apps.toml").is_file():
        make_example_app(out, progress=False)
    return out


def profile_cpu(src: Path, out: Path, rounds: int = PROFILE_ROUNDS) -> dict[str, Profile]:
    """Both models profiled with ONNX Runtime on this host (GPU type ``CPU``, one thread) into
    ``out``; reused when ``out`` holds profiles of the same model files and settings."""
    from ..profiler.backends import Timing
    from ..profiler.profile import ProfileRequest, profile_model

    models = [src / m / "model.onnx" for m in BLOCKS]
    stamp = json.dumps({"models": _digest(models), "blocks": BLOCKS, "max_batch": MAX_BATCH,
                        "rounds": rounds})
    mark = out / "source.json"
    if mark.is_file() and mark.read_text() == stamp and all((out / f"{m}.json").is_file() for m in BLOCKS):
        return load_profiles(out, list(BLOCKS))
    for name, path in zip(BLOCKS, models, strict=True):
        profile_model(ProfileRequest(model_path=path, out_dir=out, backend="ort", gpu="CPU",
                                     blocks=BLOCKS[name], max_batch=MAX_BATCH, name=name,
                                     timing=Timing(rounds=rounds), threads=1, replace=True,
                                     progress=False, verify=False))
    mark.write_text(stamp)
    return load_profiles(out, list(BLOCKS))


def cpu_app(src: Path, slo_ms: float) -> App:
    """The example app of ``src/apps.toml`` with a CPU SLO (its file's is for a V100)."""
    from ..query.split import load_apps

    (app,) = load_apps(src / "apps.toml")
    app = dataclasses.replace(app, slo_us=slo_ms * 1000.0)
    app.validate()
    return app


def plan_cpu(profiles: dict[str, Profile], app: App, vgpus: int, time_limit: float = 20.0) -> Plan:
    """The app planned on ``vgpus`` CPU vGPUs (one per server, split 1); raises on a violation."""
    from ..cluster import cluster_from_flags
    from ..query.split import plan_apps

    cluster = cluster_from_flags(f"CPU:{vgpus}", "1", "1", 10.0)
    plan = plan_apps(profiles, [app], cluster, PlanParams(slo_reference_gpu="CPU"),
                     time_limit=time_limit)
    bad = check(plan, profiles)
    if bad:
        raise InputError(f"the example app's CPU plan breaks its rules: {'; '.join(map(str, bad))}")
    return plan


def query_rate(plan: Plan, app: App) -> float:
    """Queries/s the plan serves of ``app``: its slowest stage over its requests per query."""
    return min(plan.model(s.model).throughput_rps / app.rate_factor(i) for i, s in enumerate(app.stages))


def split_summary(plan: Plan) -> dict[str, Any]:
    """The split the planner chose: per stage its budget, fan-out, batch and partitions."""
    (app,) = plan.apps
    stages = []
    for i, s in enumerate(app.stages):
        m = plan.model(s.model)
        stages.append({
            "stage": s.name, "model": s.model, "fanout": s.fanout, "rate_factor": app.rate_factor(i),
            "budget_ms": s.budget_us / 1000, "rps": m.throughput_rps,
            "pipelines": [{"bs": p.batch_size, "partitions": [[q.blocks[0], q.blocks[1], q.gpu, q.num_vgpus]
                                                              for q in p.partitions]}
                          for p in m.pipelines]})
    return {"app": app.name, "method": app.split, "slo_ms": app.slo_us / 1000,
            "glue_ms": app.glue_us / 1000, "query_rps": query_rate(plan, app), "stages": stages}


@dataclass
class Prepared:
    """Everything a run needs, on disk in ``work``."""

    work: Path
    source: Path  # apps.toml and the model files
    profiles_dir: Path
    plan_path: Path
    plan: Plan
    app: App  # as planned (with its budgets)
    frames: np.ndarray  # the example frames queries send
    expected: list[list[StageOutput]]  # LocalApp.run on each frame
    seconds: dict[str, float]


def prepare(work: Path, *, vgpus: int = 2, slo_ms: float = CPU_SLO_MS, source: Path | None = None,
            rounds: int = PROFILE_ROUNDS, frames: int = FRAMES) -> Prepared:
    """Build, profile, plan (``work/plan.json``) and compute the expected answers."""
    from ..profiler.example_app import example_frames
    from ..query.local import model_paths

    if vgpus < 1:
        raise InputError("--vgpus must be at least 1")
    t = {"start": time.perf_counter()}
    src = build_models(work, source)
    t["build"] = time.perf_counter()
    prof_dir = work / "prof"
    profiles = profile_cpu(src, prof_dir, rounds)
    t["profile"] = time.perf_counter()
    plan = plan_cpu(profiles, cpu_app(src, slo_ms), vgpus)
    save_plan(plan, work / "plan.json")
    t["plan"] = time.perf_counter()
    (app,) = plan.apps
    x = example_frames(frames, FRAME_SEED)
    local = LocalApp(app, model_paths(app, prof_dir),
                     inputs={m: p.input_spec() for m, p in profiles.items()})
    expected = [local.run(f) for f in x]
    t["expected"] = time.perf_counter()
    steps = list(t)
    secs = {k: round(t[k] - t[steps[i - 1]], 2) for i, k in enumerate(steps) if i}
    return Prepared(work, src, prof_dir, work / "plan.json", load_plan(work / "plan.json"), app, x,
                    expected, secs)


def serving_config(p: Prepared, glue_workers: int = 2) -> Path:
    """``work/ppiped.toml``: the ort backend, one thread per vGPU, the app's glue workers."""
    from ..daemon.launch import write_config

    return write_config(p.work, p.plan_path, p.profiles_dir, backend="ort", heartbeat_ms=100,
                        timeout_ms=1000,
                        extra=f"threads = 1\n\n[glue]\nworkers = {glue_workers}\ntimeout_ms = 1000\n")


def make_cluster(p: Prepared, log_level: str = "warning") -> Any:
    """``ppiped serve`` and one ort executor process per vGPU: a LocalCluster to start (``with``)."""
    from ..core.layout import Layout
    from ..daemon.launch import LocalCluster, split_groups

    n = Layout.from_plan(p.plan, load_profiles(p.profiles_dir, list(BLOCKS))).num_vgpus
    cluster = LocalCluster(serving_config(p), split_groups(n, n), log_dir=p.work, log_level=log_level)
    return cluster


# --- the load and the check ----------------------------------------------------------------------


@dataclass
class QueryLoad:
    """What the client saw of one phase of queries."""

    app: str
    rate: float
    slo_ms: float
    sent: int = 0
    ok: int = 0
    late: int = 0  # answered OK after the SLO
    dropped: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(Counter))  # stage -> reason -> n
    rejected: dict[str, dict[str, int]] = field(default_factory=lambda: defaultdict(Counter))
    no_reply: int = 0
    unnamed: int = 0  # refusals that named no stage and no reason (should stay 0)
    lat_ms: list[float] = field(default_factory=list)
    answers: list[tuple[int, list[Any]]] = field(default_factory=list)  # (frame index, outputs) of OK answers

    def summary(self, duration_s: float) -> dict[str, Any]:
        lat = np.asarray(self.lat_ms)
        p50, p99 = (float(v) for v in np.percentile(lat, [50, 99])) if lat.size else (math.nan, math.nan)
        n_drop = sum(sum(c.values()) for c in self.dropped.values())
        n_rej = sum(sum(c.values()) for c in self.rejected.values())
        return {"offered_qps": round(self.rate, 2), "duration_s": duration_s, "sent": self.sent,
                "ok": self.ok, "late": self.late, "on_time": self.ok - self.late,
                "attainment": (self.ok - self.late) / self.sent if self.sent else math.nan,
                "dropped": n_drop, "rejected": n_rej, "no_reply": self.no_reply, "unnamed": self.unnamed,
                "dropped_by_stage": {s: dict(c) for s, c in self.dropped.items()},
                "rejected_by_stage": {s: dict(c) for s, c in self.rejected.items()},
                "p50_ms": p50, "p99_ms": p99, "slo_ms": self.slo_ms}


async def offer_queries(endpoint: str, app: str, frames: np.ndarray, rate: float, duration_s: float,
                        seed: int = 0, slo_ms: float | None = None, grace_s: float = GRACE_S) -> QueryLoad:
    """Poisson arrivals at ``rate`` queries/s for ``duration_s``, each ``submit_query`` with the
    next example frame; waits for every answer up to the SLO plus ``grace_s`` past the last
    send. Keeps every OK answer's outputs for :func:`compare`."""
    from ..client import AsyncClient, Dropped, Rejected
    from ..sim.workload import generate

    times = generate("poisson", [rate], duration_s, seed).times_us / 1e6 if rate > 0 else np.zeros(0)
    payloads = [np.ascontiguousarray(f).tobytes() for f in frames]
    async with AsyncClient(endpoint, timeout_s=None) as client:
        info = await client.info(timeout_s=10.0)
        if app not in info.get("apps", {}):
            raise InputError(f"app {app!r} is not served by {endpoint}")
        slo = slo_ms or info["apps"][app]["slo_ms"]
        load = QueryLoad(app, rate, slo)

        async def one(i: int) -> None:
            k = i % len(payloads)
            t0 = time.perf_counter()
            try:
                r = await client.submit_query(app, payloads[k], timeout_s=None)
            except Dropped as e:
                load.dropped[e.stage or "-"][e.reason or "?"] += 1
                load.unnamed += not (e.stage and e.reason)
                return
            except Rejected as e:
                load.rejected[e.stage or "-"][e.reason or "?"] += 1
                load.unnamed += not e.reason
                return
            lat = (time.perf_counter() - t0) * 1000
            load.ok += 1
            load.late += lat > slo
            load.lat_ms.append(lat)
            load.answers.append((k, r.outputs))

        tasks = []
        start = time.perf_counter() + 0.02
        for i, t in enumerate(times):
            delay = start + t - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.ensure_future(one(i)))
            load.sent += 1
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=slo / 1000 + grace_s)
            load.no_reply = len(pending)
            for f in pending:
                f.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.gather(*pending, return_exceptions=True)
    return load


def compare(answers: Sequence[tuple[int, Sequence[Any]]], expected: Sequence[Sequence[StageOutput]],
            rel_tol: float = REL_TOL, abs_tol: float = ABS_TOL) -> dict[str, Any]:
    """Served answers against the by-hand ones of the same frame: the same leaf requests (stage,
    key, so the same number of crops) and every output array within ``rel_tol`` of the by-hand
    output's largest magnitude plus ``abs_tol``."""
    n_out = 0
    mismatched: list[str] = []
    max_abs = max_rel = 0.0
    for k, outs in answers:
        want = expected[k]
        got_keys = [(o.stage, tuple(o.key)) for o in outs]
        want_keys = [(w.stage, w.key) for w in want]
        if got_keys != want_keys:
            mismatched.append(f"frame {k}: served {len(outs)} outputs {got_keys}, by hand {want_keys}")
            continue
        for o, w in zip(outs, want, strict=True):
            arrays = o.arrays()
            ref = list(w.outputs.values())
            if len(arrays) != len(ref) or any(a.shape != b.shape for a, b in zip(arrays, ref, strict=False)):
                mismatched.append(f"frame {k} {o.stage}{list(o.key)}: shapes {[a.shape for a in arrays]} "
                                  f"vs {[b.shape for b in ref]}")
                continue
            for a, b in zip(arrays, ref, strict=True):
                d = float(np.max(np.abs(a.astype(np.float64) - b))) if a.size else 0.0
                scale = float(np.max(np.abs(b))) if b.size else 0.0
                max_abs = max(max_abs, d)
                max_rel = max(max_rel, d / scale if scale else d)
                n_out += 1
                if d > rel_tol * scale + abs_tol:
                    mismatched.append(f"frame {k} {o.stage}{list(o.key)}: max |diff| {d:.3g} "
                                      f"(scale {scale:.3g})")
    return {"queries": len(answers), "outputs": n_out, "max_abs_diff": max_abs,
            "max_rel_diff": max_rel, "mismatches": len(mismatched), "first_mismatches": mismatched[:5],
            "equal": not mismatched, "tolerance": f"|diff| <= {rel_tol:g} x max|by hand| + {abs_tol:g}"}


def served_in_order(endpoint: str, app: str, frames: np.ndarray, idx: Sequence[int],
                    timeout_s: float = 30.0) -> list[tuple[int, list[Any]]]:
    """One query at a time (no load) for each frame index: (index, outputs)."""
    from ..client import Client

    with Client(endpoint, timeout_s=timeout_s) as c:
        return [(k, c.submit_query(app, np.ascontiguousarray(frames[k]).tobytes()).outputs) for k in idx]


def app_counters(status: dict | None, app: str) -> dict[str, Any]:
    return ((status or {}).get("apps") or {}).get("apps", {}).get(app, {})


# --- the demo ------------------------------------------------------------------------------------


def run_app_demo(args: Any, work: Path) -> dict[str, Any]:
    """The whole demo in ``work``: prepare, serve, a few queries one by one, the load; a report."""
    import uvloop

    cpus = len(os.sched_getaffinity(0))
    vgpus = args.vgpus or min(2, cpus)
    if not 1 <= vgpus <= cpus:
        raise InputError(f"--vgpus {vgpus}: between 1 and this host's {cpus} CPUs (an ORT vGPU "
                         "runs one thread and needs a core)")
    p = prepare(work, vgpus=vgpus, slo_ms=args.slo_ms or CPU_SLO_MS)
    rate = query_rate(p.plan, p.app) * args.load_factor
    t0 = time.perf_counter()
    with make_cluster(p) as cluster:
        ready_s = time.perf_counter() - t0
        first = served_in_order(cluster.client_endpoint, p.app.name, p.frames, range(min(4, len(p.frames))))
        before = cluster.status()
        load = uvloop.run(offer_queries(cluster.client_endpoint, p.app.name, p.frames, rate,
                                        args.duration, seed=args.seed))
        after = cluster.status()
    checked = compare(first, p.expected)
    under_load = compare(load.answers, p.expected)
    c0, c1 = app_counters(before, p.app.name), app_counters(after, p.app.name)
    return {
        "app": p.app.name, "vgpus": vgpus, "backend": "ort", "host_cpus": len(os.sched_getaffinity(0)),
        "seconds": {**p.seconds, "serve_start": round(ready_s, 2)},
        "split": split_summary(p.plan), "load_factor": args.load_factor,
        "queries": load.summary(args.duration),
        "check": {"one_by_one": checked, "under_load": under_load,
                  "equal": checked["equal"] and under_load["equal"]},
        "daemon": {"ok": c1.get("ok", 0) - c0.get("ok", 0),
                   "ok_late": c1.get("ok_late", 0) - c0.get("ok_late", 0),
                   "invalid_gpu_s": round(c1.get("invalid_gpu_s", 0.0) - c0.get("invalid_gpu_s", 0.0), 4)},
        "work": str(work) if args.keep else None,
    }


def format_app_demo(r: dict[str, Any]) -> str:
    from .demo import _table

    sp = r["split"]
    q = r["queries"]
    lines = [f"app {r['app']}: the example app served with ONNX Runtime on {r['vgpus']} CPU vGPUs "
             f"of this host ({r['host_cpus']} CPUs); SLO {sp['slo_ms']:g} ms (CPU), glue "
             f"{sp['glue_ms']:g} ms per step",
             "setup: " + ", ".join(f"{k} {v:g} s" for k, v in r["seconds"].items()), "",
             f"split ({sp['method']}), planned {sp['query_rps']:.1f} queries/s:"]
    rows = [("stage", "model", "fan-out", "budget ms", "rps", "bs", "partitions [blocks) gpu x vGPUs")]
    for s in sp["stages"]:
        for j, pl in enumerate(s["pipelines"]):
            parts = " + ".join(f"[{a},{b}) {g} x{n}" for a, b, g, n in pl["partitions"])
            rows.append((s["stage"] if j == 0 else "", s["model"] if j == 0 else "",
                         f"{s['fanout']:g}" if j == 0 else "", f"{s['budget_ms']:.1f}" if j == 0 else "",
                         f"{s['rps']:.1f}" if j == 0 else "", str(pl["bs"]), parts))
    lines += _table(rows)
    lines += ["", f"load: {q['offered_qps']:.1f} queries/s offered ({r['load_factor']:g} x planned) "
                  f"for {q['duration_s']:g} s"]
    rows = [("queries", "sent", "ok", "on time", "late", "dropped", "rejected", "no reply", "p50 ms",
             "p99 ms")]
    rows.append(("all", str(q["sent"]), str(q["ok"]), f"{q['on_time']} ({100 * q['attainment']:.1f}%)"
                 if q["sent"] else "0", str(q["late"]), str(q["dropped"]), str(q["rejected"]),
                 str(q["no_reply"]), f"{q['p50_ms']:.1f}", f"{q['p99_ms']:.1f}"))
    named = [s["stage"] for s in sp["stages"]]
    named += sorted({*q["dropped_by_stage"], *q["rejected_by_stage"]} - set(named))
    for st in named:
        d, j = q["dropped_by_stage"].get(st, {}), q["rejected_by_stage"].get(st, {})
        rows.append((f"at {st}", "", "", "", "", str(sum(d.values())), str(sum(j.values())), "", "", ""))
    lines += _table(rows)
    refused = [(st, why, n) for key in ("dropped_by_stage", "rejected_by_stage")
               for st, c in q[key].items() for why, n in c.items()]
    if refused:
        lines.append("reasons: " + ", ".join(f"{st}: {why} {n}" for st, why, n in sorted(refused)))
    lines.append("")
    for name, c in (("one by one", r["check"]["one_by_one"]), ("under load", r["check"]["under_load"])):
        verdict = "equal to the by-hand outputs" if c["equal"] else f"{c['mismatches']} MISMATCHED"
        lines.append(f"check ({name}): {c['queries']} answers, {c['outputs']} outputs {verdict} "
                     f"(max |diff| {c['max_abs_diff']:.2g}, {c['max_rel_diff']:.2g} of the scale; "
                     f"{c['tolerance']})")
        lines += [f"  {m}" for m in c["first_mismatches"]]
    if r.get("work"):
        lines.append(f"kept: {r['work']}")
    return "\n".join(lines)
