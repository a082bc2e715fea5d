"""The serving config (TOML) read by ``ppiped serve`` and ``ppiped-executor``.



Every key is validated and an error names it (``ppiped.toml: limits.max_payload_bytes: ...``).
Relative paths are relative to the config file. See ``plans/ppiped.toml`` for every key.

Endpoints must be ``ipc://PATH`` or ``tcp://127.0.0.1:PORT`` unless ``endpoints.allow_remote``
is true: a scheduler that listens on other interfaces is a decision, not a default.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import socket
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .. import wire
from ..errors import InputError
from ..readfile import read_toml
from ..security import KeyFileError, Security, load_keypair, load_public_keys

BACKENDS = ("emulate", "ort", "trt", "torch")
# scheduler.app_deadlines (ppiped.query.app.MODES): e2e (PARD: every stage works to the query's
# deadline less its downstream path's estimate), split (Nexus: per-stage budgets of the plan's SLO
# split), chain (each stage's budget from when its request is submitted, as hand-chaining does)
APP_DEADLINES = ("e2e", "split", "chain")


class ConfigError(InputError):
    """The serving config is malformed; the message names the file and the key."""


@dataclass(frozen=True)
class ExecutorSettings:
    """How one vGPU's executor runs: ``[executor]`` defaults overridden by ``[executors.ID]``."""

    backend: str = "emulate"
    data_endpoint: str = ""  # empty: tcp://127.0.0.1:(data_port_base + vgpu)
    data_port_base: int = 7100
    partitions: str = ""  # ONNX file template: {model} {pipeline} {partition} {start} {end}
    engines: str = ""  # TensorRT engine cache template (same fields plus {gpu}); default beside the ONNX
    # may start a batch this long before its reserved start; inf (the default): work-conserving,
    # as the scheduler's tables assume when they pull a queue forward after an early end
    start_early_us: float = math.inf
    threads: int = 1  # ONNX Runtime intra-op threads
    device: int = 0  # CUDA device
    split: int = 0  # vGPU split for CUDA MPS (0: from the scheduler's assignment)
    fp16_engine: bool = True  # build TensorRT engines with FP16 kernels allowed
    emulate_load_ms: int = 0  # emulate: how long loading a partition takes (an engine load, emulated)
    emulate_jitter: float = 0.0  # emulate: lognormal log-sd of each batch's latency around the profile

    def endpoint_for(self, vgpu: int) -> str:
        if self.data_endpoint:
            return self.data_endpoint.replace("{vgpu}", str(vgpu))
        if self.data_port_base + vgpu > 65535:
            raise ConfigError(f"executor.data_port_base: vGPU {vgpu} would listen on port "
                              f"{self.data_port_base + vgpu} (> 65535); lower it, or set data_endpoint")
        return f"tcp://127.0.0.1:{self.data_port_base + vgpu}"


# Frames on the executor and data sockets (feature maps, results): ZMQ_MAXMSGSIZE on both, so a
# peer that reaches them cannot make the daemon or an executor allocate an arbitrary frame.
MIN_TENSOR_BYTES = 64 << 10
MAX_TENSOR_BYTES = 1 << 40
TENSOR_CAP_FLOOR = 64 << 20
TENSOR_CAP_UNKNOWN = 4 << 30  # no profiles to derive the cap from (an executor on another host)
# a profile's boundary bytes are fp16; a backend may send fp32 (x2), and a model's output, which
# profiles do not record, may be larger than any boundary (x2 again)
TENSOR_HEADROOM = 4


@dataclass(frozen=True)
class ModelSettings:
    slo_ms: float | None = None  # overrides the plan's SLO
    input_bytes: int = 0  # expected frame size (0: not checked by the scheduler)


