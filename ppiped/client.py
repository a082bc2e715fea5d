"""Client library: submit a frame to a model, get its result or a typed error.

Asyncio::

    async with AsyncClient("tcp://127.0.0.1:5555") as c:
        r = await c.submit("resnet50", frame_bytes, slo_ms=80)   # Result, or raises
        print(r.data, r.arrays())

Blocking (any thread; the socket lives on a private event-loop thread)::

    with Client("tcp://127.0.0.1:5555") as c:
        r = c.submit("resnet50", frame_bytes)

Apps (multi-model queries the plan defines): ``await c.submit_query("plates", frame)`` returns a
:class:`QueryResult` with the leaf stages' outputs (every stage's with ``stages=True``); a query
that fails raises the same errors, with ``stage`` naming where it failed.

Errors: :class:`Dropped` (accepted, then not served in time: ``reason`` says why),
:class:`Rejected` (never admitted: unknown model, oversize payload, overloaded, bad input), and
``TimeoutError`` when no reply came within the client's timeout (the scheduler answers every
accepted request, so this means it is unreachable). Requests submitted in the same event-loop
turn for the same model travel in one message, which is what lets one client offer tens of
thousands of requests per second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import zmq

from . import wire
from .daemon.loop import Reader, now_us, send_parts
from .errors import InputError
from .security import Security, connect_as, load_keypair
from .wire import Status, T

Callback = Callable[[int, int, str, Any, Any], None]  # (id, status, reason, frame, meta)


class RequestError(Exception):
    """Base of the typed errors a request can end with; ``reason`` is a stable code. A query's
    error names its ``app`` and the ``stage`` it failed at ("" when it never started); ``detail``
    may say more."""

    def __init__(self, reason: str, model: str = "", stage: str = "", detail: str = "", app: str = "") -> None:
        where = f"app {app}" if app else (f"model {model}" if model else "")
        if stage:
            where += f", stage {stage}"
        super().__init__(f"{reason}" + (f" ({where})" if where else "") + (f": {detail}" if detail else ""))
        self.reason = reason
        self.model = model
        self.app = app
        self.stage = stage
        self.detail = detail


class Dropped(RequestError):
    """The scheduler accepted the request but could not serve it within its SLO."""


class Rejected(RequestError):
    """The scheduler refused the request (unknown model, payload too large, malformed, overloaded)."""


class Result:
    """A reply: ``data`` holds the raw output bytes; ``meta`` lists ``[dtype, shape, name]`` per output
    (None for emulated executors, which echo the input frame)."""

    __slots__ = ("data", "meta")

    def __init__(self, data: bytes, meta: Any) -> None:
        self.data = data
        self.meta = meta

    def arrays(self) -> list[np.ndarray]:
        """The outputs as numpy arrays, split by ``meta`` (one array per model output)."""
        if not self.meta:
            return [np.frombuffer(self.data, dtype=np.uint8)]
        out, off = [], 0
        try:
            for dtype, shape, _name in self.meta:
                dt = np.dtype(dtype)
                n = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
                out.append(np.frombuffer(self.data, dtype=dt, count=n // dt.itemsize, offset=off).reshape(shape))
                off += n
        except Exception as e:  # noqa: BLE001 - np.dtype parses strings itself (',' raised SyntaxError)
            raise ValueError(f"the reply's meta {wire.brief(self.meta)} does not describe its {len(self.data)} "
                             f"bytes: {type(e).__name__}: {e}") from None
        return out

    def __repr__(self) -> str:
        return f"Result({len(self.data)} bytes, meta={self.meta})"


class StageOutput(Result):
    """One output of a query: the ``stage`` whose request made it and that request's ``key`` in
    the query's tree (the root's is ``()``; the j-th input a glue call made of request ``k`` is
    ``k + (j,)``)."""

    __slots__ = ("stage", "key")

    def __init__(self, stage: str, key: tuple[int, ...], data: bytes, meta: Any) -> None:
        super().__init__(data, meta)
        self.stage = stage
        self.key = key

    def __repr__(self) -> str:
        return f"StageOutput({self.stage}{list(self.key)}, {len(self.data)} bytes)"


class QueryResult:
    """A query's answer: ``outputs``, the leaf stages' outputs ordered by stage (as the app lists
    them), then by key; ``stages``: every stage's outputs by stage name when asked for (else None)."""

    __slots__ = ("outputs", "stages")

    def __init__(self, outputs: list[StageOutput], stages: dict[str, list[StageOutput]] | None) -> None:
        self.outputs = outputs
        self.stages = stages

    def __repr__(self) -> str:
        return f"QueryResult({len(self.outputs)} outputs)"


