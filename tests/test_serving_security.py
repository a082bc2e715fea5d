"""Hostile peers against a real daemon with emulated executors: forged results, bogus endpoints,
malformed results, an empty SUBMIT and ctl commands over TCP. Legit traffic runs alongside and
must get only genuine answers."""

from __future__ import annotations

import asyncio
import os
import re
import socket
import threading
import time
from pathlib import Path

import pytest
import zmq
from conftest import tiny_cluster

from ppiped import wire
from ppiped.client import AsyncClient, Client, Dropped, Rejected
from ppiped.daemon.config import load_config
from ppiped.daemon.launch import LocalCluster, curve_keys, short_tmpdir, write_config
from ppiped.executor import tiny
from ppiped.security import Security, connect_as, load_keypair
from ppiped.wire import Status, T


@pytest.fixture(scope="module")
def cluster():
    with short_tmpdir("ppiped-sec-") as d, tiny_cluster(Path(d), ((0, 2), (1, 3))) as c:
        yield c, load_config(c.config)


class Impostor:
    """A process on the host that speaks the executor protocol without being one."""

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def register(self, vgpus: list[int], data_endpoint: str) -> wire.Message:
        self.sock.send(wire.register(vgpus, data_endpoint, "emulate", os.getpid(), 0, 1))
        return self.next()

    def next(self, timeout_s: float = 5.0) -> wire.Message:
        assert self.sock.poll(int(timeout_s * 1000)), "no answer from the scheduler"
        return wire.decode(self.sock.recv_multipart()[0])

    def close(self) -> None:
        self.ctx.destroy(0)


def test_forged_results_never_reach_a_client(cluster, tmp_path):
    c, cfg = cluster
    imp = Impostor(cfg.executor)
    try:
        h = imp.register([200], f"ipc://{tmp_path}/impostor.sock")  # a vGPU the plan lacks: standby
        assert h.type == T.WELCOME
        before = c.status()["counters"].get("foreign_results", 0)
        lo = c.status()["totals"]["accepted"]
        stop = threading.Event()

        def forge():  # results for every batch id the next requests may get, over and over
            while not stop.is_set():
                for bid in range(max(1, lo - 10), lo + 400):
                    imp.sock.send_multipart([wire.result(bid, list(range(bid, bid + 4)), None, [], []),
                                             *[b"FORGED"] * 4])
                time.sleep(0.002)

        t = threading.Thread(target=forge, daemon=True)
        t.start()
        try:
            genuine = 0
            with Client(c.client_endpoint, timeout_s=10) as cl:
                frames = [b"genuine-%d" % i for i in range(200)]
                for k in range(0, 200, 5):
                    out = cl.submit_many("tiny", frames[k:k + 5], slo_ms=500)
                    for r, f in zip(out, frames[k:k + 5], strict=True):
                        # the flood may cost deadlines, or a refusal while results come late
                        # (the admission window); an answer is never someone else's data
                        if isinstance(r, Rejected):
                            assert r.reason == wire.OVERLOADED, r
                        else:
                            assert isinstance(r, Dropped) or r.data == f
                        genuine += not isinstance(r, (Dropped, Rejected))
            assert genuine >= 100
        finally:
            stop.set()
            t.join(5)
        assert c.status()["counters"].get("foreign_results", 0) > before
    finally:
        imp.close()


