"""Operations: ppiped-ctl over the unix socket, metrics, live replan under load, config errors.

One emulated two-model cluster (scheduler + 2 executor processes on ipc:// sockets in a private
temp dir) serves the module; it is stopped in a ``finally``. Loads and waits are bounded; nothing
asserts on timings.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import math
import os
import socket
import stat
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from ppiped import ctl
from ppiped.daemon.config import ConfigError, config_from_dict, load_config
from ppiped.daemon.launch import LocalCluster, short_tmpdir
from ppiped.daemon.replan import RateMeter, Replanner, mix_drift, weights_from_rates

ROOT = Path(__file__).resolve().parents[1]


def _bench():
    spec = importlib.util.spec_from_file_location("bench_replan", ROOT / "bench" / "replan.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- config -------------------------------------------------------------------------------------

BASE = {"plan": "p.json", "profiles": "profiles"}


@pytest.mark.parametrize("extra, key, problem", [
    ({"ctl": {"mode": "0777x"}}, "ctl.mode", "octal"),
    ({"ctl": {"mode": "0440"}}, "ctl.mode", "owner read and write"),
    ({"ctl": {"mode": 0o660}}, "ctl.mode", "expected a string"),
    ({"ctl": {"socket": "/x" * 60}}, "ctl.socket", "100 characters"),
    ({"ctl": {"sock": "/tmp/a"}}, "ctl", "unknown key(s) sock"),
    ({"metrics": {"port": 70000}}, "metrics.port", "TCP port"),
    ({"metrics": {"port": -1}}, "metrics.port", "integer >= 0"),
    ({"metrics": {"host": "0.0.0.0"}}, "metrics.host", "loopback"),
    ({"replan": {"drift": 1.5}}, "replan.drift", "between 0 and 1"),
    ({"replan": {"min_interval_s": 0}}, "replan.min_interval_s", "positive number"),
    ({"replan": {"algo": "gurobi"}}, "replan.algo", "ppipe, np or dart-r"),
    ({"replan": {"auto": "yes"}}, "replan.auto", "true or false"),
    ({"replan": {"every_s": 3}}, "replan", "unknown key(s) every_s"),
    ({"threads": {"loop_cpus": 0}}, "threads.loop_cpus", "list of CPU numbers"),
    ({"threads": {"io_cpus": [1, -1]}}, "threads.io_cpus", "list of CPU numbers"),
    ({"threads": {"io_cpus": [1, 1]}}, "threads.io_cpus", "listed twice"),
    ({"threads": {"io_threads": 0}}, "threads.io_threads", "integer >= 1"),
    ({"threads": {"loop_cpu": [0]}}, "threads", "unknown key(s) loop_cpu"),
    ({"executor": {"start_early_us": "soon"}}, "executor.start_early_us", 'number >= 0 or "inf"'),
    ({"executor": {"start_early_us": -5}}, "executor.start_early_us", 'number >= 0 or "inf"'),
    ({"executor": {"emulate_jitter": "inf"}}, "executor.emulate_jitter", "lognormal sigma in [0, 2]"),
    # 1e300 overflowed a batch's duration and wedged the vGPU
    ({"executor": {"emulate_jitter": 1e300}}, "executor.emulate_jitter", "lognormal sigma in [0, 2]"),
    # a per-vGPU data endpoint off the host without CURVE was accepted (only the default was checked)
    ({"endpoints": {"allow_remote": True}, "executors": {"3": {"data_endpoint": "tcp://0.0.0.0:17303"}}},
     "executors.3.data_endpoint", "security.curve must be true"),
    # in-process: no peer executor could ever reach it, and every batch was lost
    ({"executor": {"data_endpoint": "inproc://vgpu-{vgpu}"}}, "executor.data_endpoint", "ipc:// or tcp://"),
    ({"executor": {"data_port_base": 70000}}, "executor.data_port_base", "TCP port in 1024..65535"),
    ({"limits": {"max_slo_ms": 1000}, "models": {"tiny": {"slo_ms": 5000}}}, "models.tiny.slo_ms",
     "over limits.max_slo_ms"),
    ({"threads": {"io_threads": 100_000}}, "threads.io_threads", "at most 64"),
    ({"executor": {"threads": 1_000_000}}, "executor.threads", "at most 1024"),
    ({"executor": {"emulate_load_ms": 9 * 10**18}}, "executor.emulate_load_ms", "at most 3600000"),
    # "0" and "00": the second table silently replaced the first
    ({"executors": {"0": {"threads": 2}, "00": {"threads": 3}}}, "executors.00", "vGPU 0 has a table already"),
    # a 5,000-digit id raised out of int()
    ({"executors": {"9" * 5000: {"threads": 2}}}, "executors.999", "keyed by vGPU id"),
    # each worker is a Python process, all started up front
    ({"glue": {"workers": 100_000}}, "glue.workers", "at most 256"),
    ({"glue": {"max_children": 9 * 10**18}}, "glue.max_children", "at most 1000000"),
    # the daemon said "another ppiped listens" on its own endpoint
    ({"endpoints": {"ctl": "ipc:///tmp/x/a.sock"}, "ctl": {"socket": "/tmp/x/a.sock"}}, "ctl.socket",
     "is also endpoints.ctl"),
    # executors refuse a WELCOME asking for heartbeats further apart
    ({"heartbeat": {"interval_ms": 120_000, "timeout_ms": 300_000}}, "heartbeat.interval_ms", "at most 60000"),
])
def test_config_errors_name_key_and_problem(extra, key, problem):
    with pytest.raises(ConfigError) as e:
        config_from_dict({**BASE, **extra}, "/etc/ppiped/ppiped.toml")
    msg = str(e.value)
    assert f"ppiped.toml: {key}" in msg and problem in msg, msg


def test_executors_are_work_conserving_by_default_and_can_be_bounded():
    assert math.isinf(config_from_dict(BASE, "x.toml").executor_defaults.start_early_us)
    cfg = config_from_dict({**BASE, "executor": {"start_early_us": 250, "emulate_jitter": 0.05}}, "x.toml")
    assert cfg.executor_defaults.start_early_us == 250.0 and cfg.executor_defaults.emulate_jitter == 0.05


def test_example_config_documents_and_validates_every_key():
    cfg = load_config(ROOT / "plans" / "ppiped.toml")
    assert cfg.ctl_mode == 0o660 and cfg.metrics_port == 9464 and cfg.replan_min_interval_s == 60.0
    text = (ROOT / "plans" / "ppiped.toml").read_text()
    for line in text.splitlines():  # every key line carries a comment that says what it is
        s = line.strip()
        if s and not s.startswith(("#", "[")) and "=" in s:
            assert "#" in s, f"undocumented key: {s}"


def test_ctl_socket_default_follows_systemd_runtime_directory(monkeypatch):
    cfg = config_from_dict(BASE, "/etc/ppiped/ppiped.toml")
    monkeypatch.setenv("RUNTIME_DIRECTORY", "/run/ppiped")
    assert cfg.ctl_socket_path() == "/run/ppiped/ctl.sock"
    unit = (ROOT / "systemd" / "ppiped.service").read_text()
    assert "RuntimeDirectory=ppiped" in unit and "Type=notify" in unit and "WatchdogSec=" in unit
    monkeypatch.delenv("RUNTIME_DIRECTORY")
    cfg = config_from_dict({**BASE, "endpoints": {"ctl": "ipc:///tmp/x/ctl.sock"}}, "/e/p.toml")
    assert cfg.ctl_socket_path() == "/tmp/x/admin.sock"


def test_relative_ipc_endpoints_are_the_config_files_folders():
    """The config says relative paths are relative to it; ipc:// endpoints were relative to the
    daemon's working directory, so executors started elsewhere missed the sockets."""
    cfg = config_from_dict({**BASE, "endpoints": {"client": "ipc://c.sock", "executor": "ipc://sub/../e.sock"},
                            "executor": {"data_endpoint": "ipc://data-{vgpu}.sock"}}, "/etc/ppiped/p.toml")
    assert (cfg.client, cfg.executor) == ("ipc:///etc/ppiped/c.sock", "ipc:///etc/ppiped/e.sock")
    assert cfg.executor_settings(3).endpoint_for(3) == "ipc:///etc/ppiped/data-3.sock"
    assert config_from_dict({**BASE, "endpoints": {"client": "ipc:///run/c.sock"}}, "/e/p.toml").client == \
        "ipc:///run/c.sock"


