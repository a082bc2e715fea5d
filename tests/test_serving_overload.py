"""The daemon past its own ceiling: a backlogged client socket is answered ``overloaded`` by the end
of the reader's wake-up (one reply per client), a long backlog is read at a bounded duty, and
every request still gets exactly one reply.

No timing assertions here (the figures are ``bench/ingest.py``'s): the backlog is made by a fake
clock, or by stopping the daemon while a flood queues up."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import pytest
import zmq
from test_server_hotpath import Rig

from ppiped import wire
from ppiped.client import AsyncClient, Rejected, RequestError, Result, error_for
from ppiped.daemon import loop as L
from ppiped.daemon import server as S
from ppiped.daemon.config import ConfigError, load_config
from ppiped.daemon.launch import LocalCluster, short_tmpdir, write_config
from ppiped.daemon.loop import Reader, send_parts
from ppiped.executor import tiny
from ppiped.wire import Status, T


class _Behind:
    """Stands in for the client socket's Reader: behind since ``busy_since`` (0: not behind)."""

    def __init__(self, busy_since: int) -> None:
        self.busy_since = busy_since
        self.floods = 0
        self.flooded = False

    def kick(self) -> None:
        pass

    def flood(self) -> None:
        self.floods += 1
        self.flooded = True


def _replies(rig: Rig) -> list[list]:
    return [wire.decode(m[0]) for m in rig.drain(rig.cl)]


@pytest.fixture
def ticking(monkeypatch):
    """The readers' clock moves 100 µs each time it is read."""
    clock = [1_000]

    def tick() -> int:
        clock[0] += 100
        return clock[0]

    monkeypatch.setattr(L, "now_us", tick)


def test_reader_budget_and_backlog_clock(ticking):
    """A wake-up stops at its time budget and the next turn goes on; ``busy_since`` keeps the start
    of the run until a wake-up finds the socket empty."""
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    b.bind("inproc://budget")
    a.connect("inproc://budget")
    got: list[bytes] = []
    since: list[int] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        for i in range(20):
            send_parts(a, [str(i).encode()])

        def handler(msg: list) -> None:
            got.append(bytes(msg[0]))
            since.append(r.busy_since)

        r = Reader(loop, b, handler, budget_us=250)
        for _ in range(100):
            await asyncio.sleep(0)
            if len(got) == 20 and not r._scheduled:
                break
        assert r.busy_since == 0  # found empty at the end
        r.close()

    try:
        asyncio.run(main())
    finally:
        ctx.destroy(0)
    assert got == [str(i).encode() for i in range(20)]
    assert len(set(since)) == 1 and since[0] > 0  # one run: every wake-up was cut by the budget


def test_backlogged_submit_is_answered_overloaded_at_once(tmp_path, monkeypatch):
    rig = Rig(tmp_path, monkeypatch, extra="[limits]\nmax_backlog_ms = 5\n")
    try:
        srv = rig.srv
        srv.client_reader = _Behind(rig.t - 6_000)  # behind for 6 ms: past the 5 ms limit
        rig.submit([b"x" * 16] * 10, 100)
        replies = _replies(rig)
        assert len(replies) == 1
        h = replies[0]
        assert (h.type, h.ids, h.status, h.reason) == (T.REPLY, list(range(100, 110)), Status.REJECTED,
                                                       wire.OVERLOADED)
        assert "backlog" in h.meta
        assert not srv.reqs and srv.stats[0].accepted == 0
        assert srv.stats[0].rejected[wire.OVERLOADED] == 10
        st = srv.status()
        assert st["counters"]["overloaded"] == 10 and st["counters"]["shed_messages"] == 1
        assert st["shed_us"]["n"] == 1

        srv.client_reader = _Behind(rig.t - 1_000)  # 1 ms: within the limit, served
        rig.submit([b"y" * 16] * 4, 200)
        assert not [h for h in _replies(rig) if h.status != Status.OK]
        assert srv.stats[0].accepted == 4

        # a short SLO sheds sooner: after half of it (2 ms SLO: 1 ms)
        srv.client_reader = _Behind(rig.t - 1_500)
        send_parts(rig.cl, [wire.submit(tiny.MODEL, 2_000, [300, 301]), b"a", b"b"])
        assert srv.client.poll(1000)
        srv.on_client(L.recv_parts(srv.client, 0))
        assert not _replies(rig)  # a backlog's sheds are answered when the reader's wake-up ends
        srv.after_clients()
        [h] = [h for h in _replies(rig) if h.ids == [300, 301]]
        assert (h.status, h.reason) == (Status.REJECTED, wire.OVERLOADED)
    finally:
        rig.close()


