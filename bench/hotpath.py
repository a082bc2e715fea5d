"""Scheduler hot path in one process: CPU per request from SUBMIT to DISPATCH to RESULT and reply.

    .venv/bin/python bench/hotpath.py [--requests 200000] [--per-message 22] [--bs 16]

The daemon's own handlers (``on_client``, ``decide``, ``_dispatch``, ``on_exec``, ``on_result``)
run against real ZeroMQ sockets (inproc peers stand in for the client and the executor; the
scheduler's receives are counted, its peers' work is not), fed as fast as they take it: no other process competes for the CPU, so the figure is the scheduler's
work per request, the quantity the end-to-end ingest bench's latency tail is made of. Prints one
JSON line: µs per request in the scheduler (best of ``--repeat`` rounds), its split between the
submit and the result side, and the mean batch size.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import zmq

from ppiped import wire
from ppiped.commands.serve import load_serving
from ppiped.daemon.config import load_config
from ppiped.daemon.launch import write_config
from ppiped.daemon.loop import Timers, recv_parts, send_parts
from ppiped.daemon.server import Server
from ppiped.executor import tiny


class _NoReader:
    busy_since = 0  # never behind: nothing is shed

    def kick(self) -> None:
        pass

    def drain_now(self) -> None:
        pass


def _server(d: Path, bs: int, vgpus: int) -> tuple[Server, zmq.Socket, zmq.Socket, zmq.Context]:
    prof = tiny.profile_json(block_us=(5.0, 5.0), max_bs=bs)
    plan, profiles = tiny.write_example(d, prof, vgpus=(vgpus, vgpus), bs=bs, slo_ms=50.0)
    cfg = load_config(write_config(d, plan, profiles))
    srv = Server(cfg, *load_serving(cfg))
    ctx = zmq.Context()
    srv.zctx = ctx
    srv.loop = asyncio.new_event_loop()
    srv.client = ctx.socket(zmq.ROUTER)
    srv.client.bind("inproc://client")
    srv.exe = ctx.socket(zmq.ROUTER)
    srv.exe.setsockopt(zmq.ROUTER_MANDATORY, 1)
    srv.exe.bind("inproc://exe")
    srv.timers = Timers(srv.loop)
    srv.client_reader = srv.exe_reader = _NoReader()
    srv._dirty_decide = False
    srv._burst_start = 0
    cl = ctx.socket(zmq.DEALER)
    cl.setsockopt(zmq.IDENTITY, b"C")
    cl.connect("inproc://client")
    ex = ctx.socket(zmq.DEALER)
    ex.setsockopt(zmq.IDENTITY, b"E")
    ex.connect("inproc://exe")
    send_parts(ex, [b"hello"])  # the ROUTER learns the peer's identity
    assert ex.poll(0) == 0 and srv.exe.poll(1000)
    srv.exe.recv_multipart()
    n = srv.nv
    srv.on_register(b"E", wire.decode(wire.register(list(range(n)), "inproc://data", "emulate", 1, 0, 1)))
    srv.ready(srv.execs[b"E"])
    while ex.poll(0):
        ex.recv_multipart()
    return srv, cl, ex, ctx


def run(requests: int, per_message: int, bs: int, vgpus: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="ppiped-hot-") as d:
        srv, cl, ex, ctx = _server(Path(d), bs, vgpus)
        payload = b"p" * 64
        t_submit = t_result = 0.0
        sent = answered = cid = 0
        pc = time.perf_counter
        while answered < requests:
            if sent < requests:
                k = min(per_message, requests - sent)
                ids = list(range(cid, cid + k))
                cid += k
                send_parts(cl, [wire.submit("tiny", 0, ids), *([payload] * k)])
                assert srv.client.poll(1000)
                t0 = pc()
                srv.on_client(recv_parts(srv.client, 0))
                srv.after_clients()
                t_submit += pc() - t0
                sent += k
            elif srv.reqs:
                t0 = pc()
                srv.decide(srv.wake_at if srv.wake_at < float("inf") else 0)  # the rest: at their wake
                t_submit += pc() - t0
                time.sleep(0.001)
            while ex.poll(0):  # the executor: answer each dispatch at once
                m = recv_parts(ex, 0)
                h = wire.decode(m[0])
                bid, path, starts, rids = h.batch, h.path, h.starts, h.ids
                fb = []
                for hop, v in enumerate(path):
                    fb += [v, bid, hop, starts[hop], starts[hop], starts[hop] + 10]
                send_parts(ex, [wire.result(bid, rids, None, (), fb), *m[1:]])
                assert srv.exe.poll(1000)
                t0 = pc()
                srv.on_exec(recv_parts(srv.exe, 0))
                srv.after_execs()
                t_result += pc() - t0
            while cl.poll(0):
                m = cl.recv_multipart(copy=False)
                answered += len(wire.decode(m[0]).ids)
        st = srv.stats[0]
        mean_batch = st.batch_reqs / max(1, st.batches)
        srv.timers.close()
        srv.loop.close()
        ctx.destroy(0)
    return {"us_per_request": 1e6 * (t_submit + t_result) / requests,
            "submit_side_us": 1e6 * t_submit / requests, "result_side_us": 1e6 * t_result / requests,
            "mean_batch": mean_batch}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=200_000)
    ap.add_argument("--per-message", type=int, default=22, help="requests per client SUBMIT message")
    ap.add_argument("--bs", type=int, default=16)
    ap.add_argument("--vgpus", type=int, default=4, help="vGPUs per pool")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    run(2000, args.per_message, args.bs, args.vgpus)  # JIT and caches
    rounds = [run(args.requests, args.per_message, args.bs, args.vgpus) for _ in range(args.repeat)]
    best = min(rounds, key=lambda r: r["us_per_request"])
    print(json.dumps({"bench": "hotpath", "requests": args.requests, "per_message": args.per_message,
                      "bs": args.bs, **{k: round(v, 3) for k, v in best.items()},
                      "rounds_us_per_request": [round(r["us_per_request"], 3) for r in rounds]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
