"""Attacks and faults against a live daemon with emulated executors, under a steady legit load.

    .venv/bin/python bench/faults.py [--rate 2000] [--only NAME,...]

One JSON line per case, then a summary line; exit 1 when a case misses its target:

- ``forged-results``: a process registers a spare vGPU id and sends RESULTs for every batch id
  the legit load may be using; target: 0 forged answers reach the client.
- ``tcp-ctl-stop``: ``{"cmd": "stop"}`` on a TCP ctl endpoint without CURVE; target: refused,
  daemon still up.
- ``oversize-payloads``: 10 parallel clients each send a 100 MB frame; target: daemon RSS grows
  by at most 64 MB, legit attainment stays >= 99 %.
- ``forward-injection`` (and ``-curve``): a process registers a spare vGPU id (it gets the data
  endpoints, no assignment, no data key) and pushes FORWARDs into every executor's data port;
  with CURVE it is given the endpoints and its connections are refused; target: none runs (no
  RESULT for a batch the scheduler never dispatched), no executor lost, none without a reply
  (legit attainment reported: without CURVE the executors must read every forged FORWARD).
- ``unauthorized-register``: REGISTERs a plain daemon must refuse (a taken vGPU, a bogus data
  endpoint), then, against a CURVE daemon, with no key, an unknown key, a client's key and an
  executor key outside its vGPUs; target: none accepted.
- ``daemon-restart``: ``kill -9`` of the scheduler and a restart while requests are pending;
  target: every pending request ends with an explicit reason, none silently. Then the same under
  the steady load: none without a reply, every 250 ms window >= 99 % again within 3 s.
- ``executor-kill`` / ``executor-stop``: SIGKILL, or SIGSTOP for 2 s, of one of the two executor
  processes under half the legit rate (what the other half of each pool carries); target: none
  without a reply.
- ``flood``: one client (a raw socket in a process of its own) sends ``--flood`` single-request
  SUBMITs as fast as it can while ``--legit-clients`` loadgen processes share the legit rate;
  target: every legit client keeps >= 99 % attainment, every request (the flood's too) is answered.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import zmq

from ppiped import wire
from ppiped.client import AsyncClient, Dropped
from ppiped.commands.loadgen import recovery_after, run_load
from ppiped.daemon.config import load_config
from ppiped.daemon.launch import LocalCluster, curve_keys, short_tmpdir, write_config
from ppiped.executor import tiny
from ppiped.security import Security, connect_as, load_keypair

CASES = ("forged-results", "forward-injection", "unauthorized-register", "tcp-ctl-stop", "oversize-payloads",
         "daemon-restart", "executor-kill", "executor-stop", "flood")


def emit(**kw) -> dict:
    print(json.dumps(kw), flush=True)
    return kw


def _rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cluster(d: Path, tcp_ctl: bool = False) -> LocalCluster:
    plan, profiles = tiny.write_example(d, vgpus=(4, 4))  # 8 vGPUs, planned for 3,048 req/s
    cfg = write_config(d, plan, profiles, heartbeat_ms=50, timeout_ms=1000,
                       extra="[models.tiny]\ninput_bytes = 0\n")
    if tcp_ctl:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        cfg.write_text(re.sub(r'ctl = "ipc://[^"]*"', f'ctl = "tcp://127.0.0.1:{port}"', cfg.read_text(), count=1))
    return LocalCluster(cfg, ((0, 1, 4, 5), (2, 3, 6, 7)), log_level="warning")


class _Load:
    """Legit load from a process of its own (``ppiped loadgen``), so the attack's threads in
    this process never slow the client that measures attainment."""

    def __init__(self, c: LocalCluster, rate: float, seconds: float, seed: int = 0, keys: Path | None = None) -> None:
        curve = ["--key", str(keys / "clients/cam.key_secret"), "--server-key", str(keys / "server.key")] if keys else []
        self.p = subprocess.Popen([sys.executable, "-m", "ppiped.cli", "loadgen", "--endpoint", c.client_endpoint,
                                   "--rate", f"tiny={rate}", "--duration", str(seconds), "--frame-bytes", "64",
                                   "--check-echo", "--json", "--seed", str(seed), *curve],
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.seconds = seconds

    def result(self) -> dict:
        out, _ = self.p.communicate(timeout=self.seconds + 60)
        try:
            r = json.loads(out.strip().splitlines()[-1])
            m = r["models"][0]
            return {**r["total"], "drop_reasons": m["drop_reasons"], "reject_reasons": m["reject_reasons"]}
        except (IndexError, json.JSONDecodeError, KeyError):
            return {"attainment": 0.0, "no_reply": -1, "bad_echo": -1}


def _spare_executor(c: LocalCluster, d: Path) -> tuple[zmq.Context, zmq.Socket, dict[int, str]]:
    """A socket registered as an executor of a vGPU id the plan lacks (standby), and the data
    endpoints the scheduler's PEERS told it."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(load_config(c.config).executor)
    s.send(wire.register([500], f"ipc://{d}/intruder.sock", "emulate", os.getpid(), 0, 1))
    directory: dict[int, str] = {}
    end = time.monotonic() + 5
    while not directory and time.monotonic() < end:
        if s.poll(100):
            h = wire.decode(s.recv_multipart()[0])
            if h.type == wire.T.PEERS:
                flat = h.directory
                directory = {flat[i]: flat[i + 1] for i in range(0, len(flat) - 1, 2) if flat[i] != 500}
    return ctx, s, directory


