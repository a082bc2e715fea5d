"""Shared fixtures: the public PPipe data beside the project, skipped cleanly where absent, and
what a GPU test needs to know about this host."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "ppipe"
MODELS_DIR = SHARED / "models"
REFERENCE_DIR = SHARED / "reference-plans" / "maf21"
ROOT = Path(__file__).resolve().parents[1]


class _HandlerFailures(logging.Handler):
    """Records the event loop's ``handler-failed`` errors (see ``Reader._failed``)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage() == "handler-failed":
            self.seen.append(getattr(record, "fields", {}))


@pytest.fixture(autouse=True)
def _no_socket_handler_raised(request):
    """Every test fails if a socket handler of this process raised: the reader survives such a
    bug (it loses the one message), so nothing else would show it. Subprocesses log it with its
    traceback, which the tests that read their logs refuse."""
    h = _HandlerFailures()
    lg = logging.getLogger("ppiped.loop")
    lg.addHandler(h)
    try:
        yield
    finally:
        lg.removeHandler(h)
    if h.seen and request.node.get_closest_marker("handler_failures") is None:
        pytest.fail(f"a socket handler raised: {h.seen[0].get('error')} at {h.seen[0].get('at')}")


def run_cli(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    """``python -m ARGV`` as a user runs it; a hang shows as ``TimeoutExpired``, a failed test."""
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def assert_refused(p: subprocess.CompletedProcess[str], fragment: str, rc: int = 2, prefix: str = "") -> None:
    """Refused with ``rc``, the reason (``fragment``, after ``prefix``) in the last line of
    stderr, and no traceback."""
    assert p.returncode == rc, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith(prefix), last
    assert fragment in last, last


def cuda_torch() -> bool:
    """PyTorch is installed and sees a CUDA GPU."""
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return bool(torch.cuda.is_available())


def reference_plans(algo: str | None = None) -> list[Path]:
    if not REFERENCE_DIR.is_dir():
        return []
    pat = f"*_{algo}.json" if algo else "*.json"
    return sorted(REFERENCE_DIR.glob(pat))


def other_plan_set(folder: Path) -> tuple[str, str]:
    """A plan set unlike maf21, built in ``folder`` from a shared L4-T4 group: the group's ``_v4``
    file alone (no ``_bl`` or ``_dart-r`` beside it), and a single-model ``_v4`` file (no weights
    in its name) made of the group's first model. Returns the two stems."""
    import json

    (v4,) = [p for p in reference_plans("v4") if "colorization" in p.name and "_1.0-1.0-1.0_L4-T4_" in p.name]
    folder.mkdir(parents=True, exist_ok=True)
    (folder / v4.name).write_text(v4.read_text())
    entry = json.loads(v4.read_text())[0]
    single = f"{entry['config']['dnn_name']}_{v4.name.split('_1.0-1.0-1.0_')[1]}"
    (folder / single).write_text(json.dumps([entry]))
    return v4.name[: -len("_v4.json")], single[: -len("_v4.json")]


@pytest.fixture(scope="session")
def shared_profiles():
    if not MODELS_DIR.is_dir():
        pytest.skip("../shared/data/ppipe is not present")
    from ppiped.profiles import load_profiles

    return load_profiles(MODELS_DIR)


@pytest.fixture
def reference_plan_path():
    plans = reference_plans("v4")
    if not plans:
        pytest.skip("../shared/data/ppipe is not present")
    return plans[0]


@contextlib.contextmanager
def tiny_cluster(d: Path, groups):
    """The tiny two-pool example served by emulated executors in ``d``, frames of any size, a
    generous wait guard (these tests check answers, not batching); stopped on exit."""
    from ppiped.daemon.launch import LocalCluster, write_config
    from ppiped.executor import tiny

    plan, profiles = tiny.write_example(d)
    cfg = write_config(d, plan, profiles, heartbeat_ms=50, timeout_ms=1000,
                       scheduler={"wait_guard_us": 25_000}, extra="[models.tiny]\ninput_bytes = 0\n")
    with LocalCluster(cfg, groups, log_level="info") as c:
        yield c