def test_ctl_socket_group_mode_and_errors(tmp_path):
    import grp

    from ppiped.daemon.ctl_server import CtlServer

    srv = SimpleNamespace(cfg=SimpleNamespace(source="ppiped.toml"))
    path = str(tmp_path / "c.sock")
    group = grp.getgrgid(os.getgid()).gr_name

    async def go() -> None:
        cs = CtlServer(srv, path, 0o640, group)
        await cs.start()
        try:
            st = os.stat(path)
            assert stat.S_IMODE(st.st_mode) == 0o640 and st.st_gid == os.getgid()
            with pytest.raises(ConfigError, match="another ppiped listens"):
                await CtlServer(srv, path).start()
        finally:
            await cs.close()
        assert not os.path.exists(path)
        with pytest.raises(ConfigError, match="ctl.group: no group named"):
            await CtlServer(srv, path, 0o660, "no-such-group-xyz").start()

    asyncio.run(go())


# --- replan pieces ------------------------------------------------------------------------------

def test_rate_meter_mix_drift_and_weights():
    m = RateMeter(2, tau_s=0.5)
    m.t = 0
    for k in range(1, 41):  # 40 ticks of 0.1 s: 100 and 300 requests per second
        m.update([10 * k, 30 * k], k * 100_000)
    assert m.rates[0] == pytest.approx(100, rel=0.01) and m.rates[1] == pytest.approx(300, rel=0.01)
    assert mix_drift([100, 300], [1, 1]) == pytest.approx(0.25)
    assert mix_drift([100, 100], [2, 2]) == 0.0
    assert weights_from_rates([0.0, 0.0]) is None
    assert weights_from_rates([0.0, 200.0]) == [0.01, 1.0]


def test_planner_child_is_found_and_reniced():
    from ppiped.daemon.replan import children, renice_children

    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", "ppiped-ops-marker"])
    try:
        end = time.monotonic() + 10
        while p.pid not in children("ppiped-ops-marker") and time.monotonic() < end:
            time.sleep(0.02)
        assert p.pid in children("ppiped-ops-marker")
        assert renice_children("ppiped-ops-marker") == 1
        assert os.getpriority(os.PRIO_PROCESS, p.pid) == 19
    finally:
        p.kill()
        p.wait(timeout=10)


def test_auto_replan_respects_threshold_and_min_interval(monkeypatch):
    cfg = SimpleNamespace(replan_auto=True, replan_min_interval_s=60.0, replan_drift=0.2, replan_ewma_s=1.0,
                          heartbeat_interval_ms=100)
    plan = SimpleNamespace(model=lambda m: SimpleNamespace(weight=1.0))
    srv = SimpleNamespace(cfg=cfg, stopping=False, model_names=["a", "b"], plan=plan,
                          rates=SimpleNamespace(rates=[100.0, 100.0], samples=100))
    r = Replanner(srv)
    started = []
    monkeypatch.setattr(r, "start", lambda *a, **k: started.append(k.get("trigger")))
    r.last_end = time.monotonic() - 120
    r.maybe_auto()
    assert started == []  # no drift
    srv.rates.rates = [300.0, 50.0]
    r.last_end = time.monotonic() - 10
    r.maybe_auto()
    assert started == []  # drifted, but within the minimum interval
    r.last_end = time.monotonic() - 61
    r.maybe_auto()
    assert len(started) == 1 and started[0].startswith("drift")
    cfg.replan_auto = False
    r.maybe_auto()
    assert len(started) == 1


