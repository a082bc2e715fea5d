"""``ppiped-ctl``: operate a running ppiped daemon over its unix socket.

    ppiped-ctl [--socket PATH | --config ppiped.toml] status|plan|executors|drain|replan ...

The socket path comes from ``--socket``, else ``$PPIPED_CTL_SOCKET``, else the config's
``ctl.socket`` (with the daemon's own default), else ``/run/ppiped/ctl.sock``. Exit status: 0 ok,
1 the daemon answered with an error, 2 bad usage or config, 3 daemon not running, 4 permission denied.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import stat
import sys
from collections.abc import Sequence
from typing import Any

from .commands.argtypes import number

DEFAULT_SOCKET = "/run/ppiped/ctl.sock"


class CtlError(Exception):
    """A failure to talk to the daemon; ``code`` is the exit status."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


TIMEOUT = number(0, 86_400, lo_open=True)
"""Seconds to wait for an answer: a day at most (``inf`` or ``nan`` cannot be a socket timeout)."""
WAIT_S = number(0, 86_400)
"""Longest drain wait: the daemon waits this long, and the client 5 s more."""


def socket_arg(s: str) -> str:
    """``--socket``: an empty path would silently fall back to the default socket."""
    if not s:
        raise argparse.ArgumentTypeError("an empty path: give the daemon's ctl socket")
    return s


def socket_path(explicit: str | None = None, config: str | None = None) -> str:
    if explicit is not None:
        return explicit
    if os.environ.get("PPIPED_CTL_SOCKET"):
        return os.environ["PPIPED_CTL_SOCKET"]
    if config:
        from .daemon.config import load_config

        return load_config(config).ctl_socket_path()
    return DEFAULT_SOCKET


def call(path: str, req: dict[str, Any], timeout_s: float = 30.0) -> dict[str, Any]:
    """Send one request, return the daemon's answer; raises :class:`CtlError` with a clear message."""
    mode = None
    with contextlib.suppress(OSError):  # missing or unreadable: connect says which
        mode = os.stat(path).st_mode
    if mode is not None and not stat.S_ISSOCK(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a regular file" if stat.S_ISREG(mode) else "a non-socket file"
        raise CtlError(f"{path} is {kind}, not a socket: give the daemon's ctl socket "
                       "(ctl.socket in its config)", 2)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout_s)
    try:
        try:
            s.connect(path)
        except FileNotFoundError:
            raise CtlError(f"ppiped is not running: no ctl socket at {path} "
                           "(start it with `ppiped serve` or `systemctl start ppiped`)", 3) from None
        except ConnectionRefusedError:
            raise CtlError(f"ppiped is not running: {path} exists but nobody listens on it "
                           "(a stale socket of a daemon that died)", 3) from None
        except PermissionError:
            raise CtlError(f"permission denied on {path}: the socket is for its owner and group "
                           "(ask to be added to the daemon's group, e.g. `usermod -aG ppiped $USER`)", 4) from None
        except OSError as e:
            raise CtlError(f"cannot connect to {path}: {e.strerror or e}", 3) from None
        s.sendall(json.dumps(req).encode() + b"\n")
        buf = b""
        while not buf.endswith(b"\n"):
            chunk = s.recv(1 << 16)
            if not chunk:
                raise CtlError(f"ppiped closed the connection on {path} without answering", 3)
            buf += chunk
    except TimeoutError:
        raise CtlError(f"no answer from ppiped on {path} within {timeout_s:.0f} s", 3) from None
    finally:
        s.close()
    return json.loads(buf)


async def acall(path: str, req: dict[str, Any], timeout_s: float = 600.0) -> dict[str, Any]:
    """:func:`call` for code on an event loop (benches, tests): one request, one answer."""
    import asyncio

    reader, writer = await asyncio.open_unix_connection(path, limit=1 << 24)
    try:
        writer.write(json.dumps(req).encode() + b"\n")
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), timeout_s)
    finally:
        writer.close()
    if not line:
        raise CtlError(f"ppiped closed the connection on {path} without answering", 3)
    return json.loads(line)


