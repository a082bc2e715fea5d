"""Bad inputs to the operator tools: ``ppiped-executor``, ``ppiped-ctl`` and ``ppiped keys``.

Each ends in one line naming the flag (or path) and a non-zero exit, never a traceback; and
none of them may damage what is already running or deployed: a second executor for a vGPU must
not steal the first's ipc data socket, a second ``ppiped keys`` must not replace deployed keys.
Every CLI runs in a subprocess with a timeout, as a user runs it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import assert_refused, run_cli

ROOT = Path(__file__).resolve().parents[1]


def refused(p: subprocess.CompletedProcess[str], fragment: str, rc: int = 2) -> None:
    assert_refused(p, fragment, rc)


def executor_config(tmp: Path) -> Path:
    """An emulated executor's config; no scheduler runs, so an executor waits, retrying REGISTER."""
    cfg = tmp / "ppiped.toml"
    cfg.write_text(f"""
plan = "plan.json"
[endpoints]
executor = "ipc://{tmp}/sched.sock"
[executor]
backend = "emulate"
data_endpoint = "ipc://{tmp}/vgpu-{{vgpu}}.sock"
""")
    return cfg


# --- ppiped-executor ----------------------------------------------------------------------------

EXECUTOR_CASES = {
    "vgpu-overflow": (["--vgpu", "99999999999999999999999"], "--vgpu: vGPU id 99999999999999999999999"),
    "vgpu-over-plan-limit": (["--vgpu", "1000000"], "below 1,000,000"),
    "vgpu-range-too-wide": (["--vgpu", "0-100000"], "more than 4,096 vGPUs"),
    "vgpu-huge-range": (["--vgpu", "0-100000000000000"], "--vgpu: vGPU id 100000000000000"),
    "log-level-bogus": (["--vgpu", "0", "--log-level", "bogus"], "argument --log-level"),
    # in-process only: the executor said ready and every batch sent to it was lost
    "data-endpoint-inproc": (["--vgpu", "0", "--data-endpoint", "inproc://x"], "not 'inproc://x'"),
}


@pytest.mark.parametrize("extra,fragment", EXECUTOR_CASES.values(), ids=EXECUTOR_CASES.keys())
def test_executor_refuses_bad_flags(tmp_path, extra, fragment):
    cfg = executor_config(tmp_path)
    refused(run_cli(["ppiped.executor.main", "--config", str(cfg), *extra], timeout=30), fragment)
    assert not list(tmp_path.glob("*.sock")), "a refused executor left a socket file"


