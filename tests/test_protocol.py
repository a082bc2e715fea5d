"""The wire protocol, the serving config and the log format: pure functions, no sockets."""

from __future__ import annotations

import io
import logging

import msgpack
import numpy as np
import pytest

from ppiped import logs, wire
from ppiped.client import Dropped, Rejected, Result, error_for
from ppiped.daemon.config import ConfigError, config_from_dict, format_ranges, parse_vgpus
from ppiped.security import keygen
from ppiped.wire import ProtocolError, Status, T


def test_every_constructor_round_trips():
    a = wire.Assignment(3, "m", 0, 1, 4, 10, "P4", 1, 7, True, [1.0, 2.5], [0.0, 0.0])
    msgs = [
        wire.submit("m", 0, [1, 2]), wire.reply([1], Status.OK, "", [["<f4", [10], "y"]]),
        wire.error("x", "y"), wire.ping(5), wire.pong(5, {"a": 1}),
        wire.register([0, 1], "ipc:///tmp/x", "emulate", 42, 5, 7), wire.welcome([a.to_wire()], 100),
        wire.peers({0: "ipc://a", 1: "ipc://b"}), wire.heartbeat(123, 0),
        wire.dispatch(9, [0, 3], [10, 20], [1, 2]), wire.forward(9, [0, 3], [10, 20], 1, [1, 2], None),
        wire.result(9, [1], None, [2, "bad-input: short"]), wire.feedback([0, 9, 0, 1, 2, 3]),
        wire.cancel([9]), wire.bye([0]), wire.prepare(4, [a.to_wire()]), wire.preloaded(4, 1500, ""),
    ]
    for m in msgs:
        h = wire.decode(m)
        assert h.version == wire.VERSION and type(h) is wire.STRUCTS[h.type]
        assert len(m) < 200  # headers stay tiny
    b = wire.Assignment.from_wire(wire.decode(wire.welcome([a.to_wire()], 100)).assignments[0])
    assert b.to_wire() == a.to_wire()
    # the daemon spots PRELOADED by its third byte without decoding (server._on_exec_ops)
    assert wire.preloaded(2**40, 2**40, "x" * 300)[2] == T.PRELOADED
    assert wire.decode(wire.prepare(4, [a.to_wire()])).assignments == [a.to_wire()]


@pytest.mark.parametrize("raw, code, text", [
    (b"\xc1", wire.MALFORMED, "not msgpack"),
    (msgpack.packb({"v": 1}), wire.MALFORMED, "array"),
    (msgpack.packb([1]), wire.MALFORMED, "array"),
    (msgpack.packb([2, T.SUBMIT, "m", 0, [1]]), wire.VERSION_MISMATCH, "version 2"),
    (msgpack.packb([1, 77]), wire.MALFORMED, "unknown message type 77"),
    (msgpack.packb([1, "SUBMIT"]), wire.MALFORMED, "unknown message type"),
    (msgpack.packb([1, T.SUBMIT, "m", 0]), wire.MALFORMED, "expected 3 to 6 fields"),
    (msgpack.packb([1, T.SUBMIT, 5, 0, [1]]), wire.MALFORMED, "SUBMIT.model: expected string"),
    (msgpack.packb([1, T.SUBMIT, "m", -1, [1]]), wire.MALFORMED, "SUBMIT.slo_us"),
    (msgpack.packb([1, T.SUBMIT, "m", 0, [1, True]]), wire.MALFORMED, "SUBMIT.ids"),
    (msgpack.packb([1, T.DISPATCH, 1, [0], [1.5], [1]]), wire.MALFORMED, "DISPATCH.starts"),
    (msgpack.packb([1, T.FEEDBACK, "x"]), wire.MALFORMED, "FEEDBACK.entries"),
    # strings that are not UTF-8, on either decoding path (msgspec raised UnicodeDecodeError past
    # every reader: the sender got no answer)
    (msgpack.packb([1, T.SUBMIT, "m", 0, [1]]).replace(b"\xa1m", b"\xa1\xff"), wire.MALFORMED, "not UTF-8"),
    (msgpack.packb([1, T.REGISTER, [0], "ab", "emulate", 1, 0, 1]).replace(b"\xa2ab", b"\xa2\xc3("),
     wire.MALFORMED, "not UTF-8"),
    (msgpack.packb([1, T.ERROR, "c", "m"], use_bin_type=True).replace(b"\xa1c", b"\xa1\x80"), wire.MALFORMED,
     "not UTF-8"),
    # an executor's clock past 2^62 µs (2^64 - 1 once overflowed every DISPATCH through its vGPUs)
    (msgpack.packb([1, T.HEARTBEAT, 2**64 - 1, 0]), wire.MALFORMED, "HEARTBEAT.clock_us"),
    (msgpack.packb([1, T.HEARTBEAT, -5, 0]), wire.MALFORMED, "HEARTBEAT.clock_us"),
    (msgpack.packb([1, T.REGISTER, [0], "ipc://a", "emulate", 1, 2**62, 1]), wire.MALFORMED, "REGISTER.clock_us"),
])
def test_malformed_headers_raise_typed_errors(raw, code, text):
    with pytest.raises(ProtocolError) as e:
        wire.decode(raw)
    assert e.value.code == code and text in str(e.value)