@dataclass
class ServeConfig:
    source: Path
    plan: Path | None = None
    profiles: Path | None = None
    cluster: Path | None = None
    state_dir: Path | None = None  # the plan in force across restarts (daemon/state.py)
    client: str = "tcp://127.0.0.1:5555"
    executor: str = "tcp://127.0.0.1:5556"
    ctl: str = "tcp://127.0.0.1:5557"
    allow_remote: bool = False
    max_payload_bytes: int = 16 << 20
    max_tensor_bytes: int = 0  # largest frame on executor and data sockets (0: tensor_frame_cap derives it)
    max_pending: int = 100_000
    max_ids_per_message: int = 4096
    max_slo_ms: float = 60_000.0  # a request may ask for at most this SLO
    max_backlog_ms: float = 25.0  # client socket behind this long: new SUBMITs answered overloaded
    heartbeat_interval_ms: int = 100
    heartbeat_timeout_ms: int = 1000
    # a batch is lost this long (or its reserved length if longer) after its reserved end without a result
    result_grace_ms: float = 200.0
    scheduler: dict[str, Any] = field(default_factory=dict)  # passed to the core as options
    models: dict[str, ModelSettings] = field(default_factory=dict)
    executor_defaults: ExecutorSettings = field(default_factory=ExecutorSettings)
    executors: dict[int, ExecutorSettings] = field(default_factory=dict)
    ctl_socket: str = ""  # ppiped-ctl's unix socket; empty: see ctl_socket_path()
    ctl_mode: int = 0o660
    ctl_group: str = ""  # chgrp the socket to this group (empty: the daemon's own group)
    metrics_port: int = 0  # 0: no metrics endpoint
    metrics_host: str = "127.0.0.1"
    replan_auto: bool = False
    replan_min_interval_s: float = 60.0
    replan_drift: float = 0.2  # total-variation distance between measured mix and plan weights
    replan_ewma_s: float = 10.0  # time constant of the arrival-rate EWMA
    replan_time_limit_s: float = 30.0
    replan_algo: str = "ppipe"
    replan_flush_timeout_ms: float = 0.0  # 0: the largest SLO + limits.result_grace_ms
    replan_preload_timeout_ms: float = 60_000.0  # longest wait for executors to preload a new plan
    loop_cpus: tuple[int, ...] = ()  # CPUs of the event-loop thread (empty: the process's)
    io_cpus: tuple[int, ...] = ()  # CPUs of ZeroMQ's I/O threads (empty: the process's)
    io_threads: int = 1  # ZeroMQ I/O threads
    security: Security = field(default_factory=Security)  # [security]: CURVE keys and allow-lists
    app_deadlines: str = "e2e"  # scheduler.app_deadlines: how an app's stage requests get deadlines
    glue_workers: int = 2  # [glue]: worker processes running the apps' glue callables
    glue_timeout_ms: float = 1000.0  # a glue call running longer fails its query (glue-timeout)
    glue_max_children: int = 256  # most inputs one glue call may make

    def ctl_socket_path(self) -> str:
        """Where the ctl socket lives: the configured path, else systemd's RuntimeDirectory, else
        beside an ipc:// ctl endpoint, else /run/ppiped/ctl.sock."""
        if self.ctl_socket:
            return self.ctl_socket
        rd = os.environ.get("RUNTIME_DIRECTORY", "").split(":")[0]
        if rd:
            return os.path.join(rd, "ctl.sock")
        if self.ctl.startswith("ipc://"):
            return os.path.join(os.path.dirname(self.ctl[6:]) or ".", "admin.sock")
        return "/run/ppiped/ctl.sock"

    def executor_settings(self, vgpu: int) -> ExecutorSettings:
        return self.executors.get(vgpu, self.executor_defaults)

    def slo_us(self, model: str, plan_slo_us: float) -> int:
        """A model's SLO as served: its ``[models.NAME] slo_ms``, else the plan's."""
        ms = self.models.get(model)
        return int(ms.slo_ms * 1000) if ms and ms.slo_ms else int(plan_slo_us)

    def partition_file(self, settings: ExecutorSettings, **fields: Any) -> Path:
        if not settings.partitions:
            raise ConfigError(f"{self.source}: executor.partitions: needed by the {settings.backend} "
                              "backend (a template like 'parts/{model}/{start}-{end}.onnx')")
        return self._resolve(_fill(settings.partitions, fields, "executor.partitions", self.source))

    def engine_file(self, settings: ExecutorSettings, onnx_path: Path, **fields: Any) -> Path:
        if settings.engines:
            return self._resolve(_fill(settings.engines, fields, "executor.engines", self.source))
        return onnx_path.with_suffix(f".{fields.get('gpu', 'gpu')}.engine")

    def _resolve(self, p: str) -> Path:
        path = Path(p)
        return path if path.is_absolute() else (self.source.parent / path)