def test_executor_will_not_listen_off_host_without_curve(tmp_path):
    """--data-endpoint on all interfaces with remote endpoints allowed but CURVE off: it bound
    the port before the scheduler could refuse it."""
    cfg = executor_config(tmp_path)
    cfg.write_text(cfg.read_text().replace("[endpoints]\n", "[endpoints]\nallow_remote = true\n"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = run_cli(["ppiped.executor.main", "--config", str(cfg), "--vgpu", "1", "--data-endpoint",
                 f"tcp://0.0.0.0:{port}"], timeout=30)
    refused(p, "leaves this host, so security.curve must be true")


def test_one_executor_process_refuses_vgpus_configured_apart(tmp_path):
    """[executors.1] named another backend and data endpoint than vGPU 0; one process serving
    both registered vGPU 0's for both and ran vGPU 1 unlike what status said."""
    cfg = executor_config(tmp_path)
    cfg.write_text(cfg.read_text() + f'[executors.1]\ndata_endpoint = "ipc://{tmp_path}/special1.sock"\n')
    p = run_cli(["ppiped.executor.main", "--config", str(cfg), "--vgpu", "0,1"], timeout=30)
    refused(p, "executors.1.data_endpoint is")
    assert "start vGPU 1 in a process of its own" in p.stderr


def test_executor_on_a_taken_tcp_port_says_so_in_one_line(tmp_path):
    cfg = executor_config(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        ep = f"tcp://127.0.0.1:{s.getsockname()[1]}"
        p = run_cli(["ppiped.executor.main", "--config", str(cfg), "--vgpu", "1", "--data-endpoint", ep],
                    timeout=30)
    refused(p, f"ppiped-executor: error: cannot bind the data endpoint {ep}")


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    t = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < t, f"{path} never appeared"
        time.sleep(0.05)


def _accepts(path: Path) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        try:
            s.connect(str(path))
        except OSError:
            return False
    return True


def test_second_executor_for_a_vgpu_leaves_the_first_its_ipc_socket(tmp_path):
    cfg = executor_config(tmp_path)
    sock = tmp_path / "vgpu-13.sock"
    argv = [sys.executable, "-m", "ppiped.executor.main", "--config", str(cfg), "--vgpu", "13"]
    first = subprocess.Popen(argv, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(sock, first)
        second = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=30)
        assert second.returncode != 0, second.stderr[-2000:]
        assert "Traceback" not in second.stderr
        assert str(sock) in second.stderr and "another executor" in second.stderr, second.stderr[-2000:]
        assert first.poll() is None
        assert _accepts(sock), "the first executor's data socket was taken over"
        first.terminate()
        assert first.wait(timeout=20) == 0
        assert not sock.exists(), "a cleanly stopped executor left its socket file"
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=10)


def test_a_stale_ipc_socket_file_is_reused(tmp_path):
    cfg = executor_config(tmp_path)
    sock = tmp_path / "vgpu-2.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(sock))  # bound, never listening: what a killed process leaves
    p = subprocess.Popen([sys.executable, "-m", "ppiped.executor.main", "--config", str(cfg), "--vgpu", "2"],
                         cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        t = time.monotonic() + 30
        while not _accepts(sock):
            assert p.poll() is None, p.stderr.read()
            assert time.monotonic() < t
            time.sleep(0.05)
        p.send_signal(2)  # SIGINT, as Ctrl-C
        assert p.wait(timeout=20) == 0
        assert not sock.exists()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


# --- ppiped-ctl ---------------------------------------------------------------------------------

CTL_CASES = {
    "timeout-inf": (["--timeout", "inf", "status"], "argument --timeout"),
    "timeout-nan": (["--timeout", "nan", "status"], "argument --timeout"),
    "timeout-negative": (["--timeout", "-1", "status"], "argument --timeout"),
    "wait-s-inf": (["drain", "--wait-s", "inf"], "argument --wait-s"),
    "wait-s-nan": (["drain", "--wait-s", "nan"], "argument --wait-s"),
    "wait-s-negative": (["drain", "--wait-s", "-5"], "argument --wait-s"),
    "weights-negative": (["replan", "--weights", "a=-1"], "model 'a'"),
    "weights-nan": (["replan", "--weights", "a=nan"], "model 'a' must be a finite number > 0, got 'nan'"),
    "weights-zero": (["replan", "--weights", "a=0"], "model 'a' must be a finite number > 0, got '0'"),
    "weights-inf": (["replan", "--weights", "a=inf"], "model 'a' must be a finite number > 0, got 'inf'"),
    "weights-empty-value": (["replan", "--weights", "a="], "model 'a'"),
    "weights-no-name": (["replan", "--weights", "=1"], "'=1' has no model name"),
    "weights-twice": (["replan", "--weights", "a=1,a=2"], "model 'a' is given twice"),
    "weights-twice-repeated-flag": (["replan", "--weights", "a=1", "--weights", "a=2"], "model 'a' is given twice"),
    "weights-and-plan-file": (["replan", "--weights", "a=1", "--plan-file", "p.json"], "--weights or --plan-file"),
}


@pytest.mark.parametrize("argv,fragment", CTL_CASES.values(), ids=CTL_CASES.keys())
def test_ctl_refuses_bad_flags(tmp_path, argv, fragment):
    # no daemon listens on this socket: each refusal must come before any connect (exit 3)
    refused(run_cli(["ppiped.ctl", "--socket", str(tmp_path / "ctl.sock"), *argv], timeout=30), fragment)


def test_ctl_refuses_an_empty_socket_path():
    refused(run_cli(["ppiped.ctl", "--socket", "", "status"], timeout=30), "argument --socket")


@pytest.mark.parametrize("kind", ["directory", "file"])
def test_ctl_says_a_non_socket_is_not_a_socket(tmp_path, kind):
    p = tmp_path / "x"
    p.mkdir() if kind == "directory" else p.write_text("")
    r = run_cli(["ppiped.ctl", "--socket", str(p), "status"], timeout=30)
    refused(r, f"{p} is a {'directory' if kind == 'directory' else 'regular file'}, not a socket")
    assert "stale" not in r.stderr


# --- ppiped keys --------------------------------------------------------------------------------

KEYS_CASES = {
    "client-twice": (["--client", "c1", "--client", "c1"], "--client: 'c1' is given twice"),
    "admin-twice": (["--admin", "a", "--admin", "a"], "--admin: 'a' is given twice"),
    "executor-twice": (["--executor", "n=0-3", "--executor", "n=4-7"], "--executor: 'n' is given twice"),
    "client-path": (["--client", "../x"], "bad name '../x'"),
    "client-slash": (["--client", "a/b"], "bad name 'a/b'"),
    "client-empty": (["--client", ""], "bad name ''"),
    "client-dot": (["--client", "."], "bad name '.'"),
    "admin-dotdot": (["--admin", ".."], "bad name '..'"),
    "client-quote": (["--client", 'a"b'], "bad name"),
    "executor-path": (["--executor", "../n=0"], "bad name '../n'"),
    "executor-overlap": (["--executor", "a=0-3", "--executor", "b=3-7"], "vGPU 3 is in both 'a' and 'b'"),
    "executor-bad-range": (["--executor", "n=3-1"], "--executor n: bad range '3-1'"),
    "executor-not-ids": (["--executor", "n=x"], "--executor n: expected IDs"),
    "executor-twice-in-spec": (["--executor", "n=1,1"], "given twice"),
    "executor-huge-id": (["--executor", "n=0-99999999999999999"], "--executor n: vGPU id 99999999999999999"),
}


@pytest.mark.parametrize("argv,fragment", KEYS_CASES.values(), ids=KEYS_CASES.keys())
def test_keys_refuses_bad_names_and_vgpus_writing_nothing(tmp_path, argv, fragment):
    d = tmp_path / "keys"
    refused(run_cli(["ppiped.cli", "keys", "--dir", str(d), "--server", *argv], timeout=30), fragment)
    assert not d.exists(), "a refused run wrote keys"
    assert not os.listdir(tmp_path)


def test_keys_dir_that_is_a_file(tmp_path):
    f = tmp_path / "f"
    f.write_text("x")
    refused(run_cli(["ppiped.cli", "keys", "--dir", str(f), "--client", "c"], timeout=30), "not a directory")
    refused(run_cli(["ppiped.cli", "keys", "--dir", str(f / "sub"), "--client", "c"], timeout=30),
            "not a directory")
    assert f.read_text() == "x"


def test_keys_never_replace_deployed_keys_without_force(tmp_path):
    d = tmp_path / "keys"
    argv = ["ppiped.cli", "keys", "--dir", str(d), "--server", "--executor", "n1=0-3", "--client", "c1"]
    assert run_cli(argv, timeout=30).returncode == 0
    files = sorted(p for p in d.rglob("*") if p.is_file())
    before = {p: p.read_bytes() for p in files}
    assert len(files) == 6
    again = run_cli(["ppiped.cli", "keys", "--dir", str(d), "--server"], timeout=30)
    refused(again, "--force")
    assert "server.key" in again.stderr
    # a new name next to an existing one: refused as a whole, nothing written
    refused(run_cli(["ppiped.cli", "keys", "--dir", str(d), "--client", "c2", "--client", "c1"], timeout=30),
            "exist already")
    assert not (d / "clients" / "c2.key").exists()
    assert {p: p.read_bytes() for p in sorted(p for p in d.rglob("*") if p.is_file())} == before
    forced = run_cli(["ppiped.cli", "keys", "--dir", str(d), "--server", "--force"], timeout=30)
    assert forced.returncode == 0, forced.stderr
    assert (d / "server.key_secret").read_bytes() != before[d / "server.key_secret"]
    assert (d / "clients" / "c1.key_secret").read_bytes() == before[d / "clients" / "c1.key_secret"]
