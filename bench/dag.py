"""Multi-model queries on the simulator: one end-to-end SLO, three ways to schedule it.

Two apps over shared profiles, each planned by ``ppiped.query.split.plan_apps`` (the SLO split
by Nexus's DP over a 5 % grid) on an L4-T4 cluster: a 2-stage app (a detector, then a classifier
on each of its detections: Poisson fan-out, mean 3) and a 3-stage app (the same, then a second
classifier on each classification, fan-out 1). Each runs at load factors 1.0 and 1.3 (× the
plan's query rate) with latency noise σ = 0.05, under

* ``split``: per-stage deadlines from the SLO split, Nexus early drop per stage;
* ``e2e``: PARD, every stage working to the query's deadline less the core's live estimate of
  the stages after it (each at least its planned share of the SLO), proactive drops (at
  admission, and before a stage's children arrive);
* ``chain``: what a client does by hand today, each stage submitted with its stage's SLO from
  the moment the client has the previous stage's answer;
* ``e2e-ppipe``: PARD's end-to-end deadlines and its check before a stage's children arrive, with
  PPipe's batching inside each model (``ppipe``: a batch shrinks rather than drop within a stage).

Prints one JSON line per run (goodput = queries completed within the SLO per second, over the
plan's query rate; drop rate = queries dropped / offered; invalid rate = GPU time on requests
whose query failed / all GPU time), then a table and the issue's check at load 1.3: PARD's
invalid rate ≤ 1/3 of the split's and its goodput ≥ the split's.

    .venv/bin/python bench/dag.py                     # both apps, 20 s runs, 3 seeds
    .venv/bin/python bench/dag.py --duration 2 --seeds 1 --apps 2   # a smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "ppipe"

DETECTOR = "tf_efficientdet_d1"
CLASSIFIER = "googlenet-v3-pytorch"
SECOND = "repvgg-b3"
GLUE_MS = 1.0


def app_spec(stages: int, slo_ms: float) -> dict:
    st = [{"name": "detect", "model": DETECTOR},
          {"name": "classify", "model": CLASSIFIER, "after": "detect", "fanout": 3.0, "glue": "bench.dag:crop"}]
    if stages == 3:
        st.append({"name": "refine", "model": SECOND, "after": "classify", "fanout": 1.0, "glue": "bench.dag:crop"})
    return {"name": f"app{stages}", "slo_ms": slo_ms, "glue_ms": GLUE_MS, "stages": st}


def make_plan(stages: int, profiles, cluster, time_limit: float):
    from ppiped.plan import PlanParams, model_slo_us
    from ppiped.query.app import app_from_json
    from ppiped.query.split import plan_apps

    params = PlanParams()
    models = [DETECTOR, CLASSIFIER, SECOND][:stages]
    # the app's SLO: what the stages would get as separate models (PPipe's rule), plus glue
    slo_ms = sum(model_slo_us(profiles[m], params) for m in models) / 1e3 + GLUE_MS * (stages - 1)
    app = app_from_json(app_spec(stages, slo_ms))
    return plan_apps(profiles, [app], cluster, params, "ppipe", "dp", time_limit=time_limit)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA)
    ap.add_argument("--cluster", default=str(HERE.parent / "plans" / "l4-t4.toml"))
    ap.add_argument("--apps", default="2,3", help="stage counts to run (2, 3 or both)")
    ap.add_argument("--loads", default="1.0,1.3")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--jitter", type=float, default=0.05)
    ap.add_argument("--time-limit", type=float, default=30.0)
    args = ap.parse_args(argv)
    models_dir = args.data / "models"
    if not models_dir.is_dir():
        print(f"skip: no shared profiles at {models_dir}", file=sys.stderr)
        return 0
    from ppiped.cluster import load_cluster
    from ppiped.core.layout import Layout
    from ppiped.profiles import load_profiles
    from ppiped.sim.dag import SYSTEMS, app_capacity_qps, simulate_apps

    profiles = load_profiles(models_dir, [DETECTOR, CLASSIFIER, SECOND])
    cluster = load_cluster(args.cluster)
    loads = [float(x) for x in args.loads.split(",")]
    rows = []
    for n in (int(x) for x in args.apps.split(",")):
        t0 = time.perf_counter()
        plan = make_plan(n, profiles, cluster, args.time_limit)
        app = plan.apps[0]
        cap = app_capacity_qps(plan, app)
        print(json.dumps({"app": app.name, "plan_s": round(time.perf_counter() - t0, 2), "query_rate_qps": cap,
                          "slo_ms": app.slo_us / 1e3, "split": plan.solver.get("apps", {}).get(app.name, {}).get("method"),
                          "budgets_ms": [s.budget_us / 1e3 for s in app.stages],
                          "stage_rps": [plan.model(s.model).throughput_rps for s in app.stages]}), flush=True)
        lay = Layout.from_plan(plan, profiles)
        for lf in loads:
            for system, (mode, policy) in SYSTEMS.items():
                acc = {"goodput": [], "drop": [], "invalid": [], "late": []}
                for seed in range(args.seeds):
                    r = simulate_apps(plan, profiles, lf, mode, policy, args.duration, seed, args.jitter, layout=lay)
                    a = r.apps[0]
                    line = {"app": app.name, "system": system, "policy": policy, "load_factor": lf, "seed": seed,
                            "jitter_sigma": args.jitter, "duration_s": args.duration,
                            "goodput_over_capacity": a.goodput_qps / cap, **a.to_json()}
                    print(json.dumps(line), flush=True)
                    acc["goodput"].append(a.goodput_qps / cap)
                    acc["drop"].append(a.drop_rate)
                    acc["invalid"].append(a.invalid_rate)
                    acc["late"].append(a.late / a.queries if a.queries else 0.0)
                rows.append((app.name, lf, system, *(sum(v) / len(v) for v in acc.values())))
    print(f"\n{'app':<6} {'load':>5} {'system':<9} {'goodput/cap':>12} {'drop rate':>10} {'invalid rate':>13} "
          f"{'late share':>11}")
    for name, lf, system, g, d, i, late in rows:
        print(f"{name:<6} {lf:5.2f} {system:<9} {g:12.3f} {d:10.4f} {i:13.4f} {late:11.4f}")
    ok_all = True
    for name in sorted({r[0] for r in rows}):
        by = {r[2]: r for r in rows if r[0] == name and math.isclose(r[1], 1.3)}
        for pard in ("e2e", "e2e-ppipe"):
            if "split" not in by or pard not in by:
                continue
            inv_ok = by[pard][5] <= by["split"][5] / 3 + 1e-12
            gp_ok = by[pard][3] >= by["split"][3]
            if pard == "e2e":  # the check: the pard policy end to end
                ok_all &= inv_ok and gp_ok
            print(f"{name} at 1.3: {pard} invalid {by[pard][5]:.4f} vs split {by['split'][5]:.4f} "
                  f"(<= 1/3: {'yes' if inv_ok else 'NO'}), goodput {by[pard][3]:.3f} vs {by['split'][3]:.3f} "
                  f"(>=: {'yes' if gp_ok else 'NO'})")
    print(json.dumps({"summary": "dag", "met": ok_all}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
