"""``ppiped check PLAN``: recompute a plan from the profiles and list every rule it breaks."""

from __future__ import annotations

import argparse
import json

from ..cluster import load_cluster
from ..plan import check, load_plan, slo_not_judged
from ..profiles import load_profiles


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("check", help="check a plan (ppiped-plan/1 or a PPipe reference plan) against profiles")
    p.add_argument("plans", nargs="+", metavar="PLAN")
    p.add_argument("--profiles", required=True, help="directory of ppiped-profile/1 files")
    p.add_argument("--cluster", help="cluster spec TOML (default: the plan's own, or a reference file's name)")
    p.add_argument("--json", action="store_true", help="one JSON line per plan")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    cluster = load_cluster(args.cluster) if args.cluster else None
    bad = 0
    profiles: dict = {}
    for path in args.plans:
        plan = load_plan(path, cluster)
        # only the plan's own models: an unrelated broken file in the folder is not this plan's fault
        wanted = [m.model for m in plan.models if m.model not in profiles]
        if wanted:
            profiles.update(load_profiles(args.profiles, wanted))
        violations = check(plan, profiles, cluster)
        bad += bool(violations)
        unjudged = slo_not_judged(plan, profiles)
        if args.json:
            print(json.dumps({"plan": path, "ok": not violations,
                              "objective": plan.normalized_throughput,
                              "violations": [str(v) for v in violations], "slo_not_judged": unjudged}))
        else:
            if violations:
                print(f"FAIL {path}")
                for v in violations:
                    print(f"  {v}")
            else:
                print(f"ok   {path} (objective {plan.normalized_throughput:.2f})")
            if unjudged:
                print(f"  note: SLOs not judged for {', '.join(unjudged)}: no whole-model latency on the "
                      f"SLO reference GPU {plan.params.slo_reference_gpu} in their profiles")
    if not args.json and len(args.plans) > 1:
        print(f"{len(args.plans) - bad}/{len(args.plans)} plans pass")
    return 1 if bad else 0
