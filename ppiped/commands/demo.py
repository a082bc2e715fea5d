"""``ppiped demo``: the scheduler and an emulated cluster on this host, driven by the load generator.

With the embedded example (the default) the demo shows PPipe's point before the load: the plan
(``plans/example/plan.json``, the example CNN on ``plans/example/cluster.toml``: one V100 beside
twelve P4s, made by ``ppiped plan --profiles plans/example --models example --cluster
plans/example/cluster.toml --slo-reference-gpu V100 --slo-scale 7 -o plans/example/plan.json``)
pipelines the model across both GPU classes, the P4s running the early layers; printed are its
pipelines, and its throughput against NP's (the whole model on whole GPUs) planned now on the
same cluster and SLO. Then the plan's first pipeline that spans two GPU classes is served for
real: its partitions, cut from the example's ONNX model, run by ``ort`` executors on this host's
CPU, one process each, and every output is checked against the whole model run by ONNX Runtime
(:mod:`ppiped.realcheck`); the demo exits 1 if they differ.

What runs next: ``ppiped serve`` and a few ``ppiped-executor`` processes (backend ``emulate``, each
hosting many vGPUs) on private ipc:// sockets, then ``loadgen`` at ``--load-factor`` times each
model's planned throughput. Printed per model: offered rate, attainment, drops, p50/p99 latency
as the client measured them; per GPU class: the share of vGPU time spent in batches.

The plan, in order of preference: ``--plan``/``--profiles``; ``plans/example/plan.json`` beside
the example's profile (a plan made by ``ppiped plan``); the example planned now with the MILP
planner on ``--cluster`` (default ``plans/example/cluster.toml``, else a small V100+P4 cluster);
the tiny two-pool plan of :mod:`ppiped.executor.tiny` where the example is absent.

``--app`` runs something else: the example app (detector -> crop glue -> classifier) served with
real ONNX Runtime executors on this host's CPUs and driven by queries (:mod:`.demo_app`).

Time scale: emulated executors sleep the profiled latencies, and a Python scheduler reacts in
tens to hundreds of microseconds. When an SLO is only a millisecond or two (the example CNN is
small), those reaction times would be a large part of it, so the demo runs the whole cluster
``K`` times slower: block latencies, transfer times and SLOs multiplied by K, rates divided by K.
Attainment and utilization are unchanged by the scale for an ideal scheduler; the scale only
keeps the host's own jitter small against the SLO, and the request rate within what one host
emulates (a real cluster of 100 GPUs serves thousands of requests per second; here one CPU core
runs the scheduler and another the load generator and every emulated GPU). ``--time-scale auto``
picks the smallest K that makes the tightest SLO at least ``--min-slo-ms`` and the total offered
rate at most ``--max-rate``; the output states K.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..daemon.launch import (
    LocalCluster,
    cpu_split,
    running_on,
    short_tmpdir,
    split_groups,
    write_config,
)
from ..errors import InputError
from ..plan import Plan, load_plan, save_plan
from ..profiles import Profile, load_profiles, save_profile
from .argtypes import LOAD_FACTOR, POSITIVE_INT, SEED, integer, number

ROOT = Path(__file__).resolve().parents[2]
# Seconds a demo may offer load for (it runs real processes on this host), and its SLOs in ms.
DEMO_SECONDS = number(0, 3600, lo_open=True)
DEMO_SLO_MS = number(0, 3.6e6, lo_open=True)
EXAMPLE_DIR = ROOT / "plans" / "example"


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="serve the example plan on an emulated local cluster under load; "
                                    "print attainment, latency and utilization")
    p.add_argument("--plan", help="plan to serve (default: the embedded example)")
    p.add_argument("--profiles", help="profiles of the plan's models (needed with --plan)")
    p.add_argument("--cluster", help="cluster spec to plan the example on (default: a small V100+P4 cluster)")
    p.add_argument("--load-factor", type=LOAD_FACTOR, default=None,
                   help="offered load / planned throughput (default 0.8; with --app 0.3)")
    p.add_argument("--duration", type=DEMO_SECONDS, default=15.0, help="seconds of load (at most an hour)")
    p.add_argument("--arrivals", default="poisson", choices=("poisson", "bursty"), help="poisson or bursty")
    p.add_argument("--processes", type=integer(1, 64), default=2, help="executor processes hosting the vGPUs")
    p.add_argument("--time-scale", type=_time_scale_arg, default="auto",
                   help="run the cluster K times slower (auto or a number up to 10^6)")
    p.add_argument("--min-slo-ms", type=DEMO_SLO_MS, default=60.0, help="auto time scale: tightest SLO after scaling")
    p.add_argument("--max-rate", type=number(0, 1e6, lo_open=True), default=800.0,
                   help="auto time scale: most requests/s offered in all (what this host emulates comfortably)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--no-pin", dest="pin", action="store_false",
                   help="let the scheduler's event loop share every CPU (default: one to itself, with "
                        "two or more)")
    p.add_argument("--keep", help="keep config, plan and logs in this directory")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    a = p.add_argument_group("--app: the example app (detector -> crop glue -> classifier) served with "
                             "real ONNX Runtime inference on this host's CPUs, checked against the "
                             "by-hand runner (see ppiped/commands/demo_app.py)")
    a.add_argument("--app", action="store_true",
                   help="serve the example app instead of the emulated example plan; queries at "
                        "--load-factor x the planned query rate for --duration s (no CPU "
                        "pinning: the ORT vGPUs need the cores)")
    a.add_argument("--vgpus", type=POSITIVE_INT, help="--app: CPU vGPUs to plan on, at most the CPUs (default: "
                                             "min(2, CPUs))")
    a.add_argument("--slo-ms", type=DEMO_SLO_MS, help="--app: the app's end-to-end SLO on CPU (default 300)")
    p.set_defaults(func=run)


# --- which plan --------------------------------------------------------------------------


# The example CNN is profiled on V100 (split 1-4) and P4; the cluster of plans/example/cluster.toml
# to plan it on when the example directory brings no cluster spec of its own.
DEMO_CLUSTER = {"nic_gbps": 40, "gpus": {"V100": {"count": 1, "per_server": 1, "splits": [1, 2, 3, 4]},
                                         "P4": {"count": 12, "per_server": 2, "splits": [1]}}}
# SLO = 7 x the example's V100 latency: too tight for a P4 to run the whole model (so NP leaves the
# P4s idle), loose enough for P4s to run its first half ahead of the V100 (plans/example/cluster.toml).
EXAMPLE_SLO_SCALE = 7.0


def _example_plan(cluster_path: str | None) -> tuple[Plan, dict[str, Profile], str] | None:
    prof_path = EXAMPLE_DIR / "example.json"
    plan_path = EXAMPLE_DIR / "plan.json"
    if not prof_path.exists():
        return None
    profiles = load_profiles(EXAMPLE_DIR, ["example"])
    if plan_path.exists() and cluster_path is None:
        return load_plan(plan_path), profiles, str(plan_path)
    try:
        from ..planner import plan_cluster
    except ImportError:
        return None
    from ..cluster import cluster_from_json, load_cluster
    from ..plan import PlanParams

    spec = Path(cluster_path) if cluster_path else EXAMPLE_DIR / "cluster.toml"
    if spec.exists():
        cluster, where = load_cluster(spec), str(spec)
    else:
        cluster, where = cluster_from_json(DEMO_CLUSTER, "demo cluster"), _cluster_text(DEMO_CLUSTER)
    ref = profiles["example"].extra.get("slo_reference_gpu", "L4")
    plan = plan_cluster(profiles, ["example"], [1.0], cluster,
                        PlanParams(slo_scale=EXAMPLE_SLO_SCALE, slo_reference_gpu=ref), time_limit=20.0)
    return plan, profiles, f"example CNN (plans/example) planned now with the ppipe MILP on {where}"


def _cluster_text(spec: dict) -> str:
    gpus = ", ".join(f"{g['count']} {name} ({g['per_server']}/server)" for name, g in spec["gpus"].items())
    return f"{gpus}, {spec['nic_gbps']:g} Gb/s"


def _tiny_plan(work: Path) -> tuple[Plan, dict[str, Profile], str]:
    from ..executor import tiny

    plan_path, prof_dir = tiny.write_example(work / "tiny", vgpus=(3, 4), bs=4, slo_ms=60.0)
    return load_plan(plan_path), load_profiles(prof_dir), "tiny two-pool plan (ppiped.executor.tiny)"


def choose_plan(args: argparse.Namespace, work: Path) -> tuple[Plan, dict[str, Profile], str, bool]:
    """The plan to serve, its profiles, where it came from, and whether it is the example's."""
    if args.plan:
        if not args.profiles:
            raise InputError("--plan needs --profiles (the directory of its models' profiles)")
        plan = load_plan(args.plan)
        return plan, load_profiles(args.profiles, [m.model for m in plan.models]), args.plan, False
    if args.profiles:
        raise InputError("--profiles is only used with --plan")
    found = _example_plan(args.cluster)
    return (*found, True) if found is not None else (*_tiny_plan(work), False)