def test_a_backlogs_sheds_are_answered_together_per_client_each_id_once(tmp_path, monkeypatch):
    """Under a backlog (a flood), the sheds of one reader wake-up go back as one reply per client,
    at most about SHED_REPLY_IDS ids each, and every id is answered exactly once."""
    monkeypatch.setattr(S, "SHED_REPLY_IDS", 4)
    rig = Rig(tmp_path, monkeypatch, extra="[limits]\nmax_backlog_ms = 5\n")
    try:
        srv = rig.srv
        srv.client_reader = _Behind(rig.t - 6_000)
        sent = []
        for k in range(3):
            ids = [100 * (k + 1) + j for j in range(3)]
            sent += ids
            send_parts(rig.cl, [wire.submit(tiny.MODEL, 0, ids), b"a", b"b", b"c"])
            assert srv.client.poll(1000)
            srv.on_client(L.recv_parts(srv.client, 0))
        first = _replies(rig)  # the second message took the held ids past 4: sent at once
        assert [h.ids for h in first] == [[100, 101, 102, 200, 201, 202]]
        srv.after_clients()  # the wake-up ends: the rest
        second = _replies(rig)
        assert [h.ids for h in second] == [[300, 301, 302]]
        got = [i for h in first + second for i in h.ids]
        assert sorted(got) == sorted(sent) and len(got) == len(set(got))
        assert all((h.status, h.reason) == (Status.REJECTED, wire.OVERLOADED) for h in first + second)
        st = srv.status()
        assert st["counters"]["shed_messages"] == 3 and st["shed_us"]["n"] == 3
        assert not srv._shed_later
        # a shed held SHED_HOLD_US goes out with the next one, wake-up over or not
        for k, dt in ((4, 0), (5, S.SHED_HOLD_US)):
            rig.t += dt
            send_parts(rig.cl, [wire.submit(tiny.MODEL, 0, [100 * k]), b"a"])
            assert srv.client.poll(1000)
            srv.on_client(L.recv_parts(srv.client, 0))
        assert [h.ids for h in _replies(rig)] == [[400, 500]]
    finally:
        rig.close()


def _second_client(rig: Rig) -> zmq.Socket:
    """A client socket beside the rig's own (``rig.cl``), identity ``P``."""
    other = rig.ctx.socket(zmq.DEALER)
    other.setsockopt(zmq.IDENTITY, b"P")
    other.connect(rig.srv.client.getsockopt(zmq.LAST_ENDPOINT).decode())
    return other


def _submit_one(rig: Rig, sock: zmq.Socket, cid: int) -> None:
    """A one-request SUBMIT from ``sock``, read and handled by the rig's server, wake-up ended."""
    send_parts(sock, [wire.submit(tiny.MODEL, 0, [cid]), b"a"])
    assert rig.srv.client.poll(1000)
    rig.srv.on_client(L.recv_parts(rig.srv.client, 0))
    rig.srv.after_clients()


def test_a_client_sending_most_of_a_backlog_beside_others_is_shed_at_once(tmp_path, monkeypatch):
    """A backlog only just begun (inside ``max_backlog_ms`` and half the SLO): a client that sent
    more than BACKLOG_FLOOD_MSGS of its messages, and over FLOOD_SHARE of them, is answered
    ``overloaded`` at once and the reader is told it is a flood (to pace it); the other client is
    served. Alone, the same client is not shed before the backlog's limit."""
    monkeypatch.setattr(S, "BACKLOG_FLOOD_MSGS", 10)
    rig = Rig(tmp_path, monkeypatch, extra="[limits]\nmax_backlog_ms = 5\n")
    other = _second_client(rig)
    try:
        srv = rig.srv

        def send(sock: zmq.Socket, cid: int) -> None:
            _submit_one(rig, sock, cid)

        # alone: 20 messages 0.5 ms into a backlog are not shed for it (nor for the window)
        srv.client_reader = alone = _Behind(rig.t - 500)
        for k in range(20):
            send(rig.cl, k)
        assert alone.floods == 0 and srv.counters["shed_backlog"] == 0

        srv.client_reader = reader = _Behind(rig.t - 400)  # a new backlog
        send(other, 1000)
        for k in range(100, 120):
            send(rig.cl, k)
        send(other, 1001)
        replies = _replies(rig)
        shed = [i for h in replies if h.status == Status.REJECTED for i in h.ids]
        assert shed == list(range(110, 120))  # from its 11th message of this backlog on
        assert all(h.reason == wire.OVERLOADED and "backlog" in h.meta for h in replies
                   if h.status == Status.REJECTED)
        assert reader.floods == 10 and srv.counters["shed_backlog"] == 10
        assert not [h for h in _replies_of(other) if h.status == Status.REJECTED]
        assert srv.stats[0].accepted == 20 + 10 + 2
    finally:
        other.close(0)
        rig.close()


