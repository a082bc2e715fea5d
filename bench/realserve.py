"""Real ONNX Runtime serving on this host's CPUs: does inference starve the executors' control?

    .venv/bin/python bench/realserve.py                      # one JSON line on stdout
    .venv/bin/python bench/realserve.py --models example --cores 2 --no-pin --load-factor 0.25

What runs: ``--models`` (default three models of the test zoo, ``tests/zoo``: a DBNet-like FPN
text detector, a YOLO-like detector and an attention text recognizer, mixed with equal weights;
or ``example``, the example CNN of ``ppiped example-model``), each profiled with the ``ort``
backend on this host (one intra-op thread, GPU type ``CPU``, default cuts of up to 4 tensors),
planned together with the MILP (GPUs shared across models) on the cores the executors get: a
CPU "GPU" is one core, split into vGPUs that share its time (``--splits``; the profile times a
split's copies pinned to one core by the wall clock, so a half-core vGPU is timed as one), a
``--slo-ms`` SLO,
then ``ppiped serve`` and ``--processes`` executor processes with the real ``ort`` backend, and
the load generator at ``--load-factor`` times each model's planned throughput. As in the demo,
the executors get every CPU but the first, where the scheduler's event loop, its I/O thread and
the load generator run (``--no-pin``: all share all); the plan uses the executors' cores.

Figures (one JSON line): attainment, drops by reason (``executor-lost`` is what a starved
executor costs: the scheduler gave up on it or on its batches), the scheduler's
``executors_lost`` and ``batches_lost`` counters, and the ``batch-overdue`` and
``executor-removed`` warnings in its log. The example and its profile are built once under
``--cache`` and reused (keyed by the models).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import uvloop

from ppiped.commands.loadgen import run_load
from ppiped.daemon.launch import (
    LocalCluster,
    cpu_split,
    running_on,
    short_tmpdir,
    split_groups,
    write_config,
)
from ppiped.plan import load_plan

CLI = [sys.executable, "-m", "ppiped.cli"]


ZOO_DEFAULT = ("fpn", "yolo", "attention")
# Input size of each scalable zoo model at --scale 1 (the test zoo's own sizes).
ZOO_SIZE = {"fpn": ("size", 48), "yolo": ("size", 64), "attention": ("width", 64)}


def _zoo():
    """The test zoo's builders (``tests/zoo``), imported from the repository beside this bench."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from zoo import INPUT_SHAPES, ZOO

    return ZOO, INPUT_SHAPES


def build(cache: Path, models: list[str], splits: str, scale: int, rounds: int = 7) -> Path:
    """Each model's ONNX file and its ``ort`` profile on this host (GPU type ``CPU``); the profile dir."""
    prof = cache / f"prof-x{scale}-s{splits.replace(',', '')}"
    prof.mkdir(parents=True, exist_ok=True)
    for name in models:
        if (prof / f"{name}.json").exists():
            continue
        shape: list[str] = []
        if name == "example":
            subprocess.run([*CLI, "example-model", "-o", str(cache / "ex")], check=True, stdout=subprocess.DEVNULL)
            src = cache / "ex" / "example" / "model.onnx"
        else:
            import onnx

            zoo, shapes = _zoo()
            if name not in zoo:
                raise SystemExit(f"realserve: unknown model {name!r} (example or one of {', '.join(zoo)})")
            src = cache / f"{name}-x{scale}.onnx"
            kw = {ZOO_SIZE[name][0]: ZOO_SIZE[name][1] * scale} if name in ZOO_SIZE else {}
            onnx.save(zoo[name](**kw), str(src))
            shape = ["--input-shape", shapes[name]] if name in shapes else []
        blocks = "10" if name == "example" else "6"
        subprocess.run([*CLI, "profile", str(src), "--name", name, *shape, "--backend", "ort", "--gpu", "CPU",
                        "--threads", "1", "--blocks", blocks, "--batch-sizes", "1-4", "--splits", splits,
                        "--rounds", str(rounds), "-o", str(prof), "-q"], check=True, stdout=subprocess.DEVNULL)
    return prof


def plan(prof: Path, out: Path, models: list[str], cores: int, splits: str, slo_ms: float) -> Path:
    path = out / "plan.json"
    subprocess.run([*CLI, "plan", "--profiles", str(prof), "--models", ",".join(models),
                    "--weights", ",".join("1" for _ in models), "--gpus", f"CPU:{cores}",
                    "--gpus-per-server", "1", "--vgpu-splits", splits.split(",")[-1], "--nic-gbps", "10",
                    "--slo-ms", ",".join(str(slo_ms) for _ in models), "--share-gpus", "--time-limit", "20", "-o", str(path)],
                   check=True, stdout=subprocess.DEVNULL)
    return path


def count(path: Path, word: str) -> int:
    try:
        return path.read_text(errors="replace").count(word)
    except OSError:
        return 0


