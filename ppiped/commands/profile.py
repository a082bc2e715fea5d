"""``ppiped profile MODEL.onnx``: the offline phase (PPipe §5.1-5.2) for one model and GPU type."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..errors import InputError
from ..profiler.backends import BACKENDS, Timing
from ..profiler.graph import DEFAULT_MAX_CUT_TENSORS, parse_shape
from ..profiler.partition import max_deviation
from ..profiler.profile import (
    ProfileRequest,
    parse_batch_sizes,
    parse_ranges,
    parse_splits,
    profile_model,
)
from . import argtypes as at


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="partition an ONNX CNN into blocks, export them and profile their latencies",
        description="Writes DIR/<model>.json (ppiped-profile/1) and DIR/<model>/ (model and block "
                    "sub-models). Run again with another --gpu and the same -o to add a GPU type.",
    )
    p.add_argument("model", type=Path, metavar="MODEL.onnx")
    p.add_argument("--backend", choices=BACKENDS, default="ort",
                   help="trt: TensorRT engines; ort: ONNX Runtime on CPU; torch: CUDA through "
                        "PyTorch; estimate: datasheet what-if (default ort)")
    p.add_argument("--gpu", help="GPU type the latencies are for (estimate: one of the spec table; "
                                 "ort default CPU)")
    p.add_argument("--blocks", type=at.integer(1, 1000), default=10,
                   help="number of blocks (default 10)")
    p.add_argument("--batch-sizes", default="1-8", help="batch sizes 1-B (default 1-8)")
    p.add_argument("--splits", default="1", help="vGPU splits, e.g. 1,2,3,4 (default 1)")
    p.add_argument("-o", "--out", type=at.output_dir, required=True, metavar="DIR")
    p.add_argument("--name", type=at.file_name, help="model name (default: the file's stem)")
    p.add_argument("--input-shape", help="fix the per-sample input shape, e.g. 3x224x224")
    p.add_argument("--threads", type=at.integer(1, 4096), help="ort: cores for split 1 (default: all)")
    p.add_argument("--clock", choices=("auto", "wall", "cpu"), default="auto",
                   help="ort: time by wall clock or CPU time (auto: CPU time when a copy has one "
                        "thread, robust to other load on the machine)")
    p.add_argument("--mps", choices=("auto", "on", "off"), default="auto",
                   help="GPU splits > 1: run copies under an MPS daemon (default auto)")
    p.add_argument("--no-concurrent", action="store_true",
                   help="time a split with one copy instead of all v together")
    p.add_argument("--method", choices=("balanced", "greedy"), default="balanced",
                   help="pre-partitioning rule (greedy is the paper's)")
    p.add_argument("--max-cut-tensors", type=int, default=DEFAULT_MAX_CUT_TENSORS, metavar="K",
                   help="tensors a cut between blocks may carry, each sent fp16 (default "
                        f"{DEFAULT_MAX_CUT_TENSORS}; 1 is PPipe's rule, which leaves models with skip "
                        "connections such as FPN necks mostly uncuttable)")
    p.add_argument("--partition-cost", choices=("backend", "flops"), default="backend",
                   help="what blocks balance: this backend's latencies (default) or FLOPs")
    p.add_argument("--rounds", type=at.integer(1, 10_000), default=7, help="timed rounds per figure (median taken)")
    p.add_argument("--partitions", help="also export block ranges, e.g. 0-4,4-10")
    p.add_argument("--slo-reference", help="GPU whose whole-model latency sets SLOs (default: first profiled)")
    p.add_argument("--replace", action="store_true", help="start a new profile instead of merging")
    p.add_argument("--no-verify", action="store_true",
                   help="skip running the blocks in sequence against the whole model (ort)")
    p.add_argument("--calibration", type=Path, metavar="PATH",
                   help="input for that check: a .npy batch [B, *input] or sample, or a folder of "
                        ".npy files and/or images (resized to the input, RGB, scaled to [0,1]; other "
                        "normalisations: pass .npy). Default: random uniform [0,1)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    req = ProfileRequest(
        model_path=args.model, out_dir=args.out, backend=args.backend, gpu=args.gpu,
        blocks=args.blocks, max_batch=parse_batch_sizes(args.batch_sizes), splits=parse_splits(args.splits),
        name=args.name, input_shape=parse_shape(args.input_shape) if args.input_shape else None,
        timing=Timing(rounds=args.rounds), threads=args.threads, clock=args.clock, mps=args.mps,
        concurrent=not args.no_concurrent, method=args.method,
        max_cut_tensors=args.max_cut_tensors, partition_cost=args.partition_cost, replace=args.replace,
        slo_reference=args.slo_reference,
        partitions=parse_ranges(args.partitions) if args.partitions else (),
        progress=not args.quiet and sys.stderr.isatty(), verify=not args.no_verify,
        calibration=args.calibration,
    )
    t0 = time.perf_counter()
    try:
        prof, path = profile_model(req)
    except InputError as e:  # name the model file where the reason does not (ORT's and onnx's
        # reasons said "the model", a node or an input)
        msg = str(e)
        if str(args.model) in msg or Path(args.model).name in msg:
            raise
        raise InputError(f"{args.model}: {msg}") from None
    print(summary(prof, req.gpu or ""))
    print(f"wrote {path} and {path.with_suffix('')}/ in {time.perf_counter() - t0:.1f} s")
    return 0


def summary(prof, gpu: str) -> str:
    """A short table of the blocks just profiled: latency at batch 1 per split and boundary size."""
    lines = [f"{prof.model}: {prof.num_blocks} blocks, {gpu} ({prof.extra['latency_source'][gpu]['backend']})"]
    splits = prof.splits(gpu)
    lines.append("block " + "".join(f"  v={v} bs1 us" for v in splits) + "  out KiB")
    for b in range(prof.num_blocks):
        row = "".join(f"{prof.latency[gpu][v][b, 0]:>13.1f}" for v in splits)
        kib = prof.boundary_bytes[b] / 1024 if b < prof.num_blocks - 1 else 0.0
        lines.append(f"{b:>5} {row} {kib:>8.1f}")
    lines.append(f"whole model, bs 1, split 1: {prof.whole_model_latency_us[gpu]:.1f} us")
    if 1 in splits:
        dev = max_deviation(prof.latency[gpu][1][:, 0])
        lines.append(f"block balance ({gpu}, bs 1, split 1): max deviation from the mean block "
                     f"{100 * dev:.1f}%")
    eq = prof.extra.get("equivalence") or {}
    if "passed" in eq:
        lines.append(f"blocks in sequence vs whole model: max error {eq['max_rel_error']} of an output's "
                     f"range ({'within' if eq['passed'] else 'ABOVE'} {eq['tolerance']}; {eq['input']})")
    return "\n".join(lines)
