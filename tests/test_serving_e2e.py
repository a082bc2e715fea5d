"""End to end over real sockets on this host: ppiped serve, executor processes (emulate, ort), the client.

Every test starts its own scheduler and executors as subprocesses on ipc:// sockets in a private
temp dir and stops them in a ``finally``; loops are bounded by request counts or timeouts.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import zmq
from conftest import cuda_torch

from ppiped import wire
from ppiped.client import AsyncClient, Client, ClientClosed, Dropped, Rejected
from ppiped.commands.loadgen import run_load
from ppiped.daemon.launch import LocalCluster, short_tmpdir, write_config
from ppiped.executor import tiny
from ppiped.wire import Status, T


def wait_status(c: LocalCluster, ok, timeout_s: float = 10.0) -> dict:
    """Poll the scheduler's status until ``ok(status)``; bounded, returns the last status."""
    end = time.monotonic() + timeout_s

    def good(st):
        try:
            return bool(st) and ok(st)
        except (IndexError, KeyError):
            return False

    st = c.status()
    while not good(st) and time.monotonic() < end:
        time.sleep(0.05)
        st = c.status()
    return st


def show_logs(c: LocalCluster) -> None:
    for name in ["serve.log", *[f"executor-{i}.log" for i in range(len(c.groups))]]:
        print(f"--- {name}\n{c.tail(name, 40)}")


@pytest.fixture(scope="module")
def workdir():
    with short_tmpdir("ppiped-e2e-") as d:
        yield Path(d)


def make_cluster(base: Path, name: str, *, backend="emulate", groups=((0, 2), (1, 3)), **cfg_kw):
    d = base / name
    d.mkdir()
    plan, profiles = tiny.write_example(d)
    # a generous wait guard: on a loaded test host a wake-up may be late by milliseconds, and these
    # tests check replies, not batching efficiency
    cfg = write_config(d, plan, profiles, backend=backend, heartbeat_ms=50, timeout_ms=1000,
                       scheduler={"wait_guard_us": 25_000},
                       partitions=str(d / "parts" / "{model}" / "{start}-{end}.onnx"), **cfg_kw)
    return LocalCluster(cfg, groups, log_level="info")


@pytest.fixture(scope="module")
def emulated(workdir):
    c = make_cluster(workdir, "emu", extra="[models.tiny]\ninput_bytes = 0\n")
    try:
        c.start()
        yield c
    finally:
        c.stop()


def test_a_second_daemon_on_the_same_config_leaves_the_first_serving(emulated):
    """``ppiped serve`` started twice by mistake: the second finds the first's ipc sockets held
    and exits 2 before it binds anything (a bind would unlink them and cut the first off)."""
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "ppiped.cli", "serve", "--config", str(emulated.config)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is held by a live process: another ppiped serves it" in r.stderr, r.stderr
    with Client(emulated.client_endpoint, timeout_s=10) as c:
        assert c.submit("tiny", b"still here").data == b"still here"


def test_submit_echo_and_info(emulated):
    with Client(emulated.client_endpoint, timeout_s=10) as c:
        info = c.info()
        assert info["models"]["tiny"]["slo_ms"] == 60.0 and info["vgpus_alive"] == 4
        r = c.submit("tiny", b"frame-0")
        assert r.data == b"frame-0" and r.meta is None
        frames = [os.urandom(100 + i) for i in range(40)]
        out = c.submit_many("tiny", frames, slo_ms=200)
        assert [x.data for x in out] == frames