# --- ctl without a daemon -----------------------------------------------------------------------

def test_ctl_clear_errors_when_daemon_is_not_running(tmp_path, capsys):
    missing = tmp_path / "none.sock"
    assert ctl.main(["--socket", str(missing), "status"]) == 3
    assert "not running" in capsys.readouterr().err
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(stale))
    s.close()  # the file stays, nobody listens: a daemon that died
    assert ctl.main(["--socket", str(stale), "status"]) == 3
    assert "nobody listens" in capsys.readouterr().err


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores socket permissions")
def test_ctl_clear_error_without_permission(tmp_path, capsys):
    path = tmp_path / "locked.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(path))
        s.listen(1)
        os.chmod(path, 0o000)
        assert ctl.main(["--socket", str(path), "status"]) == 4
        assert "permission denied" in capsys.readouterr().err
    finally:
        s.close()


# --- against a running emulated cluster ---------------------------------------------------------

@pytest.fixture(scope="module")
def ops():
    bench = _bench()
    with short_tmpdir("ppiped-ops-") as tmp:
        d = Path(tmp)
        port = _free_port()
        cfg, plan = bench.write_example(d, metrics_port=port)
        notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        notify.bind(str(d / "notify.sock"))
        notify.setblocking(False)
        c = LocalCluster(cfg, [[0, 2], [1, 3]], log_level="info",
                         env={"NOTIFY_SOCKET": str(d / "notify.sock"), "WATCHDOG_USEC": "300000",
                              "STATE_DIRECTORY": str(d / "state")})
        try:
            c.start()
            yield SimpleNamespace(cluster=c, sock=str(d / "admin.sock"), port=port, plan=plan, dir=d,
                                  bench=bench, notify=notify)
        finally:
            c.stop()
            notify.close()