def forged_results(args) -> dict:
    with short_tmpdir("ppiped-faults-") as d, _cluster(Path(d)) as c:
        ctx, s, _ = _spare_executor(c, Path(d))
        load = _Load(c, args.rate, args.seconds)
        time.sleep(0.5)  # the load is running
        sent = 0
        end = time.monotonic() + args.seconds
        while time.monotonic() < end:
            top = c.status()["totals"]["accepted"]
            for bid in range(max(1, top - 200), top + 200):  # batches of ~1 request at this load
                s.send_multipart([wire.result(bid, list(range(bid, bid + 4)), None, [], []), *[b"FORGED"] * 4])
                sent += 1
            time.sleep(0.005)
        ctx.destroy(0)
        load = load.result()
        st = c.status()
        # check_echo: a reply whose payload is not the request's own frame is counted as bad
        wrong = load.get("bad_echo", 0)
        return emit(case="forged-results", forged_sent=sent, forged_accepted=wrong,
                    refused=st["counters"].get("foreign_results", 0) + st["counters"].get("late_results", 0),
                    legit_attainment=load.get("attainment"), legit_no_reply=load.get("no_reply"),
                    ok=wrong == 0 and load.get("no_reply", 1) == 0)


def _data_ports(c: LocalCluster) -> dict[int, str]:
    """One vGPU id per executor and its data endpoint, as the status lists them."""
    return {int(e["vgpus"].split(",")[0].split("-")[0]): e["endpoint"] for e in c.status()["executors"]
            if e["vgpus"] != "500"}


def forward_child(directory: dict[int, str], seconds: float) -> dict:
    """The injector: FORWARDs without the data key, for batch ids the scheduler never issues, at
    each vGPU's own hop, into every data port, as fast as the sockets take them."""
    ctx = zmq.Context()
    pushes = {}
    for ep in set(directory.values()):
        p = pushes[ep] = ctx.socket(zmq.PUSH)
        p.setsockopt(zmq.LINGER, 0)
        p.connect(ep)
    sent = k = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        for v, ep in directory.items():
            k += 1
            head = wire.forward((1 << 40) + k, [7 - v, v], [0, 0], 1, [k], None)
            try:
                pushes[ep].send_multipart([head, b"F" * 64], zmq.NOBLOCK)
                sent += 1
            except zmq.Again:
                pass
    ctx.destroy(0)
    return {"sent": sent, "data_ports": len(pushes)}