def _weights(items: list[str] | None) -> dict[str, float] | None:
    if not items:
        return None
    """Checked here, so a bad weight is exit 2 naming the model and value, daemon or not."""
    out: dict[str, float] = {}
    for item in ",".join(items).split(","):
        name, sep, w = item.partition("=")
        name = name.strip()
        if not sep:
            raise CtlError(f"--weights: expected MODEL=WEIGHT[,MODEL=WEIGHT...], got {item!r}", 2)
        if not name:
            raise CtlError(f"--weights: {item!r} has no model name (expected MODEL=WEIGHT)", 2)
        if name in out:
            raise CtlError(f"--weights: model {name!r} is given twice", 2)
        try:
            x = float(w)
        except ValueError:
            x = math.nan
        if not (math.isfinite(x) and x > 0):
            raise CtlError(f"--weights: weight of model {name!r} must be a finite number > 0, "
                           f"got {w.strip()!r}", 2)
        out[name] = x
    return out


def _print_status(st: dict[str, Any]) -> None:
    miss = st["vgpus"].get("missing")
    print(f"plan v{st['plan_version']} ({st['plan']}), {st['state']}, up {st['uptime_s']:.0f} s, "
          f"vGPUs {st['vgpus']['alive']}/{st['vgpus']['total']} alive"
          f"{f' ({miss} missing: no executor)' if miss else ''}, queued {st['queued']}, "
          f"in flight {st['in_flight_batches']} batches")
    print(f"{'model':<16} {'rate rps':>9} {'weight':>7} {'slo ms':>7} {'ok':>9} {'late':>6} {'dropped':>8} "
          f"{'rejected':>8} {'attain':>7} {'goodput/s':>9} {'invalid':>7} {'queued':>6}")
    for m, d in st["models"].items():
        print(f"{m:<16} {d['rate_rps']:>9.1f} {d['weight']:>7.3g} {d['slo_ms']:>7.1f} {d['ok']:>9} "
              f"{d.get('late', 0):>6} {d['dropped']:>8} {d['rejected']:>8} {100 * d['attainment']:>6.2f}% "
              f"{d.get('goodput_rps', 0.0):>9.1f} {100 * d.get('invalid_rate', 0.0):>6.2f}% {d['queued']:>6}")
        hi = d.get("high")
        if hi and hi["accepted"]:
            print(f"{'':<16} high priority: {hi['accepted']} accepted, {hi['ok_in_slo']} ok within the SLO, "
                  f"{hi['dropped']} dropped")
    other = st.get("rejected_no_model")
    if other:
        print("rejected, no model of the plan: " + ", ".join(f"{n} {why}" for why, n in sorted(other.items())))
    _print_apps(st.get("apps") or {})
    _print_executors(st["executors"], st.get("missing", []))
    last = st.get("replan", {}).get("last")
    if last:
        print(f"last replan: {json.dumps(last)}")


def _print_apps(a: dict[str, Any]) -> None:
    """Per app (multi-model queries): queries, where and why they failed, invalid GPU time."""
    if not a.get("apps"):
        return
    print(f"{'app':<16} {'offered':>9} {'ok':>9} {'late':>6} {'rejected':>8} {'attain':>7} {'invalid':>7}  "
          f"failed (stage: reason n)   [deadlines: {a.get('deadlines')}]")
    for name, d in a["apps"].items():
        failed = ", ".join(f"{st}: {r} {n}" for st, rs in d["dropped"].items() for r, n in sorted(rs.items()))
        print(f"{name:<16} {d['offered']:>9} {d['ok']:>9} {d['late']:>6} {sum(d['rejected'].values()):>8} "
              f"{100 * d['attainment']:>6.2f}% {100 * d['invalid_rate']:>6.2f}%  {failed or '-'}")
    g = a.get("glue")
    if g:
        print(f"glue: {g.get('ready', 0)}/{g.get('workers', 0)} workers ready, {g.get('busy', 0)} busy, "
              f"{g.get('queued', 0)} calls waiting; {g.get('calls', 0)} calls, {g.get('errors', 0)} errors, "
              f"{g.get('timeouts', 0)} timeouts, {g.get('restarts', 0)} workers replaced")


