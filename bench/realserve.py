"""Real ONNX Runtime serving on this host's CPUs: does inference starve the executors' control?

    .venv/bin/python bench/realserve.py                      # one JSON line on stdout
    .venv/bin/python bench/realserve.py --vgpus 4 --load-factor 0.25 --duration 20

What runs: the example CNN (``ppiped example-model``) profiled with the ``ort`` backend on this
host (one intra-op thread, GPU type ``CPU``), planned with the MILP on ``--vgpus`` CPU "vGPUs"
(a ``--slo-ms`` SLO), then ``ppiped serve`` and ``--processes`` executor processes with the real
``ort`` backend, and the load generator at ``--load-factor`` times the planned throughput. As in
the demo, the scheduler's event loop gets a CPU of its own and the executors and load generator
share the rest (``--no-pin``: all share all).

Figures (one JSON line): attainment, drops by reason (``executor-lost`` is what a starved
executor costs: the scheduler gave up on it or on its batches), the scheduler's
``executors_lost`` and ``batches_lost`` counters, and the ``batch-overdue`` and
``executor-removed`` warnings in its log. The example and its profile are built once under
``--cache`` and reused.
"""

from __future__ import annotations

import argparse
import json
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


def build(cache: Path) -> Path:
    """The example CNN and its ``ort`` profile on this host (GPU type ``CPU``); the profile dir."""
    prof = cache / "prof"
    if (prof / "example.json").exists():
        return prof
    cache.mkdir(parents=True, exist_ok=True)
    subprocess.run([*CLI, "example-model", "-o", str(cache / "ex")], check=True, stdout=subprocess.DEVNULL)
    subprocess.run([*CLI, "profile", str(cache / "ex" / "example" / "model.onnx"), "--name", "example",
                    "--backend", "ort", "--gpu", "CPU", "--threads", "1", "--blocks", "10",
                    "--batch-sizes", "1-4", "--splits", "1", "-o", str(prof), "-q"],
                   check=True, stdout=subprocess.DEVNULL)
    return prof


def plan(prof: Path, out: Path, vgpus: int, slo_ms: float) -> Path:
    path = out / "plan.json"
    subprocess.run([*CLI, "plan", "--profiles", str(prof), "--models", "example", "--weights", "1",
                    "--gpus", f"CPU:{vgpus}", "--gpus-per-server", "1", "--vgpu-splits", "1",
                    "--nic-gbps", "10", "--slo-ms", str(slo_ms), "--time-limit", "20", "-o", str(path)],
                   check=True, stdout=subprocess.DEVNULL)
    return path


def count(path: Path, word: str) -> int:
    try:
        return path.read_text(errors="replace").count(word)
    except OSError:
        return 0


def run(args: argparse.Namespace, work: Path) -> dict:
    prof = build(Path(args.cache))
    plan_path = plan(prof, work, args.vgpus, args.slo_ms)
    p = load_plan(plan_path)
    n = sum(q.num_vgpus for m in p.models for pl in m.pipelines for q in pl.partitions)
    rates = {m.model: args.load_factor * m.throughput_rps for m in p.models}
    split = cpu_split() if args.pin else None
    extra = f"threads = {args.threads}\n"  # [executor]; write_config's own [threads] would follow it
    if split:
        extra += f"[threads]\nloop_cpus = {split[0]}\nio_cpus = {split[1]}\n"
    cfg = write_config(work, plan_path, prof, backend="ort", heartbeat_ms=args.heartbeat_ms,
                       timeout_ms=args.timeout_ms, extra=extra)
    others = split[1] if split else None
    cluster = LocalCluster(cfg, split_groups(n, args.processes), log_dir=work, executor_cpus=others,
                           log_level=args.log_level)
    with cluster, running_on(others):
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
        "bench": "realserve", "vgpus": n, "processes": len(cluster.groups), "ort_threads": args.threads,
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
    ap.add_argument("--vgpus", type=int, default=4, help="CPU 'vGPUs' the plan may use")
    ap.add_argument("--load-factor", type=float, default=0.25)
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
