"""Apps served end to end: the query tracker, the glue workers, and the daemon answering every
QUERY exactly once (emulated executors, which echo their input, and :mod:`ppiped.query.testing_glue`,
whose ``fan`` yields as many children as the frame's first byte says)."""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
import zmq

from ppiped import wire
from ppiped.client import AsyncClient, Dropped, Rejected
from ppiped.daemon.config import ConfigError, config_from_dict
from ppiped.daemon.launch import LocalCluster, short_tmpdir, write_config
from ppiped.executor import tiny
from ppiped.query import testing_glue as tg
from ppiped.query.app import App, Stage, app_from_json, planned_yield
from ppiped.query.glue import GlueError, GluePool, GlueSpec, run_glue
from ppiped.query.tracker import Glue, QueryTracker, Submit
from ppiped.wire import Status, T

FAN = "ppiped.query.testing_glue:fan"
APP_SLO_MS = 400.0


def app_json(glue: str = FAN, budgets: bool = True) -> dict:
    """A two-stage app: detect (model det) then classify (model cls) on the glue's children."""
    a = app_from_json({"name": "pair", "slo_ms": APP_SLO_MS, "stages": [
        {"name": "detect", "model": "det"},
        {"name": "classify", "model": "cls", "after": "detect", "fanout": 2, "glue": glue}]})
    if budgets:
        a = a.with_budgets([150_000, 150_000], "test")
    return a.to_json()


def write_app_plan(d: Path, apps: list[dict]) -> tuple[Path, Path]:
    """Two tiny models (det, cls), each its own two-pool pipeline, and ``apps`` over them."""
    (d / "profiles").mkdir(parents=True, exist_ok=True)
    plans = []
    for m in ("det", "cls"):
        prof = tiny.profile_json(model=m)
        (d / "profiles" / f"{m}.json").write_text(json.dumps(prof))
        plans.append(tiny.plan_json(prof))
    plan = plans[0]
    plan["models"] = [p["models"][0] for p in plans]
    plan["cluster"]["gpus"]["CPU"]["count"] = sum(p["cluster"]["gpus"]["CPU"]["count"] for p in plans)
    plan["objective"]["normalized_throughput"] = min(p["objective"]["normalized_throughput"] for p in plans)
    plan["apps"] = apps
    (d / "plan.json").write_text(json.dumps(plan, indent=1))
    return d / "plan.json", d / "profiles"


def two_stage(fanout: float = 2.0) -> App:
    return App("pair", 100_000.0, (Stage("detect", "det"), Stage("classify", "cls", 0, fanout, FAN)))


def test_query_and_answer_headers_round_trip():
    assert wire.decode(wire.query("pair", 5000, 9, True, 1, 77)) == wire.Query(1, T.QUERY, "pair", 5000, 9, 1, 1, 77)
    h = wire.decode(msgpack.packb([wire.VERSION, T.QUERY, "pair", 0, 9]))
    assert (h.app, h.slo_us, h.qid, h.stages, h.priority, h.sent_us) == ("pair", 0, 9, 0, 0, 0)
    e = wire.output_entry("classify", (0, 2), True, None)
    h = wire.decode(wire.answer(9, Status.OK, "", "", "", [e]))
    assert (h.qid, h.status, h.reason, h.stage, h.detail) == (9, Status.OK, "", "", "")
    assert h.outputs == [["classify", [0, 2], True, None]]
    assert wire.query_id(msgpack.packb([wire.VERSION, T.QUERY, 3, 0, 12])) == 12
    assert wire.query_id(msgpack.packb([wire.VERSION, T.SUBMIT, "m", 0, [1]])) is None
    assert wire.query_id(b"\xc1") is None


# --- the tracker (pure) -----------------------------------------------------------------------


def test_tracker_e2e_deadlines_children_and_outputs_in_order():
    app = two_stage()
    tr = QueryTracker(app, "e2e", 0.0, 100_000.0)
    asked = []

    def est(stage: int, n: int) -> float:
        asked.append((stage, n))
        return 30_000.0

    [root] = tr.start(0.0, est)
    # the child, for the fan-out the estimate plans for (above the mean: PARD's high yield)
    assert root == Submit(0, 0, 70_000.0) and asked == [(1, planned_yield(app.stages[1].fanout))]
    assert planned_yield(app.stages[1].fanout) > app.stages[1].fanout
    assert tr.stage_done(0, "root-out") == [Glue(0, 1)] and not tr.finished
    subs = tr.glue_done(0, 1, 3, 10_000.0, est)
    assert [s.node for s in subs] == [1, 2, 3] and {s.deadline_us for s in subs} == {100_000.0}
    for n in (3, 1, 2):
        assert tr.stage_done(n, f"out{n}") == []
    assert tr.ok and tr.failed is None and tr.live() == []
    assert tr.outputs() == [("classify", (0,), True, "out1"), ("classify", (1,), True, "out2"),
                            ("classify", (2,), True, "out3")]  # leaves only, by key
    assert tr.submitted() == [1, 3]