def _inject(c: LocalCluster, directory: dict[int, str], args, keys: Path | None = None) -> dict:
    """Legit load while the injector (a process of its own) pushes FORWARDs into the data ports of
    ``directory``; what ran, what was lost, what the legit client saw."""
    served = {e["pid"] for e in c.status()["executors"] if e["vgpus"] != "500"}
    load = _Load(c, args.rate, args.seconds, keys=keys)
    time.sleep(0.5)
    # at the flooder's niceness, for the same reason (see flood)
    f = subprocess.Popen([sys.executable, __file__, "--forward-child", json.dumps(directory), str(args.seconds)],
                         stdout=subprocess.PIPE, text=True, preexec_fn=lambda: os.nice(args.flood_nice))
    load = load.result()
    out, _ = f.communicate(timeout=120)
    inj = json.loads(out.strip().splitlines()[-1])
    time.sleep(0.3)
    st = c.status()
    return {"data_ports": inj["data_ports"], "forged_sent": inj["sent"],
            # a forged FORWARD that ran ends in a RESULT for a batch the scheduler never dispatched
            "forged_run": st["counters"].get("results_never_dispatched", 0),
            # (the intruder's own standby registration goes silent and is removed: not counted)
            "executors_lost": len(served - {e["pid"] for e in st["executors"] if e["ready"]}),
            "batches_lost": st["counters"].get("batches_lost", 0), "legit_attainment": load.get("attainment"),
            "legit_no_reply": load.get("no_reply"), "legit_p99_ms": load.get("p99_ms"),
            "legit_drops": load.get("drop_reasons"), "legit_rejects": load.get("reject_reasons")}


def forward_injection(args) -> dict:
    """Without CURVE the injector registers a spare vGPU id (which since session 12 learns no
    data ports: PEERS goes only to executors serving the plan) and finds the data ports as a
    process on the host can (the socket files, a port scan: here the status), and the executors
    must read (and refuse) every FORWARD: none runs and none is lost, but on a small host the
    flood takes CPU from the legit work. With CURVE (what leaves loopback, and the systemd
    install, uses) the data ports refuse its connection, so it costs nothing."""
    with short_tmpdir("ppiped-faults-") as d, _cluster(Path(d)) as c:
        ctx, _registered, learned = _spare_executor(c, Path(d))
        plain = _inject(c, _data_ports(c), args)
        plain["ports_from_peers"] = len(set(learned.values()))
        ctx.destroy(0)
    emit(case="forward-injection", curve=False, **plain,
         ok=plain["forged_run"] == 0 and plain["executors_lost"] == 0 and plain["legit_no_reply"] == 0)
    with short_tmpdir("ppiped-faults-") as d, _curve_cluster(Path(d)) as (c, keys):
        cur = _inject(c, _data_ports(c), args, keys)
    return emit(case="forward-injection-curve", curve=True, **cur,
                ok=cur["forged_run"] == 0 and cur["executors_lost"] == 0 and cur["legit_no_reply"] == 0
                and plain["forged_run"] == 0 and plain["executors_lost"] == 0 and plain["legit_no_reply"] == 0)


@contextlib.contextmanager
def _curve_cluster(d: Path):
    """The faults cluster (8 vGPUs over two executor processes) with CURVE on every socket:
    (cluster, key directory)."""
    keys = d / "keys"
    security = curve_keys(keys, {"ex0": "0,1,4,5", "ex1": "2,3,6,7"})
    plan, profiles = tiny.write_example(d, vgpus=(4, 4))
    cfg = write_config(d, plan, profiles, heartbeat_ms=50, timeout_ms=1000,
                       extra="[models.tiny]\ninput_bytes = 0\n" + security)
    with LocalCluster(cfg, ((0, 1, 4, 5), (2, 3, 6, 7)), log_level="warning",
                      admin_key=str(keys / "admins/ops.key_secret"),
                      executor_keys=[str(keys / f"executors/ex{i}.key_secret") for i in (0, 1)]) as c:
        yield c, keys


def _register_answer(sock: zmq.Socket, vgpus: list[int], endpoint: str, timeout_s: float = 1.5) -> str:
    """What the scheduler answers a REGISTER: the message type, an error's code, or 'nothing'."""
    sock.send(wire.register(vgpus, endpoint, "emulate", os.getpid(), 0, 1))
    if not sock.poll(int(timeout_s * 1000)):
        return "nothing"
    h = wire.decode(sock.recv_multipart()[0])
    return h.code if h.type == wire.T.ERROR else wire.T(h.type).name.lower()