async def test_rejections_are_typed_and_counted(emulated):
    async with AsyncClient(emulated.client_endpoint, timeout_s=10) as c:
        with pytest.raises(Rejected) as e:
            await c.submit("no-such-model", b"x")
        assert e.value.reason == wire.UNKNOWN_MODEL
        with pytest.raises(Rejected) as e:
            await c.submit("tiny", b"\0" * (16 << 20) + b"!")
        assert e.value.reason == wire.PAYLOAD_TOO_LARGE
        # far above the limit too (libzmq once dropped such a connection and the request was
        # never answered): refused before it is sent, as soon as a PONG told the limit
        assert c.max_payload_bytes == 16 << 20
        with pytest.raises(Rejected) as e:
            await c.submit("tiny", np.zeros(5 << 20, dtype=np.float32))
        assert e.value.reason == wire.PAYLOAD_TOO_LARGE and "20971520 bytes" in str(e.value)
        assert c.pending == 0
        assert (await c.submit("tiny", b"still fine")).data == b"still fine"
    st = emulated.status()
    assert st["counters"][wire.UNKNOWN_MODEL] >= 1


async def test_a_bad_frame_or_argument_fails_its_own_call_only(emulated):
    """Bad calls batched in the same loop turn as good ones: each raises at its call, the good
    ones are served, nothing is left pending (one unsendable frame used to break the whole
    message, and a query's wedged the client for good)."""
    async with AsyncClient(emulated.client_endpoint, timeout_s=10) as c:
        strided = np.arange(10.0)[::2]
        good = [c.submit("tiny", b"a"), c.submit("tiny", b"b", slo_ms=200, priority=1),
                c.submit("tiny", strided), c.submit_query("no-such-app", np.zeros((3, 3))[:, :1])]
        bad = {"str": c.submit("tiny", "text"), "none": c.submit("tiny", None),
               "strided-view": c.submit("tiny", memoryview(strided)), "prio-bool": c.submit("tiny", b"x", priority=True),
               "slo-nan": c.submit("tiny", b"x", slo_ms=float("nan")), "slo-0": c.submit("tiny", b"x", slo_ms=0),
               "slo-huge": c.submit("tiny", b"x", slo_ms=1e20), "model": c.submit(None, b"x"),
               "query": c.submit_query("no-such-app", "text")}
        got = await asyncio.gather(*good, *bad.values(), return_exceptions=True)
        assert [r.data for r in got[:3]] == [b"a", b"b", strided.copy().tobytes()], got[:3]
        assert isinstance(got[3], Rejected) and got[3].reason == wire.UNKNOWN_APP, got[3]
        for name, r in zip(bad, got[4:], strict=True):
            assert isinstance(r, (TypeError, ValueError)), (name, r)
        assert c.pending == 0
        assert (await c.submit("tiny", b"after", priority=np.int64(1))).data == b"after"


async def test_arrays_go_in_c_order_and_native_byte_order(emulated):
    """The executor reads the frame's raw memory: a Fortran-ordered or big-endian array was
    served as another input. The emulated executor echoes what it was sent."""
    x = np.arange(12, dtype=np.float32).reshape(3, 4)
    async with AsyncClient(emulated.client_endpoint, timeout_s=10) as c:
        for arr in (np.asfortranarray(x), x.astype(">f4"), x.T.copy().T):
            assert (await c.submit("tiny", arr)).data == x.tobytes()


async def test_closing_ends_every_pending_call_and_refuses_more(tmp_path):
    """No scheduler listens: a pending request used to wait forever (timeout None) after close."""
    c = AsyncClient(f"ipc://{tmp_path}/nobody.sock", timeout_s=None)
    task = asyncio.ensure_future(c.submit("tiny", b"x"))
    many = asyncio.ensure_future(c.submit_many("tiny", [b"1", b"2"], timeout_s=0.2))
    await asyncio.sleep(0.3)
    assert [type(r) for r in await many] == [TimeoutError, TimeoutError]
    await c.close()
    with pytest.raises(Dropped) as e:
        await task
    assert e.value.reason == "client-closed" and c.pending == 0
    with pytest.raises(ClientClosed):
        await c.submit("tiny", b"y")


def test_closing_a_blocking_client_ends_a_call_blocked_in_another_thread(tmp_path):
    import threading

    c = Client(f"ipc://{tmp_path}/nobody.sock", timeout_s=None)
    out: list = []
    t = threading.Thread(target=lambda: out.append(_outcome(lambda: c.submit("tiny", b"x"))))
    t.start()
    time.sleep(0.3)
    c.close()
    t.join(10)
    assert not t.is_alive() and isinstance(out[0], Dropped) and out[0].reason == "client-closed"
    with pytest.raises(ClientClosed):
        c.submit("tiny", b"y")


