"""Serving-path bench: end-to-end ingest rate, scheduler overhead, recovery after an executor dies.

    .venv/bin/python bench/ingest.py                 # both parts, JSON lines on stdout
    .venv/bin/python bench/ingest.py --part ingest --rate 25000 --duration 10

``ingest``: one scheduler process, a near-zero-latency emulated cluster (5 µs per block) and one
load-generator process offering Poisson load. Figures: requests/s accepted, scheduled and
answered (OK) end to end as the client counts them, and the scheduler's own overhead per request
from the daemon's ctl status: time from reading the request (or from the moment the core's
wait-until expired, for requests that waited on purpose to fill a batch) to handing its batch to
the executor socket. The scheduler's event loop gets a CPU of its own and its ZeroMQ I/O thread
shares the other with the executors and the load generator (``[threads]`` in the config;
``--no-pin``: everything shares every CPU). The run reports the host's steal time, which the
latency tail follows on a virtual machine.

Past the daemon's own ceiling it must shed, not collapse: the figures then are answers within
the SLO per second (``in_slo_rps``), requests answered ``overloaded`` (count, per second, and how
long the refusal took: ``shed_p99_us`` from the daemon reading the message to its reply leaving,
``overloaded_client_p99_ms`` from the client's send) and requests without a reply (must be 0).

``recovery``: the tiny two-pool plan with realistic latencies over two executor processes;
SIGKILL one mid-run. Figures: requests never answered (must be 0), and how long after the kill
the attainment of requests sent in 250 ms windows is back at >= 99% for good (the end of the
last window under 99% within 3 s of the kill).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np
import uvloop

from ppiped.commands.loadgen import recovery_after, run_load
from ppiped.daemon.config import BACKENDS
from ppiped.daemon.launch import (
    LocalCluster,
    cpu_split,
    running_on,
    short_tmpdir,
    split_groups,
    write_config,
)
from ppiped.executor import tiny


def _cpu_s(pid: int, tid: int | None = None) -> float:
    """CPU seconds (user + system) a process has used, all threads included, or one thread's."""
    stat = f"/proc/{pid}/task/{tid}/stat" if tid else f"/proc/{pid}/stat"
    f = Path(stat).read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def _io_threads(pid: int) -> list[int]:
    """Thread ids of ZeroMQ's I/O threads in process ``pid``."""
    tids = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        if Path(f"/proc/{pid}/task/{tid}/comm").read_text().startswith("ZMQbg/IO"):
            tids.append(int(tid))
    return tids


def _steal_jiffies() -> int:
    """CPU time the hypervisor gave to other guests (``steal`` in /proc/stat; 0 off Linux/VMs)."""
    try:
        return int(Path("/proc/stat").read_text().split("\n", 1)[0].split()[8])
    except (OSError, IndexError, ValueError):
        return 0


def _cpu_busy() -> dict[str, tuple[int, int]]:
    """Per CPU: (busy, total) jiffies since boot, from /proc/stat (empty off Linux)."""
    out = {}
    try:
        for line in Path("/proc/stat").read_text().splitlines():
            f = line.split()
            if f and f[0].startswith("cpu") and f[0] != "cpu":
                v = [int(x) for x in f[1:9]]
                out[f[0]] = (sum(v) - v[3] - v[4], sum(v))  # all but idle and iowait
    except (OSError, ValueError):
        pass
    return out


def emit(**kw) -> None:
    print(json.dumps(kw), flush=True)


