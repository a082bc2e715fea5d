"""The plan in force across restarts.

A replan (``ppiped-ctl replan``, or an automatic one) changes the plan the daemon serves, but the
config still names the plan it started with; a restart (``Restart=on-failure``, a reboot) would
quietly go back to it. So each switch writes the plan in force to the state directory
(``state_dir`` in the config, else systemd's ``$STATE_DIRECTORY``, ``/var/lib/ppiped`` for
``ppiped.service``), with the SHA-256 of the config's plan file at that time. At start the daemon
serves the saved plan while the config's plan file is still the one it was replanned from; once
the operator points the config at another plan (or edits it), that plan wins.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from .. import logs
from ..cluster import Cluster
from ..errors import InputError
from ..plan import Plan, load_plan
from .config import ServeConfig

log = logs.get("ppiped.state")

PLAN_FILE = "plan-in-force.json"
META_FILE = "plan-in-force.meta.json"


def state_dir(cfg: ServeConfig) -> Path | None:
    """Where the plan in force is kept: the config's ``state_dir``, else ``$STATE_DIRECTORY``
    (systemd's; the first of a colon-separated list), else nowhere."""
    if cfg.state_dir is not None:
        return cfg.state_dir
    env = os.environ.get("STATE_DIRECTORY", "").split(":")[0]
    return Path(env) if env else None


def _sha256(path: Path | None) -> str:
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest() if path is not None else ""
    except OSError:
        return ""


def save_plan_in_force(cfg: ServeConfig, plan: Plan, version: int) -> Path | None:
    """Keep ``plan`` (now in force, as ``version``) for the next start; None when there is no
    state directory. Written beside and renamed over, so a crash never leaves half a file."""
    d = state_dir(cfg)
    if d is None:
        return None
    d.mkdir(parents=True, exist_ok=True)
    meta = {"version": version, "config": str(cfg.source), "config_plan": str(cfg.plan),
            "config_plan_sha256": _sha256(cfg.plan), "source": plan.source}
    for name, body in ((PLAN_FILE, plan.to_json()), (META_FILE, meta)):
        tmp = d / f".{name}.tmp"
        tmp.write_text(json.dumps(body, indent=1) + "\n")
        os.replace(tmp, d / name)
    return d / PLAN_FILE


def resume_plan(cfg: ServeConfig, cluster: Cluster | None) -> tuple[Plan, dict[str, Any]] | None:
    """The plan saved by the last switch, if the config's plan file is still the one it was
    replanned from (and the saved plan reads); else None, with the reason logged."""
    d = state_dir(cfg)
    if d is None or not (d / PLAN_FILE).is_file():
        return None
    try:
        meta = json.loads((d / META_FILE).read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except (OSError, ValueError) as e:
        log.warning("state-plan-ignored", dir=str(d), reason=f"{META_FILE}: {e}")
        return None
    if meta.get("config_plan") != str(cfg.plan) or meta.get("config_plan_sha256") != _sha256(cfg.plan):
        log.info("state-plan-ignored", dir=str(d), reason="the config's plan changed since the last replan")
        return None
    try:
        plan = load_plan(d / PLAN_FILE, cluster)
    except InputError as e:
        log.warning("state-plan-ignored", dir=str(d), reason=str(e))
        return None
    return plan, meta
