"""Executor-socket peers that misbehave, against the scheduler in one process (the ``Rig`` of
``test_server_hotpath``: inproc sockets, a fake clock): none may stall the loop, have a result
taken that is not theirs, or fill the log."""

from __future__ import annotations

import threading

import zmq
from test_server_hotpath import Rig

from ppiped import wire
from ppiped.daemon import server as S
from ppiped.daemon.loop import recv_parts, send_parts
from ppiped.wire import T


def _peer(rig: Rig, ident: bytes, rcvhwm: int = 1000) -> zmq.Socket:
    s = rig.ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.IDENTITY, ident)
    s.setsockopt(zmq.RCVHWM, rcvhwm)
    s.connect(rig.srv.exe.getsockopt(zmq.LAST_ENDPOINT).decode())
    return s


def _from(rig: Rig, sock: zmq.Socket, header: bytes, frames: list = ()) -> None:
    send_parts(sock, [header, *frames])
    assert rig.srv.exe.poll(1000)
    rig.srv.on_exec(recv_parts(rig.srv.exe, 0))
    rig.srv.after_execs()


def test_a_peer_that_reads_no_replies_cannot_stall_the_loop(tmp_path, monkeypatch):
    """Each unregistered HEARTBEAT is answered; a peer reading none filled its queue and the
    next answer blocked the loop for good. Now what cannot go is dropped and counted."""
    rig = Rig(tmp_path, monkeypatch)
    try:
        exe = rig.ctx.socket(zmq.ROUTER)  # the daemon's options, with a queue of 50 (not 1 M) per peer
        exe.setsockopt(zmq.ROUTER_MANDATORY, 1)
        exe.setsockopt(zmq.SNDHWM, 50)
        exe.bind(f"inproc://deaf-{id(rig)}")
        rig.srv.exe = exe
        deaf = _peer(rig, b"deaf", rcvhwm=1)
        done = threading.Event()

        def flood():
            for _ in range(400):
                _from(rig, deaf, wire.heartbeat(1, 0))
            done.set()

        threading.Thread(target=flood, daemon=True).start()
        assert done.wait(20), "the scheduler blocked on a peer that reads nothing"
        assert rig.srv.counters["exec_sends_dropped"] > 0
        send_parts(rig.cl, [wire.ping(7)])  # and it goes on answering
        assert rig.srv.client.poll(1000)
        rig.srv.on_client(recv_parts(rig.srv.client, 0))
        assert [wire.decode(m[0]).token for m in rig.drain(rig.cl)] == [7]
    finally:
        rig.close()


def test_a_result_from_off_the_path_is_not_taken_even_empty(tmp_path, monkeypatch):
    """A process on a standby vGPU sends an empty RESULT for a batch it never held: it is
    counted foreign and changes nothing (it used to be taken, its lateness sample too)."""
    rig = Rig(tmp_path, monkeypatch)
    try:
        srv = rig.srv
        other = _peer(rig, b"standby")
        _from(rig, other, wire.register([srv.nv + 3], "inproc://other-data", "emulate", 2, rig.t, 1))
        assert b"standby" in srv.execs
        rig.submit([b"x"] * 4, 0)
        rig.t += 20_000
        srv.decide(rig.t)
        (h, frames), = [(wire.decode(m[0]), m[1:]) for m in rig.drain(rig.ex)
                        if wire.decode(m[0]).type == T.DISPATCH]
        late = len(srv.stats[0].late)
        _from(rig, other, wire.result(h.batch, [], None))
        assert srv.counters["foreign_results"] == 1
        assert not srv.batches[h.batch].answered and len(srv.stats[0].late) == late
        rig.to_server(wire.result(h.batch, h.ids, None), frames)  # the holder's own
        assert srv.batches[h.batch].answered
        assert [wire.decode(m[0]).status for m in rig.drain(rig.cl)] == [wire.Status.OK]
    finally:
        rig.close()


def test_register_fields_are_bounded_and_a_register_loop_is_not_logged_whole(tmp_path, monkeypatch):
    """A backend name of 1,000 characters is refused; one connection registering again and
    again (a new incarnation each time) keeps one executor and its log lines are rate-limited."""
    rig = Rig(tmp_path, monkeypatch)
    try:
        srv = rig.srv
        peer = _peer(rig, b"loop")
        _from(rig, peer, wire.register([srv.nv + 7], "inproc://d", "x" * 1000, 3, rig.t, 1))
        assert b"loop" not in srv.execs and srv.counters["register_refused"] == 1
        assert peer.poll(1000)
        err = wire.decode(peer.recv_multipart()[0])
        assert err.type == T.ERROR and err.code == wire.MALFORMED and str(S.MAX_BACKEND_CHARS) in err.message
        for inc in range(1, 21):
            _from(rig, peer, wire.register([srv.nv + 7], "inproc://d", "emulate", 3, rig.t, inc))
        assert srv.execs[b"loop"].incarnation == 20
        assert srv.counters["suppressed_executor-registered"] >= 15
        assert srv.counters["suppressed_executor-removed"] >= 15
    finally:
        rig.close()
