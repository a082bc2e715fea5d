"""Planning in a child process, so the daemon's event loop never waits on CBC.

``python -m ppiped.planner.solve`` reads one JSON request on stdin and writes one JSON reply on
stdout: ``{"ok": true, "plan": <ppiped-plan/1>}`` or ``{"ok": false, "error": ..., "kind":
"input" | "internal"}``. :func:`plan_in_subprocess` and :func:`plan_async` wrap it; both kill the
child when the wall-clock limit passes (the solver's own limit plus a grace for start-up).
"""

from __future__ import annotations

import asyncio
import json
import logging
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from ..cluster import Cluster, cluster_from_json
from ..errors import InputError, UserError
from ..plan import Plan, PlanParams, plan_from_json
from ..profiles import Profile, profile_from_json

log = logging.getLogger(__name__)

# Seconds a child may run beyond the planner's time limit (interpreter start, imports,
# enumeration, writing the reply) before it is killed.
GRACE_S = 30.0


class PlannerTimeout(RuntimeError):
    """The planning child outlived its wall-clock limit and was killed."""


class PlannerFailed(RuntimeError):
    """The planning child crashed or answered nonsense."""


def make_request(
    profiles: Mapping[str, Profile],
    models: Sequence[str],
    weights: Sequence[float],
    cluster: Cluster,
    params: PlanParams | None = None,
    algo: str = "ppipe",
    time_limit: float = 60.0,
    batch_delay_rates: Sequence[float] | None = None,
    threads: int = 1,
    slos_us: Sequence[float] | None = None,
    mip_gap: float = 1e-6,
) -> dict[str, Any]:
    """The JSON request for one planning run; the arguments are those of ``plan_cluster``."""
    missing = [m for m in models if m not in profiles]
    if missing:
        raise InputError(f"no profile for model(s) {', '.join(missing)}")
    return {
        "profiles": {m: profiles[m].to_json() for m in models},
        "models": list(models),
        "weights": [float(w) for w in weights],
        "cluster": cluster.to_json(),
        "params": asdict(params or PlanParams()),
        "algo": algo,
        "time_limit": float(time_limit),
        "batch_delay_rates": None if batch_delay_rates is None else [float(r) for r in batch_delay_rates],
        "threads": int(threads),
        "slos_us": None if slos_us is None else [float(s) for s in slos_us],
        "mip_gap": float(mip_gap),
    }


def run_request(req: Mapping[str, Any]) -> Plan:
    """Plan what a request asks for, in this process."""
    from .api import plan_cluster

    profiles = {m: profile_from_json(p, f"request profile {m}") for m, p in req["profiles"].items()}
    return plan_cluster(
        profiles, req["models"], req["weights"], cluster_from_json(req["cluster"], "request cluster"),
        PlanParams(**req["params"]), req["algo"], req["time_limit"], req.get("batch_delay_rates"),
        req.get("threads", 1), req.get("slos_us"), req.get("mip_gap", 1e-6),
    )


def _reply_to_plan(out: bytes, err: bytes, rc: int | None) -> Plan:
    try:
        reply = json.loads(out.decode() or "null")
    except (json.JSONDecodeError, UnicodeDecodeError):
        reply = None
    if not isinstance(reply, dict):
        tail = err.decode(errors="replace").strip().splitlines()[-5:]
        raise PlannerFailed(f"planner child exited {rc} without a reply: {' | '.join(tail)}")
    if not reply.get("ok"):
        if reply.get("kind") == "input":
            raise InputError(reply.get("error", "bad planner input"))
        raise PlannerFailed(reply.get("error", "planner child failed"))
    return plan_from_json(reply["plan"], "planner child")


def _wall_limit(req: Mapping[str, Any], wall_limit_s: float | None) -> float:
    return wall_limit_s if wall_limit_s is not None else float(req["time_limit"]) + GRACE_S


def _child_cmd() -> list[str]:
    return [sys.executable, "-m", "ppiped.planner.solve"]


def plan_in_subprocess(req: Mapping[str, Any], wall_limit_s: float | None = None) -> Plan:
    """Run ``req`` (see :func:`make_request`) in a child process; blocks the calling thread."""
    limit = _wall_limit(req, wall_limit_s)
    try:
        p = subprocess.run(_child_cmd(), input=json.dumps(req).encode(), capture_output=True,
                           timeout=limit, check=False)
    except subprocess.TimeoutExpired:
        raise PlannerTimeout(f"planner child killed after {limit:.0f} s") from None
    return _reply_to_plan(p.stdout, p.stderr, p.returncode)


async def plan_async(req: Mapping[str, Any], wall_limit_s: float | None = None) -> Plan:
    """Run ``req`` in a child process without blocking the event loop; cancelling kills it."""
    limit = _wall_limit(req, wall_limit_s)
    proc = await asyncio.create_subprocess_exec(
        *_child_cmd(), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    try:
        out, err = await asyncio.wait_for(proc.communicate(json.dumps(req).encode()), limit)
    except asyncio.TimeoutError:
        proc.kill()
        await proc.wait()
        raise PlannerTimeout(f"planner child killed after {limit:.0f} s") from None
    except asyncio.CancelledError:
        proc.kill()
        await proc.wait()
        raise
    return _reply_to_plan(out, err, proc.returncode)


def main() -> int:
    """Child entry: request on stdin, reply on stdout, logs on stderr."""
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        req = json.loads(sys.stdin.read())
        plan = run_request(req)
        reply: dict[str, Any] = {"ok": True, "plan": plan.to_json()}
        rc = 0
    except (InputError, *UserError) as e:
        reply, rc = {"ok": False, "kind": "input", "error": str(e)}, 2
    except Exception as e:  # noqa: BLE001 - the parent needs the message, not a traceback
        log.exception("planner child failed")
        reply, rc = {"ok": False, "kind": "internal", "error": f"{type(e).__name__}: {e}"}, 1
    sys.stdout.write(json.dumps(reply) + "\n")
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main())