def ingest(args: argparse.Namespace) -> dict:
    with short_tmpdir("ppiped-ingest-") as d:
        d = Path(d)
        prof = tiny.profile_json(block_us=(args.block_us, args.block_us), max_bs=args.bs)
        plan, profiles = tiny.write_example(d, prof, vgpus=(args.vgpus, args.vgpus), bs=args.bs,
                                           slo_ms=args.slo_ms)
        split = cpu_split() if args.pin else None
        sched_cpus, other_cpus = split or (None, None)
        real = args.backend != "emulate"  # real inference: real frames, partitions from parts/
        keys = _curve_keys(d, 2 * args.vgpus) if args.curve else {}
        limits = f"[limits]\nmax_backlog_ms = {args.max_backlog_ms}\n" if args.max_backlog_ms else ""
        cfg = write_config(d, plan, profiles, heartbeat_ms=100, timeout_ms=2000, threads=split,
                           backend=args.backend, partitions=str(d / "parts" / "{model}" / "{start}-{end}.onnx"),
                           extra=limits + keys.get("config", ""))
        n = 2 * args.vgpus
        groups = split_groups(n, args.executor_processes)
        frame_bytes = 4 * int(np.prod(tiny.INPUT_SHAPE)) if real else 64  # float32 input
        ck = {"key_file": keys.get("client"), "server_key_file": keys.get("server")}
        with LocalCluster(cfg, groups, executor_cpus=other_cpus, admin_key=keys.get("admin")) as c, \
                running_on(other_cpus):
            # warm the path (first dispatches, socket connections), then measure a clean window
            asyncio.run(run_load(c.client_endpoint, {"tiny": 2000.0}, 1.0, frame_bytes=frame_bytes, **ck))
            c.ctl("reset-overhead")
            before = c.status()
            t0 = time.monotonic()
            spid = c.server.pid
            pids = {"scheduler": (spid, None), "scheduler_loop": (spid, spid),
                    **{f"scheduler_io{i}": (spid, t) for i, t in enumerate(_io_threads(spid))},
                    "executor": (c.executors[0].pid, None), "loadgen": (os.getpid(), None)}
            cpu0 = {k: _cpu_s(*p) for k, p in pids.items()}
            steal0 = _steal_jiffies()
            busy0 = _cpu_busy()
            r = uvloop.run(run_load(c.client_endpoint, {"tiny": args.rate}, args.duration, frame_bytes=frame_bytes,
                                    seed=args.seed, tick_us=args.tick_us, **ck))
            cpu = {k: round((_cpu_s(*p) - cpu0[k]) / args.duration, 3) for k, p in pids.items()}
            steal = (_steal_jiffies() - steal0) / os.sysconf("SC_CLK_TCK")
            busy = {k: round(100 * (b - busy0[k][0]) / max(1, t - busy0[k][1]), 1)
                    for k, (b, t) in _cpu_busy().items() if k in busy0}
            wall = time.monotonic() - t0
            after = c.status(timeout_s=30.0)  # a daemon past its ceiling may still be catching up
        if after is None:
            raise RuntimeError("the scheduler did not answer ctl status within 30 s after the run")
        tot = r["total"]
        m = r["models"][0]
        shed = after["shed_us"]
        over = m["reject_reasons"].get("overloaded", 0)
        ok = after["models"]["tiny"]["ok"] - before["models"]["tiny"]["ok"]
        ov = after["overhead_us"]
        out = {
            "bench": "ingest", "backend": args.backend, "curve": args.curve, "offered_rps": args.rate,
            "duration_s": args.duration,
            "attainment": tot["attainment"],
            "sent": tot["sent"], "answered_ok": tot["ok"], "dropped": tot["dropped"],
            "rejected": tot["rejected"], "no_reply": tot["no_reply"],
            "answered_rps": ok / args.duration, "in_slo_rps": tot["attained"] / args.duration,
            "overloaded": over, "overloaded_rps": over / args.duration,
            "shed_p50_us": shed.get("p50"), "shed_p99_us": shed.get("p99"), "shed_max_us": shed.get("max"),
            "overloaded_client_p99_ms": m["reject_latency_ms"].get("overloaded", {}).get("p99"),
            # whole messages refused, by why: client socket backlog, admission window, max_pending
            "shed_by_cause": {k: after["counters"].get(f"shed_{k}", 0) - before["counters"].get(f"shed_{k}", 0)
                              for k in ("backlog", "share", "window", "queue")},
            "client_p50_ms": tot["p50_ms"], "client_p99_ms": tot["p99_ms"],
            "overhead_p50_us": ov.get("p50"), "overhead_p99_us": ov.get("p99"),
            "overhead_p999_us": ov.get("p999"), "overhead_samples": ov.get("n"),
            "mean_batch": after["models"]["tiny"]["mean_batch"], "wall_s": wall,
            "scheduler_cpu_us_per_request": 1e6 * (after["cpu_s"] - before["cpu_s"]) / max(1, ok),
            "cores_used": cpu, "cpu_busy_pct": busy, "host_load_avg": os.getloadavg()[0],
            # a VM's stolen CPU stalls the scheduler for milliseconds at a time: the latency tail
            # follows it (see README)
            "host_steal_pct": round(100 * steal / (args.duration * (os.cpu_count() or 1)), 2),
            "wake_late_p50_us": after["wake_late_us"].get("p50"), "wake_late_p99_us": after["wake_late_us"].get("p99"),
            "wakes": after["wake_late_us"].get("n"), "loop_cpus": sched_cpus, "io_cpus": other_cpus,
        }
        emit(**out)
        return out