_FIELDS = {"model", "pipeline", "partition", "start", "end", "gpu", "vgpu"}


def _fill(template: str, fields: dict[str, Any], key: str, source: Path) -> str:
    for name in re.findall(r"{(\w+)}", template):
        if name not in _FIELDS:
            raise ConfigError(f"{source}: {key}: unknown placeholder {{{name}}} "
                              f"(known: {', '.join(sorted(_FIELDS))})")
    return re.sub(r"{(\w+)}", lambda m: str(fields.get(m.group(1), m.group(0))), template)


_LOCAL_TCP = re.compile(r"^tcp://127\.0\.0\.1:(\d{1,5})$")


def ipc_taken(path: str) -> str | None:
    """Why binding ``path`` would steal it, or None. ZeroMQ's ipc bind unlinks whatever is
    there, so a second daemon or executor on the same path would silently cut off the live one:
    a file that accepts a plain unix connect has a listener; a refused connect is a stale socket."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    except OSError as e:
        return f"cannot check {path}: {e.strerror or e}"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} exists and is not a socket (not replacing it)"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(2.0)
    try:
        s.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return None  # stale: left by a process that died
    except OSError as e:
        return f"cannot check whether a process listens on {path}: {e.strerror or e}"
    finally:
        s.close()
    return f"{path} is held by a live process"


def check_endpoint(ep: Any, key: str, source: Any, allow_remote: bool = False, base: Path | None = None) -> str:
    """The endpoint, checked; a relative ``ipc://`` path made absolute against ``base`` (the
    config file's folder), so executors and clients started elsewhere find the same socket."""
    if not isinstance(ep, str) or not ep:
        raise ConfigError(f"{source}: {key}: expected an endpoint string like 'tcp://127.0.0.1:5555'")
    if ep.startswith("inproc://") and len(ep) > 9:  # within one process (tests, benches)
        return ep
    if ep.startswith("ipc://"):
        if base is not None and not ep.startswith("ipc:///") and not ep.startswith("ipc://@"):
            ep = "ipc://" + os.path.normpath(os.path.abspath(base / ep[6:]))
        if len(ep) - 6 > 100:
            raise ConfigError(f"{source}: {key}: ipc path longer than 100 characters (unix socket limit)")
        return ep
    m = _LOCAL_TCP.match(ep)
    if m and 0 < int(m.group(1)) < 65536:
        return ep
    if allow_remote and re.match(r"^tcp://[\w.\-\[\]:]+:\d{1,5}$", ep):
        return ep
    raise ConfigError(f"{source}: {key}: {ep!r} is not ipc://PATH or tcp://127.0.0.1:PORT "
                      "(set endpoints.allow_remote = true to listen elsewhere)")


class _Table:
    """Reads one TOML table, remembering which keys were used so leftovers can be reported."""

    def __init__(self, d: Any, name: str, source: Any) -> None:
        if not isinstance(d, dict):
            raise ConfigError(f"{source}: {name or 'top level'}: expected a table")
        self.d, self.name, self.source, self.used = d, name, source, set()

    def key(self, k: str) -> str:
        return f"{self.name}.{k}" if self.name else k

    def get(self, k: str, default: Any, kind: str) -> Any:
        self.used.add(k)
        if k not in self.d:
            return default
        v = self.d[k]
        where = f"{self.source}: {self.key(k)}"
        if kind == "str":
            if not isinstance(v, str):
                raise ConfigError(f"{where}: expected a string, got {v!r}")
        elif kind == "bool":
            if not isinstance(v, bool):
                raise ConfigError(f"{where}: expected true or false, got {v!r}")
        elif kind in ("int+", "int0"):
            lo = 1 if kind == "int+" else 0
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                raise ConfigError(f"{where}: expected an integer >= {lo}, got {v!r}")
        elif kind == "num0inf":
            if v == "inf":
                v = math.inf
            elif isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"{where}: expected a number >= 0 or \"inf\", got {v!r}")
            v = float(v)
        elif kind == "num+":
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1e15:
                raise ConfigError(f"{where}: expected a positive number below 1e15, got {v!r}")
            v = float(v)
        elif kind == "table" and not isinstance(v, dict):
            raise ConfigError(f"{where}: expected a table")
        elif kind == "cpus":
            if not isinstance(v, list) or not all(isinstance(c, int) and not isinstance(c, bool)
                                                  and 0 <= c < 1024 for c in v):
                raise ConfigError(f"{where}: expected a list of CPU numbers like [0, 1], got {v!r}")
            if len(set(v)) != len(v):
                raise ConfigError(f"{where}: a CPU is listed twice: {v!r}")
            v = tuple(v)
        return v

    def sub(self, k: str) -> _Table:
        return _Table(self.get(k, {}, "table"), self.key(k), self.source)

    def done(self) -> None:
        extra = sorted(set(self.d) - self.used)
        if extra:
            raise ConfigError(f"{self.source}: {self.name or 'top level'}: unknown key(s) "
                              f"{', '.join(extra)} (known: {', '.join(sorted(self.used))})")


