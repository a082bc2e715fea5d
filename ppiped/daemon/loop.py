"""Event-loop plumbing shared by the scheduler and the executors.

* :func:`now_us`: the one clock, CLOCK_MONOTONIC in integer microseconds.
* :class:`Timers`: sub-millisecond timers. libuv (and asyncio's selector) round timeouts to whole
  milliseconds, which would add up to 1 ms to every wait-until and every emulated inference; a
  Linux ``timerfd`` armed for the earliest deadline wakes the loop within tens of microseconds.
* :class:`Reader`: drains a ZeroMQ socket from the loop. ZeroMQ's FD is edge-triggered, so every
  wake-up reads until EAGAIN (or its time budget, then it comes back next turn), and code that
  sends on a socket calls :meth:`Reader.kick` so an edge consumed by the send is not lost.
* :func:`zmq_context` / :func:`pin_this_thread`: where the I/O and event-loop threads run. On one
  shared CPU the kernel's fair scheduler lets a busy ZeroMQ I/O thread run on for a millisecond or
  more while the loop holds requests; apart, neither waits for the other.
* :func:`send_parts` / :func:`recv_parts`: multipart send and receive through pyzmq's compiled
  socket directly. pyzmq's Python layer (``send_multipart``) costs several µs per frame in flag
  enums and checks, more than the send itself; a dispatch has a frame per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import heapq
import itertools
import os
import signal
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import zmq
from zmq.backend import Socket as _BackendSocket

from .. import logs

_log = logs.get("ppiped.loop")


def now_us() -> int:
    return time.monotonic_ns() // 1000


_bsend = _BackendSocket.send
_brecv = _BackendSocket.recv
_bget = _BackendSocket.get
SNDMORE = int(zmq.SNDMORE)
NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)
ZERO_COPY_BYTES = 1 << 16  # smaller frames are copied: cheaper than zero-copy bookkeeping


def on_stop_signals(loop: asyncio.AbstractEventLoop, stop: Callable[[], None], log: Any) -> None:
    """SIGTERM and SIGINT stop gracefully; SIGHUP (a reload, to many operators) is logged and
    ignored: its default action killed the process on the spot, unanswered requests and stale
    sockets left behind, and systemd's ``Restart=on-failure`` takes a SIGHUP death for a clean
    exit, so the service stayed down."""
    def hup() -> None:
        log.warning("sighup-ignored", why="no reload: change the plan with ppiped-ctl replan, "
                    "the config with a restart")

    for sig, fn in ((signal.SIGTERM, stop), (signal.SIGINT, stop), (signal.SIGHUP, hup)):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, fn)


def unavailable_cpus(cpus: Sequence[int]) -> list[int]:
    """The CPUs of ``cpus`` this process may not run on (libzmq aborts on such an I/O affinity)."""
    allowed = os.sched_getaffinity(0)
    return [c for c in cpus if c not in allowed]


def zmq_context(io_threads: int = 1, io_cpus: Sequence[int] = ()) -> zmq.Context:
    """A context whose I/O threads run on ``io_cpus`` (empty: wherever this process may run)."""
    ctx = zmq.Context(io_threads=io_threads)
    for c in io_cpus:  # must precede the first socket: the I/O threads start with it
        ctx.set(zmq.THREAD_AFFINITY_CPU_ADD, c)
    return ctx


def pin_this_thread(cpus: Sequence[int]) -> None:
    """Keep the calling thread (only it: Linux applies pid 0 to the caller) on ``cpus``."""
    os.sched_setaffinity(0, cpus)


def send_parts(sock: zmq.Socket, parts: list, flags: int = 0) -> None:
    """``sock.send_multipart(parts)``; received ``zmq.Frame`` parts are passed on without a copy."""
    last = len(parts) - 1
    more = flags | SNDMORE
    for i in range(last):
        p = parts[i]
        _bsend(sock, p, more, len(p) < ZERO_COPY_BYTES, False)
    p = parts[last]
    _bsend(sock, p, flags, len(p) < ZERO_COPY_BYTES, False)


def recv_parts(sock: zmq.Socket, flags: int = NOBLOCK) -> list:
    """``sock.recv_multipart(flags, copy=False)``: a list of ``zmq.Frame``.

    Payloads stay frames even when small: a copying receive is cheaper per frame (0.6 vs 1.7 µs),
    but telling where the message ends then takes a ZMQ_RCVMORE query per frame (1.2 µs), which
    a frame answers for free (``bench/hotpath.py``)."""
    f = _brecv(sock, flags, False, False)
    msg = [f]
    while f.more:
        f = _brecv(sock, flags, False, False)
        msg.append(f)
    return msg


def has_input(sock: zmq.Socket) -> bool:
    return bool(_bget(sock, _EVENTS) & _POLLIN)


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Itimerspec(ctypes.Structure):
    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]


_CLOCK_MONOTONIC = 1
_TFD_NONBLOCK = 0o4000
_TFD_CLOEXEC = 0o2000000
_TFD_TIMER_ABSTIME = 1


def _timerfd() -> tuple[int, Callable[[int], None]] | None:
    """A timerfd and a function arming it at an absolute monotonic time in µs (None off Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create, settime = libc.timerfd_create, libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    fd = create(_CLOCK_MONOTONIC, _TFD_NONBLOCK | _TFD_CLOEXEC)
    if fd < 0:
        return None
    spec = _Itimerspec()

    def arm(when_us: int) -> None:
        when_us = max(when_us, 1)  # 0 would disarm
        spec.it_value.tv_sec, rem = divmod(when_us, 1_000_000)
        spec.it_value.tv_nsec = rem * 1000
        settime(fd, _TFD_TIMER_ABSTIME, ctypes.byref(spec), None)

    return fd, arm


class ConnectionCap:
    """At most ``limit`` stream connections open at once, and the ``seconds`` a listener gives
    one (metrics: a whole scrape; ctl: each request line): the metrics and ctl listeners' bound
    on what idle or dripping peers may hold. Without it, 1,000 connections sending one header
    line every 3 s took the daemon's file descriptors and libzmq aborted on the next client
    connection."""

    def __init__(self, limit: int, seconds: float) -> None:
        self.limit, self.seconds, self.open = limit, seconds, 0

    def admit(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1


class Timers:
    """A heap of callbacks keyed by absolute µs, fired from one timerfd (or loop.call_at)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._heap: list[list] = []
        self._seq = itertools.count()
        self._armed_for: int | None = None
        self._fallback: asyncio.TimerHandle | None = None
        tfd = _timerfd()
        if tfd is None:
            self._fd = -1
            self._arm = None
        else:
            self._fd, self._arm = tfd
            loop.add_reader(self._fd, self._on_fd)

    def call_at(self, when_us: int, cb: Callable[..., Any], *args: Any) -> list:
        """Run ``cb(*args)`` at ``when_us`` or soon after; returns a handle for :meth:`cancel`."""
        entry = [when_us, next(self._seq), cb, args]
        heapq.heappush(self._heap, entry)
        if self._armed_for is None or when_us < self._armed_for:
            self._rearm()
        return entry

    @staticmethod
    def cancel(entry: list) -> None:
        entry[2] = None

    def _rearm(self) -> None:
        heap = self._heap
        while heap and heap[0][2] is None:
            heapq.heappop(heap)
        if not heap:
            self._armed_for = None
            return
        when = heap[0][0]
        self._armed_for = when
        if self._arm is not None:
            self._arm(when)
        else:
            if self._fallback is not None:
                self._fallback.cancel()
            delay = max(0.0, (when - now_us()) / 1e6)
            self._fallback = self._loop.call_later(delay, self._fire)

    def _on_fd(self) -> None:
        try:
            os.read(self._fd, 8)
        except BlockingIOError:
            return
        self._fire()

    def _fire(self) -> None:
        heap = self._heap
        self._armed_for = None
        t = now_us()
        try:
            while heap and heap[0][0] <= t:
                entry = heapq.heappop(heap)
                cb = entry[2]
                if cb is not None:
                    entry[2] = None
                    try:
                        cb(*entry[3])
                    except Exception as e:  # noqa: BLE001 - one failing callback stops no other timer
                        _log.error("timer-callback-failed", callback=getattr(cb, "__qualname__", repr(cb)),
                                   error=f"{type(e).__name__}: {e}"[:300])
        finally:
            # (a callback that raised used to leave the timerfd unarmed: an executor's heartbeats
            # then stopped until some other event armed it again)
            self._rearm()

    def close(self) -> None:
        if self._fd >= 0:
            self._loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = -1
        if self._fallback is not None:
            self._fallback.cancel()
        self._heap.clear()


class Reader:
    """Calls ``handler(frames)`` for every message on ``sock``, draining it on each wake-up.

    ``budget_us``: a wake-up stops after this much time (and comes back on the next loop turn),
    so a flood on one socket cannot starve the others and the timers. ``busy_since``: when the
    current run of wake-ups began that has not yet found the socket empty (0: it was empty at the
    last look); every message now queued arrived after the socket was last seen empty, so this
    bounds how long the reader has been behind, a backlog signal that needs no sender clock.
    ``pace_after_us`` / ``duty``: once the handler has called the current backlog a flood
    (:meth:`flood`) and it is older than ``pace_after_us``, a wake-up cut by its budget is
    followed by a rest, so the socket gets at most ``duty`` of the loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: zmq.Socket,
                 handler: Callable[[list], None], after: Callable[[], None] | None = None,
                 max_per_wakeup: int = 4096, budget_us: int = 0, pace_after_us: int = 0,
                 duty: float = 1.0) -> None:
        self._loop = loop
        self._pace_after = pace_after_us
        self._rest_us = int(budget_us * (1.0 / duty - 1.0)) if pace_after_us and 0 < duty < 1 else 0
        self._resting = False
        self._closed = False
        self._flood_at = 0  # busy_since of the backlog that :meth:`flood` marked
        self.paced = 0  # wake-ups followed by a rest
        self.handler_errors = 0  # messages whose handler raised (see _failed)
        self._sock = sock
        self._handler = handler
        self._after = after
        self._max = max_per_wakeup
        self._budget = budget_us
        self._scheduled = False
        self.busy_since = 0
        self._fd = sock.getsockopt(zmq.FD)
        loop.add_reader(self._fd, self._drain)
        self.kick()  # messages may have queued before the reader existed

    def flood(self) -> None:
        """The handler found the current backlog to be one sender's flood: from now until the
        socket is next empty, wake-ups that hit the budget are followed by a rest (``duty``).
        A backlog of many senders (the loop's own ceiling) is read at full speed."""
        self._flood_at = self.busy_since

    @property
    def flooded(self) -> bool:
        """The current backlog was marked a flood (see :meth:`flood`)."""
        return self.busy_since != 0 and self._flood_at == self.busy_since

    def drain_now(self) -> None:
        """Handle every message already queued (no time budget), before acting on what has *not*
        arrived."""
        self._drain(budget=False)

    def kick(self) -> None:
        """Check for input soon: a send may have consumed the edge that announced it."""
        if not self._scheduled and not self._resting:
            self._scheduled = True
            self._loop.call_soon(self._drain)

    def _drain(self, budget: bool = True) -> None:
        self._scheduled = False
        if budget and self._resting:
            return
        t0 = now_us()
        sock, handler = self._sock, self._handler
        n = 0
        if not self.busy_since:
            self.busy_since = t0
        end = t0 + self._budget if self._budget and budget else 0
        cut = False
        try:
            # ZMQ_EVENTS first: it also processes pending commands, and an empty socket costs no
            # EAGAIN exception. Then receive until EAGAIN, asking ZMQ_EVENTS again only there
            # (the FD's edge is re-armed by that read): one query per wake-up, not one per
            # message (under a flood it was a sixth of the loop's time).
            if has_input(sock):
                while True:
                    if n >= self._max or (end and now_us() >= end):
                        cut = True
                        break
                    try:
                        msg = recv_parts(sock)
                    except zmq.Again:
                        if has_input(sock):
                            continue
                        break
                    n += 1
                    try:
                        handler(msg)
                    except Exception as e:  # noqa: BLE001 - a bug on one message stalls no socket
                        self._failed(e)
        except zmq.ZMQError as e:
            if e.errno == zmq.ENOTSOCK or sock.closed:
                return
            raise
        finally:
            if not cut:
                self.busy_since = 0
            if n and self._after is not None:
                self._after()
        if cut:
            if self._rest_us and self.flooded and now_us() - self.busy_since > self._pace_after:
                self._rest()
            else:
                self.kick()

    def _failed(self, e: Exception) -> None:
        """A handler raised: the message is lost, the socket is not. Why here: the FD is
        edge-triggered, and a drain that stopped on an exception left the rest of the backlog
        unread until some other message came (a missing counter in the executor's FORWARD
        check did so). Logged at the 1st, 2nd, 4th, ... failure, with where it was raised."""
        self.handler_errors += 1
        if logs.sampled(self.handler_errors):
            tb = e.__traceback__
            while tb is not None and tb.tb_next is not None:
                tb = tb.tb_next
            where = f"{tb.tb_frame.f_code.co_filename.rsplit('/', 1)[-1]}:{tb.tb_lineno}" if tb else "?"
            # the traceback itself too: it is a bug, and whoever reads the journal must find it
            _log.error("handler-failed", handler=getattr(self._handler, "__qualname__", repr(self._handler)),
                       error=f"{type(e).__name__}: {e}"[:300], at=where, count=self.handler_errors,
                       traceback="".join(traceback.format_exception(e))[-3000:])

    def _rest(self) -> None:
        """Behind for a while (a flood): stop watching the socket for a rest, so the process's
        other work, and the executors and clients beside it on the host, keep CPU. The FD is
        unwatched meanwhile: ZeroMQ's FD stays readable while input waits, and a watched FD
        would wake the loop again and again for nothing (a busy rest)."""
        self._resting = True
        self.paced += 1
        self._loop.remove_reader(self._fd)
        self._loop.call_later(self._rest_us / 1e6, self._resume)

    def _resume(self) -> None:
        if self._closed:
            return
        self._resting = False
        self._loop.add_reader(self._fd, self._drain)
        self._drain()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(ValueError, OSError):
            self._loop.remove_reader(self._fd)
