"""Live replan under load on an emulated local cluster: the migration numbers of issue 8.

Two models (the tiny CNN and a faster twin) are planned with equal weights on a 4-GPU emulated
cluster; Poisson load runs for ``--duration`` seconds and, at ``--at`` seconds, ``ppiped-ctl
replan --weights ... --wait`` plans for a 3:1 mix in a child process and migrates. Printed as
JSON lines:

* ``{"metric": "unanswered", ...}``: requests that got no reply (must be 0);
* ``{"metric": "dispatch_pause_ms", ...}``: the pause in dispatching vs the largest SLO + 100 ms,
  whether the executors preloaded the new partitions while serving, and how long that took;
* ``{"metric": "attainment_around_replan", ...}``: attainment over the window around the replan
  (the whole run; the default is a minute with the replan in the middle);
* ``{"metric": "replan", ...}``: the daemon's report (planning time, flush, moved requests).

    python bench/replan.py                 # one minute, replan at 30 s
    python bench/replan.py --duration 8 --at 4 --load 0.3
    python bench/replan.py --no-preload    # executors load after the switch (the pause grows)

Emulated executors take ``--load-ms`` to load a partition (a stand-in for a TensorRT engine load),
so the difference preloading makes shows on an emulated cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("tiny", "tiny2")


def write_example(d: Path, *, metrics_port: int = 0, replan: str = "", weights: tuple[float, float] = (1.0, 1.0),
                  load_ms: int = 0) -> tuple[Path, Any]:
    """Profiles, a MILP plan of both models, and a serving config with a ctl socket; returns
    (config path, plan)."""
    from ppiped.daemon.launch import write_config
    from ppiped.executor import tiny
    from ppiped.plan import load_plan, save_plan
    from ppiped.planner import plan_cluster
    from ppiped.profiles import profile_from_json

    plan_path, prof_dir = tiny.write_example(d)
    twin = tiny.profile_json(model="tiny2", block_us=(1500.0, 2500.0))
    (prof_dir / "tiny2.json").write_text(json.dumps(twin))
    base = load_plan(plan_path)
    profiles = {m: profile_from_json(json.loads((prof_dir / f"{m}.json").read_text()), m) for m in MODELS}
    plan = plan_cluster(profiles, list(MODELS), list(weights), base.cluster, base.params, time_limit=20,
                        slos_us=[60_000.0, 60_000.0])
    save_plan(plan, d / "plan2.json")
    extra = f'emulate_load_ms = {load_ms}\n\n[ctl]\nsocket = "{d}/admin.sock"\n\n[metrics]\nport = {metrics_port}\n\n[replan]\n{replan}\n'
    cfg = write_config(d, d / "plan2.json", prof_dir, heartbeat_ms=50, timeout_ms=1000,
                       scheduler={"wait_guard_us": 25_000}, extra=extra)
    return cfg, plan


async def load_with_replan(cluster: Any, sock: str, rates: dict[str, float], duration_s: float, at_s: float,
                           weights: dict[str, float], seed: int = 0, extra: dict | None = None
                           ) -> tuple[dict, dict]:
    """Run Poisson load; replan at ``at_s``; return (load report with samples, replan answer)."""
    from ppiped.commands.loadgen import run_load
    from ppiped.ctl import acall

    async def replan() -> dict:
        await asyncio.sleep(at_s)
        return await acall(sock, {"cmd": "replan", "weights": weights, "wait": True, **(extra or {})})

    task = asyncio.create_task(replan())
    try:
        report = await run_load(cluster.client_endpoint, rates, duration_s, seed=seed, keep_samples=True)
    finally:
        rp = await task
    return report, rp


def main(argv: list[str] | None = None) -> int:
    import uvloop

    from ppiped.daemon.launch import LocalCluster, short_tmpdir, split_groups

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    ap.add_argument("--at", type=float, default=30.0, help="replan this many seconds into the load")
    ap.add_argument("--load", type=float, default=0.4, help="offered load / planned throughput, per model")
    ap.add_argument("--weights", default="tiny=3,tiny2=1", help="the mix to replan for")
    ap.add_argument("--load-ms", type=int, default=250, help="emulated load time of one partition")
    ap.add_argument("--no-preload", action="store_true", help="load after the switch (replan.preload_timeout_ms = 0)")
    ap.add_argument("--keep", help="keep config, plans and logs in this directory")
    args = ap.parse_args(argv)
    weights = {k: float(v) for k, v in (x.split("=") for x in args.weights.split(","))}
    with short_tmpdir("ppiped-replan-") as tmp:
        d = Path(args.keep) if args.keep else Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        cfg, plan = write_example(d, load_ms=args.load_ms,
                                  replan="preload_timeout_ms = 0" if args.no_preload else "")
        # the post-replan plan serves less of one model: offer what both plans can carry
        rates = {m.model: args.load * m.throughput_rps * 0.5 for m in plan.models}
        nv = sum(q.num_vgpus for m in plan.models for p in m.pipelines for q in p.partitions)
        with LocalCluster(cfg, split_groups(nv, 2)) as c:
            report, rp = uvloop.run(load_with_replan(c, str(d / "admin.sock"), rates, args.duration, args.at,
                                                     weights))
            st = c.status() or {}
    t = report["total"]
    max_slo = max(m.slo_us for m in plan.models) / 1000
    lo, hi = args.at - 30.0, args.at + 30.0
    window = [hit for ts, hit in report["samples"] if lo <= ts < hi]
    att = sum(window) / len(window) if window else float("nan")
    series: dict[int, list[int]] = {}
    for ts, hit in report["samples"]:
        series.setdefault(int(ts // 5), []).append(hit)
    lines = [
        {"metric": "unanswered", "value": t["no_reply"], "sent": t["sent"], "target": 0},
        {"metric": "dispatch_pause_ms", "value": rp.get("pause_ms"), "limit_ms": max_slo + 100,
         "ok": rp.get("pause_ms") is not None and rp["pause_ms"] <= max_slo + 100,
         "preload": rp.get("preload"), "preload_ms": rp.get("preload_ms"), "load_ms_max": rp.get("load_ms_max"),
         "flush_ms": rp.get("flush_ms"), "switch_ms": rp.get("switch_ms"), "emulated_load_ms": args.load_ms},
        {"metric": "attainment_around_replan", "value": att, "window_s": [max(0.0, lo), min(args.duration, hi)],
         "requests": len(window), "target": 0.98, "dropped": t["dropped"], "rejected": t["rejected"]},
        {"metric": "attainment_per_5s", "value": {f"{5 * k}s": round(sum(v) / len(v), 4)
                                                  for k, v in sorted(series.items())}},
        {"metric": "replan", **{k: v for k, v in rp.items() if k != "plan"},
         "plan_version_after": rp.get("version"), "vgpus_alive_after": (st.get("vgpus") or {}).get("alive"),
         "rates": rates},
    ]
    for line in lines:
        print(json.dumps(line))
    if rp.get("plan"):
        print(rp["plan"], file=sys.stderr)
    return 0 if t["no_reply"] == 0 and rp.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