def test_tracker_e2e_drops_children_that_cannot_end_in_time_before_they_run():
    tr = QueryTracker(two_stage(), "e2e", 0.0, 100_000.0)
    tr.start(0.0, lambda stage, n: 10_000.0)
    tr.stage_done(0, "r")
    # 60 ms in, 8 inputs that need 50 ms: the query fails at the classify stage, nothing is queued
    assert tr.glue_done(0, 1, 8, 60_000.0, lambda stage, n: 50_000.0) == []
    assert tr.finished and tr.failed[:2] == ("classify", "early-drop") and tr.submitted() == [1, 0]
    ok = QueryTracker(two_stage(), "e2e", 0.0, 100_000.0)
    ok.start(0.0, lambda stage, n: 10_000.0)
    ok.stage_done(0, "r")
    assert len(ok.glue_done(0, 1, 8, 60_000.0, lambda stage, n: 30_000.0)) == 8 and not ok.finished


def test_tracker_zero_children_keep_all_and_split_deadlines():
    app = two_stage().with_budgets([40_000, 60_000], "test")
    tr = QueryTracker(app, "split", 0.0, 50_000.0, keep_all=True)  # half the app's SLO: budgets scale
    [root] = tr.start(0.0)
    assert root.deadline_us == 20_000.0
    assert tr.stage_done(0, "r") == [Glue(0, 1)]
    assert tr.glue_done(0, 1, 0, 5_000.0) == [] and tr.ok  # no children: done when the root is
    assert tr.outputs() == [("detect", (), False, "r")]
    ch = QueryTracker(app, "chain", 0.0, 100_000.0)
    ch.start(0.0)
    ch.stage_done(0, "r")
    assert [s.deadline_us for s in ch.glue_done(0, 1, 2, 30_000.0)] == [90_000.0, 90_000.0]


def test_tracker_fails_once_and_ignores_what_follows():
    tr = QueryTracker(two_stage(), "e2e", 0.0, 100_000.0)
    tr.start(0.0)
    tr.stage_done(0, "r")
    tr.glue_done(0, 1, 3, 1.0)
    assert tr.stage_failed(2, "deadline") and tr.finished and not tr.ok
    assert tr.failed == ("classify", "deadline", "")
    assert tr.live() == [1, 3]  # to cancel or discard
    assert not tr.stage_failed(3, "early-drop") and tr.stage_done(1, "x") == []
    assert not tr.glue_failed(1, "glue-error") and tr.failed == ("classify", "deadline", "")
    g = QueryTracker(two_stage(), "e2e", 0.0, 100_000.0)
    g.start(0.0)
    g.stage_done(0, "r")
    assert g.glue_failed(1, "glue-timeout", "slow") and g.failed == ("classify", "glue-timeout", "slow")


# --- glue --------------------------------------------------------------------------------------


def test_glue_contract_casts_checks_sizes_and_rejects_non_lists():
    spec = GlueSpec("a", "s", "p", "m", (2,), "float32", 8, (4,), "uint8")

    def arrays(outputs, frame, spec):
        assert frame.shape == (4,) and outputs[0].dtype == np.float32 and outputs[0].shape == (2,)
        return [np.array([1.0, 2.0]), np.zeros(2, dtype=np.float32).tobytes()]

    data = np.array([3.0, 4.0], dtype=np.float32).tobytes()
    meta = [["<f4", [2], "y"]]
    kids = run_glue(arrays, data, meta, b"abcd", spec, 8)
    assert kids[0] == np.array([1.0, 2.0], dtype=np.float32).tobytes() and len(kids[1]) == 8
    with pytest.raises(GlueError, match="child 0 has 12 bytes"):
        run_glue(lambda o, f, s: [b"x" * 12], data, meta, b"abcd", spec, 8)
    with pytest.raises(GlueError, match="dtype float32"):
        run_glue(lambda o, f, s: [np.zeros(2, dtype=np.float32)], data, meta, b"abcd",
                 GlueSpec("a", "s", "p", "m", (2,), "int32", 8), 8)
    with pytest.raises(GlueError, match="returned 'int'"):
        run_glue(lambda o, f, s: 42, data, meta, b"abcd", spec, 8)
    with pytest.raises(GlueError, match="max_children"):
        run_glue(lambda o, f, s: [b"12345678"] * 9, data, meta, b"abcd", spec, 8)
    with pytest.raises(GlueError, match="does not match its meta"):
        run_glue(arrays, data[:5], meta, b"abcd", spec, 8)
    with pytest.raises(GlueError, match="does not match its meta.*SyntaxError"):  # np.dtype(",") parses
        run_glue(arrays, data, [[",", [2], "y"]], b"abcd", spec, 8)


