"""Overload, light load and bursts: does the data plane hold goodput and stay on time?

Parts (each prints JSON lines, then a table; ``--part all`` runs them in turn):

* ``overload`` (simulator, shared ``_v4`` maf21 plans, Poisson, latency noise σ = 0.05): per
  model, goodput (completions within the SLO per second) over its planned capacity (its
  load-factor-1.0 rate), late completions over completions, drop rate and invalid rate (GPU time
  on requests that ended late, over all GPU time), at load factors 0.5 … 2.0, per policy.
* ``lowload`` (simulator, σ = 0.05): attainment at load factors 0.01 … 0.2 on every shared plan
  and on a synthetic plan with a 2 ms SLO (the tiny example model on its own profile).
* ``bursty`` (simulator, Gamma arrivals with cv 1.5 and 2, load factor 1.0): goodput over
  capacity, drop rate and invalid rate per policy, averaged over the shared plans.
* ``priority`` (simulator, σ = 0.05): 20 % of requests high priority, 80 % low, at load factor
  1.3: attainment of the high class, goodput over capacity of both, per reserving policy.
* ``daemon``: the real scheduler process with emulated executors whose latency wanders
  (``executor.emulate_jitter``), offered 1.3 x the tiny example plan's capacity from a load
  generator: goodput over capacity and requests without a reply.

    .venv/bin/python bench/overload.py                       # everything (minutes)
    .venv/bin/python bench/overload.py --part overload --limit 4 --duration 5
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import shutil
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "ppipe"
OVERLOAD_LF = (0.5, 1.0, 1.3, 1.6, 2.0)
LOW_LF = (0.01, 0.02, 0.05, 0.1, 0.2)


def _point(args: tuple) -> dict:
    """One simulation in a worker: per-model figures against the plan's capacity."""
    from ppiped.sim.run import PointSpec

    plan, models, policy, lf, sigma, duration, trace, cv, seed, *rest = args
    high = rest[0] if rest else 0.0
    spec = PointSpec(plan, models, trace, duration, seed, policy, sigma, cv, high_share=high)
    r = spec.result(lf, stop=False)
    per = []
    for m in r.models:
        cap = m.rate_rps / lf if lf > 0 else math.nan
        done = m.served + m.late
        per.append({"model": m.model, "goodput_over_capacity": m.goodput_rps / cap if cap else math.nan,
                    "late_share": m.late / done if done else 0.0, "drop_rate": m.drop_rate,
                    "invalid_rate": m.invalid_rate, "attainment": m.attainment, "offered": m.offered})
    out = {"plan": Path(plan).name, "policy": policy, "load_factor": lf, "jitter_sigma": sigma,
           "trace": trace, "cv": cv if trace == "bursty" else None, "models": per}
    if r.classes:
        out["high_share"] = high
        out["classes"] = {name: {"min_attainment": r.class_min_attainment(name),
                                 "goodput_over_capacity": [m.goodput_rps * lf / x.rate_rps if x.rate_rps else math.nan
                                                           for m, x in zip(ms, r.models, strict=True)]}
                          for name, ms in r.classes.items()}
    return out


def _plans(data: Path, plan_set: str, limit: int, match: str) -> list[str]:
    from ppiped.plan import reference_plan_set

    d = reference_plan_set(data, plan_set)
    plans = sorted(str(p) for p in d.glob("*_v4.json") if match in p.name)
    return plans[:limit] if limit else plans


def _run(tasks: list[tuple], jobs: int) -> list[dict]:
    out = []
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        for r in pool.map(_point, tasks):
            print(json.dumps(r), flush=True)
            out.append(r)
    return out


def part_overload(args, plans: list[str], models: str) -> dict:
    tasks = [(p, models, pol, lf, args.jitter, args.duration, "poisson", 2.0, args.seed)
             for p in plans for pol in args.policies for lf in OVERLOAD_LF]
    rows = _run(tasks, args.jobs)
    summary = {}
    print(f"\n{'policy':<18} {'load':>5} {'min goodput/cap':>16} {'max late share':>15} "
          f"{'max invalid':>12} {'plans ok':>9}")
    for pol in args.policies:
        for lf in OVERLOAD_LF:
            rs = [r for r in rows if r["policy"] == pol and r["load_factor"] == lf]
            g = min(m["goodput_over_capacity"] for r in rs for m in r["models"])
            late = max(m["late_share"] for r in rs for m in r["models"])
            inv = max(m["invalid_rate"] for r in rs for m in r["models"])
            ok = sum(all(m["goodput_over_capacity"] >= 0.95 and m["late_share"] <= 0.01 for m in r["models"])
                     for r in rs)
            summary[f"{pol}@{lf}"] = {"min_goodput_over_capacity": g, "max_late_share": late,
                                      "max_invalid_rate": inv, "plans_ok": ok, "plans": len(rs)}
            print(f"{pol:<18} {lf:5.2f} {g:16.3f} {late:15.4f} {inv:12.4f} {ok:>4}/{len(rs):<4}")
        # goodput must not fall as load rises (2 % tolerance for noise)
        falls = 0
        for p in plans:
            seq = sorted((r["load_factor"], r) for r in rows if r["policy"] == pol and r["plan"] == Path(p).name)
            for (_, a), (_, b) in zip(seq, seq[1:], strict=False):
                ga = [m["goodput_over_capacity"] for m in a["models"]]
                gb = [m["goodput_over_capacity"] for m in b["models"]]
                falls += any(y < x - 0.02 for x, y in zip(ga, gb, strict=True))
        summary[f"{pol}:goodput_falls"] = falls
        print(f"{pol}: {falls} load steps where some model's goodput fell by more than 2 % of capacity")
    return summary