def test_header_size_limit_and_frame_count():
    with pytest.raises(ProtocolError, match="exceeds"):
        wire.decode(b"\x90" * (wire.MAX_HEADER_BYTES + 1))
    h = wire.decode(wire.submit("m", 0, [1, 2]))
    wire.expect_frames(h, 2, len(h.ids))
    with pytest.raises(ProtocolError, match="announces 2"):
        wire.expect_frames(h, 1, len(h.ids))


def test_submit_priority_is_an_optional_trailing_field():
    """Older clients send SUBMIT without a priority: it decodes as the low class; a newer one
    sends it only when it is not 0, so older daemons keep understanding low-class submits."""
    assert wire.decode(wire.submit("m", 0, [1])).priority == 0
    assert wire.decode(wire.submit("m", 0, [1], 1)).priority == 1
    assert len(wire.submit("m", 0, [1])) < len(wire.submit("m", 0, [1], 1))
    with pytest.raises(ProtocolError, match="SUBMIT.priority"):
        wire.decode(msgpack.packb([1, T.SUBMIT, "m", 0, [1], "high"]))
    with pytest.raises(ProtocolError, match="expected 3 to 6 fields"):
        wire.decode(msgpack.packb([1, T.SUBMIT, "m", 0, [1], 1, 2, 3, 4]))
    with pytest.raises(ProtocolError, match="expected 1 fields"):  # no optional fields elsewhere
        wire.decode(msgpack.packb([1, T.PING]))


def test_submit_epoch_is_an_optional_trailing_field_sent_only_when_known():
    """A client stamps SUBMIT and QUERY with the scheduler epoch it knows; without one (0) the
    bytes are as before, so an older daemon understands every submit of a client that has not
    seen it say that it checks epochs."""
    assert wire.submit("m", 0, [1], 0, 5) == msgpack.packb([1, T.SUBMIT, "m", 0, [1], 0, 5])
    assert wire.decode(wire.submit("m", 0, [1], 0, 5)).epoch == 0
    assert wire.decode(wire.submit("m", 0, [1], 0, 0, 77)).epoch == 77
    assert wire.query("a", 0, 3, sent_us=5) == msgpack.packb([1, T.QUERY, "a", 0, 3, 0, 0, 5])
    assert wire.decode(wire.query("a", 0, 3, epoch=9)).epoch == 9
    assert wire.heartbeat(5, 1) == msgpack.packb([1, T.HEARTBEAT, 5, 1])  # nothing unreachable
    assert wire.decode(wire.heartbeat(5, 1, [4])).unreachable == [4]


