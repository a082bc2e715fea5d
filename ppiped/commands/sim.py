"""``ppiped sim``: run a plan on the discrete-event simulator (the daemon's core, virtual clock)."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import numpy as np

from ..errors import InputError
from .argtypes import (
    CV,
    DURATION,
    FRACTION,
    JITTER,
    LOAD_FACTOR,
    POSITIVE,
    SEED,
    check_request_count,
    existing_file,
    number,
    plot_file,
    trace_kind,
)


def add_world_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by ``sim`` and ``sweep``: the trace and the simulated executors."""
    p.add_argument("--profiles", required=True, help="directory of ppiped-profile/1 files")
    p.add_argument("--cluster", help="cluster spec TOML for a PPipe reference plan (default: from its file name)")
    p.add_argument("--trace", default="poisson", type=trace_kind,
                   help="poisson, bursty, or an Azure Functions 2021 trace file (default poisson)")
    p.add_argument("--cv", type=CV, default=2.0, help="bursty: coefficient of variation of the gaps (default 2)")
    p.add_argument("--trace-scale", choices=("stretch", "fold"), default="stretch",
                   help="trace files: compress the time axis to the rate (stretch, default) or overlay "
                        "rate/native-rate windows of the trace as the PPipe artifact does (fold)")
    p.add_argument("--duration", type=DURATION, default=30.0, help="simulated seconds of arrivals (default 30)")
    p.add_argument("--seed", type=SEED, default=0, help="seeds the trace and the latency jitter")
    p.add_argument("--policy", default=None,
                   help="ppipe (reservations, the default), reactive, ppipe-early-drop, pard (plans with apps: "
                        "the deadline mode's, see --app-deadlines)")
    p.add_argument("--high-share", type=FRACTION, default=0.0, metavar="F",
                   help="share of requests in the high priority class (default 0); reported per class")
    p.add_argument("--jitter", type=JITTER, default=None, metavar="SIGMA",
                   help="lognormal sigma of executor latency around the profile (default 0.05; 0: none)")
    p.add_argument("--start-early-us", type=number(0, inf_ok=True), default=float("inf"),
                   help="executors may start a batch this long before its reserved start (default inf: "
                        "work-conserving; 0: never early)")
    p.add_argument("--margin-quantile", type=number(0, 1, lo_open=True, hi_open=True), default=0.9,
                   help="quantile of measured/profiled latency each vGPU's reservations cover (default 0.9)")
    p.add_argument("--noise-z", type=number(0, 10, hi_open=True), default=0.0,
                   help="deadline checks keep this many standard deviations of the path's latency "
                        "noise (default 0: none)")
    p.add_argument("--oracle-latency", nargs="?", const="all", default="", choices=("all", "first", "later"),
                   help="diagnostic: the core books each inference (all; or only those of pipelines' first "
                        "pools, or of the pools after them) at the latency it will take (the jitter drawn "
                        "ahead); an upper reference for better estimates, not a policy")
    p.add_argument("--base-plan", type=existing_file, help="plan whose per-model throughput is load factor 1.0 "
                                       "(default: the _v4 sibling of a reference plan, else the plan itself)")