def part_lowload(args, plans: list[str], models: str) -> dict:
    tasks = [(p, models, pol, lf, args.jitter, args.duration, "poisson", 2.0, args.seed)
             for p in plans for pol in args.policies for lf in LOW_LF]
    synth = _synthetic_plan()
    tasks += [(synth[0], synth[1], pol, lf, args.jitter, args.duration, "poisson", 2.0, args.seed)
              for pol in args.policies for lf in LOW_LF]
    rows = _run(tasks, args.jobs)
    summary = {}
    print(f"\n{'policy':<18} {'load':>5} {'min attainment (shared)':>24} {'2 ms SLO plan':>14}")
    for pol in args.policies:
        for lf in LOW_LF:
            rs = [r for r in rows if r["policy"] == pol and r["load_factor"] == lf]
            shared = [m["attainment"] for r in rs if r["plan"] != "plan.json" for m in r["models"]]
            syn = [m["attainment"] for r in rs if r["plan"] == "plan.json" for m in r["models"]]
            summary[f"{pol}@{lf}"] = {"min_attainment_shared": min(shared, default=math.nan),
                                      "attainment_2ms_plan": min(syn, default=math.nan)}
            print(f"{pol:<18} {lf:5.2f} {min(shared, default=math.nan):24.4f} {min(syn, default=math.nan):14.4f}")
    return summary


def _synthetic_plan() -> tuple[str, str]:
    """The tiny example, two 300 µs blocks at batch 1, planned at batch 2 with a 2 ms SLO (a
    written plan and profile)."""
    from ppiped.executor import tiny

    d = Path(tempfile.mkdtemp(prefix="ppiped-overload-"))
    atexit.register(shutil.rmtree, d, ignore_errors=True)
    prof = tiny.profile_json(block_us=(300.0, 300.0), max_bs=4)
    plan, profiles = tiny.write_example(d, prof, vgpus=(2, 2), bs=2, slo_ms=2.0)
    return str(plan), str(profiles)


def part_bursty(args, plans: list[str], models: str) -> dict:
    tasks = [(p, models, pol, 1.0, args.jitter, args.duration, "bursty", cv, args.seed)
             for p in plans for pol in args.policies for cv in (1.5, 2.0)]
    rows = _run(tasks, args.jobs)
    summary = {}
    print(f"\n{'policy':<18} {'cv':>4} {'goodput/cap':>12} {'drop rate':>10} {'invalid rate':>13}")
    for cv in (1.5, 2.0):
        for pol in args.policies:
            ms = [m for r in rows if r["policy"] == pol and r["cv"] == cv for m in r["models"]]
            g = sum(m["goodput_over_capacity"] for m in ms) / len(ms)
            d = sum(m["drop_rate"] for m in ms) / len(ms)
            i = sum(m["invalid_rate"] for m in ms) / len(ms)
            summary[f"{pol}@cv{cv}"] = {"goodput_over_capacity": g, "drop_rate": d, "invalid_rate": i}
            print(f"{pol:<18} {cv:4.1f} {g:12.3f} {d:10.4f} {i:13.4f}")
    return summary