def test_submit_sent_us_is_an_optional_trailing_field():
    """``sent_us`` follows ``priority``: a sender that gives it spells the priority out (0 too);
    left out, or from an older client, it decodes as 0 (unknown)."""
    assert wire.decode(wire.submit("m", 0, [1])).sent_us == 0
    h = wire.decode(wire.submit("m", 0, [1], 1))
    assert (h.priority, h.sent_us) == (1, 0)
    assert wire.decode(wire.submit("m", 0, [1], 0, 123_456_789)) == wire.Submit(1, T.SUBMIT, "m", 0, [1], 0, 123_456_789)
    assert msgpack.unpackb(wire.submit("m", 0, [1], 0, 5)) == [1, T.SUBMIT, "m", 0, [1], 0, 5]
    h = wire.decode(msgpack.packb([1, T.SUBMIT, "m", 0, [1], 1, 7]))
    assert (h.priority, h.sent_us) == (1, 7)
    for bad in (-1, 1.5, "now"):
        with pytest.raises(ProtocolError, match="SUBMIT.sent_us"):
            wire.decode(msgpack.packb([1, T.SUBMIT, "m", 0, [1], 0, bad]))


def test_bad_assignment_rejected():
    with pytest.raises(ProtocolError):
        wire.Assignment.from_wire([1, 2, 3])
    with pytest.raises(ProtocolError):
        wire.Assignment.from_wire([0, "m", 0, 0, 0, 1, "G", 1, 0, "yes", [1.0], [0.0]])


def test_client_result_and_errors():
    y = np.arange(6, dtype=np.float32)
    z = np.array([1, 2], dtype=np.int64)
    r = Result(y.tobytes() + z.tobytes(), [["<f4", [2, 3], "y"], ["<i8", [2], "z"]])
    a, b = r.arrays()
    assert a.shape == (2, 3) and a[1, 2] == 5 and list(b) == [1, 2]
    for meta in ([[",", [2], "y"]], [["<f4", [11], "y"]], [["<f4", [2]]]):  # np.dtype(",") raised SyntaxError
        with pytest.raises(ValueError, match="does not describe its 40 bytes"):
            Result(y.tobytes() + z.tobytes(), meta).arrays()
    assert isinstance(error_for(Status.DROPPED, "deadline"), Dropped)
    e = error_for(Status.REJECTED, "unknown-model", "m")
    assert isinstance(e, Rejected) and e.reason == "unknown-model" and "m" in str(e)


BASE = {"plan": "p.json", "profiles": "profiles"}


@pytest.mark.parametrize("extra, text", [
    ({"bogus": 1}, "top level: unknown key(s) bogus"),
    ({"endpoints": {"client": "tcp://0.0.0.0:5555"}}, "endpoints.client: 'tcp://0.0.0.0:5555' is not"),
    ({"endpoints": {"client": "tcp://10.0.0.1:5555"}}, "endpoints.client"),
    ({"security": {"curve": True}}, "security.server_key (scheduler host) or security.server_public_key"),
    ({"security": {"curve": True, "server_key": "/nonexistent/s.key_secret"}}, "security.server_key: cannot read"),
    ({"security": {"curv": True}}, "security: unknown key(s) curv"),
    ({"endpoints": {"executor": 5}}, "endpoints.executor: expected a string"),
    ({"limits": {"max_payload_bytes": 0}}, "limits.max_payload_bytes: expected an integer >= 1"),
    ({"limits": {"max_pending": "many"}}, "limits.max_pending"),
    ({"limits": {"max_tensor_bytes": 4096}}, "limits.max_tensor_bytes: expected 65536 to 1099511627776 bytes"),
    ({"limits": {"max_tensor_bytes": 2**50}}, "limits.max_tensor_bytes: expected 65536"),
    ({"endpoints": {"client": "ipc:///tmp/x/c.sock", "executor": "ipc:///tmp/x/../x/c.sock"}},
     "endpoints.executor: 'ipc:///tmp/x/../x/c.sock' is also endpoints.client"),
    ({"limits": {"max_backlog_ms": float("inf")}}, "limits.max_backlog_ms: expected a positive number below 1e15"),
    ({"heartbeat": {"interval_ms": 100, "timeout_ms": 150}}, "heartbeat.timeout_ms: must be at least twice"),
    ({"executor": {"backend": "cuda"}}, "executor.backend: expected one of emulate, ort, trt"),
    ({"executor": {"partitions": 3}}, "executor.partitions: expected a string"),
    ({"executors": {"x": {}}}, "executors.x: tables under [executors] are keyed by vGPU id"),
    ({"executors": {"3": {"threads": 0}}}, "executors.3.threads"),
    ({"models": {"m": {"slo_ms": -1}}}, "models.m.slo_ms: expected a positive number"),
    ({"models": {"m": {"slo": 1}}}, "models.m: unknown key(s) slo"),
])
def test_config_errors_name_the_key(extra, text):
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, **extra}, "/etc/ppiped.toml")
    assert text in str(e.value) and "/etc/ppiped.toml" in str(e.value)


