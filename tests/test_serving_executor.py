"""Executor daemons against a scripted scheduler: registration, reservation order, fp16 hops, results."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import zmq

from ppiped import wire
from ppiped.daemon.loop import now_us
from ppiped.executor import tiny
from ppiped.wire import T

LAT = [1000.0 * (1 + 0.25 * k) for k in range(8)]


def write_config(tmp_path, backend="emulate", extra=""):
    tiny.write_example(tmp_path)
    cfg = tmp_path / "ppiped.toml"
    cfg.write_text(f"""
plan = "plan.json"
profiles = "profiles"
[endpoints]
executor = "ipc://{tmp_path}/sched.sock"
[heartbeat]
interval_ms = 50
timeout_ms = 500
[executor]
backend = "{backend}"
data_endpoint = "ipc://{tmp_path}/data-{{vgpu}}.sock"
partitions = "parts/{{model}}/{{start}}-{{end}}.onnx"
{extra}
""")
    return cfg


class FakeScheduler:
    """The scheduler's side of the executor protocol, driven step by step from a test."""

    def __init__(self, endpoint):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.procs = []
        self.seen = []
        self.piggybacked = []

    def spawn(self, cfg, vgpus, *extra):
        p = subprocess.Popen([sys.executable, "-m", "ppiped.executor.main", "--config", str(cfg),
                              "--vgpu", vgpus, *extra], stderr=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def recv(self, want, timeout_s=10.0):
        """Next message of type ``want`` as (identity, header, frames); others go to ``self.seen``."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.sock.poll(50):
                ident, head, *frames = self.sock.recv_multipart()
                h = wire.decode(head)
                if h[1] == T.RESULT:
                    self.piggybacked += h[6]
                if h[1] == want:
                    return ident, h, frames
                self.seen.append((ident, h, frames))
        raise AssertionError(f"no {T(want).name} within {timeout_s} s")

    def feedback(self, n, timeout_s=10.0):
        """Feedback entries seen so far plus new ones until there are ``n``."""
        fb = [x for _, h, _ in self.seen if h[1] == T.FEEDBACK for x in h[2]] + self.piggybacked
        self.piggybacked = []
        self.seen = [m for m in self.seen if m[1][1] != T.FEEDBACK]
        while len(fb) < n * wire.FEEDBACK_STRIDE:
            fb += self.recv(T.FEEDBACK, timeout_s)[1][2]
        k = wire.FEEDBACK_STRIDE
        return [fb[i:i + k] for i in range(0, len(fb), k)]

    def send(self, ident, header, *frames):
        self.sock.send_multipart([ident, header, *frames])

    def close(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        self.ctx.destroy(0)


@pytest.fixture
def sched(tmp_path):
    s = FakeScheduler(f"ipc://{tmp_path}/sched.sock")
    try:
        yield s
    finally:
        s.close()


def assignment(vgpu, part, last, lat=LAT):
    return wire.Assignment(vgpu, "tiny", 0, part, part, part + 1, "CPU", 1, vgpu, last, lat,
                           [0.0] * len(lat)).to_wire()


def welcome(sched, ident, vgpus):
    sched.send(ident, wire.welcome([assignment(v, v, v == 1) for v in vgpus], 50))
    sched.recv(T.HEARTBEAT)


def test_emulate_two_processes_in_reservation_order(sched, tmp_path):
    """With executors bounded to their reservations (start_early_us = 0; the default, inf,
    starts a batch as soon as the vGPU is free)."""
    cfg = write_config(tmp_path, extra="start_early_us = 0\n")
    sched.spawn(cfg, "0")
    sched.spawn(cfg, "1")
    idents = {}
    for _ in range(2):
        ident, h, _ = sched.recv(T.REGISTER)
        idents[h[2][0]] = ident
        assert h[4] == "emulate" and h[3] == f"ipc://{tmp_path}/data-{h[2][0]}.sock"
    directory = {0: f"ipc://{tmp_path}/data-0.sock", 1: f"ipc://{tmp_path}/data-1.sock"}
    for v in (0, 1):
        sched.send(idents[v], wire.peers(directory))
        welcome(sched, idents[v], [v])
    t0 = now_us() + 30_000
    # Batch 2 is reserved before batch 1 on vGPU 0; both arrive together: 2 must run first.
    sched.send(idents[0], wire.dispatch(1, [0, 1], [t0 + 5000, t0 + 8000], [10, 11]), b"a", b"b")
    sched.send(idents[0], wire.dispatch(2, [0, 1], [t0, t0 + 2000], [12]), b"c")
    results = {}
    while len(results) < 2:
        ident, h, frames = sched.recv(T.RESULT)
        results[h[2]] = dict(zip(h[3], frames, strict=True))
        assert ident == idents[1] and h[5] == []
    assert results == {1: {10: b"a", 11: b"b"}, 2: {12: b"c"}}
    entries = sched.feedback(4)
    by = {(b, hop): (v, ready, s, e) for v, b, hop, ready, s, e in entries}
    assert set(by) == {(1, 0), (1, 1), (2, 0), (2, 1)}
    for (b, hop), (v, ready, s, e) in by.items():
        reserved = {1: [t0 + 5000, t0 + 8000], 2: [t0, t0 + 2000]}[b][hop]
        assert v == hop and s >= reserved and s >= ready
        assert e - s >= LAT[[2, 1][b - 1] - 1] - 50
    assert by[(2, 0)][2] < by[(1, 0)][2]


def test_ort_partitions_fp16_hop_and_bad_frame(sched, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    cfg = write_config(tmp_path, backend="ort")
    sched.spawn(cfg, "0-1")
    ident, h, _ = sched.recv(T.REGISTER)
    assert h[2] == [0, 1] and h[4] == "ort"
    sched.send(ident, wire.peers({0: f"ipc://{tmp_path}/data-0.sock"}))
    welcome(sched, ident, [0, 1])
    rng = np.random.default_rng(1)
    x = rng.normal(0, 1, (2, *tiny.INPUT_SHAPE)).astype(np.float32)
    sched.send(ident, wire.dispatch(5, [0, 1], [0, 0], [1, 2, 3]), x[0].tobytes(), b"short", x[1].tobytes())
    got = {}
    while 5 not in got or "failed" not in got:
        _, h, frames = sched.recv(T.RESULT)
        if h[5]:
            got["failed"] = h[5]
        if h[3]:
            got[5] = (h[3], h[4], frames)
    assert got["failed"][0] == 2 and got["failed"][1].startswith("bad-input: frame of 5 bytes")
    ids, meta, frames = got[5]
    assert ids == [1, 3]
    assert meta == [["<f4", [tiny.CLASSES], "logits"]]
    sess = ort.InferenceSession(str(tmp_path / "parts" / "tiny.onnx"), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    for i, f in enumerate(frames):
        y = np.frombuffer(f, dtype=np.float32)
        np.testing.assert_allclose(y, want[i], rtol=2e-2, atol=2e-2)


def test_cancel_and_reregister(sched, tmp_path):
    cfg = write_config(tmp_path)
    sched.spawn(cfg, "0-1")
    ident, _, _ = sched.recv(T.REGISTER)
    welcome(sched, ident, [0, 1])
    t0 = now_us() + 200_000
    sched.send(ident, wire.dispatch(9, [0, 1], [t0, t0 + 2000], [1]), b"x")
    sched.send(ident, wire.cancel([9]))
    sched.send(ident, wire.dispatch(10, [0, 1], [0, 0], [2]), b"y")
    _, h, frames = sched.recv(T.RESULT)
    assert h[2] == 10 and frames == [b"y"]
    with pytest.raises(AssertionError):
        sched.recv(T.RESULT, timeout_s=0.5)
    # A scheduler that lost its state answers heartbeats with UNREGISTERED: the executor registers again.
    sched.send(ident, wire.error(wire.UNREGISTERED, "who are you"))
    _, h, _ = sched.recv(T.REGISTER)
    assert h[2] == [0, 1]


def test_refusal_and_bad_flags(sched, tmp_path):
    cfg = write_config(tmp_path)
    p = sched.spawn(cfg, "0")
    ident, _, _ = sched.recv(T.REGISTER)
    sched.send(ident, wire.error("unknown-vgpu", "vGPU 0 is not in the plan"))
    assert p.wait(timeout=10) == 2
    assert "unknown-vgpu" in p.stderr.read()
    r = subprocess.run([sys.executable, "-m", "ppiped.executor.main", "--config", str(cfg), "--vgpu", "3-1"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "--vgpu: bad range" in r.stderr


def test_broken_partition_file_exits_2_naming_it(sched, tmp_path):
    pytest.importorskip("onnxruntime")
    cfg = write_config(tmp_path, backend="ort")
    part = tmp_path / "parts" / "tiny" / "1-2.onnx"
    part.write_bytes(b"this is not an ONNX model")
    p = sched.spawn(cfg, "0,1")
    ident, _, _ = sched.recv(T.REGISTER)
    sched.send(ident, wire.welcome([assignment(v, v, v == 1) for v in (0, 1)], 50))
    rc = p.wait(timeout=20)
    err = p.stderr.read()
    assert rc == 2, err
    line = next(x for x in err.splitlines() if x.startswith("ppiped-executor: error: cannot load"))
    assert "vGPU 1 (tiny pipeline 0 partition 1, blocks [1,2))" in line, line