def unauthorized_register(args) -> dict:
    tries: dict[str, str] = {}
    with short_tmpdir("ppiped-faults-") as d, _cluster(Path(d)) as c:
        ctx = zmq.Context()
        ep = load_config(c.config).executor
        for name, vgpus, data in (("plain, a served vGPU", [0], f"ipc://{d}/x.sock"),
                                  ("plain, bogus data endpoint", [500], "bogus-endpoint"),
                                  ("plain, remote data endpoint", [501], "tcp://203.0.113.5:7000")):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
            tries[name] = _register_answer(s, vgpus, data)
        ctx.destroy(0)
    with short_tmpdir("ppiped-faults-") as d, _curve_cluster(Path(d)) as (c, keys):
        ep = load_config(c.config).executor
        sec = Security(curve=True, server=load_keypair(keys / "server.key"))
        ctx = zmq.Context()
        for name, key, vgpus in (("CURVE, no key", None, [500]),
                                 ("CURVE, unknown key", "intruder.key_secret", [500]),
                                 ("CURVE, a client's key", "clients/cam.key_secret", [500]),
                                 ("CURVE, executor key outside its vGPUs", "executors/ex0.key_secret", [2])):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            if key is not None:
                connect_as(s, sec, own=load_keypair(keys / key, need_secret=True))
            s.connect(ep)
            tries[name] = _register_answer(s, vgpus, f"ipc://{d}/y.sock")
        ctx.destroy(0)
        alive = c.status()["vgpus"]["alive"]
    accepted = [k for k, v in tries.items() if v in ("welcome", "peers")]
    return emit(case="unauthorized-register", answers=tries, accepted=len(accepted), curve_vgpus_alive=alive,
                ok=not accepted and alive == 8)


def _faulted_load(c: LocalCluster, rate: float, seconds: float, at_s: float, act) -> tuple[dict, float]:
    """The legit load from this process with ``act()`` run at ``at_s`` into it (the sender's
    tick): its figures with per-request samples, and when ``act`` ran (the samples' clock)."""
    done: dict[str, float] = {}

    def on_tick(t_us: float) -> None:
        if t_us >= at_s * 1e6 and not done:
            done["t"] = t_us / 1e6
            act()

    r = asyncio.run(run_load(c.client_endpoint, {"tiny": rate}, seconds, frame_bytes=64, check_echo=True,
                             on_tick=on_tick, keep_samples=True))
    return r, done.get("t", at_s)


def _fault_row(case: str, r: dict, t: float, **extra) -> dict:
    rec = recovery_after(r["samples"], t)
    tot = r["total"]
    return {"case": case, "at_s": round(t, 3), "sent": tot["sent"], "no_reply": tot["no_reply"],
            "bad_echo": tot["bad_echo"], "attainment": tot["attainment"],
            "worst_window_attainment": rec["worst_window_attainment"], "recovery_s": rec["recovery_s"],
            "drop_reasons": r["models"][0]["drop_reasons"], "reject_reasons": r["models"][0]["reject_reasons"],
            **extra}


def executor_fault(args, kind: str) -> dict:
    rate = args.rate / 2  # the surviving half of each pool carries it
    with short_tmpdir("ppiped-faults-") as d, _cluster(Path(d)) as c:
        def act() -> None:
            if kind == "kill":
                c.kill_executor(1)
            else:
                os.kill(c.executors[1].pid, signal.SIGSTOP)
                threading.Timer(2.0, os.kill, (c.executors[1].pid, signal.SIGCONT)).start()

        r, t = _faulted_load(c, rate, args.seconds + 3.0, 1.5, act)
        st = c.status()
        row = _fault_row(f"executor-{kind}", r, t, rate_rps=rate,
                         executors_lost=st["counters"].get("executors_lost", 0),
                         batches_lost=st["counters"].get("batches_lost", 0))
        return emit(**row, ok=row["no_reply"] == 0 and row["bad_echo"] == 0)


def tcp_ctl_stop(args) -> dict:
    with short_tmpdir("ppiped-faults-") as d, _cluster(Path(d), tcp_ctl=True) as c:
        r = c.ctl("stop")
        time.sleep(0.3)
        alive = c.server.poll() is None
        return emit(case="tcp-ctl-stop", answer=r, daemon_alive=alive,
                    ok=alive and isinstance(r, dict) and "error" in r)