def test_tensor_cap_is_derived_from_every_profile_in_the_directory(tmp_path):
    """The daemon and its executors read the same directory, so they derive the same cap: the
    headroom times the largest tensor any profile sends (boundary or input) at its largest
    batch, never below the floor; an explicit key wins; no readable profiles: the default."""
    from ppiped.daemon.config import (
        TENSOR_CAP_FLOOR,
        TENSOR_CAP_UNKNOWN,
        TENSOR_HEADROOM,
        tensor_frame_cap,
    )
    from ppiped.profiles import Profile, save_profile

    d = tmp_path / "profiles"
    d.mkdir()
    big = 40 << 20  # bytes per request at one boundary; 8 requests a batch at most
    lat = np.ones((3, 8))
    m = Profile("m", 3, {"T4": {1: lat}}, np.array([1000.0, big]), {"T4": 3.0})
    save_profile(m, d / "m.json")
    save_profile(Profile("s", 2, {"T4": {1: np.ones((2, 2))}}, np.array([10.0]), {"T4": 2.0}), d / "s.json")
    cfg = config_from_dict({"plan": "p.json", "profiles": str(d)}, tmp_path / "ppiped.toml")
    assert tensor_frame_cap(cfg)[0] == TENSOR_HEADROOM * big * 8
    (d / "m.json").unlink()
    assert tensor_frame_cap(cfg)[0] == TENSOR_CAP_FLOOR  # s alone: 4 x 10 x 2 bytes
    cfg.profiles = tmp_path / "nowhere"
    assert tensor_frame_cap(cfg)[0] == TENSOR_CAP_UNKNOWN
    assert tensor_frame_cap(cfg, {"m": m})[0] == TENSOR_HEADROOM * big * 8  # the daemon's own
    cfg.max_tensor_bytes = 1 << 20
    assert tensor_frame_cap(cfg) == (1 << 20, "limits.max_tensor_bytes")


def test_config_defaults_overrides_and_templates(tmp_path):
    cfg = config_from_dict({
        **BASE,
        "endpoints": {"client": "ipc:///run/ppiped/c.sock", "executor": "tcp://127.0.0.1:6000"},
        "executor": {"backend": "ort", "partitions": "parts/{model}/{start}-{end}.onnx", "data_port_base": 9000},
        "executors": {"2": {"backend": "trt", "data_endpoint": "ipc:///tmp/x-{vgpu}.sock"}},
    }, tmp_path / "ppiped.toml")
    assert cfg.plan == tmp_path / "p.json"
    assert cfg.executor_settings(0).backend == "ort" and cfg.executor_settings(2).backend == "trt"
    assert cfg.executor_settings(2).partitions == "parts/{model}/{start}-{end}.onnx"  # inherited
    assert cfg.executor_settings(1).endpoint_for(1) == "tcp://127.0.0.1:9001"
    assert cfg.executor_settings(2).endpoint_for(2) == "ipc:///tmp/x-2.sock"
    p = cfg.partition_file(cfg.executor_settings(0), model="m", start=0, end=4)
    assert p == tmp_path / "parts" / "m" / "0-4.onnx"
    with pytest.raises(ConfigError, match="leaves this host, so security.curve must be true"):
        config_from_dict({**BASE, "endpoints": {"allow_remote": True, "client": "tcp://10.0.0.1:5555"}})
    keys = tmp_path / "keys"
    keygen(keys, "server")
    remote = config_from_dict({**BASE, "endpoints": {"allow_remote": True, "client": "tcp://10.0.0.1:5555"},
                               "security": {"curve": True, "server_key": str(keys / "server.key_secret")}})
    assert remote.client == "tcp://10.0.0.1:5555" and remote.security.curve


