"""Random frames and headers at both scheduler endpoints of a live daemon (hypothesis).

Every client message gets an answer; no peer input takes the daemon down or costs a legit
client its request; the daemon's log holds no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import msgpack
import pytest
import zmq
from conftest import tiny_cluster
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ppiped import wire
from ppiped.client import Client
from ppiped.daemon.config import load_config
from ppiped.daemon.launch import short_tmpdir
from ppiped.wire import T


@pytest.fixture(scope="module")
def target():
    with short_tmpdir("ppiped-fuzz-") as d, tiny_cluster(Path(d), ((0, 2), (1, 3))) as c:
        conf = load_config(c.config)
        ctx = zmq.Context()
        socks = {}
        try:
            for name, ep in (("client", conf.client), ("executor", conf.executor), ("ctl", conf.ctl)):
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(ep)
                socks[name] = s
            yield c, socks
        finally:
            ctx.destroy(0)


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=5),
                                                       st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                      max_leaves=12)
# Mostly well-formed prefixes ([version, known type, ...]) so the checks past decode() are reached.
headers = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda t, fields: msgpack.packb([wire.VERSION, t, *fields]),
              st.sampled_from([int(x) for x in T] + [0, 99]), st.lists(values, max_size=7)),
    st.builds(lambda fields: msgpack.packb(fields), st.lists(values, max_size=8)),
)
messages = st.tuples(headers, st.lists(st.binary(max_size=32), max_size=4))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(to_client=messages, to_executor=messages)
def test_random_messages_never_hurt_the_daemon(target, to_client, to_executor):
    c, socks = target
    s = socks["client"]
    s.send_multipart([to_client[0], *to_client[1]])
    assert s.poll(5000), f"no answer to a client message {to_client!r}"
    while s.poll(0):
        s.recv_multipart()
    socks["executor"].send_multipart([to_executor[0], *to_executor[1]])
    while socks["executor"].poll(20):
        socks["executor"].recv_multipart()
    assert c.server.poll() is None, "the daemon died"


json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=False), st.text(max_size=12)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=3)),
    max_leaves=10)
ctl_bodies = st.one_of(
    st.binary(max_size=64),
    st.builds(lambda v: json.dumps(v).encode(), json_values),
    st.builds(lambda cmd, rest: json.dumps({"cmd": cmd, **rest}).encode(),
              st.one_of(st.sampled_from(["status", "plan", "bogus", ""]), json_values).filter(
                  lambda c: c not in ("stop", "reset-overhead")),  # (real commands, not input faults)
              st.dictionaries(st.text(max_size=6), json_values, max_size=3)))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=ctl_bodies)
def test_random_ctl_requests_are_answered_and_hurt_nothing(target, body):
    """The ZeroMQ ctl endpoint (status for ppiped-ctl and the bench): any request body gets one
    JSON answer, a status or an error naming what is wrong."""
    c, socks = target
    s = socks["ctl"]
    s.send_multipart([b"", body])
    assert s.poll(5000), f"no answer to ctl body {body!r}"
    delim, reply = s.recv_multipart()
    out = json.loads(reply)
    assert isinstance(out, dict) and ("error" in out or "models" in out), out
    assert c.server.poll() is None, "the daemon died"


def test_after_the_fuzz_legit_clients_are_served(target):
    c, _ = target
    with Client(c.client_endpoint, timeout_s=10) as cl:
        assert [r.data for r in cl.submit_many("tiny", [b"a", b"b"], slo_ms=2000)] == [b"a", b"b"]
    assert c.server.poll() is None
    assert "Traceback" not in c.tail("serve.log", 5000)
    st_ = c.status()
    assert st_["vgpus"]["alive"] == 4


def test_connections_that_only_pinged_leave_no_client_state(target):
    """Every closed connection used to leave its identity's generation behind, whether or not
    a request of it was ever in flight: 300 connect-ping-close rounds held 300 entries."""
    c, _ = target
    ctx = zmq.Context()
    try:
        for i in range(300):
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.connect(c.client_endpoint)
            s.send(wire.ping(i))
            assert s.poll(5000)
            s.close(0)
        with Client(c.client_endpoint, timeout_s=10) as cl:  # its messages drain the disconnects
            assert cl.submit_many("tiny", [b"x"], slo_ms=2000)[0].data == b"x"
            st_ = c.status()
        assert st_["client_identities"] <= 10, st_["client_identities"]
    finally:
        ctx.destroy(0)


def test_an_echoed_ping_token_is_bounded(target):
    """A PING's token comes back in its PONG: past MAX_PING_BYTES it is refused, so unread
    PINGs cannot make the daemon hold their size again."""
    c, socks = target
    s = socks["client"]
    while s.poll(0):
        s.recv_multipart()
    s.send(wire.ping(b"t" * 64))
    assert s.poll(5000)
    h = wire.decode(s.recv_multipart()[0])
    assert h.type == T.PONG and h.token == b"t" * 64
    s.send(wire.ping(b"t" * wire.MAX_PING_BYTES))
    assert s.poll(5000)
    h = wire.decode(s.recv_multipart()[0])
    assert h.type == T.ERROR and h.code == wire.MALFORMED and "PING of" in h.message


@pytest.mark.parametrize("header", [
    msgpack.packb([b"\0" * 100_000, 1]),  # a version field of 100 kB
    msgpack.packb([wire.VERSION, "t" * 100_000]),  # a type field
    wire.submit("m" * 100_000, 1000, [1]),  # an unknown model's name
])
def test_errors_never_quote_a_peer_field_whole(target, header):
    """An answer to a bad header quotes at most a few dozen characters of it: quoting whole
    fields made every reply (and log line) 4x the size of what provoked it."""
    c, socks = target
    s = socks["client"]
    while s.poll(0):
        s.recv_multipart()
    s.send_multipart([header, b"x"])
    assert s.poll(5000)
    reply = s.recv_multipart()
    assert sum(len(f) for f in reply) < 1000
    assert c.server.poll() is None