# --- what the plan is, and that its cuts compute the model ------------------------------------


def pipeline_rows(plan: Plan) -> list[dict[str, Any]]:
    """Each pipeline of each model with its partitions, as the summary prints them."""
    rows = []
    for m in plan.models:
        for i, p in enumerate(m.pipelines):
            parts = [{"blocks": list(q.blocks), "gpu": q.gpu, "vgpu_split": q.vgpu_split,
                      "num_vgpus": q.num_vgpus} for q in p.partitions]
            rows.append({"model": m.model, "pipeline": i, "batch_size": p.batch_size,
                         "throughput_rps": p.throughput_rps, "partitions": parts,
                         "gpu_classes": sorted({q.gpu for q in p.partitions})})
    return rows


def compare_with_np(plan: Plan, profiles: dict[str, Profile]) -> dict[str, Any]:
    """The plan's throughput against NP's (each GPU runs the whole model, no vGPUs) planned now on
    the same cluster with the same SLOs and weights: what partitioning and vGPUs buy."""
    from ..planner import plan_cluster

    np_plan = plan_cluster(profiles, [m.model for m in plan.models], [m.weight for m in plan.models],
                           plan.cluster, plan.params, algo="np", time_limit=20.0,
                           slos_us=[m.slo_us for m in plan.models])
    ours = sum(m.throughput_rps for m in plan.models)
    theirs = sum(m.throughput_rps for m in np_plan.models)
    return {"algo": plan.algo or "plan", "plan_rps": ours, "np_rps": theirs,
            "gain": ours / theirs if theirs > 0 else math.inf,
            "objective": plan.normalized_throughput, "np_objective": np_plan.normalized_throughput}