# Retry of sends a DEALER could not take (no scheduler connected).
_RETRY_S = 0.005
# A scheduler silent this long (no PONG while requests are pending) is taken for gone.
UNREACHABLE_S = 2.0
# A pending request ends with this reason (Dropped) when its client is closed.
CLIENT_CLOSED = "client-closed"
# ERROR messages kept in ``AsyncClient.errors``, the latest first to stay.
ERRORS_KEPT = 1000
# Largest frame the client takes from the server (a result tensor; 2 GiB): libzmq drops a
# connection that sends a larger one before allocating it.
MAX_FRAME_BYTES = 1 << 31


def error_for(status: int, reason: str, model: str = "", stage: str = "", detail: str = "",
              app: str = "") -> RequestError:
    cls = Rejected if status == Status.REJECTED else Dropped
    return cls(reason, model, stage, detail, app)


# Largest SLO a client may ask for, µs (the wire carries it as an unsigned integer; a daemon
# refuses anything above its own limits.max_slo_ms with a reason).
MAX_SLO_US = 2**40


def _frame(frame: Any) -> Any:
    """``frame`` as something ZeroMQ sends as the request's bytes, or TypeError. An ndarray goes
    in C order and native byte order: its raw memory is what the executor reads, so a Fortran-
    ordered or big-endian array was served as another input (wrong answers, NaN)."""
    if isinstance(frame, np.ndarray):
        if not frame.dtype.isnative:
            frame = frame.astype(frame.dtype.newbyteorder("="))
        return np.ascontiguousarray(frame)
    if isinstance(frame, (bytes, bytearray)):
        return frame
    try:
        mv = memoryview(frame)
    except TypeError:
        raise TypeError(f"a frame is bytes or a numpy array, got {type(frame).__name__}") from None
    if not mv.c_contiguous:
        raise TypeError("a frame's memory must be contiguous (np.ascontiguousarray it)")
    return mv


def _slo_us(slo_ms: Any) -> int:
    """The SLO on the wire (0: the model's own), or ValueError / TypeError."""
    if slo_ms is None:
        return 0
    if isinstance(slo_ms, bool) or not isinstance(slo_ms, (int, float, np.integer, np.floating)):
        raise TypeError(f"slo_ms is a number of milliseconds, got {type(slo_ms).__name__}")
    us = float(slo_ms) * 1000.0
    if not 1.0 <= us <= MAX_SLO_US:  # NaN fails too
        raise ValueError(f"slo_ms must be within [0.001, {MAX_SLO_US / 1000:g}], got {slo_ms!r}")
    return int(us)


def _priority(priority: Any) -> int:
    if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
        raise TypeError(f"priority is 0 (low) or 1 (high), got {priority!r}")
    if priority not in (0, 1):
        raise ValueError(f"priority must be 0 (low) or 1 (high), got {priority!r}")
    return int(priority)


def _name(name: Any, what: str) -> str:
    if not isinstance(name, str) or not name:
        raise TypeError(f"{what} is a non-empty string, got {name!r}")
    return name


class ClientClosed(RuntimeError):
    """The client was closed: its pending requests ended with this, and it takes no more."""


