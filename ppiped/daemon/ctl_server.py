"""The ``ppiped-ctl`` endpoint: newline-delimited JSON over a unix socket, on the daemon's loop.

A request is one line ``{"cmd": "status", ...}``; the answer is one line, ``{"ok": true, ...}``
or ``{"ok": false, "error": "..."}``. Access control is the file system's: the socket is created
with mode ``ctl.mode`` (0660) and, if ``ctl.group`` is set, that group, so operators are granted
access by group membership rather than by a password.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import json
import os
import socket
import stat
import time
from typing import TYPE_CHECKING, Any

from .. import logs, wire
from ..errors import InputError
from ..plan import check_weights, format_plan_table, load_plan
from .config import ConfigError, format_ranges
from .loop import ConnectionCap, now_us
from .replan import missing_vgpus, placeable

if TYPE_CHECKING:
    from .server import Server

log = logs.get("ppiped.ctl")

COMMANDS = ("status", "plan", "executors", "drain", "replan")
MAX_LINE = 1 << 20
MAX_CONNECTIONS = 64  # ctl connections open at once
IDLE_S = 120.0  # the longest wait for a request line (each answer restarts it)


MAX_PLAN_FILE_BYTES = 64 << 20  # plans are KB to a few MB; a FIFO, /dev/zero or a huge file is refused


class CtlServer:
    def __init__(self, srv: Server, path: str, mode: int = 0o660, group: str = "") -> None:
        self.srv, self.path, self.mode, self.group = srv, path, mode, group
        self.server: asyncio.AbstractServer | None = None
        self.cap = ConnectionCap(MAX_CONNECTIONS, IDLE_S)

    @staticmethod
    def group_id(group: str, source: str) -> int:
        """The gid of ``ctl.group`` (-1: unset); checked before the daemon binds anything."""
        if not group:
            return -1
        try:
            return grp.getgrnam(group).gr_gid
        except KeyError:
            raise ConfigError(f"{source}: ctl.group: no group named {group!r}") from None

    async def start(self) -> None:
        gid = self.group_id(self.group, self.srv.cfg.source)
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        if os.path.exists(self.path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
                raise ConfigError(f"{self.srv.cfg.source}: ctl.socket: another ppiped listens on {self.path}")
            except OSError:
                os.unlink(self.path)  # a stale socket of a daemon that died
            finally:
                probe.close()
        old = os.umask(0o777 & ~self.mode)  # never a moment with wider permissions than asked
        try:
            self.server = await asyncio.start_unix_server(self._handle, self.path, limit=MAX_LINE)
        finally:
            os.umask(old)
        os.chmod(self.path, self.mode)
        if gid >= 0:
            os.chown(self.path, -1, gid)
        log.info("ctl-listening", path=self.path, mode=oct(self.mode), group=self.group or "-")

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.server.wait_closed(), 1.0)
            self.server = None
        with contextlib.suppress(OSError):
            os.unlink(self.path)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.cap.admit():
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(json.dumps({"ok": False, "error": f"{self.cap.limit} ctl connections are open "
                                         "already; try again"}).encode() + b"\n")
                writer.close()
            return
        try:
            # (a request line must come within IDLE_S of the previous answer: held connections and
            # lines dripped byte by byte otherwise kept the daemon's descriptors and memory)
            while line := await asyncio.wait_for(reader.readline(), self.cap.seconds):
                try:
                    try:
                        text = line.decode()
                    except UnicodeDecodeError:
                        raise ValueError("the request line is not UTF-8") from None
                    req = json.loads(text)
                    if not isinstance(req, dict):
                        raise ValueError("expected a JSON object")
                    out = await self.command(req)
                except (ValueError, InputError) as e:
                    out = {"ok": False, "error": str(e)}
                except Exception as e:  # noqa: BLE001 - an operator's request never takes the daemon down
                    log.warning("ctl-command-failed", error=f"{type(e).__name__}: {e}")
                    out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
                writer.write(json.dumps(out).encode() + b"\n")
                await writer.drain()
        except ValueError:  # readline's over-long line: one answer, then the connection ends
            with contextlib.suppress(ConnectionError, OSError):
                writer.write(json.dumps({"ok": False, "error": f"request line longer than {MAX_LINE} bytes"})
                             .encode() + b"\n")
                await writer.drain()
        except (ConnectionError, asyncio.LimitOverrunError, asyncio.IncompleteReadError, TimeoutError,
                asyncio.TimeoutError):
            pass
        except asyncio.CancelledError:
            # shutdown with a connection open: end quietly (Python 3.11's stream callback calls
            # task.exception() on a cancelled handler and logs the CancelledError as a crash)
            pass
        finally:
            self.cap.release()
            with contextlib.suppress(ConnectionError, OSError):
                writer.close()

    async def command(self, req: dict[str, Any]) -> dict[str, Any]:
        cmd = req.get("cmd")
        srv = self.srv
        if cmd == "status":
            return {"ok": True, **status(srv)}
        if cmd == "plan":
            return {"ok": True, "version": srv.plan_version, "source": srv.plan.source,
                    "table": format_plan_table(srv.plan)}
        if cmd == "executors":
            return {"ok": True, "executors": executors(srv), "missing": missing(srv)}
        if cmd == "drain":
            return {"ok": True, **await drain(srv, _flag(req, "off"), _seconds(req, "timeout_s", 30.0))}
        if cmd == "replan":
            return await self.replan(req)
        raise InputError(f"unknown command {wire.brief(cmd)} (known: {', '.join(COMMANDS)})")

    async def replan(self, req: dict[str, Any]) -> dict[str, Any]:
        srv = self.srv
        dry, wait = _flag(req, "dry_run"), _flag(req, "wait")  # all refusals before anything starts
        if req.get("weights") is not None and req.get("plan_file"):
            raise InputError("give weights or plan_file, not both (a plan file fixes the mix)")
        w = req.get("weights")
        weights = None
        if w is not None:
            if isinstance(w, dict):
                unknown = sorted(set(w) - set(srv.model_names))
                if unknown:
                    raise InputError(f"weights: unknown model(s) {', '.join(unknown)} "
                                     f"(the daemon serves {', '.join(srv.model_names)})")
                missing = [m for m in srv.model_names if m not in w]
                if missing:
                    raise InputError(f"weights: no weight for model(s) {', '.join(missing)} (give every model "
                                     f"the daemon serves one: {', '.join(srv.model_names)})")
                w = [w[m] for m in srv.model_names]
            weights = check_weights(w, srv.model_names)
        plan = None
        if req.get("plan_file"):  # migrate to a plan made elsewhere (e.g. `ppiped plan`)
            path = req["plan_file"]
            if not isinstance(path, str):
                raise InputError(f"plan_file: expected a path, got {wire.brief(path)}")
            try:
                st = os.stat(path)
            except OSError as e:
                raise InputError(f"plan_file: {path}: {e.strerror or e}") from None
            if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_PLAN_FILE_BYTES:
                raise InputError(f"plan_file: {path}: expected a regular file of at most "
                                 f"{MAX_PLAN_FILE_BYTES >> 20} MiB")
            # read off the loop: serving goes on while a large plan is parsed
            plan = await asyncio.to_thread(load_plan, path, srv.plan.cluster, True)
            if not dry:  # what the switch would refuse is refused here, before "started"
                await asyncio.to_thread(placeable, srv, plan)
        task = srv.replanner.start(weights, dry, "ctl", plan)
        if not (wait or dry):
            return {"ok": True, "started": True, "version": srv.plan_version}
        return await asyncio.shield(task)


def _flag(req: dict[str, Any], key: str) -> bool:
    """A yes/no field: JSON true or false (absent: false). The string "false" is refused, not
    read as true."""
    v = req.get(key, False)
    if not isinstance(v, bool):
        raise InputError(f"{key}: expected true or false, got {wire.brief(v)}")
    return v


MAX_TIMEOUT_S = 86400.0


def _seconds(req: dict[str, Any], key: str, default: float) -> float:
    v = req.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= MAX_TIMEOUT_S:
        raise InputError(f"{key}: expected seconds in [0, {MAX_TIMEOUT_S:g}], got {wire.brief(v)}")
    return float(v)


def status(srv: Server) -> dict[str, Any]:
    """What an operator looks at first: plan version, per-model rate and attainment, queue, executors."""
    models = {}
    up = (now_us() - srv.started) / 1e6
    for i, m in enumerate(srv.model_names):
        s = srv.stats[i]
        dropped = sum(s.dropped.values())
        answered = s.ok + dropped
        models[m] = {"rate_rps": round(srv.rates.rates[i], 2), "weight": srv.plan.model(m).weight,
                     "slo_ms": srv.slo_us[i] / 1000, "accepted": s.accepted, "ok": s.ok, "late": s.ok_late,
                     "dropped": dropped, "rejected": sum(s.rejected.values()),
                     "attainment": (s.ok - s.ok_late) / answered if answered else 1.0,
                     "queued": srv.core.pending(i), **s.outcomes(up)}
    alive = srv.alive_vgpus()
    return {"plan_version": srv.plan_version, "plan": srv.plan.source, "uptime_s": (now_us() - srv.started) / 1e6,
            "state": "holding" if srv.holding else ("draining" if srv.draining else "serving"),
            "models": models, "rejected_no_model": dict(srv.unowned_rejects), "queued": len(srv.reqs),
            "in_flight_batches": sum(1 for b in srv.batches.values() if not b.answered),
            "vgpus": {"total": srv.nv, "alive": alive, "missing": format_ranges(missing_vgpus(srv))},
            "executors": executors(srv), "missing": missing(srv), "apps": srv.queries.status(),
            "replan": {"running": srv.replanner.busy, "auto": srv.cfg.replan_auto, "last": srv.replanner.last,
                       "history": srv.replanner.history, "min_interval_s": srv.cfg.replan_min_interval_s}}


def executors(srv: Server) -> list[dict[str, Any]]:
    t = now_us()
    out = []
    for e in srv.execs.values():
        silent = (t - e.last_seen) / 1000
        health = "ready" if e.ready else ("loading" if e.rewelcome or silent < srv.cfg.heartbeat_timeout_ms
                                          else "silent")
        standby = [v for v in e.vgpus if v >= srv.nv]
        if e.ready and len(standby) == len(e.vgpus):
            health = "standby"
        out.append({"vgpus": format_ranges(e.vgpus), "pid": e.pid, "backend": e.backend, "endpoint": e.endpoint,
                    "health": health, "silent_ms": round(silent, 1), "clock_offset_us": e.offset,
                    "standby": format_ranges(standby) if standby else "",
                    "unreachable_peers": srv.unreachable_peers(e, t),
                    "assignments": [_describe(srv.assignments[v]) for v in e.vgpus if v < srv.nv]})
    return out


def missing(srv: Server) -> list[dict[str, Any]]:
    """vGPUs of the plan with no executor registered (a replan that added vGPUs, or one that died):
    out of service until an executor registers for them."""
    return [{"vgpu": v, "health": "missing", "assignment": _describe(srv.assignments[v])}
            for v in missing_vgpus(srv)]


def _describe(a: Any) -> str:
    return f"{a.model}/p{a.pipeline}.{a.partition} [{a.start},{a.end}) {a.gpu} 1/{a.split}"


async def drain(srv: Server, off: bool, timeout_s: float) -> dict[str, Any]:
    """Refuse new requests (``shutdown``/draining) and wait until queued and in-flight ones are answered."""
    if off:
        srv.draining = False
        return {"draining": False}
    srv.draining = True
    end = time.monotonic() + max(0.0, timeout_s)
    while (srv.reqs or any(not b.answered for b in srv.batches.values())) and time.monotonic() < end:
        await asyncio.sleep(0.01)
    left = len(srv.reqs) + sum(len(b.reqs) for b in srv.batches.values() if not b.answered)
    return {"draining": True, "drained": left == 0, "left": left}