def _outcome(fn):
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - the test looks at what it was
        return e


def test_malformed_messages_get_errors_not_crashes(emulated):
    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(emulated.client_endpoint)
    try:
        def ask(*frames):
            s.send_multipart(list(frames))
            assert s.poll(10_000), "no answer to a malformed message"
            head, *rest = s.recv_multipart()
            return wire.decode(head), rest

        h, _ = ask(b"\xc1 not msgpack")
        assert h.type == T.ERROR and h.code == wire.MALFORMED
        import msgpack
        h, _ = ask(msgpack.packb([99, T.SUBMIT, "tiny", 0, [1]]), b"x")
        assert h.type == T.ERROR and h.code == wire.VERSION_MISMATCH
        h, _ = ask(msgpack.packb([wire.VERSION, T.SUBMIT, "tiny", 0, ["a"]]), b"x")
        assert h.type == T.ERROR and "SUBMIT.ids" in h.message
        h, _ = ask(wire.submit("tiny", 0, [7, 8]), b"only one frame")
        assert h.type == T.REPLY and h.ids == [7, 8] and h.status == Status.REJECTED and h.reason == wire.MALFORMED
        h, _ = ask(wire.dispatch(1, [0], [0], []))
        assert h.type == T.ERROR and "DISPATCH" in h.message
        h, rest = ask(wire.submit("tiny", 0, [9]), b"ok")
        assert h.type == T.REPLY and h.status == Status.OK and rest == [b"ok"]
        h, _ = ask(wire.submit("tiny", 0, [10], 2), b"x")
        assert h.type == T.REPLY and h.status == Status.REJECTED and "priority" in h.meta
    finally:
        s.close(0)
        ctx.term()
    st = emulated.status()["counters"]
    assert st["malformed"] >= 5 and st["handler_errors"] == 0  # each refused, none raised


async def test_high_priority_requests_are_served_and_counted(emulated):
    before = emulated.status()["models"]["tiny"]
    async with AsyncClient(emulated.client_endpoint, timeout_s=10) as c:
        rs = await c.submit_many("tiny", [b"a", b"b", b"c"], priority=1)
        assert [r.data for r in rs] == [b"a", b"b", b"c"]
        with pytest.raises(ValueError, match="priority"):
            await c.submit("tiny", b"x", priority=5)
    after = emulated.status()["models"]["tiny"]
    assert after["high"]["accepted"] - before["high"]["accepted"] == 3
    assert after["high"]["ok_in_slo"] - before["high"]["ok_in_slo"] == 3
    assert after["goodput_rps"] > 0 and 0.0 <= after["invalid_rate"] <= 1.0


async def test_impossible_slo_is_dropped_with_reason(emulated):
    async with AsyncClient(emulated.client_endpoint, timeout_s=10) as c:
        with pytest.raises(Dropped) as e:
            await c.submit("tiny", b"x", slo_ms=0.5)
        assert e.value.reason == wire.DEADLINE


async def test_slo_below_the_fastest_pipeline_is_a_deadline_drop_not_overload(emulated):
    """A microsecond SLO on an idle daemon is no sign of load: it is dropped as ``deadline`` with
    the fastest pipeline's latency named, and no shed counter moves."""
    before = emulated.status()["counters"]
    async with AsyncClient(emulated.client_endpoint, timeout_s=10) as c:
        for slo_ms in (0.001, 0.01, 0.05, 0.1):
            for _ in range(3):
                with pytest.raises(Dropped) as e:
                    await c.submit("tiny", b"x", slo_ms=slo_ms)
                assert e.value.reason == wire.DEADLINE and "fastest pipeline" in str(e.value), e.value
    after = emulated.status()["counters"]
    assert after["slo_below_fastest"] - before.get("slo_below_fastest", 0) == 12
    for k in (wire.OVERLOADED, "shed_backlog"):
        assert after.get(k, 0) == before.get(k, 0), k