def test_glue_pool_errors_timeouts_crashes_and_import_errors():
    """Each failure is answered once with its reason; a hung or dead worker is replaced and the
    pool goes on serving; an import error is reported by start(), before any call."""
    bad = "ppiped.query.testing_glue:nope"
    pool = GluePool([FAN, bad], workers=2, timeout_s=0.3)
    errors = pool.start()
    assert list(errors) == [bad] and "AttributeError" in errors[bad]

    async def main() -> list:
        loop = asyncio.get_running_loop()
        pool.attach(loop)
        spec = GlueSpec("pair", "classify", "detect", "cls")

        def one(k: int, ref: str = FAN, deadline_us: int = 0) -> asyncio.Future:
            f = loop.create_future()
            pool.call(ref, tg.frame(k, b"ab"), None, b"frame", spec,
                      lambda o, r, d: f.set_result((o, r, d)), deadline_us)
            return f

        out = [await one(2), await one(tg.RAISE), await one(tg.SLEEP), await one(tg.DIE),
               await one(tg.BAD), await one(0), await one(1, bad)]
        out.append(await asyncio.gather(*(one(k) for k in (3, 1, 2))))
        # both workers hung: a call waiting for one is answered at its deadline, not run
        hung = [one(tg.SLEEP), one(tg.SLEEP)]
        out.append(await one(1, deadline_us=time.monotonic_ns() // 1000 + 20_000))
        out.append(await asyncio.gather(*hung))
        return out

    try:
        out = asyncio.run(main())
    finally:
        pool.close()
    ok2, raised, slept, died, badret, zero, unimported, after, waited, hung = out
    assert ok2 == ([b"\x02ab\x00", b"\x02ab\x01"], "", "")
    assert raised[:2] == (None, "glue-error") and "told to fail" in raised[2]
    assert slept[:2] == (None, "glue-timeout")
    assert died[:2] == (None, "glue-error") and "died" in died[2]
    assert badret[:2] == (None, "glue-error") and zero == ([], "", "")
    assert unimported[:2] == (None, "glue-error") and "nope" in unimported[2]
    assert [len(o) for o, _, _ in after] == [3, 1, 2]
    assert waited[:2] == (None, "deadline") and [r for _, r, _ in hung] == ["glue-timeout"] * 2
    assert pool.stats["timeouts"] == 3 and pool.stats["restarts"] == 4 and pool.stats["late"] == 1


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_glue_pool_moves_messages_larger_than_a_socket_buffer(loop):
    """Frames and children of megabytes (real images and crops) go through whole, in both
    directions, on the daemon's uvloop (whose add_reader makes the socket non-blocking: a
    message then arrives in pieces) and on asyncio's loop; several calls at once."""
    import uvloop

    pool = GluePool([FAN], workers=2, timeout_s=20.0)
    assert pool.start() == {}
    tags = [bytes([i]) * (2_000_000 + i) for i in range(4)]

    async def main() -> list:
        lp = asyncio.get_running_loop()
        pool.attach(lp)
        spec = GlueSpec("pair", "classify", "detect", "cls")
        futs = []
        for tag in tags:
            f = lp.create_future()
            pool.call(FAN, tg.frame(3, tag), None, b"\x07" * 3_000_000, spec,
                      lambda o, r, d, f=f: f.set_result((o, r, d)))
            futs.append(f)
        return await asyncio.gather(*futs)

    try:
        out = uvloop.run(main()) if loop == "uvloop" else asyncio.run(main())
    finally:
        pool.close()
    for tag, (kids, reason, detail) in zip(tags, out, strict=True):
        assert (reason, detail) == ("", "")
        assert kids == [tg.frame(3, tag) + bytes([j]) for j in range(3)]
    assert pool.stats["ok"] == 4 and pool.stats["restarts"] == 0


# --- config ------------------------------------------------------------------------------------


def test_config_app_deadlines_and_glue_keys_are_checked():
    cfg = config_from_dict({"scheduler": {"app_deadlines": "split"}, "glue": {"workers": 3, "timeout_ms": 50}})
    assert cfg.app_deadlines == "split" and cfg.glue_workers == 3 and cfg.glue_timeout_ms == 50.0
    assert "app_deadlines" not in cfg.scheduler
    assert config_from_dict({}).app_deadlines == "e2e"
    with pytest.raises(ConfigError, match="scheduler.app_deadlines: expected one of e2e, split, chain"):
        config_from_dict({"scheduler": {"app_deadlines": "pard"}})
    with pytest.raises(ConfigError, match="glue: unknown key"):
        config_from_dict({"glue": {"worker": 2}})
    with pytest.raises(ConfigError, match="glue.timeout_ms"):
        config_from_dict({"glue": {"timeout_ms": 0}})


def test_split_deadlines_need_a_planned_split(tmp_path):
    from ppiped.commands.serve import load_serving
    from ppiped.daemon.config import load_config
    from ppiped.daemon.server import Server

    plan, profiles = write_app_plan(tmp_path, [app_json(budgets=False)])
    cfg = load_config(write_config(tmp_path, plan, profiles, scheduler={"app_deadlines": "split"}))
    with pytest.raises(ConfigError, match="app 'pair' has no SLO split"):
        Server(cfg, *load_serving(cfg))


def test_glue_import_error_stops_the_daemon_at_start():
    with short_tmpdir() as td:
        d = Path(td)
        plan, profiles = write_app_plan(d, [app_json(glue="ppiped.query.testing_glue:nope")])
        cfg = write_config(d, plan, profiles)
        p = subprocess.run([sys.executable, "-m", "ppiped.cli", "serve", "--config", str(cfg)],
                           capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert "app 'pair', stage 'classify': glue ppiped.query.testing_glue:nope" in p.stderr
    assert "AttributeError" in p.stderr


# --- the server's query path in one process (a fake clock, a stub glue pool) -----------------------


class _StubPool:
    """Stands in for the glue workers: the test answers each call when it likes."""

    def __init__(self) -> None:
        self.calls: list = []

    def call(self, ref, data, meta, frame, spec, done, deadline_us=0) -> None:
        self.calls.append((data, frame, spec, done))

    def close(self) -> None:
        pass

    def status(self) -> dict:
        return {"calls": len(self.calls)}


class _Idle:
    busy_since = 0

    def kick(self) -> None:
        pass

    def drain_now(self) -> None:
        pass


class AppRig:
    """A Server serving the two-stage app over inproc sockets, with one executor peer for all
    vGPUs and a clock that moves only when told to."""

    def __init__(self, d: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        from ppiped.commands.serve import load_serving
        from ppiped.daemon import apps as A
        from ppiped.daemon import server as S
        from ppiped.daemon.config import load_config
        from ppiped.daemon.loop import Timers

        self.t = 1_000_000
        monkeypatch.setattr(S, "now_us", lambda: self.t)
        monkeypatch.setattr(A, "now_us", lambda: self.t)
        plan, profiles = write_app_plan(d, [app_json()])
        cfg = load_config(write_config(d, plan, profiles))
        srv = self.srv = S.Server(cfg, *load_serving(cfg))
        self.pool = srv.queries.pool = _StubPool()
        self.ctx = ctx = zmq.Context()
        srv.zctx, srv.loop = ctx, asyncio.new_event_loop()
        srv.client = ctx.socket(zmq.ROUTER)
        srv.client.bind(f"inproc://qc-{id(self)}")
        srv.exe = ctx.socket(zmq.ROUTER)
        srv.exe.setsockopt(zmq.ROUTER_MANDATORY, 1)
        srv.exe.bind(f"inproc://qe-{id(self)}")
        srv.timers = Timers(srv.loop)
        srv.client_reader = srv.exe_reader = _Idle()
        self.cl = ctx.socket(zmq.DEALER)
        self.cl.connect(f"inproc://qc-{id(self)}")
        self.ex = ctx.socket(zmq.DEALER)
        self.ex.setsockopt(zmq.IDENTITY, b"E")
        self.ex.connect(f"inproc://qe-{id(self)}")
        self.ex.send(b"hello")
        assert srv.exe.poll(1000)
        srv.exe.recv_multipart()
        srv.on_register(b"E", wire.decode(wire.register(list(range(srv.nv)), "inproc://d", "emulate", 1, self.t, 1)))
        srv.ready(srv.execs[b"E"])
        self.drain(self.ex)

    @staticmethod
    def drain(sock: zmq.Socket) -> list[list]:
        out = []
        while sock.poll(0):
            out.append(sock.recv_multipart())
        return out

    def query(self, qid: int, frame: bytes) -> None:
        from ppiped.daemon.loop import recv_parts

        self.cl.send_multipart([wire.query("pair", 0, qid), frame])
        assert self.srv.client.poll(1000)
        self.srv.on_client(recv_parts(self.srv.client, 0))
        self.srv.after_clients()

    def dispatched(self, until_us: int | None = None) -> list[tuple[wire.Dispatch, list]]:
        """Move the clock (by default to when the core asked to be woken) and let the core
        dispatch: the DISPATCH headers and frames sent."""
        self.t = int(self.srv.wake_at) + 1 if until_us is None else until_us
        srv = self.srv
        if srv.wake_entry is not None and srv.wake_at < self.t:  # its timer has fired (no loop runs
            srv.timers.cancel(srv.wake_entry)  # here: the daemon's _on_wake clears it so)
            srv.wake_entry, srv.wake_at = None, math.inf
        srv.decide(self.t)
        return [(wire.decode(m[0]), m[1:]) for m in self.drain(self.ex)]

    def to_server(self, header: bytes, frames: list = ()) -> None:
        from ppiped.daemon.loop import recv_parts

        self.ex.send_multipart([header, *frames])
        assert self.srv.exe.poll(1000)
        self.srv.on_exec(recv_parts(self.srv.exe, 0))
        self.srv.after_execs()

    def finish(self, h: wire.Dispatch, ok: list[int], failed: list = ()) -> None:
        """Report batch ``h`` run (feedback on every hop), ``ok`` of its requests with a result."""
        bid, path, starts = h.batch, h.path, h.starts
        fb = []
        for hop, v in enumerate(path):
            fb += [v, bid, hop, starts[hop], starts[hop], starts[hop] + 1000]
        frames = [b"out-%d" % rid for rid in ok]
        self.to_server(wire.result(bid, ok, None, list(failed), fb), frames)

    def answers(self) -> list[tuple[wire.Answer, list]]:
        return [(wire.decode(m[0]), m[1:]) for m in self.drain(self.cl)]

    def close(self) -> None:
        self.srv.timers.close()
        self.srv.loop.close()
        self.ctx.destroy(0)


def test_a_failed_child_fails_the_query_once_withdraws_queued_stages_and_discards_late_results(
        tmp_path, monkeypatch):
    rig = AppRig(tmp_path, monkeypatch)
    srv = rig.srv
    try:
        rig.query(1, tg.frame(5))
        [(h, frames)] = rig.dispatched()  # the root, at its last moment
        assert frames[0] == tg.frame(5)
        rig.finish(h, h.ids)
        [(data, frame, spec, done)] = rig.pool.calls
        assert data == b"out-%d" % h.ids[0] and frame == tg.frame(5) and spec.stage == "classify"
        done([b"c%d" % j for j in range(5)], "", "")  # the children go to the core, which decides
        cls = srv.model_index["cls"]
        [(b1, f1)] = rig.dispatched(rig.t)  # one full batch (bs 4) at once, one child left queued
        assert len(b1.ids) == 4 and len(set(f1)) == 4 and set(f1) < {b"c%d" % j for j in range(5)}
        assert srv.core.pending(cls) == 1
        rig.finish(b1, [], [b1.ids[0], "executor-error: boom"])  # one child fails
        [(a, af)] = rig.answers()
        assert a.type == T.ANSWER and a.qid == 1 and a.status == Status.DROPPED and af == []
        assert (a.reason, a.stage) == (wire.FAILED, "classify") and "boom" in a.detail
        assert srv.core.pending(cls) == 0 and not srv.reqs  # the queued child was withdrawn
        assert srv.stats[cls].dropped["query-failed"] == 1
        app = srv.queries.status()["apps"]["pair"]
        assert app["gpu_s"] > 0 and app["invalid_gpu_s"] == app["gpu_s"]  # the root's, for nothing
        rig.finish(b1, b1.ids[1:])  # the batch's other children end: discarded
        assert rig.answers() == []
        st = srv.stats[cls]
        assert st.accepted == st.answered == 5 and st.clients == 0
        app2 = srv.queries.status()["apps"]["pair"]
        assert app2["gpu_s"] > app["gpu_s"] and app2["invalid_gpu_s"] == app2["gpu_s"]
        assert app2["dropped"] == {"classify": {"failed": 1}} and app2["ok"] == 0
        assert srv.queries.status()["queries_in_flight"] == 0
        from ppiped.daemon.metrics import render

        text = render(srv)
        assert 'ppiped_app_drops_total{app="pair",stage="classify",reason="failed"} 1' in text
    finally:
        rig.close()


def test_glue_children_are_bounded_by_max_pending_as_queries_are(tmp_path, monkeypatch):
    """A glue's children queue under the same bound as the query did (before, one query's
    fan-out queued up to max_children^depth requests past limits.max_pending)."""
    rig = AppRig(tmp_path, monkeypatch)
    srv = rig.srv
    try:
        srv.cfg.max_pending = 3
        rig.query(1, tg.frame(5))
        [(h, _)] = rig.dispatched()
        rig.finish(h, h.ids)
        rig.pool.calls[0][3]([b"c%d" % j for j in range(5)], "", "")
        [(a, af)] = rig.answers()
        assert (a.qid, a.status, a.reason, a.stage) == (1, Status.DROPPED, wire.OVERLOADED, "classify")
        assert "limits.max_pending 3" in a.detail and af == []
        cls = srv.model_index["cls"]
        assert not srv.reqs and srv.core.pending(cls) == 0  # the children queued were withdrawn
        st = srv.stats[cls]
        assert st.accepted == st.answered == 3 and srv.counters["query_children_refused"] == 1
        assert srv.queries.status()["apps"]["pair"]["dropped"] == {"classify": {wire.OVERLOADED: 1}}
    finally:
        rig.close()


def test_a_query_whose_glue_makes_no_children_ends_with_its_root(tmp_path, monkeypatch):
    rig = AppRig(tmp_path, monkeypatch)
    try:
        rig.query(7, tg.frame(0))
        [(h, _)] = rig.dispatched()
        rig.finish(h, h.ids)
        assert rig.answers() == []  # waiting on the glue
        rig.pool.calls[0][3]([], "", "")
        [(a, af)] = rig.answers()
        assert a.qid == 7 and a.status == Status.OK and a.outputs == [] and af == []
        rig.query(8, tg.frame(2))
        [(h, _)] = rig.dispatched()
        rig.finish(h, h.ids)
        rig.pool.calls[1][3](None, "glue-timeout", "slow")
        [(a, _)] = rig.answers()
        assert (a.qid, a.status, a.reason, a.stage, a.detail) == (8, Status.DROPPED, "glue-timeout", "classify", "slow")
    finally:
        rig.close()


# --- the daemon ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cluster():
    with short_tmpdir() as td:
        d = Path(td)
        plan, profiles = write_app_plan(d, [app_json()])
        cfg = write_config(d, plan, profiles, heartbeat_ms=50, timeout_ms=1000,
                           scheduler={"wait_guard_us": 25_000},
                           extra="[glue]\nworkers = 2\ntimeout_ms = 300\n")
        with LocalCluster(cfg, [[0, 2, 4, 6], [1, 3, 5, 7]], log_level="info") as c:
            yield c


def _apps(c: LocalCluster) -> dict:
    st = c.status()
    assert st is not None
    return st["apps"]


def _wait_glue_ready(c: LocalCluster, timeout_s: float = 30.0) -> None:
    """Until every glue worker (replacements included) is up."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        g = _apps(c)["glue"]
        if g["ready"] == g["workers"] == 2 and not g["busy"]:
            return
        time.sleep(0.05)
    raise AssertionError(f"glue workers not back: {g}")


def test_queries_answer_the_glue_children_in_order(cluster):
    before = _apps(cluster)["apps"]["pair"]

    async def main() -> list:
        async with AsyncClient(cluster.client_endpoint) as c:
            info = await c.info()
            assert info["apps"]["pair"]["slo_ms"] == APP_SLO_MS
            outs = []
            for k in (0, 1, 3, 2):
                outs.append(await c.submit_query("pair", tg.frame(k, b"q%d" % k), stages=k == 3))
            return outs

    outs = asyncio.run(main())
    for k, r in zip((0, 1, 3, 2), outs, strict=True):
        f = tg.frame(k, b"q%d" % k)
        # emulated models echo: each child's output is its input, the frame plus its index
        assert [o.data for o in r.outputs] == [f + bytes([j]) for j in range(k)]
        assert [o.key for o in r.outputs] == [(j,) for j in range(k)]
        assert {o.stage for o in r.outputs} <= {"classify"}
    assert [o.data for o in outs[2].stages["detect"]] == [tg.frame(3, b"q3")]
    from ppiped.client import Client

    with Client(cluster.client_endpoint) as c:  # the blocking client, high priority
        r = c.submit_query("pair", tg.frame(2, b"b"), priority=1)
        assert [o.data for o in r.outputs] == [tg.frame(2, b"b") + bytes([j]) for j in range(2)]
        with pytest.raises(Rejected, match="unknown-app"):
            c.submit_query("nope", b"x")
    assert outs[0].stages is None and outs[0].outputs == []
    after = _apps(cluster)["apps"]["pair"]
    assert after["ok"] - before["ok"] == 5
    assert after["stage_requests"]["detect"] - before["stage_requests"]["detect"] == 5
    assert after["stage_requests"]["classify"] - before["stage_requests"]["classify"] == 0 + 1 + 3 + 2 + 2


def test_glue_errors_and_timeouts_are_answered_and_serving_goes_on(cluster):
    before = _apps(cluster)["apps"]["pair"]

    async def one(k: int) -> Exception | object:
        async with AsyncClient(cluster.client_endpoint) as c:
            try:
                return await c.submit_query("pair", tg.frame(k))
            except (Dropped, Rejected) as e:
                return e

    got = {}
    for k in (tg.RAISE, tg.SLEEP, tg.DIE, tg.BAD):
        got[k] = asyncio.run(one(k))
        _wait_glue_ready(cluster)
        ok = asyncio.run(one(2))  # the daemon and the pool keep serving
        assert not isinstance(ok, Exception) and len(ok.outputs) == 2
    for k, reason in ((tg.RAISE, "glue-error"), (tg.SLEEP, "glue-timeout"), (tg.DIE, "glue-error"),
                      (tg.BAD, "glue-error")):
        e = got[k]
        assert isinstance(e, Dropped) and e.reason == reason and e.stage == "classify" and e.app == "pair", e
    assert "told to fail" in got[tg.RAISE].detail and "died" in got[tg.DIE].detail
    after = _apps(cluster)["apps"]["pair"]
    drops = after["dropped"]["classify"]
    old = before["dropped"].get("classify", {})
    assert drops["glue-error"] - old.get("glue-error", 0) == 3
    assert drops["glue-timeout"] - old.get("glue-timeout", 0) == 1
    assert after["invalid_gpu_s"] > before["invalid_gpu_s"]  # the roots' work was for nothing


def _raw_queries(endpoint: str, headers: list[bytes], frames: list[list[bytes]], expect: int,
                 timeout_s: float = 120.0, linger_s: float = 0.5) -> list[tuple[wire.Message, int]]:
    """Send raw QUERY messages on one DEALER and collect every reply (decoded header, payload
    frame count) until ``expect`` have come and then ``linger_s`` more without one."""
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(endpoint)
    try:
        for h, fs in zip(headers, frames, strict=True):
            s.send_multipart([h, *fs])
        out: list[tuple[wire.Message, int]] = []
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            wait = linger_s if len(out) >= expect else 1.0
            if not s.poll(int(wait * 1000)):
                if len(out) >= expect:
                    break
                continue
            msg = s.recv_multipart()
            out.append((wire.decode(msg[0]), len(msg) - 1))
        return out
    finally:
        s.close(0)
        ctx.term()


def test_unknown_app_and_malformed_queries_get_clear_errors(cluster):
    cases = [
        (wire.query("nope", 0, 1), [b"f"]),
        (wire.query("pair", 0, 2), []),  # no frame
        (wire.query("pair", 0, 3), [b"a", b"b"]),  # two frames
        (wire.query("pair", 0, 4, priority=5), [b"f"]),
        (wire.query("pair", int(APP_SLO_MS * 1000) + 1, 5), [b"f"]),  # above the app's SLO
        (msgpack.packb([wire.VERSION, T.QUERY, 7, 0, 6]), [b"f"]),  # app is not a string
        (msgpack.packb([wire.VERSION, T.QUERY, "pair", -1, 7]), [b"f"]),
        (b"\xc1garbage", [b"f"]),  # not msgpack: no query id to answer, an ERROR
    ]
    got = _raw_queries(cluster.client_endpoint, [h for h, _ in cases], [f for _, f in cases], len(cases))
    answers = {h.qid: h for h, _ in got if h.type == T.ANSWER}
    errors = [h for h, _ in got if h.type == T.ERROR]
    assert sorted(answers) == [1, 2, 3, 4, 5, 6, 7] and len(errors) == 1 and len(got) == 8
    assert answers[1].status == Status.REJECTED and answers[1].reason == wire.UNKNOWN_APP and "pair" in answers[1].detail
    for qid, text in ((2, "exactly one"), (3, "exactly one"), (4, "priority"), (5, "above app 'pair'"),
                      (6, "QUERY.app"), (7, "QUERY.slo_us")):
        h = answers[qid]
        assert h.status == Status.REJECTED and h.reason == wire.MALFORMED and text in h.detail, h
    assert errors[0].code == wire.MALFORMED

    async def client_side() -> None:
        async with AsyncClient(cluster.client_endpoint) as c:
            with pytest.raises(Rejected) as e:
                await c.submit_query("nope", b"f")
            assert e.value.reason == wire.UNKNOWN_APP and e.value.app == "nope"

    asyncio.run(client_side())


def test_overload_every_query_answered_exactly_once(cluster):
    """Far more queries than the plan serves, at once: each gets exactly one ANSWER (OK or an
    error naming a stage), none is left without one, and the daemon serves on."""
    n = 3000
    headers = [wire.query("pair", 0, qid, priority=qid % 2) for qid in range(1, n + 1)]
    frames = [[tg.frame(2, b"%d" % qid)] for qid in range(1, n + 1)]
    got = _raw_queries(cluster.client_endpoint, headers, frames, n)
    assert all(h.type == T.ANSWER for h, _ in got)
    per = Counter(h.qid for h, _ in got)
    assert sorted(per) == list(range(1, n + 1)) and set(per.values()) == {1}  # exactly once each
    outcomes = Counter((h.status, h.reason, h.stage) for h, _ in got)
    ok = [(h, n) for h, n in got if h.status == Status.OK]
    assert ok and all(n == 2 == len(h.outputs) for h, n in ok)  # two children's outputs each
    assert all(h.stage in ("detect", "classify") for h, _ in got if h.status != Status.OK), outcomes
    st = _apps(cluster)
    assert st["queries_in_flight"] == 0 and st["apps"]["pair"]["in_flight"] == 0

    async def after() -> int:
        async with AsyncClient(cluster.client_endpoint) as c:
            return len((await c.submit_query("pair", tg.frame(1))).outputs)

    assert asyncio.run(after()) == 1


def test_ctl_status_shows_the_apps(cluster, capsys):
    from ppiped import ctl

    _wait_glue_ready(cluster)
    assert ctl.main(["--socket", str(cluster.config.parent / "admin.sock"), "status"]) == 0
    out = capsys.readouterr().out
    assert "[deadlines: e2e]" in out and "\npair " in out and "classify: glue-error" in out
    assert "glue: 2/2 workers ready" in out


def test_the_daemon_logged_no_error(cluster):
    """After everything above (glue crashes, timeouts, malformed input, overload): no traceback and
    no internal error in the daemon."""
    st = cluster.status()
    assert "query_internal_errors" not in st["counters"]
    log = (cluster.log_dir / "serve.log").read_text(errors="replace")
    assert "Traceback" not in log and "Exception in callback" not in log, log[-3000:]


def test_a_replan_adds_an_app_with_new_glue_or_refuses_glue_that_does_not_import():
    """The glue workers start with the daemon for the apps it serves; a replan whose apps need
    other callables starts workers for them before the switch (or is refused, the plan in force
    serving on), instead of switching to an app whose every query then fails."""
    from ppiped import ctl

    with short_tmpdir() as td:
        d = Path(td)
        plans = {}
        for name, apps in (("none", []), ("pair", [app_json()]),
                           ("broken", [app_json(glue="ppiped.query.testing_glue:nope")])):
            (d / name).mkdir()
            plans[name] = write_app_plan(d / name, apps)[0]
        cfg = write_config(d, plans["none"], d / "none" / "profiles", heartbeat_ms=50, timeout_ms=1000)
        with LocalCluster(cfg, [[0, 2, 4, 6], [1, 3, 5, 7]], log_level="info") as c:
            sock = str(d / "admin.sock")
            rp = ctl.call(sock, {"cmd": "replan", "plan_file": str(plans["pair"]), "wait": True}, 120)
            assert rp["ok"], rp

            async def query() -> list:
                async with AsyncClient(c.client_endpoint) as cl:
                    return [o.data for o in (await cl.submit_query("pair", tg.frame(2, b"n"))).outputs]

            assert asyncio.run(query()) == [tg.frame(2, b"n") + bytes([j]) for j in range(2)]
            rp = ctl.call(sock, {"cmd": "replan", "plan_file": str(plans["broken"]), "wait": True}, 120)
            assert not rp["ok"] and "glue ppiped.query.testing_glue:nope" in rp["error"], rp
            assert asyncio.run(query()) == [tg.frame(2, b"n") + bytes([j]) for j in range(2)]
            assert "query_internal_errors" not in c.status()["counters"]


def test_hop_times_from_before_the_batch_was_sent_are_not_believed(tmp_path, monkeypatch):
    """An executor's hop that 'started' days before its batch was sent once counted days of GPU
    time, for good; it is refused as foreign feedback, and an honest report still counts."""
    rig = AppRig(tmp_path, monkeypatch)
    srv = rig.srv
    try:
        rig.query(1, tg.frame(0))
        [(h, _)] = rig.dispatched()
        v = h.path[0]
        fb = [v, h.batch, 0, h.starts[0] - 10**12, h.starts[0] - 10**12, h.starts[0] + 1000]
        rig.to_server(wire.result(h.batch, h.ids, None, [], fb), [b"out"])
        assert srv.counters["foreign_feedback"] == 1 and srv.busy_us[v] == 0
        rig.query(2, tg.frame(0))
        [(h, _)] = rig.dispatched()
        rig.finish(h, h.ids)
        assert srv.busy_us[h.path[0]] == 1000
    finally:
        rig.close()
