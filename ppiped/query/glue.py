"""Glue: user code that turns a stage's outputs into the next stage's inputs, run in worker
processes, never in the scheduler's event loop.

The contract
------------
An app's stage after the root names a glue callable ``"module:function"`` (importable where the
daemon runs). For every request of the parent stage that ends with a result, the daemon calls::

    fn(outputs, frame, spec) -> list of child inputs

* ``outputs``: the parent request's outputs, a list of read-only numpy arrays, one per model
  output, each with its per-request shape and dtype from the result's tensor meta (ORT and
  TensorRT executors send it). An executor that sends no meta (the emulator, which echoes its
  input) gives one flat ``uint8`` array of the raw bytes.
* ``frame``: the client's original frame, a read-only numpy array shaped as the root model's
  input (``spec.frame_shape``, ``spec.frame_dtype``) when the root model's profile records its
  input and the frame has that size; else a flat ``uint8`` array of its bytes.
* ``spec``: a :class:`GlueSpec`: the app, the stage it makes inputs for (and its model's input
  ``shape`` / ``dtype`` / ``bytes`` where known), the parent stage, the frame's spec.

It returns a list (any iterable but a single array, bytes or str) of zero or more child inputs,
each ``bytes``-like or a numpy array. An array is cast to the child model's input dtype where it
is known (``same_kind`` casting: float64 to float32 is fine, float to int is an error) and sent in
C order; where the input size is known (the child model's profile, or ``[models.NAME]
input_bytes``), every child must have exactly that many bytes. At most ``glue.max_children``
children. A glue that raises, returns something else, or breaks these rules fails its query
``glue-error`` naming the stage; one that runs past ``glue.timeout_ms`` fails it ``glue-timeout``
and its worker is killed and replaced. Glue must be a pure function of its arguments: a worker
may run any query's calls, and is replaced at any time.

Why not the standard pools: ``concurrent.futures.ProcessPoolExecutor`` can neither stop one
running call (a timed-out glue would hold its worker for good) nor survive a worker's death (one
crash breaks the whole pool and fails every pending call); ``multiprocessing.Process`` either
forks the daemon (copying its ZeroMQ I/O threads' state half-way) or, to spawn, re-imports the
caller's ``__main__`` in each worker (which fails or re-runs code when the daemon is embedded in
a script or a test). So each worker here is a fresh interpreter started with ``subprocess``
(``python -c``, the daemon's ``sys.path``), talking over a socket pair framed and pickled by
``multiprocessing.connection.Connection``. The pool kills and replaces just the worker that hung
or died, and the daemon reads the sockets from its event loop (``add_reader``): no thread.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import json
import multiprocessing.connection
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import logs
from ..wire import brief

if TYPE_CHECKING:
    from .app import App

log = logs.get("ppiped.glue")

Done = Callable[[list[bytes] | None, str, str], None]  # (children or None, reason, detail)

GLUE_ERROR = "glue-error"  # as ppiped.wire's (the worker side does not import the wire)
GLUE_TIMEOUT = "glue-timeout"
DEADLINE = "deadline"
SHUTDOWN = "shutdown"
SWEEP_S = 0.02  # how often calls waiting for a worker are checked against their deadlines


@dataclass(frozen=True)
class GlueSpec:
    """What a glue call is told besides the data (its third argument)."""

    app: str
    stage: str  # the stage whose inputs this call makes
    parent: str  # the stage whose outputs it reads
    model: str  # ``stage``'s model
    shape: tuple[int, ...] | None = None  # that model's input per request (no batch axis), if known
    dtype: str | None = None
    bytes: int = 0  # its size per request; 0: not known (not checked)
    frame_shape: tuple[int, ...] | None = None  # the root model's input: how ``frame`` is decoded
    frame_dtype: str | None = None


class GlueError(Exception):
    """A glue call's result breaks the contract (the message says how)."""


def load_callable(ref: str) -> Callable[..., Any]:
    """Import ``module:function``; raises ImportError, AttributeError or TypeError."""
    module, _, name = ref.partition(":")
    if not module or not name:
        raise TypeError(f"{ref!r} is not 'module:function'")
    fn = getattr(importlib.import_module(module), name)
    if not callable(fn):
        raise TypeError(f"{ref} is a {type(fn).__name__}, not a callable")
    return fn


