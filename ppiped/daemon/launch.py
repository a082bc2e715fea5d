"""Start a scheduler and its executor processes on this machine (demo, benches, tests).

Everything listens on ``ipc://`` sockets in a private directory, so several local clusters can
run side by side and nothing is reachable from outside the host. :class:`LocalCluster` owns its
processes: ``stop()`` (also on ``with`` exit) terminates and, if need be, kills every one.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq

from ..errors import InputError


def _die_with_parent() -> None:
    """In the child: get SIGTERM when the launching process dies, even by SIGKILL (Linux)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def cpu_split() -> tuple[list[int], list[int]] | None:
    """How a cluster on this host shares this process's CPUs: the scheduler's event loop gets the
    first to itself, as an operator gives it one (``[threads] loop_cpus``); its ZeroMQ I/O thread,
    the executors and the load generator share the rest. None with fewer than two CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    return (cpus[:1], cpus[1:]) if len(cpus) >= 2 else None


@contextlib.contextmanager
def running_on(cpus: Sequence[int] | None):
    """Keep the calling thread on ``cpus`` for the block (None: where it is)."""
    mine = os.sched_getaffinity(0)
    if cpus:
        os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        if cpus:
            os.sched_setaffinity(0, mine)


def curve_keys(directory: Path, executors: dict[str, str], clients: Sequence[str] = ("cam",),
               admins: Sequence[str] = ("ops",), unlisted: Sequence[str] = ("intruder",)) -> str:
    """Keypairs for a CURVE cluster under ``directory`` (``server``, ``executors/NAME`` for each
    executor name -> its vGPU ranges, ``clients/NAME``, ``admins/NAME``, and keys nobody allowed
    at the top); returns the ``[security]`` config lines that use them."""
    from ..security import keygen

    for name, sub in (("server", ""), *((n, "executors") for n in executors), *((n, "clients") for n in clients),
                      *((n, "admins") for n in admins), *((n, "") for n in unlisted)):
        keygen(directory / sub, name)
    lines = [f'[security]\ncurve = true\nserver_key = "{directory}/server.key_secret"\n'
             f'client_keys = "{directory}/clients"\nadmin_keys = "{directory}/admins"\n[security.executors]']
    lines += [f'"{directory}/executors/{n}.key" = "{v}"' for n, v in executors.items()]
    return "\n".join(lines) + "\n"


def write_config(directory: Path, plan: Path, profiles: Path, *, backend: str = "emulate",
                 partitions: str = "", heartbeat_ms: int = 100, timeout_ms: int = 1000,
                 scheduler: dict[str, Any] | None = None,
                 threads: tuple[Sequence[int], Sequence[int]] | None = None, extra: str = "") -> Path:
    """A serving config whose endpoints are ipc sockets in ``directory``; ``threads``: the
    scheduler's (loop CPUs, I/O CPUs), as :func:`cpu_split` gives them."""
    d = directory
    sched = "".join(f"{k} = {json.dumps(v)}\n" for k, v in (scheduler or {}).items())
    if threads:  # last: ``extra`` may start with keys of [executor]
        extra = f"{extra}\n[threads]\nloop_cpus = {list(threads[0])}\nio_cpus = {list(threads[1])}\n"
    text = f"""# written by ppiped.daemon.launch
plan = {json.dumps(str(plan))}
profiles = {json.dumps(str(profiles))}

[endpoints]
client = "ipc://{d}/client.sock"
executor = "ipc://{d}/executor.sock"
ctl = "ipc://{d}/ctl.sock"

[heartbeat]
interval_ms = {heartbeat_ms}
timeout_ms = {timeout_ms}

[scheduler]
{sched}
[executor]
backend = "{backend}"
data_endpoint = "ipc://{d}/data-{{vgpu}}.sock"
partitions = {json.dumps(partitions)}
{extra}
"""
    path = d / "ppiped.toml"
    path.write_text(text)
    return path


def split_groups(n_vgpus: int, processes: int) -> list[list[int]]:
    """vGPUs 0..n-1 over ``processes`` executor processes, interleaved so each holds every pool."""
    processes = max(1, min(processes, n_vgpus))
    return [list(range(i, n_vgpus, processes)) for i in range(processes)]


