"""The systemd units verify cleanly (where systemd-analyze exists), with the install prefix rendered."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
UNITS = sorted((ROOT / "systemd").iterdir())
VENV = Path(sys.executable).parent.parent

pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")


def render(tmp: Path, extra: str = "") -> list[Path]:
    """Point the units at this checkout's venv; MPS's binary is absent off GPU hosts."""
    out = []
    for u in UNITS:
        text = u.read_text().replace("/opt/ppiped/.venv", str(VENV))
        if not Path("/usr/bin/nvidia-cuda-mps-control").exists():
            text = text.replace("/usr/bin/nvidia-cuda-mps-control", "/bin/true")
        name = u.name.replace("@.service", "@0.service")
        (tmp / name).write_text(text + extra)
        out.append(tmp / name)
    return out


def verify(paths: list[Path]) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", *map(str, paths)], capture_output=True,
                          text=True, timeout=60)


def test_units_verify_cleanly(tmp_path):
    names = {u.name for u in UNITS}
    assert {"ppiped.service", "ppiped-executor@.service", "ppiped.target", "nvidia-mps.service"} <= names
    r = verify(render(tmp_path))
    problems = [ln for ln in r.stderr.splitlines() if str(tmp_path) in ln or "is not executable" in ln]
    assert r.returncode == 0 and not problems, r.stderr


def test_verify_catches_a_broken_unit(tmp_path):
    paths = render(tmp_path, extra="\n[Service]\nTypo=1\n")
    r = verify(paths)
    assert "Unknown key" in r.stderr


def test_scheduler_unit_hardening():
    text = (ROOT / "systemd" / "ppiped.service").read_text()
    for line in ("Type=notify", "WatchdogSec=", "Restart=on-failure", "NoNewPrivileges=yes",
                 "ProtectSystem=strict", "ProtectHome=yes", "StateDirectory=ppiped", "RuntimeDirectory=ppiped"):
        assert line in text


def test_executors_can_bind_the_documented_ipc_data_endpoint():
    """The example config puts ipc:// data sockets in /run/ppiped: under ProtectSystem=strict the
    executor unit may write there only as its RuntimeDirectory, and neither unit's restart may
    delete the sockets (it could not bind them; a scheduler restart would have removed them)."""
    assert "ipc:///run/ppiped/" in (ROOT / "plans" / "ppiped.toml").read_text()
    for unit in ("ppiped.service", "ppiped-executor@.service"):
        text = (ROOT / "systemd" / unit).read_text()
        assert "RuntimeDirectory=ppiped\n" in text and "RuntimeDirectoryPreserve=yes" in text, unit


def test_readme_install_enables_the_target_and_every_example_vgpu():
    """Enabling the services only links them into ppiped.target; without enabling the target
    nothing started at boot. The example plan has 16 vGPUs; the install started 4."""
    readme = (ROOT / "README.md").read_text()
    install = readme[readme.index("## Install as services"):]
    install = install[:install.index("```\n", install.index("```sh") + 5)]
    assert "systemctl enable ppiped.target" in install
    import json

    plan = json.loads((ROOT / "plans" / "example" / "plan.json").read_text())
    n = sum(q["num_vgpus"] for m in plan["models"] for p in m["pipelines"] for q in p["partitions"])
    assert f"seq 0 {n - 1}" in install