def test_in_a_flood_the_other_clients_are_not_shed_for_the_backlog(tmp_path, monkeypatch):
    """Long into a backlog marked a flood, a client over its equal share but within what the
    others leave free is admitted: its messages are read in turn with the flood's, not behind it
    (it is still held to the share and window rules)."""
    monkeypatch.setattr(S, "BACKLOG_FLOOD_MSGS", 0)
    rig = Rig(tmp_path, monkeypatch, extra="[limits]\nmax_backlog_ms = 5\n")
    other = _second_client(rig)
    try:
        srv = rig.srv
        srv.fair_cap[0] = 8.0  # two clients: an equal share of 4

        def send(sock: zmq.Socket, cid: int) -> None:
            _submit_one(rig, sock, cid)

        for k in range(3):
            send(other, 1000 + k)  # in flight before the backlog
        srv.client_reader = reader = _Behind(rig.t - 1_000)
        send(other, 1003)  # 1 ms into the backlog: served
        rig.t += 9_000  # 10 ms behind: past max_backlog_ms
        for k in range(100, 110):
            send(rig.cl, k)
        assert reader.flooded
        assert srv.counters["shed_backlog"] == 7  # the flooder's: its 4th message on
        send(other, 1004)  # its 5th in flight: over the equal share, within what is free
        assert not [h for h in _replies_of(other) if h.status == Status.REJECTED]
        assert srv.stats[0].accepted == 5 + 3
    finally:
        other.close(0)
        rig.close()


def _replies_of(sock: zmq.Socket) -> list:
    return [wire.decode(m[0]) for m in Rig.drain(sock)]


def test_the_client_socket_holds_a_bounded_backlog_per_connection(tmp_path, monkeypatch):
    """The daemon's client socket holds at most CLIENT_RCVHWM unread messages of one connection;
    past that the sender's own socket holds them (a flood costs the daemon neither memory nor
    I/O-thread CPU before the loop reads it), while another connection still gets through."""
    rig = Rig(tmp_path, monkeypatch)
    try:
        srv = rig.srv
        sock = srv._bind(zmq.ROUTER, "inproc://bounded", "endpoints.client", unlimited=True)
        flooder, polite = rig.ctx.socket(zmq.DEALER), rig.ctx.socket(zmq.DEALER)
        for s_ in (flooder, polite):
            s_.setsockopt(zmq.SNDHWM, 10)
            s_.connect("inproc://bounded")
        sent = 0
        with pytest.raises(zmq.Again):
            while sent < 100 * S.CLIENT_RCVHWM:
                flooder.send(b"f", zmq.NOBLOCK)
                sent += 1
        assert S.CLIENT_RCVHWM <= sent <= S.CLIENT_RCVHWM + 10
        polite.send(b"p", zmq.NOBLOCK)
        got = []
        while sock.poll(100):
            got.append(sock.recv_multipart()[1])
        assert got.count(b"p") == 1 and got.count(b"f") == sent
        sock.close(0)
    finally:
        rig.close()


class _CountingReader(Reader):
    """A reader that counts its wake-ups (every call of its drain, the FD's included)."""

    def __init__(self, *a, **kw) -> None:
        self.wakeups = 0
        super().__init__(*a, **kw)

    def _drain(self, budget: bool = True) -> None:
        self.wakeups += 1
        super()._drain(budget)