async def test_loadgen_every_request_answered(emulated):
    r = await run_load(emulated.client_endpoint, {"tiny": 300.0}, 2.0, seed=3, check_echo=True)
    t = r["total"]
    assert t["sent"] > 400 and t["no_reply"] == 0 and t["bad_echo"] == 0
    assert t["ok"] + t["dropped"] + t["rejected"] == t["sent"]
    st = emulated.status()
    assert st["vgpus"]["alive"] == 4 and st["gpu_classes"]["CPU"]["busy_us"] > 0


@pytest.mark.parametrize("backend", ["ort", pytest.param("torch", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not cuda_torch(), reason="needs PyTorch with a CUDA GPU")])])
def test_executors_serve_real_inference(workdir, backend):
    """ort on the CPU, torch on a GPU: frames in, the model's outputs back, fp16 between hops."""
    ort = pytest.importorskip("onnxruntime")
    c = make_cluster(workdir, backend, backend=backend)
    try:
        c.start()
        rng = np.random.default_rng(5)
        x = rng.normal(0, 1, (6, *tiny.INPUT_SHAPE)).astype(np.float32)
        with Client(c.client_endpoint, timeout_s=20) as cl:
            out = cl.submit_many("tiny", [xi.tobytes() for xi in x], slo_ms=2000)
            with pytest.raises(Rejected) as e:
                cl.submit("tiny", b"wrong size", slo_ms=2000)
            assert e.value.reason == wire.BAD_INPUT
        sess = ort.InferenceSession(str(c.config.parent / "parts" / "tiny.onnx"),
                                    providers=["CPUExecutionProvider"])
        want = sess.run(None, {"x": x})[0]
        for i, r in enumerate(out):
            (y,) = r.arrays()
            assert y.shape == (tiny.CLASSES,)
            assert np.abs(y - want[i]).max() <= 2e-2 * np.abs(want[i]).max(), (y, want[i])
    except BaseException:
        show_logs(c)
        raise
    finally:
        c.stop()


def test_killed_executor_every_request_still_answered(workdir):
    """SIGKILL one executor process mid-run: its vGPUs leave, in-flight requests are re-dispatched
    or dropped, and every request the client sent gets exactly one reply."""
    c = make_cluster(workdir, "kill")
    try:
        c.start()

        async def drive():
            killed = {}

            def on_tick(t_us):
                if t_us > 700_000 and not killed:
                    killed["at"] = time.monotonic()
                    os.kill(c.executors[1].pid, signal.SIGKILL)

            r = await run_load(c.client_endpoint, {"tiny": 400.0}, 2.0, seed=9, on_tick=on_tick,
                               check_echo=True)
            return r, killed

        r, killed = asyncio.run(drive())
        assert killed, "the executor was never killed"
        t = r["total"]
        assert t["sent"] > 500 and t["no_reply"] == 0 and t["bad_echo"] == 0, t
        assert t["ok"] + t["dropped"] + t["rejected"] == t["sent"]
        st = wait_status(c, lambda s: s["in_flight_batches"] == 0)
        assert st["vgpus"]["alive"] == 2 and st["counters"]["executors_lost"] >= 1, st["counters"]
        assert st["in_flight_batches"] == 0
        # the survivors still serve
        with Client(c.client_endpoint, timeout_s=10) as cl:
            assert cl.submit("tiny", b"after").data == b"after"
    except BaseException:
        show_logs(c)
        raise
    finally:
        c.stop()


