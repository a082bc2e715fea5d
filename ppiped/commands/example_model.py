"""``ppiped example-model``: the embedded example CNN and its what-if profile, built from code."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import argtypes as at


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "example-model",
        help="build the example ResNet-style CNN (ONNX) and its estimate profile",
        description="Writes DIR/example.json (profile, latencies by the estimate backend, labelled "
                    "as such) and DIR/example/ (model.onnx and block sub-models). Seeded: the same "
                    "files every time.",
    )
    p.add_argument("-o", "--out", type=at.output_dir, default=Path("plans/example"), metavar="DIR",
                   help="output directory (default plans/example)")
    p.add_argument("--gpus", default="V100:1-4,P4:1",
                   help="GPU types and splits to estimate; the first is the SLO reference "
                        "(default V100:1-4,P4:1)")
    p.add_argument("--blocks", type=at.integer(1, 1000), default=10)
    p.add_argument("--max-batch", type=at.integer(1, 1024), default=8,
                   help="profile batch sizes 1..B (default 8)")
    p.add_argument("--seed", type=at.SEED, default=0)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..profiler.example import make_example
    from .profile import summary

    prof, path, onnx_path = make_example(args.out, args.gpus, args.blocks, args.max_batch, args.seed,
                                         progress=sys.stderr.isatty())
    for gpu in prof.gpus:
        print(summary(prof, gpu))
    print(f"wrote {path} and {onnx_path.parent}/ (SLO reference GPU: {prof.extra['slo_reference_gpu']})")
    return 0
