"""Prometheus metrics: text exposition format over a tiny HTTP responder on the daemon's loop.

The figures are read from the server's own counters when scraped, so serving pays nothing for
them except the dispatch-decision histogram (a bisect per decision) and the reservation-error sum.
No dependency: a scrape is one short GET, answered by an ``asyncio`` stream handler.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
from typing import TYPE_CHECKING, Any

from .loop import ConnectionCap, now_us

if TYPE_CHECKING:
    from .server import Server

# Scrapes served at once, and the seconds one may take in all (a scrape is one short GET).
MAX_CONNECTIONS = 16
REQUEST_S = 10.0
# dispatch-decision latency buckets, seconds (a decision should take microseconds)
DECIDE_BUCKETS_S = (5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2)


class Histogram:
    """Cumulative-bucket histogram; ``observe`` is a bisect and two additions."""

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.sum = 0.0
        self.n = 0

    def observe(self, x: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, x)] += 1
        self.sum += x
        self.n += 1

    def lines(self, name: str) -> list[str]:
        out, acc = [], 0
        for b, c in zip(self.bounds, self.counts):  # noqa: B905 - counts has one more (+Inf)
            acc += c
            out.append(f'{name}_bucket{{le="{b:g}"}} {acc}')
        out.append(f'{name}_bucket{{le="+Inf"}} {self.n}')
        out.append(f"{name}_sum {self.sum:.9g}")
        out.append(f"{name}_count {self.n}")
        return out


class Metrics:
    """What the server records for metrics beyond its own counters."""

    def __init__(self) -> None:
        self.decide = Histogram(DECIDE_BUCKETS_S)
        self.res_err_sum_s = 0.0  # |actual end - reserved end| of a batch's last hop
        self.res_err_n = 0
        self.replan_s = 0.0
        self.replans: dict[str, int] = {}
        self.pause_s = 0.0

    def reservation_error(self, err_us: float) -> None:
        self.res_err_sum_s += abs(err_us) / 1e6
        self.res_err_n += 1


def _esc(v: Any) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**kw: Any) -> str:
    return "{" + ",".join(f'{k}="{_esc(v)}"' for k, v in kw.items()) + "}"


def render(srv: Server) -> str:
    """The exposition text for one scrape."""
    m = srv.metrics
    lines: list[str] = []

    def head(name: str, kind: str, help_: str) -> None:
        lines.append(f"# HELP {name} {help_}")
        lines.append(f"# TYPE {name} {kind}")

    names = srv.model_names
    every = srv.all_stats()  # counters: removed models' too, so none decreases or vanishes
    head("ppiped_requests_total", "counter", "Requests accepted into the queue.")
    for n, s in every:
        lines.append(f"ppiped_requests_total{_labels(model=n)} {s.accepted}")
    head("ppiped_replies_total", "counter", "Replies sent, by outcome (ok, dropped, rejected).")
    for n, s in every:
        for outcome, v in (("ok", s.ok), ("dropped", sum(s.dropped.values())),
                           ("rejected", sum(s.rejected.values()))):
            lines.append(f"ppiped_replies_total{_labels(model=n, outcome=outcome)} {v}")
    if srv.unowned_rejects:  # requests no model owns: unknown model, malformed message
        lines.append(f"ppiped_replies_total{_labels(model='-', outcome='rejected')} {sum(srv.unowned_rejects.values())}")
    head("ppiped_drops_total", "counter", "Requests dropped, by reason.")
    for n, s in every:
        for reason, v in sorted(s.dropped.items()):
            lines.append(f"ppiped_drops_total{_labels(model=n, reason=reason)} {v}")
    head("ppiped_rejects_total", "counter", "Requests rejected at admission, by reason.")
    for n, s in every:
        for reason, v in sorted(s.rejected.items()):
            lines.append(f"ppiped_rejects_total{_labels(model=n, reason=reason)} {v}")
    for reason, v in sorted(srv.unowned_rejects.items()):
        lines.append(f"ppiped_rejects_total{_labels(model='-', reason=reason)} {v}")
    head("ppiped_late_total", "counter", "Requests answered ok after their deadline (counted in ok too).")
    for n, s in every:
        lines.append(f"ppiped_late_total{_labels(model=n)} {s.ok_late}")
    head("ppiped_attainment_ratio", "gauge", "Share of answered requests served within the SLO.")
    for i, n in enumerate(names):
        s = srv.stats[i]
        answered = s.ok + sum(s.dropped.values())
        good = s.ok - s.ok_late
        lines.append(f"ppiped_attainment_ratio{_labels(model=n)} {good / answered if answered else 1.0:.6g}")
    head("ppiped_gpu_seconds_total", "counter",
         "Measured GPU time of answered requests, by whether it was useful (valid) or spent on "
         "requests answered late or failed after starting (invalid).")
    for n, s in every:
        lines.append(f"ppiped_gpu_seconds_total{_labels(model=n, use='valid')} {(s.gpu_us - s.invalid_us) / 1e6:.6g}")
        lines.append(f"ppiped_gpu_seconds_total{_labels(model=n, use='invalid')} {s.invalid_us / 1e6:.6g}")
    head("ppiped_class_requests_total", "counter", "High priority class: accepted, ok within the SLO, dropped.")
    for n, s in every:
        for outcome, v in zip(("accepted", "ok", "dropped"), s.high, strict=True):
            lines.append(f"ppiped_class_requests_total{_labels(model=n, priority='high', outcome=outcome)} {v}")
    head("ppiped_arrival_rate_rps", "gauge", "Measured arrival rate (EWMA), requests per second.")
    for i, n in enumerate(names):
        lines.append(f"ppiped_arrival_rate_rps{_labels(model=n)} {srv.rates.rates[i]:.6g}")
    head("ppiped_in_flight", "gauge", "Requests accepted and not yet answered.")
    for i, n in enumerate(names):
        lines.append(f"ppiped_in_flight{_labels(model=n)} {srv.stats[i].accepted - srv.stats[i].answered}")
    head("ppiped_admission_window", "gauge",
         "Most requests in flight before new ones are refused overloaded (+Inf: executors keep up).")
    for i, n in enumerate(names):
        lines.append(f"ppiped_admission_window{_labels(model=n)} {srv.stats[i].limit:.6g}")
    head("ppiped_queue_depth", "gauge", "Requests waiting in the scheduler's queue.")
    for i, n in enumerate(names):
        lines.append(f"ppiped_queue_depth{_labels(model=n)} {srv.core.pending(i)}")
    _app_lines(srv, head, lines)
    head("ppiped_dispatch_decision_seconds", "histogram", "Time of one scheduling decision (core.decide).")
    lines.extend(m.decide.lines("ppiped_dispatch_decision_seconds"))
    head("ppiped_vgpu_busy_ratio", "gauge", "Share of time each vGPU ran batches since the plan took effect.")
    lay = srv.layout
    span = max(1, now_us() - srv.plan_since)
    for v in range(srv.nv):
        g = lay.pool_gpu[int(lay.v_pool[v])]
        lines.append(f"ppiped_vgpu_busy_ratio{_labels(vgpu=v, gpu=g)} {min(1.0, srv.busy_us[v] / span):.6g}")
    head("ppiped_vgpus_alive", "gauge", "vGPUs whose executor is ready.")
    alive = sum(1 for v in range(srv.nv) if (e := srv.vgpu_exec[v]) is not None and e.ready)
    lines.append(f"ppiped_vgpus_alive {alive}")
    head("ppiped_peer_unreachable_total", "counter",
         "Batches an executor could not forward to their next vGPU (no endpoint or no connection).")
    lines.append(f"ppiped_peer_unreachable_total {srv.counters.get('peer_unreachable', 0)}")
    head("ppiped_handler_errors_total", "counter",
         "Messages whose socket handler raised (a bug: the message is lost, the socket serves on).")
    lines.append(f"ppiped_handler_errors_total {srv.handler_errors}")
    head("ppiped_reservation_error_seconds", "summary", "|actual - reserved| end of each batch's last hop.")
    lines.append(f"ppiped_reservation_error_seconds_sum {m.res_err_sum_s:.9g}")
    lines.append(f"ppiped_reservation_error_seconds_count {m.res_err_n}")
    head("ppiped_plan_version", "gauge", "Version of the plan in force (1 at start, +1 per migration).")
    lines.append(f"ppiped_plan_version {srv.plan_version}")
    head("ppiped_replan_duration_seconds", "gauge", "Duration of the last replan (planning and migration).")
    lines.append(f"ppiped_replan_duration_seconds {m.replan_s:.6g}")
    head("ppiped_replan_pause_seconds", "gauge", "Dispatching pause of the last migration.")
    lines.append(f"ppiped_replan_pause_seconds {m.pause_s:.6g}")
    head("ppiped_replans_total", "counter", "Replans, by result.")
    for r, v in sorted(m.replans.items()):
        lines.append(f"ppiped_replans_total{_labels(result=r)} {v}")
    return "\n".join(lines) + "\n"


def _app_lines(srv: Server, head: Any, lines: list[str]) -> None:
    """Per app (multi-model queries): queries by outcome, drops by stage and reason, GPU time."""
    stats = srv.queries.stats
    if not stats:
        return
    head("ppiped_app_queries_total", "counter",
         "Queries by outcome: offered, accepted, ok, late (ok after the deadline), rejected.")
    for a, s in stats.items():
        for outcome, v in (("offered", s.offered), ("accepted", s.accepted), ("ok", s.ok), ("late", s.ok_late),
                           ("rejected", sum(s.rejected.values()))):
            lines.append(f"ppiped_app_queries_total{_labels(app=a, outcome=outcome)} {v}")
    head("ppiped_app_drops_total", "counter", "Queries that failed, by the stage they failed at and why.")
    for a, s in stats.items():
        for stage, d in s.dropped.items():
            for reason, v in sorted(d.items()):
                lines.append(f"ppiped_app_drops_total{_labels(app=a, stage=stage, reason=reason)} {v}")
    head("ppiped_app_stage_requests_total", "counter", "Stage requests submitted, by stage.")
    for a, s in stats.items():
        for stage, v in s.stage_requests.items():
            lines.append(f"ppiped_app_stage_requests_total{_labels(app=a, stage=stage)} {v}")
    head("ppiped_app_gpu_seconds_total", "counter",
         "GPU time of the apps' stage requests: valid, or spent on queries that failed or were late.")
    for a, s in stats.items():
        lines.append(f"ppiped_app_gpu_seconds_total{_labels(app=a, use='valid')} {(s.gpu_us - s.invalid_us) / 1e6:.6g}")
        lines.append(f"ppiped_app_gpu_seconds_total{_labels(app=a, use='invalid')} {s.invalid_us / 1e6:.6g}")


class MetricsServer:
    """``GET /metrics`` on host:port; anything else is 404. Runs on the daemon's event loop."""

    def __init__(self, srv: Server, host: str, port: int) -> None:
        self.srv, self.host, self.port = srv, host, port
        self.server: asyncio.AbstractServer | None = None
        self.cap = ConnectionCap(MAX_CONNECTIONS, REQUEST_S)

    async def start(self) -> None:
        self.server = await asyncio.start_server(self._handle, self.host, self.port)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.cap.admit():  # (closed unread: a scraper retries; a flood holds nothing)
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()
            return
        try:
            await asyncio.wait_for(self._answer(reader, writer), self.cap.seconds)
        except (TimeoutError, asyncio.TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        except asyncio.CancelledError:  # shutdown mid-scrape: end quietly (see CtlServer._handle)
            pass
        finally:
            self.cap.release()
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One request, headers read and ignored, one answer."""
        try:
            line = await reader.readline()
            for _ in range(100):
                if await reader.readline() in (b"\r\n", b"\n", b""):
                    break
        except ValueError:  # a line past the stream's limit (64 KiB): asyncio raises, not returns
            writer.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Length: 0\r\n"
                         b"Connection: close\r\n\r\n")
            await writer.drain()
            return
        parts = line.decode("latin-1").split()
        if len(parts) >= 2 and parts[0] == "GET" and parts[1].split("?")[0] in ("/metrics", "/"):
            body = render(self.srv).encode()
            status, ctype = "200 OK", "text/plain; version=0.0.4; charset=utf-8"
        else:
            body, status, ctype = b"not found: try GET /metrics\n", "404 Not Found", "text/plain"
        writer.write(f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                     "Connection: close\r\n\r\n".encode() + body)
        await writer.drain()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