def test_a_flood_marked_backlog_rests_between_wake_ups_and_the_rest_is_idle(ticking):
    """Past ``pace_after_us`` behind, a wake-up cut by its budget is followed by a rest once the
    handler has called the backlog a flood (it gets at most ``duty`` of the loop); a backlog the
    handler did not call a flood is read at full speed. Every message is still handled, in order
    per sender, and a rest does not wake the loop while a second sender's messages arrive (the
    socket's FD, readable from their arrival until the socket is read, is not watched meanwhile:
    watched, it made every rest a busy loop)."""
    ctx = zmq.Context()
    got: dict[str, list[bytes]] = {}
    paced: dict[str, int] = {}
    wakeups: dict[str, int] = {}

    async def main(name: str, flood: bool, **pace) -> None:
        b = ctx.socket(zmq.ROUTER)
        b.bind(f"inproc://pace-{name}")
        bulk, trickle = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        bulk.connect(f"inproc://pace-{name}")
        trickle.connect(f"inproc://pace-{name}")
        loop = asyncio.get_running_loop()
        for i in range(40):
            send_parts(bulk, [b"b%d" % i])
        got[name] = []
        r: _CountingReader

        def handler(m: list) -> None:
            got[name].append(bytes(m[1]))
            if flood:
                r.flood()

        r = _CountingReader(loop, b, handler, budget_us=250, **pace)
        for i in range(20):
            await asyncio.sleep(0.001)
            send_parts(trickle, [b"t%d" % i])
        for _ in range(4000):
            await asyncio.sleep(0.0005)
            if len(got[name]) == 60:
                break
        await asyncio.sleep(0.01)
        paced[name], wakeups[name] = r.paced, r.wakeups
        r.close()
        for s_ in (bulk, trickle, b):
            s_.close(0)

    try:
        asyncio.run(main("flood", True, pace_after_us=500, duty=0.1))
        asyncio.run(main("backlog", False, pace_after_us=500, duty=0.1))
        asyncio.run(main("plain", True))
    finally:
        ctx.destroy(0)
    for name in ("flood", "backlog", "plain"):
        assert [m for m in got[name] if m[:1] == b"b"] == [b"b%d" % i for i in range(40)]
        assert [m for m in got[name] if m[:1] == b"t"] == [b"t%d" % i for i in range(20)]
    assert paced["flood"] > 0 and paced["backlog"] == 0 and paced["plain"] == 0
    # a rest ends in one wake-up, and a message arriving during it wakes nothing
    assert wakeups["flood"] <= 2 * paced["flood"] + 30


def _results_for_dispatches(rig: Rig) -> int:
    """Answer every DISPATCH the executor peer holds with a RESULT now; how many batches."""
    batches = [(wire.decode(m[0]), m[1:]) for m in rig.drain(rig.ex)]
    for h, frames in batches:
        assert h.type == T.DISPATCH
        rig.to_server(wire.result(h.batch, h.ids, None), frames)
    return len(batches)


def test_admission_window_follows_executor_lateness(tmp_path, monkeypatch):
    """Results far past their reserved ends for two intervals in a row shrink the model's window
    below what was in flight; beyond it requests are refused ``overloaded`` (all of a message at
    once when none fits), each exactly once; on-time results while the window refuses something
    grow it again."""
    rig = Rig(tmp_path, monkeypatch)  # 20 ms SLO: lateness counts past 5 ms
    try:
        srv = rig.srv
        st = srv.stats[0]
        assert st.limit == float("inf")
        rig.submit([b"x" * 16] * 8, 0)
        rig.t += 8_000  # the executor answers 8 ms late: past a quarter of the SLO, not half
        assert _results_for_dispatches(rig) == 2  # the first is due for an adjustment: late once
        assert st.limit == float("inf")  # one late interval may be a stall of the host
        srv.adjust_limits(rig.t)  # late again
        assert st.limit == S.MIN_LIMIT  # 0.8 x the 8 in flight, but never below the minimum
        assert [h.status for h in _replies(rig)] == [Status.OK] * 2
        assert st.accepted - st.answered == 0

        rig.submit([b"y" * 16] * 100, 1000)  # the window takes 64 of them
        replies = _replies(rig)
        assert [(h.ids, h.reason) for h in replies if h.status != Status.OK] == \
            [(list(range(1064, 1100)), wire.OVERLOADED)]
        assert st.accepted - st.answered == 64 and st.limited

        rig.submit([b"z" * 16] * 10, 2000)  # no room at all: the whole message, one reply
        [h] = _replies(rig)
        assert (h.ids, h.status, h.reason) == (list(range(2000, 2010)), Status.REJECTED, wire.OVERLOADED)
        assert "admission window 64" in h.meta
        rig.t += 300
        assert _results_for_dispatches(rig) > 0  # on time
        srv.adjust_limits(rig.t)
        assert st.limit == int(S.MIN_LIMIT * 1.1) + S.MIN_LIMIT // 4
        m = srv.status()["models"][tiny.MODEL]
        assert m["limit"] == st.limit and m["in_flight"] == st.accepted - st.answered
        assert srv.counters["overloaded"] == 46
    finally:
        rig.close()