def test_silent_executor_is_removed_and_rejoins(workdir):
    """SIGSTOP one executor: it misses heartbeats and leaves its pools, requests keep being answered;
    SIGCONT: it is told it is unregistered, registers again and serves."""
    c = make_cluster(workdir, "silent")
    try:
        c.start()
        p = c.executors[1]
        p.send_signal(signal.SIGSTOP)
        try:
            st = wait_status(c, lambda s: s["vgpus"]["alive"] == 2)
            assert st["vgpus"]["alive"] == 2 and st["counters"]["executors_lost"] == 1
            r = asyncio.run(run_load(c.client_endpoint, {"tiny": 200.0}, 1.0, seed=4, check_echo=True))
            assert r["total"]["no_reply"] == 0 and r["total"]["bad_echo"] == 0
        finally:
            p.send_signal(signal.SIGCONT)
        st = wait_status(c, lambda s: s["vgpus"]["alive"] == 4, timeout_s=20)
        assert st["vgpus"]["alive"] == 4
        r = asyncio.run(run_load(c.client_endpoint, {"tiny": 200.0}, 1.0, seed=5, check_echo=True))
        assert r["total"]["no_reply"] == 0 and r["total"]["bad_echo"] == 0
    except BaseException:
        show_logs(c)
        raise
    finally:
        c.stop()


def test_second_claim_on_a_vgpu_waits_for_the_first_to_die(workdir):
    c = make_cluster(workdir, "taken", groups=((0, 1, 2, 3),))
    try:
        c.start()
        first = c.executors[0].pid
        c.groups.append([0, 1, 2, 3])
        # a second process for the same vGPUs, on a data endpoint of its own (the first one's is
        # held, and an executor refuses to take a live process's socket)
        c.executors.append(c._spawn([c.python, "-m", "ppiped.executor.main", "--config", str(c.config),
                                     "--vgpu", "0,1,2,3", "--log-level", c.log_level, "--data-endpoint",
                                     f"ipc://{workdir}/second-data.sock"], "executor-1.log"))
        st = wait_status(c, lambda s: s["counters"].get("vgpu_taken", 0) >= 1)
        assert st["counters"]["vgpu_taken"] >= 1 and [e["pid"] for e in st["executors"]] == [first]
        c.kill_executor(0)
        st = wait_status(c, lambda s: s["vgpus"]["alive"] == 4 and s["executors"][0]["pid"] != first,
                         timeout_s=20)
        assert st["vgpus"]["alive"] == 4 and st["executors"][0]["pid"] == c.executors[1].pid
        with Client(c.client_endpoint, timeout_s=10) as cl:
            assert cl.submit("tiny", b"new owner").data == b"new owner"
    except BaseException:
        show_logs(c)
        raise
    finally:
        c.stop()


def test_scheduler_restart_executors_reregister(workdir):
    c = make_cluster(workdir, "restart", groups=((0, 1, 2, 3),))
    try:
        c.start()
        c.server.send_signal(signal.SIGTERM)
        assert c.server.wait(timeout=15) == 0
        c.server = c._spawn([c.python, "-m", "ppiped.cli", "serve", "--config", str(c.config)], "serve2.log")
        end = time.monotonic() + 60
        while time.monotonic() < end:
            st = c.status(timeout_s=1.0)
            if st and st["vgpus"]["alive"] == 4:
                break
            time.sleep(0.2)
        else:
            pytest.fail("executors did not re-register with the restarted scheduler")
        with Client(c.client_endpoint, timeout_s=10) as cl:
            assert cl.submit("tiny", b"again").data == b"again"
    finally:
        c.stop()