def test_an_executor_that_heartbeats_but_never_runs_is_quarantined(tmp_path):
    """A process registers the first-pool vGPU no executor serves, answers WELCOME with
    heartbeats and runs nothing: the batches dispatched to it go overdue with no hop reported.
    After a few, over more than the heartbeat timeout, it is removed and its REGISTER refused for
    a while (``quarantined``), so the scheduler stops routing batches into it; every request is
    still answered, the healthy executor is never charged, and the rest of the plan serves on."""
    with short_tmpdir("ppiped-q-") as d, tiny_cluster(Path(d), ((1, 2, 3),)) as c:
        cfg = load_config(c.config)
        imp = Impostor(cfg.executor)
        stop = threading.Event()
        try:
            h = imp.register([0], f"ipc://{d}/impostor.sock")
            assert h.type == T.WELCOME

            def beat():
                while not stop.is_set():
                    imp.sock.send(wire.heartbeat(time.monotonic_ns() // 1000, 0))
                    time.sleep(0.02)

            t = threading.Thread(target=beat, daemon=True)
            t.start()
            answered = 0
            deadline = time.monotonic() + 30
            with Client(c.client_endpoint, timeout_s=20) as cl:
                while not c.status()["counters"].get("executors_quarantined") and time.monotonic() < deadline:
                    out = cl.submit_many("tiny", [b"x%d" % i for i in range(8)], slo_ms=300)
                    assert all(isinstance(r, (Dropped, Rejected)) or r.data.startswith(b"x") for r in out)
                    answered += len(out)
                assert c.status()["counters"]["executors_quarantined"] == 1
                stop.set()
                t.join(5)
                imp.sock.send(wire.register([0], f"ipc://{d}/impostor.sock", "emulate", os.getpid(), 0, 2))
                while True:  # (heartbeats sent before the removal may still be answered first)
                    h = imp.next()
                    if h.type == T.ERROR and h.code == wire.QUARANTINED:
                        break
                other = Impostor(cfg.executor)  # a new connection for the same vGPU: the same answer
                try:
                    h = other.register([0], f"ipc://{d}/impostor2.sock")
                    assert h.type == T.ERROR and h.code == wire.QUARANTINED, h
                finally:
                    other.close()
                out = cl.submit_many("tiny", [b"after%d" % i for i in range(20)], slo_ms=2000)
                assert [r.data for r in out] == [b"after%d" % i for i in range(20)]
                assert c.status()["counters"]["executors_quarantined"] == 1  # only the impostor
            assert answered > 0
        finally:
            stop.set()
            imp.close()


def test_forged_feedback_cannot_stall_the_schedule(cluster, tmp_path):
    """Hop times for batches of vGPUs the sender does not serve, with ends days ahead (they once
    pushed every later reservation back and stopped serving for good): refused and counted, and
    requests sent afterwards are served."""
    c, cfg = cluster
    imp = Impostor(cfg.executor)
    try:
        assert imp.register([202], f"ipc://{tmp_path}/impostor2.sock").type == T.WELCOME
        before = c.status()["counters"].get("foreign_feedback", 0)
        top = sum(m["batches"] for m in c.status()["models"].values())  # batch ids count up from 1
        t = time.time_ns() // 1000
        entries: list[int] = []
        for bid in range(max(1, top - 5), top + 80):
            for hop, vs in ((0, (0, 1)), (1, (2, 3))):
                for v in vs:
                    entries += [v, bid, hop, t, t, t + 10**12]
        stop = threading.Event()

        def forge():
            while not stop.is_set():
                imp.sock.send(wire.feedback(entries))
                imp.sock.send_multipart([wire.result(2**40, [], None, [], entries)])

        th = threading.Thread(target=forge, daemon=True)
        th.start()
        try:
            with Client(c.client_endpoint, timeout_s=10) as cl:
                for _ in range(40):
                    cl.submit_many("tiny", [b"x"] * 5, slo_ms=500)
        finally:
            stop.set()
            th.join(5)
        with Client(c.client_endpoint, timeout_s=10) as cl:
            out = [r for _ in range(20) for r in cl.submit_many("tiny", [b"after"] * 5, slo_ms=500)]
        served = sum(1 for r in out if not isinstance(r, (Dropped, Rejected)))
        assert served >= 90, [type(r).__name__ for r in out]
        assert c.status()["counters"].get("foreign_feedback", 0) > before
    finally:
        imp.close()


def test_standby_registrations_learn_no_data_endpoints(cluster, tmp_path):
    """A process holding only spare vGPU ids gets its WELCOME but no PEERS directory (the plan's
    data endpoints), and its own id is not passed on to the executors."""
    c, cfg = cluster
    imp = Impostor(cfg.executor)
    try:
        assert imp.register([230], f"ipc://{tmp_path}/standby.sock").type == T.WELCOME
        got = []
        while imp.sock.poll(500):
            got.append(wire.decode(imp.sock.recv_multipart()[0]).type)
        assert T.PEERS not in got, got
    finally:
        imp.close()


def test_bad_endpoints_and_malformed_results_are_refused(cluster):
    c, cfg = cluster
    imp = Impostor(cfg.executor)
    try:
        h = imp.register([201], "bogus-endpoint")
        assert h.type == T.ERROR and h.code == "bad-endpoint"
        imp2 = Impostor(cfg.executor)
        try:
            assert imp2.register([202], "ipc:///tmp/ppiped-sec-unused.sock").type == T.WELCOME
            # a 'failed' entry that is not [id, reason, ...]: an error back, no traceback
            imp2.sock.send_multipart([wire.result(1, [], None, [[1, 2], "x"], [])])
            h = imp2.next()
            while h.type != T.ERROR:
                h = imp2.next()
            assert h.code == wire.MALFORMED and "failed" in h.message
        finally:
            imp2.close()
        with Client(c.client_endpoint, timeout_s=10) as cl:
            assert cl.submit("tiny", b"after").data == b"after"
        st = c.status()
        assert st["counters"]["register_refused"] >= 1 and st["counters"]["exec_malformed"] >= 1
    finally:
        imp.close()
    log = c.tail("serve.log", 400)
    assert "Traceback" not in log


def test_an_absurd_executor_clock_loses_no_request(tmp_path):
    """A peer holding two of the plan's vGPUs heartbeats, every other time with a clock near
    2^64 µs. That clock once became the executor's offset, the DISPATCH built on it could not be
    encoded, and every request of that decision went unanswered. Now the absurd heartbeats are
    refused as malformed; every request is answered, the ones on the healthy vGPUs served."""
    with short_tmpdir("ppiped-clk-") as d, tiny_cluster(Path(d), ((0, 2),)) as c:
        cfg = load_config(c.config)
        imp = Impostor(cfg.executor)
        stop = threading.Event()
        try:
            assert imp.register([1, 3], f"ipc://{tmp_path}/clock.sock").type == T.WELCOME

            def beat():
                while not stop.is_set():
                    imp.sock.send(wire.heartbeat(time.monotonic_ns() // 1000, 0))
                    imp.sock.send(wire.heartbeat(2**64 - 1, 0))
                    time.sleep(0.05)

            th = threading.Thread(target=beat, daemon=True)
            th.start()
            time.sleep(0.3)
            assert c.status()["vgpus"]["alive"] == 4  # the peer's two vGPUs are in service
            with Client(c.client_endpoint, timeout_s=10) as cl:
                out = [r for _ in range(10) for r in cl.submit_many("tiny", [b"x"] * 3, slo_ms=500)]
            assert len(out) == 30
            assert sum(1 for r in out if not isinstance(r, (Dropped, Rejected))) >= 1
            assert c.status()["counters"]["exec_malformed"] >= 1
        finally:
            stop.set()
            imp.close()
        assert "Traceback" not in c.tail("serve.log", 4000)


def test_stopping_with_a_ctl_connection_open_logs_no_crash():
    """An operator's idle ppiped-ctl connection at shutdown: its handler is cancelled, and the
    daemon stops without a traceback (Python 3.11's stream callback once logged the cancellation
    as an exception)."""
    with short_tmpdir("ppiped-ctlstop-") as d:
        with tiny_cluster(Path(d), ((0, 2), (1, 3))) as c:
            idle = socket.socket(socket.AF_UNIX)
            idle.connect(load_config(c.config).ctl_socket_path())
            assert c.status()["vgpus"]["alive"] == 4  # the daemon has taken the connection
        idle.close()
        log = c.tail("serve.log", 4000)
        assert "stopped" in log and "Traceback" not in log


def test_empty_submit_is_answered(cluster):
    c, _ = cluster
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(c.client_endpoint)
    try:
        s.send(wire.submit("tiny", 0, []))
        assert s.poll(5000), "a SUBMIT without requests got no answer"
        h = wire.decode(s.recv_multipart()[0])
        assert h.type == T.ERROR and h.code == wire.MALFORMED
        s.send_multipart([wire.submit("tiny", 3_600_000_000, [5]), b"x"])  # an hour's SLO
        assert s.poll(5000)
        h = wire.decode(s.recv_multipart()[0])
        assert h.type == T.REPLY and h.status == Status.REJECTED and "max_slo_ms" in h.meta
    finally:
        ctx.destroy(0)


def test_stop_over_tcp_ctl_is_refused():
    with short_tmpdir("ppiped-tcpctl-") as d:
        d = Path(d)
        plan, profiles = tiny.write_example(d)
        cfg = write_config(d, plan, profiles, heartbeat_ms=50, timeout_ms=1000)
        text = cfg.read_text()
        with socket.socket() as probe:  # a free loopback port
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        text = re.sub(r'ctl = "ipc://[^"]*"', f'ctl = "tcp://127.0.0.1:{port}"', text, count=1)
        cfg.write_text(text)
        c = LocalCluster(cfg, ((0, 1, 2, 3),), log_level="info")
        try:
            c.start()
            assert c.ctl("stop") == {"error": "'stop' is refused on a TCP ctl endpoint (status only); "
                                     "use an ipc:// endpoints.ctl, or ppiped-ctl over the ctl unix socket"}
            time.sleep(0.3)
            assert c.server.poll() is None, "the daemon stopped on a TCP stop"
            assert "totals" in c.status()
        finally:
            c.stop()


# --- CURVE -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def curve_cluster():
    with short_tmpdir("ppiped-curve-") as d:
        d = Path(d)
        keys = d / "keys"
        extra = "[models.tiny]\ninput_bytes = 0\n" + curve_keys(keys, {"ex01": "0-1", "ex23": "2-3"},
                                                                clients=("cam", "cam2"))
        plan, profiles = tiny.write_example(d)
        cfg = write_config(d, plan, profiles, heartbeat_ms=50, timeout_ms=1000,
                           scheduler={"wait_guard_us": 25_000}, extra=extra)
        c = LocalCluster(cfg, ((0, 1), (2, 3)), log_level="info", admin_key=str(keys / "admins/ops.key_secret"),
                         executor_keys=[str(keys / "executors/ex01.key_secret"),
                                        str(keys / "executors/ex23.key_secret")])
        try:
            c.start()
            yield c, load_config(cfg), keys
        finally:
            c.stop()


def test_curve_serves_keyed_clients_only(curve_cluster):
    c, _, keys = curve_cluster
    with Client(c.client_endpoint, timeout_s=10, key_file=str(keys / "clients/cam.key_secret"),
                server_key_file=str(keys / "server.key")) as cl:
        assert cl.submit("tiny", b"keyed").data == b"keyed"
    for key in (None, keys / "intruder.key_secret"):  # no key, or a key nobody allowed
        kw = {} if key is None else {"key_file": str(key), "server_key_file": str(keys / "server.key")}
        with Client(c.client_endpoint, timeout_s=1.5, **kw) as cl, pytest.raises(TimeoutError):
            cl.submit("tiny", b"anonymous")
    assert c.status()["vgpus"]["alive"] == 4  # admin ctl over CURVE works too


def test_curve_executor_keys_are_bound_to_their_vgpus(curve_cluster, tmp_path):
    c, cfg, keys = curve_cluster
    sec = Security(curve=True, server=load_keypair(keys / "server.key"),
                   own=load_keypair(keys / "executors/ex01.key_secret", need_secret=True))
    ctx = zmq.Context()
    try:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        connect_as(s, sec)
        s.connect(cfg.executor)
        s.send(wire.register([2], f"ipc://{tmp_path}/x.sock", "emulate", os.getpid(), 0, 9))
        assert s.poll(5000)
        h = wire.decode(s.recv_multipart()[0])
        assert h.type == T.ERROR and h.code == "unauthorized-vgpu" and "0-1" in h.message
        # a client's key does not open the executor socket at all
        s2 = ctx.socket(zmq.DEALER)
        s2.setsockopt(zmq.LINGER, 0)
        connect_as(s2, sec, own=load_keypair(keys / "clients/cam.key_secret", need_secret=True))
        s2.connect(cfg.executor)
        s2.send(wire.register([200], f"ipc://{tmp_path}/y.sock", "emulate", os.getpid(), 0, 9))
        assert not s2.poll(1500)
    finally:
        ctx.destroy(0)
    with Client(c.client_endpoint, timeout_s=10, key_file=str(keys / "clients/cam.key_secret"),
                server_key_file=str(keys / "server.key")) as cl:
        assert [r.data for r in cl.submit_many("tiny", [b"a", b"b", b"c"])] == [b"a", b"b", b"c"]


def test_curve_a_reply_never_reaches_another_client_on_the_same_identity(curve_cluster):
    """Client A (key cam) submits under the ROUTER identity b"victim" while the executors are
    stopped, and leaves; client B (another allowed key) connects under the same identity. A's
    reply, when it comes, is not sent to B: it was owed to a connection that closed."""
    import signal

    c, _, keys = curve_cluster
    ctx = zmq.Context()

    def client(name: str) -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"victim")
        connect_as(s, Security(curve=True, server=load_keypair(keys / "server.key")),
                   own=load_keypair(keys / f"clients/{name}.key_secret", need_secret=True))
        s.connect(c.client_endpoint)
        return s

    before = c.status()["models"]["tiny"]["accepted"]
    for p in c.executors:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        a = client("cam")
        a.send_multipart([wire.submit("tiny", 3_000_000, [4242]), b"SECRET-OF-A"])
        deadline = time.monotonic() + 10
        while c.status()["models"]["tiny"]["accepted"] == before and time.monotonic() < deadline:
            time.sleep(0.05)
        a.close(0)
        time.sleep(0.5)  # the daemon hears of the disconnect
        b = client("cam2")
        b.send(wire.ping(7))
        assert b.poll(5000)
        assert wire.decode(b.recv_multipart()[0]).type == T.PONG
    finally:
        for p in c.executors:
            os.kill(p.pid, signal.SIGCONT)
    deadline = time.monotonic() + 15
    while not c.status()["counters"].get("replies_to_closed_connections") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.status()["counters"]["replies_to_closed_connections"] == 1
    got = []
    while b.poll(500):
        got.append(b.recv_multipart())
    ctx.destroy(0)
    assert not any(b"SECRET-OF-A" in f for m in got for f in m), got
    assert not any(wire.decode(m[0]).type == T.REPLY for m in got), got


def test_without_curve_a_reply_never_reaches_another_client_on_the_same_identity(cluster):
    """No CURVE (ipc): client A submits under the ROUTER identity b"cam" while the executors are
    stopped, and closes its socket; client B connects under the same identity and submits the
    same request ids. B gets exactly its own replies, never A's results."""
    import signal

    c, _ = cluster
    ctx = zmq.Context()

    def client() -> zmq.Socket:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.ROUTING_ID, b"cam")
        s.connect(c.client_endpoint)
        return s

    n = 20
    ids = list(range(1, n + 1))
    before = c.status()["models"]["tiny"]["accepted"]
    for p in c.executors:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        a = client()
        a.send_multipart([wire.submit("tiny", 20_000_000, ids), *[b"A%d" % i for i in ids]])
        deadline = time.monotonic() + 10
        while c.status()["models"]["tiny"]["accepted"] < before + n and time.monotonic() < deadline:
            time.sleep(0.05)
        a.close(0)
        time.sleep(0.3)  # the daemon hears of the disconnect
        b = client()
        b.send_multipart([wire.submit("tiny", 20_000_000, ids), *[b"B%d" % i for i in ids]])
        deadline = time.monotonic() + 10
        while c.status()["models"]["tiny"]["accepted"] < before + 2 * n and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        for p in c.executors:
            os.kill(p.pid, signal.SIGCONT)
    got: dict[int, list] = {}
    end = time.monotonic() + 20
    while time.monotonic() < end and (len(got) < n or b.poll(300)):
        if not b.poll(200):
            continue
        m = b.recv_multipart()
        h = wire.decode(m[0])
        if h.type == T.REPLY:
            for i, rid in enumerate(h.ids):
                got.setdefault(rid, []).append(bytes(m[1 + i]) if h.status == Status.OK else h.reason)
    ctx.destroy(0)
    assert got == {i: [b"B%d" % i] for i in ids}, got
    assert c.status()["counters"]["replies_to_closed_connections"] >= n


async def test_daemon_restart_ends_every_pending_request_explicitly():
    with short_tmpdir("ppiped-restart-") as d, tiny_cluster(Path(d), ((0, 1, 2, 3),)) as c:
        async with AsyncClient(c.client_endpoint, timeout_s=30) as ac:
            assert (await ac.submit("tiny", b"before", slo_ms=5000)).data == b"before"
            epoch = ac.epoch if ac.epoch is not None else (await ac.info())["epoch"]
            outs, waited = await c.restart_with_pending(ac, 50, "tiny")  # batches hang meanwhile
            reasons = {o.reason for o in outs if isinstance(o, Dropped)}
            assert all(isinstance(o, Dropped) for o in outs), outs[:3]
            assert reasons <= {wire.DAEMON_RESTARTED, wire.DAEMON_UNREACHABLE}, reasons
            assert waited < 10
            info = await ac.info(timeout_s=10)
            assert info["epoch"] != epoch


@pytest.mark.parametrize("down_s, knows_epoch", [(0.3, True), (3.0, True), (3.0, False)])
async def test_requests_the_client_ended_are_never_served_by_the_restarted_daemon(down_s, knows_epoch):
    """Requests submitted while the scheduler is down wait in the client's socket and reach the
    restarted one; the client ends them (daemon-restarted when it hears of the restart, or
    daemon-unreachable after 2 s of silence, even before it ever learned an epoch), so the new
    scheduler must not serve or count them: what the client saw served is what the daemon
    counts, and new requests are served."""
    from ppiped.client import Result

    with short_tmpdir("ppiped-restart-") as d, tiny_cluster(Path(d), ((0, 1, 2, 3),)) as c:
        async with AsyncClient(c.client_endpoint, timeout_s=30) as ac:
            if knows_epoch:
                assert (await ac.submit("tiny", b"before", slo_ms=5000)).data == b"before"
                await ac.info()  # the client knows the first scheduler's epoch
            c.kill_server()
            futs = [asyncio.ensure_future(ac.submit("tiny", b"q%d" % i, slo_ms=20_000)) for i in range(40)]
            await asyncio.sleep(down_s)
            c.restart_server()
            outs = await asyncio.gather(*futs, return_exceptions=True)
            lost = {wire.DAEMON_RESTARTED, wire.DAEMON_UNREACHABLE}
            served = sum(isinstance(o, Result) for o in outs)
            kept = [o for o in outs if not (isinstance(o, Dropped) and o.reason in lost)]
            assert all(isinstance(o, (Result, Dropped, Rejected)) for o in outs), outs[:3]
            end = time.monotonic() + 60  # the new daemon is up and its executors are back
            while not ((st := c.status(timeout_s=1.0)) and st["vgpus"]["alive"] == 4) and time.monotonic() < end:
                await asyncio.sleep(0.1)
            await asyncio.sleep(1.0)  # anything still on its way reaches the new daemon
            st = c.status(timeout_s=10)
            assert st["models"]["tiny"]["accepted"] == len(kept), (st["models"]["tiny"], outs[:3])
            assert st["models"]["tiny"]["ok"] == served
            assert (await ac.submit("tiny", b"after", slo_ms=5000)).data == b"after"


def test_a_frame_past_the_tensor_cap_never_reaches_the_scheduler(cluster):
    """A process on the host sends the executor socket one frame just past the cap derived from
    the tiny profiles (their 64 MiB floor): libzmq drops it and its connection before the loop
    sees it (without the cap the scheduler allocated it and counted it malformed), and legit
    traffic is served on."""
    from ppiped.daemon.config import tensor_frame_cap

    c, cfg = cluster
    cap, _ = tensor_frame_cap(cfg)
    before = c.status()["counters"].get("exec_malformed", 0)
    imp = Impostor(cfg.executor)
    try:
        imp.sock.send(b"\x00" * (cap + wire.FRAME_SLACK + 1))
        imp.sock.send(b"\x01" * 64)  # after it, a small malformed message on a new connection
        deadline = time.monotonic() + 5
        while c.status()["counters"].get("exec_malformed", 0) == before and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)
        assert c.status()["counters"].get("exec_malformed", 0) == before + 1
    finally:
        imp.close()
    with Client(c.client_endpoint, timeout_s=10) as cl:
        out = cl.submit_many("tiny", [b"x"] * 3, slo_ms=500)
    assert len(out) == 3 and all(not isinstance(r, (Dropped, Rejected)) for r in out)