def _print_executors(execs: list[dict[str, Any]], missing: list[dict[str, Any]] = ()) -> None:
    print(f"{'vGPUs':<10} {'pid':>7} {'backend':<8} {'health':<8} {'silent ms':>9}  assignment")
    for e in execs:
        print(f"{e['vgpus']:<10} {e['pid']:>7} {e['backend']:<8} {e['health']:<8} {e['silent_ms']:>9.1f}  "
              f"{'; '.join(e['assignments'] + ([f'standby: {sb}'] if (sb := e.get('standby')) else []))}")
    for m in missing:  # in the plan, but no executor registered for it: out of service
        print(f"{m['vgpu']:<10} {'-':>7} {'-':<8} {'missing':<8} {'-':>9}  {m['assignment']}")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="ppiped-ctl", description="Operate a running ppiped daemon.")
    ap.add_argument("--socket", type=socket_arg, help=f"the daemon's ctl socket (default: from --config, else {DEFAULT_SOCKET})")
    ap.add_argument("--config", help="ppiped.toml to read ctl.socket from")
    ap.add_argument("--json", action="store_true", help="print the daemon's JSON answer")
    ap.add_argument("--timeout", type=TIMEOUT, default=30.0,
                    help="seconds to wait for an answer (at most a day)")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="COMMAND")
    sub.add_parser("status", help="plan version, per-model rate and attainment, queue, executors")
    sub.add_parser("plan", help="the plan in force, as `ppiped plan` prints it")
    sub.add_parser("executors", help="executors, their vGPUs, assignments and health")
    d = sub.add_parser("drain", help="refuse new requests and wait until the queued ones are answered")
    d.add_argument("--off", action="store_true", help="accept requests again")
    d.add_argument("--wait-s", type=WAIT_S, default=30.0,
                   help="longest wait for the queue to empty (seconds, at most a day)")
    r = sub.add_parser("replan", help="plan again for the measured (or given) mix and migrate to it")
    r.add_argument("--weights", action="append", metavar="MODEL=W[,MODEL=W]",
                   help="load weights (default: the measured arrival rates)")
    r.add_argument("--plan-file", help="migrate to this plan file instead of planning")
    r.add_argument("--dry-run", action="store_true", help="plan and print, do not migrate")
    r.add_argument("--wait", action="store_true", help="wait until the migration is done")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.cmd == "replan" and args.weights and args.plan_file:
        ap.error("replan: give --weights or --plan-file, not both (a plan file fixes the mix)")
    try:
        weights = _weights(args.weights) if args.cmd == "replan" else None
        path = socket_path(args.socket, args.config)
        req: dict[str, Any] = {"cmd": args.cmd}
        timeout = args.timeout
        if args.cmd == "drain":
            req.update(off=args.off, timeout_s=args.wait_s)
            timeout = max(timeout, args.wait_s + 5)
        elif args.cmd == "replan":
            req.update(weights=weights, dry_run=args.dry_run, wait=args.wait)
            if args.plan_file:
                req["plan_file"] = os.path.abspath(args.plan_file)
            if args.wait or args.dry_run:
                timeout = max(timeout, 600.0)
        out = call(path, req, timeout)
    except CtlError as e:
        print(f"ppiped-ctl: {e}", file=sys.stderr)
        return e.code
    except ValueError as e:  # a config error (ConfigError is a ValueError) or a garbled answer
        print(f"ppiped-ctl: {e}", file=sys.stderr)
        return 2
    if not out.get("ok"):
        print(f"ppiped-ctl: {args.cmd}: {out.get('error', 'failed')}", file=sys.stderr)
        if args.json:
            print(json.dumps(out, indent=1))
        return 1
    try:
        _print_answer(args, out)
    except BrokenPipeError:  # the reader went away (``| head``): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0


def _print_answer(args: argparse.Namespace, out: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(out, indent=1))
    elif args.cmd == "status":
        _print_status(out)
    elif args.cmd == "plan":
        print(f"plan v{out['version']} ({out['source']})")
        print(out["table"])
    elif args.cmd == "executors":
        _print_executors(out["executors"], out.get("missing", []))
    elif args.cmd == "drain":
        print("accepting requests again" if not out["draining"] else
              ("drained: no request queued or in flight" if out["drained"] else
               f"draining: {out['left']} requests still queued or in flight"))
    elif args.cmd == "replan":
        if out.get("started") and "plan" not in out:
            print(f"replan started (plan v{out['version']} in force); see `ppiped-ctl status`")
        else:
            if "plan" in out:
                print(out["plan"])
            print(json.dumps({k: v for k, v in out.items() if k != "plan"}))


if __name__ == "__main__":
    sys.exit(main())