def checked_pipeline(plan: Plan, model: str) -> list[tuple[tuple[int, int], str]]:
    """The partitions to serve for real: the first pipeline spanning two GPU classes, else the
    one with the most partitions."""
    pipes = plan.model(model).pipelines
    multi = [p for p in pipes if len({q.gpu for q in p.partitions}) > 1]
    pick = multi[0] if multi else max(pipes, key=lambda p: len(p.partitions))
    return [(q.blocks, q.gpu) for q in pick.partitions]


def real_inference(plan: Plan, work: Path) -> dict[str, Any]:
    """The example's checked pipeline served by ort executors and compared with the whole model;
    a run that cannot serve it at all is a failed check, not a crash, so the load still runs."""
    from ..profiler.example import EXAMPLE_NAME, example_with_model
    from ..realcheck import RealCheck, serve_and_compare

    cuts = checked_pipeline(plan, EXAMPLE_NAME)
    real_dir = work / "real"
    real_dir.mkdir(exist_ok=True)
    try:
        profile = example_with_model(EXAMPLE_DIR, work / "example-model")
        return serve_and_compare(real_dir, profile, cuts).to_json()
    except Exception as e:
        return RealCheck(cuts, 0, [], errors=[f"{type(e).__name__}: {e}"]).to_json()


# --- time scale --------------------------------------------------------------------------


def _time_scale_arg(s: str) -> str:
    """``auto`` or a finite factor in (0, 10^6], checked before anything starts (inf was taken,
    and five seconds later the scaled plan's NIC speed of 0 was named instead)."""
    if s != "auto":
        try:
            number(0, 1e6, lo_open=True)(s)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"expected 'auto' or {str(e).removeprefix('expected ')}") from None
    return s