# Upper bounds on sizes a config may ask for: beyond them a typo, not a deployment.
MAX_EXECUTOR_THREADS = 1024
MAX_IO_THREADS = 64
MAX_GLUE_WORKERS = 256  # [glue] workers: Python processes of about 32 MB each
MAX_GLUE_CHILDREN = 1_000_000  # [glue] max_children: child requests one glue call may yield
MAX_EMULATE_LOAD_MS = 3_600_000
MAX_EMULATE_JITTER = 2.0  # as the simulator's --jitter: e^(2 x 4) ~ 3000x the profile already


def _executor_settings(t: _Table, base: ExecutorSettings, allow_remote: bool, folder: Path) -> ExecutorSettings:
    s = replace(
        base,
        backend=t.get("backend", base.backend, "str"),
        data_endpoint=t.get("data_endpoint", base.data_endpoint, "str"),
        data_port_base=t.get("data_port_base", base.data_port_base, "int+"),
        partitions=t.get("partitions", base.partitions, "str"),
        engines=t.get("engines", base.engines, "str"),
        start_early_us=t.get("start_early_us", base.start_early_us, "num0inf"),
        threads=t.get("threads", base.threads, "int+"),
        device=t.get("device", base.device, "int0"),
        split=t.get("split", base.split, "int0"),
        fp16_engine=t.get("fp16_engine", base.fp16_engine, "bool"),
        emulate_load_ms=t.get("emulate_load_ms", base.emulate_load_ms, "int0"),
        emulate_jitter=t.get("emulate_jitter", base.emulate_jitter, "num0inf"),
    )
    if not 0 <= s.emulate_jitter <= MAX_EMULATE_JITTER:  # 1e300 overflowed a batch's duration
        raise ConfigError(f"{t.source}: {t.key('emulate_jitter')}: expected a lognormal sigma in "
                          f"[0, {MAX_EMULATE_JITTER:g}], got {s.emulate_jitter}")
    if s.backend not in BACKENDS:
        raise ConfigError(f"{t.source}: {t.key('backend')}: expected one of {', '.join(BACKENDS)}, "
                          f"got {s.backend!r}")
    if s.data_endpoint:
        _not_inproc(s.data_endpoint, f"{t.source}: {t.key('data_endpoint')}")
        if s.data_endpoint.startswith("ipc://"):
            s = replace(s, data_endpoint=check_endpoint(s.data_endpoint, t.key("data_endpoint"), t.source,
                                                        allow_remote, folder))
        check_endpoint(s.data_endpoint.replace("{vgpu}", "0"), t.key("data_endpoint"), t.source, allow_remote)
    if not 1024 <= s.data_port_base <= 65535:
        raise ConfigError(f"{t.source}: {t.key('data_port_base')}: expected a TCP port in 1024..65535 "
                          f"(vGPU v listens on data_port_base + v), got {s.data_port_base}")
    if s.threads > MAX_EXECUTOR_THREADS:  # ONNX Runtime sizes its pool from it: 10^6 took 20 GB
        raise ConfigError(f"{t.source}: {t.key('threads')}: at most {MAX_EXECUTOR_THREADS}, got {s.threads}")
    if s.emulate_load_ms > MAX_EMULATE_LOAD_MS:
        raise ConfigError(f"{t.source}: {t.key('emulate_load_ms')}: at most {MAX_EMULATE_LOAD_MS} "
                          f"(an hour), got {s.emulate_load_ms}")
    t.done()
    return s