class AsyncClient:
    """One DEALER connection to the scheduler; safe to use from one event loop."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", timeout_s: float | None = 30.0,
                 max_ids_per_message: int = 1024, key_file: str | None = None,
                 server_key_file: str | None = None, watch_s: float | None = 0.25) -> None:
        """``key_file`` (this client's ``.key_secret``) and ``server_key_file`` (the scheduler's
        ``.key``): CURVE, as a scheduler with ``security.curve`` requires. ``watch_s``: while
        requests are pending, PING this often; a scheduler that answers with another epoch has
        restarted and lost them (each ends ``Dropped('daemon-restarted')``), and one silent for
        ``UNREACHABLE_S`` ends them ``Dropped('daemon-unreachable')``: never a silent loss.
        Raises :class:`ppiped.errors.InputError` when a key file cannot be read."""
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.max_ids = max_ids_per_message
        self._sec: Security | None = None
        if key_file or server_key_file:
            if not (key_file and server_key_file):
                raise InputError("CURVE needs both the client's key_file and the server_key_file")
            self._sec = Security(curve=True, server=load_keypair(server_key_file, what="server key"),
                                 own=load_keypair(key_file, need_secret=True, what="client key"))
        self._ctx = zmq.Context()
        self._sock = self._new_socket()
        self._ids = itertools.count(1)
        self._pending: dict[int, Callback] = {}
        self._queries: dict[int, Callable[[int, str, str, str, list, list], None]] = {}
        self._out: dict[tuple[str, int, int], tuple[list[int], list]] = {}
        self._qout: list[list] = []  # QUERY messages waiting to be sent
        self._flush_scheduled = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._reader: Reader | None = None
        self._pings: dict[int, asyncio.Future] = {}
        # ERROR messages not tied to a request, the latest ERRORS_KEPT (a server sending nothing
        # else grew the list without bound)
        self.errors: deque[tuple[str, str]] = deque(maxlen=ERRORS_KEPT)
        self.watch_s = watch_s
        self.epoch: int | None = None  # the scheduler's, from its PONGs
        self._stamp = False  # its PONG says it refuses requests stamped with another epoch
        self._heard = 0.0  # monotonic time of the last message heard (or of the first pending request)
        self._watch_handle: asyncio.TimerHandle | None = None
        self._watch_tokens = itertools.count(-1, -1)  # watch pings: negative tokens
        self.max_payload_bytes: int | None = None  # the scheduler's, from its PONGs
        self.closed = False

    def _new_socket(self) -> zmq.Socket:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)  # refused before it is allocated
        if self._sec is not None:
            connect_as(sock, self._sec)
        sock.connect(self.endpoint)
        return sock

    def _reconnect(self) -> None:
        """A new connection, after every pending request was ended ``daemon-unreachable``: the
        old socket's unsent messages (queued while no scheduler was connected) are discarded
        with it, so requests this client gave up are never served later, and replies still due
        on the old connection never reach this one. The epoch is forgotten: the next PONG, from
        whichever scheduler answers, sets it without ending the requests sent meanwhile."""
        if self._reader is not None:
            self._reader.close()
        self._sock.close(0)
        self._sock = self._new_socket()
        self.epoch = None
        if self._loop is not None:
            self._reader = Reader(self._loop, self._sock, self._on_msg)

    @property
    def pending(self) -> int:
        return len(self._pending) + len(self._queries)

    def _attach(self) -> asyncio.AbstractEventLoop:
        if self.closed:
            raise ClientClosed(f"the client of {self.endpoint} is closed")
        loop = self._loop
        if loop is not None and loop is not asyncio.get_running_loop():
            raise RuntimeError("an AsyncClient serves the event loop it was first used on; make one per loop")
        if loop is None:
            loop = self._loop = asyncio.get_running_loop()
            self._reader = Reader(loop, self._sock, self._on_msg)
            if self.watch_s:
                self._heard = time.monotonic()
                self._watch_handle = loop.call_later(self.watch_s, self._watch)
            with contextlib.suppress(zmq.Again):  # learn the scheduler's limits and epoch early
                self._sock.send(wire.ping(next(self._watch_tokens)), zmq.NOBLOCK)
        return loop

    def _watch(self) -> None:
        """Ping while requests are pending; end them all if the scheduler restarted or went silent."""
        now = time.monotonic()
        if self._pending or self._queries:
            if now - self._heard > max(UNREACHABLE_S, 4 * self.watch_s):
                self._end_all(wire.DAEMON_UNREACHABLE)
                self._reconnect()
                self._heard = now
            else:
                with contextlib.suppress(zmq.Again):
                    self._sock.send(wire.ping(next(self._watch_tokens)), zmq.NOBLOCK)
                if self._reader is not None:
                    self._reader.kick()
        else:
            self._heard = now
        self._watch_handle = self._loop.call_later(self.watch_s, self._watch)

    def _end_all(self, reason: str) -> None:
        """End every pending request and query with ``reason``; those not sent yet never are."""
        self._out.clear()
        self._qout.clear()
        pending, self._pending = self._pending, {}
        for rid, cb in pending.items():
            cb(rid, Status.DROPPED, reason, None, None)
        queries, self._queries = self._queries, {}
        for qcb in queries.values():
            qcb(Status.DROPPED, reason, "", "", [], [])

    # --- submitting ---------------------------------------------------------------------------

    def submit_cb(self, model: str, frame: Any, slo_ms: float | None, cb: Callback, priority: int = 0) -> int:
        """Queue one request; ``cb(id, status, reason, frame, meta)`` runs once, on its reply.
        ``priority`` 1 is the high class: under overload the low class (0) is dropped first."""
        self._attach()
        # every check before the request is registered: a frame that cannot be sent once broke
        # the whole message it was batched into, and a bad SLO left a request pending forever
        model, frame = _name(model, "model"), _frame(frame)
        key = (model, _slo_us(slo_ms), _priority(priority))
        self._check_size(frame, model)
        rid = next(self._ids)
        self._pending[rid] = cb
        q = self._out.get(key)
        if q is None:
            q = self._out[key] = ([], [])
        q[0].append(rid)
        q[1].append(frame)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_soon(self.flush)
        return rid

    def _check_size(self, frame: Any, what: str) -> None:
        """Refuse a frame above the scheduler's max_payload_bytes here: libzmq drops a connection
        that sends one, silently, and the request never got an answer."""
        n = frame.nbytes if hasattr(frame, "nbytes") else len(frame)
        if self.max_payload_bytes is not None and n > self.max_payload_bytes:
            raise Rejected(wire.PAYLOAD_TOO_LARGE, what,
                           detail=f"frame of {n} bytes, the scheduler takes at most {self.max_payload_bytes}")

    def flush(self) -> None:
        """Send everything queued: one multipart per (model, SLO), at most ``max_ids`` requests each.
        Each carries this host's monotonic clock at the send (``sent_us``), so the scheduler can
        tell how long it queued before being read and start the SLO clock at the send.

        Never blocks the event loop: while the scheduler is unreachable (down, or refusing this
        client's CURVE key) a DEALER cannot take messages; what is left is retried shortly, and
        the requests' timeouts and the watcher still run."""
        self._flush_scheduled = False
        out, self._out = self._out, {}
        sock = self._sock
        # stamped with the scheduler epoch this client knows: if that scheduler is gone, this
        # client ends these requests when it hears of the new one, which refuses them unserved
        epoch = (self.epoch or 0) if self._stamp else 0
        while self._qout:
            q = self._qout[0]
            try:
                send_parts(sock, [wire.query(*q[0], sent_us=now_us(), epoch=epoch), q[1]], zmq.NOBLOCK)
            except zmq.Again:
                break
            self._qout.pop(0)
        for (model, slo_us, prio), (ids, frames) in out.items():
            for i in range(0, len(ids), self.max_ids):
                chunk = ids[i:i + self.max_ids]
                try:
                    send_parts(sock, [wire.submit(model, slo_us, chunk, prio, now_us(), epoch),
                                      *frames[i:i + self.max_ids]], zmq.NOBLOCK)
                except zmq.Again:
                    q = self._out.setdefault((model, slo_us, prio), ([], []))
                    q[0].extend(ids[i:])
                    q[1].extend(frames[i:])
                    break
        if (self._out or self._qout) and not self._flush_scheduled:
            self._flush_scheduled = True
            self._loop.call_later(_RETRY_S, self.flush)
        if self._reader is not None:
            self._reader.kick()

    async def submit(self, model: str, frame: Any, slo_ms: float | None = None,
                     timeout_s: float | None = -1.0, priority: int = 0) -> Result:
        """Serve ``frame`` with ``model``; the SLO defaults to the model's. Raises Dropped/Rejected."""
        loop = self._attach()
        fut = loop.create_future()

        def done(rid: int, status: int, reason: str, f: Any, meta: Any) -> None:
            if fut.done():
                return
            if status == Status.OK:
                fut.set_result(Result(f.bytes if hasattr(f, "bytes") else bytes(f), meta))
            else:
                # a refusal's or drop's text (the limit, the latency) rides where a result's meta would
                fut.set_exception(error_for(status, reason, model, detail=meta if isinstance(meta, str) else ""))

        rid = self.submit_cb(model, frame, slo_ms, done, priority)
        t = self.timeout_s if timeout_s == -1.0 else timeout_s
        try:
            return await asyncio.wait_for(fut, t) if t is not None else await fut
        except asyncio.TimeoutError:
            self._pending.pop(rid, None)
            raise TimeoutError(f"no reply from {self.endpoint} within {t} s") from None

    async def submit_many(self, model: str, frames: Sequence[Any], slo_ms: float | None = None,
                          priority: int = 0, timeout_s: float | None = -1.0) -> list[Result | RequestError | TimeoutError]:
        """Submit several frames at once; each entry is a Result or the error it ended with
        (a TimeoutError too: one late answer no longer loses the others)."""
        futs = [asyncio.ensure_future(self.submit(model, f, slo_ms, timeout_s, priority)) for f in frames]
        got = await asyncio.gather(*futs, return_exceptions=True)
        for g in got:  # a bad call (TypeError, ValueError) is the caller's, not an outcome
            if isinstance(g, BaseException) and not isinstance(g, (RequestError, TimeoutError)):
                raise g
        return list(got)

    async def submit_query(self, app: str, frame: Any, slo_ms: float | None = None, stages: bool = False,
                           priority: int = 0, timeout_s: float | None = -1.0) -> QueryResult:
        """Serve ``frame`` with ``app``, a tree of models with one end-to-end SLO (the plan's apps;
        ``info()["apps"]`` lists them). ``slo_ms``: at most the app's (its default).
        ``stages``: also return every stage's outputs (:attr:`QueryResult.stages`).
        ``priority`` 1: the high class for every stage request.

        Returns a :class:`QueryResult` with the leaf stages' outputs (none when glue made no
        children). Raises :class:`Rejected` (unknown-app, malformed, bad-input, overloaded, ...)
        or :class:`Dropped` (deadline, early-drop, no-capacity, glue-error, glue-timeout, failed,
        ...), each naming the app and the ``stage`` it failed at, or TimeoutError (no answer
        within ``timeout_s``; -1: the client's timeout)."""
        loop = self._attach()
        app, frame = _name(app, "app"), _frame(frame)
        slo_us, priority = _slo_us(slo_ms), _priority(priority)
        self._check_size(frame, app)
        fut = loop.create_future()
        qid = next(self._ids)

        def done(status: int, reason: str, stage: str, detail: str, entries: list, frames: list) -> None:
            if fut.done():
                return
            if status != Status.OK:
                fut.set_exception(error_for(status, reason, "", stage, detail, app))
                return
            outs: list[StageOutput] = []
            by: dict[str, list[StageOutput]] = {}
            for e, f in zip(entries, frames):  # noqa: B905 - checked by the reader
                o = StageOutput(e[0], tuple(e[1]), f.bytes if hasattr(f, "bytes") else bytes(f), e[3])
                by.setdefault(o.stage, []).append(o)
                if e[2]:
                    outs.append(o)
            fut.set_result(QueryResult(outs, by if stages else None))

        self._queries[qid] = done
        self._qout.append([(app, slo_us, qid, stages, priority), frame])
        if not self._flush_scheduled:
            self._flush_scheduled = True
            loop.call_soon(self.flush)
        t = self.timeout_s if timeout_s == -1.0 else timeout_s
        try:
            return await asyncio.wait_for(fut, t) if t is not None else await fut
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer from {self.endpoint} within {t} s") from None
        finally:
            self._queries.pop(qid, None)

    async def info(self, timeout_s: float = 5.0) -> dict:
        """Ask the scheduler what it serves: models with their SLOs, limits, protocol version."""
        loop = self._attach()
        token = next(self._ids)
        fut = loop.create_future()
        self._pings[token] = fut
        with contextlib.suppress(zmq.Again):  # unreachable: no answer, and the wait times out
            self._sock.send(wire.ping(token), zmq.NOBLOCK)
        self._reader.kick()
        try:
            return await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(f"no answer from {self.endpoint} within {timeout_s} s") from None
        finally:
            self._pings.pop(token, None)

    # --- replies ------------------------------------------------------------------------------

    def _on_msg(self, msg: list) -> None:
        try:
            h = wire.decode(msg[0])
        except wire.ProtocolError as e:
            self.errors.append((e.code, str(e)))
            return
        t = h.type
        # any message from the scheduler shows it is there (only PONGs counted: a client whose
        # PONGs queued behind a stream of replies gave its pending requests up as unreachable)
        self._heard = time.monotonic()
        if t == T.REPLY:
            ids, status, reason, meta = h.ids, h.status, h.reason, h.meta
            pending = self._pending
            if status == Status.OK:
                if len(msg) - 1 != len(ids):
                    self.errors.append((wire.MALFORMED, "REPLY frame count mismatch"))
                    return
                for rid, f in zip(ids, msg[1:]):  # noqa: B905 - lengths checked above
                    cb = pending.pop(rid, None)
                    if cb is not None:
                        cb(rid, status, reason, f, meta)
            else:
                for rid in ids:
                    cb = pending.pop(rid, None)
                    if cb is not None:
                        cb(rid, status, reason, None, meta)
        elif t == T.ANSWER:
            qid, status, reason, stage, detail, entries = h.qid, h.status, h.reason, h.stage, h.detail, h.outputs
            qcb = self._queries.pop(qid, None)
            if qcb is None:
                return
            if status == Status.OK and (len(msg) - 1 != len(entries) or not all(
                    type(e) is list and len(e) == 4 and type(e[0]) is str and type(e[1]) is list
                    for e in entries)):
                qcb(Status.DROPPED, wire.MALFORMED, "", "ANSWER outputs do not match its frames", [], [])
                return
            qcb(status, reason, stage, detail, entries, msg[1:])
        elif t == T.PONG:
            epoch = h.info.get("epoch")
            if epoch is not None:
                if self.epoch is not None and epoch != self.epoch:
                    # every request sent so far carries the old epoch: the new scheduler never
                    # saw them or refuses them unserved (so ending them all agrees with it)
                    self._end_all(wire.DAEMON_RESTARTED)
                self.epoch = epoch
                self._stamp = h.info.get("checks_epoch") is True
            mp = h.info.get("max_payload_bytes")
            if isinstance(mp, int) and not isinstance(mp, bool) and mp > 0:
                self.max_payload_bytes = mp
            fut = self._pings.get(h.token) if type(h.token) is int else None  # (ours are ints; a
            # list or map from a broken server raised out of the reader)
            if fut is not None and not fut.done():
                fut.set_result(h.info)
        elif t == T.ERROR:
            self.errors.append((h.code, h.message))

    async def close(self) -> None:
        """End every pending request and query ``Dropped('client-closed')``, then close the
        socket; later calls raise :class:`ClientClosed`."""
        if self.closed:
            return
        self.closed = True
        self._end_all(CLIENT_CLOSED)
        for fut in self._pings.values():
            if not fut.done():
                fut.set_exception(ClientClosed(f"the client of {self.endpoint} was closed"))
        if self._watch_handle is not None:
            self._watch_handle.cancel()
        if self._reader is not None:
            self._reader.close()
        self._sock.close(0)
        self._ctx.term()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


class Client:
    """Blocking client: every call runs on a private event-loop thread, so any thread may call it."""

    def __init__(self, endpoint: str = "tcp://127.0.0.1:5555", timeout_s: float | None = 30.0,
                 key_file: str | None = None, server_key_file: str | None = None) -> None:
        """As :class:`AsyncClient`."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="ppiped-client", daemon=True)
        self._thread.start()
        self._ac = self._call(self._make(endpoint, timeout_s, key_file, server_key_file))

    @staticmethod
    async def _make(endpoint: str, timeout_s: float | None, key_file: str | None,
                    server_key_file: str | None) -> AsyncClient:
        return AsyncClient(endpoint, timeout_s, key_file=key_file, server_key_file=server_key_file)

    def _call(self, coro: Any) -> Any:
        if self._loop.is_closed():
            coro.close()
            raise ClientClosed("the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def submit(self, model: str, frame: Any, slo_ms: float | None = None, priority: int = 0,
               timeout_s: float | None = -1.0) -> Result:
        """Serve ``frame`` with ``model``; raises :class:`Dropped` / :class:`Rejected` / TimeoutError
        (``timeout_s`` -1: the client's)."""
        return self._call(self._ac.submit(model, frame, slo_ms, timeout_s, priority))

    def submit_many(self, model: str, frames: Sequence[Any], slo_ms: float | None = None,
                    priority: int = 0, timeout_s: float | None = -1.0) -> list[Result | RequestError | TimeoutError]:
        return self._call(self._ac.submit_many(model, frames, slo_ms, priority, timeout_s))

    def submit_query(self, app: str, frame: Any, slo_ms: float | None = None, stages: bool = False,
                     priority: int = 0, timeout_s: float | None = -1.0) -> QueryResult:
        """As :meth:`AsyncClient.submit_query`: a :class:`QueryResult`, or raises
        :class:`Dropped` / :class:`Rejected` (with the ``stage``) / TimeoutError."""
        return self._call(self._ac.submit_query(app, frame, slo_ms, stages, priority, timeout_s))

    def info(self, timeout_s: float = 5.0) -> dict:
        return self._call(self._ac.info(timeout_s))

    def close(self) -> None:
        """End every pending call (each raises ``Dropped('client-closed')``), then stop."""
        if self._loop.is_closed():
            return
        self._call(self._ac.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
