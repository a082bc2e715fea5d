"""Planner bench: re-plan the maf21 reference configurations, PPipe's ablation settings, and larger clusters.

Parts (``--part``, default ``maf21``; ``all`` runs the three one after another):

``maf21``
    The 48 configurations behind the shared maf21 reference plans (model groups x weights x 4
    clusters). For each algorithm (PPipe, NP, DART-r) it plans with the reference's inputs
    (cluster, weights, SLO, margin, and the reference's own batching-delay rates
    ``config.est_xput``) and compares with the reference. Target: ours / reference >= 1.00
    (PPipe) or 0.99 (NP, DART-r).

``ablation``
    PPipe's ablation settings: each of the 18 profiled models alone on L4:25,T4:75 (4 L4 or 2 T4
    per server, vGPU splits 1-4 on both, NIC 10 Gb/s), up to 3 partitions, SLO margin 0.1,
    SLO = 5 x whole-model L4 latency. NP is planned first (it derives its own batching-delay
    rate), then PPipe with NP's throughput as the rate. Target: PPipe >= NP on every model.

``scale``
    The maf21 3-model groups (models and weights of the L4-T4 ``_v4`` reference files, whose
    ``est_xput`` gives the batching-delay rates) on clusters the references do not cover:
    ``3types`` L4:25,V100:25,T4:50 and ``4types`` L4:25,V100:25,T4:25,P4:25 (per server L4 4,
    V100 4, T4 2, P4 1; splits up to 4, P4 1; NIC 10 Gb/s), and ``1kgpus`` L4:250,T4:750 and
    ``10kgpus`` L4:2500,T4:7500 (as L4-T4) on the first ``--large-groups`` groups, with the
    reference rates scaled by the cluster's size over 100 GPUs. Up to 2 partitions, margin 0.4.
    Targets: solved within 10 s (3 types), 20 s (4 types), 5 s (large), and status optimal or
    gap <= 0.1 %. Each plan's time limit is its target (or ``--time-limit`` if lower), and it
    asks the planner for that gap (``ppiped plan --mip-gap 0.001``): the planner stops once it
    has proven it, and its "optimal" then means within it (``solver.mip_gap``). Runs one
    case at a time by default (``--jobs 1``), CBC on both cores (``--threads 2``), so timings
    are not disturbed.

Every part prints one JSON line per case on stdout and a summary line (``"summary": true``),
progress and a table on stderr. Every case row lists the targets it missed (``missed``); the
exit status is 1 when any case missed one (an error or a failed plan check counts), else 0.

    python bench/planner.py [--part maf21|ablation|scale|all] [--jobs N] [--limit N] [--match S]
                            [--time-limit 60] [--algo ppipe,np,dart-r] [--large-groups 3]

``--limit N`` keeps the first N cases of each cluster kind (maf21, ablation: the first N
configurations or models; scale: the first N groups of each cluster), ``--match S`` the cases
whose name contains S. ``--algo`` applies to ``maf21``. Skips (exit 0) when ../shared/data/ppipe
is absent.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data" / "ppipe"
MODELS_DIR = SHARED / "models"
REF_DIR = SHARED / "reference-plans" / "maf21"
REF_SUFFIX = {"ppipe": "v4", "np": "bl", "dart-r": "dart-r"}
ALGOS = ("ppipe", "np", "dart-r")
TARGET = {"ppipe": 1.00, "np": 1.00, "dart-r": 1.00}  # ratios rounded to 5 decimals
PARTS = ("maf21", "ablation", "scale")
DEFAULT_JOBS = {"maf21": 2, "ablation": 2, "scale": 1}
# CBC threads per job: the scale part runs one job at a time and gives CBC both cores.
DEFAULT_THREADS = {"maf21": 1, "ablation": 1, "scale": 2}

ABLATION = {"gpus": "L4:25,T4:75", "per_server": "4,2", "splits": "4,4", "nic_gbps": 10.0,
            "max_partitions": 3, "slo_margin": 0.1, "slo_scale": 5.0}
ABLATION_TOL = 1e-6  # PPipe / NP >= 1 - this

# Scale clusters: kind -> (--gpus, per server, largest split, solve-time target in s, large?).
SCALE = {
    "3types": ("L4:25,V100:25,T4:50", "4,4,2", "4,4,4", 10.0, False),
    "4types": ("L4:25,V100:25,T4:25,P4:25", "4,4,2,1", "4,4,4,1", 20.0, False),
    "1kgpus": ("L4:250,T4:750", "4,2", "4,4", 5.0, True),
    "10kgpus": ("L4:2500,T4:7500", "4,2", "4,4", 5.0, True),
}
SCALE_NIC_GBPS = 10.0
SCALE_GAP = 0.001  # status optimal, or a gap at most this (0.1 %)
SCALE_REF_CLUSTER = "_L4-T4_25-75_"  # reference files giving models, weights and rates


@dataclass
class Case:
    """One unit of work: ``part`` picks the runner, ``kind`` groups cases for ``--limit``."""

    part: str
    kind: str
    name: str
    spec: dict[str, Any] = field(default_factory=dict)


# --------------------------------------------------------------------------- shared helpers


def configurations(refs: Path = REF_DIR) -> list[str]:
    """One stem per configuration of a plan set: the reference file name without ``_<algo>.json``."""
    return sorted({p.name[: -len("_v4.json")] for p in refs.glob("*_v4.json")})


def _ref_path(stem: str, algo: str, refs: Path = REF_DIR) -> Path:
    return refs / f"{stem}_{REF_SUFFIX[algo]}.json"


def _reference(stem: str, algo: str, refs: Path = REF_DIR):
    from ppiped.plan import import_reference

    return import_reference(_ref_path(stem, algo, refs))


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None


def plan_and_check(profiles, models, weights, cluster, params, algo, time_limit, rates, threads,
                   mip_gap: float = 1e-6):
    """Plan once and check the plan; returns ``(plan or None, record)``.

    The record is what every part reports for one plan: normalized throughput, wall seconds,
    solver status, gap and who found the plan, and the checker's verdict, or the error.
    """
    from ppiped.plan import check
    from ppiped.planner import plan_cluster

    t0 = time.perf_counter()
    try:
        plan = plan_cluster(profiles, models, weights, cluster, params, algo, time_limit, rates, threads,
                            mip_gap=mip_gap)
    except Exception as e:  # noqa: BLE001 - a failure is a bench result, not a crash
        return None, {"error": f"{type(e).__name__}: {e}", "solve_s": round(time.perf_counter() - t0, 3)}
    wall = time.perf_counter() - t0
    violations = check(plan, profiles)
    return plan, {
        "ours": round(plan.normalized_throughput, 3),
        "solve_s": round(wall, 3),
        "gap": _finite(plan.solver.get("gap")),
        "status": plan.solver.get("status"),
        "found_by": plan.solver.get("found_by"),
        "check": "ok" if not violations else [str(v) for v in violations],
    }


def _record_missed(label: str, rec: dict) -> list[str]:
    """Targets every plan has: it was made, and it passes the checker."""
    if "error" in rec:
        return [f"{label}: error"]
    if rec["check"] != "ok":
        return [f"{label}: check failed"]
    return []


def _fmt(x: Any, nd: int = 3) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def _pct(gap: Any) -> str:
    return "-" if gap is None else "0%" if gap < 1e-9 else f"{100 * gap:.3g}%"


def _ratio(x: Any) -> str:
    return x if isinstance(x, str) else "-" if x is None else f"{x:.4f}"


def _label(row: dict) -> str:
    """A short name for a 3-model configuration: each model's first word, and the weights."""
    if not row.get("models"):
        return _short(row["case"])
    models = "+".join(m.split("_")[0][:14] for m in row["models"])
    return f"{models} {'-'.join(f'{w:g}' for w in row.get('weights', []))}"