def _curve_keys(d: Path, n_vgpus: int) -> dict[str, str]:
    """Keypairs for a CURVE run (scheduler, one executor key for every vGPU, a client, an admin)
    and the [security] config lines."""
    from ppiped.security import keygen

    k = d / "keys"
    for name in ("server", "executor", "client", "admin"):
        keygen(k, name)
    config = (f'[security]\ncurve = true\nserver_key = "{k}/server.key_secret"\n'
              f'executor_key = "{k}/executor.key_secret"\nclient_keys = "{k}/client.key"\n'
              f'admin_keys = "{k}/admin.key"\n[security.executors]\n"{k}/executor.key" = "0-{n_vgpus - 1}"\n')
    return {"config": config, "server": str(k / "server.key"), "client": str(k / "client.key_secret"),
            "admin": str(k / "admin.key_secret")}


def recovery(args: argparse.Namespace) -> dict:
    with short_tmpdir("ppiped-recovery-") as d:
        d = Path(d)
        plan, profiles = tiny.write_example(d, vgpus=(4, 4), bs=4, slo_ms=60.0)
        cfg = write_config(d, plan, profiles, heartbeat_ms=100, timeout_ms=1000)
        groups = [[0, 1, 4, 5], [2, 3, 6, 7]]  # each process holds half of each pool
        kill_at = args.kill_at
        with LocalCluster(cfg, groups) as c:
            killed: dict[str, float] = {}

            def on_tick(t_us: float) -> None:
                if t_us >= kill_at * 1e6 and not killed:
                    killed["t"] = t_us / 1e6
                    os.kill(c.executors[1].pid, signal.SIGKILL)

            r = uvloop.run(run_load(c.client_endpoint, {"tiny": args.recovery_rate}, args.recovery_duration,
                                    seed=args.seed, on_tick=on_tick, keep_samples=True))
            st = c.status()
        t_kill = killed.get("t", kill_at)
        rec = recovery_after(r["samples"], t_kill, args.window)
        out = {
            "bench": "recovery", "rate_rps": args.recovery_rate, "killed_at_s": round(t_kill, 3),
            "sent": r["total"]["sent"], "no_reply": r["total"]["no_reply"],
            "attainment": r["total"]["attainment"], "worst_window_attainment": rec["worst_window_attainment"],
            "recovery_s": rec["recovery_s"], "window_s": args.window, "series": rec["series"],
            "executors_lost": st["counters"].get("executors_lost", 0),
            "retried": st["counters"].get("retried", 0), "batches_lost": st["counters"].get("batches_lost", 0),
            "drop_reasons": r["models"][0]["drop_reasons"],
        }
        emit(**out)
        return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("all", "ingest", "recovery"), default="all")
    ap.add_argument("--rate", type=float, default=22000.0, help="ingest: offered requests/s")
    ap.add_argument("--duration", type=float, default=10.0)
    ap.add_argument("--bs", type=int, default=16, help="ingest: planned batch size")
    ap.add_argument("--block-us", type=float, default=5.0,
                    help="ingest: planned latency of each of the tiny CNN's two blocks at batch 1 (µs)")
    ap.add_argument("--backend", choices=BACKENDS, default="emulate",
                    help="ingest: executor backend (emulate sleeps the plan's latency; ort, trt and torch run "
                         "the tiny CNN)")
    ap.add_argument("--executor-processes", type=int, default=1, help="ingest: processes hosting the vGPUs")
    ap.add_argument("--tick-us", type=int, default=1000, help="ingest: the load generator sends every tick")
    ap.add_argument("--vgpus", type=int, default=4, help="ingest: vGPUs per pool")
    ap.add_argument("--slo-ms", type=float, default=50.0)
    ap.add_argument("--max-backlog-ms", type=float, default=0.0,
                    help="ingest: limits.max_backlog_ms of the daemon (0: its default)")
    ap.add_argument("--recovery-rate", type=float, default=600.0)
    ap.add_argument("--recovery-duration", type=float, default=6.0)
    ap.add_argument("--kill-at", type=float, default=2.0)
    ap.add_argument("--window", type=float, default=0.25, help="recovery: attainment window (s)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--curve", action="store_true",
                    help="CURVE on every socket (keys made in the run's temp dir): what encryption costs")
    ap.add_argument("--no-pin", dest="pin", action="store_false",
                    help="ingest: let the scheduler share every CPU with the executors and load generator")
    args = ap.parse_args()
    ok = True
    if args.part in ("all", "ingest"):
        r = ingest(args)
        ok &= r["no_reply"] == 0
    if args.part in ("all", "recovery"):
        r = recovery(args)
        ok &= r["no_reply"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