def _notes(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_sighup_leaves_the_daemon_serving(ops):
    import signal

    ops.cluster.server.send_signal(signal.SIGHUP)
    time.sleep(0.3)
    assert ops.cluster.server.poll() is None and ctl.call(ops.sock, {"cmd": "status"})["plan_version"] >= 1
    assert "sighup-ignored" in (ops.dir / "serve.log").read_text()


def test_ctl_socket_is_0660(ops):
    assert stat.S_IMODE(os.stat(ops.sock).st_mode) == 0o660


def test_ctl_status_plan_executors(ops, capsys):
    out = ctl.call(ops.sock, {"cmd": "status"})
    assert out["ok"] and out["plan_version"] >= 1 and out["vgpus"] == {"total": 4, "alive": 4, "missing": ""}
    assert set(out["models"]) == {"tiny", "tiny2"}
    assert {"rate_rps", "attainment", "queued", "weight"} <= set(out["models"]["tiny"])
    assert len(out["executors"]) == 2 and all(e["health"] == "ready" for e in out["executors"])
    assert ctl.main(["--socket", ops.sock, "status"]) == 0
    text = capsys.readouterr().out
    assert "plan v" in text and "tiny2" in text and "attain" in text
    assert ctl.main(["--socket", ops.sock, "plan"]) == 0
    text = capsys.readouterr().out
    assert "pipe rps" in text and "objective" in text
    assert ctl.main(["--socket", ops.sock, "executors"]) == 0
    assert "ready" in capsys.readouterr().out
    assert ctl.main(["--socket", ops.sock, "--json", "executors"]) == 0
    assert json.loads(capsys.readouterr().out)["executors"][0]["assignments"]
    bad = ctl.call(ops.sock, {"cmd": "reboot"})
    assert not bad["ok"] and "unknown command" in bad["error"]


@pytest.mark.parametrize("req,fragment", [
    ({"cmd": "drain", "off": "false"}, "off: expected true or false, got 'false'"),
    ({"cmd": "drain", "off": 1}, "off: expected true or false"),
    ({"cmd": "drain", "timeout_s": float("nan")}, "timeout_s: expected seconds"),
    ({"cmd": "drain", "timeout_s": -1}, "timeout_s: expected seconds"),
    ({"cmd": "drain", "timeout_s": "5"}, "timeout_s: expected seconds"),
    ({"cmd": "replan", "dry_run": "yes"}, "dry_run: expected true or false"),
    ({"cmd": "replan", "wait": [1]}, "wait: expected true or false"),
    ({"cmd": "replan", "weights": {"tiny": 1}, "plan_file": "/x.json"}, "not both"),
])
def test_ctl_refuses_wrongly_typed_fields_by_name(ops, req, fragment):
    """A string "false" is not read as true; nothing is done, and the daemon keeps serving."""
    before = ctl.call(ops.sock, {"cmd": "status"})
    out = ctl.call(ops.sock, req)
    assert not out["ok"] and fragment in out["error"], out
    after = ctl.call(ops.sock, {"cmd": "status"})
    assert after["state"] == "serving" and after["replan"]["running"] is False
    assert after["plan_version"] == before["plan_version"] and after["replan"]["last"] == before["replan"]["last"]


def test_ctl_answers_an_oversized_line_before_closing(ops):
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.connect(ops.sock)
        s.settimeout(10)
        with contextlib.suppress(OSError):  # the daemon may close before the whole line is sent
            s.sendall(b'{"cmd": "status", "pad": "' + b"x" * (2 << 20) + b'"}\n')
        data = b""
        while not data.endswith(b"\n"):
            chunk = s.recv(4096)
            if not chunk:
                break
            data += chunk
    out = json.loads(data)
    assert not out["ok"] and "longer than" in out["error"]
    assert ctl.call(ops.sock, {"cmd": "status"})["ok"]


def test_installed_ppiped_ctl_script(ops):
    exe = Path(sys.executable).with_name("ppiped-ctl")
    if not exe.exists():
        pytest.skip("ppiped-ctl is not installed in this environment")
    p = subprocess.run([str(exe), "--socket", ops.sock, "status"], capture_output=True, text=True, timeout=30)
    assert p.returncode == 0 and "plan v" in p.stdout, p.stderr


def test_replan_rejects_bad_weights(ops, capsys):
    assert ctl.main(["--socket", ops.sock, "replan", "--weights", "tiny=1,nosuch=2", "--dry-run"]) == 1
    assert "unknown model" in capsys.readouterr().err
    assert ctl.main(["--socket", ops.sock, "replan", "--weights", "tiny"]) == 2
    # raw requests, as any process that can open the socket may send them: each refused by name
    for weights, text in (([1, 2, 3], "expected 2 (one per model: tiny, tiny2)"),
                          ([1e308, 1], "expected numbers in [1e-06, 1e+06], got 1e+308"),
                          ({"tiny": True, "tiny2": 1}, "got True"), ([1, "2"], "got '2'"),
                          ([1e6, 0.5], "more than 1e+06 x the smallest"),
                          ({"tiny": 3}, "no weight for model(s) tiny2")):
        out = ctl.call(ops.sock, {"cmd": "replan", "weights": weights, "dry_run": True})
        assert not out["ok"] and text in out["error"], (weights, out)


def test_replan_refuses_a_broken_plan_file_and_keeps_serving(ops):
    """A plan file with no models (it once crashed the daemon in compiled code), one that is not
    JSON, one that is not UTF-8 and one that does not exist: each refused with a reason, the
    daemon still on its plan."""
    from ppiped.plan import save_plan

    before = ctl.call(ops.sock, {"cmd": "status"})["plan_version"]
    save_plan(ops.plan, ops.dir / "good.json")
    good = json.loads((ops.dir / "good.json").read_text())
    bodies = {"empty.json": json.dumps({**good, "models": []}).encode(), "text.json": b"not json",
              "bytes.json": b"\xff\xfe{}"}
    for name, body in bodies.items():
        (ops.dir / name).write_bytes(body)
    for name in [*bodies, "nosuch.json"]:
        out = ctl.call(ops.sock, {"cmd": "replan", "plan_file": str(ops.dir / name), "wait": True})
        assert out["ok"] is False and out["error"], (name, out)
    st = ctl.call(ops.sock, {"cmd": "status"})
    assert st["ok"] and st["plan_version"] == before and st["vgpus"]["alive"] == 4


def test_replan_dry_run_refuses_what_the_switch_would(ops):
    """A plan file that parses but cannot be placed (a partition on a GPU type nobody profiled):
    a dry run says so as the real replan does, instead of "ok"."""
    from ppiped.plan import save_plan

    save_plan(ops.plan, ops.dir / "good.json")
    bad = json.loads((ops.dir / "good.json").read_text())
    bad["models"][0]["pipelines"][0]["partitions"][0]["blocks"] = [0, 999]
    (ops.dir / "unplaceable.json").write_text(json.dumps(bad))
    outs = [ctl.call(ops.sock, {"cmd": "replan", "plan_file": str(ops.dir / "unplaceable.json"), **kw})
            for kw in ({"dry_run": True}, {"wait": True})]
    assert [o["ok"] for o in outs] == [False, False], outs
    assert outs[0]["error"] == outs[1]["error"]
    # an SLO past limits.max_slo_ms, refused at start, was taken on replan (1e308 µs once)
    bad = json.loads((ops.dir / "good.json").read_text())
    bad["models"][0]["slo_us"] = 1e12
    (ops.dir / "slo-past-limit.json").write_text(json.dumps(bad))
    out = ctl.call(ops.sock, {"cmd": "replan", "plan_file": str(ops.dir / "slo-past-limit.json"), "dry_run": True})
    assert not out["ok"] and "over limits.max_slo_ms" in out["error"], out


def test_replan_plan_file_refuses_an_unplaceable_plan_before_it_says_started(ops):
    """Without --wait the answer used to be "started" (exit 0) and the refusal went to the log
    only; now the operator gets it, in the same words as with --wait, and no class name."""
    from ppiped.plan import save_plan

    save_plan(ops.plan, ops.dir / "good.json")
    bad = json.loads((ops.dir / "good.json").read_text())
    bad["models"][0]["pipelines"][0]["partitions"][0]["num_vgpus"] = 10_000
    (ops.dir / "toomany.json").write_text(json.dumps(bad))
    outs = [ctl.call(ops.sock, {"cmd": "replan", "plan_file": str(ops.dir / "toomany.json"), **kw})
            for kw in ({}, {"wait": True})]
    assert [o["ok"] for o in outs] == [False, False] and "started" not in outs[0], outs
    assert "whole GPUs" in outs[0]["error"] and "Error:" not in outs[0]["error"]
    assert ctl.main(["--socket", ops.sock, "replan", "--plan-file", str(ops.dir / "toomany.json")]) != 0


def test_replan_dry_run_keeps_the_plan(ops, capsys):
    before = ctl.call(ops.sock, {"cmd": "status"})["plan_version"]
    assert ctl.main(["--socket", ops.sock, "replan", "--weights", "tiny=1,tiny2=4", "--dry-run"]) == 0
    assert "pipe rps" in capsys.readouterr().out
    assert ctl.call(ops.sock, {"cmd": "status"})["plan_version"] == before


def test_replan_under_load_answers_every_request(ops):
    before = ctl.call(ops.sock, {"cmd": "status"})
    rates = {m.model: 0.1 * m.throughput_rps for m in ops.plan.models}
    report, rp = asyncio.run(ops.bench.load_with_replan(ops.cluster, ops.sock, rates, 4.0, 1.5,
                                                        {"tiny": 3.0, "tiny2": 1.0}))
    t = report["total"]
    assert t["sent"] > 0 and t["no_reply"] == 0, t
    assert t["ok"] + t["dropped"] + t["rejected"] == t["sent"]
    assert rp["ok"], rp
    for k in ("pause_ms", "flush_ms", "moved_requests", "plan_s", "preload_ms", "switch_ms"):
        assert k in rp
    # the executors loaded the new partitions while serving; the switch only swapped them in
    assert rp["preload"] == "all" and rp["preloaded_executors"] == 2 and rp["stragglers"] == 0, rp
    after = ctl.call(ops.sock, {"cmd": "status"})
    assert after["plan_version"] == before["plan_version"] + 1
    assert after["vgpus"]["alive"] == 4 and after["state"] == "serving"
    assert after["replan"]["last"]["ok"]
    # the new assignment is what the executors serve now: tiny has 3 vGPUs at 3:1
    execs = ctl.call(ops.sock, {"cmd": "executors"})["executors"]
    assert sum(a.startswith("tiny/") for e in execs for a in e["assignments"]) == 3
    # and serving goes on afterwards
    report = asyncio.run(asyncio.wait_for(_load_only(ops, rates, 1.0), 60))
    assert report["total"]["no_reply"] == 0 and report["total"]["ok"] > 0


async def _load_only(ops, rates, duration):
    from ppiped.commands.loadgen import run_load

    return await run_load(ops.cluster.client_endpoint, rates, duration)


def test_metrics_endpoint(ops):
    with urllib.request.urlopen(f"http://127.0.0.1:{ops.port}/metrics", timeout=10) as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    for name in ("ppiped_requests_total", "ppiped_replies_total", "ppiped_drops_total", "ppiped_rejects_total",
                 "ppiped_attainment_ratio", "ppiped_queue_depth", "ppiped_dispatch_decision_seconds",
                 "ppiped_vgpu_busy_ratio", "ppiped_reservation_error_seconds", "ppiped_plan_version",
                 "ppiped_replan_duration_seconds", "ppiped_replan_pause_seconds", "ppiped_arrival_rate_rps"):
        assert f"# TYPE {name} " in text, name
    vals = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            k, v = line.rsplit(" ", 1)
            vals[k] = float(v)
    assert vals['ppiped_requests_total{model="tiny"}'] > 0
    assert vals['ppiped_dispatch_decision_seconds_bucket{le="+Inf"}'] > 0
    assert vals["ppiped_plan_version"] >= 1 and vals["ppiped_reservation_error_seconds_count"] > 0
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"http://127.0.0.1:{ops.port}/nope", timeout=10)
    assert e.value.code == 404
    for head in (b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", b"GET /" + b"a" * 70_000 + b"\r\n"):
        with socket.create_connection(("127.0.0.1", ops.port), timeout=10) as s:
            s.sendall(head)
            assert s.recv(100).startswith(b"HTTP/1.1 431 ")  # a line past asyncio's limit
    assert "Traceback" not in (ops.dir / "serve.log").read_text()


def _daemon_fds(ops) -> int:
    return len(os.listdir(f"/proc/{ops.cluster.server.pid}/fd"))


def test_idle_metrics_and_ctl_connections_are_bounded(ops):
    """Connections that send half a request and wait hold at most the listeners' caps of the
    daemon's descriptors (1,000 dripping metrics connections once exhausted them and libzmq
    aborted the daemon), the extra ctl ones are told why, and serving goes on throughout."""
    from ppiped.client import Client
    from ppiped.daemon import ctl_server, metrics

    before = _daemon_fds(ops)
    held = []
    try:
        for _ in range(3 * metrics.MAX_CONNECTIONS):
            s = socket.create_connection(("127.0.0.1", ops.port), timeout=10)
            s.sendall(b"GET /metrics HTTP/1.1\r\n")
            held.append(s)
        for _ in range(ctl_server.MAX_CONNECTIONS + 5):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(10)
            s.connect(ops.sock)
            s.sendall(b'{"cmd": "sta')
            held.append(s)
        extra = held[-1].recv(4096)
        assert b"ctl connections are open already" in extra
        time.sleep(0.5)
        assert _daemon_fds(ops) <= before + metrics.MAX_CONNECTIONS + ctl_server.MAX_CONNECTIONS + 8
        with Client(ops.cluster.client_endpoint, timeout_s=10) as c:
            assert c.submit("tiny", b"x" * 16) is not None
    finally:
        for s in held:
            s.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the held ones are let go as their peers close
        with contextlib.suppress(OSError), urllib.request.urlopen(f"http://127.0.0.1:{ops.port}/metrics",
                                                                  timeout=5) as r:
            if r.status == 200:
                break
        time.sleep(0.2)
    else:
        pytest.fail("no scrape answered after the idle connections closed")
    assert ctl.call(ops.sock, {"cmd": "status"})["state"] == "serving"
    assert ops.cluster.server.poll() is None


def test_sd_notify_ready_watchdog_status(ops):
    notes = "\n".join(_notes(ops.notify))
    assert "READY=1" in notes and "WATCHDOG=1" in notes and "STATUS=" in notes


def test_drain_refuses_new_requests_then_resumes(ops, capsys):
    from ppiped.client import Client, Rejected

    assert ctl.main(["--socket", ops.sock, "drain", "--wait-s", "10"]) == 0
    assert "drained" in capsys.readouterr().out
    assert ctl.call(ops.sock, {"cmd": "status"})["state"] == "draining"
    with Client(ops.cluster.client_endpoint, timeout_s=10) as c, pytest.raises(Rejected):
        c.submit("tiny", b"x" * 16)
    assert ctl.main(["--socket", ops.sock, "drain", "--off"]) == 0
    with Client(ops.cluster.client_endpoint, timeout_s=10) as c:
        assert c.submit("tiny", b"x" * 16) is not None


# --- automatic replanning -----------------------------------------------------------------------

def test_auto_replan_under_skewed_load():
    """A daemon with a small drift threshold and minimum interval replans by itself when the mix
    skews, then again when it flips, never sooner than the minimum interval after the last one;
    every request is answered. Executors take 300 ms to load a partition and the daemon waits
    100 ms for preloading, so the stragglers' fallback (load at the switch) runs too."""
    from ppiped.commands.loadgen import run_load

    min_s = 1.5
    with short_tmpdir("ppiped-auto-") as tmp:
        d = Path(tmp)
        cfg, plan = _bench().write_example(
            d, load_ms=300, replan=f"auto = true\ndrift = 0.1\nmin_interval_s = {min_s}\newma_s = 0.3\n"
                                   "time_limit_s = 10\npreload_timeout_ms = 100\n")
        sock = str(d / "admin.sock")
        thr = {m.model: m.throughput_rps for m in plan.models}
        with LocalCluster(cfg, [[0, 2], [1, 3]]) as c:
            async def phases() -> list[dict]:
                a = await run_load(c.client_endpoint, {"tiny": 0.25 * thr["tiny"], "tiny2": 0.02 * thr["tiny2"]}, 3.0)
                b = await run_load(c.client_endpoint, {"tiny": 0.02 * thr["tiny"], "tiny2": 0.25 * thr["tiny2"]}, 3.0)
                return [a, b]

            reports = asyncio.run(phases())
            end = time.monotonic() + 60
            while True:  # the second replan may still be planning
                st = ctl.call(sock, {"cmd": "status"})
                autos = [h for h in st["replan"]["history"] if h["trigger"].startswith("drift")]
                # done: two auto replans, and every executor back (a straggler joins after the resume)
                if (len(autos) >= 2 and not st["replan"]["running"] and st["vgpus"]["alive"] == 4) \
                        or time.monotonic() > end:
                    break
                time.sleep(0.1)
    for r in reports:
        assert r["total"]["sent"] > 0 and r["total"]["no_reply"] == 0, r["total"]
    assert len(autos) >= 2, st["replan"]
    assert all(h["ok"] and not h["dry_run"] for h in autos), autos
    assert st["plan_version"] == 1 + len(autos)
    hist = st["replan"]["history"]
    for prev, nxt in zip(hist, hist[1:], strict=False):
        assert nxt["started_s"] - prev["ended_s"] >= min_s - 0.01, hist
    assert st["replan"]["min_interval_s"] == min_s
    assert any(h["stragglers"] >= 1 for h in autos), autos
    assert st["vgpus"]["alive"] == 4


# --- a plan with other models and more vGPUs than executors (runs last: it changes the models) ---

def test_replan_plan_file_changes_models_and_adds_vgpus(ops, capsys):
    import zmq

    from ppiped import wire
    from ppiped.client import Client
    from ppiped.cluster import GpuType
    from ppiped.executor import tiny
    from ppiped.plan import save_plan
    from ppiped.planner import plan_cluster
    from ppiped.profiles import profile_from_json

    # tiny2 goes, tiny3 comes (its profile is new to the daemon), and the cluster grows to 6 GPUs
    prof_dir = ops.dir / "profiles"
    (prof_dir / "tiny3.json").write_text(json.dumps(tiny.profile_json(model="tiny3", block_us=(1000.0, 1500.0))))
    profiles = {m: profile_from_json(json.loads((prof_dir / f"{m}.json").read_text()), m) for m in ("tiny", "tiny3")}
    cl = ops.plan.cluster
    bigger = type(cl)({"CPU": GpuType("CPU", 6, 1, (1,))}, cl.nic_gbps)
    plan = plan_cluster(profiles, ["tiny", "tiny3"], [1.0, 1.0], bigger, ops.plan.params, time_limit=20,
                        slos_us=[60_000.0, 60_000.0])
    nv = sum(q.num_vgpus for m in plan.models for p in m.pipelines for q in p.partitions)
    assert nv == 6
    save_plan(plan, ops.dir / "plan3.json")
    before = ctl.call(ops.sock, {"cmd": "status"})["plan_version"]
    rates = {"tiny": 50.0, "tiny2": 50.0}
    report, rp = asyncio.run(ops.bench.load_with_replan(
        ops.cluster, ops.sock, rates, 2.0, 0.5, None, extra={"plan_file": str(ops.dir / "plan3.json")}))
    t = report["total"]
    assert t["sent"] > 0 and t["no_reply"] == 0, t  # tiny2's queued requests too: dropped model-removed
    assert rp["ok"], rp
    assert rp["version"] == before + 1 and rp["vgpus"] == 6 and rp["vgpus_missing"] == "4-5"
    kept = json.loads((ops.dir / "state" / "plan-in-force.json").read_text())  # for the next start
    assert [m["model"] for m in kept["models"]] == ["tiny", "tiny3"]
    st = ctl.call(ops.sock, {"cmd": "status"})
    assert set(st["models"]) == {"tiny", "tiny3"}
    assert st["vgpus"]["total"] == 6 and st["vgpus"]["missing"] == "4-5" and st["vgpus"]["alive"] == 4
    assert ctl.main(["--socket", ops.sock, "status"]) == 0
    assert "missing" in capsys.readouterr().out
    assert ctl.main(["--socket", ops.sock, "executors"]) == 0
    assert sum("missing" in line for line in capsys.readouterr().out.splitlines()) == 2
    # a removed model: rejected unknown-model, and the message says what happened
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(ops.cluster.client_endpoint)
    no_model = ctl.call(ops.sock, {"cmd": "status"}).get("rejected_no_model", {}).get(wire.UNKNOWN_MODEL, 0)
    try:
        sock.send_multipart([wire.submit("tiny2", 0, [7, 8, 9]), *[b"x" * 16] * 3])
        assert sock.poll(10_000)
        h = wire.decode(sock.recv_multipart()[0])
    finally:
        sock.close(0)
    assert h.type == wire.T.REPLY and h.ids == [7, 8, 9] and h.status == wire.Status.REJECTED
    assert h.reason == wire.UNKNOWN_MODEL
    # counted per request where an operator looks (it was a per-message counter status never showed)
    assert ctl.call(ops.sock, {"cmd": "status"})["rejected_no_model"][wire.UNKNOWN_MODEL] == no_model + 3
    with urllib.request.urlopen(f"http://127.0.0.1:{ops.port}/metrics", timeout=10) as r:
        assert f'ppiped_rejects_total{{model="-",reason="unknown-model"}} {no_model + 3}' in r.read().decode()
    assert f"'tiny2' (it was removed by plan v{before + 1}" in h.meta and "tiny3" in h.meta, h.meta
    # the new vGPUs come into service when an executor registers for them
    ops.cluster.groups.append([4, 5])
    ops.cluster.executors.append(ops.cluster._start_executor(len(ops.cluster.groups) - 1))
    end = time.monotonic() + 60
    while ctl.call(ops.sock, {"cmd": "status"})["vgpus"]["alive"] < 6 and time.monotonic() < end:
        time.sleep(0.05)
    st = ctl.call(ops.sock, {"cmd": "status"})
    assert st["vgpus"] == {"total": 6, "alive": 6, "missing": ""}
    with Client(ops.cluster.client_endpoint, timeout_s=10) as c:
        assert c.submit("tiny3", b"x" * 16) is not None  # the added model is served
    # a plan with fewer vGPUs: the executor of vGPUs 4-5 waits on standby instead of exiting, and
    # comes back into service, preloaded, with a plan that has them again
    smaller = type(cl)({"CPU": GpuType("CPU", 4, 1, (1,))}, cl.nic_gbps)
    plan4 = plan_cluster(profiles, ["tiny", "tiny3"], [1.0, 1.0], smaller, ops.plan.params, time_limit=20,
                         slos_us=[60_000.0, 60_000.0])
    save_plan(plan4, ops.dir / "plan4.json")
    nv4 = sum(q.num_vgpus for m in plan4.models for p in m.pipelines for q in p.partitions)
    assert nv4 <= 4
    rp = ctl.call(ops.sock, {"cmd": "replan", "plan_file": str(ops.dir / "plan4.json"), "wait": True}, 60)
    assert rp["ok"] and rp["vgpus"] == nv4 and rp["vgpus_missing"] == "", rp
    st = ctl.call(ops.sock, {"cmd": "status"})
    assert st["vgpus"] == {"total": nv4, "alive": nv4, "missing": ""}
    # the replan answers once the plan's own vGPUs serve; the executor it left without any
    # re-registers on its own time (its health reads "loading" until then)
    end = time.monotonic() + 30
    while time.monotonic() < end:
        (standby,) = [e for e in ctl.call(ops.sock, {"cmd": "status"})["executors"] if e["vgpus"] == "4-5"]
        if standby["health"] != "loading":
            break
        time.sleep(0.05)
    assert standby["health"] == "standby" and standby["standby"] == "4-5" and standby["assignments"] == []
    time.sleep(0.5)
    assert ops.cluster.executors[-1].poll() is None  # still running, not refused
    rp = ctl.call(ops.sock, {"cmd": "replan", "plan_file": str(ops.dir / "plan3.json"), "wait": True}, 60)
    assert rp["ok"] and rp["preload"] == "all", rp
    end = time.monotonic() + 30
    while ctl.call(ops.sock, {"cmd": "status"})["vgpus"]["alive"] < 6 and time.monotonic() < end:
        time.sleep(0.05)
    assert ctl.call(ops.sock, {"cmd": "status"})["vgpus"] == {"total": 6, "alive": 6, "missing": ""}
    with Client(ops.cluster.client_endpoint, timeout_s=10) as c:
        assert all(c.submit("tiny3", b"x" * 16) is not None for _ in range(20))


def test_switch_moves_kept_models_and_drops_removed_ones():
    """replan.switch with stand-ins: queued requests of a removed model are answered model-removed,
    the others move to the new core under the new plan's model index."""
    from ppiped import wire
    from ppiped.daemon.replan import switch

    calls = []
    old = SimpleNamespace(cancel=lambda rid, m: calls.append(("cancel", rid, m)))
    new = SimpleNamespace(layout=SimpleNamespace(models=["c", "a"]),
                          submit=lambda rid, m, a, d, priority: calls.append(("submit", rid, m, priority)))
    reqs = {1: SimpleNamespace(model=0, arrival=1, deadline=2, prio=1),
            2: SimpleNamespace(model=1, arrival=1, deadline=2, prio=0),
            3: SimpleNamespace(model=0, arrival=1, deadline=2, prio=0)}
    dropped = []
    srv = SimpleNamespace(core=old, model_names=["a", "b"], reqs=dict(reqs), batches={1: None},
                          _drop_reqs=lambda rs, why: dropped.append(([r.model for r in rs], why)),
                          install_plan=lambda plan, core: calls.append(("install",)), plan_version=2, execs={},
                          _send_peers=lambda: calls.append(("peers",)))
    moved, removed = switch(srv, None, new)
    assert (moved, removed) == (2, 1)
    assert dropped == [([1], wire.MODEL_REMOVED)]  # counted under the old index of "b"
    # (a high-class request stays high in the new core)
    assert ("submit", 1, 1, 1) in calls and ("submit", 3, 1, 0) in calls and calls[-2:] == [("install",), ("peers",)]
    assert srv.reqs[1].model == 1 and 2 not in srv.reqs and srv.batches == {}


# --- permission denied, for real: ppiped-ctl as an unprivileged user -------------------------------

NOBODY = 65534


def _as_user(uid: int, gid: int):
    def drop() -> None:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)
    return drop