def _table(headers: list[str], rows: list[list[Any]]) -> str:
    cells = [[_fmt(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    line = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip()  # noqa: E731
    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in cells])


def _short(name: str, n: int = 44) -> str:
    return name if len(name) <= n else name[: n - 1] + "…"


def _stats(values: list[float], prefix: str) -> dict:
    if not values:
        return {}
    return {f"{prefix}_min": min(values), f"{prefix}_median": statistics.median(values),
            f"{prefix}_mean": statistics.fmean(values), f"{prefix}_max": max(values)}


# --------------------------------------------------------------------------- part: maf21


def maf21_cases(args) -> list[Case]:
    algos = [a for a in args.algo.split(",") if a]
    from ppiped.plan import reference_plan_set

    refs = reference_plan_set(args.data, args.plan_set)
    return [Case("maf21", "maf21", s, {"algos": algos, "refs": str(refs), "models": str(Path(args.data) / "models")})
            for s in configurations(refs)]


def maf21_run(case: Case, time_limit: float, threads: int) -> dict:
    from ppiped.plan import PlanParams
    from ppiped.profiles import load_profiles

    refs = Path(case.spec["refs"])
    v4 = _reference(case.name, "ppipe", refs)  # its cluster allows every split; NP/DART-r restrict their own
    models = [m.model for m in v4.models]
    weights = [m.weight for m in v4.models]
    rates = [m.batch_delay_rate_rps for m in v4.models]
    profiles = load_profiles(Path(case.spec["models"]), models)
    params = PlanParams(slo_margin=v4.params.slo_margin, batch_delay_factor=v4.params.batch_delay_factor,
                        max_partitions=v4.params.max_partitions, slo_scale=v4.params.slo_scale,
                        slo_reference_gpu=v4.params.slo_reference_gpu)
    out: dict = {"config": case.name, "cluster": "-".join(v4.cluster.gpus), "weights": weights,
                 "models": models, "algos": {}}
    for algo in case.spec["algos"]:
        ref = _reference(case.name, algo, refs) if _ref_path(case.name, algo, refs).is_file() else None
        _, rec = plan_and_check(profiles, models, weights, v4.cluster, params, algo, time_limit, rates,
                                threads)
        rec["ref"] = None if ref is None else round(ref.normalized_throughput, 3)
        if "error" not in rec and ref is not None:
            rec["ratio"] = round(rec["ours"] / ref.normalized_throughput, 5)
            rec["ref_gap"] = ref.solver.get("gap")
        out["algos"][algo] = rec
    return out


def maf21_missed(row: dict) -> list[str]:
    missed = []
    for algo, rec in row.get("algos", {}).items():
        m = _record_missed(algo, rec)
        if not m and rec.get("ratio", math.inf) < TARGET[algo]:
            m = [f"{algo}: ratio {rec['ratio']} < {TARGET[algo]}"]
        missed += m
    return missed


def maf21_brief(row: dict) -> str:
    return " ".join(f"{a}={x.get('ratio', 'ERR')}/{x.get('solve_s', '-')}s" for a, x in row["algos"].items())


def maf21_summary(rows: list[dict], args) -> dict:
    algos = [a for a in args.algo.split(",") if a]
    summ: dict = {"configurations": len(rows)}
    for algo in algos:
        res = [r["algos"][algo] for r in rows if algo in r.get("algos", {})]
        ok = [x for x in res if "ratio" in x]
        s = {
            "planned": sum(1 for x in res if "error" not in x),
            "without_reference": sum(1 for x in res if "error" not in x and x.get("ref") is None),
            "errors": len(rows) - sum(1 for x in res if "error" not in x),
            "check_failures": sum(1 for x in ok if x["check"] != "ok"),
            "below_target": sum(1 for x in ok if x["ratio"] < TARGET[algo]),
            "target": TARGET[algo],
            "not_optimal": sum(1 for x in ok if x["status"] != "optimal"),
        }
        if ok:
            gaps = [x["gap"] for x in ok if x["gap"] is not None]
            s.update(ratio_min=min(x["ratio"] for x in ok),
                     ratio_median=statistics.median(x["ratio"] for x in ok),
                     ratio_mean=statistics.fmean(x["ratio"] for x in ok),
                     solve_s_median=statistics.median(x["solve_s"] for x in ok),
                     solve_s_max=max(x["solve_s"] for x in ok), gap_max=max(gaps, default=None))
        summ[algo] = s
    pairs = [(r["algos"]["ppipe"], r["algos"]["np"]) for r in rows
             if "ratio" in r.get("algos", {}).get("ppipe", {}) and "ratio" in r.get("algos", {}).get("np", {})]
    if pairs:
        summ["ppipe_over_np_mean"] = statistics.fmean(a["ours"] / b["ours"] for a, b in pairs)
        summ["ppipe_over_np_mean_reference"] = statistics.fmean(a["ref"] / b["ref"] for a, b in pairs)
    return summ


def maf21_table(rows: list[dict], args) -> str:
    algos = [a for a in args.algo.split(",") if a]
    headers = ["cluster", "configuration"] + [f"{a} {k}" for a in algos for k in ("ratio", "s")] + ["missed"]
    body = [[r.get("cluster", "?"), _label(r)]
            + [v for a in algos for v in (_ratio(r.get("algos", {}).get(a, {}).get("ratio", "ERR")),
                                          r.get("algos", {}).get(a, {}).get("solve_s"))]
            + [len(r["missed"])] for r in rows]
    return _table(headers, body)


# --------------------------------------------------------------------------- part: ablation


def ablation_cases(args) -> list[Case]:
    models = Path(args.data) / "models"
    return [Case("ablation", "ablation", p.stem, {"models": str(models)}) for p in sorted(models.glob("*.json"))]


def ablation_run(case: Case, time_limit: float, threads: int) -> dict:
    from ppiped.cluster import cluster_from_flags
    from ppiped.plan import PlanParams
    from ppiped.profiles import load_profiles

    a = ABLATION
    model = case.name
    profiles = load_profiles(Path(case.spec["models"]), [model])
    cluster = cluster_from_flags(a["gpus"], a["per_server"], a["splits"], a["nic_gbps"])
    params = PlanParams(slo_margin=a["slo_margin"], max_partitions=a["max_partitions"],
                        slo_scale=a["slo_scale"], slo_reference_gpu="L4")
    out: dict = {"model": model, "cluster": a["gpus"], "algos": {}}
    np_plan, out["algos"]["np"] = plan_and_check(profiles, [model], [1.0], cluster, params, "np",
                                                 time_limit, None, threads)
    if np_plan is None:
        out["algos"]["ppipe"] = {"error": "skipped: no NP plan to take the batching-delay rate from"}
        return out
    rate = np_plan.models[0].throughput_rps
    out["batch_delay_rate_rps"] = round(rate, 3)
    out["slo_ms"] = round(np_plan.models[0].slo_us / 1000, 3)
    _, out["algos"]["ppipe"] = plan_and_check(profiles, [model], [1.0], cluster, params, "ppipe",
                                              time_limit, [rate], threads)
    pp, np_ = out["algos"]["ppipe"], out["algos"]["np"]
    if "error" not in pp and np_["ours"] > 0:
        out["ratio"] = round(pp["ours"] / np_["ours"], 6)
    return out


def ablation_missed(row: dict) -> list[str]:
    missed = _record_missed("np", row["algos"]["np"]) + _record_missed("ppipe", row["algos"]["ppipe"])
    if not missed and row.get("ratio") is None:
        missed.append("no ratio (NP throughput 0)")
    elif not missed and row["ratio"] < 1 - ABLATION_TOL:
        missed.append(f"ppipe/np {row['ratio']} < 1")
    return missed


def ablation_brief(row: dict) -> str:
    a = row.get("algos", {})
    return (f"ppipe={a.get('ppipe', {}).get('ours', 'ERR')} np={a.get('np', {}).get('ours', 'ERR')} "
            f"ratio={row.get('ratio', '-')}")


def ablation_summary(rows: list[dict], args) -> dict:
    ok = [r for r in rows if r.get("ratio") is not None]
    ratios = [r["ratio"] for r in ok]
    pp = [r["algos"]["ppipe"] for r in ok]
    summ = {
        "models": len(rows),
        "planned": len(ok),
        "errors": sum(1 for r in rows if "error" in r or any("error" in x for x in r.get("algos", {}).values())),
        "check_failures": sum(1 for r in ok for x in r["algos"].values() if x["check"] != "ok"),
        "below_target": sum(1 for x in ratios if x < 1 - ABLATION_TOL),
        "target": "ppipe >= np",
        "ppipe_not_optimal": sum(1 for x in pp if x["status"] != "optimal"),
        **_stats(ratios, "ratio"),
    }
    if ratios:
        summ["ratio_geomean"] = math.exp(statistics.fmean(math.log(max(x, 1e-12)) for x in ratios))
        summ["ppipe_solve_s_max"] = max(x["solve_s"] for x in pp)
        summ["np_solve_s_max"] = max(r["algos"]["np"]["solve_s"] for r in ok)
    return summ


def ablation_table(rows: list[dict], args) -> str:
    headers = ["model", "ppipe", "np", "ratio", "ppipe s", "np s", "status", "gap", "check", "missed"]
    body = []
    for r in rows:
        a = r.get("algos", {})
        pp, np_ = a.get("ppipe", {}), a.get("np", {})
        chk = "ok" if pp.get("check") == "ok" and np_.get("check") == "ok" else "FAIL/ERR"
        body.append([_short(r["case"], 36), pp.get("ours", "ERR"), np_.get("ours", "ERR"), _ratio(r.get("ratio")),
                     pp.get("solve_s"), np_.get("solve_s"), pp.get("status"), _pct(pp.get("gap")), chk,
                     len(r["missed"])])
    return _table(headers, body)


# --------------------------------------------------------------------------- part: scale


def _scale_groups(refs: Path) -> list[str]:
    """The plan set's configurations on L4-T4: one per model group and weights."""
    return [s for s in configurations(refs) if SCALE_REF_CLUSTER in s]


def scale_cases(args) -> list[Case]:
    from ppiped.plan import reference_plan_set

    refs = reference_plan_set(args.data, args.plan_set)
    groups = _scale_groups(refs)
    # Large clusters: distinct model sets first, so a few groups are a few different models.
    firsts, rest, seen = [], [], set()
    for s in groups:
        models = s.split("_L4-T4_")[0].rsplit("_", 1)[0]
        (rest if models in seen else firsts).append(s)
        seen.add(models)
    large = (firsts + rest)[: args.large_groups]
    cases = []
    for kind, (gpus, per_server, splits, target_s, is_large) in SCALE.items():
        total = sum(int(x.split(":")[1]) for x in gpus.split(","))
        for stem in large if is_large else groups:
            cases.append(Case("scale", kind, f"{kind}/{stem}", {
                "stem": stem, "refs": str(refs), "models": str(Path(args.data) / "models"), "gpus": gpus, "per_server": per_server, "splits": splits,
                "target_s": target_s, "rate_scale": total / 100 if is_large else 1.0}))
    return cases


def scale_run(case: Case, time_limit: float, threads: int) -> dict:
    from ppiped.cluster import cluster_from_flags
    from ppiped.plan import PlanParams
    from ppiped.profiles import load_profiles

    sp = case.spec
    v4 = _reference(sp["stem"], "ppipe", Path(sp["refs"]))
    models = [m.model for m in v4.models]
    weights = [m.weight for m in v4.models]
    rates = [m.batch_delay_rate_rps * sp["rate_scale"] for m in v4.models]
    profiles = load_profiles(Path(sp["models"]), models)
    cluster = cluster_from_flags(sp["gpus"], sp["per_server"], sp["splits"], SCALE_NIC_GBPS)
    params = PlanParams(slo_margin=0.4, batch_delay_factor=v4.params.batch_delay_factor, max_partitions=2,
                        slo_scale=5.0, slo_reference_gpu="L4")
    _, rec = plan_and_check(profiles, models, weights, cluster, params, "ppipe", min(time_limit, sp["target_s"]),
                            rates, threads, mip_gap=SCALE_GAP)
    return {"config": sp["stem"], "cluster": sp["gpus"], "models": models, "weights": weights,
            "rate_scale": sp["rate_scale"], "target_s": sp["target_s"], "algos": {"ppipe": rec}}


def scale_missed(row: dict) -> list[str]:
    rec = row["algos"]["ppipe"]
    missed = _record_missed("ppipe", rec)
    if "error" in rec:
        return missed
    if rec["solve_s"] > row["target_s"]:
        missed.append(f"solve {rec['solve_s']} s > {row['target_s']} s")
    if rec["status"] != "optimal" and (rec["gap"] is None or rec["gap"] > SCALE_GAP):
        missed.append(f"status {rec['status']} gap {rec['gap']}")
    return missed


def scale_brief(row: dict) -> str:
    rec = row["algos"]["ppipe"]
    return f"ppipe={rec.get('ours', 'ERR')} {rec.get('solve_s')}s {rec.get('status')} gap={_pct(rec.get('gap'))}"


def scale_summary(rows: list[dict], args) -> dict:
    summ: dict = {"cases": len(rows)}
    for kind, (gpus, *_rest) in SCALE.items():
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        ok = [r["algos"]["ppipe"] for r in rs if "error" not in r.get("algos", {}).get("ppipe", {"error": 1})]
        summ[kind] = {
            "cluster": gpus, "target_s": SCALE[kind][3], "cases": len(rs), "planned": len(ok),
            "errors": len(rs) - len(ok),
            "check_failures": sum(1 for x in ok if x["check"] != "ok"),
            "missed": sum(1 for r in rs if r["missed"]),
            "not_optimal": sum(1 for x in ok if x["status"] != "optimal"),
            "gap_max": max((x["gap"] for x in ok if x["gap"] is not None), default=None),
            **_stats([x["solve_s"] for x in ok], "solve_s"),
        }
    return summ


def scale_table(rows: list[dict], args) -> str:
    headers = ["kind", "configuration", "ppipe", "solve s", "target s", "status", "gap", "check", "missed"]
    body = []
    for r in rows:
        rec = r.get("algos", {}).get("ppipe", {})
        body.append([r["kind"], _label(r), rec.get("ours", "ERR"), rec.get("solve_s"),
                     r.get("target_s"), rec.get("status"), _pct(rec.get("gap")),
                     "ok" if rec.get("check") == "ok" else "FAIL/ERR", len(r["missed"])])
    return _table(headers, body)


# --------------------------------------------------------------------------- one path for every part


@dataclass(frozen=True)
class Part:
    cases: Callable[[Any], list[Case]]
    run: Callable[[Case, float, int], dict]
    missed: Callable[[dict], list[str]]
    brief: Callable[[dict], str]
    summary: Callable[[list[dict], Any], dict]
    table: Callable[[list[dict], Any], str]


PART = {
    "maf21": Part(maf21_cases, maf21_run, maf21_missed, maf21_brief, maf21_summary, maf21_table),
    "ablation": Part(ablation_cases, ablation_run, ablation_missed, ablation_brief, ablation_summary,
                     ablation_table),
    "scale": Part(scale_cases, scale_run, scale_missed, scale_brief, scale_summary, scale_table),
}


def run_case(case: Case, time_limit: float, threads: int) -> dict:
    """Run one case of any part and record it; runs in a worker process."""
    part = PART[case.part]
    t0 = time.perf_counter()
    try:
        body = part.run(case, time_limit, threads)
    except Exception as e:  # noqa: BLE001 - e.g. a reference or profile that does not load
        body = {"error": f"{type(e).__name__}: {e}"}
    row = {"part": case.part, "kind": case.kind, "case": case.name, **body}
    row["case_s"] = round(time.perf_counter() - t0, 3)
    row["missed"] = [f"error: {body['error']}"] if "error" in body else part.missed(row)
    return row


def select(cases: list[Case], match: str | None, limit: int | None) -> list[Case]:
    """``--match``: the name contains it; ``--limit``: the first N of each kind."""
    if match:
        cases = [c for c in cases if match in c.name]
    if limit is not None:
        taken: dict[str, int] = {}
        kept = []
        for c in cases:
            if taken.get(c.kind, 0) < limit:
                taken[c.kind] = taken.get(c.kind, 0) + 1
                kept.append(c)
        cases = kept
    return cases


def run_part(name: str, args) -> bool:
    """Run one part's cases; prints rows, the summary and the table; True when a target was missed."""
    part = PART[name]
    cases = select(part.cases(args), args.match, args.limit)
    jobs = max(1, args.jobs if args.jobs is not None else DEFAULT_JOBS[name])
    threads = max(1, args.threads if args.threads is not None else DEFAULT_THREADS[name])
    print(f"== part {name}: {len(cases)} case(s), {jobs} job(s) × {threads} CBC thread(s), "
          f"time limit {args.time_limit} s", file=sys.stderr, flush=True)
    rows: list[dict] = []
    t0 = time.perf_counter()
    if cases:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as ex:
            futs = [ex.submit(run_case, c, args.time_limit, threads) for c in cases]
            for i, f in enumerate(as_completed(futs), 1):
                row = f.result()
                rows.append(row)
                print(json.dumps(row), flush=True)
                brief = row["missed"][0] if "error" in row else part.brief(row)
                tag = " ".join(x for x in (row["kind"] if row["kind"] != name else "",
                                           row.get("cluster", "") if name == "maf21" else "", _label(row)) if x)
                print(f"[{name} {i}/{len(cases)} {time.perf_counter() - t0:.0f}s] {tag} "
                      f"{brief}{'  MISSED: ' + '; '.join(row['missed']) if row['missed'] else ''}",
                      file=sys.stderr, flush=True)
    order = {c.name: i for i, c in enumerate(cases)}
    rows.sort(key=lambda r: order[r["case"]])
    summ = {"summary": True, "part": name, **part.summary(rows, args)}
    summ["cases_missed"] = sum(1 for r in rows if r["missed"])
    summ["wall_s"] = round(time.perf_counter() - t0, 1)
    summ["jobs"] = jobs
    summ["threads"] = threads
    summ["time_limit_s"] = args.time_limit
    print(json.dumps(summ), flush=True)
    if rows:
        print(part.table(rows, args), file=sys.stderr)
    print(f"== part {name}: {summ['cases_missed']} of {len(rows)} case(s) missed a target",
          file=sys.stderr, flush=True)
    return summ["cases_missed"] > 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="maf21", choices=[*PARTS, "all"], help="what to run (default maf21)")
    ap.add_argument("--jobs", type=int, help="worker processes (default 2; 1 for the scale part)")
    ap.add_argument("--algo", default=",".join(ALGOS), help="maf21: algorithms, comma-separated")
    ap.add_argument("--limit", type=int, help="only the first N cases of each cluster kind")
    ap.add_argument("--match", help="only cases whose name contains this")
    ap.add_argument("--time-limit", type=float, default=60.0, help="planner time limit per plan (s)")
    ap.add_argument("--threads", type=int, help="CBC threads per job (default 1; 2 for the scale part)")
    ap.add_argument("--large-groups", type=int, default=3,
                    help="scale: model groups planned on the 1,000- and 10,000-GPU clusters (default 3)")
    ap.add_argument("--data", default=str(SHARED), help="the PPipe data set (models/, reference-plans/)")
    ap.add_argument("--plan-set", default="maf21",
                    help="maf21 and scale: reference plans, a folder name under DATA/reference-plans or a "
                         "path (default maf21)")
    args = ap.parse_args(argv)
    from ppiped.plan import reference_plan_set

    refs, models = reference_plan_set(args.data, args.plan_set), Path(args.data) / "models"
    if not refs.is_dir() or not models.is_dir():
        if args.plan_set == "maf21" and args.data == str(SHARED):
            print(f"skipped: {SHARED} is not present", file=sys.stderr)
            return 0
        ap.error(f"no plan set {refs} or no {models}")
    bad = [a for a in args.algo.split(",") if a and a not in ALGOS]
    if bad:
        ap.error(f"unknown algorithm(s) {bad}; choose from {ALGOS}")
    parts = PARTS if args.part == "all" else (args.part,)
    missed = [p for p in parts if run_part(p, args)]
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
