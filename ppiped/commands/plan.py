"""``ppiped plan``: solve the control-plane MILP for a cluster and a load mix; write the plan."""

from __future__ import annotations

import argparse
import json
import logging
import time

from ..cluster import cluster_from_flags, load_cluster
from ..errors import InputError
from ..plan import (
    WEIGHT_MAX,
    WEIGHT_MAX_RATIO,
    WEIGHT_MIN,
    Plan,
    PlanParams,
    check,
    format_plan_table,
    save_plan,
)
from ..profiles import ProfileError, load_profiles
from .argtypes import (
    POSITIVE,
    POSITIVE_INT,
    gpu_counts,
    model_names,
    number,
    numbers,
    output_file,
)

WEIGHTS = numbers(WEIGHT_MIN, WEIGHT_MAX, max_ratio=WEIGHT_MAX_RATIO)

TIME_LIMIT = number(0, 7 * 86_400, lo_open=True)
"""Seconds for the whole plan: a week at most (the solver's clock overflows on inf)."""

NIC_GBPS_DEFAULT = 10.0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan pipelines, pools and batch sizes for a cluster (MILP, CBC)",
                       description="Choose partitions, vGPU pools and batch sizes that maximise the "
                       "worst model's throughput/weight under the SLOs (PPipe's MILP, NP or DART-r).")
    p.add_argument("--profiles", required=True, help="directory of ppiped-profile/1 files")
    p.add_argument("--models", type=model_names, help="comma-separated model names (optional with --apps)")
    p.add_argument("--weights", type=WEIGHTS,
                   help="comma-separated load weights, one per model (default: equal)")
    a = p.add_argument_group("apps (multi-model queries with one end-to-end SLO)")
    a.add_argument("--apps", metavar="FILE",
                   help="TOML or JSON file of [[apps]] (name, slo_ms, weight, glue_ms, [[apps.stages]]: "
                   "name, model, after, fanout, glue, budget_ms); their stages are planned beside --models")
    a.add_argument("--split", choices=("dp", "even", "fixed"),
                   help="how each app's SLO is split across its stages: dp (Nexus's DP over a 5%% grid, "
                   "default), even (in proportion to each stage's latency), fixed (the file's budget_ms)")
    g = p.add_argument_group("cluster (a TOML spec, or the flags)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--cluster", help="cluster spec TOML")
    x.add_argument("--gpus", type=gpu_counts, help="GPU types and counts, e.g. L4:25,P4:75")
    g.add_argument("--gpus-per-server", help="GPUs per server per type, e.g. 1,1 (default 1)")
    g.add_argument("--vgpu-splits", help="largest vGPU split per type, e.g. 4,1 (default 1)")
    g.add_argument("--nic-gbps", type=POSITIVE, help="server NIC bandwidth (default 10)")
    r = p.add_argument_group("planning rules")
    r.add_argument("--max-partitions", type=POSITIVE_INT, default=2, help="partitions per pipeline (default 2)")
    r.add_argument("--slo-scale", type=POSITIVE, default=5.0,
                   help="SLO = scale x whole-model latency on --slo-reference-gpu at batch 1 (default 5)")
    r.add_argument("--slo-reference-gpu", default="L4", help="GPU type the SLO scale refers to (default L4)")
    r.add_argument("--slo-ms", type=numbers(0, lo_open=True), help="explicit SLOs in ms, one per model (overrides --slo-scale)")
    r.add_argument("--slo-margin", type=number(0, 1, hi_open=True), default=0.4, help="fraction of the SLO kept free (default 0.4)")
    r.add_argument("--share-gpus", action="store_true",
                   help="let different models' vGPU slices share a physical GPU (gpu-lets' spatial "
                   "sharing; off by default: PPipe's rule rounds each model's pools up to whole GPUs; "
                   "never compare such a plan with a reference plan)")
    r.add_argument("--batch-delay-factor", type=POSITIVE, default=1.3,
                   help="initial batching delay = factor x (bs-1) / rate (default 1.3)")
    r.add_argument("--batch-delay-rate", type=numbers(0, lo_open=True),
                   help="rate (req/s) per model for the batching-delay estimate (default: from the NP plan)")
    s = p.add_argument_group("solver")
    s.add_argument("--algo", choices=("ppipe", "np", "dart-r"), default="ppipe")
    s.add_argument("--time-limit", type=TIME_LIMIT, default=60.0, help="seconds for the whole plan (default 60)")
    s.add_argument("--threads", type=POSITIVE_INT, default=1, help="CBC threads (default 1)")
    s.add_argument("--mip-gap", type=number(0, 1, hi_open=True), default=1e-6,
                   help="stop once the plan is within this fraction of the best bound (default 1e-6)")
    s.add_argument("--subprocess", action="store_true",
                   help="solve in a child process, as the daemon does")
    p.add_argument("-o", "--output", type=output_file, help="write the plan (ppiped-plan/1) here")
    p.add_argument("--json", action="store_true", help="print a JSON summary instead of the table")
    p.add_argument("-v", "--verbose", action="store_true", help="log the solver's phases on stderr")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if args.cluster:
        flags = [f for f, v in (("--gpus-per-server", args.gpus_per_server),
                                ("--vgpu-splits", args.vgpu_splits), ("--nic-gbps", args.nic_gbps))
                 if v is not None]
        if flags:
            raise InputError(f"{', '.join(flags)}: only with --gpus (the cluster file {args.cluster} "
                             "sets its own)")
        cluster = load_cluster(args.cluster)
    elif args.gpus:
        nic = NIC_GBPS_DEFAULT if args.nic_gbps is None else args.nic_gbps
        cluster = cluster_from_flags(args.gpus, args.gpus_per_server, args.vgpu_splits, nic)
    else:
        raise InputError("give the cluster: --cluster FILE.toml, or --gpus NAME:COUNT,...")
    models = args.models or []
    if not models and not args.apps:
        raise InputError("give the models to plan: --models NAME,... and/or --apps FILE")
    weights = args.weights or [1.0] * len(models)
    rates = args.batch_delay_rate
    slo_ms = args.slo_ms
    params = PlanParams(
        slo_margin=args.slo_margin, batch_delay_factor=args.batch_delay_factor,
        max_partitions=args.max_partitions, share_gpus=args.share_gpus,
        slo_scale=None if slo_ms else args.slo_scale,
        slo_reference_gpu=None if slo_ms else args.slo_reference_gpu,
    )
    profiles = load_profiles(args.profiles, models) if models else {}
    slos = [x * 1e3 for x in slo_ms] if slo_ms else None
    if args.split and not args.apps:
        raise InputError("--split splits the apps' SLOs: give --apps FILE")
    if args.apps:
        return _run_apps(args, cluster, params, profiles, models, weights, rates, slos)
    plan = _solve(args, profiles, models, weights, cluster, params, rates, slos, args.time_limit)
    return _report(args, plan, profiles)