def _unprivileged_python() -> str:
    """An interpreter that uid 65534 can run ``ppiped.ctl`` with (the venv may live under a home
    directory it cannot enter); skips unless this runs as root and one exists."""
    if os.geteuid() != 0:
        pytest.skip("needs root to run ppiped-ctl as another user")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    for exe in dict.fromkeys([sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"]):
        try:
            p = subprocess.run([exe, "-c", "import ppiped.ctl"], env=env, cwd="/", capture_output=True,
                               timeout=60, preexec_fn=_as_user(NOBODY, NOBODY))
        except (OSError, subprocess.SubprocessError):
            continue
        if p.returncode == 0:
            return exe
    pytest.skip(f"no python that uid {NOBODY} may run with {ROOT} importable")


def test_ctl_permission_denied_and_group_access_as_unprivileged_user():
    """A root-owned 0660 socket refuses uid 65534 (exit 4, a clear message); with ctl.group set to
    its group, the socket takes that group and the same user gets in."""
    import grp

    from ppiped.daemon.ctl_server import CtlServer
    from ppiped.executor import tiny
    from ppiped.plan import plan_from_json

    exe = _unprivileged_python()
    try:
        group = grp.getgrgid(NOBODY).gr_name
    except KeyError:
        group = ""
    srv = SimpleNamespace(cfg=SimpleNamespace(source="ppiped.toml"), plan_version=1,
                          plan=plan_from_json(tiny.plan_json(tiny.profile_json()), "tiny-plan"))
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}

    async def ctl_as_nobody(path: str) -> tuple[int, str, str]:
        p = await asyncio.create_subprocess_exec(exe, "-m", "ppiped.ctl", "--socket", path, "plan", env=env,
                                                 cwd="/", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                                 preexec_fn=_as_user(NOBODY, NOBODY))
        out, err = await asyncio.wait_for(p.communicate(), 60)
        return p.returncode, out.decode(), err.decode()

    async def go(d: str) -> None:
        path = os.path.join(d, "ctl.sock")
        cs = CtlServer(srv, path, 0o660)
        await cs.start()
        try:
            st = os.stat(path)
            assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o660) and st.st_gid != NOBODY
            rc, out, err = await ctl_as_nobody(path)
            assert rc == 4, (rc, out, err)
            assert f"permission denied on {path}" in err and "group" in err, err
        finally:
            await cs.close()
        if not group:
            return
        cs = CtlServer(srv, path, 0o660, group)
        await cs.start()
        try:
            assert os.stat(path).st_gid == NOBODY
            rc, out, err = await ctl_as_nobody(path)
            assert rc == 0 and "plan v1" in out, (rc, out, err)
        finally:
            await cs.close()

    with short_tmpdir("ppiped-perm-") as d:
        os.chmod(d, 0o755)  # the directory must not be what refuses: the socket's mode is under test
        asyncio.run(go(d))