def config_from_dict(d: Any, source: str | Path = "<memory>") -> ServeConfig:
    """Validate a decoded config; relative paths resolve against ``source``'s directory."""
    src = Path(source)
    base = src.parent if str(source) != "<memory>" else Path.cwd()
    top = _Table(d, "", src)

    def path(k: str) -> Path | None:
        v = top.get(k, None, "str")
        if v is None:
            return None
        p = Path(os.path.expanduser(v))
        return p if p.is_absolute() else base / p

    cfg = ServeConfig(source=src, plan=path("plan"), profiles=path("profiles"), cluster=path("cluster"),
                      state_dir=path("state_dir"))
    ep = top.sub("endpoints")
    cfg.allow_remote = ep.get("allow_remote", False, "bool")
    for k in ("client", "executor", "ctl"):
        setattr(cfg, k, check_endpoint(ep.get(k, getattr(cfg, k), "str"), ep.key(k), src, cfg.allow_remote, base))
    seen: dict[str, str] = {}
    for k in ("client", "executor", "ctl"):
        e = getattr(cfg, k)
        # one ipc path bound twice: libzmq's second bind unlinks the first socket's file
        key = "ipc://" + os.path.normpath(os.path.abspath(e[6:])) if e.startswith("ipc://") else e
        if key in seen:
            raise ConfigError(f"{src}: {ep.key(k)}: {e!r} is also {ep.key(seen[key])}; each endpoint needs its own")
        seen[key] = k
    ep.done()
    lim = top.sub("limits")
    cfg.max_payload_bytes = lim.get("max_payload_bytes", cfg.max_payload_bytes, "int+")
    cfg.max_tensor_bytes = lim.get("max_tensor_bytes", cfg.max_tensor_bytes, "int+")
    if cfg.max_tensor_bytes and not MIN_TENSOR_BYTES <= cfg.max_tensor_bytes <= MAX_TENSOR_BYTES:
        raise ConfigError(f"{src}: {lim.key('max_tensor_bytes')}: expected {MIN_TENSOR_BYTES} to "
                          f"{MAX_TENSOR_BYTES} bytes, got {cfg.max_tensor_bytes}")
    cfg.max_pending = lim.get("max_pending", cfg.max_pending, "int+")
    cfg.max_ids_per_message = lim.get("max_ids_per_message", cfg.max_ids_per_message, "int+")
    cfg.max_slo_ms = lim.get("max_slo_ms", cfg.max_slo_ms, "num+")
    cfg.max_backlog_ms = lim.get("max_backlog_ms", cfg.max_backlog_ms, "num+")
    cfg.result_grace_ms = lim.get("result_grace_ms", cfg.result_grace_ms, "num+")
    lim.done()
    hb = top.sub("heartbeat")
    cfg.heartbeat_interval_ms = hb.get("interval_ms", cfg.heartbeat_interval_ms, "int+")
    cfg.heartbeat_timeout_ms = hb.get("timeout_ms", cfg.heartbeat_timeout_ms, "int+")
    if cfg.heartbeat_interval_ms > wire.MAX_HEARTBEAT_MS:  # (executors refuse a WELCOME asking for more)
        raise ConfigError(f"{src}: heartbeat.interval_ms: at most {wire.MAX_HEARTBEAT_MS}, got "
                          f"{cfg.heartbeat_interval_ms}")
    if cfg.heartbeat_timeout_ms < 2 * cfg.heartbeat_interval_ms:
        raise ConfigError(f"{src}: heartbeat.timeout_ms: must be at least twice interval_ms "
                          f"({cfg.heartbeat_interval_ms}), got {cfg.heartbeat_timeout_ms}")
    hb.done()
    _ops_tables(top, cfg, base)
    th = top.sub("threads")
    cfg.loop_cpus = th.get("loop_cpus", (), "cpus")
    cfg.io_cpus = th.get("io_cpus", (), "cpus")
    cfg.io_threads = th.get("io_threads", 1, "int+")
    if cfg.io_threads > MAX_IO_THREADS:  # libzmq aborts on running out of descriptors past a few hundred
        raise ConfigError(f"{src}: {th.key('io_threads')}: at most {MAX_IO_THREADS}, got {cfg.io_threads}")
    th.done()
    cfg.scheduler = dict(top.get("scheduler", {}, "table"))
    mode = cfg.scheduler.pop("app_deadlines", cfg.app_deadlines)
    if mode not in APP_DEADLINES:
        raise ConfigError(f"{src}: scheduler.app_deadlines: expected one of {', '.join(APP_DEADLINES)}, "
                          f"got {mode!r}")
    cfg.app_deadlines = mode
    glue = top.sub("glue")
    cfg.glue_workers = glue.get("workers", cfg.glue_workers, "int+")
    if cfg.glue_workers > MAX_GLUE_WORKERS:  # (each is a Python process, all started up front)
        raise ConfigError(f"{src}: {glue.key('workers')}: at most {MAX_GLUE_WORKERS}, got {cfg.glue_workers}")
    cfg.glue_timeout_ms = glue.get("timeout_ms", cfg.glue_timeout_ms, "num+")
    cfg.glue_max_children = glue.get("max_children", cfg.glue_max_children, "int+")
    if cfg.glue_max_children > MAX_GLUE_CHILDREN:
        raise ConfigError(f"{src}: {glue.key('max_children')}: at most {MAX_GLUE_CHILDREN}, got "
                          f"{str(cfg.glue_max_children)[:20]}")
    glue.done()
    models = top.sub("models")
    for name in list(models.d):
        mt = models.sub(name)
        slo = mt.get("slo_ms", None, "num+")
        if slo is not None and slo > cfg.max_slo_ms:
            raise ConfigError(f"{src}: models.{name}.slo_ms: {slo:g} is over limits.max_slo_ms "
                              f"({cfg.max_slo_ms:g})")
        cfg.models[name] = ModelSettings(slo, mt.get("input_bytes", 0, "int0"))
        mt.done()
    models.done()
    cfg.executor_defaults = _executor_settings(top.sub("executor"), ExecutorSettings(), cfg.allow_remote, base)
    per = top.sub("executors")
    for k in list(per.d):
        if not re.fullmatch(r"\d{1,9}", str(k)):
            raise ConfigError(f"{src}: executors.{str(k)[:40]}: tables under [executors] are keyed by vGPU id "
                              "(an integer), e.g. [executors.3]")
        if int(k) in cfg.executors:  # "0" and "00": the second silently replaced the first
            raise ConfigError(f"{src}: executors.{k}: vGPU {int(k)} has a table already")
        cfg.executors[int(k)] = _executor_settings(per.sub(k), cfg.executor_defaults, cfg.allow_remote, base)
    per.done()
    cfg.security = _security(top.sub("security"), cfg, base)
    top.done()
    return cfg


