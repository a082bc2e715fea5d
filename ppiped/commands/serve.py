"""``ppiped serve --config ppiped.toml``: run the scheduler daemon in the foreground."""

from __future__ import annotations

import argparse

from .. import logs
from ..daemon.config import ConfigError, ServeConfig, load_config
from ..daemon.state import resume_plan
from ..errors import InputError
from ..plan import Plan, load_plan
from ..profiles import Profile, load_profiles


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="run the scheduler daemon (clients, executors, ctl) from a serving config")
    p.add_argument("--config", required=True, help="serving config TOML (see plans/ppiped.toml)")
    p.add_argument("--plan", help="override the config's plan")
    p.add_argument("--log-level", default="info")
    p.set_defaults(func=run)


def load_serving(cfg: ServeConfig, plan_path: str | None = None,
                 resumed_meta: dict | None = None) -> tuple[Plan, dict[str, Profile]]:
    """The plan in force and the profiles of its models, as the config names them (a plan the
    last replan saved, if the config's plan is unchanged: its record goes to ``resumed_meta``)."""
    from ..cluster import load_cluster

    path = plan_path or cfg.plan
    if path is None:
        raise ConfigError(f"{cfg.source}: plan: missing (the plan file to serve)")
    if cfg.profiles is None:
        raise ConfigError(f"{cfg.source}: profiles: missing (the directory of the plan's model profiles)")
    cluster = load_cluster(cfg.cluster) if cfg.cluster else None
    resumed = resume_plan(cfg, cluster) if plan_path is None else None
    if resumed is not None:
        plan, meta = resumed
        if resumed_meta is not None:
            resumed_meta.update(meta)
        logs.get("ppiped.serve").info("plan-resumed", plan=plan.source, version=meta.get("version"),
                                      config_plan=str(cfg.plan))
    else:
        try:
            plan = load_plan(path, cluster)
        except InputError as e:
            if plan_path is not None:
                raise
            raise ConfigError(f"{cfg.source}: plan: {e}") from None
    profiles = load_profiles(cfg.profiles, [m.model for m in plan.models])
    return plan, profiles


def run(args: argparse.Namespace) -> int:
    import uvloop

    from ..daemon.server import Server
    from ..plan import refuse_for_serving

    logs.setup(args.log_level)
    log = logs.get("ppiped.serve")
    cfg = load_config(args.config)
    meta: dict = {}
    plan, profiles = load_serving(cfg, args.plan, meta)
    for v in refuse_for_serving(plan, profiles):  # served anyway: the data plane copes, but say so
        log.warning("plan-rule-broken", plan=plan.source, violation=str(v))
    server = Server(cfg, plan, profiles)
    v = meta.get("version")
    if type(v) is int and v >= 1:  # the resumed plan keeps its number (status, metrics, log agree)
        server.plan_version = v
    return uvloop.run(server.run())