def test_results_past_half_the_slo_shrink_the_window_at_once(tmp_path, monkeypatch):
    rig = Rig(tmp_path, monkeypatch)  # 20 ms SLO
    try:
        st = rig.srv.stats[0]
        rig.submit([b"x" * 16] * 8, 0)
        rig.t += 15_000
        assert _results_for_dispatches(rig) == 2
        assert st.limit == S.MIN_LIMIT
    finally:
        rig.close()


def test_client_surfaces_overloaded_as_rejected():
    e = error_for(Status.REJECTED, wire.OVERLOADED, "tiny")
    assert isinstance(e, Rejected) and e.reason == "overloaded"


def test_scheduler_rooms_are_configurable_and_checked(tmp_path):
    from ppiped.commands.serve import load_serving

    plan, profiles = tiny.write_example(tmp_path)
    cfg = load_config(write_config(tmp_path, plan, profiles,
                                   scheduler={"policy": "pard", "class_room": 0.1, "pressure_room": 0.3,
                                              "room_quantile": 0.98}))
    srv = S.Server(cfg, *load_serving(cfg))
    assert srv.core_kw["class_room"] == 0.1 and srv.core_kw["pressure_room"] == 0.3
    assert srv.core_kw["room_quantile"] == 0.98
    assert srv.core.policy.name == "pard"
    cfg = load_config(write_config(tmp_path, plan, profiles, scheduler={"class_room": 1.5}))
    with pytest.raises(ConfigError, match="scheduler: class_room and pressure_room must be within"):
        S.Server(cfg, *load_serving(cfg))
    cfg = load_config(write_config(tmp_path, plan, profiles, scheduler={"room_quantile": 1.0}))
    with pytest.raises(ConfigError, match=r"scheduler: room_quantile must be within \(0, 1\), got 1.0"):
        S.Server(cfg, *load_serving(cfg))


def test_max_backlog_config(tmp_path):
    plan, profiles = tiny.write_example(tmp_path)
    assert load_config(write_config(tmp_path, plan, profiles)).max_backlog_ms == 25.0
    cfg = write_config(tmp_path, plan, profiles, extra="[limits]\nmax_backlog_ms = 0.5\n")
    assert load_config(cfg).max_backlog_ms == 0.5
    with pytest.raises(ConfigError, match="limits.max_backlog_ms"):
        load_config(write_config(tmp_path, plan, profiles, extra="[limits]\nmax_backlog_ms = -1\n"))


@contextlib.contextmanager
def _tiny_cluster(timeout_ms: int, max_backlog_ms: int):
    """The tiny example on 4 emulated vGPUs in two executor processes, any input size."""
    with short_tmpdir("ppiped-overload-") as d:
        d = Path(d)
        plan, profiles = tiny.write_example(d)
        cfg = write_config(d, plan, profiles, heartbeat_ms=50, timeout_ms=timeout_ms,
                           extra=f"[limits]\nmax_backlog_ms = {max_backlog_ms}\n[models.tiny]\ninput_bytes = 0\n")
        with LocalCluster(cfg, ((0, 2), (1, 3))) as c:
            yield c