class LocalCluster:
    """``ppiped serve`` plus executor processes; the context manager stops them all."""

    def __init__(self, config: Path, groups: Sequence[Sequence[int]], *, backend: str | None = None,
                 log_dir: Path | None = None, log_level: str = "warning", python: str = sys.executable,
                 env: dict[str, str] | None = None, executor_cpus: Sequence[int] | None = None,
                 admin_key: str | None = None, executor_keys: Sequence[str] | None = None) -> None:
        """``admin_key``: an admin's ``.key_secret`` for ctl when ``security.curve`` is on;
        ``executor_keys``: one ``.key_secret`` per group (``ppiped-executor --key``)."""
        self.config = Path(config)
        self.admin_key = admin_key
        self.executor_keys = list(executor_keys) if executor_keys else None
        self.executor_cpus = executor_cpus
        self.groups = [list(g) for g in groups]
        self.backend = backend
        self.log_dir = Path(log_dir) if log_dir else self.config.parent
        self.log_level = log_level
        self.python = python
        self.env = {**os.environ, **(env or {})}
        self.server: subprocess.Popen | None = None
        self.executors: list[subprocess.Popen | None] = []
        from .config import load_config

        cfg = load_config(self.config)
        self.client_endpoint, self.ctl_endpoint = cfg.client, cfg.ctl
        self.security = cfg.security

    def _spawn(self, args: list[str], log_name: str, cpus: Sequence[int] | None = None) -> subprocess.Popen:
        log = open(self.log_dir / log_name, "ab")  # noqa: SIM115 - the child keeps it

        def setup() -> None:
            _die_with_parent()
            if cpus:  # before the child starts any thread, so ZeroMQ's I/O threads inherit it
                os.sched_setaffinity(0, cpus)

        try:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                    start_new_session=True, preexec_fn=setup)
        finally:
            log.close()

    def start(self, timeout_s: float = 180.0) -> LocalCluster:
        """Start everything and wait until every vGPU is ready (the first start may JIT-compile).
        On any failure every process started so far is stopped before the error propagates."""
        try:
            self.restart_server()
            for i in range(len(self.groups)):
                self.executors.append(self._start_executor(i))
            total = sum(len(g) for g in self.groups)
            end = time.monotonic() + timeout_s
            while True:
                if self.server.poll() is not None:
                    raise InputError(f"ppiped serve exited with {self.server.returncode}: "
                                     f"{self.tail('serve.log')}")
                st = self.status(timeout_s=1.0)
                if st and st["vgpus"]["alive"] >= total:
                    return self
                if time.monotonic() > end:
                    raise InputError(f"cluster not ready within {timeout_s:.0f} s "
                                     f"(alive: {st['vgpus']['alive'] if st else '?'} of {total})")
                time.sleep(0.2)
        except BaseException:
            self.stop()
            raise

    def kill_server(self, sig: int = signal.SIGKILL) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(sig)
            self.server.wait(timeout=10)

    def restart_server(self) -> None:
        """Kill the scheduler (SIGKILL) and start it again; executors re-register by themselves."""
        self.kill_server()
        self.server = self._spawn([self.python, "-m", "ppiped.cli", "serve", "--config",
                                   str(self.config), "--log-level", self.log_level], "serve.log")

    async def restart_with_pending(self, client: Any, n: int, model: str, slo_ms: float = 20_000.0
                                   ) -> tuple[list, float]:
        """Hold ``n`` requests pending (executor 0 stopped), ``kill -9`` and restart the scheduler,
        and wait for every request's end: (results or exceptions, seconds from the restart)."""
        os.kill(self.executors[0].pid, signal.SIGSTOP)
        try:
            futs = [asyncio.ensure_future(client.submit(model, b"p%d" % i, slo_ms=slo_ms)) for i in range(n)]
            await asyncio.sleep(0.3)
            t0 = time.monotonic()
            self.restart_server()
        finally:
            os.kill(self.executors[0].pid, signal.SIGCONT)
        outs = await asyncio.gather(*futs, return_exceptions=True)
        return outs, time.monotonic() - t0

    def _start_executor(self, i: int) -> subprocess.Popen:
        vg = ",".join(map(str, self.groups[i]))
        args = [self.python, "-m", "ppiped.executor.main", "--config", str(self.config), "--vgpu", vg,
                "--log-level", self.log_level]
        if self.backend:
            args += ["--backend", self.backend]
        if self.executor_keys:
            args += ["--key", self.executor_keys[i]]
        return self._spawn(args, f"executor-{i}.log", self.executor_cpus)

    def kill_executor(self, i: int, sig: int = signal.SIGKILL) -> None:
        p = self.executors[i]
        if p is not None and p.poll() is None:
            p.send_signal(sig)
            p.wait(timeout=10)

    def restart_executor(self, i: int) -> None:
        self.kill_executor(i)
        self.executors[i] = self._start_executor(i)

    def ctl(self, cmd: str, timeout_s: float = 5.0) -> dict | None:
        ctx = zmq.Context.instance()
        s = ctx.socket(zmq.REQ)
        s.setsockopt(zmq.LINGER, 0)
        try:
            if self.security.curve and self.admin_key:
                from ..security import connect_as, load_keypair

                connect_as(s, self.security, own=load_keypair(self.admin_key, need_secret=True))
            s.connect(self.ctl_endpoint)
            s.send(json.dumps({"cmd": cmd}).encode())
            if not s.poll(int(timeout_s * 1000)):
                return None
            return json.loads(s.recv())
        finally:
            s.close(0)

    def status(self, timeout_s: float = 5.0) -> dict | None:
        return self.ctl("status", timeout_s)

    def tail(self, name: str, lines: int = 20) -> str:
        try:
            return "\n".join((self.log_dir / name).read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        procs = [p for p in [*self.executors, self.server] if p is not None]
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        end = time.monotonic() + 5.0
        for p in procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def short_tmpdir(prefix: str = "ppiped-") -> tempfile.TemporaryDirectory:
    """A temp dir with a short path: ipc socket paths must stay under ~100 characters."""
    base = "/tmp" if os.path.isdir("/tmp") else None
    return tempfile.TemporaryDirectory(prefix=prefix, dir=base)


async def wait_ready(endpoint: str, total: int, timeout_s: float = 60.0) -> dict:
    """Poll the scheduler with PING until ``total`` vGPUs are alive."""
    from ..client import AsyncClient

    end = time.monotonic() + timeout_s
    async with AsyncClient(endpoint) as c:
        while True:
            try:
                info = await c.info(timeout_s=1.0)
                if info.get("vgpus_alive", 0) >= total:
                    return info
            except TimeoutError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"scheduler at {endpoint} not ready within {timeout_s} s")
            await asyncio.sleep(0.1)
