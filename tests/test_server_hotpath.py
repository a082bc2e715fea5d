"""The scheduler daemon's hot path in one process (inproc ZeroMQ peers, a fake clock): what the
shortcuts of ``on_submit`` / ``_dispatch`` / ``on_feedback`` must keep exactly as it was."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from ppiped import wire
from ppiped.commands.serve import load_serving
from ppiped.daemon import server as S
from ppiped.daemon.config import load_config
from ppiped.daemon.launch import write_config
from ppiped.daemon.loop import Timers, recv_parts, send_parts
from ppiped.executor import tiny
from ppiped.wire import Status, T


class _NoReader:
    busy_since = 0  # never behind: nothing is shed

    def kick(self) -> None:
        pass

    def drain_now(self) -> None:
        pass


class Rig:
    """A Server with inproc sockets, a client and an executor peer, and a clock that only moves
    when told to (so two runs of one script are the same to the microsecond)."""

    def __init__(self, d: Path, monkeypatch: pytest.MonkeyPatch, extra: str = "",
                 block_us: tuple[float, float] = (50.0, 80.0), slo_ms: float = 20.0) -> None:
        self.t = 1_000_000
        monkeypatch.setattr(S, "now_us", lambda: self.t)
        prof = tiny.profile_json(block_us=block_us, max_bs=4)
        plan, profiles = tiny.write_example(d, prof, vgpus=(2, 2), bs=4, slo_ms=slo_ms)
        cfg = load_config(write_config(d, plan, profiles, extra=extra))
        srv = self.srv = S.Server(cfg, *load_serving(cfg))
        self.ctx = ctx = zmq.Context()
        srv.zctx = ctx
        srv.loop = asyncio.new_event_loop()
        srv.client = ctx.socket(zmq.ROUTER)
        srv.client.bind(f"inproc://client-{id(self)}")
        srv.exe = ctx.socket(zmq.ROUTER)
        srv.exe.setsockopt(zmq.ROUTER_MANDATORY, 1)
        srv.exe.bind(f"inproc://exe-{id(self)}")
        srv.timers = Timers(srv.loop)
        srv.client_reader = srv.exe_reader = _NoReader()
        srv._dirty_decide = False
        srv._burst_start = 0
        self.cl = ctx.socket(zmq.DEALER)
        self.cl.setsockopt(zmq.IDENTITY, b"C")
        self.cl.connect(f"inproc://client-{id(self)}")
        self.ex = ctx.socket(zmq.DEALER)
        self.ex.setsockopt(zmq.IDENTITY, b"E")
        self.ex.connect(f"inproc://exe-{id(self)}")
        send_parts(self.ex, [b"hello"])  # the ROUTER learns the peer's identity
        assert srv.exe.poll(1000)
        srv.exe.recv_multipart()
        srv.on_register(b"E", wire.decode(wire.register(list(range(srv.nv)), "inproc://data", "emulate", 1,
                                                        self.t, 1)))
        srv.ready(srv.execs[b"E"])
        self.drain(self.ex)

    @staticmethod
    def drain(sock: zmq.Socket) -> list[list[bytes]]:
        out = []
        while sock.poll(0):
            out.append(sock.recv_multipart())
        return out

    def submit(self, payloads: list[bytes], cid0: int) -> None:
        send_parts(self.cl, [wire.submit(tiny.MODEL, 0, list(range(cid0, cid0 + len(payloads)))), *payloads])
        assert self.srv.client.poll(1000)
        self.srv.on_client(recv_parts(self.srv.client, 0))
        self.srv.after_clients()

    def to_server(self, header: bytes, frames: list = ()) -> None:
        send_parts(self.ex, [header, *frames])
        assert self.srv.exe.poll(1000)
        self.srv.on_exec(recv_parts(self.srv.exe, 0))
        self.srv.after_execs()

    def close(self) -> None:
        self.srv.timers.close()
        self.srv.loop.close()
        self.ctx.destroy(0)


def test_submit_rejects_some_and_queues_the_rest_in_order(tmp_path, monkeypatch):
    """Rejected requests in the middle of a SUBMIT take no id: the accepted ones are queued in one
    call with consecutive ids and dispatched with their own payloads, earliest first."""
    rig = Rig(tmp_path, monkeypatch, extra="[limits]\nmax_payload_bytes = 8\nmax_pending = 6\n")
    try:
        payloads = [b"ok-%d" % i if i % 3 else b"too-large-%d" % i for i in range(12)]
        rig.submit(payloads, 100)
        srv = rig.srv
        replies = [wire.decode(m[0]) for m in rig.drain(rig.cl)]
        rejected = {h.reason: h.ids for h in replies if h.type == T.REPLY and h.status == Status.REJECTED}
        assert rejected == {wire.PAYLOAD_TOO_LARGE: [100, 103, 106, 109], wire.OVERLOADED: [110, 111]}
        assert srv.stats[0].accepted == 6 and srv.next_rid == 7
        rig.t += 20_000  # the last moment for every request: each is dispatched or dropped now
        srv.decide(rig.t)
        sent = {}  # rid -> the payload dispatched with it
        for m in rig.drain(rig.ex):
            h = wire.decode(m[0])
            assert h.type == T.DISPATCH
            sent.update(zip(h.ids, m[1:]))  # noqa: B905
        in_batches = {rid: r for b in srv.batches.values() for rid, r in b.reqs.items()}
        assert sorted(sent) == sorted(in_batches) and sent
        assert all(sent[rid] == b"ok-%d" % (r.cid - 100) for rid, r in in_batches.items())
        dropped = [c for m in rig.drain(rig.cl) for c in wire.decode(m[0]).ids]
        assert sorted([r.cid for r in in_batches.values()] + dropped) == [101, 102, 104, 105, 107, 108]
    finally:
        rig.close()


def _script(d: Path, monkeypatch: pytest.MonkeyPatch, report_many_from: int) -> tuple[list, np.ndarray, dict]:
    """Requests, dispatches, one FEEDBACK message for every hop of every batch (late and long, so
    the core must move reservations), results, more requests; everything the server sent back."""
    monkeypatch.setattr(S, "REPORT_MANY_FROM", report_many_from)
    rig = Rig(d, monkeypatch)
    out: list = []
    try:
        cid = itertools.count()
        for rnd in range(3):
            for _ in range(3):
                rig.submit([b"x" * 16] * 5, next(cid) * 100)
                rig.t += 7
            batches = []
            for m in rig.drain(rig.ex):
                h = wire.decode(m[0])
                # (hop tags are signed with each run's random executor keys: all else must match)
                out.append(msgspec.structs.replace(h, tags=[len(t) for t in h.tags]) if h.type == T.DISPATCH else h)
                batches.append((h, m[1:]))
            entries = []
            for h, _ in batches:
                for hop, v in enumerate(h.path):
                    s = h.starts[hop] + 3 * (hop + 1) + rnd
                    entries += [v, h.batch, hop, s - 1, s, s + 150 + 10 * hop]
            rig.t += 400
            rig.to_server(wire.feedback(entries))
            for h, frames in batches:
                rig.to_server(wire.result(h.batch, h.ids, None), frames)
            out += [wire.decode(m[0]) for m in rig.drain(rig.cl)]
            rig.t += 50
        assert rig.srv.counters["stale_feedback"] == 0
        return out, rig.srv.core._A.copy(), rig.srv.status()["busy_us"]
    finally:
        rig.close()


def test_feedback_reports_one_by_one_equal_one_report_many(tmp_path, monkeypatch):
    """``on_feedback`` reports a few handles one compiled call each and many in one call: the
    core ends in the same state and every later decision is the same."""
    one = _script(tmp_path / "one", monkeypatch, 1 << 30)
    many = _script(tmp_path / "many", monkeypatch, 0)
    assert one[0] == many[0]
    assert sum(1 for h in one[0] if h.type == T.DISPATCH) >= 3
    assert np.array_equal(one[1], many[1])
    assert one[2] == many[2] and sum(one[2]) > 0


def test_a_dispatch_that_cannot_be_sent_loses_no_request(tmp_path, monkeypatch):
    """A DISPATCH header that cannot be encoded (an int past 64 bits once came from an executor's
    clock) voids that batch and requeues its requests; the batches of the same decision are still
    booked and sent, and every request is in flight or answered."""
    rig = Rig(tmp_path, monkeypatch)
    real = wire.dispatch
    calls = itertools.count()

    def first_fails(*args):
        if next(calls) == 0:
            raise OverflowError("can't serialize ints > 2**64 - 1")
        return real(*args)

    monkeypatch.setattr(wire, "dispatch", first_fails)
    try:
        srv = rig.srv
        for k in range(4):
            rig.submit([b"x"] * 4, 100 * k)
        rig.t += 20_000
        srv.decide(rig.t)
        sent = [wire.decode(m[0]) for m in rig.drain(rig.ex)]
        lost = [b for b in srv.batches.values() if b.answered]
        assert len(lost) == 1 and srv.counters["batches_lost"] == 1 and srv.counters["retried"] >= 1
        assert {h.batch for h in sent if h.type == T.DISPATCH} == {b.id for b in srv.batches.values()
                                                                  if not b.answered}
        answered = [i for m in rig.drain(rig.cl) for i in wire.decode(m[0]).ids]
        in_flight = {r.cid for b in srv.batches.values() if not b.answered for r in b.reqs.values()}
        assert sorted([*in_flight, *answered]) == sorted(100 * k + i for k in range(4) for i in range(4))
    finally:
        rig.close()


def test_a_long_batch_is_given_its_length_before_it_is_lost(tmp_path, monkeypatch):
    """A batch reserved for about a second that runs 0.25 s over on a loaded host (past the fixed
    result_grace_ms of 0.2 s) is still waited for; one silent for its reserved length past its end
    is lost, and its requests go back to the queue."""
    rig = Rig(tmp_path, monkeypatch, block_us=(280_000.0, 320_000.0), slo_ms=5_000.0)
    try:
        srv = rig.srv
        srv.replanner.maybe_auto = lambda: None
        rig.submit([b"x"] * 4, 0)
        rig.t += 4_000_000
        srv.decide(rig.t)
        rig.drain(rig.ex)
        (b,) = srv.batches.values()
        assert 1_000_000 <= b.span <= 1_100_000
        rig.t = int(b.finish) + 250_000
        rig.to_server(wire.heartbeat(rig.t, 0))  # the executor is alive, the batch just slow
        srv.housekeeping()
        assert not b.answered and srv.counters["batches_lost"] == 0
        rig.t = int(b.finish + b.span) + 1
        rig.to_server(wire.heartbeat(rig.t, 0))
        srv.housekeeping()
        assert b.answered and srv.counters["batches_lost"] == 1
    finally:
        rig.close()


def test_unreachable_peer_is_counted_shown_and_mended_with_the_directory(tmp_path, monkeypatch):
    """An executor that gave up forwarding to a vGPU (its heartbeat says) is not silent: the daemon
    counts it, shows it in status, and sends it the directory again; a re-registration that is
    only re-welcomed (a migration) gets the directory too (it may have been on standby)."""
    rig = Rig(tmp_path, monkeypatch)
    try:
        srv = rig.srv
        rig.to_server(wire.heartbeat(rig.t, 0, [3, 3, 1]))
        st = srv.status()
        assert st["counters"]["peer_unreachable"] == 2
        assert st["executors"][0]["unreachable_peers"] == "1,3"
        got = [wire.decode(m[0]) for m in rig.drain(rig.ex)]
        peers = [h for h in got if h.type == T.PEERS]
        assert len(peers) == 1 and peers[0].directory[:2] == [0, "inproc://data"], got
        rig.to_server(wire.heartbeat(rig.t, 0))
        assert srv.status()["executors"][0]["unreachable_peers"] == "1,3"  # for a heartbeat timeout
        rig.t += srv.cfg.heartbeat_timeout_ms * 1000 + 1
        assert srv.status()["executors"][0]["unreachable_peers"] == ""
        rig.to_server(wire.register(list(range(srv.nv)), "inproc://data", "emulate", 1, rig.t, 1))
        kinds = [wire.decode(m[0]).type for m in rig.drain(rig.ex)]
        assert T.WELCOME in kinds and T.PEERS in kinds, kinds
    finally:
        rig.close()
