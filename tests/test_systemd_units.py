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