def pick_time_scale(plan: Plan | None, value: str, min_slo_ms: float, offered_rps: float = 0.0,
                    max_rate: float = math.inf) -> float:
    if value != "auto":
        try:
            k = float(value)
        except ValueError:
            raise InputError(f"--time-scale: expected 'auto' or a number, got {value!r}") from None
        if not k > 0:
            raise InputError("--time-scale must be positive")
        return k
    assert plan is not None
    tightest = min(m.slo_us for m in plan.models) / 1000
    return float(max(1, math.ceil(min_slo_ms / tightest), math.ceil(offered_rps / max_rate)))


def scale_time(plan: Plan, profiles: dict[str, Profile], k: float) -> tuple[Plan, dict[str, Profile]]:
    """The same cluster ``k`` times slower: latencies and SLOs × k, NIC and rates ÷ k."""
    if k == 1:
        return plan, profiles
    out_profiles = {}
    for name, p in profiles.items():
        q = copy.copy(p)
        q.latency = {g: {v: a * k for v, a in sp.items()} for g, sp in p.latency.items()}
        q.whole_model_latency_us = {g: x * k for g, x in p.whole_model_latency_us.items()}
        q.__post_init__()
        out_profiles[name] = q
    d = plan.to_json()
    d["cluster"]["nic_gbps"] = d["cluster"]["nic_gbps"] / k
    d["objective"]["normalized_throughput"] /= k
    for m in d["models"]:
        m["slo_us"] *= k
        m["throughput_rps"] /= k
        m["batch_delay_rate_rps"] /= k
        for p in m["pipelines"]:
            p["throughput_rps"] /= k
            p["latency_us"] *= k
            for q in p["partitions"]:
                q["lat_infer_us"] *= k
                q["lat_trans_us"] *= k
                q["throughput_rps"] /= k
    from ..plan import plan_from_json

    return plan_from_json(d, f"{plan.source} (time x{k:g})"), out_profiles


# --- the run -----------------------------------------------------------------------------