def oversize_payloads(args) -> dict:
    with short_tmpdir("ppiped-faults-") as d, _cluster(Path(d)) as c:
        rss0 = _rss_mb(c.server.pid)
        load = _Load(c, args.rate, args.seconds)
        time.sleep(0.5)
        big = b"\0" * (100 << 20)

        def attack() -> None:
            ctx = zmq.Context()
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(c.client_endpoint)
            s.send_multipart([wire.submit("tiny", 0, [1]), big])
            time.sleep(2.0)
            ctx.destroy(0)

        ts = [threading.Thread(target=attack) for _ in range(10)]
        peak = rss0
        for t in ts:
            t.start()
        while any(t.is_alive() for t in ts):
            peak = max(peak, _rss_mb(c.server.pid))
            time.sleep(0.05)
        load = load.result()
        growth = peak - rss0
        att = load.get("attainment", 0.0)
        return emit(case="oversize-payloads", rss_before_mb=round(rss0, 1), rss_peak_mb=round(peak, 1),
                    growth_mb=round(growth, 1), legit_attainment=att, legit_no_reply=load.get("no_reply"),
                    ok=growth <= 64 and att >= 0.99 and load.get("no_reply", 1) == 0)


def daemon_restart(args) -> dict:
    with short_tmpdir("ppiped-faults-") as d:
        c = _cluster(Path(d))
        try:
            c.start()

            async def go() -> dict:
                async with AsyncClient(c.client_endpoint, timeout_s=30) as ac:
                    await ac.submit("tiny", b"warm", slo_ms=5000)
                    outs, waited = await c.restart_with_pending(ac, 100, "tiny")
                    reasons: dict[str, int] = {}
                    for o in outs:
                        k = o.reason if isinstance(o, Dropped) else type(o).__name__
                        reasons[k] = reasons.get(k, 0) + 1
                    t1 = time.monotonic()
                    while True:  # back in service: a request served again
                        try:
                            await ac.submit("tiny", b"after", slo_ms=2000)
                            break
                        except Dropped:
                            await asyncio.sleep(0.05)
                    return {"pending": len(outs), "reasons": reasons, "ended_within_s": round(waited, 2),
                            "served_again_after_s": round(waited + time.monotonic() - t1, 2)}

            r = asyncio.run(go())
        finally:
            c.stop()
        # Served by the new scheduler (the request was still in the socket) or ended with a reason:
        # both are answers; anything else (a timeout) is silent.
        answered = sum(v for k, v in r["reasons"].items()
                       if k in (wire.DAEMON_RESTARTED, wire.DAEMON_UNREACHABLE, "Result"))
    with short_tmpdir("ppiped-faults-") as d, _cluster(Path(d)) as c:
        lr, t = _faulted_load(c, args.rate, args.seconds + 3.0, 1.5, c.restart_server)
    load = _fault_row("daemon-restart", lr, t)
    return emit(case="daemon-restart", **r, silent=r["pending"] - answered,
                under_load={k: v for k, v in load.items() if k != "case"},
                ok=answered == r["pending"] and load["no_reply"] == 0 and load["bad_echo"] == 0
                and load["recovery_s"] <= 3.0)