def test_the_shipped_example_config_is_valid():
    from pathlib import Path

    from ppiped.daemon.config import load_config

    cfg = load_config(Path(__file__).resolve().parents[1] / "plans" / "ppiped.toml")
    assert cfg.client.startswith("tcp://127.0.0.1:") and cfg.heartbeat_timeout_ms >= 2 * cfg.heartbeat_interval_ms


def test_vgpu_ranges():
    assert parse_vgpus(["3", "8-10,14"]) == [3, 8, 9, 10, 14]
    assert format_ranges([14, 3, 8, 9, 10]) == "3,8-10,14"
    for bad in (["x"], ["3-1"], ["1", "1"]):
        with pytest.raises(ConfigError):
            parse_vgpus(bad)


def test_logfmt_and_journal_prefix(monkeypatch):
    assert logs.logfmt("dispatch", {"vgpu": 3, "msg": "a b", "x": 1.5, "q": 'say "hi"'}) == \
        'dispatch vgpu=3 msg="a b" x=1.5 q="say \\"hi\\""'
    for journal, check in ((True, lambda s: s.startswith("<4>ppiped.t: warn-event k=v")),
                           (False, lambda s: " warn  ppiped.t: warn-event k=v" in s)):
        if journal:
            monkeypatch.setenv("JOURNAL_STREAM", "8:1234")
        else:
            monkeypatch.delenv("JOURNAL_STREAM", raising=False)
        buf = io.StringIO()
        logs.setup("info", stream=buf)
        logs.get("ppiped.t").warning("warn-event", k="v")
        logs.get("ppiped.t").debug("hidden")
        out = buf.getvalue().strip()
        assert check(out) and "hidden" not in out, out
    logging.getLogger("ppiped").handlers.clear()


@pytest.mark.parametrize("timerfd", [True, False])
async def test_timers_fire_in_order_and_cancel(monkeypatch, timerfd):
    import asyncio

    from ppiped.daemon import loop as L

    if not timerfd:
        monkeypatch.setattr(L, "_timerfd", lambda: None)
    timers = L.Timers(asyncio.get_running_loop())
    fired = []
    t0 = L.now_us()
    for k in (3, 1, 2, 5):
        timers.call_at(t0 + k * 2000, fired.append, k)
    gone = timers.call_at(t0 + 4000, fired.append, 99)
    L.Timers.cancel(gone)
    timers.call_at(t0 - 1000, fired.append, 0)  # already due: fires at once
    for _ in range(200):
        if len(fired) == 5:
            break
        await asyncio.sleep(0.005)
    timers.close()
    assert fired == [0, 1, 2, 3, 5]


def test_sd_notify(monkeypatch, tmp_path):
    import socket

    from ppiped.daemon import sdnotify

    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    path = str(tmp_path / "notify.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind(path)
        monkeypatch.setenv("NOTIFY_SOCKET", path)
        assert sdnotify.notify("READY=1") is True
        assert s.recv(100) == b"READY=1"
    monkeypatch.setenv("WATCHDOG_USEC", "15000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval_s() == 5.0