_LOOPBACK = re.compile(r"^(ipc://|inproc://|tcp://(127\.0\.0\.1|localhost|\[::1\]):)")


def _not_inproc(ep: str, where: str) -> str:
    """A data endpoint is reached by other processes: an in-process one lost every batch."""
    if ep.startswith("inproc://"):
        raise ConfigError(f"{where}: a data endpoint is reached by other processes: ipc:// or tcp://, not {ep!r}")
    return ep


def check_data_endpoint(ep: Any, key: str, cfg: ServeConfig) -> str:
    """An executor's data endpoint given on its command line: checked as the config's are, and
    refused before anything binds when it leaves the host without CURVE, or is in-process only."""
    ep = _not_inproc(check_endpoint(ep, key, "flags", cfg.allow_remote), key)
    if not _LOOPBACK.match(ep) and not cfg.security.curve:
        raise ConfigError(f"{key}: {ep!r} leaves this host, so security.curve must be true in {cfg.source}")
    return ep


def _security(t: _Table, cfg: ServeConfig, base: Path) -> Security:
    """[security]: CURVE on or off, the scheduler's key, and who may connect where.

    CURVE is required as soon as any endpoint, a data endpoint included, is not loopback."""
    src = t.source
    curve = t.get("curve", False, "bool")
    data = [("executor.data_endpoint", cfg.executor_defaults.endpoint_for(0))]
    data += [(f"executors.{v}.data_endpoint", st.endpoint_for(v)) for v, st in sorted(cfg.executors.items())
             if st.data_endpoint]  # a per-vGPU one listens off-host as surely as the default
    remote = [(k, ep) for k, ep in (("endpoints.client", cfg.client), ("endpoints.executor", cfg.executor),
                                    ("endpoints.ctl", cfg.ctl), *data)
              if not _LOOPBACK.match(ep)]
    if remote and not curve:
        k, ep = remote[0]
        raise ConfigError(f"{src}: {k}: {ep!r} leaves this host, so security.curve must be true "
                          "(`ppiped keys` makes the key files and prints the config lines)")

    def path(k: str) -> Path | None:
        v = t.get(k, "", "str")
        if not v:
            return None
        p = Path(os.path.expanduser(v))
        return p if p.is_absolute() else base / p

    def paths(k: str) -> list[Path]:
        v = t.get(k, [], "any")
        vs = [v] if isinstance(v, str) else v
        if not isinstance(vs, list) or not all(isinstance(x, str) for x in vs):
            raise ConfigError(f"{src}: security.{k}: expected a path or a list of paths")
        return [Path(os.path.expanduser(x)) if os.path.isabs(os.path.expanduser(x)) else base / x
                for x in vs]

    server, own, server_pub = path("server_key"), path("executor_key"), path("server_public_key")
    clients, admins = paths("client_keys"), paths("admin_keys")
    ex = t.sub("executors")
    bindings = {k: ex.get(k, "", "str") for k in list(ex.d)}
    ex.done()
    t.done()
    if not curve:
        return Security()
    try:
        sec = Security(curve=True)
        if server is not None:
            sec.server = load_keypair(server, what="security.server_key")
        elif server_pub is not None:
            sec.server = load_keypair(server_pub, what="security.server_public_key")
        else:
            raise ConfigError(f"{src}: security.server_key (scheduler host) or "
                              "security.server_public_key (elsewhere): needed with curve = true")
        if own is not None:
            sec.own = load_keypair(own, need_secret=True, what="security.executor_key")
        sec.clients = load_public_keys(clients, "security.client_keys")
        sec.admins = load_public_keys(admins, "security.admin_keys")
        for f, spec in bindings.items():
            p = Path(os.path.expanduser(f))
            key = load_keypair(p if p.is_absolute() else base / p, what=f"security.executors.{f}").public
            try:
                sec.executors[key] = frozenset(parse_vgpus([spec]))
            except ConfigError as e:
                raise ConfigError(f"{src}: security.executors.{f}: {str(e).removeprefix('--vgpu: ')}"
                                  ) from None
    except KeyFileError as e:
        raise ConfigError(f"{src}: {e}") from None
    return sec