def flood_child(endpoint: str, n: int, slo_ms: float, timeout_s: float) -> dict:
    """The flooder: ``n`` one-request SUBMITs pushed as fast as the socket takes them (no pacing,
    no sent_us: an attacker's client), then every reply collected; one JSON line of outcomes."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 0)
    s.setsockopt(zmq.RCVHWM, 0)
    s.connect(endpoint)
    frame = b"f" * 64
    sent_at = [0.0] * n
    outcome: dict[str, int] = {}
    in_slo = got = 0
    seen = bytearray(n)

    def take(m: list) -> None:
        nonlocal in_slo, got
        h = wire.decode(m[0])
        key = "ok" if h.status == wire.Status.OK else f"{wire.Status(h.status).name.lower()}:{h.reason}"
        outcome[key] = outcome.get(key, 0) + len(h.ids)
        got += len(h.ids)
        for i in h.ids:
            seen[i] += 1
        if h.status == wire.Status.OK:
            t = time.monotonic()
            in_slo += sum(1 for i in h.ids if t - sent_at[i] <= slo_ms / 1000)

    t0 = time.monotonic()
    for i in range(n):
        sent_at[i] = time.monotonic()
        s.send_multipart([wire.submit("tiny", 0, [i]), frame])
        if i & 255 == 0:
            while s.poll(0):
                take(s.recv_multipart())
    send_s = time.monotonic() - t0
    end = time.monotonic() + timeout_s
    while got < n and time.monotonic() < end:
        if s.poll(100):
            take(s.recv_multipart())
    ctx.destroy(0)
    missing = [i for i in range(n) if not seen[i]]
    return {"t0_monotonic": round(t0, 3), "sent": n, "missing_ids": [missing[:5], missing[-5:]], "answered_twice": sum(1 for x in seen if x > 1), "send_s": round(send_s, 2), "answered": got, "no_reply": n - got,
            "ok_in_slo": in_slo, "outcomes": outcome, "answered_within_s": round(time.monotonic() - t0, 2)}


def flood(args) -> dict:
    with short_tmpdir("ppiped-faults-") as d, _cluster(Path(d)) as c:
        k = args.legit_clients
        cpu0 = c.status()["cpu_s"]
        loads = [_Load(c, args.rate / k, args.seconds, seed=i) for i in range(k)]
        time.sleep(0.5)  # the load is running
        # at nice 19: a remote flooder would not take this host's CPUs from the daemon, its
        # executors and the legit clients (on a 2-core VM it otherwise starves them all)
        f = subprocess.Popen([sys.executable, __file__, "--flood-child", c.client_endpoint, str(args.flood)],
                             stdout=subprocess.PIPE, text=True,
                             preexec_fn=lambda: os.nice(args.flood_nice))
        legit = [x.result() for x in loads]
        out, _ = f.communicate(timeout=120)
        try:
            fl = json.loads(out.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            fl = {"no_reply": -1}
        st = c.status()
        atts = [x.get("attainment", 0.0) for x in legit]
        if fl.get("no_reply"):
            print(c.tail("serve.log", 30), file=sys.stderr)
        return emit(case="flood", legit_attainment=atts, legit_min=min(atts),
                    legit_no_reply=sum(x.get("no_reply", 1) for x in legit),
                    legit_outcomes=[{"sent": x.get("sent"), "drop": x.get("drop_reasons"),
                                     "reject": x.get("reject_reasons"), "p50_ms": x.get("p50_ms"),
                                     "p99_ms": x.get("p99_ms")} for x in legit],
                    flooder=fl, daemon_cpu_s=round(st["cpu_s"] - cpu0, 2), daemon_queued=st["queued"], daemon_in_flight=st["models"]["tiny"]["in_flight"],
                    daemon_counters={k: v for k, v in st["counters"].items()
                                                 if k.startswith(("shed", "overloaded", "late"))},
                    ok=min(atts) >= 0.99 and fl.get("no_reply", 1) == 0
                    and all(x.get("no_reply", 1) == 0 for x in legit))


RUN = {"forged-results": forged_results, "forward-injection": forward_injection,
       "unauthorized-register": unauthorized_register, "tcp-ctl-stop": tcp_ctl_stop,
       "oversize-payloads": oversize_payloads, "daemon-restart": daemon_restart,
       "executor-kill": lambda a: executor_fault(a, "kill"), "executor-stop": lambda a: executor_fault(a, "stop"),
       "flood": flood}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rate", type=float, default=2000.0, help="legit requests/s alongside")
    ap.add_argument("--seconds", type=float, default=5.0, help="attack duration")
    ap.add_argument("--only", help=f"comma-separated cases ({', '.join(CASES)})")
    ap.add_argument("--flood", type=int, default=100_000, help="flood: SUBMITs the flooder sends")
    ap.add_argument("--legit-clients", type=int, default=2, help="flood: loadgen processes sharing --rate")
    ap.add_argument("--flood-nice", type=int, default=19,
                    help="flood, forward-injection: the attacking process's niceness")
    ap.add_argument("--flood-child", nargs=2, metavar=("ENDPOINT", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--forward-child", nargs=2, metavar=("DIRECTORY", "SECONDS"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.flood_child:
        emit(**flood_child(args.flood_child[0], int(args.flood_child[1]), 60.0, 60.0))
        return 0
    if args.forward_child:
        directory = {int(v): ep for v, ep in json.loads(args.forward_child[0]).items()}
        emit(**forward_child(directory, float(args.forward_child[1])))
        return 0
    cases = args.only.split(",") if args.only else list(CASES)
    bad = [k for k in cases if k not in RUN]
    if bad:
        ap.error(f"unknown case(s) {bad}; choose from {CASES}")
    rows = [RUN[k](args) for k in cases]
    missed = [r["case"] for r in rows if not r["ok"]]
    emit(summary=True, cases=len(rows), missed=missed)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