def glue_problems(apps: Iterable[Any]) -> list[tuple[Any, Any, str]]:
    """(app, stage, why) for every stage whose glue callable does not load here, as a glue
    worker would load it: what the daemon would refuse at start, found before."""
    out = []
    for a in apps:
        for s in a.stages:
            if s.glue:
                try:
                    load_callable(s.glue)
                except Exception as e:  # noqa: BLE001 - any failure of user code to import is the answer
                    out.append((a, s, f"{type(e).__name__}: {e}"))
    return out


def split_outputs(data: bytes, meta: Any) -> list[np.ndarray]:
    """A result frame as arrays, one per ``[dtype, shape, name]`` of ``meta`` (per-request shapes,
    concatenated in order); no meta: one flat uint8 array."""
    if not meta:
        return [np.frombuffer(data, dtype=np.uint8)]
    out, off = [], 0
    try:
        for dtype, shape, _name in meta:
            dt = np.dtype(dtype)
            n = int(np.prod(shape, dtype=np.int64))
            out.append(np.frombuffer(data, dtype=dt, count=n, offset=off).reshape(shape))
            off += n * dt.itemsize
    except Exception as e:  # noqa: BLE001 - np.dtype parses strings itself (',' raised SyntaxError)
        raise GlueError(f"the parent's output ({len(data)} bytes) does not match its meta {brief(meta)}: "
                        f"{type(e).__name__}: {e}") from None
    if off != len(data):
        raise GlueError(f"the parent's output has {len(data)} bytes, its meta {brief(meta)} describes {off}")
    return out


def glue_spec(app: App, i: int, inputs: Mapping[str, Mapping[str, Any] | None],
              input_bytes: int = 0) -> GlueSpec:
    """The spec of the glue making stage ``i``'s inputs, from the models' inputs by model name
    (:meth:`ppiped.profiles.Profile.input_spec` dicts; None or absent: unknown). ``input_bytes``
    overrides the stage model's size (``[models.NAME] input_bytes``). One builder for the daemon
    and the by-hand runner, so glue sees the same spec in both."""
    stage = app.stages[i]
    spec, fspec = inputs.get(stage.model), inputs.get(app.stages[0].model)
    return GlueSpec(app.name, stage.name, app.stages[stage.parent].name, stage.model,
                    tuple(spec["shape"]) if spec else None, spec["dtype"] if spec else None,
                    input_bytes or (int(spec["bytes"]) if spec else 0),
                    tuple(fspec["shape"]) if fspec else None, fspec["dtype"] if fspec else None)


def pack_outputs(outputs: Iterable[tuple[str, np.ndarray]]) -> tuple[bytes, list]:
    """One request's outputs ``(name, array)`` in model order (batch axis removed) as an executor
    sends them: the arrays' bytes back to back and their ``[dtype, shape, name]`` meta, which
    :func:`split_outputs` reverses."""
    arrays = [(n, np.ascontiguousarray(a)) for n, a in outputs]
    return (b"".join(a.tobytes() for _, a in arrays),
            [[a.dtype.str, list(a.shape), n] for n, a in arrays])


def child_input(data: bytes, spec: GlueSpec) -> np.ndarray:
    """A child :func:`run_glue` made, as the array the child model is fed: its input's shape and
    dtype where ``spec`` knows them, else flat ``uint8``."""
    if spec.shape is not None and spec.dtype:
        return np.frombuffer(data, dtype=np.dtype(spec.dtype)).reshape(spec.shape)
    return np.frombuffer(data, dtype=np.uint8)


def decode_frame(frame: bytes, spec: GlueSpec) -> np.ndarray:
    """The client's frame as the root model's input where its spec is known and fits."""
    if spec.frame_shape is not None and spec.frame_dtype:
        dt = np.dtype(spec.frame_dtype)
        if int(np.prod(spec.frame_shape, dtype=np.int64)) * dt.itemsize == len(frame):
            return np.frombuffer(frame, dtype=dt).reshape(spec.frame_shape)
    return np.frombuffer(frame, dtype=np.uint8)