def _ops_tables(top: _Table, cfg: ServeConfig, base: Path) -> None:
    """[ctl], [metrics] and [replan]: the operator's side of the daemon."""
    src = top.source
    ctl = top.sub("ctl")
    sock = ctl.get("socket", "", "str")
    if sock:
        p = Path(os.path.expanduser(sock))
        sock = str(p if p.is_absolute() else base / p)
        if len(sock) > 100:
            raise ConfigError(f"{src}: ctl.socket: path longer than 100 characters (unix socket limit)")
        for k in ("client", "executor", "ctl"):  # (the daemon then said another ppiped listened there)
            e = getattr(cfg, k)
            if e.startswith("ipc://") and os.path.normpath(os.path.abspath(e[6:])) == os.path.normpath(sock):
                raise ConfigError(f"{src}: ctl.socket: {sock} is also endpoints.{k}; each needs its own path")
    cfg.ctl_socket = sock
    mode = ctl.get("mode", "0660", "str")
    if not re.fullmatch(r"0?[0-7]{3}", mode) or int(mode, 8) & 0o600 != 0o600:
        raise ConfigError(f"{src}: ctl.mode: expected octal permissions like \"0660\" that let the "
                          f"owner read and write, got {mode!r}")
    cfg.ctl_mode = int(mode, 8)
    cfg.ctl_group = ctl.get("group", "", "str")
    ctl.done()
    met = top.sub("metrics")
    port = met.get("port", 0, "int0")
    if port > 65535:
        raise ConfigError(f"{src}: metrics.port: expected 0 (off) or a TCP port 1-65535, got {port}")
    cfg.metrics_port = port
    host = met.get("host", "127.0.0.1", "str")
    if host not in ("127.0.0.1", "::1", "localhost") and not cfg.allow_remote:
        raise ConfigError(f"{src}: metrics.host: {host!r} is not a loopback address "
                          "(set endpoints.allow_remote = true to listen elsewhere)")
    cfg.metrics_host = host
    met.done()
    rp = top.sub("replan")
    cfg.replan_auto = rp.get("auto", False, "bool")
    cfg.replan_min_interval_s = rp.get("min_interval_s", 60.0, "num+")
    cfg.replan_drift = rp.get("drift", 0.2, "num+")
    if cfg.replan_drift > 1:
        raise ConfigError(f"{src}: replan.drift: a share of the load between 0 and 1, got {cfg.replan_drift}")
    cfg.replan_ewma_s = rp.get("ewma_s", 10.0, "num+")
    cfg.replan_time_limit_s = rp.get("time_limit_s", 30.0, "num+")
    cfg.replan_algo = rp.get("algo", "ppipe", "str")
    if cfg.replan_algo not in ("ppipe", "np", "dart-r"):
        raise ConfigError(f"{src}: replan.algo: expected ppipe, np or dart-r, got {cfg.replan_algo!r}")
    flush = rp.get("flush_timeout_ms", 0, "int0")
    cfg.replan_flush_timeout_ms = float(flush)
    cfg.replan_preload_timeout_ms = float(rp.get("preload_timeout_ms", 60_000, "int0"))
    rp.done()


