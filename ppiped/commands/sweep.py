"""``ppiped sweep``: the largest load factor at which every model keeps its SLO attainment target."""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from ..errors import InputError
from .argtypes import JOBS, LOAD_FACTOR, check_request_count, number, plot_file
from .sim import _finite, add_world_args, options_from

MAX_COARSE_POINTS = 10_000
"""Most load factors the coarse phase may step through (--max-factor / --step): each is a whole
simulation, so more is a sweep that never ends (--step 0 was one)."""

MAX_BISECT_RATIO = 1e9
"""Largest --max-factor / --resolution: the sweep rounds load factors to multiples of the
resolution, which loses all meaning (and overflows) far below this."""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sweep", help="find the max load factor at which every model keeps >= 99%% attainment")
    p.add_argument("--plan", required=True, action="append",
                   help="plan to sweep (repeat to compare systems on one plot)")
    add_world_args(p)
    p.add_argument("--target", type=number(0, 1, lo_open=True), default=0.99, help="attainment every model must keep (default 0.99)")
    p.add_argument("--step", type=LOAD_FACTOR, default=0.05, help="coarse step of the load factor (default 0.05)")
    p.add_argument("--resolution", type=LOAD_FACTOR, default=0.01, help="bisect down to this (default 0.01)")
    p.add_argument("--start", type=LOAD_FACTOR, default=None,
                   help="a guess of the answer: search from there instead of from one step (same result, fewer runs)")
    p.add_argument("--max-factor", type=LOAD_FACTOR, default=3.0,
                   help="largest load factor tried (default 3)")
    p.add_argument("--jobs", type=JOBS, default=1, help="worker processes, at most 256 (2: both cores)")
    p.add_argument("--json", action="store_true", help="one JSON line per plan (points: [load factor, attainment] of the runs that ran "
                        "to the end; stopped_early: load factors whose runs stopped once below --target)")
    p.add_argument("--plot", metavar="FILE", type=plot_file,
                   help="attainment vs load factor per plan (PNG, PPipe Figure 7); runs every point to the end")
    p.set_defaults(func=run)


def point_spec(args: argparse.Namespace, plan: str):
    """One point of the sweep of ``plan``: the world ``sim`` runs with the same flags
    (:func:`ppiped.commands.sim.options_from`), stopped once below --target unless plotting."""
    from ..sim.run import PointSpec

    opt = options_from(args)
    return PointSpec(plan, str(args.profiles), args.trace, args.duration, args.seed, args.policy, opt.sigma,
                     args.cv, opt.start_early_us, args.base_plan, None if args.plot else args.target,
                     opt.nic_fifo, args.trace_scale, args.high_share, args.cluster, opt.margin_quantile,
                     opt.noise_z, opt.oracle_latency)


def run(args: argparse.Namespace) -> int:
    from ..cluster import load_cluster
    from ..plan import load_plan
    from ..sim.run import rates_at_one, refuse_unservable
    from ..sim.sweep import sweep

    opt = options_from(args)  # the flags' ranges: their argparse types
    if args.max_factor / args.step > MAX_COARSE_POINTS:
        raise InputError(f"--max-factor {args.max_factor:g} / --step {args.step:g} is more than "
                         f"{MAX_COARSE_POINTS:,} load factors to simulate: raise --step")
    if args.max_factor < args.resolution:
        raise InputError(f"--max-factor {args.max_factor:g} is below --resolution {args.resolution:g}: "
                         "no load factor to try")
    if args.max_factor / args.resolution > MAX_BISECT_RATIO:
        raise InputError(f"--resolution {args.resolution:g} is below {1 / MAX_BISECT_RATIO:g} x "
                         f"--max-factor {args.max_factor:g}: raise --resolution")
    if args.start is not None and args.start > args.max_factor:
        raise InputError(f"--start {args.start:g} is above --max-factor {args.max_factor:g}")
    if not Path(args.profiles).is_dir():
        raise InputError(f"--profiles {args.profiles}: not a directory")
    plans = []
    cluster = load_cluster(args.cluster) if args.cluster else None
    for path in args.plan:  # every plan read and sized before the first (long) sweep
        plan = load_plan(path, cluster)
        if plan.apps:
            raise InputError(f"--plan {path}: a plan with apps is not swept (its stages are not independent "
                             "models); run ppiped sim --load-factor on it")
        refuse_unservable(plan, path)
        names = [m.model for m in plan.models]
        rates = rates_at_one(path, plan, args.base_plan, cluster)
        top = args.max_factor * float(rates.sum())
        check_request_count(top * args.duration, f"{path}: --max-factor {args.max_factor:g} ({top:.6g} req/s) "
                            f"for --duration {args.duration:g} s")
        plans.append((path, plan, names, rates))
    pool = None
    if args.jobs > 1:
        pool = ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("fork"))
    curves = {}
    try:
        for path, plan, names, rates in plans:
            spec = point_spec(args, str(path))
            sr = sweep(spec, args.target, args.step, args.resolution, args.max_factor, pool, args.jobs,
                       args.start)
            lf = sr.max_load_factor
            detail = spec.result(lf, stop=False) if lf > 0 else None
            label = Path(path).name
            curves[f"{plan.algo or label} ({args.policy})"] = sr.curve()
            out = {
                "plan": label, "policy": args.policy, "trace": args.trace, "duration_s": args.duration,
                "seed": args.seed, "jitter_sigma": opt.sigma, "target": args.target,
                "max_load_factor": lf, "max_rate_rps": float(lf * rates.sum()),
                "models": [
                    {"model": n, "rate_rps": float(lf * r),
                     "attainment": detail.models[i].attainment if detail else None}
                    for i, (n, r) in enumerate(zip(names, rates, strict=True))
                ],
                "points": [[f, a] for f, a in sr.curve()],
                "stopped_early": sorted(sr.stopped),
                "dips": sr.dips(args.target),
            }
            if args.json:
                print(json.dumps(_finite(out)))
            else:
                print(f"{label}\n  policy {args.policy}, {args.trace}, {args.duration:g} s, seed {args.seed}: "
                      f"max load factor {lf:.2f} at >= {100 * args.target:g}% attainment "
                      f"= {lf * rates.sum():.1f} req/s")
                for m in out["models"]:
                    att = f"{100 * m['attainment']:.2f}%" if m["attainment"] is not None else "-"
                    print(f"    {m['model'][:48]:<48} {m['rate_rps']:9.1f} req/s  attainment {att}")
                if out["dips"]:
                    print(f"  note: below target at lower load factor(s) {', '.join(f'{f:.2f}' for f in out['dips'])}")
            sys.stdout.flush()
    finally:
        if pool is not None:
            pool.shutdown()
    if args.plot:
        from ..sim.plots import plot_attainment

        plot_attainment(curves, args.plot, title=f"{args.trace}, {args.duration:g} s", target=args.target)
        if not args.json:
            print(f"plot: {args.plot}")
    return 0