def run_glue(fn: Callable[..., Any], data: bytes, meta: Any, frame: bytes, spec: GlueSpec,
             max_children: int) -> list[bytes]:
    """One glue call under the contract (module docstring): the children as bytes, or GlueError."""
    res = fn(split_outputs(data, meta), decode_frame(frame, spec), spec)
    if res is None or isinstance(res, (bytes, bytearray, memoryview, str, np.ndarray, dict)):
        raise GlueError(f"returned {type(res).__name__!r}; a glue returns a list of child inputs")
    try:
        items = list(res) if isinstance(res, Iterable) else None
    except Exception as e:  # a generator that raised
        raise GlueError(f"{type(e).__name__}: {e}") from None
    if items is None:
        raise GlueError(f"returned {type(res).__name__!r}; a glue returns a list of child inputs")
    if len(items) > max_children:
        raise GlueError(f"returned {len(items)} children, more than glue.max_children = {max_children}")
    return [_child(x, spec, j) for j, x in enumerate(items)]


def _child(x: Any, spec: GlueSpec, j: int) -> bytes:
    if isinstance(x, np.ndarray):
        if spec.dtype:
            try:
                x = x.astype(spec.dtype, casting="same_kind", copy=False)
            except TypeError:
                raise GlueError(f"child {j}: dtype {x.dtype}, and model {spec.model!r} takes "
                                f"{spec.dtype}") from None
        b = np.ascontiguousarray(x).tobytes()
    elif isinstance(x, (bytes, bytearray, memoryview)):
        b = bytes(x)
    else:
        raise GlueError(f"child {j} is a {type(x).__name__}; children are bytes or numpy arrays")
    if spec.bytes and len(b) != spec.bytes:
        shape = f" {list(spec.shape)} {spec.dtype}" if spec.shape is not None else ""
        raise GlueError(f"child {j} has {len(b)} bytes; model {spec.model!r} takes{shape} {spec.bytes}")
    return b


# --- the worker process ----------------------------------------------------------------------


def _worker_main(fd: int, args: str) -> None:
    """A worker's entry point (``python -c``): socket ``fd`` to the daemon, ``args`` JSON."""
    a = json.loads(args)
    sys.path[:] = a["path"]
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the daemon decides when workers stop
    with contextlib.suppress(Exception):  # Linux: SIGKILL when the daemon dies, even by SIGKILL
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != a["parent"]:
        return
    _worker(multiprocessing.connection.Connection(fd), a["refs"], a["max_children"])


def _worker(conn: multiprocessing.connection.Connection, refs: list[str], max_children: int) -> None:
    """Import every callable, say which failed, then serve calls until the socket closes."""
    fns: dict[str, Callable[..., Any]] = {}
    errors: dict[str, str] = {}
    for ref in refs:
        try:
            fns[ref] = load_callable(ref)
        except BaseException as e:  # noqa: BLE001 - any failure of user code is reported, not fatal
            errors[ref] = f"{type(e).__name__}: {e}"
    conn.send(("ready", errors))
    while True:
        try:
            cid, ref, data, meta, frame, spec = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn = fns.get(ref)
            if fn is None:
                raise GlueError(f"cannot import {ref}: {errors.get(ref, 'not configured')}")
            out: Any = (cid, True, run_glue(fn, data, meta, frame, spec, max_children))
        except GlueError as e:
            out = (cid, False, str(e))
        except BaseException as e:  # noqa: BLE001 - user code: anything it raises is its error
            tb = traceback.extract_tb(e.__traceback__)
            where = f" (at {os.path.basename(tb[-1].filename)}:{tb[-1].lineno})" if tb else ""
            out = (cid, False, f"{type(e).__name__}: {e}{where}")
        try:
            conn.send(out)
        except (OSError, ValueError):
            return


# --- the pool (daemon side) ------------------------------------------------------------------


class _Call:
    __slots__ = ("id", "ref", "data", "meta", "frame", "spec", "deadline_us", "done", "timer")

    def __init__(self, cid: int, ref: str, data: bytes, meta: Any, frame: bytes, spec: GlueSpec,
                 deadline_us: int, done: Done) -> None:
        self.id, self.ref, self.data, self.meta, self.frame, self.spec = cid, ref, data, meta, frame, spec
        self.deadline_us, self.done = deadline_us, done
        self.timer: Any = None