def tensor_frame_cap(cfg: ServeConfig, profiles: dict | None = None) -> tuple[int, str]:
    """The largest frame the executor and data sockets accept, and where the figure comes from.

    ``limits.max_tensor_bytes`` when set; else ``TENSOR_HEADROOM`` x the largest tensor any profile
    in ``profiles`` (the directory's, else the ones given) sends per request x its largest batch,
    at least ``TENSOR_CAP_FLOOR``: the daemon and its executors read the same directory, so they
    agree, and any plan of those models fits."""
    if cfg.max_tensor_bytes:
        return cfg.max_tensor_bytes, "limits.max_tensor_bytes"
    from ..profiles import load_profiles

    if cfg.profiles is not None:
        with contextlib.suppress(InputError, OSError, ValueError):
            profiles = load_profiles(cfg.profiles)
    if not profiles:
        return TENSOR_CAP_UNKNOWN, "default: no profiles to derive it from"
    need = 0
    for p in profiles.values():
        spec = p.input_spec() or {}
        per = max(int(p.boundary_bytes.max(initial=0)), int(spec.get("bytes", 0)))
        bs = max((a.shape[1] for sp in p.latency.values() for a in sp.values()), default=1)
        need = max(need, per * bs)
    cap = max(TENSOR_HEADROOM * need, TENSOR_CAP_FLOOR)
    return min(cap, MAX_TENSOR_BYTES), f"derived from the profiles ({TENSOR_HEADROOM} x {need} bytes)"


def load_config(path: str | Path) -> ServeConfig:
    path = Path(path)
    return config_from_dict(read_toml(path, ConfigError), path)


def format_ranges(vs: list[int]) -> str:
    """[0, 1, 2, 5] → '0-2,5' (log lines stay short for processes hosting many vGPUs)."""
    vs = sorted(vs)
    out, i = [], 0
    while i < len(vs):
        j = i
        while j + 1 < len(vs) and vs[j + 1] == vs[j] + 1:
            j += 1
        out.append(str(vs[i]) if i == j else f"{vs[i]}-{vs[j]}")
        i = j + 1
    return ",".join(out)


def parse_vgpus(items: list[str]) -> list[int]:
    """``--vgpu 3 --vgpu 8-11,14`` → [3, 8, 9, 10, 11, 14]."""
    out: list[int] = []
    for item in items:
        for part in item.split(","):
            part = part.strip()
            a, sep, b = part.partition("-")
            try:
                lo = int(a)
                hi = int(b) if sep else lo
            except ValueError:
                raise ConfigError(f"--vgpu: expected IDs or ranges like 0-7, got {part!r}") from None
            if lo < 0 or hi < lo:
                raise ConfigError(f"--vgpu: bad range {part!r}")
            out.extend(range(lo, hi + 1))
    if not out:
        raise ConfigError("--vgpu: at least one vGPU id is needed")
    if len(set(out)) != len(out):
        raise ConfigError("--vgpu: a vGPU id is given twice")
    return out
