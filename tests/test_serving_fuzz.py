"""Random frames and headers at both scheduler endpoints of a live daemon (hypothesis).

Every client message gets an answer; no peer input takes the daemon down or costs a legit
client its request; the daemon's log holds no traceback."""

from __future__ import annotations

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
            for name, ep in (("client", conf.client), ("executor", conf.executor)):
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


def test_after_the_fuzz_legit_clients_are_served(target):
    c, _ = target
    with Client(c.client_endpoint, timeout_s=10) as cl:
        assert [r.data for r in cl.submit_many("tiny", [b"a", b"b"], slo_ms=2000)] == [b"a", b"b"]
    assert c.server.poll() is None
    assert "Traceback" not in c.tail("serve.log", 5000)
    st_ = c.status()
    assert st_["vgpus"]["alive"] == 4
