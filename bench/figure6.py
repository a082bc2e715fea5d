"""Reproduce PPipe's Figure 6 on the simulator: max load factor at 99% attainment, per system.

For every reference configuration of a plan set (``--plan-set``, default maf21: 48 in the shared
data set; any folder of PPipe reference files, single-model ones included) and every trace (Poisson,
bursty with cv 2), the largest load factor at which every model keeps >= 99% SLO attainment, for

* PPipe   = the ``_v4`` plan under our ``ppipe`` policy (reservation-based batching),
* NP      = the ``_bl`` plan (no partitioning) under ``ppipe``,
* DART-r  = the ``_dart-r`` plan under ``ppipe``,
* Reactive = the ``_v4`` plan under ``reactive`` (per-pool batching, no reservations),

where load factor 1.0 is the ``_v4`` plan's per-model throughput (as in the paper). Every sweep
runs the daemon's own compiled core on the simulator's virtual clock.

Prints one JSON line per sweep as it finishes, a summary table and the mean per system, and
writes PNGs: Figure 6 (bars), Figure 7 (attainment vs load factor, one configuration) and
Figure 12 (per-vGPU timelines, the same configuration, PPipe vs Reactive).

    .venv/bin/python bench/figure6.py                 # the full bench, both cores
    .venv/bin/python bench/figure6.py --limit 2 --duration 2 --traces poisson   # a smoke run

Runs at latency noise σ = 0 (the paper's simulator uses the profiled latencies), 0.05 and 0.1
by default (``--jitter``), with work-conserving executors (``--start-early-us``, default inf).
Transfers share the servers' NICs (``--no-nic``: they never queue); ``--cv`` sets the bursty
trace's coefficient of variation (2 by default; note that cv 4 Gamma gaps are far burstier than
what the paper's bursty numbers suggest: cv 1.5 lands near them).
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_DATA = HERE.parent.parent / "shared" / "data" / "ppipe"

SYSTEMS = {  # name -> (plan suffix, policy, sweep start guess per trace; only speed depends on it)
    "PPipe": ("v4", "ppipe", {"poisson": 0.9, "bursty": 0.2}),
    "NP": ("bl", "ppipe", {"poisson": 0.55, "bursty": 0.15}),
    "DART-r": ("dart-r", "ppipe", {"poisson": 0.6, "bursty": 0.15}),
    "Reactive": ("v4", "reactive", {"poisson": 0.6, "bursty": 0.15}),
}
PAPER = {"poisson": {"PPipe": 0.965, "DART-r": 0.749, "NP": 0.668},
         "bursty": {"PPipe": 0.903, "DART-r": 0.694, "NP": 0.611}}


@dataclass(frozen=True)
class Task:
    config: str  # the v4 file name without "_v4.json"
    system: str
    trace: str


def _sweep(task: Task, plans_dir: str, models_dir: str, duration: float, seed: int, sigma: float,
           target: float, early: float, cv: float, nic: bool, paper_metric: bool = False,
           trace_scale: str = "stretch", oracle: str = "") -> dict:
    """One sweep in a worker process; returns its JSON line."""
    from ppiped.sim.run import PointSpec
    from ppiped.sim.sweep import sweep

    suffix, policy, starts = SYSTEMS[task.system]
    plan = str(Path(plans_dir) / f"{task.config}_{suffix}.json")
    spec = PointSpec(plan, models_dir, task.trace, duration, seed, policy, sigma, cv, early,
                     str(Path(plans_dir) / f"{task.config}_v4.json"), target, nic, trace_scale,
                     oracle_latency=oracle)
    t0 = time.perf_counter()
    cpu0 = time.process_time()
    start = starts.get(task.trace, 0.5) if cv >= 3 or task.trace != "bursty" else 0.6
    sr = sweep(spec, target, 0.05, 0.01, start=start)
    out = {"config": task.config, "system": task.system, "plan": Path(plan).name, "policy": policy,
           "trace": task.trace, "cv": cv if task.trace == "bursty" else None, "duration_s": duration, "seed": seed, "jitter_sigma": sigma,
           "oracle_latency": oracle,
           "max_load_factor": sr.max_load_factor, "runs": len(sr.points),
           "points": [[f, a] for f, a in sr.curve()]}
    if paper_metric:
        out["per_model_lf"] = paper_per_model(spec, target)
        out["paper_metric"] = sum(out["per_model_lf"]) / len(out["per_model_lf"])
    out.update(wall_s=round(time.perf_counter() - t0, 3), cpu_s=round(time.process_time() - cpu0, 3))
    return out


def paper_per_model(spec, target: float) -> list[float]:
    """The PPipe artifact's Figure-6 measure, per model: load factors 1.00, 0.95, ... 0.05 are tried
    in turn and each model's value is the first (highest) at which it alone keeps ``target``
    (``scripts/run_sim_in_batch.py``: ``for lf in range(100, 0, -5)``, stop at <= 1% dropped or
    late; each DNN is simulated on its own there, and ``scripts/plot.py`` averages over DNNs).
    Capped at 1.0 and on a 0.05 grid, unlike the sweep (all models together, 0.01 steps)."""
    found: dict[int, float] = {}
    n = None
    for k in range(20, 0, -1):
        lf = k / 20
        res = spec.result(lf, stop=False)
        n = len(res.models)
        for i, m in enumerate(res.models):
            if i not in found and m.attainment >= target:
                found[i] = lf
        if len(found) == n:
            break
    return [found.get(i, 0.0) for i in range(n or 0)]


def short_name(config: str) -> str:
    """'apcnet+atss+gcnet 0.39-0.26-0.35 L4-P4' from a reference file name stem (a single-model
    file, whose name has no weights, keeps its first 44 characters)."""
    from ppiped.plan import PlanError, reference_name_info

    try:
        info = reference_name_info(config + "_v4.json")
    except PlanError:
        info = {"weights": None}
    if info["weights"] is None:
        return config if len(config) <= 44 else config[:43] + "…"
    head = config.split("_" + "-".join(f"{w:g}" if w != 1 else "1.0" for w in info["weights"]))[0]
    models = []
    for part in head.split("-"):
        tok = part.split("_")[0]
        if tok and tok[0].isalpha() and not tok.startswith(("d8", "d16", "b3", "b8", "v2", "v3", "caffe")):
            models.append(tok)
    gpus = "-".join(info["gpus"])
    w = "-".join(f"{x:g}" for x in info["weights"])
    return f"{'+'.join(models[:3])} {w} {gpus}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default=str(DEFAULT_DATA), help="the PPipe data set (models/, reference-plans/)")
    ap.add_argument("--plan-set", default="maf21",
                    help="reference plans: a folder name under DATA/reference-plans, or a path (default maf21)")
    ap.add_argument("--duration", type=float, default=30.0, help="simulated seconds per run (default 30)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--jitter", default="0,0.05,0.1",
                    help="lognormal sigma of executor latency; a comma list runs the bench once per value "
                         "(default 0,0.05,0.1; the paper's simulator has none)")
    ap.add_argument("--start-early-us", type=float, default=float("inf"),
                    help="executors may start this early (default inf: work-conserving; 0: never early)")
    ap.add_argument("--target", type=float, default=0.99)
    ap.add_argument("--no-nic", action="store_true",
                    help="transfers never queue on shared NICs (contention only in the core's reservations)")
    ap.add_argument("--oracle-latency", nargs="?", const="all", default="", choices=("all", "first", "later"),
                    help="diagnostic: the core books each inference (all; or only those of pipelines' first "
                         "pools, or of the pools after them) at the latency it will take: an upper reference "
                         "for better latency estimates under --jitter, not a policy")
    ap.add_argument("--traces", default="poisson,bursty")
    ap.add_argument("--cv", type=float, default=2.0, help="bursty: coefficient of variation of the gaps (default 2)")
    ap.add_argument("--trace-scale", choices=("stretch", "fold"), default="stretch",
                    help="traces given as an Azure Functions 2021 file: stretch (default) or fold, the "
                         "PPipe artifact's rescaling for its bursty runs (see ppiped/sim/workload.py)")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--limit", type=int, default=0, help="only the first N configurations")
    ap.add_argument("--match", default="", help="only configurations whose name contains this")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--out", default=str(HERE.parent / "out" / "figure6"), help="folder for JSONL, summary and PNGs")
    ap.add_argument("--no-plots", action="store_true")
    ap.add_argument("--paper-metric", action="store_true",
                    help="also measure the PPipe artifact's Figure-6 figure: per model, the highest of "
                         "1.00, 0.95, ... at which it keeps the target, averaged over models (slower)")
    ap.add_argument("--curve-config", type=int, default=0,
                    help="index (among those run) of the configuration for the Figure 7/12 plots")
    args = ap.parse_args(argv)
    try:
        jitters = [float(x) for x in str(args.jitter).split(",") if x.strip()]
    except ValueError:
        ap.error(f"--jitter: expected numbers separated by commas, got {args.jitter!r}")
    if not jitters or any(j < 0 for j in jitters):
        ap.error(f"--jitter: expected sigmas >= 0, got {args.jitter!r}")
    if len(jitters) > 1:
        return _per_jitter(argv or sys.argv[1:], jitters, Path(args.out))
    args.jitter = jitters[0]

    from ppiped.plan import reference_plan_set

    data = Path(args.data)
    plans_dir, models_dir = reference_plan_set(data, args.plan_set), data / "models"
    if not plans_dir.is_dir() or not models_dir.is_dir():
        print(f"figure6: no plan set {plans_dir} or no {models_dir}: nothing to do (skipped)", file=sys.stderr)
        return 0
    configs = sorted(p.name[: -len("_v4.json")] for p in plans_dir.glob("*_v4.json") if args.match in p.name)
    if args.limit:
        configs = configs[: args.limit]
    if not configs:
        print(f"figure6: error: no *_v4.json plans in {plans_dir}"
              + (f" whose name contains {args.match!r}" if args.match else ""), file=sys.stderr)
        return 2
    traces = [t for t in args.traces.split(",") if t]
    systems = [s for s in args.systems.split(",") if s]
    for s in systems:
        if s not in SYSTEMS:
            ap.error(f"unknown system {s!r} (known: {', '.join(SYSTEMS)})")
    tasks = [Task(c, s, t) for c in configs for t in traces for s in systems
             if (plans_dir / f"{c}_{SYSTEMS[s][0]}.json").is_file()]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from tqdm import tqdm

    from ppiped.sim.run import PointSpec

    # compile (or load from cache) once in the parent, so forked workers start warm
    PointSpec(str(plans_dir / f"{configs[0]}_v4.json"), str(models_dir), duration_s=0.05).result(0.1)
    t0 = time.perf_counter()
    results: dict[Task, dict] = {}
    ctx = multiprocessing.get_context("fork")
    args_common = (str(plans_dir), str(models_dir), args.duration, args.seed, args.jitter, args.target,
                   args.start_early_us, args.cv, not args.no_nic, args.paper_metric, args.trace_scale,
                   args.oracle_latency)
    bar = tqdm(total=len(tasks), desc="figure6", unit="sweep", file=sys.stderr, dynamic_ncols=True)
    with ProcessPoolExecutor(max(1, args.jobs), mp_context=ctx) as pool:
        futs = {pool.submit(_sweep, t, *args_common): t for t in tasks}
        for f in as_completed(futs):
            r = f.result()
            results[futs[f]] = r
            tqdm.write(json.dumps(r), file=sys.stdout)
            bar.update(1)
    bar.close()
    wall = time.perf_counter() - t0

    # deterministic files: tasks in order
    with (out / "runs.jsonl").open("w") as fh:
        for t in tasks:
            fh.write(json.dumps(results[t]) + "\n")
    table = {tr: {s: [results[Task(c, s, tr)]["max_load_factor"] if Task(c, s, tr) in results else math.nan
                      for c in configs] for s in systems} for tr in traces}
    means = {tr: {s: _mean(table[tr][s]) for s in systems} for tr in traces}
    paper_means = None
    if args.paper_metric:
        paper_means = {tr: {s: _mean([x for c in configs if Task(c, s, tr) in results
                                      for x in results[Task(c, s, tr)]["per_model_lf"]])
                            for s in systems} for tr in traces}
    cpu = sum(r["cpu_s"] for r in results.values())
    summary = {"configs": len(configs), "traces": traces, "systems": systems, "duration_s": args.duration,
               "seed": args.seed, "bursty_cv": args.cv, "jitter_sigma": args.jitter,
               "start_early_us": args.start_early_us, "nic_model": not args.no_nic,
               "oracle_latency": args.oracle_latency,
               "target": args.target, "means": means, "paper": PAPER,
               "ppipe_over_np": {tr: _paired_ratio(table[tr].get("PPipe"), table[tr].get("NP")) for tr in traces},
               "paper_metric_means": paper_means,
               "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "jobs": args.jobs}

    names = [short_name(c) for c in configs]
    print()
    print(_table(names, table, traces, systems, means))
    print()
    for tr in traces:
        paper = PAPER.get(tr, {})
        row = "  ".join(f"{s} {means[tr][s]:.3f}" + (f" (paper {paper[s]:.3f})" if s in paper else "")
                        for s in systems)
        print(f"mean, {tr}: {row}; PPipe/NP {summary['ppipe_over_np'][tr]:.2f} (paper "
              f"{_ratio(paper.get('PPipe'), paper.get('NP')):.2f})")
    if paper_means:
        for tr in traces:
            row = "  ".join(f"{s} {paper_means[tr][s]:.3f}" for s in systems)
            print(f"paper's measure (per model, 0.05 grid, <= 1.0, mean over models), {tr}: {row}")
    print(f"{len(tasks)} sweeps, {sum(r['runs'] for r in results.values())} simulations in {wall:.0f} s wall "
          f"({cpu:.0f} s CPU, {args.jobs} jobs); {args.duration:g} s simulated per run, jitter σ={args.jitter:g}")

    if not args.no_plots and configs:
        plots = _plots(args, configs, names, table, traces, systems, plans_dir, models_dir, out)
        summary["plots"] = plots
        for p in plots:
            print(f"plot: {p}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(f"results: {out / 'runs.jsonl'}  {out / 'summary.json'}")
    return 0


def _per_jitter(argv: list[str], jitters: list[float], out: Path) -> int:
    """Run the bench once per latency noise level (each in ``out/sigma-<σ>``) and print one
    JSON line and one table row per level."""
    rest, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--jitter", "--out"):
            skip = True
        elif not a.startswith(("--jitter=", "--out=")):
            rest.append(a)
    rows = []
    for j in jitters:
        sub = out / f"sigma-{j:g}"
        rc = main([*rest, "--jitter", f"{j:g}", "--out", str(sub)])
        if rc or not (sub / "summary.json").is_file():  # failed, or skipped (no data)
            return rc
        summary = json.loads((sub / "summary.json").read_text())
        rows.append({"jitter_sigma": j, "means": summary["means"], "out": str(sub)})
    print()
    for r in rows:
        print(json.dumps(r))
    systems = sorted({s for r in rows for tr in r["means"].values() for s in tr})
    for tr in rows[0]["means"]:
        print(f"{tr}: " + "; ".join(f"σ={r['jitter_sigma']:g} " + " ".join(
            f"{s} {r['means'][tr][s]:.3f}" for s in systems if s in r["means"][tr]) for r in rows))
    return 0


def _mean(xs: list[float]) -> float:
    ok = [x for x in xs if not math.isnan(x)]
    return sum(ok) / len(ok) if ok else math.nan


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else math.nan


def _paired_ratio(a: list[float] | None, b: list[float] | None) -> float:
    """Mean of ``a`` over mean of ``b``, over the configurations both systems have a plan for."""
    if not a or not b:
        return math.nan
    pairs = [(x, y) for x, y in zip(a, b, strict=True) if not (math.isnan(x) or math.isnan(y))]
    return _ratio(_mean([x for x, _ in pairs]), _mean([y for _, y in pairs])) if pairs else math.nan


def _table(names, table, traces, systems, means) -> str:
    w = max(len(n) for n in names)
    head = f"{'configuration':<{w}}  " + "   ".join(
        " ".join(f"{s[:8]:>8}" for s in systems) for _ in traces)
    sub = f"{'':<{w}}  " + "   ".join(f"{tr:^{9 * len(systems) - 1}}" for tr in traces)
    lines = [sub, head]
    for i, n in enumerate(names):
        lines.append(f"{n:<{w}}  " + "   ".join(" ".join(f"{table[tr][s][i]:8.2f}" for s in systems)
                                               for tr in traces))
    lines.append(f"{'mean':<{w}}  " + "   ".join(" ".join(f"{means[tr][s]:8.3f}" for s in systems)
                                                for tr in traces))
    return "\n".join(lines)


def _plots(args, configs, names, table, traces, systems, plans_dir, models_dir, out) -> list[str]:
    """Figure 6 bars for every configuration; Figures 7 and 12 for one configuration."""
    from ppiped.sim.plots import plot_attainment, plot_max_load, plot_timeline
    from ppiped.sim.run import PointSpec

    paths = [str(plot_max_load({tr: table[tr] for tr in traces}, names, out / "figure6.png",
                               title=f"max load factor at {100 * args.target:g}% attainment "
                                     f"({len(configs)} {plans_dir.name} configurations, jitter σ={args.jitter:g})"))]
    c = configs[min(args.curve_config, len(configs) - 1)]
    tr = traces[0]
    curves = {}
    lfs = [round(0.3 + 0.05 * i, 2) for i in range(17)]  # 0.30 .. 1.10
    for s in systems:
        suffix, policy, _ = SYSTEMS[s]
        spec = PointSpec(str(plans_dir / f"{c}_{suffix}.json"), str(models_dir), tr, args.duration, args.seed,
                         policy, args.jitter, args.cv, args.start_early_us, str(plans_dir / f"{c}_v4.json"), None,
                         not args.no_nic, args.trace_scale, oracle_latency=args.oracle_latency)
        with ProcessPoolExecutor(max(1, args.jobs), mp_context=multiprocessing.get_context("fork")) as pool:
            curves[s] = [(f, o.attainment) for f, o in zip(lfs, pool.map(spec, lfs), strict=True)]
    paths.append(str(plot_attainment(curves, out / "figure7.png", title=f"{short_name(c)}, {tr}",
                                     target=args.target)))
    window = (10e6, 10.05e6) if args.duration > 10.05 else (0.4 * args.duration * 1e6, 0.4 * args.duration * 1e6 + 50e3)
    for s in ("PPipe", "Reactive"):
        if s not in systems:
            continue
        suffix, policy, _ = SYSTEMS[s]
        spec = PointSpec(str(plans_dir / f"{c}_{suffix}.json"), str(models_dir), tr, args.duration, args.seed,
                         policy, args.jitter, args.cv, args.start_early_us, str(plans_dir / f"{c}_v4.json"), None,
                         not args.no_nic, args.trace_scale, oracle_latency=args.oracle_latency)
        res = spec.result(0.8, stop=False, timeline_us=window)
        from ppiped.plan import load_plan

        models = [m.model for m in load_plan(plans_dir / f"{c}_{suffix}.json").models]
        paths.append(str(plot_timeline(res.timeline, out / f"figure12-{s.lower()}.png", models, window,
                                       title=f"{short_name(c)}: {s} at load factor 0.8, {tr}, 50 ms")))
    return paths


if __name__ == "__main__":
    sys.exit(main())
