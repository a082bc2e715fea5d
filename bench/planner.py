"""Planner bench: re-plan every configuration behind the shared maf21 reference plans.

For each of the 48 configurations (16 model groups x weights x 4 clusters) and each algorithm
(PPipe, NP, DART-r) this plans with the same inputs as the reference (cluster, weights, SLO,
margin, and the reference's own batching-delay rates ``config.est_xput``), checks the plan with
``ppiped.plan.check``, and prints one JSON line per configuration: our normalized throughput,
the reference's, the ratio, seconds and the MIP gap. A summary line follows.

    python bench/planner.py [--jobs 2] [--algo ppipe,np,dart-r] [--limit N] [--time-limit 60]

Skips (exit 0) when ../shared/data/ppipe is absent.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "ppipe"
MODELS_DIR = SHARED / "models"
REF_DIR = SHARED / "reference-plans" / "maf21"
REF_SUFFIX = {"ppipe": "v4", "np": "bl", "dart-r": "dart-r"}
ALGOS = ("ppipe", "np", "dart-r")
TARGET = {"ppipe": 1.00, "np": 0.99, "dart-r": 0.99}


def configurations() -> list[str]:
    """One stem per configuration: the reference file name without ``_<algo>.json``."""
    stems = sorted({p.name[: -len("_v4.json")] for p in REF_DIR.glob("*_v4.json")})
    return stems


def _reference(stem: str, algo: str):
    from ppiped.plan import import_reference

    return import_reference(REF_DIR / f"{stem}_{REF_SUFFIX[algo]}.json")


def run_one(stem: str, algos: list[str], time_limit: float, threads: int) -> dict:
    """Plan one configuration with each algorithm; runs in a worker process."""
    from ppiped.plan import PlanParams, check
    from ppiped.planner import plan_cluster
    from ppiped.profiles import load_profiles

    v4 = _reference(stem, "ppipe")  # its cluster allows every split; NP/DART-r restrict their own
    models = [m.model for m in v4.models]
    weights = [m.weight for m in v4.models]
    rates = [m.batch_delay_rate_rps for m in v4.models]
    profiles = load_profiles(MODELS_DIR, models)
    params = PlanParams(slo_margin=v4.params.slo_margin, batch_delay_factor=v4.params.batch_delay_factor,
                        max_partitions=v4.params.max_partitions, slo_scale=v4.params.slo_scale,
                        slo_reference_gpu=v4.params.slo_reference_gpu)
    gpus = "-".join(v4.cluster.gpus)
    out: dict = {"config": stem, "cluster": gpus, "weights": weights, "models": models, "algos": {}}
    for algo in algos:
        ref = _reference(stem, algo)
        t0 = time.perf_counter()
        try:
            plan = plan_cluster(profiles, models, weights, v4.cluster, params, algo, time_limit, rates,
                                threads)
        except Exception as e:  # noqa: BLE001 - a failure is a bench result, not a crash
            out["algos"][algo] = {"error": f"{type(e).__name__}: {e}", "ref": ref.normalized_throughput}
            continue
        wall = time.perf_counter() - t0
        violations = check(plan, profiles)
        ours = plan.normalized_throughput
        out["algos"][algo] = {
            "ours": round(ours, 3),
            "ref": round(ref.normalized_throughput, 3),
            "ratio": round(ours / ref.normalized_throughput, 5),
            "solve_s": round(wall, 3),
            "gap": plan.solver.get("gap"),
            "status": plan.solver.get("status"),
            "found_by": plan.solver.get("found_by"),
            "ref_gap": ref.solver.get("gap"),
            "check": "ok" if not violations else [str(v) for v in violations],
        }
    return out


def summarize(rows: list[dict], algos: list[str]) -> dict:
    summ: dict = {"summary": True, "configurations": len(rows)}
    for algo in algos:
        res = [r["algos"][algo] for r in rows if algo in r["algos"]]
        ok = [x for x in res if "ratio" in x]
        ratios = [x["ratio"] for x in ok]
        secs = [x["solve_s"] for x in ok]
        s = {
            "planned": len(ok),
            "errors": len(res) - len(ok),
            "check_failures": sum(1 for x in ok if x["check"] != "ok"),
            "below_target": sum(1 for x in ok if x["ratio"] < TARGET[algo]),
            "target": TARGET[algo],
            "not_optimal": sum(1 for x in ok if x["status"] != "optimal"),
        }
        if ok:
            s.update(ratio_min=min(ratios), ratio_median=statistics.median(ratios),
                     ratio_mean=statistics.fmean(ratios), solve_s_median=statistics.median(secs),
                     solve_s_max=max(secs), gap_max=max(x["gap"] or 0.0 for x in ok))
        summ[algo] = s
    pairs = [(r["algos"]["ppipe"], r["algos"]["np"]) for r in rows
             if "ratio" in r["algos"].get("ppipe", {}) and "ratio" in r["algos"].get("np", {})]
    if pairs:
        summ["ppipe_over_np_mean"] = statistics.fmean(a["ours"] / b["ours"] for a, b in pairs)
        summ["ppipe_over_np_mean_reference"] = statistics.fmean(a["ref"] / b["ref"] for a, b in pairs)
    return summ


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    ap.add_argument("--algo", default=",".join(ALGOS), help="algorithms, comma-separated")
    ap.add_argument("--limit", type=int, help="only the first N configurations")
    ap.add_argument("--match", help="only configurations whose name contains this")
    ap.add_argument("--time-limit", type=float, default=60.0, help="planner time limit (s)")
    ap.add_argument("--threads", type=int, default=1, help="CBC threads per job")
    args = ap.parse_args()
    if not REF_DIR.is_dir() or not MODELS_DIR.is_dir():
        print(f"skipped: {SHARED} is not present", file=sys.stderr)
        return 0
    algos = [a for a in args.algo.split(",") if a]
    bad = [a for a in algos if a not in ALGOS]
    if bad:
        ap.error(f"unknown algorithm(s) {bad}; choose from {ALGOS}")
    stems = configurations()
    if args.match:
        stems = [s for s in stems if args.match in s]
    if args.limit:
        stems = stems[: args.limit]
    rows: list[dict] = []
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=get_context("spawn")) as ex:
        futs = {ex.submit(run_one, s, algos, args.time_limit, args.threads): s for s in stems}
        for i, f in enumerate(as_completed(futs), 1):
            row = f.result()
            rows.append(row)
            print(json.dumps(row), flush=True)
            brief = " ".join(f"{a}={x.get('ratio', 'ERR')}/{x.get('solve_s', '-')}s"
                             for a, x in row["algos"].items())
            print(f"[{i}/{len(stems)} {time.perf_counter() - t0:.0f}s] {row['cluster']} "
                  f"{row['config'][:40]}… {brief}", file=sys.stderr, flush=True)
    rows.sort(key=lambda r: r["config"])
    summ = summarize(rows, algos)
    summ["wall_s"] = round(time.perf_counter() - t0, 1)
    summ["jobs"] = args.jobs
    print(json.dumps(summ), flush=True)
    failed = any(summ[a]["check_failures"] or summ[a]["errors"] or summ[a]["below_target"] for a in algos)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