def part_priority(args, plans: list[str], models: str) -> dict:
    pols = [p for p in args.policies if p != "reactive"]  # reactive has no classes
    tasks = [(p, models, pol, 1.3, args.jitter, args.duration, "poisson", 2.0, args.seed, 0.2)
             for p in plans for pol in pols]
    rows = _run(tasks, args.jobs)
    summary = {}
    print(f"\n{'policy':<18} {'min high attainment':>20} {'plans >= 99.9 %':>16} {'min goodput/cap (all)':>22}")
    for pol in pols:
        rs = [r for r in rows if r["policy"] == pol]
        hi = [r["classes"]["high"]["min_attainment"] for r in rs]
        g = min(m["goodput_over_capacity"] for r in rs for m in r["models"])
        ok = sum(h >= 0.999 for h in hi)
        summary[pol] = {"min_high_attainment": min(hi), "plans_ok": ok, "plans": len(rs),
                        "min_goodput_over_capacity": g}
        print(f"{pol:<18} {min(hi):20.4f} {ok:>8}/{len(rs):<7} {g:22.3f}")
    return summary


def part_daemon(args) -> dict:
    import uvloop

    from ppiped.commands.loadgen import run_load
    from ppiped.daemon.launch import LocalCluster, short_tmpdir, write_config
    from ppiped.executor import tiny
    from ppiped.plan import load_plan

    with short_tmpdir() as tmp:
        d = Path(tmp)
        plan, profiles = tiny.write_example(d, vgpus=(4, 4), bs=4, slo_ms=60.0)
        cap = load_plan(plan).models[0].throughput_rps
        cfg = write_config(d, plan, profiles, heartbeat_ms=100, timeout_ms=1000,
                           scheduler={"policy": args.daemon_policy},
                           extra=f"emulate_jitter = {args.jitter}\n")
        with LocalCluster(cfg, ((0, 1, 4, 5), (2, 3, 6, 7)), log_level="warning") as c:
            rate = args.daemon_load * cap
            r = uvloop.run(run_load(c.client_endpoint, {tiny.MODEL: rate}, args.daemon_seconds))
    (m,) = [x for x in r["models"] if x["model"] == tiny.MODEL]
    ok = m["attained"]
    out = {"bench": "overload-daemon", "policy": args.daemon_policy, "jitter_sigma": args.jitter,
           "capacity_rps": cap, "offered_rps": rate, "load_factor": args.daemon_load,
           "goodput_rps": ok / args.daemon_seconds, "goodput_over_capacity": ok / args.daemon_seconds / cap,
           "sent": m.get("sent"), "no_reply": m.get("no_reply"), "drop_reasons": m.get("drop_reasons"),
           "reject_reasons": m.get("reject_reasons"), "p99_ms": m.get("p99_ms")}
    print(json.dumps(out), flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", default="all", choices=("overload", "lowload", "bursty", "priority", "daemon", "all"))
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="the PPipe data set (models/, reference-plans/)")
    ap.add_argument("--plan-set", default="maf21",
                    help="simulator parts: the _v4 plans of this folder under DATA/reference-plans, or a path")
    ap.add_argument("--policies", default="ppipe,pard,ppipe-early-drop,reactive",
                    help="comma-separated policies for the simulator parts")
    ap.add_argument("--jitter", type=float, default=0.05, help="lognormal σ of executor latency (default 0.05)")
    ap.add_argument("--duration", type=float, default=20.0, help="simulated seconds per run (default 20)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--limit", type=int, default=0, help="only the first N shared plans")
    ap.add_argument("--match", default="", help="only shared plans whose name contains this")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--daemon-load", type=float, default=1.3, help="daemon part: load factor (default 1.3)")
    ap.add_argument("--daemon-seconds", type=float, default=10.0)
    ap.add_argument("--daemon-policy", default="pard")
    args = ap.parse_args(argv)
    args.policies = [p for p in args.policies.split(",") if p]
    from ppiped.core.scheduler import POLICIES

    for p in [*args.policies, args.daemon_policy]:
        if p not in POLICIES:
            ap.error(f"unknown policy {p!r} (known: {', '.join(POLICIES)})")
    data = Path(args.data)
    models = str(data / "models")
    plans = _plans(data, args.plan_set, args.limit, args.match)
    summary: dict = {}
    sim_parts = [p for p in ("overload", "lowload", "bursty", "priority") if args.part in (p, "all")]
    if sim_parts and not plans:
        print(f"overload: no _v4 plans in {data}/reference-plans for --plan-set {args.plan_set}: the "
              "shared-plan runs are skipped", file=sys.stderr)
        sim_parts = [p for p in sim_parts if p == "lowload"]  # its synthetic plan needs no data
    if sim_parts:
        from ppiped.sim.run import PointSpec

        plan0, models0 = (plans[0], models) if plans else _synthetic_plan()
        PointSpec(plan0, models0, duration_s=0.05).result(0.1)  # compile once before forking
        for p in sim_parts:
            summary[p] = globals()[f"part_{p}"](args, plans, models)
    if args.part in ("daemon", "all"):
        summary["daemon"] = part_daemon(args)
    print(json.dumps({"bench": "overload", "summary": summary}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