def _thread_cpus(pid: int) -> dict[str, set[int]]:
    """Each thread of ``pid`` by name (the main thread as 'main') and the CPUs it may run on."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        name = "main" if int(tid) == pid else Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
        out[name] = os.sched_getaffinity(int(tid))
    return out


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_threads_config_puts_the_loop_and_zeromq_io_on_their_cpus(workdir):
    loop_cpu, io_cpu = sorted(os.sched_getaffinity(0))[:2]
    c = make_cluster(workdir, "threads", extra=f"[threads]\nloop_cpus = [{loop_cpu}]\nio_cpus = [{io_cpu}]\n")
    try:
        c.start()
        with Client(c.client_endpoint, timeout_s=10) as cl:
            frame = np.ones(tiny.INPUT_SHAPE, np.float32).tobytes()
            assert cl.submit("tiny", frame).data == frame  # emulated executors echo the input
        cpus = _thread_cpus(c.server.pid)
        assert cpus["main"] == {loop_cpu}, cpus
        io = [v for k, v in cpus.items() if k.startswith("ZMQbg/IO")]
        assert io and all(v == {io_cpu} for v in io), cpus
    except BaseException:
        show_logs(c)
        raise
    finally:
        c.stop()


def test_serve_refuses_a_plan_that_cuts_where_the_profile_found_fp16_unsafe(workdir):
    """Served, such a plan's answers were off by half the output's range; it was a warning."""
    import json
    import subprocess
    import sys

    from ppiped.plan import load_plan

    d = workdir / "unsafe"
    d.mkdir()
    plan, profiles = tiny.write_example(d)
    cut = load_plan(plan).models[0].pipelines[0].partitions[0].blocks[1]
    f = Path(profiles) / f"{tiny.MODEL}.json"
    prof = json.loads(f.read_text())
    prof["equivalence"] = {"unsafe_cuts": [cut], "cut_errors": {str(cut): 0.53}}
    f.write_text(json.dumps(prof))
    cfg = write_config(d, plan, profiles)
    r = subprocess.run([sys.executable, "-m", "ppiped.cli", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "not served" in r.stderr and "[unsafe-cut]" in r.stderr, r.stderr


def test_threads_config_with_a_cpu_the_daemon_may_not_use_is_a_clear_error(workdir):
    import subprocess
    import sys

    d = workdir / "badcpu"
    d.mkdir()
    plan, profiles = tiny.write_example(d)
    cfg = write_config(d, plan, profiles, extra="[threads]\nio_cpus = [1023]\n")
    r = subprocess.run([sys.executable, "-m", "ppiped.cli", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r
    assert "threads.io_cpus: CPU 1023 not available to this process" in r.stderr, r.stderr


@pytest.mark.parametrize("extra,scheduler,fragment", [
    ("", {"policy": 5}, "scheduler.policy: expected a policy name"),
    ("[limits]\nmax_slo_ms = 0.001\n", None, "limits.max_slo_ms: 0.001 is below the SLO of tiny"),
    ("", {"min_wait_us": 1e300}, "min_wait_us must be within [0, 1e+07]"),
])
def test_serve_refuses_a_config_at_odds_with_itself_or_the_plan(workdir, extra, scheduler, fragment):
    """A policy that is no name, a SLO cap below the plan's own SLO (every request of the plan's
    would be refused as malformed): one line, exit status 2, before anything listens."""
    import subprocess
    import sys

    d = workdir / ("odd-" + fragment.split(":")[0])
    d.mkdir()
    plan, profiles = tiny.write_example(d)
    cfg = write_config(d, plan, profiles, scheduler=scheduler, extra=extra)
    r = subprocess.run([sys.executable, "-m", "ppiped.cli", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_replan_brings_a_standby_executor_into_service_and_requests_pass_through_it(workdir):
    """An executor registered while its vGPUs were beyond the plan (standby) learns no data
    endpoints, and the others never heard of it; a replan to a plan that has its vGPUs must give
    every executor the new directory, or every batch crossing to or from it is lost."""
    import json

    from ppiped import ctl

    c = make_cluster(workdir, "grow", extra="[models.tiny]\ninput_bytes = 0\n")
    try:
        c.start()
        c.groups.append([4, 5])
        c.executors.append(c._start_executor(2))
        wait_status(c, lambda s: any(e["vgpus"] == "4-5" for e in s["executors"]))
        plan6 = c.config.parent / "plan6.json"
        plan6.write_text(json.dumps(tiny.plan_json(tiny.profile_json(), vgpus=(3, 3))))
        rp = ctl.call(str(c.config.parent / "admin.sock"),
                      {"cmd": "replan", "plan_file": str(plan6), "wait": True}, 60)
        assert rp["ok"] and rp["vgpus"] == 6, rp
        st = wait_status(c, lambda s: s["vgpus"]["alive"] == 6, timeout_s=30)
        assert st["vgpus"]["alive"] == 6, st["vgpus"]

        async def drive():
            async with AsyncClient(c.client_endpoint, timeout_s=30) as cl:
                return await asyncio.gather(*[cl.submit("tiny", b"g%d" % i, slo_ms=5000) for i in range(120)],
                                            return_exceptions=True)

        outs = asyncio.run(drive())
        bad = [o for o in outs if isinstance(o, BaseException)]
        assert not bad, bad[:5]
        assert [o.data for o in outs] == [b"g%d" % i for i in range(120)]
        st = c.status()
        assert st["busy_us"][4] + st["busy_us"][5] > 0, st["busy_us"]  # the new vGPUs served
        assert not st["counters"].get("peer_unreachable"), st["counters"]
    except BaseException:
        show_logs(c)
        raise
    finally:
        c.stop()


def test_counters_never_go_backwards_when_a_replan_removes_and_re_adds_a_model(workdir):
    """Totals keep a removed model's history, its Prometheus counters stay (a counter never
    decreases within a process), and a model added back counts on from where it stopped."""
    import json
    import socket
    import urllib.request

    from ppiped import ctl

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    d = workdir / "counters"
    d.mkdir()
    plan, profiles = tiny.write_example(d)
    prof2 = tiny.profile_json(model="tiny2")
    (profiles / "tiny2.json").write_text(json.dumps(prof2))
    both = tiny.plan_json(tiny.profile_json(), vgpus=(1, 1))
    both["models"] += tiny.plan_json(prof2, vgpus=(1, 1))["models"]
    both["objective"]["normalized_throughput"] = min(m["throughput_rps"] for m in both["models"])
    both["cluster"]["gpus"]["CPU"]["count"] = 4
    (d / "both.json").write_text(json.dumps(both))
    cfg = write_config(d, d / "both.json", profiles, heartbeat_ms=50, timeout_ms=1000,
                       scheduler={"wait_guard_us": 25_000},
                       extra=f"[models.tiny]\ninput_bytes = 0\n[models.tiny2]\ninput_bytes = 0\n"
                             f"[metrics]\nport = {port}\n")
    c = LocalCluster(cfg, ((0, 2), (1, 3)), log_level="info")
    admin = str(d / "admin.sock")

    def metrics() -> dict[str, float]:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        return {k: float(v) for k, v in (ln.rsplit(" ", 1) for ln in text.splitlines()
                                         if ln.startswith(("ppiped_requests_total", "ppiped_replies_total",
                                                             "ppiped_handler_errors_total")))}

    def replan(path: Path) -> None:
        rp = ctl.call(admin, {"cmd": "replan", "plan_file": str(path), "wait": True}, 60)
        assert rp["ok"], rp

    try:
        c.start()
        with Client(c.client_endpoint, timeout_s=10) as cl:
            for m in ("tiny", "tiny2"):
                assert all(not isinstance(r, Exception) for r in cl.submit_many(m, [b"x"] * 5, slo_ms=5000))
        before = metrics()
        t0 = c.status()["totals"]
        assert t0["accepted"] == 10 and before['ppiped_requests_total{model="tiny2"}'] == 5
        replan(plan)  # tiny alone: tiny2 removed
        after = metrics()
        assert c.status()["totals"] == t0
        for k, v in before.items():  # the removed model's counters are still there, unchanged
            assert after.get(k) == v, (k, v, after.get(k))
        replan(d / "both.json")  # tiny2 back: it counts on
        with Client(c.client_endpoint, timeout_s=10) as cl:
            assert all(not isinstance(r, Exception) for r in cl.submit_many("tiny2", [b"y"] * 3, slo_ms=5000))
        again = metrics()
        assert again['ppiped_requests_total{model="tiny2"}'] == 8
        assert again['ppiped_replies_total{model="tiny2",outcome="ok"}'] == 8
        assert again["ppiped_handler_errors_total"] == 0
        st = c.status()
        assert st["totals"]["accepted"] == 13 and st["models"]["tiny2"]["accepted"] == 8
    except BaseException:
        show_logs(c)
        raise
    finally:
        c.stop()
