"""``ppiped example-app``: the example app of #17 (detector -> crop glue -> classifier), from code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import argtypes as at


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "example-app",
        help="build the example app: a detector-like CNN, crop glue, a classifier CNN",
        description="Writes DIR/detector.json and DIR/classifier.json (estimate profiles, labelled "
                    "as such), DIR/detector/ and DIR/classifier/ (model.onnx and block "
                    "sub-models), DIR/apps.toml (the app; its fan-out measured by running the "
                    "detector and the glue on seeded example frames) and DIR/cluster.toml. "
                    "Seeded: the same files every time.",
    )
    p.add_argument("-o", "--out", type=at.output_dir, default=Path("plans/example-app"), metavar="DIR",
                   help="output directory (default plans/example-app)")
    p.add_argument("--gpus", default="V100:1-4,P4:1",
                   help="GPU types and splits to estimate; the first is the SLO reference "
                        "(default V100:1-4,P4:1)")
    p.add_argument("--max-batch", type=at.integer(1, 1024), default=8,
                   help="profile batch sizes 1..B (default 8)")
    p.add_argument("--seed", type=at.SEED, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..profiler.example_app import FANOUT_FRAMES, make_example_app
    from .profile import summary

    r = make_example_app(args.out, args.gpus, args.max_batch, args.seed, progress=sys.stderr.isatty())
    for prof, _ in r["profiles"].values():
        for gpu in prof.gpus:
            print(summary(prof, gpu))
    print(f"fan-out: {r['mean']:.3f} crops per frame on {FANOUT_FRAMES} example frames "
          f"(min {min(r['counts'])}, max {max(r['counts'])}) -> {r['fanout']}")
    paths = ", ".join(str(p) for _, p in r["profiles"].values())
    print(f"wrote {paths}, their model directories, {r['apps']} and {r['cluster']}")
    print(f"plan it: ppiped plan --profiles {args.out} --apps {r['apps']} --cluster {r['cluster']} "
          f"-o {args.out}/plan.json")
    return 0