def test_flood_past_the_limit_gets_exactly_one_reply_each():
    """A flood queued while the daemon is stopped: once it runs again, it is behind, sheds whole
    messages ``overloaded`` and serves the others; every request is answered exactly once."""
    n_socks, n_msgs, per_msg = 4, 60, 40
    with _tiny_cluster(timeout_ms=2000, max_backlog_ms=1) as c:
        ctx = zmq.Context()
        try:
            socks = []
            for _ in range(n_socks):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(c.client_endpoint)
                socks.append(s)
            for s in socks:  # connected and served before the flood
                s.send_multipart([wire.submit(tiny.MODEL, 0, [0]), b"warm"])
                assert s.poll(10_000)
                s.recv_multipart()
            os.kill(c.server.pid, signal.SIGSTOP)
            try:
                for k in range(n_msgs):
                    for s in socks:
                        ids = list(range(1 + k * per_msg, 1 + (k + 1) * per_msg))
                        s.send_multipart([wire.submit(tiny.MODEL, 0, ids), *(b"p%d" % i for i in ids)])
                time.sleep(0.1)
            finally:
                os.kill(c.server.pid, signal.SIGCONT)
            want = n_msgs * per_msg
            answers = [Counter() for _ in socks]
            outcome: Counter = Counter()
            end = time.monotonic() + 30
            while sum(sum(a.values()) for a in answers) < n_socks * want and time.monotonic() < end:
                for s, a in zip(socks, answers, strict=True):
                    while s.poll(0):
                        m = s.recv_multipart()
                        h = wire.decode(m[0])
                        assert h.type == T.REPLY
                        a.update(h.ids)
                        outcome[(h.status, h.reason)] += len(h.ids)
                        if h.status == Status.OK:
                            assert m[1:] == [b"p%d" % i for i in h.ids]  # each its own result
                time.sleep(0.005)
            time.sleep(0.3)  # nothing more may come
            for s, a in zip(socks, answers, strict=True):
                while s.poll(0):
                    a.update(wire.decode(s.recv_multipart()[0]).ids)
            for a in answers:
                assert set(a) == set(range(1, want + 1)) and set(a.values()) == {1}
            assert outcome[(Status.REJECTED, wire.OVERLOADED)] > 0
            assert set(outcome) <= {(Status.OK, ""), (Status.REJECTED, wire.OVERLOADED),
                                    (Status.DROPPED, wire.DEADLINE)}
            st = c.status()
            assert st["counters"]["overloaded"] == outcome[(Status.REJECTED, wire.OVERLOADED)]
            assert c.server.poll() is None
            assert "Traceback" not in c.tail("serve.log", 5000)
        finally:
            ctx.destroy(0)


def _submit_as(rig: Rig, sock: zmq.Socket, header: bytes, n: int) -> None:
    send_parts(sock, [header, *[b"x" * 16] * n])
    assert rig.srv.client.poll(1000)
    rig.srv.on_client(L.recv_parts(rig.srv.client, 0))


def test_fair_admission_refuses_the_client_over_its_share(tmp_path, monkeypatch):
    """A client alone may fill the model's capacity; once another has requests in flight, the
    first is over its fair share and refused ``overloaded`` at once, while the other, under its
    share, is admitted although the first filled the capacity."""
    rig = Rig(tmp_path, monkeypatch)
    flooder = rig.ctx.socket(zmq.DEALER)
    try:
        srv = rig.srv
        flooder.setsockopt(zmq.IDENTITY, b"F")
        flooder.connect(f"inproc://client-{id(rig)}")
        st = srv.stats[0]
        cap = srv.fair_cap[0]
        big = int(cap) + 50
        _submit_as(rig, flooder, wire.submit(tiny.MODEL, 0, list(range(big))), big)
        assert st.accepted == big and st.clients == 1  # alone: admission as before
        _submit_as(rig, rig.cl, wire.submit(tiny.MODEL, 0, [1000, 1001]), 2)
        assert st.accepted == big + 2 and st.clients == 2  # under its share: admitted
        _submit_as(rig, flooder, wire.submit(tiny.MODEL, 0, [5000]), 1)
        [m] = rig.drain(flooder)
        h = wire.decode(m[0])
        assert (h.ids, h.status, h.reason) == ([5000], Status.REJECTED, wire.OVERLOADED) and "fair share" in h.meta
        assert srv.counters["shed_share"] == 1 and st.accepted == big + 2
        assert srv.status()["models"][tiny.MODEL]["clients"] == 2
        # every answer gives the share back: nothing in flight, no active client left
        rig.t += 20_000
        srv.decide(rig.t)
        while _results_for_dispatches(rig):
            pass
        assert st.accepted == st.answered and st.clients == 0
        assert all(sh.n == 0 for p in srv.peers.values() for sh in p.shares.values())
        rig.t += S.CLIENT_IDLE_US + 1
        srv.forget_clients(rig.t)  # idle and nothing in flight: forgotten
        assert srv.peers == {}
    finally:
        flooder.close(0)
        rig.close()