class _Worker:
    __slots__ = ("proc", "conn", "ready", "call", "rbuf", "wbuf", "writing")

    def __init__(self, proc: subprocess.Popen, conn: multiprocessing.connection.Connection) -> None:
        self.proc, self.conn = proc, conn
        self.ready = False
        self.call: _Call | None = None
        self.rbuf = bytearray()  # bytes read, not yet a whole message
        self.wbuf = bytearray()  # bytes to send, once the socket takes them
        self.writing = False  # a writer callback is registered for wbuf


def _framed(obj: Any) -> bytes:
    """``obj`` pickled and framed as ``multiprocessing.connection.Connection.send`` frames it
    (what the worker's blocking ``recv`` reads)."""
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    n = len(data)
    head = struct.pack("!i", n) if n <= 0x7FFFFFFF else struct.pack("!iQ", -1, n)
    return head + data


def _unframe(buf: bytearray) -> list[Any]:
    """Every whole message at the front of ``buf`` (removed from it), unpickled; a partial one
    stays for the next read."""
    out = []
    while len(buf) >= 4:
        (n,) = struct.unpack_from("!i", buf)
        head = 4
        if n == -1:
            if len(buf) < 12:
                break
            (n,) = struct.unpack_from("!Q", buf, 4)
            head = 12
        if len(buf) < head + n:
            break
        out.append(pickle.loads(bytes(buf[head:head + n])))
        del buf[:head + n]
    return out


def _now_us() -> int:
    return time.monotonic_ns() // 1000  # the daemon's clock (ppiped.daemon.loop.now_us)


