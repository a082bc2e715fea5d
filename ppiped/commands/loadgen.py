"""``ppiped loadgen``: open-loop Poisson or bursty load; attainment and latency as the client sees them.

Arrival times come from :mod:`ppiped.sim.workload` (the same generators the simulator uses).
Requests due in the same event-loop turn leave in one message per model, so one client process
offers tens of thousands of requests per second. Latency is measured from the moment a request
is handed to the socket to the moment its reply is read; a request *attains* its SLO when it is
answered OK within the SLO. Requests never answered within the SLO plus ``--grace-s`` count as
``no-reply`` (the scheduler promises one reply per request, so this should stay zero).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from ..client import AsyncClient
from ..daemon.loop import Timers, now_us
from ..errors import InputError
from ..sim.workload import generate
from ..wire import Status
from .argtypes import (
    CV,
    MAX_FRAME_BYTES,
    MAX_LOADGEN_REQUESTS,
    POSITIVE,
    SEED,
    CommandFailed,
    check_request_count,
    client_endpoint,
    integer,
    trace_kind,
)


@dataclass
class ModelLoad:
    model: str
    rate_rps: float
    slo_ms: float
    sent: int = 0
    ok: int = 0
    attained: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    rejected: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    no_reply: int = 0
    lat_ms: list[float] = field(default_factory=list)
    reject_lat_ms: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    bad_echo: int = 0

    def summary(self, duration_s: float) -> dict[str, Any]:
        lat = np.asarray(self.lat_ms) if self.lat_ms else np.zeros(1)
        pct = np.percentile(lat, [50, 90, 99]) if self.lat_ms else [math.nan] * 3
        return {
            "model": self.model, "offered_rps": self.rate_rps, "sent": self.sent,
            "sent_rps": self.sent / duration_s if duration_s > 0 else 0.0, "slo_ms": self.slo_ms,
            "ok": self.ok, "attained": self.attained,
            "attainment": self.attained / self.sent if self.sent else math.nan,
            "dropped": sum(self.dropped.values()), "drop_reasons": dict(self.dropped),
            "rejected": sum(self.rejected.values()), "reject_reasons": dict(self.rejected),
            # how fast a refusal comes back (send to reply), by reason: an overloaded daemon must
            # say so at once, not after the SLO
            "reject_latency_ms": {k: _pcts(v) for k, v in self.reject_lat_ms.items()},
            "no_reply": self.no_reply, "bad_echo": self.bad_echo,
            "p50_ms": float(pct[0]), "p90_ms": float(pct[1]), "p99_ms": float(pct[2]),
            "max_ms": float(lat.max()) if self.lat_ms else math.nan,
        }


def _pcts(lat_ms: list[float]) -> dict[str, float]:
    p50, p99 = np.percentile(lat_ms, [50, 99])
    return {"p50": float(p50), "p99": float(p99), "max": float(max(lat_ms))}


def _frame(rng: np.random.Generator, n: int, dtype: str | None) -> bytes:
    """``n`` bytes of input: for a float model, values in [0, 1) as an image's pixels are (random
    bytes read as floats hold NaNs, infinities and denormals, which real frames never do and
    which make CPU inference many times slower)."""
    try:
        dt = np.dtype(dtype) if dtype else None
    except TypeError:
        dt = None
    if dt is None or dt.kind != "f" or n % dt.itemsize:
        return rng.integers(0, 256, n, dtype=np.uint8).tobytes()
    return rng.random(n // dt.itemsize).astype(dt).tobytes()


async def run_load(endpoint: str, rates: dict[str, float], duration_s: float, *, kind: str = "poisson",
                   seed: int = 0, frame_bytes: int | None = None, slo_ms: dict[str, float] | None = None,
                   grace_s: float = 2.0, check_echo: bool = False, cv: float = 2.0,
                   on_tick: Any = None, keep_samples: bool = False, tick_us: int = 250,
                   key_file: str | None = None, server_key_file: str | None = None) -> dict[str, Any]:
    """Offer ``rates`` (req/s per model) for ``duration_s``; return per-model and total figures.

    ``keep_samples``: also return ``samples``, per request (send time in s from the start,
    attained 0/1), for time series such as recovery after a failure. ``tick_us``: the sender wakes
    at most this often and sends everything due in one message per model (arrivals move by less
    than a tick; latency counts from the actual send). ``key_file``/``server_key_file``: CURVE,
    as :class:`ppiped.client.AsyncClient` takes them."""
    models = list(rates)
    trace = generate(kind, [rates[m] for m in models], duration_s, seed, cv=cv)
    async with AsyncClient(endpoint, timeout_s=None, key_file=key_file,
                           server_key_file=server_key_file) as client:
        info = await client.info(timeout_s=10.0)
        served = info.get("models", {})
        for m in models:
            if m not in served:
                raise InputError(f"model {m!r} is not served by {endpoint} (it serves "
                                 f"{', '.join(served) or 'nothing'})")
        loads = {m: ModelLoad(m, rates[m], (slo_ms or {}).get(m) or served[m]["slo_ms"]) for m in models}
        rng = np.random.default_rng(seed + 1)
        frames = {}
        for m in models:
            n = frame_bytes if frame_bytes is not None else (served[m].get("input_bytes") or 1024)
            frames[m] = [_frame(rng, n, (served[m].get("input") or {}).get("dtype")) for _ in range(64)]
        per_req_slo = {m: (slo_ms or {}).get(m) for m in models}
        sent_at: dict[int, tuple[ModelLoad, int, bytes]] = {}
        samples: list[tuple[int, int]] = []

        def on_reply(rid: int, status: int, reason: str, frame: Any, meta: Any) -> None:
            t = now_us()
            ml, t0, payload = sent_at.pop(rid)
            hit = 0
            if status == Status.OK:
                lat = (t - t0) / 1000
                ml.ok += 1
                ml.lat_ms.append(lat)
                if lat <= ml.slo_ms:
                    ml.attained += 1
                    hit = 1
                if check_echo and frame is not None and bytes(frame.buffer) != payload:
                    ml.bad_echo += 1
            elif status == Status.REJECTED:
                ml.rejected[reason] += 1
                ml.reject_lat_ms[reason].append((t - t0) / 1000)
            else:
                ml.dropped[reason] += 1
            if keep_samples:
                samples.append((t0 - start, hit))

        loop = asyncio.get_running_loop()
        timers = Timers(loop)
        done = loop.create_future()
        times = trace.times_us
        which = trace.model
        n = len(times)
        idx = 0
        start = now_us() + 20_000

        def tick() -> None:
            nonlocal idx
            t = now_us() - start
            while idx < n and times[idx] <= t:
                m = models[which[idx]]
                ml = loads[m]
                payload = frames[m][idx & 63]
                rid = client.submit_cb(m, payload, per_req_slo[m], on_reply)
                sent_at[rid] = (ml, now_us(), payload)
                ml.sent += 1
                idx += 1
            if idx < n:
                timers.call_at(max(start + int(times[idx]), now_us() + tick_us), tick)
            elif not done.done():
                done.set_result(None)
            if on_tick is not None:
                on_tick(t)

        timers.call_at(start, tick)
        await done
        sent_all = now_us()
        max_slo = max(ml.slo_ms for ml in loads.values())
        deadline = sent_all + int((max_slo / 1000 + grace_s) * 1e6)
        while sent_at and now_us() < deadline:
            await asyncio.sleep(0.01)
        for ml, t0, _ in sent_at.values():
            ml.no_reply += 1
            if keep_samples:
                samples.append((t0 - start, 0))
        timers.close()
    elapsed = duration_s
    per = [loads[m].summary(elapsed) for m in models]
    sent = sum(p["sent"] for p in per)
    attained = sum(p["attained"] for p in per)
    all_lat = np.concatenate([np.asarray(loads[m].lat_ms) for m in models]) if sent else np.zeros(0)
    total = {
        "sent": sent, "ok": sum(p["ok"] for p in per), "attained": attained,
        "attainment": attained / sent if sent else math.nan,
        "dropped": sum(p["dropped"] for p in per), "rejected": sum(p["rejected"] for p in per),
        "no_reply": sum(p["no_reply"] for p in per), "bad_echo": sum(p["bad_echo"] for p in per),
        "p50_ms": float(np.percentile(all_lat, 50)) if len(all_lat) else math.nan,
        "p99_ms": float(np.percentile(all_lat, 99)) if len(all_lat) else math.nan,
        "sent_rps": sent / elapsed if elapsed > 0 else 0.0,
    }
    out = {"duration_s": duration_s, "kind": kind, "models": per, "total": total}
    if keep_samples:
        samples.sort()
        out["samples"] = [(t / 1e6, hit) for t, hit in samples]
    return out


def recovery_after(samples: list[tuple[float, int]], t_event: float, window_s: float = 0.25,
                   horizon_s: float = 3.0) -> dict[str, Any]:
    """After an event at ``t_event`` (s, the samples' clock): attainment per ``window_s`` of send
    time, the worst window within ``horizon_s`` after the event, and the recovery time: from the
    event to the end of the last window within the horizon below 99 % (0: none was)."""
    windows: dict[int, list[int]] = {}
    for t, hit in samples:
        windows.setdefault(int(t // window_s), []).append(hit)
    series = [(round(k * window_s, 3), sum(v) / len(v)) for k, v in sorted(windows.items())]
    after = [(t, a) for t, a in series if t + window_s > t_event and t < t_event + horizon_s]
    bad = [t for t, a in after if a < 0.99]
    return {"recovery_s": round(max(0.0, bad[-1] + window_s - t_event) if bad else 0.0, 3),
            "worst_window_attainment": min((a for _, a in after), default=1.0),
            "series": [(t, round(a, 4)) for t, a in series]}


def format_report(r: dict[str, Any]) -> str:
    rows = [("model", "offered/s", "sent", "attain", "ok", "dropped", "rejected", "no-reply", "p50 ms",
             "p99 ms", "slo ms")]
    for p in r["models"]:
        rows.append((p["model"][:32], f"{p['offered_rps']:.1f}", str(p["sent"]), f"{100 * p['attainment']:.2f}%",
                     str(p["ok"]), str(p["dropped"]), str(p["rejected"]), str(p["no_reply"]),
                     f"{p['p50_ms']:.2f}", f"{p['p99_ms']:.2f}", f"{p['slo_ms']:.1f}"))
    t = r["total"]
    rows.append(("total", "", str(t["sent"]), f"{100 * t['attainment']:.2f}%", str(t["ok"]), str(t["dropped"]),
                 str(t["rejected"]), str(t["no_reply"]), f"{t['p50_ms']:.2f}", f"{t['p99_ms']:.2f}", ""))
    w = [max(len(x[i]) for x in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.rjust(wi) if i else c.ljust(wi) for i, (c, wi) in enumerate(zip(x, w, strict=True)))
             for x in rows]
    lines.insert(1, "  ".join("-" * wi for wi in w))
    reasons = defaultdict(int)
    for p in r["models"]:
        for k, v in {**p["drop_reasons"], **{f"rejected:{a}": b for a, b in p["reject_reasons"].items()}}.items():
            reasons[k] += v
    if reasons:
        lines.append("drops/rejects by reason: " + ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())))
    return "\n".join(lines)


def parse_rates(items: list[str]) -> dict[str, float]:
    out = {}
    for item in items:
        m, sep, r = item.rpartition("=")
        if not sep or not m:
            raise InputError(f"--rate: expected MODEL=REQ_PER_S, got {item!r}")
        if m in out:
            raise InputError(f"--rate: model {m!r} is given twice")
        try:
            out[m] = float(r)
        except ValueError:
            raise InputError(f"--rate {item!r}: {r!r} is not a number") from None
        if not (out[m] > 0 and math.isfinite(out[m])):
            raise InputError(f"--rate {item!r}: the rate must be a finite number > 0 (req/s)")
    if not out:
        raise InputError("--rate: give at least one MODEL=REQ_PER_S")
    return out


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadgen", help="drive a running scheduler with Poisson or bursty load; print attainment")
    p.add_argument("--endpoint", type=client_endpoint, default="tcp://127.0.0.1:5555", help="scheduler client endpoint")
    p.add_argument("--rate", action="append", required=True, metavar="MODEL=RPS",
                   help="offered load per model (repeatable)")
    p.add_argument("--duration", type=POSITIVE, default=10.0, help="seconds of load (default 10)")
    p.add_argument("--arrivals", type=trace_kind, default="poisson", help="poisson, bursty, or an Azure Functions trace CSV")
    p.add_argument("--cv", type=CV, default=2.0, help="bursty: coefficient of variation of the gaps (default 2)")
    p.add_argument("--seed", type=SEED, default=0)
    p.add_argument("--frame-bytes", type=integer(1, MAX_FRAME_BYTES), help="payload size (default: the model's input size, else 1 KiB)")
    p.add_argument("--slo-ms", type=POSITIVE, help="per-request SLO (default: each model's)")
    p.add_argument("--check-echo", action="store_true", help="emulated executors: replies must echo the frame")
    p.add_argument("--json", action="store_true")
    p.add_argument("--key", help="CURVE: this client's secret key file (`ppiped keys`)")
    p.add_argument("--server-key", help="CURVE: the scheduler's public key file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import uvloop

    rates = parse_rates(args.rate)  # every input is checked before connecting
    total = sum(rates.values())
    check_request_count(total * args.duration, f"--rate (in all {total:.6g} req/s) for --duration "
                        f"{args.duration:g} s", MAX_LOADGEN_REQUESTS)
    slo = {m: args.slo_ms for m in rates} if args.slo_ms else None
    try:
        r = uvloop.run(run_load(args.endpoint, rates, args.duration, kind=args.arrivals, seed=args.seed,
                                frame_bytes=args.frame_bytes, slo_ms=slo, check_echo=args.check_echo,
                                cv=args.cv, key_file=args.key, server_key_file=args.server_key))
    except TimeoutError as e:
        raise CommandFailed(f"{e} (is `ppiped serve` running there?)") from None
    except zmq.ZMQError as e:
        raise CommandFailed(f"{args.endpoint}: {e}") from None
    if args.json:
        print(json.dumps(r))
    else:
        print(format_report(r))
    sys.stdout.flush()
    return 0 if r["total"]["no_reply"] == 0 else 1