def run_demo(args: argparse.Namespace, work: Path,
             show: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """The whole demo; ``show`` gets the part before the load (plan, NP, real inference) as soon
    as it is known, so a reader sees it while the load runs."""
    import uvloop

    from .loadgen import run_load

    plan, profiles, origin, example = choose_plan(args, work)
    head: dict[str, Any] = {"plan": origin, "algo": plan.algo, "cluster": plan.cluster.to_json(),
                            "slo_ms": {m.model: m.slo_us / 1000 for m in plan.models},
                            "pipelines": pipeline_rows(plan), "comparison": None, "real_inference": None}
    if example:
        head["comparison"] = compare_with_np(plan, profiles)
        head["real_inference"] = real_inference(plan, work)
    if show is not None:
        show(head)
    offered = args.load_factor * sum(m.throughput_rps for m in plan.models)
    k = pick_time_scale(plan, args.time_scale, args.min_slo_ms, offered, args.max_rate)
    plan, profiles = scale_time(plan, profiles, k)
    (work / "profiles").mkdir(parents=True, exist_ok=True)
    for name, p in profiles.items():
        save_profile(p, work / "profiles" / f"{name}.json")
    save_plan(plan, work / "plan.json")
    split = cpu_split() if args.pin else None
    cfg = write_config(work, work / "plan.json", work / "profiles", heartbeat_ms=100, timeout_ms=1000,
                       threads=split)
    from ..core.layout import Layout

    layout = Layout.from_plan(plan, profiles)
    n = layout.num_vgpus
    rates = {m.model: args.load_factor * m.throughput_rps for m in plan.models}
    if not any(r > 0 for r in rates.values()):
        raise InputError("the plan has no throughput to offer load against")
    others = split[1] if split else None
    cluster = LocalCluster(cfg, split_groups(n, args.processes), log_dir=work, executor_cpus=others)
    t_start = time.monotonic()
    with cluster, running_on(others):
        ready_s = time.monotonic() - t_start
        before = cluster.status()
        result = uvloop.run(run_load(cluster.client_endpoint, rates, args.duration, kind=args.arrivals,
                                     seed=args.seed))
        after = cluster.status()
    if before is None or after is None:
        raise InputError("the scheduler stopped answering status queries; see the logs with --keep DIR")
    span_us = after["now_us"] - before["now_us"]
    util = {}
    for g, c in after["gpu_classes"].items():
        busy = c["busy_us"] - before["gpu_classes"][g]["busy_us"]
        util[g] = {"vgpus": c["vgpus"], "gpus": round(c["gpu_share"], 3),
                   "utilization": busy / (span_us * c["vgpus"]) if span_us > 0 else 0.0}
    models = []
    for m in result["models"]:
        st = after["models"][m["model"]]
        models.append({**m, "mean_batch": st["mean_batch"]})
    return {
        **head, "time_scale": k, "load_factor": args.load_factor, "arrivals": args.arrivals,
        "duration_s": args.duration, "vgpus": n, "executor_processes": len(cluster.groups),
        "startup_s": round(ready_s, 2), "models": models, "total": result["total"], "gpu_classes": util,
        "scheduler": {"overhead_us": after["overhead_us"], "wake_late_us": after["wake_late_us"],
                      "counters": after["counters"]},
    }


def _cluster_line(c: dict[str, Any]) -> str:
    def one(name: str, g: dict[str, Any]) -> str:
        sp = g["splits"]
        splits = f", vGPU splits {sp[0]}-{sp[-1]}" if len(sp) > 1 else ""
        return f"{g['count']} {name} ({g['per_server']}/server{splits})"

    return ", ".join(one(n, g) for n, g in c["gpus"].items()) + f", {c['nic_gbps']:g} Gb/s NIC"


def format_head(r: dict[str, Any]) -> str:
    """The plan, PPipe against NP, and the real-inference check: what the demo shows first."""
    slo = ", ".join(f"{m} {v:.2f} ms" for m, v in r["slo_ms"].items())
    lines = [f"plan: {r['plan']} ({r['algo'] or 'plan'})",
             f"cluster: {_cluster_line(r['cluster'])}; SLO {slo}", ""]
    rows = [("model", "pipeline", "bs", "partitions: [blocks) GPU/split × vGPUs", "rps")]
    for p in r["pipelines"]:
        parts = " → ".join(f"[{q['blocks'][0]},{q['blocks'][1]}) {q['gpu']}"
                           + (f"/{q['vgpu_split']}" if q["vgpu_split"] > 1 else "") + f" ×{q['num_vgpus']}"
                           for q in p["partitions"])
        rows.append((p["model"][:34], str(p["pipeline"]), str(p["batch_size"]), parts,
                     f"{p['throughput_rps']:.0f}"))
    lines += _table(rows, left=(0, 3))
    c = r.get("comparison")
    if c:
        lines += ["", f"{'PPipe' if c['algo'] == 'ppipe' else c['algo']} {c['plan_rps']:.0f} rps vs NP "
                      f"{c['np_rps']:.0f} rps (×{c['gain']:.2f}) on this cluster and SLO (NP: the whole "
                      "model on whole GPUs)"]
    q = r.get("real_inference")
    if q:
        from ..realcheck import RealCheck, format_check

        lines += ["", format_check(RealCheck.from_json(q))]
    return "\n".join(lines)


def format_run(r: dict[str, Any]) -> str:
    """The emulated run under load: attainment, latency, utilization."""
    lines = [f"emulated cluster at scale: the plan's {r['vgpus']} vGPUs emulated in {r['executor_processes']} "
             f"executor processes; time scale x{r['time_scale']:g} (latencies and SLOs x{r['time_scale']:g}, rates /{r['time_scale']:g}); "
             f"load factor {r['load_factor']}, {r['arrivals']} arrivals, {r['duration_s']:g} s",
             "sockets: ipc:// on this host only, CURVE off (a deployment beyond loopback needs "
             "[security] curve = true; see `ppiped keys`)", ""]
    rows = [("model", "offered/s", "sent", "attainment", "drops", "rejects", "p50 ms", "p99 ms", "SLO ms",
             "batch")]
    for m in r["models"]:
        rows.append((m["model"][:34], f"{m['offered_rps']:.1f}", str(m["sent"]), f"{100 * m['attainment']:.2f}%",
                     str(m["dropped"] + m["no_reply"]), str(m["rejected"]), f"{m['p50_ms']:.1f}",
                     f"{m['p99_ms']:.1f}", f"{m['slo_ms']:.1f}", f"{m['mean_batch']:.2f}"))
    t = r["total"]
    rows.append(("all", "", str(t["sent"]), f"{100 * t['attainment']:.2f}%", str(t["dropped"] + t["no_reply"]),
                 str(t["rejected"]), f"{t['p50_ms']:.1f}", f"{t['p99_ms']:.1f}", "", ""))
    lines += _table(rows)
    lines.append("")
    rows = [("GPU class", "vGPUs", "GPUs", "utilization")]
    for g, u in r["gpu_classes"].items():
        rows.append((g, str(u["vgpus"]), f"{u['gpus']:g}", f"{100 * u['utilization']:.1f}%"))
    lines += _table(rows)
    ov = r["scheduler"]["overhead_us"]
    if ov.get("n"):
        lines.append("")
        lines.append(f"scheduler overhead per request (receive to dispatch): p50 {ov['p50']:.0f} us, "
                     f"p99 {ov['p99']:.0f} us")
    return "\n".join(lines)


def format_demo(r: dict[str, Any]) -> str:
    return format_head(r) + "\n\n" + format_run(r)


def _table(rows: list[tuple[str, ...]], left: tuple[int, ...] = (0,)) -> list[str]:
    w = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = ["  ".join(c.ljust(wi) if i in left else c.rjust(wi) for i, (c, wi) in enumerate(zip(r, w, strict=True)))
           for r in rows]
    out.insert(1, "  ".join("-" * wi for wi in w))
    return out


# The app's queries as a share of its planned rate: the plan counts each CPU vGPU as a core of
# its own, but on a small host the scheduler, glue workers and client share those cores (on two
# CPUs about 0.4 x the planned rate is what is served within the SLO).
APP_LOAD_FACTOR = 0.3


def run(args: argparse.Namespace) -> int:
    if args.load_factor is None:
        args.load_factor = APP_LOAD_FACTOR if args.app else 0.8
    if not 0 < args.load_factor <= 10:
        raise InputError("--load-factor must be in (0, 10]")
    if args.app:
        used = [f for f, v in (("--plan", args.plan), ("--profiles", args.profiles),
                               ("--cluster", args.cluster)) if v]
        if used:
            raise InputError(f"--app plans the example app itself: drop {', '.join(used)}")
        if args.arrivals != "poisson":
            raise InputError("--app offers Poisson arrivals only")
    elif args.vgpus is not None or args.slo_ms is not None:
        raise InputError("--vgpus and --slo-ms are for --app")
    if args.time_scale != "auto":
        pick_time_scale(None, args.time_scale, args.min_slo_ms)  # validate before any planning

    def show(head: dict[str, Any]) -> None:
        print(format_head(head) + "\n", flush=True)

    def body(work: Path) -> dict[str, Any]:
        if args.app:
            from .demo_app import run_app_demo

            return run_app_demo(args, work)
        return run_demo(args, work, None if args.json else show)

    if args.keep:
        work = Path(args.keep).resolve()
        work.mkdir(parents=True, exist_ok=True)
        if len(str(work)) > 60:
            raise InputError(f"--keep {work}: path too long for ipc sockets (60 characters at most)")
        r = body(work)
    else:
        with short_tmpdir("ppiped-demo-") as d:
            r = body(Path(d))
    if args.json:
        print(json.dumps(r))
    elif args.app:
        from .demo_app import format_app_demo

        print(format_app_demo(r))
    else:
        print(format_run(r))
    sys.stdout.flush()
    if args.app:
        return 0 if r["queries"]["no_reply"] == 0 and r["check"]["equal"] else 1
    real = r["real_inference"]
    return 0 if r["total"]["no_reply"] == 0 and (real is None or real["equal"]) else 1