class GluePool:
    """``workers`` glue processes serving every callable in ``refs``; see the module docstring.

    Life cycle: :meth:`start` (blocking, before serving: says which callables failed to import),
    :meth:`attach` to the event loop, :meth:`call` from it, :meth:`close`. Every call's ``done``
    runs exactly once, on the loop: ``done(children, "", "")``, or ``done(None, reason, detail)``
    with reason ``glue-error``, ``glue-timeout``, ``deadline`` (it waited for a worker past
    ``deadline_us``) or ``shutdown``.
    """

    def __init__(self, refs: Sequence[str], workers: int = 2, timeout_s: float = 1.0,
                 max_children: int = 256) -> None:
        self.refs = sorted(set(refs))
        self.n = max(1, workers)
        self.timeout_s = timeout_s
        self.max_children = max_children
        self.workers: list[_Worker] = []
        self.queue: deque[_Call] = deque()
        self.loop: Any = None
        self.ids = itertools.count(1)
        self.closed = False
        self.sweep: Any = None  # the timer answering calls that waited past their deadline
        self.stats = {"calls": 0, "ok": 0, "errors": 0, "timeouts": 0, "late": 0, "restarts": 0}

    def _spawn(self) -> _Worker:
        mine, theirs = socket.socketpair()
        args = json.dumps({"path": sys.path, "refs": self.refs, "max_children": self.max_children,
                           "parent": os.getpid()})
        code = f"from ppiped.query.glue import _worker_main; _worker_main({theirs.fileno()}, {args!r})"
        try:
            p = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                 stdin=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        w = _Worker(p, multiprocessing.connection.Connection(mine.detach()))
        self.workers.append(w)
        if self.loop is not None:
            self._watch(w)
        return w

    def _watch(self, w: _Worker) -> None:
        """Read ``w`` from the loop. The socket is made non-blocking (uvloop does so anyway):
        the loop must never wait for a message that is only partly there, in or out, so it
        reads and writes whole frames through buffers (:meth:`_readable`, :meth:`_send`)."""
        os.set_blocking(w.conn.fileno(), False)
        self.loop.add_reader(w.conn.fileno(), self._readable, w)

    def start(self, timeout_s: float = 60.0) -> dict[str, str]:
        """Start the workers and wait until each has imported the callables (blocking). Returns
        ``{ref: error}`` for those that failed to import (empty: all good); raises RuntimeError
        if a worker does not come up within ``timeout_s``."""
        for _ in range(self.n):
            self._spawn()
        errors: dict[str, str] = {}
        end = time.monotonic() + timeout_s
        waiting = {w.conn: w for w in self.workers}
        while waiting:
            left = end - time.monotonic()
            ready = multiprocessing.connection.wait(list(waiting), max(0.0, left))
            if not ready:
                self.close()
                raise RuntimeError(f"glue workers did not start within {timeout_s:g} s")
            for c in ready:
                w = waiting.pop(c)
                try:
                    kind, errs = c.recv()
                except (EOFError, OSError):
                    self.close()
                    raise RuntimeError(f"a glue worker died while starting (exit code "
                                       f"{w.proc.poll()})") from None
                w.ready = kind == "ready"
                errors.update(errs)
        return errors

    def attach(self, loop: Any) -> None:
        """Read the workers' pipes from ``loop`` (the daemon's), where every ``done`` then runs."""
        self.loop = loop
        for w in self.workers:
            self._watch(w)

    def status(self) -> dict[str, int]:
        """Counts since start (calls, ok, errors, timeouts, late, restarts) and the workers now:
        all of them, those ready (imports done), those busy, and the calls waiting for one."""
        ws = self.workers
        return {**self.stats, "workers": len(ws), "ready": sum(1 for w in ws if w.ready),
                "busy": sum(1 for w in ws if w.call is not None), "queued": len(self.queue)}

    def call(self, ref: str, data: bytes, meta: Any, frame: bytes, spec: GlueSpec, done: Done,
             deadline_us: int = 0) -> None:
        """Run ``ref`` on a parent's output ``data`` (+ ``meta``) and the query's ``frame``; a call
        still waiting for a worker at ``deadline_us`` (monotonic µs; 0: none) is not run."""
        self.stats["calls"] += 1
        c = _Call(next(self.ids), ref, data, meta, frame, spec, deadline_us, done)
        if self.closed:
            self._end(c, None, SHUTDOWN, "the daemon is stopping")
            return
        self.queue.append(c)
        self._pump()

    def _pump(self) -> None:
        for w in self.workers:
            if not self.queue:
                return
            if w.ready and w.call is None:
                self._run(w)
        if self.queue and self.sweep is None and self.loop is not None:
            self.sweep = self.loop.call_later(SWEEP_S, self._sweep)

    def _sweep(self) -> None:
        """Every ``SWEEP_S`` while calls wait for a worker: answer those past their deadline now,
        not when a worker frees (a slow glue or a worker being replaced may take long)."""
        self.sweep = None
        if self.closed:
            return
        t = _now_us()
        late = [c for c in self.queue if c.deadline_us and t >= c.deadline_us]
        if late:
            gone = set(map(id, late))
            self.queue = deque(c for c in self.queue if id(c) not in gone)
            for c in late:
                self.stats["late"] += 1
                self._end(c, None, DEADLINE, "waited for a glue worker past the query's deadline")
        if self.queue:
            self.sweep = self.loop.call_later(SWEEP_S, self._sweep)

    def _run(self, w: _Worker) -> None:
        q = self.queue
        while q:
            c = q.popleft()
            if c.deadline_us and _now_us() >= c.deadline_us:
                self.stats["late"] += 1
                self._end(c, None, DEADLINE, "waited for a glue worker past the query's deadline")
                continue
            if not self._send(w, (c.id, c.ref, c.data, c.meta, c.frame, c.spec)):
                q.appendleft(c)  # it died: the reader sees EOF and replaces it
                w.ready = False
                return
            w.call = c
            c.timer = self.loop.call_later(self.timeout_s, self._timeout, w, c)
            return

    def _send(self, w: _Worker, obj: Any) -> bool:
        """Queue ``obj`` for worker ``w`` and send what the socket takes now; the rest goes when
        it is writable. False: the socket is broken (the worker died)."""
        w.wbuf += _framed(obj)
        return self._flush(w)

    def _flush(self, w: _Worker) -> bool:
        fd = w.conn.fileno()
        try:
            while w.wbuf:
                n = os.write(fd, w.wbuf)
                del w.wbuf[:n]
        except BlockingIOError:
            pass
        except (OSError, ValueError):
            w.wbuf.clear()
            self._unwrite(w)
            return False
        if w.wbuf and not w.writing:
            self.loop.add_writer(fd, self._flush, w)
            w.writing = True
        elif not w.wbuf:
            self._unwrite(w)
        return True

    def _unwrite(self, w: _Worker) -> None:
        if w.writing:
            w.writing = False
            with contextlib.suppress(Exception):
                self.loop.remove_writer(w.conn.fileno())

    def _readable(self, w: _Worker) -> None:
        """Read what is there; handle every whole message; a worker gone (EOF) or sending
        something unreadable is replaced."""
        eof = False
        try:
            while True:
                data = os.read(w.conn.fileno(), 1 << 20)
                if not data:
                    eof = True
                    break
                w.rbuf += data
        except BlockingIOError:
            pass
        except (OSError, ValueError):
            eof = True
        try:
            msgs = _unframe(w.rbuf)
        except Exception as e:  # an unpicklable message: treat the worker as broken
            self._replace(w, GLUE_ERROR, f"unreadable message from the glue worker: {e}")
            return
        for msg in msgs:
            if w not in self.workers:
                return
            self._on_message(w, msg)
        if eof and w in self.workers:
            code = None
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = w.proc.wait(0.1)
            self._replace(w, GLUE_ERROR, f"the glue worker died (exit code {code})")

    def _on_message(self, w: _Worker, msg: Any) -> None:
        if not w.ready:
            w.ready = True  # a replacement's ("ready", errors): its imports are the start's
            self._pump()
            return
        c = w.call
        if c is None or type(msg) is not tuple or len(msg) != 3 or msg[0] != c.id:
            return
        w.call = None
        c.timer.cancel()
        _, ok, out = msg
        if ok:
            self.stats["ok"] += 1
            self._end(c, out, "", "")
        else:
            self.stats["errors"] += 1
            self._end(c, None, GLUE_ERROR, str(out))
        if self.queue:
            self._run(w)

    def _timeout(self, w: _Worker, c: _Call) -> None:
        if w.call is not c:
            return
        self.stats["timeouts"] += 1
        self._replace(w, GLUE_TIMEOUT, f"{c.ref} ran past glue.timeout_ms = {self.timeout_s * 1000:g}")

    def _replace(self, w: _Worker, reason: str, detail: str) -> None:
        """Kill worker ``w`` (hung, dead or broken), answer its call, start another."""
        c, w.call = w.call, None
        self._drop(w)
        if c is not None:
            if c.timer is not None:
                c.timer.cancel()
            if reason == GLUE_ERROR:
                self.stats["errors"] += 1
            self._end(c, None, reason, detail)
        if not self.closed:
            self.stats["restarts"] += 1
            self._spawn()

    def _drop(self, w: _Worker) -> None:
        if self.loop is not None:
            self._unwrite(w)
            with contextlib.suppress(Exception):
                self.loop.remove_reader(w.conn.fileno())
        with contextlib.suppress(Exception):
            w.conn.close()
        if w.proc.poll() is None:
            w.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            w.proc.wait(1.0)
        if w in self.workers:
            self.workers.remove(w)

    @staticmethod
    def _end(c: _Call, out: list[bytes] | None, reason: str, detail: str) -> None:
        c.data = c.frame = b""
        try:
            c.done(out, reason, detail)
        except Exception:  # the caller's bug must not wedge the pool (its queue would stall)
            log.error("glue-callback-failed", exc=True, ref=c.ref)

    def close(self) -> None:
        """Answer every waiting and running call ``shutdown`` and stop the workers."""
        self.closed = True
        if self.sweep is not None:
            self.sweep.cancel()
            self.sweep = None
        while self.queue:
            self._end(self.queue.popleft(), None, SHUTDOWN, "the daemon is stopping")
        for w in list(self.workers):
            c, w.call = w.call, None
            self._drop(w)
            if c is not None:
                if c.timer is not None:
                    c.timer.cancel()
                self._end(c, None, SHUTDOWN, "the daemon is stopping")