def _solve(args: argparse.Namespace, profiles, models, weights, cluster, params, rates, slos,
           time_limit: float) -> Plan:
    if args.subprocess:
        from ..planner.solve import make_request, plan_in_subprocess

        req = make_request(profiles, models, weights, cluster, params, args.algo, time_limit,
                           rates, args.threads, slos, args.mip_gap)
        return plan_in_subprocess(req)
    from ..planner import plan_cluster

    return plan_cluster(profiles, models, weights, cluster, params, args.algo, time_limit,
                        rates, args.threads, slos, args.mip_gap)


def _run_apps(args: argparse.Namespace, cluster, params: PlanParams, profiles: dict, models: list[str],
              weights: list[float], rates: list[float] | None, slos: list[float] | None) -> int:
    """Plan the apps' stages (their SLO split first) beside the plain models."""
    from ..query.glue import glue_problems
    from ..query.split import attach_split, load_apps, split_apps

    if rates is not None:
        raise InputError("--batch-delay-rate is not taken with --apps: the rates come from the NP plan")
    if slos is not None and len(slos) != len(models):
        raise InputError(f"--slo-ms: {len(models)} models but {len(slos)} SLOs (the apps' SLOs come "
                         "from the apps file)")
    apps = load_apps(args.apps)
    for a in apps:
        for s in a.stages:
            if s.model not in profiles:
                where = f"{args.apps}: app {a.name!r}, stage {s.name!r}"
                try:
                    profiles.update(load_profiles(args.profiles, [s.model]))
                except ProfileError as e:
                    raise InputError(f"{where}: {e}") from None
    bad = glue_problems(apps)
    if bad:
        a, s, why = bad[0]
        raise InputError(f"{args.apps}: app {a.name!r}, stage {s.name!r}: glue {s.glue} cannot be imported: {why}")
    t0 = time.perf_counter()
    try:
        sp = split_apps(profiles, apps, cluster, params, args.algo, args.split or "dp", models, weights,
                        slos, time_limit=args.time_limit)
    except InputError as e:  # what no split can serve: the apps file is what to change
        raise InputError(f"{args.apps}: {e}") from None
    left = max(0.5, args.time_limit - (time.perf_counter() - t0))
    plan = _solve(args, profiles, sp.models, sp.weights, cluster, params, None, sp.slos_us, left)
    return _report(args, attach_split(plan, sp), profiles)


def _report(args: argparse.Namespace, plan, profiles) -> int:
    violations = check(plan, profiles)
    if args.output:
        save_plan(plan, args.output)
    if args.json:
        print(json.dumps({"algo": plan.algo, "objective": plan.normalized_throughput,
                          "models": {m.model: m.throughput_rps for m in plan.models},
                          "solver": plan.solver, "violations": [str(v) for v in violations],
                          "output": args.output}))
    else:
        print(format_plan_table(plan))
        for v in violations:
            print(f"CHECK FAILED: {v}")
    return 1 if violations else 0