def run(args: argparse.Namespace, work: Path) -> dict:
    models = [m for m in args.models.split(",") if m]
    split = cpu_split() if args.pin else None
    cores = args.cores or (len(split[1]) if split else len(os.sched_getaffinity(0)))
    prof = build(Path(args.cache), models, args.splits, args.scale, args.rounds)
    plan_path = plan(prof, work, models, cores, args.splits, args.slo_ms)
    p = load_plan(plan_path)
    n = sum(q.num_vgpus for m in p.models for pl in m.pipelines for q in pl.partitions)
    rates = {m.model: args.load_factor * m.throughput_rps for m in p.models}
    extra = f"threads = {args.threads}\n"  # [executor]; write_config's own [threads] would follow it
    if split:  # the executors' cores do inference only: client and scheduler I/O stay on the loop's
        extra += f"[threads]\nloop_cpus = {split[0]}\nio_cpus = {split[0]}\n"
    cfg = write_config(work, plan_path, prof, backend="ort", heartbeat_ms=args.heartbeat_ms,
                       timeout_ms=args.timeout_ms, extra=extra)
    others = split[1] if split else None
    cluster = LocalCluster(cfg, split_groups(n, args.processes), log_dir=work, executor_cpus=others,
                           log_level=args.log_level)
    with cluster, running_on(split[0] if split else None):
        before = cluster.status()
        t0 = time.monotonic()
        result = uvloop.run(run_load(cluster.client_endpoint, rates, args.duration, seed=args.seed))
        wall = time.monotonic() - t0
        after = cluster.status()
    t = result["total"]
    reasons: dict[str, int] = {}
    for m in result["models"]:
        for k, v in m["drop_reasons"].items():
            reasons[k] = reasons.get(k, 0) + v
    c0, c1 = (before or {}).get("counters", {}), (after or {}).get("counters", {})
    return {
        "bench": "realserve", "models": models, "scale": args.scale, "planned_rps": {m.model: round(m.throughput_rps, 1) for m in p.models},
        "cores": cores, "vgpus": n, "processes": len(cluster.groups), "ort_threads": args.threads,
        "load_factor": args.load_factor, "offered_rps": round(sum(rates.values()), 1),
        "slo_ms": args.slo_ms, "duration_s": args.duration, "wall_s": round(wall, 1),
        "sent": t["sent"], "ok": t["ok"], "attainment": round(t["attainment"], 4),
        "dropped": t["dropped"], "no_reply": t["no_reply"], "drop_reasons": reasons,
        "executor_lost": reasons.get("executor-lost", 0),
        "p50_ms": round(t["p50_ms"], 1), "p99_ms": round(t["p99_ms"], 1),
        "executors_lost": c1.get("executors_lost", 0) - c0.get("executors_lost", 0),
        "batches_lost": c1.get("batches_lost", 0) - c0.get("batches_lost", 0),
        "batch_overdue_warnings": count(work / "serve.log", "batch-overdue"),
        "executor_removed_warnings": count(work / "serve.log", "executor-removed"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(ZOO_DEFAULT),
                    help="comma-separated: zoo models (tests/zoo) or example (default %(default)s)")
    ap.add_argument("--scale", type=int, default=4,
                    help="zoo models' input size x this (fpn 48, yolo 64, attention 32x64 at 1): "
                         "CPU inference of a few ms per request, as real models take (default 4)")
    ap.add_argument("--cores", type=int, help="CPU 'GPUs' (one core each) the plan may use (default: the "
                                               "cores the executors get)")
    ap.add_argument("--splits", default="1,2,3,4", help="vGPU splits of a core, profiled and planned "
                                                        "(default %(default)s)")
    ap.add_argument("--load-factor", type=float, default=0.5)
    ap.add_argument("--rounds", type=int, default=7, help="profile: timed rounds per figure (default 7)")
    ap.add_argument("--duration", type=float, default=20.0)
    ap.add_argument("--slo-ms", type=float, default=100.0)
    ap.add_argument("--processes", type=int, default=1, help="executor processes hosting the vGPUs")
    ap.add_argument("--threads", type=int, default=1, help="ONNX Runtime intra-op threads per vGPU")
    ap.add_argument("--heartbeat-ms", type=int, default=100)
    ap.add_argument("--timeout-ms", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-pin", dest="pin", action="store_false")
    ap.add_argument("--cache", default="/tmp/ppiped-realserve", help="example model and profile, built once")
    ap.add_argument("--log-level", default="warning", help="of the scheduler and executors (their logs: --keep)")
    ap.add_argument("--keep", help="keep config, plan and logs in this directory")
    args = ap.parse_args()
    if args.keep:
        work = Path(args.keep)
        work.mkdir(parents=True, exist_ok=True)
        r = run(args, work)
    else:
        with short_tmpdir("ppiped-rs-") as d:
            r = run(args, Path(d))
    print(json.dumps(r), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