def options_from(args: argparse.Namespace, **kw):
    from ..core.scheduler import POLICIES
    from ..sim.run import DEFAULT_SIGMA, SimOptions

    if args.policy is None:
        args.policy = "ppipe"
    if args.policy not in POLICIES:
        raise InputError(f"unknown --policy {args.policy!r} (known: {', '.join(POLICIES)})")
    sigma = DEFAULT_SIGMA if args.jitter is None else args.jitter  # the flags' ranges: add_world_args
    return SimOptions(sigma=sigma, start_early_us=args.start_early_us, margin_quantile=args.margin_quantile,
                      noise_z=args.noise_z, oracle_latency=args.oracle_latency, **kw)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sim", help="simulate a plan under a workload with the daemon's scheduling core")
    p.add_argument("--plan", required=True, help="ppiped-plan/1 or PPipe reference plan")
    add_world_args(p)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--rate", type=POSITIVE, help="total requests/s, split across models by the plan's weights")
    g.add_argument("--load-factor", type=LOAD_FACTOR, help="each model at F x its throughput in the base plan")
    p.add_argument("--app-deadlines", choices=("split", "e2e", "chain"), default="e2e",
                   help="plans with apps: stage deadlines from the SLO split (Nexus; policy "
                        "ppipe-early-drop), the query's end-to-end budget (PARD; pard, the default) or "
                        "each stage's budget from its submission (hand-chained; ppipe)")
    p.add_argument("--json", action="store_true",
                   help="print the result as one JSON object (goodput_rps and utilization count the requests "
                        "that arrived within --duration, the drain after it included)")
    p.add_argument("--plot", metavar="FILE", type=plot_file, help="write a per-vGPU timeline of batches (PNG)")
    p.add_argument("--plot-window", type=number(0), nargs=2, metavar=("FROM_MS", "TO_MS"),
                   help="timeline window in simulated ms (default: 200 ms from the middle of the run)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..cluster import load_cluster
    from ..plan import load_plan
    from ..profiles import load_profiles
    from ..sim.run import rates_at_one, refuse_unservable, simulate, weight_rates
    from ..sim.workload import generate

    if args.plot_window and not args.plot_window[0] < args.plot_window[1]:
        raise InputError(f"--plot-window: FROM_MS ({args.plot_window[0]:g}) must be below TO_MS "
                         f"({args.plot_window[1]:g})")
    cluster = load_cluster(args.cluster) if args.cluster else None
    plan = load_plan(args.plan, cluster)
    refuse_unservable(plan, args.plan)
    profiles = load_profiles(args.profiles, [m.model for m in plan.models])
    names = [m.model for m in plan.models]
    if plan.apps:
        return _run_apps(args, plan, profiles)
    if args.rate is not None:
        rates = weight_rates(plan, args.rate)
        how = f"--rate {args.rate:g} for --duration {args.duration:g} s"
    else:
        rates = args.load_factor * rates_at_one(args.plan, plan, args.base_plan, cluster)
        how = (f"--load-factor {args.load_factor:g} ({float(np.sum(rates)):.6g} req/s) for "
               f"--duration {args.duration:g} s")
    check_request_count(float(np.sum(rates)) * args.duration, how)
    window = None
    if args.plot:
        if args.plot_window:
            window = (args.plot_window[0] * 1e3, args.plot_window[1] * 1e3)
        else:
            mid = args.duration * 1e6 / 2
            window = (mid, mid + 200e3)
    opt = options_from(args, timeline_us=window)
    trace = generate(args.trace, list(rates), args.duration, args.seed, args.cv, args.trace_scale,
                     args.high_share)
    res = simulate(plan, profiles, trace, args.policy, opt.sigma, args.seed, duration_s=args.duration,
                   options=opt)
    res.extra.update(trace=args.trace, load_factor=args.load_factor,
                     rate_rps=float(np.sum(rates)))
    if args.plot:
        from ..sim.plots import plot_timeline

        plot_timeline(res.timeline, args.plot, names, window,
                      title=f"{Path(args.plan).name[-70:]} — {res.policy}")
    if args.json:
        print(json.dumps(_finite(res.to_json())))
    else:
        print(res.summary())
        if args.plot:
            print(f"timeline: {args.plot}")
    return 0


def _run_apps(args: argparse.Namespace, plan, profiles) -> int:
    """A plan with apps: each app at ``--load-factor`` × its planned query rate (plain models at
    theirs), its stages spawned as their parents finish."""
    from ..sim.dag import default_policy, simulate_apps
    from ..sim.run import base_rates

    if args.load_factor is None:
        raise InputError("a plan with apps is loaded by --load-factor (x each app's planned query rate)")
    # every stage's planned rate already counts its fan-out: about the requests the run makes
    rate = args.load_factor * float(np.sum(base_rates(plan)))
    check_request_count(rate * args.duration, f"--load-factor {args.load_factor:g} ({rate:.6g} req/s "
                        f"over the apps' stages) for --duration {args.duration:g} s")
    if args.plot or args.high_share:
        raise InputError("--plot and --high-share are not supported for plans with apps yet")
    policy = args.policy or default_policy(args.app_deadlines)
    args.policy = policy
    opt = options_from(args)
    res = simulate_apps(plan, profiles, args.load_factor, args.app_deadlines, policy, args.duration, args.seed,
                        opt.sigma, args.trace, args.cv, options=opt, trace_scale=args.trace_scale)
    if args.json:
        print(json.dumps(_finite(res.to_json())))
    else:
        print(res.summary())
    return 0


def _finite(x):
    """JSON has no NaN/inf: write them as null."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x