def test_a_replanned_plan_outlives_a_restart_until_the_config_plan_changes(tmp_path):
    """The plan a switch saved in the state directory is what the next start serves, while the
    config's plan file is the one it was replanned from; edited, the config's plan wins."""
    from ppiped.commands.serve import load_serving
    from ppiped.daemon.state import save_plan_in_force
    from ppiped.executor import tiny
    from ppiped.plan import plan_from_json, save_plan

    plan_path, profiles = tiny.write_example(tmp_path)
    cfg = config_from_dict({"plan": str(plan_path), "profiles": str(profiles), "state_dir": str(tmp_path / "st")},
                           tmp_path / "ppiped.toml")
    started, _ = load_serving(cfg)
    replanned = plan_from_json({**started.to_json(), "algo": "replanned"}, "replanned")
    assert save_plan_in_force(cfg, replanned, 2) == tmp_path / "st" / "plan-in-force.json"
    meta: dict = {}
    resumed, _ = load_serving(cfg, None, meta)
    assert resumed.algo == "replanned" and meta["version"] == 2  # `ppiped serve` numbers it v2, not v1
    save_plan(started, plan_path)  # the operator rewrites the config's plan: it is served
    plan_path.write_text(plan_path.read_text() + "\n")
    assert load_serving(cfg)[0].algo == started.algo
    assert load_serving(cfg, str(plan_path))[0].algo == started.algo  # --plan always wins


def test_ctl_names_a_request_line_that_is_not_utf8(ops):
    import socket as so

    with so.socket(so.AF_UNIX) as s:
        s.connect(ops.sock)
        s.settimeout(10)
        s.sendall(b"\xff\xfe\n")
        out = json.loads(s.makefile("rb").readline())
    assert not out["ok"] and out["error"] == "the request line is not UTF-8"