def test_submit_that_queued_past_its_slo_is_dropped_deadline_at_once(tmp_path, monkeypatch):
    """``sent_us``: the least (receive - sent_us) is the client's clock offset; a message that
    took longer waited in the socket, its deadline starts at its send, and one that waited past
    its SLO (20 ms here) is answered DROPPED ``deadline`` at once, never served late."""
    rig = Rig(tmp_path, monkeypatch, extra="[limits]\nmax_backlog_ms = 1000\n")
    try:
        srv = rig.srv
        skew = 7_777_777  # the client's clock runs ahead: clocks need not agree

        def deadline(cid: int) -> int:
            reqs = [*srv.reqs.values(), *(r for b in srv.batches.values() for r in b.reqs.values())]
            [r] = [r for r in reqs if r.cid == cid]
            return r.deadline

        _submit_as(rig, rig.cl, wire.submit(tiny.MODEL, 0, [1], 0, rig.t + skew - 100), 1)
        assert deadline(1) == rig.t + 20_000  # the least delay seen: none queued
        rig.t += 1_000
        _submit_as(rig, rig.cl, wire.submit(tiny.MODEL, 0, [2], 0, rig.t + skew - 100 - 5_000), 1)
        assert deadline(2) == rig.t - 5_000 + 20_000  # queued 5 ms
        rig.t += 1_000
        _submit_as(rig, rig.cl, wire.submit(tiny.MODEL, 0, [3, 4], 0, rig.t + skew - 100 - 25_000), 2)
        late = [wire.decode(m[0]) for m in rig.drain(rig.cl)]
        late = [h for h in late if h.ids == [3, 4]]
        assert [(h.status, h.reason) for h in late] == [(Status.DROPPED, wire.DEADLINE)]
        assert srv.counters["late_on_arrival"] == 2 and srv.stats[0].dropped[wire.DEADLINE] >= 2
        # a client that lies (sent_us far in the future) only makes its own later messages look late
        rig.t += 1_000
        _submit_as(rig, rig.cl, wire.submit(tiny.MODEL, 0, [5], 0, rig.t + 10**15), 1)
        rig.t += 1_000
        _submit_as(rig, rig.cl, wire.submit(tiny.MODEL, 0, [6], 0, rig.t + skew - 100), 1)
        assert srv.counters["late_on_arrival"] == 3
    finally:
        rig.close()


def test_polite_client_is_served_beside_a_flooding_one():
    """One client floods single-request SUBMITs as fast as it can (and reads nothing); another
    sends a steady trickle with a 5 s SLO: every polite request is answered and at least 90 %
    are OK (6-14 % were before fair admission; the issue's 99 % is measured by
    ``bench/faults.py --only flood``: here a stall of the shared CI host may shrink the admission
    window below one polite burst)."""
    n_flood, n_polite = 10_000, 150
    with _tiny_cluster(timeout_ms=5000, max_backlog_ms=10000) as c:
        ctx = zmq.Context()
        flood_done = threading.Event()

        def flood() -> None:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.SNDHWM, 0)
            s.connect(c.client_endpoint)
            for i in range(n_flood):
                s.send_multipart([wire.submit(tiny.MODEL, 0, [i]), b"f"])
            flood_done.wait(60)
            s.close(0)

        async def polite() -> list:
            async with AsyncClient(c.client_endpoint, timeout_s=30) as ac:
                await ac.submit(tiny.MODEL, b"warm", slo_ms=5000)
                th = threading.Thread(target=flood)
                th.start()
                try:
                    futs = []
                    for i in range(n_polite):
                        futs.append(asyncio.ensure_future(ac.submit(tiny.MODEL, b"p%d" % i, slo_ms=5000)))
                        await asyncio.sleep(0.002)
                    return await asyncio.gather(*futs, return_exceptions=True)
                finally:
                    flood_done.set()
                    th.join()

        try:
            outs = asyncio.run(polite())
            st = c.status()
            why = (Counter(getattr(o, "reason", type(o).__name__) for o in outs), st["counters"])
            assert all(isinstance(o, Result | RequestError) for o in outs), why  # none timed out
            ok = [(i, o) for i, o in enumerate(outs) if isinstance(o, Result)]
            assert len(ok) >= 0.9 * n_polite, why
            assert all(o.data == b"p%d" % i for i, o in ok)
            # the flooder was held back: to its share, and once it sent most of a backlog, shed at once
            assert st["counters"].get("shed_share", 0) + st["counters"].get("shed_backlog", 0) > 0
            assert c.server.poll() is None
        finally:
            ctx.destroy(0)

